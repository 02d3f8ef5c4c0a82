"""A cluster of simulated Macs behind simulated links: one worker process per Mac (each under its own `disklimit` and
`memlimit`, as in cluster_bench.py), each reached through `../shared/tools/linkproxy` with a link kind's round trip
and bandwidth (deltafin/plan/cluster/links.py PROFILES: each link its own; `wifi-shared`: one rate for every link, as on
one Wi-Fi channel; `--scale-to RATE` scales the bandwidth by RATE over a Mac's 6.6 GB/s SSD, so that the links keep
their
ratio to the disks), and this process as the coordinator, reaching every worker through the proxies (and so do the
workers each other, with wide experts). For each profile: the plan's mode and its prediction, a prompt's prefill
seconds, the seconds per decoded token, the greedy ids and the bytes each link carried each way. Prints one JSON
object. `--flap 1,3,10` runs each profile again with the last worker's link dropped that many seconds `--flap-after`
seconds into the generation (its proxy killed, then listening again): the ids, the added seconds, and whether the
cluster re-planned (it should not below --reconnect-timeout).

    python -m tests.system.link_bench --model K3SLICE --workers 2 --profiles loopback,wifi,1gbe --scale-to 250M \\
        --disk-rate 250M --memlimit-gb 6 --memory-gb 5.5 --prompt-tokens 819 --tokens 4 --pin -- --spine int8
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import threading
import time

import torch

import deltafin
from deltafin.checkpoint.config import load_config
from deltafin.paths import model_path
from deltafin.plan.cluster.links import PROFILES, Link
from deltafin.plan.timing.predict import prefill_seconds
from deltafin.runtime.worker_stats import StageStats
from tests.support.cluster import WorkerProcess, split_at_dashes
from tests.support.links import slow_links
from tests.system.cluster_bench import _caps

MAC_SSD = 6.6e9  # bytes a second a Mac's SSD reads (docs/PERF.md): what --scale-to scales the links by


SHARED = "-shared"  # a profile's name with this after it: every link on one medium of that rate (one Wi-Fi channel)


def profile_link(name: str, scale: float) -> tuple[float, float]:
    """(rtt ms, Mbit/s) of a profile, its bandwidth scaled ("loopback": no delay, no cap; "4ms": that round trip,
    no cap; "wifi-shared": wifi's, every link sharing it)."""
    name = name.removesuffix(SHARED)
    if name == "loopback":
        return 0.0, 0.0
    if name.endswith("ms"):
        return float(name[:-2]), 0.0
    link: Link = PROFILES[name]
    return link.rtt_s * 1e3, link.up_bps * 8 / 1e6 * scale


def _pinned(i: int, pin: bool) -> tuple[str, ...]:
    """Worker `i` on a core of its own (`--pin`): a simulated Mac computes on its own chip, so what its compute
    probe measured at start is what it has while the others compute too (the coordinator shares the cores)."""
    cores = sorted(os.sched_getaffinity(0))
    return ("taskset", "-c", str(cores[i % len(cores)])) if pin and shutil.which("taskset") else ()


def _rate(text: str) -> float:
    unit = {"K": 1e3, "M": 1e6, "G": 1e9}.get(text[-1].upper(), 1.0)
    return float(text.rstrip("KkMmGg")) * unit


def run(args: argparse.Namespace, name: str, options: dict, flap: float = 0.0) -> dict:
    cfg = load_config(args.model)
    rtt_ms, mbps = profile_link(name, _rate(args.scale_to) / MAC_SSD if args.scale_to else 1.0)
    prefix = _caps(args.disk_rate, args.memlimit_gb)
    gbps = str(_rate(args.disk_rate) / 1e9)
    procs = [WorkerProcess(args.model, f"w{i}", "--disk-gbps", gbps, *args.worker_args, memory_gb=args.memory_gb,
                           prefix=prefix + _pinned(i, args.pin)) for i in range(args.workers)]
    ids = (torch.arange(args.prompt_tokens) * 7919 % (cfg.vocab_size - 1000) + 500).tolist()
    try:
        addresses = [p.wait_ready(timeout=900) for p in procs]
        shared = mbps if name.endswith(SHARED) else 0.0
        with slow_links(addresses, rtt_ms, mbps, shared) as proxy, deltafin.connect(
                args.model, proxy.addresses, discover=False, progress=False, **options) as model:
            plan = model.engine.backend.plan
            timer = threading.Timer(args.flap_after, proxy.drop, (len(procs) - 1, flap)) if flap else None
            t0 = time.monotonic()
            if timer is not None:
                timer.start()
            out = model.generate(ids, max_tokens=args.tokens)
            wall = time.monotonic() - t0
            stats = model.stats()
            recoveries = [{"seconds": round(r.seconds, 2), "replanned": r.replanned, "cause": r.cause[:120]}
                          for r in getattr(model.engine.backend, "recoveries", [])]
        probes = [plan.links.to_workers.values(), plan.links.pairs.values()]
        probed = {a: sum(v.probe_bytes for group in probes for v in group if v.address == a) for a in proxy.addresses}
        carried = {f"w{i}": {"to": c.to, "back": c.back, "probes": probed[via]}
                   for i, (a, via) in enumerate(zip(addresses, proxy.addresses, strict=True))
                   if (c := proxy.carried.get(a)) is not None}
    finally:
        for p in procs:
            p.stop()
    predicted = prefill_seconds(cfg, plan, args.prompt_tokens)
    return {"profile": name, "rtt_ms": rtt_ms, "mbit_s": round(mbps, 2) or None, "shared": name.endswith(SHARED),
            "capped": bool(prefix),
            "flap_s": flap or None, "recoveries": recoveries,
            "experts": "wide" if plan.wide else "local", "why": plan.mode_why,
            "prefill_s": round(out.timing.prefill_s, 2), "s_per_token": round(out.timing.decode_s /
                                                                              max(1, out.timing.decode_steps), 3),
            "wall_s": round(wall, 1), "ids": list(out.token_ids), "text": out.text,
            # each link's bytes, both ways; "probes": what measuring the links moved over it
            "link_bytes": carried, "stages": [_stage_seconds(s) for s in stats],
            "request_bytes": None if flap else sum(c["to"] + c["back"] - c["probes"] for c in carried.values()),
            # (a dropped link's proxy starts its count again)
            "predicted": {"prefill_s": round(predicted.total, 2), "prefill_disk_s": round(predicted.disk, 2),
                          "prefill_link_s": round(predicted.link, 2), "prefill_compute_s": round(predicted.compute, 2),
                          "s_per_token": round(plan.token.total, 3) if plan.token else None}}


def _stage_seconds(stats: StageStats) -> dict:
    """Where a stage's (or holder's) time went: its forwards' seconds, computing, waiting on its disk and on the
    other holders."""
    own = stats.as_dict()
    wide = own["wide"] or {}
    return {**{k: v for k, v in own.items() if k in ("name", "layers", "forwards", "tokens", "seconds")
               or k.endswith("_s")}, **{k: v for k, v in wide.items() if k.endswith("_s")}}


def main(argv: list[str] | None = None) -> int:
    argv, extra = split_at_dashes(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(prog="python -m tests.system.link_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=model_path, required=True, help="a model directory or name (k3-mini)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--profiles", default="loopback,wifi",
                   help=f"link kinds, comma-separated: loopback, {', '.join(PROFILES)}, or a bare round trip such as "
                        f"10ms; a kind with {SHARED} after it (wifi{SHARED}) puts every link on one medium of its "
                        "rate, as one Wi-Fi channel is (default loopback,wifi)")
    p.add_argument("--scale-to", default="", metavar="RATE",
                   help="scale the links' bandwidth to disks of RATE a second (e.g. 250M: the disklimit rate)")
    p.add_argument("--disk-rate", default="250M", help="each worker's disk read cap (default 250M)")
    p.add_argument("--memory-gb", type=float, default=5.5, help="each worker's --memory-gb (default 5.5)")
    p.add_argument("--memlimit-gb", type=float, default=6.0, help="each worker's memory cap, page cache included")
    p.add_argument("--prompt-tokens", type=int, default=819)
    p.add_argument("--tokens", type=int, default=4, help="tokens to generate (default 4)")
    p.add_argument("--experts", default="auto", help="the coordinator's --experts (default auto)")
    p.add_argument("--pin", action="store_true",
                   help="each worker on a core of its own (taskset), as each Mac computes on its own chip")
    p.add_argument("--flap", default="", metavar="SECONDS",
                   help="also run each profile with the last worker's link down this long, comma-separated (1,3,10)")
    p.add_argument("--flap-after", type=float, default=5.0, help="seconds into the generation the link drops")
    p.add_argument("--worker-arg", dest="worker_args", action="append", default=[],
                   help="an argument for every worker (repeatable)")
    args = p.parse_args(argv)
    for name in args.profiles.split(","):
        kind = name.removesuffix(SHARED)
        if kind != "loopback" and kind not in PROFILES and not re.fullmatch(r"\d+(\.\d+)?ms", kind):
            p.error(f"unknown link profile {name!r}: loopback, {', '.join(PROFILES)}, or a round trip such as 10ms, "
                    f"each with {SHARED} after it or not")
        if args.flap and name.endswith(SHARED):
            p.error(f"--flap drops one worker's link: {name} has one medium for all")
    options = {"experts": args.experts, **_keywords(extra)}
    runs = []
    drops = [float(s) for s in args.flap.split(",") if s]
    flaps = [0.0, *drops, 0.0] if drops else [0.0]  # with drops, the run without one also last: the first warms up
    for name in args.profiles.split(","):
        mine = [run(args, name, options, flap) for flap in flaps]
        base = min((r for r in mine if not r["flap_s"]), key=lambda r: r["wall_s"])
        for r in mine:
            if r["flap_s"]:  # against the same profile's (faster) run without the drop
                r.update(same_ids=r["ids"] == base["ids"], added_s=round(r["wall_s"] - base["wall_s"], 1))
            print(json.dumps({k: r.get(k) for k in ("profile", "flap_s", "experts", "prefill_s", "s_per_token",
                                                     "wall_s", "same_ids", "added_s", "recoveries", "request_bytes",
                                                     "predicted")}), file=sys.stderr, flush=True)
        runs += mine
    print(json.dumps({"model": str(args.model), "workers": args.workers, "disk_rate": args.disk_rate,
                      "pinned": args.pin, "scale_to": args.scale_to or None, "runs": runs}, indent=1))
    return 0


def _keywords(extra: list[str]) -> dict:
    """The coordinator's flags after `--` as the Python API's keywords (`--spine int8` -> spine="int8")."""
    out, i = {}, 0
    while i < len(extra):
        name = extra[i].lstrip("-").replace("-", "_")
        if i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            value: object = extra[i + 1]
            out[name] = float(value) if name.endswith("_gb") else int(value) if str(value).isdigit() else value
            i += 2
        else:
            out[name] = True
            i += 1
    return out


if __name__ == "__main__":
    sys.exit(main())
