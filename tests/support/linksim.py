"""A link between two machines, simulated on loopback: the stand-in for `../shared/tools/linkproxy` where a checkout
has no `../shared` beside it (tests/support/links.py picks it then), with the same command line and output.

    python tests/support/linksim.py --rtt-ms MS --mbps MBIT [--shared-mbps MBIT] --listen PORT --to HOST:PORT
        [--listen ... --to ...]

Each pair accepts connections on 127.0.0.1:PORT and forwards them to HOST:PORT. Each direction of each connection
delivers a chunk half a round trip after it was read, in order, and paces the chunks to MBIT megabits a second (0:
no cap) with a 64 KiB burst. It holds at most WINDOW bytes a direction in flight, so a sender that outruns the link
waits as it would on TCP. With --shared-mbps every direction of every connection of every pair also draws on that
one rate, as the stations of one Wi-Fi channel share its airtime. Prints `linkproxy: 127.0.0.1:PORT -> HOST:PORT`
once listening; on SIGTERM or SIGINT, `linkproxy: 127.0.0.1:PORT carried N bytes to, M back` for each pair, then
exits. Standard library only.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

CHUNK = 64 * 1024
BURST = 64 * 1024
WINDOW = 4 * 1024 * 1024


class Medium:
    """A rate every direction of every connection draws on (--shared-mbps): one Wi-Fi channel's airtime."""

    def __init__(self, rate_bps: float):
        self.rate, self.free_at = rate_bps, 0.0

    def through(self, nbytes: int) -> float:
        """When `nbytes` handed to the medium now are through it, after what it was given before."""
        self.free_at = max(self.free_at, time.monotonic() - BURST / self.rate) + nbytes / self.rate
        return self.free_at


class Direction:
    """One direction of one connection: read, hold for half a round trip, pace, write; bytes counted in `carried`."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float, rate_bps: float,
                 carried: dict[str, int], key: str, medium: Medium | None = None):
        self.reader, self.writer, self.delay, self.rate = reader, writer, delay_s, rate_bps
        self.carried, self.key, self.medium = carried, key, medium
        self.queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(maxsize=max(1, WINDOW // CHUNK))

    async def run(self) -> None:
        await asyncio.gather(self._read(), self._write())

    async def _read(self) -> None:
        try:
            while data := await self.reader.read(CHUNK):
                await self.queue.put((time.monotonic(), data))
        except (ConnectionError, OSError):
            pass
        await self.queue.put((time.monotonic(), b""))  # the end

    async def _write(self) -> None:
        free_at = 0.0  # when the link has sent what it was given so far
        try:
            while True:
                read_at, data = await self.queue.get()
                due = read_at + self.delay
                if self.rate > 0 and data:
                    free_at = max(free_at, time.monotonic() - BURST / self.rate) + len(data) / self.rate
                    due = max(due, free_at)
                if self.medium is not None and data:
                    due = max(due, self.medium.through(len(data)))
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if not data:
                    if self.writer.can_write_eof():
                        self.writer.write_eof()
                    return
                self.writer.write(data)
                await self.writer.drain()
                self.carried[self.key] += len(data)
        except (ConnectionError, OSError):
            return


async def _serve(port: int, target: str, delay_s: float, rate_bps: float, carried: dict[str, int],
                 medium: Medium | None) -> asyncio.Server:
    host, _, target_port = target.rpartition(":")

    async def connected(c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter) -> None:
        try:
            t_reader, t_writer = await asyncio.open_connection(host.strip("[]"), int(target_port))
        except OSError:
            c_writer.close()
            return
        try:
            await asyncio.gather(Direction(c_reader, t_writer, delay_s, rate_bps, carried, "to", medium).run(),
                                 Direction(t_reader, c_writer, delay_s, rate_bps, carried, "back", medium).run())
        finally:
            for w in (c_writer, t_writer):
                w.close()

    return await asyncio.start_server(connected, "127.0.0.1", port)


async def main(args: argparse.Namespace) -> None:
    if len(args.listen) != len(args.to):
        raise SystemExit("linksim: give one --to for each --listen")
    delay_s, rate_bps = args.rtt_ms / 2e3, args.mbps * 1e6 / 8
    counts = [{"to": 0, "back": 0} for _ in args.listen]
    medium = Medium(args.shared_mbps * 1e6 / 8) if args.shared_mbps > 0 else None
    servers = [await _serve(p, t, delay_s, rate_bps, c, medium)
               for p, t, c in zip(args.listen, args.to, counts, strict=True)]
    for port, target in zip(args.listen, args.to, strict=True):
        print(f"linkproxy: 127.0.0.1:{port} -> {target} (rtt {args.rtt_ms} ms, {args.mbps or 'no cap'} Mbit/s)",
              flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for server in servers:
        server.close()
    for port, c in zip(args.listen, counts, strict=True):
        print(f"linkproxy: 127.0.0.1:{port} carried {c['to']:,} bytes to, {c['back']:,} back", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="linksim", description=__doc__.splitlines()[0])
    p.add_argument("--rtt-ms", type=float, default=0.0)
    p.add_argument("--mbps", type=float, default=0.0, help="megabits a second each way (0: no cap)")
    p.add_argument("--shared-mbps", type=float, default=0.0,
                   help="megabits a second that every pair's traffic, both ways, shares (0: none)")
    p.add_argument("--listen", type=int, action="append", default=[])
    p.add_argument("--to", action="append", default=[])
    return p.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
