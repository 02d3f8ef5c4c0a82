"""One worker's client: a call in flight when a new plan closes the client fails as that worker's error (what
/health and /metrics answer 503 for and poll again), not as a cancellation of the request that asked."""

from __future__ import annotations

import asyncio

import pytest

from deltafin.coordinator.cluster.worker_client import WorkerClient
from deltafin.errors import RemoteError


async def test_a_client_closed_by_a_new_plan_fails_its_calls_in_flight():
    server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)  # accepts, never answers
    port = server.sockets[0].getsockname()[1]
    client = WorkerClient(f"127.0.0.1:{port}", "w")
    try:
        call = asyncio.ensure_future(client.stats())
        await asyncio.sleep(0.05)  # connecting (a server that answers nothing times the attempt out after ~1 s)
        assert not call.done()
        await client.close()
        with pytest.raises(RemoteError, match="replaced by a new plan"):
            await asyncio.wait_for(call, 5)
    finally:
        server.close()
