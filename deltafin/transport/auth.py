"""Cluster authentication (a shared key, HMAC per call) and TLS credentials for the worker's gRPC.

Every call from the coordinator carries `x-deltafin-auth: v1.<unix time>.<nonce>.<hmac>` where the HMAC
(SHA-256, keyed with the cluster key) covers the method name, the time and the nonce. The worker checks
it in constant time, accepts times within ±`WINDOW` seconds, and refuses a (time, nonce) it has already
seen, so a captured header cannot be replayed. The header does not cover the message body: on a network
where someone could alter traffic, add TLS (`--tls-cert/--tls-key`, and `--tls-client-ca` for mutual TLS),
which gives integrity and confidentiality; the key then still decides who may drive the worker.

The standard gRPC health service is left open (it says only SERVING or not) so probes need no key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from deltafin.errors import AuthError

HEADER = "x-deltafin-auth"
ENV_KEY = "DELTAFIN_CLUSTER_KEY"
WINDOW = 60.0  # seconds of clock difference tolerated between coordinator and worker
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)
MIN_KEY_BYTES = 16


def load_key(key: str | None, key_file: str | None, env: dict[str, str] | None = None) -> bytes | None:
    """The cluster key from --cluster-key, --cluster-key-file or $DELTAFIN_CLUSTER_KEY (in that order)."""
    env = os.environ if env is None else env
    if key_file:
        try:
            text = Path(key_file).read_text().strip()
        except OSError as e:
            raise AuthError(f"cannot read the cluster key file {key_file}: {e.strerror or e}") from None
    else:
        text = (key if key is not None else env.get(ENV_KEY, "")).strip()
    if not text:
        return None
    if len(text.encode()) < MIN_KEY_BYTES:
        raise AuthError(f"the cluster key is too short ({len(text.encode())} bytes): use at least {MIN_KEY_BYTES}, "
                        "e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    return text.encode()


def _mac(key: bytes, method: str, stamp: str, nonce: str) -> str:
    return hmac.new(key, f"{method}\n{stamp}\n{nonce}".encode(), hashlib.sha256).hexdigest()


def sign(key: bytes, method: str, now: float | None = None) -> tuple[tuple[str, str], ...]:
    """Call metadata proving the caller holds `key`."""
    stamp = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(12)
    return ((HEADER, f"v1.{stamp}.{nonce}.{_mac(key, method, stamp, nonce)}"),)


class Verifier:
    def __init__(self, key: bytes, window: float = WINDOW, max_nonces: int = 100_000):
        self.key, self.window, self.max_nonces = key, window, max_nonces
        self.seen: OrderedDict[str, float] = OrderedDict()  # nonce -> its time

    def check(self, method: str, metadata: Any, now: float | None = None) -> str | None:
        """None if the call is authentic, else why not (for the UNAUTHENTICATED message)."""
        now = time.time() if now is None else now
        value = next((v for k, v in (metadata or ()) if k == HEADER), None)
        if value is None:
            return "this worker requires the cluster key (set --cluster-key on the coordinator)"
        if isinstance(value, bytes):
            value = value.decode("ascii", "replace")
        parts = value.split(".")
        if len(parts) != 4 or parts[0] != "v1" or not parts[1].isdigit() or len(parts[1]) > 12:
            return "malformed authentication header"
        _, stamp, nonce, mac = parts
        if not hmac.compare_digest(_mac(self.key, method, stamp, nonce), mac):
            return "wrong cluster key"
        if abs(now - int(stamp)) > self.window:
            return f"authentication time is {now - int(stamp):+.0f}s off (are the clocks in sync?)"
        while self.seen and next(iter(self.seen.values())) < now - 2 * self.window:
            self.seen.popitem(last=False)
        if nonce in self.seen:
            return "replayed authentication header"
        self.seen[nonce] = float(stamp)
        while len(self.seen) > self.max_nonces:
            self.seen.popitem(last=False)
        return None


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call without a valid header, before the servicer sees it."""

    def __init__(self, key: bytes):
        self.verifier = Verifier(key)
        self.refused = 0

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        if method.startswith(OPEN_PREFIXES):
            return await continuation(details)
        why = self.verifier.check(method, details.invocation_metadata)
        if why is None:
            return await continuation(details)
        self.refused += 1
        handler = await continuation(details)
        return _refusal(handler, why)


def _refusal(handler: Any, why: str) -> Any:
    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
        yield  # pragma: no cover - an async generator that never yields

    if handler is None:
        return None
    # the request is never parsed (None: its bytes as they came): garbage from an unknown caller costs nothing
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(stream, None, handler.response_serializer)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream, None, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(unary, None, handler.response_serializer)


# ---- TLS --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerTls:
    cert: str
    key: str
    client_ca: str | None = None  # require client certificates signed by this CA (mutual TLS)

    def credentials(self) -> grpc.ServerCredentials:
        pair = [(_read(self.key), _read(self.cert))]
        if self.client_ca:
            return grpc.ssl_server_credentials(pair, root_certificates=_read(self.client_ca),
                                               require_client_auth=True)
        return grpc.ssl_server_credentials(pair)


@dataclass(frozen=True)
class ClientTls:
    ca: str | None = None  # the CA that signed the workers' certificates (default: the system's roots)
    cert: str | None = None  # this coordinator's certificate, for workers that require mutual TLS
    key: str | None = None
    server_name: str | None = None  # expected name in the workers' certificates, if not their address

    def credentials(self) -> grpc.ChannelCredentials:
        if (self.cert is None) != (self.key is None):
            raise AuthError("--tls-cert and --tls-key go together")
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca) if self.ca else None,
                                            private_key=_read(self.key) if self.key else None,
                                            certificate_chain=_read(self.cert) if self.cert else None)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise AuthError(f"cannot read {path}: {e.strerror or e}") from None


@dataclass(frozen=True)
class ClusterSecurity:
    """What the coordinator presents to workers."""

    key: bytes | None = None
    tls: ClientTls | None = None

    def metadata(self, method: str) -> tuple[tuple[str, str], ...] | None:
        return sign(self.key, method) if self.key is not None else None

    def channel(self, address: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
        """A channel to `address`: over TLS when there is TLS (its options added), else in the clear."""
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=options)
        return grpc.aio.secure_channel(address, self.tls.credentials(), options=options + self.tls.options())
