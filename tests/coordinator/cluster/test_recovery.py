"""The replay and the retry logic of ResilientCluster, against a scripted in-process cluster."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.coordinator.cluster import current_plan
from deltafin.coordinator.cluster.backend import Resume
from deltafin.coordinator.cluster.recovery import Recovery, RecoveryOptions, ResilientCluster
from deltafin.coordinator.cluster.worker_client import FORWARD_UNIT, Timeouts, WorkerClient
from deltafin.coordinator.cluster.workers import ClusterSpec
from deltafin.errors import ClusterUnavailable, PartialFailure, RemoteError
from deltafin.runtime.stage_io import SeqInput, SeqOutput


class FlakyStages:
    """Records every forward; fails the calls listed in `fail_at` (by call number) as a lost worker would."""

    max_forward_tokens = None

    def __init__(self, fail_at: set[int], code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        self.calls: list[list[tuple[str, int, list[int]]]] = []
        self.fail_at, self.code = fail_at, code
        self.stages: list = []
        self.workers: list = []  # ClusterBackend's stages and expert holders
        self.resumes: list = []  # the `resume` of every call

    async def forward(self, batch: list[SeqInput], all_logits: bool = False, resume=None, progress=None
                      ) -> list[SeqOutput]:
        n = len(self.calls)
        self.calls.append([(b.session_id, b.cache_len, b.ids.tolist()) for b in batch])
        self.resumes.append(resume)
        if n in self.fail_at:
            e = RemoteError("w1", self.code, "gone")
            e.resume_at = Resume(1, batch)  # type: ignore[attr-defined]  # as ClusterBackend: failed at the second stage
            raise e
        return [SeqOutput(b.session_id, logits=torch.zeros(1, 4)) for b in batch]

    async def release(self, session_ids: list[str], keep_as: list[str] | None = None, keep_lengths=None) -> None:
        pass

    async def close(self) -> None:
        pass


def _cluster(tiny_dir: Path, stages: FlakyStages, **options) -> tuple[ResilientCluster, list[str]]:
    cfg = load_config(tiny_dir)
    rc = ResilientCluster(ClusterSpec(tiny_dir, discover=False), cfg, stages, None,  # type: ignore[arg-type]
                          RecoveryOptions(**{"rejoin_interval": 0, **options}))
    causes: list[str] = []

    async def recover(cause: str, sessions: list[str], retry_hop: bool = False) -> Recovery:  # a re-plan that
        causes.append(cause)  # reloads the stages
        rc.journal.mark_all_stale()
        return Recovery(cause, 0.0, (), True)

    rc.recover = recover  # type: ignore[method-assign]
    return rc, causes


def _step(sid: str, pos: int, ids: list[int]) -> SeqInput:
    return SeqInput(sid, pos, ids=torch.tensor(ids))


async def test_a_lost_worker_replays_the_recorded_chunks_then_retries(tiny_dir: Path) -> None:
    stages = FlakyStages(fail_at={3})
    rc, causes = _cluster(tiny_dir, stages)
    await rc.forward([_step("s", 0, [5, 6, 7])])  # prompt
    await rc.forward([_step("s", 3, [8])])
    await rc.forward([_step("s", 4, [9])])
    await rc.forward([_step("s", 5, [10])])  # call 3 fails: recover, replay, retry
    assert len(causes) == 1 and "UNAVAILABLE" in causes[0]
    assert stages.calls[4:] == [[("s", 0, [5, 6, 7])], [("s", 3, [8])], [("s", 4, [9])], [("s", 5, [10])]]
    assert not rc.journal.stale and list(rc.journal.sessions["s"].ids) == [5, 6, 7, 8, 9, 10]
    await rc.release(["s"])
    assert not rc.journal.sessions and rc.journal.size == 0


async def test_a_session_resumed_from_a_kept_prefix_replays_from_token_0(tiny_dir: Path) -> None:
    """A session kept as a prefix (at release) and one saved mid-prompt (save_at) keep their records; a new
    session resumed from either starts with that record, so after a worker loss it is rebuilt from token 0
    in the original chunks (without the prefix, which the new stage does not have) and then retried."""
    stages = FlakyStages(fail_at={5})
    rc, _ = _cluster(tiny_dir, stages)
    await rc.forward([SeqInput("a", 0, ids=torch.tensor([5, 6, 7]), save_at=((3, "p3"),))])
    await rc.forward([_step("a", 3, [8])])
    await rc.release(["a"], ["p4"])
    assert not rc.journal.sessions and list(rc.journal.prefixes["p4"].ids) == [5, 6, 7, 8]
    assert list(rc.journal.prefixes["p3"].chunks) == [3] and rc.journal.size == 7
    await rc.forward([SeqInput("b", 4, ids=torch.tensor([9, 10]), resume_from="p4")])  # call 2
    await rc.forward([SeqInput("c", 3, ids=torch.tensor([11]), resume_from="p3")])  # call 3
    await rc.forward([_step("b", 6, [12])])  # call 4
    await rc.forward([_step("b", 7, [13])])  # call 5 fails: replay b from token 0, then retry
    assert stages.calls[6:] == [[("b", 0, [5, 6, 7])], [("b", 3, [8])], [("b", 4, [9, 10])], [("b", 6, [12])],
                                [("b", 7, [13])]]
    assert list(rc.journal.sessions["c"].ids) == [5, 6, 7, 11]
    await rc.release(["p3", "p4", "b", "c"])  # dropping prefixes by id forgets their records too
    assert not rc.journal.sessions and not rc.journal.prefixes and rc.journal.size == 0


async def test_errors_that_replay_cannot_fix_fail_the_request(tiny_dir: Path) -> None:
    stages = FlakyStages(fail_at={1}, code=grpc.StatusCode.INVALID_ARGUMENT)
    rc, causes = _cluster(tiny_dir, stages)
    await rc.forward([_step("s", 0, [1, 2])])
    with pytest.raises(RemoteError):
        await rc.forward([_step("s", 2, [3])])
    assert causes == [] and rc.journal.stale == {"s"}  # replayed before its next forward, if there is one


async def test_a_bad_sequence_does_not_fail_its_batch_neighbours(tiny_dir: Path) -> None:
    stages = FlakyStages(fail_at={2, 6}, code=grpc.StatusCode.INVALID_ARGUMENT)
    rc, _ = _cluster(tiny_dir, stages)
    await rc.forward([_step("a", 0, [1])])
    await rc.forward([_step("b", 0, [2])])
    # call 2 (the batch) fails; each is replayed alone (3, 5), then "a" works (4) and "b" fails (6)
    with pytest.raises(PartialFailure) as e:
        await rc.forward([_step("a", 1, [3]), _step("b", 1, [4])])
    ok, bad = e.value.results
    assert isinstance(ok, SeqOutput) and isinstance(bad, RemoteError)


async def test_repeated_losses_give_up_with_a_clear_error(tiny_dir: Path) -> None:
    rc, causes = _cluster(tiny_dir, FlakyStages(fail_at=set(range(100))), max_attempts=2)
    with pytest.raises(ClusterUnavailable, match="giving up after 2 recoveries"):
        await rc.forward([_step("s", 0, [1])])
    assert len(causes) == 2


def test_forward_deadlines_grow_with_their_tokens():
    t = Timeouts(forward=600.0)
    assert t.forward_deadline(1) == t.forward_deadline(FORWARD_UNIT) == 600.0
    assert t.forward_deadline(4 * FORWARD_UNIT) == 2400.0


async def test_a_forward_carries_the_deadline_of_its_tokens():
    """A Forward of 1,536 tokens (two sequences) gets three times the deadline of one 512-token chunk; a
    decode step gets the one-chunk deadline."""
    deadlines = []

    class Stub:
        def ForwardParts(self, requests, timeout, metadata):  # the gRPC method's name
            deadlines.append(timeout)

            class Call:  # a streaming call: its responses, and cancel()
                def __aiter__(self):
                    return self

                async def __anext__(self):
                    raise StopAsyncIteration

                def cancel(self):
                    pass

            return Call()

    client = WorkerClient("127.0.0.1:1", timeouts=Timeouts(forward=100.0))
    client.stub = Stub()
    try:
        await client.forward([_step("a", 0, list(range(1024))), _step("b", 0, list(range(512)))], False, "r")
        await client.forward([_step("a", 1024, [7])], False, "r")
    finally:
        await client.close()
    assert deadlines == [300.0, 100.0]


async def test_recovery_and_rejoin_failures_are_warnings(tiny_dir: Path, caplog, monkeypatch) -> None:
    """A failing membership check and a failing Bonjour browse during recovery are logged at WARNING (not
    hidden at DEBUG), and the loop goes on trying."""
    rc, _ = _cluster(tiny_dir, FlakyStages(fail_at=set()), rejoin_interval=0.01)
    calls = []

    async def lost_stages() -> str:
        calls.append(1)
        raise RuntimeError("probe exploded")

    async def browse_fails(spec, timeout=None):
        raise OSError("mDNS socket closed")

    rc.membership.lost_stages = lost_stages  # type: ignore[method-assign]
    monkeypatch.setattr(current_plan, "discover_addresses", browse_fails)
    rc.spec.discover = True
    with caplog.at_level(logging.WARNING, logger="deltafin.coordinator.cluster"):  # membership.py, current_plan.py
        rc.membership.watch()
        for _ in range(500):  # a loaded 2-core CI box may run the loop late: wait for the retry, up to 10 s
            if len(calls) >= 2:
                break
            await asyncio.sleep(0.02)
        assert await rc.current.discovered() == []
        await rc.close()
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("checking for lost or returning workers failed" in m and "probe exploded" in m for m in messages)
    assert any("Bonjour failed" in m and "mDNS socket closed" in m for m in messages)
    assert len(calls) >= 2  # it kept trying


async def test_a_batch_that_recovery_cannot_fix_is_split(tiny_dir: Path) -> None:
    """A session no stage holds and no journal can rebuild (released, or beyond the journal) fails its batch
    again after the recovery; the batch is then split so that only that sequence fails."""

    class MissingOne(FlakyStages):
        async def forward(self, batch, all_logits=False, resume=None, progress=None):
            self.calls.append([(b.session_id, b.cache_len, b.ids.tolist()) for b in batch])
            if any(b.session_id == "gone" for b in batch):
                raise RemoteError("w1", grpc.StatusCode.NOT_FOUND, "session 'gone' is not on this stage")
            return [SeqOutput(b.session_id, logits=torch.zeros(1, 4)) for b in batch]

    stages = MissingOne(set())
    rc, causes = _cluster(tiny_dir, stages)
    await rc.forward([_step("kept", 0, [1])])
    with pytest.raises(PartialFailure) as e:
        await rc.forward([_step("kept", 1, [2]), _step("gone", 1, [3])])
    ok, bad = e.value.results
    assert isinstance(ok, SeqOutput) and ok.session_id == "kept"
    assert isinstance(bad, ClusterUnavailable)
    assert len(causes) == 1 + rc.options.max_attempts  # one for the batch, then "gone" alone until it gives up
    assert list(rc.journal.sessions["kept"].ids) == [1, 2]


async def test_speculative_forwards_replay_as_they_ran(tiny_dir: Path) -> None:
    """A session that verified drafts and continued from a position inside them is replayed with the same
    forwards (speculative ones included), so the new stages rewind where the old ones did."""
    stages = FlakyStages(fail_at={4})
    rc, _ = _cluster(tiny_dir, stages)
    await rc.forward([_step("s", 0, [5, 6, 7])])
    await rc.forward([SeqInput("s", 3, ids=torch.tensor([8, 9, 10, 11]), speculative=True)])  # 8 + three drafts
    await rc.forward([_step("s", 5, [12])])  # one draft taken (9): continue after it
    await rc.forward([SeqInput("s", 6, ids=torch.tensor([13, 14]), speculative=True)])
    await rc.forward([_step("s", 8, [15])])  # call 4 fails: replay, then retry
    replayed = stages.calls[5:9]
    assert replayed == [[("s", 0, [5, 6, 7])], [("s", 3, [8, 9, 10, 11])], [("s", 5, [12])], [("s", 6, [13, 14])]]
    assert stages.calls[9] == [("s", 8, [15])]
    flags = [c.speculative for c in rc.journal.sessions["s"].forwards()]
    assert flags == [False, True, False, True, False]
    with pytest.raises(ClusterUnavailable, match="cannot be rebuilt"):  # 3 is not a position of the last forward
        rc.journal.stale.add("s")
        await rc.forward([_step("s", 3, [1])])


async def test_a_failed_hop_is_retried_when_the_stages_kept_their_sessions(tiny_dir: Path) -> None:
    """Only an expert holder was lost (the re-plan keeps every stage): the failed forward resumes at the stage that
    failed, with the same inputs; nothing is replayed."""
    stages = FlakyStages(fail_at={2})
    rc, causes = _cluster(tiny_dir, stages)

    async def recover(cause: str, sessions: list[str], retry_hop: bool = False) -> Recovery:
        causes.append(cause)
        assert retry_hop
        return Recovery(cause, 0.0, (), False)

    rc.recover = recover  # type: ignore[method-assign]
    await rc.forward([_step("s", 0, [5, 6, 7])])
    await rc.forward([_step("s", 3, [8])])
    await rc.forward([_step("s", 4, [9])])  # fails at its second stage: retried from there
    assert len(causes) == 1 and len(stages.calls) == 4
    assert stages.resumes[:3] == [None, None, None] and stages.resumes[3].stage == 1
    assert stages.calls[3] == [("s", 4, [9])] and not rc.journal.stale
    assert list(rc.journal.sessions["s"].ids) == [5, 6, 7, 8, 9]


async def test_lost_state_on_unchanged_stages_is_replayed_not_retried(tiny_dir: Path) -> None:
    """A stage that answers but lacks what the step needs (the states the stage before handed it were dropped, a
    session expired: NOT_FOUND) cannot be fixed by retrying that stage, whose stages before have advanced: the
    session is replayed from its record, then the step runs again whole."""
    stages = FlakyStages(fail_at={2}, code=grpc.StatusCode.NOT_FOUND)
    rc, causes = _cluster(tiny_dir, stages)
    retried: list[bool] = []

    async def recover(cause: str, sessions: list[str], retry_hop: bool = False) -> Recovery:
        causes.append(cause)
        retried.append(retry_hop)
        rc.journal.mark_stale(sessions)  # as recovery.recover marks the batch when the stages are unchanged
        return Recovery(cause, 0.0, (), False)

    rc.recover = recover  # type: ignore[method-assign]
    await rc.forward([_step("s", 0, [5, 6, 7])])
    await rc.forward([_step("s", 3, [8])])
    await rc.forward([_step("s", 4, [9])])  # fails with lost state at its second stage
    assert retried == [False] and stages.resumes[3:] == [None, None, None]
    assert stages.calls[3:] == [[("s", 0, [5, 6, 7])], [("s", 3, [8])], [("s", 4, [9])]]
    assert list(rc.journal.sessions["s"].ids) == [5, 6, 7, 8, 9] and not rc.journal.stale


async def test_a_worker_that_stops_answering_is_asked_again_before_the_cluster_plans_without_it(
        tiny_dir: Path, caplog) -> None:
    """A dropped link (a Wi-Fi roam, a re-plugged cable): the plan's worker is asked again until it answers (then
    the recovery goes on with every worker, so the plan stays) or the reconnect timeout passes (then without it);
    meanwhile `reconnecting` says who and for how long (the status endpoint shows it)."""
    rc, _ = _cluster(tiny_dir, FlakyStages(fail_at=set()))
    rc.spec.timeouts = replace(Timeouts(), reconnect=5.0)
    w0, w1 = (SimpleNamespace(address=f"127.0.0.1:{p}", name=n, state="ready") for p, n in ((1, "w0"), (2, "w1")))
    rc.current.backend.workers = [w0, w1]  # type: ignore[attr-defined]
    answers = [[(None, w0)], [(None, w0)], [(None, w0), (None, w1)]]  # w1's link is down for two asks
    seen: list[dict[str, float]] = []

    async def candidates():
        seen.append(dict(rc.reconnecting))
        return answers.pop(0) if len(answers) > 1 else answers[0]

    rc.current.candidates = candidates  # type: ignore[method-assign]
    with caplog.at_level(logging.INFO, logger="deltafin.coordinator.cluster"):
        t0 = asyncio.get_running_loop().time()
        got = await rc._answering()
    assert [d.name for _, d in got] == ["w0", "w1"] and rc.reconnecting == {}
    assert list(seen[2]) == ["w1"] and 0.9 <= asyncio.get_running_loop().time() - t0 < 3.0  # two asks 0.5 s apart
    messages = [r.getMessage() for r in caplog.records]
    assert any("w1 does not answer: asking again for up to 5 s" in m for m in messages)
    assert any("w1 answers again after" in m for m in messages)

    restarted = SimpleNamespace(address=w1.address, name="w1", state="idle")  # back, but without its stage
    answers[:] = [[(None, w0), (None, restarted)]]
    t0 = asyncio.get_running_loop().time()
    assert len(await rc._answering()) == 2 and asyncio.get_running_loop().time() - t0 < 0.4  # not waited for

    answers[:] = [[(None, w0)]]  # w1 gone for good: given up on after the timeout
    rc.spec.timeouts = replace(Timeouts(), reconnect=1.0)
    got = await rc._answering()
    assert [d.name for _, d in got] == ["w0"] and rc.reconnecting == {}
    assert any("w1 did not answer for 1.0 s: planning without" in r.getMessage() for r in caplog.records)
