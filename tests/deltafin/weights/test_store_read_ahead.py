"""A prompt's guesses read ahead as far as the store's slots allow (runtime/read_ahead.py; wide holders get them as
`hints_ahead`): the cache gives its entries' slots to them, every guessed expert is read once and used from where
it was staged; a decode step's guesses stay within two layers' k and leave the cache alone."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.plan.memory.stage_parts import expert_slot_bytes
from deltafin.weights.store import ExpertStore

CPU = torch.device("cpu")


def _settled(store: ExpertStore) -> None:
    for _ in range(500):  # let the reads in flight land
        if not store.reads.pending:
            return
        time.sleep(0.01)


def test_a_prompts_guesses_read_ahead_into_the_caches_slots(tiny_dir: Path) -> None:
    cfg = load_config(tiny_dir)
    first, second = cfg.moe_layers[0], cfg.moe_layers[1]
    store = ExpertStore(open_checkpoint(tiny_dir, cfg), cfg.moe_layers, device=CPU,
                        cache_bytes=cfg.num_experts * expert_slot_bytes(cfg), threads=2)
    k, everyone = cfg.experts_per_token, list(range(cfg.num_experts))
    try:
        for _ in store.experts(first, everyone):  # the cache full of the first layer's experts
            pass
        assert len(store.cache.entries) == cfg.num_experts
        store.prefetch(second, everyone)  # a decode step's guess: two layers' k at most, the cache kept
        _settled(store)
        assert store.stats.prefetch_issued <= 2 * k and len(store.cache.entries) == cfg.num_experts
        store.prefetch(second, everyone, ahead=True)  # a prompt's: every slot beyond a layer's demand reads
        _settled(store)
        free_beyond_demand = cfg.num_experts + 2 * k  # the cache's slots and the two layers' guesses' (working_slots)
        assert store.stats.prefetch_issued == min(cfg.num_experts, free_beyond_demand) > 2 * k
        assert len(store.cache.entries) < cfg.num_experts  # the cache gave its slots
        reads = store.snapshot_stats().reads
        seen = {e for e, _ in store.experts(second, everyone)}
        assert seen == set(everyone)
        stats = store.snapshot_stats()
        assert stats.reads == cfg.num_experts + cfg.num_experts  # both layers' experts read once each
        assert stats.reads - reads == cfg.num_experts - store.stats.prefetch_issued  # the rest on demand
    finally:
        store.close()
