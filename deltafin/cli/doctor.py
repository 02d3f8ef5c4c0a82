"""`deltafin doctor`: one table of checks, each ✔ or ✘ (⚠ where it works, but slowly) with the fix: Python, torch
and the backend (the device, its kernels, a small matmul against the CPU's), memory and the plan it allows, the
model (config, tokenizer, every shard against its header; `--full` reads every byte and checks the Hub's sha256
where the download recorded it), the disk's read speed for streaming, free disk for the cache, Bonjour and the
API's port, the cluster key and TLS files. The exit status is 1 when a check fails."""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.manifest import recorded_sha256
from deltafin.checkpoint.shards import id_ranges, scan_checkpoint
from deltafin.errors import DeltafinError
from deltafin.formats import converted_spines
from deltafin.paths import BUNDLED, bundled_model, cache_dir
from deltafin.text.tokenizer import K3Tokenizer

OK, WARN, FAIL = "ok", "warn", "fail"
MARK = {OK: "✔", WARN: "⚠", FAIL: "✘"}
SLOW_DISK_GBPS = 1.0  # below this, streaming K3's 25.8 GB of experts a token takes over 25 s
API_PORT = 8000  # the HTTP API's default (deltafin serve)
MEASURABLE_BYTES = 10**9  # experts to time the disk on: fewer would sit in caches and time the memory


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    detail: str
    fix: str = ""


def run_checks(model: str | None, full: bool, device: str, security: dict[str, str | None],
               interfaces: list[str] | None = None) -> list[Check]:
    """Every check, in order; one that breaks is a failed check with its error, never a traceback."""
    checks: list[Check] = []
    steps: list[tuple[str, Callable[[], list[Check]]]] = [
        ("python", _python), ("backend", lambda: _backend(device)), ("memory", lambda: _memory(model, device))]
    if model is not None:
        steps += [("model", lambda: _model(model, full)), ("disk", lambda: _disk(model))]
    steps += [("cache disk", lambda: _cache_room(model)), ("network", lambda: _network(interfaces)),
              ("security", lambda: _security(security))]
    for name, step in steps:
        try:
            checks += step()
        except Exception as e:  # a check that cannot run says why (the error names what to fix)
            checks.append(Check(name, FAIL, str(e) if isinstance(e, DeltafinError) else f"{type(e).__name__}: {e}"))
    return checks


def _python() -> list[Check]:
    v = sys.version_info
    ok = v >= (3, 10)
    return [Check("python", OK if ok else FAIL, f"{platform.python_version()} ({sys.executable})",
                  "" if ok else "Deltafin needs Python 3.10 or newer")]


def _backend(device: str) -> list[Check]:
    import torch  # lazily: `deltafin --help` does not load torch

    from deltafin.devices import resolve_device  # (lazily: torch)
    from deltafin.kernels.linear import fast_path  # (lazily: torch)

    out = [Check("torch", OK, f"{torch.__version__}")]
    dev = resolve_device(device)
    out.append(Check("device", OK, f"{dev} (--device {device})"))
    fast = fast_path(dev.type)
    name = getattr(fast, "isa", type(fast).__name__) if fast is not None else None
    out.append(Check("kernels", OK if fast is not None else WARN, name or "the torch reference only",
                     "" if fast is not None else "the fast kernels failed to build or to pass their self-check (run "
                     "with -v for why); on Linux install a C compiler (gcc)"))
    if dev.type != "cpu":
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(8, 256, generator=g), torch.randn(256, 256, generator=g)
        got = (x.to(dev) @ w.to(dev)).cpu()
        rel = float((got - x @ w).norm() / (x @ w).norm())
        out.append(Check("matmul", OK if rel < 1e-3 else FAIL, f"{dev} against the CPU: relative error {rel:.1e}",
                         "" if rel < 1e-3 else "the device computes wrongly: update its driver, or --device cpu"))
    if sys.platform == "darwin" and platform.machine() == "arm64":
        try:
            import mlx.core as mx  # lazily: MLX exists on Apple silicon only

            out.append(Check("mlx", OK, f"{mx.__version__} ({mx.default_device()})"))
        except ImportError:
            out.append(Check("mlx", WARN, "not installed: the routed experts run on MPS, slower",
                             "pip install mlx"))
    return out


def _memory(model: str | None, device: str) -> list[Check]:
    from deltafin.cli.inspection import memory_plan, plan_lines  # (lazily: torch)
    from deltafin.devices import resolve_device  # (lazily: torch)
    from deltafin.runtime.stage_options import StageOptions, with_memory_found  # (lazily)

    dev = resolve_device(device)
    budget = with_memory_found(StageOptions(), dev).memory_bytes or 0
    out = [Check("memory", OK, f"{budget / 1e9:.1f} GB usable on {dev}")]
    if model is not None:
        plan = memory_plan(load_config(model), budget, dev.type)
        first = plan_lines(plan, load_config(model).num_layers)[0]
        out.append(Check("plan", FAIL if "error" in plan else OK, first.removeprefix("memory plan: "),
                         "more memory, or more workers (deltafin-worker on other machines)" if "error" in plan
                         else ""))
    return out


def _model(model: str, full: bool) -> list[Check]:
    cfg = load_config(model)
    out = [Check("config", OK, f"{cfg.model_type}, {cfg.num_layers} layers, {cfg.num_experts} experts a layer")]
    tok = K3Tokenizer.load(model)
    out.append(Check("tokenizer", OK, f"{tok.vocab_size:,} tokens"))
    ckpt = scan_checkpoint(model, cfg)
    damaged = [p for p in ckpt.problems if p.damage]
    held = ckpt.layers_available()
    if damaged:
        out += [Check("shards", FAIL, p.message, "copy or download the file again (`deltafin download SOURCE`)")
                for p in damaged]
    else:
        out.append(Check("shards", OK, f"{len(ckpt.shard_sizes)} files, every one as long as its header says; "
                                       f"layers {id_ranges(held)} of {cfg.num_layers}"
                                       + ("" if ckpt.top_available else ", no embedding/head")))
    if full:
        out += _every_byte(Path(model), sorted(ckpt.shard_sizes))
    return out


def _every_byte(model: Path, files: list[str]) -> list[Check]:
    """Every shard read to its end (an unreadable sector fails here, not mid-request), and its sha256 checked
    where the download recorded the Hub's."""
    hashes, bad, read = recorded_sha256(model), [], 0
    for name in files:
        h = hashlib.sha256()
        try:
            with open(model / name, "rb") as f:
                while chunk := f.read(64 << 20):
                    h.update(chunk)
                    read += len(chunk)
        except OSError as e:
            bad.append(Check("bytes", FAIL, f"{name}: unreadable ({e.strerror or e})", "the disk is failing: copy "
                             "the model elsewhere, or download it again"))
            continue
        want = hashes.get(name)
        if want is not None and h.hexdigest() != want:
            bad.append(Check("sha256", FAIL, f"{name}: sha256 {h.hexdigest()[:16]}..., the Hub's {want[:16]}...",
                             "download it again (`deltafin download SOURCE`)"))
    checked = sum(name in hashes for name in files)
    return bad or [Check("bytes", OK, f"{read / 1e9:.2f} GB read, every shard to its end; {checked} of {len(files)} "
                                      "checked against the Hub's sha256")]


def _disk(model: str) -> list[Check]:
    from deltafin.weights.diskspeed import measure_disk  # (lazily: torch)

    ckpt = scan_checkpoint(model, load_config(model))
    cfg = ckpt.config
    experts = sum(cfg.is_moe(i) for i in ckpt.layers_available()) * cfg.num_experts * cfg.bytes_per_expert
    if experts < MEASURABLE_BYTES:
        return [Check("disk", OK, f"not measured: the model's experts ({experts / 1e6:.0f} MB) are too few to time "
                      "the disk (`deltafin bench --disk DIR` on a larger model's folder does)")]
    gbps = measure_disk(ckpt, 8, "direct")
    per_token = ckpt.config.expert_bytes_per_token() / 1e9
    slow = gbps < SLOW_DISK_GBPS
    return [Check("disk", WARN if slow else OK, f"{gbps:.2f} GB/s whole-expert reads ({per_token:.1f} GB of experts a "
                  f"token: {per_token / gbps:.1f} s at no cache hits)",
                  "a faster disk (an internal NVMe SSD), or more machines (wide experts read from every disk)"
                  if slow else "")]


def _cache_room(model: str | None) -> list[Check]:
    """Free space in the cache directory for the kept prefixes a stage of `model` (else of `deltafin serve`'s
    model, k3-mini) writes by default, and with --model a q4 spine."""
    from deltafin.plan.memory.kept_prefixes import default_prefix_disk_bytes  # (lazily: torch)
    from deltafin.plan.memory.sizing import Placement  # (lazily: torch)
    from deltafin.plan.memory.sizing_options import SizingOptions  # (lazily: torch)

    root = cache_dir()
    probe = root if root.exists() else next(p for p in root.parents if p.exists())
    free = shutil.disk_usage(probe).free
    cfg = load_config(model or bundled_model())
    need = default_prefix_disk_bytes(cfg, SizingOptions().context, Placement("cpu").act_bytes)
    what = f"{need / 1e9:.2f} GB of kept prefixes (--prefix-disk-gb's default for {Path(model or BUNDLED).name})"
    if model is not None:
        from deltafin.plan.memory.layer_table import layer_table  # (lazily: torch)

        smallest = converted_spines()[0]  # --model: the spine in the fewest bytes (q4)
        spine = layer_table(cfg, Placement("cpu")).resident(smallest)[-1]
        need, what = need + spine, f"a {smallest} spine ({spine / 1e9:.1f} GB) and {what}"
    ok = free >= need
    return [Check("cache disk", OK if ok else WARN, f"{free / 1e9:.1f} GB free in {root} for {what}",
                  "" if ok else "free space there, or point $DELTAFIN_CACHE at a larger disk (or --prefix-disk-gb "
                  "less)")]


def _network(interfaces: list[str] | None) -> list[Check]:
    from deltafin.transport.discovery import LOCAL_NETWORK, hears_itself, interface_addresses  # lazily: zeroconf
    from deltafin.transport.ports import check_free  # (lazily, with zeroconf)

    where = ", ".join(interfaces) if interfaces else "every interface"
    ours = ["127.0.0.1", *interface_addresses()]
    strangers = [i for i in interfaces or () if i not in ours]
    if strangers:
        return [Check("bonjour", FAIL, f"--interface {', '.join(strangers)}: not an address of this machine",
                      f"give one of {', '.join(ours)}, or no --interface (every one)")]
    if hears_itself(interfaces):
        out = [Check("bonjour", OK, f"this machine hears its own announcement ({where})")]
    else:
        fix = (f"{LOCAL_NETWORK}; then run doctor again" if sys.platform == "darwin" else
               "let multicast DNS (UDP 5353) through the firewall, or use a network that carries it")
        out = [Check("bonjour", FAIL, f"this machine did not hear its own Bonjour announcement ({where}): workers "
                     "and coordinators will not find each other", f"{fix}; or name workers with --worker HOST:PORT")]
    try:
        check_free("127.0.0.1", API_PORT, "the API")
        out.append(Check("port", OK, f"{API_PORT} is free for `deltafin serve`"))
    except DeltafinError as e:
        out.append(Check("port", WARN, str(e), f"`deltafin serve --port PORT` (another port), or stop what holds "
                         f"{API_PORT}"))
    return out


def _security(given: dict[str, str | None]) -> list[Check]:
    from deltafin.transport.auth import ENV_KEY, ServerTls, load_key  # (lazily: grpc)

    out = []
    if given.get("cluster_key_file") or os.environ.get(ENV_KEY):
        key = load_key(None, given.get("cluster_key_file"))
        out.append(Check("cluster key", OK, f"{len(key or b'')} bytes"))
    if given.get("tls_cert") or given.get("tls_key"):
        if not (given.get("tls_cert") and given.get("tls_key")):
            return [*out, Check("tls", FAIL, "--tls-cert and --tls-key go together", "give both")]
        ServerTls(given["tls_cert"], given["tls_key"]).credentials()  # type: ignore[arg-type]
        out.append(Check("tls", OK, f"{given['tls_cert']} and its key load"))
    return out


def report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{MARK[c.status]} {c.name:<{width}}  {c.detail}")
        if c.fix:
            lines.append(f"  {'':<{width}}  fix: {c.fix}")
    return "\n".join(lines)


def _cmd_doctor(args: argparse.Namespace) -> int:
    if args.verbose < 1:  # the checks' own findings are the output; the libraries' info lines are not
        logging.getLogger("deltafin").setLevel(logging.WARNING)
    security = {k: getattr(args, k) for k in ("cluster_key_file", "tls_cert", "tls_key")}
    checks = run_checks(args.model, args.full, args.device, security, args.interface)
    print(json.dumps([asdict(c) for c in checks], indent=1) if args.json else report(checks))
    return 1 if any(c.status == FAIL for c in checks) else 0


def add_doctor_command(sub: argparse._SubParsersAction, model_arg: Callable[[str], str], model_help: str) -> None:
    p = sub.add_parser("doctor", help="check this machine, the model and the setup; say what to fix",
                       description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--model", type=model_arg, default=None, help=model_help)
    p.add_argument("--full", action="store_true", help="read every byte of the model's shards (and check the Hub's "
                   "sha256 where the download recorded it)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "mps"])
    p.add_argument("--cluster-key-file", default=None, help="check this cluster key file")
    p.add_argument("--tls-cert", default=None, help="check this certificate (with --tls-key)")
    p.add_argument("--tls-key", default=None)
    p.add_argument("--interface", action="append", default=None, help="check Bonjour on this interface address "
                   "(repeatable; default: every one, as a worker announces)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_doctor)

