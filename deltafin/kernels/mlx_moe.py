"""Routed experts on MLX (Apple's array framework): K3's MXFP4 bytes as stored, a layer's experts in one
evaluation. On a Mac MLX runs them on the GPU with Apple-maintained Metal kernels; `mlx[cpu]` runs the same
code on Linux, which is how this path is tested here.

Expert slots are four MLX arrays with a row per slot (shapes for K3: I = 3072, D = 3584):
    w13 [S, 2I, D/8] uint32   gate (rows 0..I-1) and up (rows I..2I-1) codes: one gather_qmm computes both
    s13 [S, 2I, D/32] uint8   their E8M0 scales, as stored
    w2  [S, D, I/8] uint32    down codes
    s2  [S, D, I/32] uint8    down scales
`mx.quantized_matmul`/`mx.gather_qmm` with mode="mxfp4", group_size=32 read the uint8 code pairs viewed as
uint32 (low nibble = even element, as compressed-tensors stores them) and the E8M0 bytes as they are. The
reader fills a slot straight through the arrays' buffers (one `preadv` of the expert's six tensors into six
places), so the bytes go from the disk to MLX-owned memory with no copy in between.

Shapes: N tokens, k experts per token, M = N*k (token, expert) pairs, D expert width, I expert inner width.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import numpy as np
import torch

from deltafin.checkpoint.config import MXFP4_GROUP, ModelConfig, parse_config
from deltafin.checkpoint.presets import preset_config
from deltafin.formats.mxfp4 import MXFP4  # MLX names the format as formats/mxfp4.py does
from deltafin.kernels.activations import GatedActivation
from deltafin.kernels.quant import MXFP4Weight, mxfp4_linear_reference

log = logging.getLogger(__name__)


@functools.cache
def mlx_available() -> bool:
    try:
        import mlx.core  # noqa: F401  # lazily: whether MLX is installed at all
    except ImportError:
        return False
    return True


class MLXSlots:
    """`count` expert slots (see the module docstring), filled in place through memoryviews."""

    def __init__(self, cfg: ModelConfig, count: int):
        import mlx.core as mx  # lazily: MLX loads only where the MLX path runs

        i, d = cfg.moe_intermediate_size, cfg.expert_dim
        self.cfg, self.count = cfg, count
        self.w13 = mx.zeros((count, 2 * i, d // 8), dtype=mx.uint32)
        self.s13 = mx.zeros((count, 2 * i, d // MXFP4_GROUP), dtype=mx.uint8)
        self.w2 = mx.zeros((count, d, i // 8), dtype=mx.uint32)
        self.s2 = mx.zeros((count, d, i // MXFP4_GROUP), dtype=mx.uint8)
        mx.eval(self.w13, self.s13, self.w2, self.s2)  # allocated now, so that the buffers below are theirs
        self._views = [memoryview(a).cast("B") for a in (self.w13, self.s13, self.w2, self.s2)]
        self.size = sum(v.nbytes for v in self._views) // max(1, count)  # bytes per slot

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self._views)

    def regions(self, slot: int) -> list[memoryview]:
        """Where an expert's six tensors go, in spec order: w1 packed, w1 scales, w2 packed, w2 scales, w3 packed,
        w3 scales (w1 = gate and w3 = up share w13's rows, gate first)."""
        w13, s13, w2, s2 = self._views
        p13, q13 = w13.nbytes // self.count, s13.nbytes // self.count
        p2, q2 = w2.nbytes // self.count, s2.nbytes // self.count
        a, b = slot * p13, slot * q13
        return [w13[a:a + p13 // 2], s13[b:b + q13 // 2], w2[slot * p2:(slot + 1) * p2], s2[slot * q2:(slot + 1) * q2],
                w13[a + p13 // 2:a + p13], s13[b + q13 // 2:b + q13]]

    def scales(self, slot: int) -> list[np.ndarray]:
        """The slot's scale bytes (for the load-time E8M0 check), without a copy."""
        r = self.regions(slot)
        return [np.frombuffer(r[1], dtype=np.uint8), np.frombuffer(r[3], dtype=np.uint8),
                np.frombuffer(r[5], dtype=np.uint8)]

    def release_memory(self) -> None:
        for v in self._views:
            v.release()
        self._views = []
        self.w13 = self.s13 = self.w2 = self.s2 = None


def _situ(mx, a, u, act: GatedActivation):
    if act.kind == "situ":
        gate = act.beta * mx.tanh(a / act.beta) * mx.sigmoid(a)
        if act.linear_beta > 0:
            u = act.linear_beta * mx.tanh(u / act.linear_beta)
        return gate * u
    return a * mx.sigmoid(a) * u


def _experts_mx(mx, slots: MLXSlots, act: GatedActivation, x, rhs):
    """Expert rhs[m] on x[m] for every sorted pair m: x [M, 1, D] -> [M, 1, D]."""
    i = slots.cfg.moe_intermediate_size
    q = {"transpose": True, "group_size": MXFP4_GROUP, "bits": 4, "mode": MXFP4.name, "sorted_indices": True}
    h = mx.gather_qmm(x, slots.w13, slots.s13, rhs_indices=rhs, **q)  # [M, 1, 2I]: gate and up at once
    return mx.gather_qmm(_situ(mx, h[..., :i], h[..., i:], act), slots.w2, slots.s2, rhs_indices=rhs, **q)


def run_experts(slots: MLXSlots, act: GatedActivation, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
                slot_of: Callable[[int], int]) -> torch.Tensor:
    """sum_k weights[n, k] * Expert_{idx[n, k]}(z[n]) for every token, in one MLX evaluation: every (token,
    expert) pair through gather_qmm, sorted by slot (as mlx-lm's switch layers do, which lets Metal's kernel
    walk each expert's rows together). z [N, D] fp32, idx [N, k] expert ids, weights [N, k] fp32; `slot_of`
    says where each expert is."""
    import mlx.core as mx  # lazily: MLX loads only where the MLX path runs

    n_tok, k = idx.shape
    slot = np.array([slot_of(e) for e in idx.reshape(-1).tolist()], dtype=np.int32)
    order = np.argsort(slot, kind="stable")
    tok = mx.array((np.arange(n_tok * k, dtype=np.int32) // k)[order])
    x = mx.array(z.detach().to(torch.float32).cpu().numpy())[tok][:, None, :]  # [M, 1, D]
    y = _experts_mx(mx, slots, act, x, mx.array(slot[order]))
    w = mx.array(weights.detach().to(torch.float32).cpu().numpy().reshape(-1)[order])
    out = mx.zeros((n_tok, z.shape[1]), dtype=mx.float32).at[tok].add(y[:, 0, :] * w[:, None])
    mx.eval(out)
    return torch.from_numpy(np.array(out)).to(z.device)


def pair_outputs(slots: MLXSlots, act: GatedActivation, z: torch.Tensor, rows: torch.Tensor, ids: torch.Tensor,
                 slot_of: Callable[[int], int]) -> torch.Tensor:
    """Expert ids[p] on z[rows[p]] for every pair p, unweighted -> [P, D] fp32 (wide experts: a holder's pairs,
    summed by the stage that asked)."""
    import mlx.core as mx  # lazily: MLX loads only where the MLX path runs

    slot = np.array([slot_of(e) for e in ids.tolist()], dtype=np.int32)
    order = np.argsort(slot, kind="stable")
    x = mx.array(z.detach().to(torch.float32).cpu().numpy())[mx.array(rows.cpu().numpy()[order])][:, None, :]
    y = _experts_mx(mx, slots, act, x, mx.array(slot[order]))
    back = mx.array(np.argsort(order, kind="stable").astype(np.int32))
    out = y[:, 0, :][back]
    mx.eval(out)
    return torch.from_numpy(np.array(out)).to(z.device)


@functools.cache
def verified(act: GatedActivation) -> bool:
    """Whether MLX's experts pass the self-check (once per process and activation); logs the outcome."""
    small = dataclasses.replace(parse_config(preset_config("small", 2)), hidden_act=act.kind, situ_beta=act.beta,
                                situ_linear_beta=act.linear_beta)
    try:
        ok = self_check(small, act)
    except Exception as e:  # a broken or partial MLX install must not stop the runtime
        log.warning("MLX experts unavailable (%s); using the torch path", e)
        return False
    import mlx.core as mx  # lazily: MLX loads only where the MLX path runs

    if ok:
        log.info("routed experts on MLX %s (%s), self-checked", mx.__version__, mx.default_device())
    else:
        log.warning("MLX experts failed their self-check; using the torch path")
    return ok


def self_check(cfg: ModelConfig, act: GatedActivation) -> bool:
    """MLX's experts against the torch reference on random MXFP4 experts of this model's shapes (every code,
    several scales, more (token, expert) pairs than experts): relative error at fp32 rounding."""
    g = torch.Generator().manual_seed(4321)
    i, d, n_exp = cfg.moe_intermediate_size, cfg.expert_dim, 3
    slots = MLXSlots(cfg, n_exp)
    mats = []
    for s in range(n_exp):
        experts = []
        for rows, cols, region in ((i, d, 0), (d, i, 2), (i, d, 4)):
            w = MXFP4Weight(torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g),
                            torch.randint(118, 130, (rows, cols // MXFP4_GROUP), dtype=torch.uint8, generator=g))
            r = slots.regions(s)
            np.frombuffer(r[region], dtype=np.uint8)[:] = w.packed.numpy().reshape(-1)
            np.frombuffer(r[region + 1], dtype=np.uint8)[:] = w.scales.numpy().reshape(-1)
            experts.append(w)
        mats.append(experts)
    z = torch.randn(5, d, generator=g)
    idx = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 2]])
    weights = torch.rand(5, 2, generator=g)
    got = run_experts(slots, act, z, idx, weights, lambda e: e)
    want = torch.zeros(5, d)
    for t in range(5):
        for j in range(2):
            w1, w2, w3 = mats[int(idx[t, j])]
            h = act(mxfp4_linear_reference(z[t:t + 1], w1), mxfp4_linear_reference(z[t:t + 1], w3))
            want[t] += weights[t, j] * mxfp4_linear_reference(h, w2)[0]
    slots.release_memory()
    err = float((got - want).norm() / want.norm())
    if err > 1e-5:
        log.warning("MLX experts disagree with the reference (relative error %.2e)", err)
    return err <= 1e-5
