"""A forward in several messages (codec.py's tensors and sequences, sliced along their tokens), and a stage's outputs
as the next stage's inputs (the coordinator's relay, a worker's hand-off) or as a hand-off's answer.

A forward longer than one message holds (a long prompt's residual state at K3's width: up to 258 KB a token)
travels as a stream of ForwardRequest parts and comes back as ForwardResponse parts: each part carries slices
of some sequences' tensors along their tokens; a session's slices, in order, make its whole tensor, and its
other fields come with its first slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from deltafin.errors import CodecError
from deltafin.models.attn_res import ResidualState
from deltafin.runtime.features import Features
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from deltafin.transport.codec import decode_features, decode_inputs, decode_outputs, encode_inputs, encode_outputs
from deltafin.transport.generated import deltafin_pb2 as pb


def _token_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in tensors if t.shape[0])


def _slices(items: list[tuple[str, list[torch.Tensor]]], max_bytes: int) -> list[list[tuple[int, int, int]]]:
    """Parts of at most `max_bytes` of tensor data (a token at least): per part, (item, first token, end token)
    slices, every item's tokens once and in order."""
    parts: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = max_bytes
    for i, (_, tensors) in enumerate(items):
        total, per_token, at = tensors[0].shape[0], max(1, _token_bytes(tensors)), 0
        while True:
            if current and room < per_token:  # this part is full
                parts.append(current)
                current, room = [], max_bytes
            n = min(total - at, max(1, room // per_token))
            current.append((i, at, at + n))
            at, room = at + n, room - n * per_token
            if at >= total:
                break
    return [*parts, current] if current else parts


def request_bytes(batch: list[SeqInput]) -> int:
    """Tensor bytes of a forward's inputs (what decides whether it needs parts)."""
    return sum(_token_bytes(_input_tensors(b)) * b.num_tokens for b in batch)


def _input_tensors(item: SeqInput) -> list[torch.Tensor]:
    return [item.ids] if item.ids is not None else [item.state.P, item.state.B]  # type: ignore[union-attr]


def encode_request_parts(batch: list[SeqInput], all_logits: bool, request_id: str,
                         max_bytes: int) -> list[pb.ForwardRequest]:
    """A forward's inputs as parts of at most `max_bytes` of tensor data each."""
    items = [(b.session_id, _input_tensors(b)) for b in batch]
    out = []
    for part in _slices(items, max_bytes):
        seqs = []
        for i, a, z in part:
            item = batch[i]
            piece = (item.carrying(ResidualState(item.state.P[a:z], item.state.B[a:z])) if item.ids is None
                     else dataclasses.replace(item, ids=item.ids[a:z]))
            seqs += encode_inputs([piece])
        out.append(pb.ForwardRequest(request_id=request_id, sequences=seqs, all_logits=all_logits,
                                     part_bytes=max_bytes))
    return out


def decode_request_parts(msgs: list[pb.ForwardRequest]) -> tuple[list[SeqInput], bool, str]:
    """The forward a stream of parts carried: (inputs, all_logits, request id); CodecError if the parts
    disagree (a session's slices of different kinds, dtypes or widths). The first part's `part_bytes` is how
    large the answer's parts may be."""
    if not msgs:
        raise CodecError("a forward in parts needs at least one part")
    pieces: dict[str, list[SeqInput]] = {}
    for msg in msgs:
        for item in decode_inputs(list(msg.sequences)):
            pieces.setdefault(item.session_id, []).append(item)
    batch = []
    for sid, parts in pieces.items():
        first = parts[0]
        try:
            if first.ids is not None:
                batch.append(dataclasses.replace(first, ids=torch.cat([p.ids for p in parts])))  # type: ignore[misc]
            else:
                batch.append(first.carrying(ResidualState(torch.cat([p.state.P for p in parts]),  # type: ignore[union-attr]
                                                          torch.cat([p.state.B for p in parts]))))  # type: ignore[union-attr]
        except (RuntimeError, TypeError) as e:
            raise CodecError(f"session {sid!r}: its parts do not join: {e}") from None
    return batch, msgs[0].all_logits, msgs[0].request_id


def encode_output_parts(outputs: list[SeqOutput], max_bytes: int) -> list[pb.ForwardResponse]:
    def tensors(o: SeqOutput) -> list[torch.Tensor]:
        return [o.logits] if o.logits is not None else [o.state.P, o.state.B]  # type: ignore[union-attr]

    out = []
    for part in _slices([(o.session_id, tensors(o)) for o in outputs], max_bytes):
        pieces = []
        for i, a, z in part:
            o = outputs[i]
            features = o.features if a == 0 else {}  # whole, with the sequence's first slice
            pieces.append(SeqOutput(o.session_id, logits=o.logits[a:z], features=features) if o.logits is not None
                          else SeqOutput(o.session_id, state=ResidualState(o.state.P[a:z], o.state.B[a:z]),  # type: ignore[union-attr]
                                         features=features))
        out.append(pb.ForwardResponse(sequences=encode_outputs(pieces)))
    return out


def decode_output_parts(msgs: list[pb.ForwardResponse]) -> list[SeqOutput]:
    pieces: dict[str, list[SeqOutput]] = {}
    for msg in msgs:
        for o in decode_outputs(list(msg.sequences)):
            pieces.setdefault(o.session_id, []).append(o)
    out = []
    for sid, parts in pieces.items():
        features = {k: v for p in parts for k, v in p.features.items()}
        try:
            if parts[0].logits is not None:
                out.append(SeqOutput(sid, logits=torch.cat([p.logits for p in parts]), features=features))  # type: ignore[misc]
            else:
                out.append(SeqOutput(sid, state=ResidualState(torch.cat([p.state.P for p in parts]),  # type: ignore[union-attr]
                                                              torch.cat([p.state.B for p in parts])),  # type: ignore[union-attr]
                                     features=features))
        except (RuntimeError, TypeError) as e:
            raise CodecError(f"output {sid!r}: its parts do not join: {e}") from None
    return out


def next_stage_parts(outputs: list[SeqOutput], inputs: Mapping[str, SeqInput], all_logits: bool, request_id: str,
                     max_bytes: int) -> list[pb.ForwardRequest]:
    """A stage's output states (some sequences' slices) as the next stage's input parts: each sequence's fields as
    the forward's `inputs` (by session id) give them, its state from `outputs` (the relay and the hand-off)."""
    if any(o.state is None for o in outputs):
        raise CodecError("a stage before the last answered with logits")
    return encode_request_parts([inputs[o.session_id].carrying(o.state) for o in outputs],  # type: ignore[arg-type]
                                all_logits, request_id, max_bytes)


def encode_handed(features: Mapping[str, Features]) -> pb.ForwardResponse:
    """A stage's answer once the next stage holds its outputs (a hand-off): each sequence's draft features only."""
    return pb.ForwardResponse(handed=True, sequences=encode_outputs([SeqOutput(sid, features=dict(f))
                                                                     for sid, f in features.items()]))


def decode_handed(msgs: list[pb.ForwardResponse]) -> list[SeqOutput]:
    """`encode_handed`'s answer: each sequence with its features and no state."""
    return [SeqOutput(m.session_id, features=decode_features(m, f"output {m.session_id!r}"))
            for msg in msgs for m in msg.sequences]
