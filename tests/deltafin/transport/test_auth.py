"""Cluster key, TLS / mutual TLS and the API key, with real worker processes."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import subprocess
from pathlib import Path

import grpc
import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltafin.checkpoint.config import load_config
from deltafin.coordinator.cluster.backend import LocalBackend
from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.http.server import start
from deltafin.errors import AuthError
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.text.tokenizer import K3Tokenizer
from deltafin.transport.auth import Verifier, load_key, sign
from deltafin.transport.generated import deltafin_pb2 as pb
from deltafin.transport.generated import deltafin_pb2_grpc as pb_grpc
from tests.support.cluster import COORDINATOR, workers

KEY = "correct horse battery staple 42"


def test_verifier_accepts_only_fresh_signatures_of_the_key() -> None:
    key = KEY.encode()
    v = Verifier(key)
    md = sign(key, "/deltafin.v1.Worker/Info", now=1000)
    assert v.check("/deltafin.v1.Worker/Info", md, now=1000) is None
    assert "replayed" in v.check("/deltafin.v1.Worker/Info", md, now=1001)  # type: ignore[operator]
    assert "wrong cluster key" in v.check("/deltafin.v1.Worker/Forward", sign(key, "/deltafin.v1.Worker/Info",
                                                                            now=1000), now=1000)
    assert "wrong cluster key" in v.check("/x", sign(b"another key of 16+ bytes", "/x", now=1000), now=1000)
    assert "requires the cluster key" in v.check("/x", (), now=1000)  # type: ignore[operator]
    assert "malformed" in v.check("/x", (("x-deltafin-auth", "v1.abc"),), now=1000)  # type: ignore[operator]
    assert "clocks" in v.check("/x", sign(key, "/x", now=1000), now=1200)  # type: ignore[operator]


def test_key_sources(tmp_path: Path) -> None:
    assert load_key(None, None, env={}) is None
    assert load_key(None, None, env={"DELTAFIN_CLUSTER_KEY": KEY}) == KEY.encode()
    (tmp_path / "k").write_text(KEY + "\n")
    assert load_key("ignored-when-a-file-is-given", str(tmp_path / "k"), env={}) == KEY.encode()
    with pytest.raises(AuthError, match="too short"):
        load_key("short", None, env={})
    with pytest.raises(AuthError, match="cannot read"):
        load_key(None, str(tmp_path / "missing"), env={})


async def _drained(call) -> list:
    return [part async for part in call]


async def _calls(address: str, metadata, credentials: grpc.ChannelCredentials | None = None) -> dict[str, str]:
    """The status of each kind of RPC on `address` with the given metadata."""
    channel = (grpc.aio.secure_channel(address, credentials) if credentials
               else grpc.aio.insecure_channel(address))
    stub = pb_grpc.WorkerStub(channel)
    out = {}
    calls = {"Info": lambda md: stub.Info(pb.InfoRequest(), timeout=10, metadata=md),
             "Stats": lambda md: stub.Stats(pb.StatsRequest(), timeout=10, metadata=md),
             "Release": lambda md: stub.Release(pb.ReleaseRequest(session_ids=["x"]), timeout=10, metadata=md),
             "Forward": lambda md: stub.Forward(pb.ForwardRequest(), timeout=10, metadata=md),
             "RunExperts": lambda md: _drained(stub.RunExperts(pb.ExpertRequest(layer=1), timeout=10, metadata=md))}
    for name, call in calls.items():
        md = metadata(f"/deltafin.v1.Worker/{name}") if callable(metadata) else metadata
        try:
            await call(md)
            out[name] = "OK"
        except grpc.aio.AioRpcError as e:
            out[name] = e.code().name
    try:
        md = metadata("/deltafin.v1.Worker/Assign") if callable(metadata) else metadata
        async for _ in stub.Assign(pb.Assignment(start=0, end=1, model_fingerprint="nope"), timeout=10, metadata=md):
            pass
        out["Assign"] = "OK"
    except grpc.aio.AioRpcError as e:
        out["Assign"] = e.code().name
    health = health_pb2_grpc.HealthStub(channel)
    r = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    out["Health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    await channel.close()
    return out


def test_worker_refuses_calls_without_the_right_key(tiny_dir: Path) -> None:
    with workers(tiny_dir, 1, "--cluster-key", KEY) as (w,):
        none = asyncio.run(_calls(w.address, None))
        wrong = asyncio.run(_calls(w.address, lambda m: sign(b"not the cluster key at all", m)))
        right = asyncio.run(_calls(w.address, lambda m: sign(KEY.encode(), m)))
        refused = {"Info": "UNAUTHENTICATED", "Stats": "UNAUTHENTICATED", "Release": "UNAUTHENTICATED",
                   "Forward": "UNAUTHENTICATED", "RunExperts": "UNAUTHENTICATED", "Assign": "UNAUTHENTICATED",
                   "Health": "SERVING"}
        assert none == refused and wrong == refused  # another worker's expert call too, unless signed
        # with the key every call reaches the servicer (which then judges the request itself)
        assert right == {"Info": "OK", "Stats": "OK", "Release": "OK", "Forward": "FAILED_PRECONDITION",
                         "RunExperts": "FAILED_PRECONDITION", "Assign": "FAILED_PRECONDITION", "Health": "SERVING"}
        cluster = ["--model", str(tiny_dir), "--worker", w.address, "--no-discover", "-q"]
        ok = subprocess.run([*COORDINATOR, *cluster, "--cluster-key", KEY, "generate", "hi", "--max-tokens", "3",
                             "--json"], capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        assert len(json.loads(ok.stdout)["ids"]) == 3
        bad = subprocess.run([*COORDINATOR, *cluster, "--cluster-key", "a wrong key, long enough", "generate", "hi"],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode == 1
        assert "refused this coordinator's credentials" in bad.stderr and "no usable workers" in bad.stderr
        assert "Traceback" not in bad.stderr


def _certs(d: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA."""
    now = datetime.datetime.now(datetime.timezone.utc)

    def make(name: str, issuer_key, issuer_name, key, ca: bool, san=None):
        b = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
             .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    out = {}
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = make("deltafin test CA", ca_key, None, ca_key, True)
    for name, san in [("server", [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), ("client", None)]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = make(name, ca_key, ca.subject, key, False, san)
        out[f"{name}_cert"] = d / f"{name}.pem"
        out[f"{name}_key"] = d / f"{name}.key"
        out[f"{name}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        out[f"{name}_key"].write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                         serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()))
    out["ca"] = d / "ca.pem"
    out["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return out


def test_mutual_tls(tiny_dir: Path, tmp_path: Path) -> None:
    """The coordinator and two workers over mutual TLS with the cluster key; the workers' expert calls to each
    other (wide experts) go over the same TLS, each presenting its own certificate."""
    c = _certs(tmp_path)
    tls = ["--tls-cert", str(c["server_cert"]), "--tls-key", str(c["server_key"]), "--tls-client-ca", str(c["ca"])]
    with workers(tiny_dir, 2, "--cluster-key", KEY, *tls) as (w, w2):
        base = [*COORDINATOR, "--model", str(tiny_dir), "--worker", w.address, "--no-discover", "-q",
                "--cluster-key", KEY]
        client = ["--tls-ca", str(c["ca"]), "--tls-cert", str(c["client_cert"]), "--tls-key", str(c["client_key"])]
        ok = subprocess.run([*base, "--worker", w2.address, *client, "--experts", "wide", "generate", "hi",
                             "--max-tokens", "2", "--json"],
                            capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        assert all(row["calls_served"] > 0 for row in json.loads(ok.stdout)["workers"])  # worker to worker
        ok = subprocess.run([*base, "--worker", w2.address, *client, "--experts", "local", "--hops", "direct",
                             "generate", "hi", "--max-tokens", "2", "--json"],
                            capture_output=True, text=True, timeout=120)
        assert ok.returncode == 0, ok.stderr
        # each forward's states handed from the first stage's worker to the second's, over the same mutual TLS
        rows = sorted(json.loads(ok.stdout)["workers"], key=lambda r: r["layers"])
        assert [(r["handed_on"], r["hand_offs_failed"], r["handed_in"]) for r in rows] == [(2, 0, 0), (0, 0, 2)]
        for name, args in [("no client certificate", ["--tls-ca", str(c["ca"])]), ("plaintext", [])]:
            bad = subprocess.run([*base, *args, "generate", "hi", "--max-tokens", "2"], capture_output=True,
                                 text=True, timeout=120)
            assert bad.returncode == 1 and "no usable workers" in bad.stderr, name
        missing = subprocess.run([*base, "--tls-ca", str(tmp_path / "nope.pem"), "plan"], capture_output=True,
                                 text=True, timeout=60)
        assert missing.returncode == 1 and "cannot read" in missing.stderr


async def test_api_key(tiny_dir: Path) -> None:
    pipe = LocalPipeline.load(tiny_dir, 1, "cpu", "fp32")
    engine = Engine(LocalBackend(pipe), K3Tokenizer.load(tiny_dir), load_config(tiny_dir), "tiny")
    runner, port = await start(engine, "127.0.0.1", 0, api_key="sk-test-123")
    url = f"http://127.0.0.1:{port}"
    try:
        for key in ("unused", "sk-test-12"):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as e:
                await client.models.list()
            assert e.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="sk-test-123", max_retries=0)
        r = await client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
        import aiohttp

        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/health") as h:
                assert h.status == 200
            async with s.get(url + "/metrics") as m:
                assert m.status == 401
    finally:
        await runner.cleanup()
        await engine.close()


def test_coordinator_ignores_announced_workers_it_cannot_authenticate(tiny_dir: Path) -> None:
    with workers(tiny_dir, 1, "--cluster-key", KEY, announce=True, prefix="keyed"):
        base = [*COORDINATOR, "--model", str(tiny_dir), "--interface", "127.0.0.1", "--discover-timeout", "3",
                "--expect", "1"]
        ignored = subprocess.run([*base, "plan"], capture_output=True, text=True, timeout=120)
        assert ignored.returncode == 1
        assert "refused this coordinator's credentials" in ignored.stderr and "no usable workers" in ignored.stderr
        used = subprocess.run([*base, "--cluster-key", KEY, "plan"], capture_output=True, text=True, timeout=120)
        assert used.returncode == 0 and "keyed0" in used.stdout
