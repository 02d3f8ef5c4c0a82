"""The experts' remembered heat: the counts saved are the lookups the layers made (not the prefetcher's guesses),
a torn, corrupt or other-geometry file is ignored with a log line, a failed save leaves the previous file, warming
fills the cache with exactly the hottest experts that fit (their bytes the checkpoint's), an expert asked for
while its warming read is in flight is read once, and after a restart the first forward hits what it used before."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import fingerprint, open_checkpoint
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions
from deltafin.weights import expert_heat
from deltafin.weights.expert_heat import ExpertHeat, decay, encode_heat, heat_path, read_heat
from deltafin.weights.expert_trace import ExpertRecorder
from deltafin.weights.reader import SlotPool
from deltafin.weights.store import ExpertStore

CPU = torch.device("cpu")
IDS = torch.tensor([5, 100, 300, 7, 9, 700])


def _heat(tmp_path: Path, model: Path, **kw) -> ExpertHeat:
    return ExpertHeat.for_checkpoint(tmp_path / "heat", open_checkpoint(model, load_config(model)),
                                     save_every_s=0, **kw)


def _options(model: Path, slots: int, heat_dir: Path | None) -> StageOptions:
    cfg = load_config(model)
    return StageOptions(prefetch=False, expert_heat_dir=None if heat_dir is None else str(heat_dir)).replace(
        expert_cache_bytes=slots * expert_slot_bytes(cfg), read_threads=2)


def _ranked(counts: Counter, limit: int) -> list[tuple[int, int]]:
    """The reference ranking: most used first, ties by (layer, expert)."""
    return [k for k, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:limit]]


def test_the_counts_saved_are_the_lookups_the_layers_made_not_the_guesses(tiny_dir, tmp_path):
    cfg = load_config(tiny_dir)
    pipe = LocalPipeline.load(tiny_dir, 1, device="cpu", options=_options(tiny_dir, 4, tmp_path / "heat").replace(
        prefetch=True))
    stage = pipe.stages[0]
    recorder = stage.experts = ExpertRecorder(stage.experts)
    try:
        pipe.forward([SeqInput("a", 0, ids=IDS)])
        for i in range(6):
            pipe.forward([SeqInput("a", len(IDS) + i, ids=torch.tensor([37 * i + 11]))])
        assert recorder.inner.stats.prefetch_issued > 0  # guesses were made, and must not count
    finally:
        stage.experts = recorder.inner
        pipe.close()  # saves
    used = Counter((layer, e) for layer, ids in recorder.trace for e in ids)
    path = heat_path(tmp_path / "heat", open_checkpoint(tiny_dir, cfg))
    assert path.parent.name == fingerprint(tiny_dir) and not list(tiny_dir.glob("*heat*"))  # never the model dir
    _, counts = read_heat(path, cfg)
    want = np.zeros_like(counts)
    for (layer, e), n in used.items():
        want[cfg.moe_layers.index(layer), e] = n
    assert np.array_equal(counts, want) and counts.sum() == sum(len(ids) for _, ids in recorder.trace)
    assert np.array_equal(ExpertHeat(path, cfg).total(), want)  # reloaded as saved


def test_counts_halve_every_half_life_of_a_layers_lookups_and_never_overflow(tiny_dir, tmp_path):
    cfg = load_config(tiny_dir)
    heat = _heat(tmp_path, tiny_dir, half_life=10)
    first, second = cfg.moe_layers[:2]
    for _ in range(25):  # 25 lookups of expert 3 on the first layer: halved twice (at 10 and 20), 5 since
        heat.count(first, [3])
    heat.count(second, [1, 2])
    assert heat.save()
    since, counts = read_heat(heat.path, cfg)
    assert (since[0], since[1], counts[0, 3], counts[1, 1], counts[1, 2]) == (5, 2, 25 >> 2, 1, 1)
    since, capped = decay(np.array([3]), np.array([[2**40, 7]]), 10)  # no halving due: capped to uint32
    assert capped.tolist() == [[2**32 - 1, 7]] and since.tolist() == [3]


@pytest.mark.parametrize("damage, reason", [
    (lambda data: data[:len(data) // 2], "torn"),
    (lambda data: data[:-9] + bytes([data[-9] ^ 1]) + data[-8:], "corrupt"),
    (lambda data: b"garbage!" + data[8:], "not a heat file"),
    (lambda data: b"", "not a heat file"),
    ("other geometry", "another geometry"),
])
def test_a_torn_corrupt_or_mismatched_file_is_ignored_with_a_log_line(tiny_dir, small_dir, tmp_path, caplog,
                                                                      damage, reason):
    cfg = load_config(tiny_dir)
    heat = _heat(tmp_path, tiny_dir)
    heat.count(cfg.moe_layers[0], [1, 2, 3])
    assert heat.save()
    data = heat.path.read_bytes()
    if damage == "other geometry":  # a well-formed file of another model's shape where this one's belongs
        small = load_config(small_dir)
        data = encode_heat(small, np.zeros(len(small.moe_layers)), np.ones((len(small.moe_layers),
                                                                              small.num_experts)))
    else:
        data = damage(data)
    heat.path.write_bytes(data)
    caplog.set_level(logging.WARNING, logger="deltafin.weights.expert_heat")
    again = ExpertHeat(heat.path, cfg, save_every_s=0)
    assert not again.total().any() and again.hottest(cfg.moe_layers, 10) == []
    (line,) = [r.getMessage() for r in caplog.records]
    assert "ignored" in line and reason in line and str(heat.path) in line
    again.count(cfg.moe_layers[1], [4])  # the next save replaces it with a good file
    assert again.save() and read_heat(heat.path, cfg)[1][1, 4] == 1


def test_a_failed_save_leaves_the_previous_file_usable(tiny_dir, tmp_path, monkeypatch, caplog):
    """A write that fails before its rename (here fsync: the disk went away) leaves the file saved before as it was,
    and no temporary file; a process that died mid-write (its temporary file torn) changes nothing either."""
    cfg = load_config(tiny_dir)
    layer = cfg.moe_layers[0]
    heat = _heat(tmp_path, tiny_dir)
    heat.count(layer, [5, 5, 6])
    assert heat.save()
    before = heat.path.read_bytes()
    heat.count(layer, [7])

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(expert_heat.os, "fsync", failing_fsync)
    caplog.set_level(logging.WARNING, logger="deltafin.weights.expert_heat")
    assert not heat.save()
    monkeypatch.undo()
    assert "not saved" in caplog.text and heat.path.read_bytes() == before
    assert sorted(p.name for p in heat.path.parent.iterdir()) == ["heat.bin", "heat.bin.lock"]
    (heat.path.parent / f".heat.bin.{os.getpid() + 1}.1.tmp").write_bytes(before[:20])  # a crashed writer's
    assert ExpertHeat(heat.path, cfg).total()[0, [5, 6, 7]].tolist() == [2, 1, 0]
    assert heat.save()  # the count kept for the next save
    assert read_heat(heat.path, cfg)[1][0, [5, 6, 7]].tolist() == [2, 1, 1]


def test_warming_fills_the_cache_with_exactly_the_hottest_experts_that_fit(tiny_dir, tmp_path):
    cfg = load_config(tiny_dir)
    ckpt = open_checkpoint(tiny_dir, cfg)
    layers = cfg.moe_layers[1:4]  # a stage's layers: the others' heat is not this store's
    heat = _heat(tmp_path, tiny_dir)
    rng = np.random.default_rng(0)
    used = Counter()
    for layer in cfg.moe_layers:
        for e, n in enumerate(rng.integers(0, 20, cfg.num_experts)):
            heat.count(layer, [e] * int(n))
            used[(layer, e)] += int(n)
    assert heat.save()
    slots = 9
    store = ExpertStore(ckpt, layers, device=CPU, cache_bytes=slots * expert_slot_bytes(cfg), threads=2,
                        prefetch=False, heat=ExpertHeat(heat.path, cfg, save_every_s=0))
    try:
        assert store.warmer.done.wait(30)
        want = _ranked(Counter({k: n for k, n in used.items() if k[0] in layers and n}), slots)
        assert set(store.cache.entries) == set(want) and store.warmer.warmed == slots
        assert store.stats.lookups == 0 and store.snapshot_stats().reads == slots
        layer = want[0][0]
        ids = [e for lay, e in want if lay == layer]
        with safe_open(ckpt.expert(layer, ids[0]).tensors[0].file, "pt") as f:
            for e, got in store.experts(layer, ids):
                name = f"language_model.model.layers.{layer}.block_sparse_moe.experts.{e}.w1.weight_packed"
                assert torch.equal(got.w1.packed, f.get_tensor(name))
        assert (store.stats.hits, store.stats.misses) == (len(ids), 0)
    finally:
        store.close()


def test_an_expert_asked_for_while_its_warming_read_is_in_flight_is_read_once(tiny_dir, tmp_path, monkeypatch):
    cfg = load_config(tiny_dir)
    layer = cfg.moe_layers[0]
    heat = _heat(tmp_path, tiny_dir)
    heat.count(layer, [4, 4, 9])  # expert 4 is the hottest, warmed first
    assert heat.save()
    reading, gate, fill = threading.Event(), threading.Event(), SlotPool.fill

    def slow_fill(self, files, plan, slot, abort=None):
        if plan.tensors[0].name.endswith(f"layers.{layer}.block_sparse_moe.experts.4.w1.weight_packed"):
            reading.set()
            gate.wait(10)
        fill(self, files, plan, slot, abort)

    monkeypatch.setattr(SlotPool, "fill", slow_fill)
    store = ExpertStore(open_checkpoint(tiny_dir, cfg), [layer], device=CPU, cache_bytes=expert_slot_bytes(cfg),
                        threads=2, prefetch=False, heat=ExpertHeat(heat.path, cfg, save_every_s=0))
    try:
        assert reading.wait(10)  # the warming read of expert 4 is in flight; the cache has room for it alone
        got: list[int] = []
        asker = threading.Thread(target=lambda: got.extend(e for e, _ in store.experts(layer, [4])))
        asker.start()
        while store.stats.misses < 1 and asker.is_alive():  # it waits for that read, as for its own
            time.sleep(0.01)
        gate.set()
        asker.join(10)
        assert store.warmer.done.wait(10)
        assert got == [4] and store.snapshot_stats().reads == 1 and store.stats.misses == 1
        assert list(store.cache.entries) == [(layer, 4)] and store.warmer.warmed == 0  # kept as the layer's
    finally:
        gate.set()
        store.close()


def test_after_a_restart_the_first_forward_hits_the_experts_used_before(small_dir, tmp_path):
    """The first run's experts are remembered; a new pipeline warms them into its cache (room for all of them and
    for its first forward's misses, so nothing is evicted) and its first forward, on other tokens, hits exactly
    the experts it shares with them; without the heat, the same forward hits none."""
    heat_dir, slots = tmp_path / "heat", 300  # small: 7 MoE layers x 48 experts = 336
    first = LocalPipeline.load(small_dir, 1, device="cpu", options=_options(small_dir, slots, heat_dir))
    recorder = first.stages[0].experts = ExpertRecorder(first.stages[0].experts)
    try:
        first.forward([SeqInput("a", 0, ids=IDS[:4])])
        first.forward([SeqInput("a", 4, ids=torch.tensor([3]))])
    finally:
        first.stages[0].experts = recorder.inner
        first.close()
    used = {(layer, e) for layer, ids in recorder.trace for e in ids}
    hits, asked = {}, {}
    for name, folder in (("with", heat_dir), ("without", None)):
        pipe = LocalPipeline.load(small_dir, 1, device="cpu", options=_options(small_dir, slots, folder))
        store = pipe.stages[0].experts
        rec = pipe.stages[0].experts = ExpertRecorder(store)
        try:
            if store.warmer is not None:
                assert store.warmer.done.wait(30) and set(store.cache.entries) == used
            pipe.forward([SeqInput("b", 0, ids=torch.tensor([2000]))])
            hits[name] = store.stats.hits
            asked[name] = {(layer, e) for layer, ids in rec.trace for e in ids}
        finally:
            pipe.stages[0].experts = store
            pipe.close()
    assert asked["with"] == asked["without"]  # the same forward: the same routing
    assert len(used) + len(asked["with"] - used) <= slots  # the premise: no eviction in that forward
    assert hits == {"with": len(asked["with"] & used), "without": 0} and hits["with"] > 0


def test_a_warming_read_queues_behind_every_demand_read_and_guess_of_any_layer(tiny_dir, monkeypatch):
    """One reader, busy: a warming read of the first MoE layer, then a guess and a demand read of the last, are
    queued; the demand read goes first, then the guess, the warming read last (layers otherwise go in order)."""
    from deltafin.weights.expert_disks import ExpertDisks
    from deltafin.weights.reader import DEMAND, PREFETCH, WARM

    cfg = load_config(tiny_dir)
    first, last = cfg.moe_layers[0], cfg.moe_layers[-1]
    disks = ExpertDisks(open_checkpoint(tiny_dir, cfg), (), None, "buffered", threads=1)
    pool = SlotPool(4, expert_slot_bytes(cfg))
    names = {disks.plan(key)[1].tensors[0].name: key for key in [(first, 0), (first, 1), (last, 2), (last, 3)]}
    order, reading, gate, fill = [], threading.Event(), threading.Event(), SlotPool.fill

    def recording_fill(self, files, plan, slot, abort=None):
        order.append(names[plan.tensors[0].name])
        if len(order) == 1:
            reading.set()
            gate.wait(10)
        fill(self, files, plan, slot, abort)

    monkeypatch.setattr(SlotPool, "fill", recording_fill)
    try:
        futures = [disks.submit((first, 0), DEMAND, pool, lambda slot, plan: pool.release(slot), None)]
        assert reading.wait(10)
        for key, priority in [((first, 1), WARM), ((last, 2), PREFETCH), ((last, 3), DEMAND)]:
            futures.append(disks.submit(key, priority, pool, lambda slot, plan: pool.release(slot), None))
        gate.set()
        for f in futures:
            f.result(10)
        assert order == [(first, 0), (last, 3), (last, 2), (first, 1)]
    finally:
        gate.set()
        disks.close()


def test_a_mode_reading_every_experts_copy_warms_the_copies(small_dir, tmp_path, monkeypatch):
    """In q3 a store reads only copies (ids E + e): its warming reads the hottest experts' copies, so that the first
    forward hits them; the heat counts a copy's use as its expert's."""
    from deltafin.weights import expert_copy

    monkeypatch.setattr(expert_copy, "default_root", lambda model_dir, fmt: tmp_path / fmt)
    heat_dir, slots = tmp_path / "heat", 300
    options = _options(small_dir, slots, heat_dir).replace(expert_mode="q3")
    first = LocalPipeline.load(small_dir, 1, device="cpu", options=options)
    try:
        first.forward([SeqInput("a", 0, ids=IDS[:4])])
        e_count = first.config.num_experts
        used = {key for key in first.stages[0].experts.cache.entries}
        assert used and all(e >= e_count for _, e in used)
    finally:
        first.close()
    again = LocalPipeline.load(small_dir, 1, device="cpu", options=options)
    try:
        store = again.stages[0].experts
        assert store.warmer is not None and store.warmer.done.wait(30)
        assert set(store.cache.entries) == used  # the same copies, warmed
    finally:
        again.close()


def test_a_prompts_read_ahead_ends_the_warming_so_the_room_it_evicts_stays_its_own(tiny_dir, tmp_path, monkeypatch):
    cfg = load_config(tiny_dir)
    warmed_layer, prompt_layer = cfg.moe_layers[0], cfg.moe_layers[1]
    heat = _heat(tmp_path, tiny_dir)
    heat.count(warmed_layer, [e for e in range(cfg.num_experts) for _ in range(1 + e % 5)])
    assert heat.save()
    reading, gate, fill = threading.Event(), threading.Event(), SlotPool.fill

    def slow_fill(self, files, plan, slot, abort=None):
        if f"layers.{warmed_layer}." in plan.tensors[0].name:
            reading.set()
            gate.wait(10)
        fill(self, files, plan, slot, abort)

    monkeypatch.setattr(SlotPool, "fill", slow_fill)
    slots = 8
    store = ExpertStore(open_checkpoint(tiny_dir, cfg), cfg.moe_layers[:2], device=CPU,
                        cache_bytes=slots * expert_slot_bytes(cfg), threads=2, prefetch=True,
                        heat=ExpertHeat(heat.path, cfg, save_every_s=0))
    try:
        assert reading.wait(10)  # the first warming read is in flight (half of 2 readers: one at a time)
        store.prefetch(prompt_layer, list(range(cfg.num_experts)), ahead=True)
        gate.set()
        assert store.warmer.done.wait(10)
        with store.reads.lock:
            while store.reads.live:
                store.reads.idle.wait(10)
        # the read in flight landed in the cache; none started after the prompt's read-ahead took the room
        assert store.warmer.warmed == 1 and len(store.cache.entries) <= 1
        ids = list(range(cfg.experts_per_token))
        assert [e for e, _ in store.experts(warmed_layer, ids)] != []  # a demand still finds its slots
    finally:
        gate.set()
        store.close()
