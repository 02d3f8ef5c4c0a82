"""Addresses: a worker's HOST:PORT as a user writes it, checked before any lookup; and why a server cannot
listen on an address, in words a user can act on (gRPC only says it failed to bind)."""

from __future__ import annotations

import errno
import ipaddress
import re
import socket

from deltafin.errors import DeltafinError

HOST_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9._-]*[A-Za-z0-9_])?")  # a name or an IPv4 address


def check_address(text: str, flag: str = "--worker") -> str:
    """`text` if it is HOST:PORT (port 1-65535; an IPv6 host in brackets, [::1]:7070), else the one-line error
    saying so: a mistyped address is not sent to the name resolver, whose error would not say what is wrong."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        try:
            known_host = isinstance(ipaddress.ip_address(host[1:-1]), ipaddress.IPv6Address)
        except ValueError:
            known_host = False
    else:
        known_host = HOST_NAME.fullmatch(host) is not None
    if not (sep and known_host and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise DeltafinError(f"{flag} {text!r}: HOST:PORT expected (port 1-65535; IPv6 as [::1]:7070)")
    return text


def cannot_listen(host: str, port: int, what: str, error: OSError | None = None, flag: str = "--port"
                  ) -> DeltafinError:
    """The error for `what` ("this worker", "the API") failing to listen on host:port, after asking the OS why
    (`error`: what the server itself got, if it said)."""
    reason = _reason(host, port) or (error.errno if error is not None else None)
    where = f"{host}:{port}"
    if reason == errno.EADDRINUSE:
        return DeltafinError(f"{where} is already in use by another process (another deltafin-worker or server?): "
                             f"stop it, or start {what} on another port with {flag} PORT ({flag} 0 picks a free one)")
    if reason == errno.EADDRNOTAVAIL or reason == socket.EAI_NONAME:
        return DeltafinError(f"{host} is not an address of this machine: give --host one of its addresses "
                             "(127.0.0.1 for this machine only, 0.0.0.0 for all)")
    if reason == errno.EACCES:
        return DeltafinError(f"{where} needs privileges (ports below 1024 do): use {flag} 1024 or higher")
    return DeltafinError(f"cannot listen on {where}" + (f": {errno.errorcode.get(reason, reason)}" if reason else ""))


def check_free(host: str, port: int, what: str, flag: str = "--port") -> None:
    """Fail now, before minutes of loading, if host:port cannot be listened on."""
    if _reason(host, port) is not None:
        raise cannot_listen(host, port, what, flag=flag)


def _reason(host: str, port: int) -> int | None:
    """The errno a plain bind of host:port gets now (None: it would succeed, the failure was elsewhere)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return e.errno
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and aiohttp bind
        try:
            s.bind(address)
        except OSError as e:
            return e.errno
    return None
