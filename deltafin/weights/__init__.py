"""Spine residency and the expert store (pread, cache, prefetch, counters)."""
