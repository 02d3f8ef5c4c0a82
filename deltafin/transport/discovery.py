"""Bonjour (zeroconf) announce and browse of `_deltafin._tcp.local.` workers.

A worker's TXT record carries what the coordinator needs to plan before it connects: protocol version,
device, memory budget, measured disk bandwidth, model fingerprint, and the layer ranges on its disk.
`interfaces` restricts multicast (tests and benchmarks use ["127.0.0.1"]).
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
import time
import uuid

import ifaddr
from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf

from deltafin.transport.protocol import PROTOCOL_VERSION, version_gap
from deltafin.transport.worker_info import WorkerDescription

log = logging.getLogger(__name__)

SERVICE_TYPE = "_deltafin._tcp.local."


def txt_record(d: WorkerDescription) -> dict[str, str]:
    return {
        "v": str(d.protocol_version),
        "name": d.name,
        "dev": d.device,
        "mem": str(d.memory_bytes),
        "bw": f"{d.disk_gbps:.3f}",
        "fp": d.model_fingerprint,
        "layers": ",".join(f"{a}-{b}" for a, b in d.layers),
        "top": "1" if d.has_top else "0",
        "ver": d.version,
        "hmem": str(d.host_memory_bytes),
        "id": d.worker_id,
        "experts": ",".join(f"{a}-{b}" for a, b in d.expert_ranges),
        "ebw": f"{d.expert_speed:.3f}",
        "disks": str(d.expert_disks),
        **({"dmg": "; ".join(d.damaged)[:200]} if d.damaged else {}),  # (a TXT string holds 255 bytes)
    }


def parse_txt(props: dict[bytes, bytes | None], address: str) -> WorkerDescription:
    """A TXT record back into a description; ValueError when it is not a Deltafin worker's."""
    p = {k.decode(): (v or b"").decode() for k, v in props.items()}
    layers = _ranges(p.get("layers", ""))
    experts = _ranges(p["experts"]) if "experts" in p else None
    return WorkerDescription(
        name=p["name"], address=address, device=p.get("dev", "?"), memory_bytes=int(p.get("mem", "0")),
        disk_gbps=float(p.get("bw", "0")), model_fingerprint=p.get("fp", ""),
        layers=layers,  # type: ignore[arg-type]
        has_top=p.get("top") == "1", protocol_version=int(p.get("v", "0")), version=p.get("ver", ""),
        host_memory_bytes=int(p.get("hmem", "0")), worker_id=p.get("id", ""), expert_layers=experts,
        expert_gbps=float(p.get("ebw", "0")), expert_disks=int(p.get("disks", "1")),
        damaged=tuple(x for x in p.get("dmg", "").split("; ") if x))


def _ranges(text: str) -> tuple[tuple[int, int], ...]:
    ranges = tuple(tuple(int(x) for x in r.split("-")) for r in text.split(",") if r)
    if any(len(r) != 2 for r in ranges):
        raise ValueError(f"bad layer ranges {text!r}")
    return ranges  # type: ignore[return-value]


# macOS interfaces that multicast DNS should leave alone: Apple's peer-to-peer Wi-Fi (awdl, llw) and VPN
# tunnels (utun): announcing there keeps the radio busy and reaches no worker
_DARWIN_SKIP = ("awdl", "llw", "utun", "lo")


def interface_addresses() -> list[str]:
    """This machine's IPv4 addresses but loopback's (a worker listening on all of them is reached at each)."""
    return [ip.ip for a in ifaddr.get_adapters() for ip in a.ips
            if isinstance(ip.ip, str) and not ip.ip.startswith("127.")]


def default_interfaces() -> list[str] | None:
    """Interfaces to use when none are named: every one (None), but on macOS the IPv4 addresses of the real
    interfaces only (Wi-Fi, Ethernet, the Thunderbolt bridge)."""
    if sys.platform != "darwin":
        return None

    return [ip.ip for a in ifaddr.get_adapters() if not a.nice_name.startswith(_DARWIN_SKIP)
            for ip in a.ips if isinstance(ip.ip, str)] or None


def _zeroconf(interfaces: list[str] | None) -> Zeroconf:
    interfaces = interfaces or default_interfaces()
    if interfaces:
        return Zeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
    return Zeroconf(ip_version=IPVersion.V4Only)


class Announcer:
    """Registers a worker's service; `close()` withdraws it (goodbye packets)."""

    def __init__(self, d: WorkerDescription, host: str, port: int, interfaces: list[str] | None = None):
        self.zc = _zeroconf(interfaces)
        safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in d.name) or "worker"
        address = host if host not in ("0.0.0.0", "") else _primary_address()
        self.info = ServiceInfo(SERVICE_TYPE, f"{safe}.{SERVICE_TYPE}", addresses=[socket.inet_aton(address)],
                                port=port, properties=txt_record(d), server=f"{safe}.local.")
        self.zc.register_service(self.info, allow_name_change=True)
        log.info("announced %s at %s:%d", self.info.name, address, port)

    def close(self) -> None:
        try:
            self.zc.unregister_service(self.info)
        finally:
            self.zc.close()


def browse(timeout: float = 3.0, interfaces: list[str] | None = None,
           expect: int | None = None) -> list[WorkerDescription]:
    """Workers that answer within `timeout` seconds (sooner once `expect` of them have)."""
    zc = _zeroconf(interfaces)
    found: dict[str, WorkerDescription] = {}
    lock = threading.Lock()

    class Listener(ServiceListener):
        def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            info = zc.get_service_info(type_, name, timeout=int(timeout * 1000))
            if info is None or not info.parsed_addresses():
                return
            try:
                d = parse_txt(info.properties, f"{info.parsed_addresses()[0]}:{info.port}")
            except (KeyError, ValueError) as e:
                log.warning("ignoring %s: not a Deltafin worker announcement (%s)", name, e)
                return
            with lock:
                found[name] = d

        update_service = add_service

        def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
            with lock:
                found.pop(name, None)

    browser = ServiceBrowser(zc, SERVICE_TYPE, Listener())
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with lock:
                if expect is not None and len(found) >= expect:
                    break
            time.sleep(0.05)
    finally:
        browser.cancel()
        zc.close()
    workers = sorted(found.values(), key=lambda d: d.name)
    for d in workers:
        if d.protocol_version != PROTOCOL_VERSION:
            log.warning("ignoring %s", version_gap(d.name, d.protocol_version, "this process"))
    return [d for d in workers if d.protocol_version == PROTOCOL_VERSION]


def _primary_address() -> str:
    """The address other machines reach this one at (no packet is sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


LOCAL_NETWORK = ("System Settings › Privacy & Security › Local Network, on for the app that runs it (Terminal, "
                 "iTerm, your IDE: macOS blocks Bonjour for an app without it and says nothing)")
CHECK_TYPE = "_deltafin-check._tcp.local."  # doctor's own announcement: no coordinator takes it for a worker


def nobody_answered(timeout: float, platform: str | None = None) -> str:
    """Why discovery may find no worker, and what to do: the causes that are silent, named for this platform."""
    blocked = (f"on a Mac, Bonjour works only with {LOCAL_NETWORK}, on this Mac and on each worker's"
               if (platform or sys.platform) == "darwin" else
               "the workers' announcements may not reach this machine (a firewall, or a network such as guest "
               "Wi-Fi that drops multicast; on a Mac the worker's app also needs " + LOCAL_NETWORK + ")")
    return (f"no workers: none answered on Bonjour within {timeout:.0f}s and none was named with --worker "
            f"HOST:PORT. If they run, {blocked}; `deltafin doctor` checks that this machine hears its own "
            "announcement; or name them with --worker HOST:PORT. To run on this machine alone, add --local (or use "
            "`deltafin serve` / `deltafin chat --local`); to use other machines, start `deltafin-worker --model "
            "...` on each")


def hears_itself(interfaces: list[str] | None = None, timeout: float = 5.0) -> bool:
    """Whether this machine sees its own Bonjour announcement within `timeout` seconds (a check service, announced
    and browsed for on `interfaces` as a worker and a coordinator would, then withdrawn)."""
    zc = _zeroconf(interfaces)
    name = f"check-{uuid.uuid4().hex[:12]}.{CHECK_TYPE}"
    address = interfaces[0] if interfaces else _primary_address()
    info = ServiceInfo(CHECK_TYPE, name, addresses=[socket.inet_aton(address)], port=9,
                       server=f"{name.split('.')[0]}.local.")
    heard = threading.Event()

    class Listener(ServiceListener):
        def add_service(self, zc: Zeroconf, type_: str, seen: str) -> None:
            if seen == name:
                heard.set()

        def update_service(self, zc: Zeroconf, type_: str, seen: str) -> None:
            self.add_service(zc, type_, seen)

        def remove_service(self, zc: Zeroconf, type_: str, seen: str) -> None:
            pass

    try:
        zc.register_service(info)
        browser = ServiceBrowser(zc, CHECK_TYPE, Listener())
        try:
            return heard.wait(timeout)
        finally:
            browser.cancel()
    finally:
        try:
            zc.unregister_service(info)
        finally:
            zc.close()
