"""Writing trained k3-mini parameters as a checkpoint in the exact K3 layout (synth.write_checkpoint).

Spine tensors are stored in their spec's dtype (BF16 or F32, as K3 stores them); each routed expert is
rounded to MXFP4 (quant.quantize_mxfp4) into its `weight_packed` / `weight_scale` pair. The config is the
`mini` preset's, its synthetic marker replaced by a record of how the weights were trained.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from deltafin.checkpoint.config import TensorSpec, parse_config
from deltafin.kernels.quant import MXFP4Weight, quantize_mxfp4
from deltafin.mini.synth import write_checkpoint
from deltafin.mini.train import experts_name


def export(raw: dict[str, Any], params: dict[str, torch.Tensor], ranks: dict[bytes, int], out: Path,
           trained: dict[str, Any]) -> Path:
    """Write `params` (training names: train.load_parameters) under config `raw` to `out`."""
    cfg = parse_config(raw)
    raw = {k: v for k, v in raw.items() if k != "deltafin_synthetic"}
    raw["deltafin_trained"] = trained
    host = {k: v.detach().float().cpu() for k, v in params.items()}

    @lru_cache(maxsize=8)
    def expert(layer: int, e: int, matrix: str) -> MXFP4Weight:
        return quantize_mxfp4(host[experts_name(layer, matrix)][e])

    def tensor_bytes(spec: TensorSpec) -> Iterator[bytes]:
        name = spec.name.removeprefix(cfg.prefix)
        if spec.expert is not None:
            matrix, part = name.split(".")[-2:]  # ...experts.{e}.w1.weight_packed
            q = expert(spec.layer, spec.expert, matrix)
            t = q.packed if part == "weight_packed" else q.scales
        else:
            t = host[name].reshape(spec.shape).to(torch.bfloat16 if spec.dtype == "BF16" else torch.float32)
        yield t.contiguous().view(torch.uint8).numpy().tobytes()

    return write_checkpoint(raw, out, tensor_bytes, ranks, label="export k3-mini", show_progress=False)
