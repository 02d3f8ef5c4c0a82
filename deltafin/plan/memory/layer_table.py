"""The per-layer table and the rules that place a stage's tensors: how the stage uses each tensor
(`tensor_role`), the bytes it takes as placed (`placed_bytes`), and for every layer of a config its bytes resident
in each spine format (deltafin/formats), read when it streams (as stored for the spine held as stored; a converted
format streams its converted files: `Streamed`), its read buffer and the tensors placed from that buffer, with
prefix sums so that a range of layers costs O(1). Pure, from the config and the placement alone: sizing.py builds
every stage's plan on this table, and the stage places its tensors by the same rules."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from deltafin.checkpoint.config import LayerKind, ModelConfig, TensorSpec
from deltafin.formats import auto_spines, converted_spines, held_format, spine_format, spine_formats

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


# the matrices a compact spine keeps at 8 bits (in its format's `sensitive` one): the head, KDA's gate and beta
# projections, MLA's latent projections (and, in MLA layers, its output and gate projections): measured sensitive
# (README, spine formats)
EIGHT_BIT = ("lm_head.weight", "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "q_a_proj.weight",
             "q_b_proj.weight", "kv_a_proj_with_mqa.weight")
EIGHT_BIT_MLA = ("self_attn.o_proj.weight", "self_attn.g_proj.weight")


def tensor_role(spec: TensorSpec, kind: LayerKind | None = None) -> str:
    """How the stage uses a tensor: vector (fp32), embedding (as stored), dense (kv_b: activation dtype),
    router (as stored, scored in fp32), matrix (in the spine's format) or matrix8 (a matrix a compact spine keeps
    at 8 bits: formats' `held_format`). `kind`: the layer's (None: a top tensor)."""
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


STORED = "stored"  # a tensor as the checkpoint holds it


def matrix_format(spine: str, resident: bool = True) -> str:
    """The format a stage's matrices are in: a converted spine format's, resident and streamed alike (streamed
    layers are read from the converted spine's files, `Streamed`, never quantized per pass); else as stored.
    `resident` no longer changes the answer (the placer's calls name it)."""
    return spine if spine_format(spine).converted else STORED


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
    held = None if fmt == STORED else held_format(fmt, role, spec.shape)
    if held is not None:
        return held.matrix_bytes(*spec.shape)
    return spec.nbytes  # embedding, router, matrices as stored


TENSOR_ALIGN = 64  # each tensor of a converted spine file starts on a multiple of this


def converted_kind(spec: TensorSpec, role: str, fmt: str) -> str:
    """How a converted spine of format `fmt` writes a tensor: in the format it holds the tensor in (its own, or
    its `sensitive` one), or STORED (as the checkpoint holds it), by the rules the stage places tensors by."""
    held = held_format(fmt, role, spec.shape)
    return STORED if held is None else held.name


def converted_parts(spec: TensorSpec, role: str, fmt: str) -> tuple[int, ...]:
    """The bytes of each array a tensor is written as in a converted spine file (weights/spine_files.py): its
    format's arrays (formats' `parts`), else the tensor as stored."""
    held = held_format(fmt, role, spec.shape)
    return (spec.nbytes,) if held is None else held.parts(*spec.shape)


def converted_bytes(spec: TensorSpec, role: str, fmt: str) -> int:
    """Bytes a tensor takes in a converted spine file: its arrays, each widened to TENSOR_ALIGN."""
    return sum(-(-n // TENSOR_ALIGN) * TENSOR_ALIGN for n in converted_parts(spec, role, fmt))


def held_bytes(pairs: list[tuple[TensorSpec, str]], place: Placed, fmt: str) -> int:
    """Bytes a resident unit of tensors (a layer, the embedding, the head: (spec, role) pairs) takes as the stage
    holds it in format `fmt` (STORED, or a converted spine format): as placed, except a converted spine's unit on a
    placement that does not copy (the CPU), which is held as read: its whole file (weights/spine_files.py), which
    its matrices are views of, and the vectors and kv_b as placed (an upper bound: the placer makes tensors of
    their own of those in another dtype or stacked, such as the bf16 norms and KDA's convolutions; the others stay
    views)."""
    if fmt != STORED and not place.copies:
        own = sum(placed_bytes(s, r, place, fmt) for s, r in pairs if r in ("vector", "dense"))
        return align_up(sum(converted_bytes(s, r, fmt) for s, r in pairs)) + own
    return sum(placed_bytes(s, r, place, fmt) for s, r in pairs)


# ---- per-layer table --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Streamed:
    """What each layer costs when it streams in one spine format: the bytes read per pass, its read buffer and the
    tensors placed from that buffer (per layer). The spine as stored streams the checkpoint's tensors; a converted
    format streams its converted files (weights/spine_files.py: one file a layer, each array at TENSOR_ALIGN,
    the file padded to direct-I/O blocks, read whole into the buffer)."""

    stored: tuple[int, ...]  # bytes read when it streams
    span: tuple[int, ...]  # its read buffer (aligned)
    copy: tuple[int, ...]  # new allocations when it is loaded from a buffer


@dataclass(frozen=True)
class LayerTable:
    """Per-layer byte counts for one config and placement, with prefix sums so a range costs O(1)."""

    cfg: ModelConfig
    place: Placed
    held: Mapping[str, tuple[int, ...]]  # spine format -> a resident layer's bytes, prefix sums (length L+1;
    # held_bytes: a converted format's on the CPU as converted)
    stored: tuple[int, ...]  # per layer: bytes read when it streams as stored (the stored spine's `streamed`)
    span: tuple[int, ...]  # per layer: its read buffer as stored (aligned, upper bound)
    stream_copy: tuple[int, ...]  # per layer: new allocations when it is loaded from a buffer as stored
    moe: tuple[int, ...]  # prefix counts of MoE layers
    kda: tuple[int, ...]  # prefix counts of KDA layers
    mla: tuple[int, ...]  # prefix counts of MLA layers
    converted: Mapping[str, Streamed]  # converted spine format -> its streamed layers: its converted files

    def resident(self, spine: str) -> tuple[int, ...]:
        """The resident layers' prefix sums for a spine format."""
        return self.held[spine]

    def streamed(self, spine: str) -> Streamed:
        """What streamed layers cost in a spine format: the stored one's as stored (`stored`, `span`,
        `stream_copy`), a converted one's in its converted form."""
        if spine_format(spine).converted:
            return self.converted[spine]
        return Streamed(self.stored, self.span, self.stream_copy)


def layer_table(cfg: ModelConfig, place: Placed, spans: tuple[int, ...] | None = None) -> LayerTable:
    """The table for `cfg` on `place`. `spans` are the layers' real read-buffer sizes where the checkpoint is
    at hand (its tensors' offsets); without them each layer's spine is taken as one contiguous run, as in the
    release and in both synthetic orders."""
    return _layer_table(cfg, place, spans, tuple(f.name for f in spine_formats()))


@lru_cache(maxsize=16)
def _layer_table(cfg: ModelConfig, place: Placed, spans: tuple[int, ...] | None,
                 formats: tuple[str, ...]) -> LayerTable:
    # `formats`: the registered spine formats, in the cache's key (a test registers one of its own)
    held: dict[str, list[int]] = {name: [0] for name in formats}
    stored, span, copy = [], [], []
    for i in range(cfg.num_layers):
        specs = cfg.layer_tensor_specs(i)
        roles = [tensor_role(s, cfg.layer_kinds[i]) for s in specs]
        pairs = list(zip(specs, roles, strict=True))
        for name, sums in held.items():
            sums.append(sums[-1] + held_bytes(pairs, place, matrix_format(name)))
        nbytes = sum(s.nbytes for s in specs)
        stored.append(nbytes)
        span.append(spans[i] if spans is not None else align_up(nbytes) + 2 * ALIGN)  # widened to blocks
        # on the CPU a streamed matrix is a view of the buffer; vectors and kv_b become new tensors
        copy.append(sum(placed_bytes(s, r, place, STORED) for s, r in zip(specs, roles, strict=True)
                        if place.copies or r in ("vector", "dense")))
    counts = lambda pred: tuple(_prefix([1 if pred(i) else 0 for i in range(cfg.num_layers)]))
    return LayerTable(cfg, place, {name: tuple(sums) for name, sums in held.items()}, tuple(stored), tuple(span),
                      tuple(copy), counts(cfg.is_moe), counts(lambda i: cfg.layer_kinds[i] is LayerKind.KDA),
                      counts(lambda i: cfg.layer_kinds[i] is LayerKind.MLA),
                      {name: _converted_stream(cfg, place, name) for name in converted_spines()
                       if name in formats})


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


# ---- which formats a model can use ----------------------------------------------------------------------


@lru_cache(maxsize=16)
def unfit_spines(cfg: ModelConfig) -> dict[str, str]:
    """The converted spine formats that hold none of `cfg`'s matrices in their own groups (every one would be held
    in the format's fallback: q4's groups of 64 divide no row of a model whose hidden size is no multiple of 64),
    each with why: `--spine auto` and `deltafin convert` leave them out and say so."""
    shapes = sorted({s.shape for i in range(cfg.num_layers) for s in cfg.layer_tensor_specs(i)
                     if tensor_role(s, cfg.layer_kinds[i]) == "matrix"})
    out = {}
    for fmt in spine_formats():
        if fmt.converted and shapes and not any(fmt.fits(*shape) for shape in shapes):
            fallback = fmt.sensitive or "as stored"
            out[fmt.name] = (f"{fmt.name} can hold none of this model's spine matrices (its groups divide none of "
                             f"their rows: e.g. {shapes[0][0]}x{shapes[0][1]}, hidden size {cfg.hidden_size}); a "
                             f"{fmt.name} spine would be {fallback} throughout")
    return out


def model_spines(cfg: ModelConfig, for_room_too: bool = True) -> tuple[str, ...]:
    """`--spine auto`'s formats (formats.auto_spines) that `cfg` can use (not in `unfit_spines`)."""
    return tuple(f for f in auto_spines(for_room_too) if f not in unfit_spines(cfg))
