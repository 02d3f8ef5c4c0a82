"""Typed options from named values: a size in GB fills its _bytes field, nested options fill from the same values,
names for other options are left alone, and the checks name the flag."""

from __future__ import annotations

import pytest

from deltafin.coordinator.cluster.cluster_options import ClusterOptions
from deltafin.errors import DeltafinError
from deltafin.options import at_least, check_choice, flag, from_values, more_than_zero, option_names
from deltafin.plan.memory.sizing_options import SizingOptions
from deltafin.runtime.stage_options import StageOptions
from deltafin.worker.worker_options import WorkerOptions


def test_sizes_in_gb_fill_their_bytes_fields_and_nested_options_fill_too() -> None:
    got = from_values(StageOptions, {"memory_gb": 1.5, "expert_cache_gb": None, "context": 512, "io": "buffered",
                                     "max_active": 9})  # max_active: another concern's, left alone
    assert got.memory_bytes == 1_500_000_000 and got.io == "buffered"
    assert got.sizing == SizingOptions(expert_cache_bytes=None, context=512)


def test_a_repeated_flags_list_is_its_fields_tuple_and_a_given_field_is_taken_as_it_is() -> None:
    """argparse appends a repeated flag's values to a list; the frozen options hold tuples (hashable, comparable)."""
    got = from_values(ClusterOptions, {"model": "m", "worker": ["a:1", "b:2"], "interface": ["127.0.0.1"]})
    assert got.worker == ("a:1", "b:2") and got.interface == ("127.0.0.1",)
    assert from_values(ClusterOptions, {"model": "m"}).interface is None  # not given: the default, not a tuple
    nested = StageOptions(io="buffered")
    worker = from_values(WorkerOptions, {"model": "m", "io": "direct", "advertise": ["h:1"]}, stage=nested)
    assert worker.stage is nested and worker.advertise == ("h:1",)


def test_the_names_are_the_fields_with_sizes_in_gb() -> None:
    names = option_names(StageOptions)
    assert {"memory_gb", "expert_cache_gb", "prefix_cache_gb", "prefill_chunk", "read_threads", "cache_policy"} <= names
    assert not {"memory_bytes", "sizing", "expert_cache_bytes"} & names


def test_the_checks_name_the_flag() -> None:
    assert flag("expert_cache_gb") == "--expert-cache-gb"
    with pytest.raises(DeltafinError, match=r"--io: invalid choice: 'mmap' \(choose from 'direct', 'buffered'\)"):
        check_choice("io", "mmap", ("direct", "buffered"))
    with pytest.raises(DeltafinError, match="--context must be at least 1"):
        at_least(1, sequences=2, context=0)
    at_least(0, memory_gb=None, prefix_disk_gb=0)  # not given, or at the bound: fine


@pytest.mark.parametrize("gb", [0, -1, 1e-10])
def test_a_memory_budget_must_be_more_than_nothing(gb) -> None:
    """`--memory-gb 0` (or `memory_gb=0`, or a budget under a byte) was accepted, to fail later as a plan that
    cannot fit: the typed options refuse it, naming the flag, wherever they are built."""
    with pytest.raises(DeltafinError, match="^--memory-gb must be more than 0$"):
        from_values(StageOptions, {"memory_gb": gb})
    with pytest.raises(DeltafinError, match="^--memory-gb must be more than 0$"):
        more_than_zero(memory_gb=int(gb * 1e9))
    more_than_zero(memory_gb=None)  # not given: the memory found
