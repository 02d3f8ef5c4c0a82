"""The repository's own promises: CI runs exactly the README's test command, and the README's figures for
defaults and K3's sizes are the code's (computed here from the code and the real K3 config, not copied)."""

from __future__ import annotations

import argparse
import math
import re
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the README and the docs it links


def _docs() -> str:
    return "\n".join(p.read_text() for p in DOCS)


README = " ".join(_docs().split())  # one line: a figure may wrap anywhere


@pytest.mark.parametrize("doc", ["deploy/README.md", *(str(p.relative_to(ROOT)) for p in DOCS)])
def test_the_readmes_name_no_file_a_clone_lacks(doc: str) -> None:
    """Every path a document names relative to itself is in the repository (the README once named ../shared/, the
    workspace around the clone), and every link it makes leads to a file."""
    text, here = (ROOT / doc).read_text(), (ROOT / doc).parent
    outside = [t for t in re.findall(r"\.\./[\w./-]+", text) if not (here / t).resolve().is_relative_to(ROOT)]
    assert outside == []
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("#")]
    assert [t for t in links if not (here / t.split("#")[0]).exists()] == []


def test_the_docs_name_only_files_the_repository_has() -> None:
    """Every path into the project's own folders that a document names (a test file, a module) exists: a doc once
    cited a test file that never did."""
    named = re.findall(r"\b((?:deltafin|coordinator|worker|tests|tools|deploy|proto)/[\w/.-]*\.(?:py|md|proto|c|json))",
                       _docs() + (ROOT / "deploy" / "README.md").read_text())
    assert named and sorted({p for p in named if not (ROOT / p).exists()}) == []


def test_the_readme_says_how_its_commands_are_found() -> None:
    """After the set-up line the README's commands are bare (`deltafin serve`): it says to activate the environment
    they were installed into, or to prefix them, before the first."""
    readme = (ROOT / "README.md").read_text()
    first_bare = readme.index("`deltafin serve`")
    assert "source .venv/bin/activate" in readme[:first_bare] and ".venv/bin/" in readme[:first_bare]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)\n```", readme, re.S)
    assert len(blocks) >= 2, "README must show the install/demo command and the test command"
    test_command = blocks[1].strip()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in [line.strip() for line in ci]
    assert "pip install -q torch==2.13.0" in "\n".join(ci)


def _defaults() -> list[str]:
    from deltafin.cli.flags import add_cluster_options, add_stage_options
    from deltafin.cli.worker import build_parser as worker_parser
    from deltafin.coordinator.http.openai_api import COMPLETION_MAX_TOKENS
    from deltafin.coordinator.http.request import MAX_STOP_STRINGS
    from deltafin.coordinator.http.server import HEARTBEAT_S
    from deltafin.kernels.blocks import WEIGHT_BLOCK_VALUES
    from deltafin.models.pieces import MLA_BLOCK_BYTES, MLA_BLOCK_TOKENS, PIECE_TOKENS
    from deltafin.plan.memory.forward_workspace import FORWARD_SHARE
    from deltafin.plan.memory.kept_prefixes import GRID_MIN, KEPT_ON_DISK, PREFIX_DISK_BYTES
    from deltafin.plan.memory.sizing import RUNTIME_OVERHEAD
    from deltafin.plan.memory.sizing_options import (
        BASE_CONTEXT,
        ONE_USER_CONTEXT,
        ONE_USER_SEQUENCES,
        SEQUENCES,
        SPECULATIVE_TOKENS,
    )
    from deltafin.runtime.memory import MARGIN
    from deltafin.text.chat import SERVING_MAX_TOKENS
    from deltafin.text.drafting import Calibration, DraftLength, FittedCost, NgramDrafter, default_cost
    from deltafin.transport.protocol import DEFAULT_MAX_MESSAGE
    from deltafin.weights.reader import CHUNK

    stage, cluster = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_stage_options(stage)
    add_cluster_options(cluster)
    worker = worker_parser()
    s, c = stage.get_default, cluster.get_default
    ngrams = list(range(NgramDrafter.max_ngram, NgramDrafter.min_ngram - 1, -1))
    return [
        f"`--sequences N` is the sequences the plan keeps caches for ({ONE_USER_SEQUENCES} on one worker, "
        f"{SEQUENCES} on each stage of a cluster;",
        f"holds, whichever is less: the plan is made for {BASE_CONTEXT:,} tokens a sequence, {ONE_USER_CONTEXT:,} for "
        "one worker's one conversation, then its context grows",
        "`--prefill-chunk N` is the most tokens one forward carries (default: where the experts stream through a "
        f"cache of the stage's own, {PIECE_TOKENS} beside the cache and a prompt's forward as long as the memory "
        "holds with the cache lent to it, up to the context; else the planned context if its workspace fits "
        f"{FORWARD_SHARE:.0%} of the budget",
        f"`--prefix-disk-gb G` (default: room for {KEPT_ON_DISK} of the model's kept states at `--max-context` "
        f"tokens, {BASE_CONTEXT} at most, at most {PREFIX_DISK_BYTES / 1e9:g} GB",
        f"forward longer than {PIECE_TOKENS} tokens runs each layer's attention {PIECE_TOKENS} tokens at a time",
        f"and {RUNTIME_OVERHEAD >> 30} GiB for the runtime",
        f"grown in {MLA_BLOCK_TOKENS}-token blocks",
        f"keeps {MARGIN['host']:.0%} ({MARGIN['discrete']:.0%} of a GPU) free",
        f"(split in {CHUNK >> 20} MiB pieces)",
        f"by {s('read_threads')} reader threads",
        f"so {s('cache_policy').upper()} is the default",
        f"`--worker-timeout`, {c('worker_timeout'):g} s)",
        f"within `--worker-timeout` ({c('worker_timeout'):g} s)",
        f"A forward has {c('forward_timeout'):g} s per 512 tokens",
        f"`--session-ttl` ({worker.get_default('session_ttl'):g} s)",
        f"(`--max-message-mb`, {DEFAULT_MAX_MESSAGE >> 30} GiB)",
        f"at most {c('replay_journal_tokens') * 4 >> 20} MiB in all by default",
        f"`--default-max-tokens` ({SERVING_MAX_TOKENS})",
        f"text completions without it get {COMPLETION_MAX_TOKENS}",
        f"`stop` (up to {MAX_STOP_STRINGS} strings",
        f"sends an SSE comment every {HEARTBEAT_S:g} s",
        f"never denser than every {GRID_MIN:,} tokens",
        f"`MLA_BLOCK_BYTES`, {MLA_BLOCK_BYTES >> 20} MiB",
        f"every {DraftLength.probe_every}th step probes with one draft",
        f"only a draft it is sure of: p ≥ {DraftLength.probe_sure:g})",
        f"a decaying count starting at {DraftLength.prior})",
        "in slices of half a bit of −log2(1 − p)" if Calibration().edge(2) == 0.5 else "(the slices changed)",
        f"the last {', '.join(map(str, ngrams[:-1]))} or {ngrams[-1]} tokens",
        "the prior splits a one-token pass half and half"
        if (cost := default_cost(896, 16)).fixed == cost.per_expert * 16 else "(the cost model's split changed)",
        f"the plan's two ends counting as {FittedCost.prior_weight:g} passes each",
        f"bf16 converted in {WEIGHT_BLOCK_VALUES * 4 >> 20} MiB row blocks",
        f"a forward verifies at most {SPECULATIVE_TOKENS} tokens",
    ]


@pytest.mark.parametrize("figure", _defaults())
def test_the_readmes_defaults_are_the_codes(figure: str) -> None:
    assert figure in README, f"README does not say: {figure}"


def _k3_figures(tmp: Path) -> list[str]:
    from deltafin.checkpoint.config import LayerKind, load_config
    from deltafin.plan.memory.layer_table import layer_table
    from deltafin.plan.memory.sizing_options import SPECULATIVE_TOKENS, Placement
    from deltafin.plan.memory.stage_parts import (
        boundary_bytes_per_token,
        kda_state_bytes,
        kda_trail_bytes,
        mla_row_bytes,
        top_bytes,
    )

    shutil.copy(ROOT / "tests" / "data" / "kimi-k3-config.json", tmp / "config.json")
    cfg = load_config(tmp)
    moe, k = len(cfg.moe_layers), cfg.experts_per_token
    specs = [s for i in range(cfg.num_layers) for s in cfg.layer_tensor_specs(i)] + list(cfg.top_tensor_specs())
    spine_bytes, spine_params = sum(s.nbytes for s in specs), sum(math.prod(s.shape) for s in specs)
    expert_params = sum(math.prod(s.shape) for s in cfg.expert_tensor_specs(1, 0) if s.name.endswith("packed")) * 2
    all_experts = cfg.num_experts * moe * cfg.bytes_per_expert
    total_params = spine_params + cfg.num_experts * moe * expert_params
    active = spine_params + k * moe * expert_params
    cpu = Placement("cpu")
    table = layer_table(cfg, cpu)
    n_kda = sum(kind is LayerKind.KDA for kind in cfg.layer_kinds)
    wire = lambda layer: boundary_bytes_per_token(cfg, layer, 4) / 1e3
    return [
        f"{total_params / 1e12:.1f}T-parameter",
        f"{cfg.num_layers} layers: {n_kda} Kimi Delta Attention + {cfg.num_layers - n_kda} NoPE MLA, "
        f"{cfg.num_experts} MXFP4 experts per layer with {k} active",
        f"{(spine_bytes + all_experts) / 1e12:.2f} TB on disk, {all_experts / 1e12:.2f} TB of it experts",
        f"{k} of {cfg.num_experts} experts in each of {moe} MoE layers: {k} × {cfg.bytes_per_expert / 1e6:.1f} MB × "
        f"{moe} = **{cfg.expert_bytes_per_token() / 1e9:.1f} GB of expert bytes per token**",
        f"~{spine_params / 1e9:.0f}B dense parameters ({spine_bytes / 1e9:.0f} GB bf16, "
        f"~{table.resident('int8')[-1] / 1e9:.0f} GB as row-int8)",
        f"(KDA {kda_state_bytes(cfg) * n_kda / 1e9:.2f} GB per sequence at K3 width, "
        f"MLA {mla_row_bytes(cfg, 1)} values per token per layer",
        f"2 × {active / 1e9:.0f}B active parameters = {2 * active / 1e12:.2f} TFLOP per token",
        f"{wire(0):.1f} KB (l = 0) to {wire(cfg.num_layers - 1):.0f} KB (l = {cfg.num_layers - 1}); "
        f"{wire(46):.0f} KB for a two-Mac split at layer 46",
        f"that trail is {kda_trail_bytes(cfg) * n_kda / 1e9:.2f} GB per speculating sequence for a "
        f"{SPECULATIVE_TOKENS}-token pass over {n_kda} KDA layers",
        f"the {all_experts / 1e9:,.0f} GB of experts",
        "K3's spine (layers, embedding and head) takes " + ", ".join(
            f"{(table.resident(spine)[-1] + top_bytes(cfg, cpu, spine, True, True)) / 1e9:.1f} GB as {spine}"
            for spine in ("bf16", "int8", "q4")),
    ]


def test_the_readmes_k3_figures_are_the_codes(tmp_path: Path) -> None:
    missing = [f for f in _k3_figures(tmp_path) if f not in README]
    assert not missing, "README does not say:\n" + "\n".join(missing)


# the projection for Macs: the planner's MPS plans at a Mac's budget, SSD and compute (docs/PERF.md's M1 Max: 400 GB/s
# of unified memory, 10 TFLOP/s), at an assumed streaming efficiency
MAC_SSD_GBPS, MAC_MEMORY_GBPS, MAC_TFLOPS, EFFICIENCY = 6.6, 400.0, 10.0, 0.85
MACS = (("1 × 64 GB (56 GB budget)", 1, 56), ("2 × 64 GB", 2, 56), ("4 × 64 GB", 4, 56),
        ("2 × 128 GB (112 GB budgets)", 2, 112))


def _mac_compute(cfg):
    from deltafin.plan.cluster.compute import assumed_gpu
    return assumed_gpu(cfg, MAC_MEMORY_GBPS, MAC_TFLOPS)


def _mac_workers(cfg, n: int, budget_gb: int) -> list:
    from deltafin.plan.cluster.cluster_plan import WorkerCapacity

    return [WorkerCapacity(f"mac{i}", budget_gb * 10**9, MAC_SSD_GBPS, ((0, cfg.num_layers),), True, device="mps",
                           worker_id=str(i), compute=_mac_compute(cfg)) for i in range(n)]


def _mac_projection(cfg) -> list[str]:
    """Each cluster's rows, per link kind between its Macs (plan/cluster/links.py PROFILES): the experts `--experts
    auto` chooses for that link (plan/modes.py), what a token reads, its time (disks and links, over the assumed
    efficiency; the compute as assumed) and a 4K prompt's first token, at the defaults."""
    from deltafin.plan.cluster.links import PROFILES, Links
    from deltafin.plan.memory.sizing import SizingInput
    from deltafin.plan.modes import choose_mode

    rows = []
    for label, n, budget_gb in MACS:
        for kind in PROFILES if n > 1 else ("—",):
            links = Links(assumed=PROFILES[kind]) if n > 1 else Links()
            plan = choose_mode(cfg, _mac_workers(cfg, n, budget_gb), SizingInput(), 4, "auto", links)
            stages = [s.plan for s in plan.workers]
            resident = sum(len(z.resident_layers) for z in stages)
            read = sum(z.expert_bytes_per_token for z in stages) / 1e9
            spine = sum(z.spine_bytes_per_token for z in stages) / 1e9
            seconds = plan.seconds_per_token / EFFICIENCY
            prompt = dict(plan.first_token)[4096].total / EFFICIENCY
            what = f"{stages[0].spine} spine, {resident} of {cfg.num_layers} layers resident"
            each = f" ({max(z.expert_bytes_per_token for z in stages) / 1e9:.1f} a Mac)" if plan.wide else ""
            experts = ("wide" if plan.wide else "local") if n > 1 else "—"
            rows.append(f"| {label} | {kind} | {experts} | {what} | {read:.1f} + {spine:.1f} = {read + spine:.1f}"
                        f"{each} | {seconds:.2f} s | {1 / seconds:.3f} | {prompt / 60:.1f} min |")
    return rows


def _long_prompt_projection(cfg) -> list[str]:
    """The first token of 1K to 64K prompts on each cluster (Thunderbolt between Macs), at the defaults; a prompt
    the default context refuses, with the plan `--max-context` that long makes (what `plan` prints: outlook.py). The
    one projection of a prompt's first token: docs/serving.md points here."""
    from deltafin.plan.cluster.links import PROFILES, Links
    from deltafin.plan.memory.sizing import SizingInput
    from deltafin.plan.modes import choose_mode
    from deltafin.plan.timing.predict import PROMPT_LENGTHS, prompt_forward

    rows = []
    for label, n, budget_gb in MACS:
        workers, links = _mac_workers(cfg, n, budget_gb), Links(assumed=PROFILES["thunderbolt"]) if n > 1 else Links()
        plan = choose_mode(cfg, workers, SizingInput(), 4, "auto", links)
        longest = choose_mode(cfg, workers, SizingInput(context=max(PROMPT_LENGTHS)), 4, "auto", links)
        cells = []
        for length in PROMPT_LENGTHS:
            p = plan if length <= plan.context else longest
            cells.append(f"{dict(p.first_token)[length].total / EFFICIENCY / 60:.1f} min"
                         + ("" if p is plan else " ‡"))
        rows.append(f"| {label} | {plan.context:,} | {prompt_forward(plan):,} | {' | '.join(cells)} | "
                    f"{prompt_forward(longest):,} | {plan.seconds_per_token / EFFICIENCY:.2f} s / "
                    f"{longest.seconds_per_token / EFFICIENCY:.2f} s |")
    return rows


def test_the_docs_long_prompt_projection_is_the_planners(tmp_path: Path) -> None:
    from deltafin.checkpoint.config import load_config

    shutil.copy(ROOT / "tests" / "data" / "kimi-k3-config.json", tmp_path / "config.json")
    rows = _long_prompt_projection(load_config(tmp_path))
    missing = [r for r in rows if r not in _docs().splitlines()]
    assert not missing, "the docs' long-prompt projection lacks these rows:\n" + "\n".join(missing)


def test_the_readmes_mac_projection_is_the_planners(tmp_path: Path) -> None:
    from deltafin.checkpoint.config import load_config

    shutil.copy(ROOT / "tests" / "data" / "kimi-k3-config.json", tmp_path / "config.json")
    rows = _mac_projection(load_config(tmp_path))
    missing = [r for r in rows if r not in _docs().splitlines()]
    assert not missing, "README's projection table lacks these rows:\n" + "\n".join(missing)


def _speculative_projection(cfg, lines: list[str]) -> list[str]:
    """The drafting table for one 64 GB Mac: its MPS plan with --speculative (room for every sequence's trail),
    that plan's fixed spine and experts, the experts a pass of k drafts reads as measured on the k3-slice (the
    README's row) and under a uniform router, the best k."""
    from deltafin.plan.cluster.cluster_plan import WorkerCapacity
    from deltafin.plan.memory.sizing import SizingInput
    from deltafin.plan.memory.sizing_options import SPECULATIVE_TOKENS
    from deltafin.plan.planner import plan_layers
    from deltafin.text.drafting import chain_tokens, distinct_experts

    mac = WorkerCapacity("mac", 56 * 10**9, MAC_SSD_GBPS, ((0, cfg.num_layers),), True, device="mps")
    (stage,) = plan_layers(cfg, [mac], SizingInput(speculative_tokens=SPECULATIVE_TOKENS)).stages
    (plain,) = plan_layers(cfg, [mac]).stages
    spine, experts = stage.plan.spine_bytes_per_token / 1e9, stage.plan.expert_bytes_per_token / 1e9
    one_pass = (spine + experts) / MAC_SSD_GBPS / EFFICIENCY
    plain_pass = (plain.plan.spine_bytes_per_token + plain.plan.expert_bytes_per_token) / 1e9 / MAC_SSD_GBPS \
        / EFFICIENCY
    header = (f"the trails' room, {(stage.plan.sessions - plain.plan.sessions) / 1e9:.2f} GB for "
              f"{stage.plan.sequences} sequence{'s' if stage.plan.sequences != 1 else ''}, costs "
              f"{(lost := len(plain.plan.resident_layers) - len(stage.plan.resident_layers))} resident "
              f"layer{'s' if lost != 1 else ''}, so "
              f"{spine:.1f} GB of spine streamed and {experts:.1f} GB of experts per one-token pass, 6.6 GB/s at the "
              f"assumed 0.85 efficiency: {one_pass:.1f} s a token, {1 / one_pass:.3f} tok/s, against "
              f"{1 / plain_pass:.3f} without drafting")
    (measured,) = [[float(x) for x in line.strip("|").split("|")[1:]] for line in lines
                   if line.startswith("| × one token's experts |")]
    uniform = [distinct_experts(k + 1, cfg.num_experts, cfg.experts_per_token) / cfg.experts_per_token
               for k in range(len(measured))]

    def best(a: float, growth: list[float]) -> tuple[float, int, float, float]:
        return max((chain_tokens([a] * k) / s, k, chain_tokens([a] * k), s) for k, s in
                   enumerate((spine + experts * g) / MAC_SSD_GBPS / EFFICIENCY for g in growth))

    rows = [header]
    for a in (0.3, 0.5, 0.51, 0.7, 0.74, 0.77, 0.8, 0.9):  # 0.51, 0.74, 0.77: the published heads (the doc says)
        m, u = best(a, measured), best(a, uniform)
        rows.append(f"| {a} | {m[1]} ({u[1]}) | {m[2]:.1f} ({u[2]:.1f}) | {m[3]:.1f} ({u[3]:.1f}) | "
                    f"{m[0]:.3f} ({u[0]:.3f}) |")
    return rows


def test_the_readmes_speculative_projection_is_the_cost_model(tmp_path: Path) -> None:
    from deltafin.checkpoint.config import load_config

    shutil.copy(ROOT / "tests" / "data" / "kimi-k3-config.json", tmp_path / "config.json")
    lines = _docs().splitlines()
    header, *rows = _speculative_projection(load_config(tmp_path), lines)
    missing = [r for r in rows if r not in lines] + ([header] if header not in README else [])
    assert not missing, "README's drafting projection lacks these rows:\n" + "\n".join(missing)


def test_the_readmes_cpu_plans_are_the_planners(tmp_path: Path) -> None:
    """The `plan` command's output in the README (real workers, CPU placement) is what the planner gives now, for
    the sequences `serve` plans for (its --max-active)."""
    from deltafin.checkpoint.config import load_config
    from deltafin.coordinator.engine.serving_options import ServingOptions
    from deltafin.plan.cluster.cluster_plan import WorkerCapacity
    from deltafin.plan.memory.sizing import SizingInput
    from deltafin.plan.planner import plan_layers

    shutil.copy(ROOT / "tests" / "data" / "kimi-k3-config.json", tmp_path / "config.json")
    cfg = load_config(tmp_path)
    text = _docs()
    blocks = re.findall(r"^# (\d+) x (\d+) GB .*?\n(.*?)\ntotal +([^\n]*)", text, re.M | re.S)
    assert len(blocks) == 4, "README's four plan tables"
    for n, budget_gb, rows, total in blocks:
        workers = [WorkerCapacity(f"mac{i + 1}", int(budget_gb) * 10**9, MAC_SSD_GBPS, ((0, cfg.num_layers),),
                                  True, worker_id=str(i)) for i in range(int(n))]
        experts = "wide" if int(n) > 1 else "local"  # the command's default (--experts auto)
        options = SizingInput(sequences=ServingOptions().max_active)
        table = plan_layers(cfg, workers, options, experts=experts).table().splitlines()
        shown = [[t for t in row.split() if not t.startswith("127.0.0.1:")] for row in rows.splitlines()[1:]]
        body = [row.split() for row in table[1:] if row.startswith(("mac", "total"))]
        assert shown + [["total", *total.split()]] == body, (n, budget_gb)


def _mode_planned(cfg, mode: str) -> tuple[float, float, float]:
    """Full K3's tok/s at the defaults in `mode` on one 64 GB Mac and on four (Thunderbolt between them), and on four
    with the spine row-int8 (`--spine int8`)."""
    from deltafin.expert_modes import parse
    from deltafin.plan.cluster.links import PROFILES, Links
    from deltafin.plan.memory.sizing import SizingInput
    from deltafin.plan.memory.sizing_options import expert_read_share
    from deltafin.plan.modes import choose_mode

    out = []
    for n, spine in ((1, "auto"), (4, "auto"), (4, "int8")):
        links = Links(assumed=PROFILES["thunderbolt"]) if n > 1 else Links()
        sizing = SizingInput(spine=spine, expert_read_share=expert_read_share(cfg, parse(mode)))
        plan = choose_mode(cfg, _mac_workers(cfg, n, 56), sizing, 4, "auto", links)
        out.append(EFFICIENCY / plan.seconds_per_token)
    return out[0], out[1], out[2]


def test_the_expert_modes_table_is_the_benchs_and_the_planners(tmp_path: Path) -> None:
    """docs/expert-modes.md's frontier: a row for every registered mode; each top-p mode's measured reads are the
    share the planner prices it at (expert_modes.TOP_P_READS); the planned tok/s are the planner's."""
    from deltafin.checkpoint.config import load_config
    from deltafin.expert_modes import parse, read_share
    from deltafin.plan.memory.sizing_options import mode_presets

    shutil.copy(ROOT / "tests" / "data" / "kimi-k3-config.json", tmp_path / "config.json")
    cfg = load_config(tmp_path)
    text = (ROOT / "docs" / "expert-modes.md").read_text()
    rows = {r.split("|")[1].strip(): [c.strip() for c in r.split("|")[2:-1]] for r in text.splitlines()
            if r.startswith("| ") and len(r.split("|")) == 10 and r.split("|")[1].strip() in mode_presets()}
    assert set(rows) == set(mode_presets())
    for mode, cells in rows.items():
        if parse(mode).top_p is not None and parse(mode).held_margin is None and parse(mode).low_bit is None:
            assert float(cells[0]) == pytest.approx(read_share(parse(mode)), abs=5e-4)
        assert cells[4:] == [f"{x:.3f}" for x in _mode_planned(cfg, mode)], mode
