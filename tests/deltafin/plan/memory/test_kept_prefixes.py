"""The kept prefixes' default disk budget follows the model: room for KEPT_ON_DISK of its states at the planned
context, at most 32 GB (K3 keeps 32 GB; k3-mini a fraction of a GB), and `plan`/`inspect` say that budget."""

from __future__ import annotations

from deltafin.checkpoint.config import LayerKind, load_config, parse_config
from deltafin.paths import bundled_model
from deltafin.plan.memory.kept_prefixes import (
    KEPT_ON_DISK,
    PREFIX_DISK_BYTES,
    default_prefix_disk_bytes,
    kept_prefixes_text,
)
from deltafin.plan.memory.stage_parts import sequence_bytes


def test_the_default_disk_budget_is_room_for_kept_states_of_the_model_at_most_32_gb(k3_config_raw) -> None:
    k3 = parse_config(k3_config_raw)
    state = sequence_bytes(k3, 69, 24, 4096, 4)  # README: 0.465 GB + 55.3 KB a token
    assert abs(state - (0.465e9 + 4096 * 55.3e3)) < 0.01e9
    assert KEPT_ON_DISK * state > PREFIX_DISK_BYTES and default_prefix_disk_bytes(k3, 4096, 4) == 32 * 10**9
    mini = load_config(bundled_model())
    small = default_prefix_disk_bytes(mini, 4096, 4)
    n_kda = sum(k is LayerKind.KDA for k in mini.layer_kinds)
    assert small == KEPT_ON_DISK * sequence_bytes(mini, n_kda, mini.num_layers - n_kda, 4096, 4)
    assert 0.3e9 < small < 0.4e9 and default_prefix_disk_bytes(mini, 1024, 4) < small
    assert "and 0.364 GB of disk a stage" in kept_prefixes_text(mini, [(0, mini.num_layers, 10**7)], 4, 4096)
    assert "and 32 GB of disk a stage" in kept_prefixes_text(k3, [(0, k3.num_layers, 10**9)], 4, 4096)
    assert "and 5 GB of disk a stage" in kept_prefixes_text(k3, [(0, k3.num_layers, 10**9)], 4, 4096, disk=5 * 10**9)


def test_the_flags_help_says_the_default_the_code_computes(k3_config_raw) -> None:
    import argparse

    from deltafin.cli.flags import add_stage_options

    p = argparse.ArgumentParser()
    add_stage_options(p)
    (flag,) = [a for a in p._actions if "--prefix-disk-gb" in a.option_strings]
    mini = default_prefix_disk_bytes(load_config(bundled_model()), 4096, 4)
    k3 = default_prefix_disk_bytes(parse_config(k3_config_raw), 4096, 4)
    assert flag.default is None and f"room for {KEPT_ON_DISK} of the model's kept states at --max-context tokens, at " \
        f"most {PREFIX_DISK_BYTES / 1e9:g} GB: K3's {k3 / 1e9:g} GB, k3-mini's {mini / 1e9:.2f} GB" in flag.help
