"""The registry of weight formats: the built-in formats as the planner, the converter and the command line knew them
before there was a registry; the registry loads without torch; and a format added in one module of its own
(tests/support/group_int8.py) is planned by `deltafin inspect --spine`, placed and laid out by the stage's rules, and
timed and checked by `bench --kernel`'s spine benchmark, then gone again."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from deltafin.checkpoint.config import load_config
from deltafin.cli.bench_kernels import bench_spine
from deltafin.cli.commands import main
from deltafin.formats import (
    auto_spines,
    converted_spines,
    held_format,
    spine_choices,
    spine_format,
    stored_spine,
    weight_format,
)
from deltafin.kernels.linear import linear
from deltafin.kernels.quant import quantize_int8_rows, quantize_q4
from deltafin.paths import bundled_model
from deltafin.plan.memory.layer_table import converted_parts, tensor_role
from deltafin.plan.memory.sizing_options import SizingOptions
from deltafin.runtime.stage_build import WeightPlacer
from tests.support import group_int8


def test_the_builtin_formats_are_the_ones_the_code_had() -> None:
    assert spine_choices() == ("auto", "bf16", "int8", "q4")
    assert converted_spines() == ("q4", "int8") and stored_spine() == "bf16"
    assert auto_spines() == ("bf16", "int8", "q4") and auto_spines(for_room_too=False) == ("bf16", "int8")
    assert [spine_format(f).bytes_per_weight for f in ("bf16", "int8", "q4")] == [2.0, 1.0, 0.5625]
    # q4 holds a matrix of whole 64-groups; its 8-bit matrices and the others are row-int8; bf16 holds none
    assert held_format("q4", "matrix", (256, 7168)).name == "q4"
    assert held_format("q4", "matrix8", (256, 7168)).name == "int8"
    assert held_format("q4", "matrix", (256, 96)).name == "int8"
    assert held_format("int8", "matrix", (256, 96)).name == "int8"
    assert held_format("bf16", "matrix", (256, 7168)) is None and held_format("q4", "vector", (7168,)) is None
    dense = torch.randn(8, 128)
    assert weight_format(quantize_q4(dense)).name == "q4" and weight_format(quantize_int8_rows(dense)).name == "int8"
    assert weight_format(dense) is None


def test_the_registry_and_the_flags_load_without_torch() -> None:
    code = ("import sys, deltafin.formats, deltafin.cli.flags; "
            "assert 'torch' not in sys.modules, 'torch loaded'; print(deltafin.formats.spine_choices())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "('auto', 'bf16', 'int8', 'q4')"


def _matrices(cfg, layer: int) -> list[tuple[int, int, int]]:
    """(rows, cols, bytes as stored) of the layer's matrices whose rows are whole groups of the test's format."""
    out = []
    for spec in cfg.layer_tensor_specs(layer):
        role = tensor_role(spec, cfg.layer_kinds[layer])
        if role in ("matrix", "matrix8") and len(spec.shape) == 2 and min(spec.shape) > 1 \
                and spec.shape[1] % group_int8.GROUP == 0:
            out.append((*spec.shape, spec.nbytes))
    return out


def test_a_format_of_one_module_is_inspected_placed_and_benched(capsys) -> None:
    model = bundled_model()
    cfg = load_config(model)
    with group_int8.registered() as fmt:
        assert fmt.name in spine_choices() and SizingOptions(spine=fmt.name).spine == fmt.name
        assert fmt.name not in auto_spines()  # it says auto may not choose it: auto's plans are unchanged
        # `deltafin inspect --spine q8g`: every layer's resident bytes are bf16's with each matrix it holds at a
        # byte a value and an fp16 scale a group (a GPU: tensors as placed), and the memory plan holds it
        assert main(["-q", "inspect", "--model", str(model), "--memory-gb", "4", "--device", "cuda", "--spine",
                     fmt.name, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        for i, layer in enumerate(report["layers"]):
            held = layer["resident_bytes"]
            grown = sum(rows * cols + 2 * rows * cols // group_int8.GROUP - stored
                        for rows, cols, stored in _matrices(cfg, i))
            assert held[fmt.name] - held["bf16"] == grown != 0
        plan = report["plan"]
        assert plan["spine"] == fmt.name and plan["spine_why"].startswith("as given")
        assert plan["layers"] == sum(layer["resident_bytes"][fmt.name] for layer in report["layers"])
        # the converted file's layout and the stage's placement follow the format
        spec = next(s for s in cfg.layer_tensor_specs(0) if tensor_role(s, cfg.layer_kinds[0]) == "matrix")
        rows, cols = spec.shape
        assert converted_parts(spec, "matrix", fmt.name) == (rows * cols, 2 * rows * cols // group_int8.GROUP)
        dense = torch.randn(rows, cols, dtype=torch.bfloat16)
        placed = WeightPlacer(torch.device("cpu"), torch.float32, fmt.name).place(dense, "matrix")
        assert isinstance(placed, group_int8.Q8GWeight) and weight_format(placed) is fmt
        # `linear` runs its reference (no device has a method for it): the product of its dequantized matrix
        x = torch.randn(3, cols, dtype=torch.float64).float()
        want = x.double() @ group_int8.dequantize(placed, torch.float64).T
        assert float((linear(x, placed).double() - want).norm() / want.norm()) < 1e-6
        # `bench --kernel`'s spine benchmark times and checks it beside the others: its bytes, its product
        # against float64 of its own weights, and a group's finer scale rounding closer to bf16 than a row's
        spine = bench_spine("cpu", repeats=1, shapes={"m": (64, 256)}, prefill_tokens=5, rotation_bytes=10**5)
        got = spine["matrices"][0]["formats"]
        assert set(got) == {"bf16", "int8", "q4", fmt.name}
        assert got[fmt.name]["weight_bytes"] == 64 * 256 + 2 * 64 * 256 // group_int8.GROUP
        assert got[fmt.name]["rel_err"] < 1e-5
        assert 0.002 < got[fmt.name]["err_vs_bf16"] < got["int8"]["err_vs_bf16"]
    assert fmt.name not in spine_choices()  # gone with the `with`
