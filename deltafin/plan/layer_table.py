"""The per-layer table and the rules that place a stage's tensors: how the stage uses each tensor
(`tensor_role`), the bytes it takes as placed (`placed_bytes`), and for every layer of a config its bytes resident
(bf16, row-int8 or q4), read when it streams (as stored for a bf16 spine; an int8 or q4 spine streams its converted
files: `Streamed`), its read buffer and the tensors placed from that buffer, with prefix sums so that a range of
layers costs O(1). Pure, from the config and the placement alone: sizing.py builds every
stage's plan on this table, and the stage places its tensors by the same rules."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from deltafin.checkpoint.config import LayerKind, ModelConfig, TensorSpec
from deltafin.kernels.quant import Q4_GROUP, q4_bytes

ALIGN = 4096  # direct-I/O block (deltafin.weights.directio.ALIGN)


class Placed(Protocol):
    """What the rules read of where a stage holds its tensors (sizing.Placement, which builds on this module)."""

    @property
    def act_bytes(self) -> int: ...  # activation element size: fp32 4, bf16 2

    @property
    def copies(self) -> bool: ...  # tensors are copied off the host buffers they were read into


def align_up(n: int) -> int:
    """`n` bytes widened to whole direct-I/O blocks."""
    return -(-n // ALIGN) * ALIGN


# ---- placement rules (the stage follows these) ----------------------------------------------------------


# the matrices a compact (q4) spine keeps at 8 bits: the head, KDA's gate and beta projections, MLA's latent
# projections (and, in MLA layers, its output and gate projections): measured sensitive (README, spine formats)
EIGHT_BIT = ("lm_head.weight", "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "q_a_proj.weight",
             "q_b_proj.weight", "kv_a_proj_with_mqa.weight")
EIGHT_BIT_MLA = ("self_attn.o_proj.weight", "self_attn.g_proj.weight")


def tensor_role(spec: TensorSpec, kind: LayerKind | None = None) -> str:
    """How the stage uses a tensor: vector (fp32), embedding (as stored), dense (kv_b: activation dtype),
    router (as stored, scored in fp32), matrix (bf16 as stored, row-int8, or 4-bit in a q4 spine) or matrix8
    (a matrix a q4 spine keeps at 8 bits). `kind`: the layer's (None: a top tensor)."""
    name = spec.name
    if name.endswith("embed_tokens.weight"):
        return "embedding"
    if len(spec.shape) == 1 or spec.dtype == "F32" or 1 in spec.shape:
        return "vector"
    if name.endswith("kv_b_proj.weight"):
        return "dense"
    if name.endswith("block_sparse_moe.gate.weight"):
        return "router"
    if name.endswith(EIGHT_BIT) or (kind is LayerKind.MLA and name.endswith(EIGHT_BIT_MLA)):
        return "matrix8"
    return "matrix"


def matrix_format(spine: str, resident: bool = True) -> str:
    """The format a stage's matrices are in: an int8 or q4 spine's, resident and streamed alike (streamed layers
    are read from the converted spine's files, `Streamed`, never quantized per pass); a bf16 spine's as stored.
    `resident` no longer changes the answer (the placer's calls name it)."""
    return spine if spine in ("int8", "q4") else "stored"


def placed_bytes(spec: TensorSpec, role: str, place: Placed, fmt: str) -> int:
    """Bytes a tensor takes on the device as the stage places it."""
    if role == "vector":
        name = spec.name
        if name.endswith("res_proj.weight"):
            return 0  # folded with its res_norm into one fp32 scoring vector
        if name.endswith("A_log"):
            return 4 * min(spec.numel, max(spec.shape))  # the per-head entries only
        return 4 * spec.numel
    if role == "dense":
        return place.act_bytes * spec.numel
    if role in ("matrix", "matrix8") and fmt in ("int8", "q4") and min(spec.shape) > 1:
        rows, cols = spec.shape
        if fmt == "q4" and role == "matrix" and cols % Q4_GROUP == 0:
            return q4_bytes(rows, cols)
        return spec.numel + 2 * rows  # row-int8
    return spec.nbytes  # embedding, router, matrices as stored


TENSOR_ALIGN = 64  # each tensor of a converted spine file starts on a multiple of this


def converted_kind(spec: TensorSpec, role: str, fmt: str) -> str:
    """How a converted spine of format `fmt` (int8 | q4) writes a tensor: "q4" (4-bit groups), "int8" (rows),
    or "stored" (as the checkpoint holds it), by the rules the stage places tensors by."""
    if role in ("matrix", "matrix8") and len(spec.shape) == 2 and min(spec.shape) > 1:
        if fmt == "q4" and role == "matrix" and spec.shape[1] % Q4_GROUP == 0:
            return "q4"
        if fmt in ("int8", "q4"):
            return "int8"
    return "stored"


def converted_parts(spec: TensorSpec, role: str, fmt: str) -> tuple[int, ...]:
    """The bytes of each array a tensor is written as in a converted spine file (weights/converted_spine.py):
    q4 packed codes, fp16 scales, fp16 biases; row-int8 values, fp16 scales; else the tensor as stored."""
    kind = converted_kind(spec, role, fmt)
    if kind == "stored":
        return (spec.nbytes,)
    rows, cols = spec.shape
    if kind == "q4":
        return rows * cols // 2, 2 * rows * (cols // Q4_GROUP), 2 * rows * (cols // Q4_GROUP)
    return spec.numel, 2 * rows


def converted_bytes(spec: TensorSpec, role: str, fmt: str) -> int:
    """Bytes a tensor takes in a converted spine file: its arrays, each widened to TENSOR_ALIGN."""
    return sum(-(-n // TENSOR_ALIGN) * TENSOR_ALIGN for n in converted_parts(spec, role, fmt))


def held_bytes(pairs: list[tuple[TensorSpec, str]], place: Placed, fmt: str) -> int:
    """Bytes a resident unit of tensors (a layer, the embedding, the head: (spec, role) pairs) takes as the stage
    holds it in format `fmt` (stored | int8 | q4): as placed, except a converted spine's unit on a placement that
    does not copy (the CPU), which is held as read: its whole file (weights/spine_files.py), which its matrices are
    views of, and the vectors and kv_b as placed (an upper bound: the placer makes tensors of their own of those in
    another dtype or stacked, such as the bf16 norms and KDA's convolutions; the others stay views)."""
    if fmt in ("int8", "q4") and not place.copies:
        own = sum(placed_bytes(s, r, place, fmt) for s, r in pairs if r in ("vector", "dense"))
        return align_up(sum(converted_bytes(s, r, fmt) for s, r in pairs)) + own
    return sum(placed_bytes(s, r, place, fmt) for s, r in pairs)


# ---- per-layer table --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Streamed:
    """What each layer costs when it streams in one spine format: the bytes read per pass, its read buffer and the
    tensors placed from that buffer (per layer). A bf16 spine streams the checkpoint's tensors as stored; an int8 or
    q4 spine streams its converted files (weights/spine_files.py: one file a layer, each array at TENSOR_ALIGN,
    the file padded to direct-I/O blocks, read whole into the buffer)."""

    stored: tuple[int, ...]  # bytes read when it streams
    span: tuple[int, ...]  # its read buffer (aligned)
    copy: tuple[int, ...]  # new allocations when it is loaded from a buffer


@dataclass(frozen=True)
class LayerTable:
    """Per-layer byte counts for one config and placement, with prefix sums so a range costs O(1)."""

    cfg: ModelConfig
    place: Placed
    bf16: tuple[int, ...]  # resident layer, bf16 spine (prefix sums, length L+1)
    int8: tuple[int, ...]  # resident layer, int8 spine (prefix sums; held_bytes: on the CPU as converted)
    q4: tuple[int, ...]  # resident layer, q4 spine: 4-bit groups, the EIGHT_BIT matrices row-int8 (prefix sums)
    stored: tuple[int, ...]  # per layer: bytes read when it streams as stored (a bf16 spine: `streamed`)
    span: tuple[int, ...]  # per layer: its read buffer as stored (aligned, upper bound)
    stream_copy: tuple[int, ...]  # per layer: new allocations when it is loaded from a buffer as stored
    moe: tuple[int, ...]  # prefix counts of MoE layers
    kda: tuple[int, ...]  # prefix counts of KDA layers
    mla: tuple[int, ...]  # prefix counts of MLA layers
    int8_stream: Streamed  # streamed layers of an int8 spine: its converted files
    q4_stream: Streamed  # streamed layers of a q4 spine: its converted files

    def resident(self, spine: str) -> tuple[int, ...]:
        """The resident layers' prefix sums for a spine format (bf16 | int8 | q4)."""
        return {"bf16": self.bf16, "int8": self.int8, "q4": self.q4}[spine]

    def streamed(self, spine: str) -> Streamed:
        """What streamed layers cost in a spine format: bf16 as stored (`stored`, `span`, `stream_copy`), int8 and
        q4 in their converted form."""
        if spine == "bf16":
            return Streamed(self.stored, self.span, self.stream_copy)
        return {"int8": self.int8_stream, "q4": self.q4_stream}[spine]


def layer_table(cfg: ModelConfig, place: Placed, spans: tuple[int, ...] | None = None) -> LayerTable:
    """The table for `cfg` on `place`. `spans` are the layers' real read-buffer sizes where the checkpoint is
    at hand (its tensors' offsets); without them each layer's spine is taken as one contiguous run, as in the
    release and in both synthetic orders."""
    return _layer_table(cfg, place, spans)


@lru_cache(maxsize=16)
def _layer_table(cfg: ModelConfig, place: Placed, spans: tuple[int, ...] | None) -> LayerTable:
    bf16, int8, q4, stored, span, copy = [0], [0], [0], [], [], []
    for i in range(cfg.num_layers):
        specs = cfg.layer_tensor_specs(i)
        roles = [tensor_role(s, cfg.layer_kinds[i]) for s in specs]
        pairs = list(zip(specs, roles, strict=True))
        for sums, fmt in ((bf16, "stored"), (int8, "int8"), (q4, "q4")):
            sums.append(sums[-1] + held_bytes(pairs, place, fmt))
        nbytes = sum(s.nbytes for s in specs)
        stored.append(nbytes)
        span.append(spans[i] if spans is not None else align_up(nbytes) + 2 * ALIGN)  # widened to blocks
        # on the CPU a streamed matrix is a view of the buffer; vectors and kv_b become new tensors
        copy.append(sum(placed_bytes(s, r, place, "stored") for s, r in zip(specs, roles, strict=True)
                        if place.copies or r in ("vector", "dense")))
    counts = lambda pred: tuple(_prefix([1 if pred(i) else 0 for i in range(cfg.num_layers)]))
    return LayerTable(cfg, place, tuple(bf16), tuple(int8), tuple(q4), tuple(stored), tuple(span), tuple(copy),
                      counts(cfg.is_moe), counts(lambda i: cfg.layer_kinds[i] is LayerKind.KDA),
                      counts(lambda i: cfg.layer_kinds[i] is LayerKind.MLA), _converted_stream(cfg, place, "int8"),
                      _converted_stream(cfg, place, "q4"))


def _converted_stream(cfg: ModelConfig, place: Placed, fmt: str) -> Streamed:
    """Streamed layers of a converted spine: each layer's file (its arrays at TENSOR_ALIGN, padded to direct-I/O
    blocks) is what is read and the buffer it is read into; what is placed from it is the tensors as placed in
    `fmt`, every one on a device that copies, else (the CPU: matrices are views of the buffer) the vectors and kv_b,
    which the placer converts to their own tensors."""
    stored, copy = [], []
    for i in range(cfg.num_layers):
        pairs = [(s, tensor_role(s, cfg.layer_kinds[i])) for s in cfg.layer_tensor_specs(i)]
        stored.append(align_up(sum(converted_bytes(s, r, fmt) for s, r in pairs)))
        copy.append(sum(placed_bytes(s, r, place, fmt) for s, r in pairs if place.copies or r in ("vector", "dense")))
    return Streamed(tuple(stored), tuple(stored), tuple(copy))


def _prefix(values: list[int]) -> list[int]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return out
