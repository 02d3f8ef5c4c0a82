"""A stage's inputs and outputs as values (SeqInput, SeqOutput), and the checks a forward's batch passes before any
session changes (`check_batch`): what a stage takes from the coordinator, the wire or the stage before."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deltafin.checkpoint.config import ModelConfig
from deltafin.errors import InvalidInput
from deltafin.models.attn_res import ResidualState
from deltafin.models.pieces import PIECE_TOKENS
from deltafin.plan.memory.sizing_options import SPECULATIVE_TOKENS
from deltafin.runtime.features import FeatureAsk, Features


@dataclass(frozen=True)
class SeqInput:
    """One sequence of a forward call: `ids` [T] for stage 0, else the residual state of T tokens."""

    session_id: str
    cache_len: int  # tokens already in the session's cache (0 starts a new session)
    ids: torch.Tensor | None = None
    state: ResidualState | None = None
    resume_from: str | None = None  # a new session starts from this prefix (of cache_len tokens)
    # keep the session's state after n tokens as a prefix (cache_len < n <= cache_len + T), each under its id; a
    # state inside the forward is taken as it runs (the forward is not split), the last stage keeps the logits
    # of a state at the forward's end (what a prompt's first output token needs)
    save_at: tuple[tuple[int, str], ...] = ()
    # drafted tokens to verify: logits for every token come back, and the next forward may continue from any
    # of its positions (cache_len below the session's length drops the drafts after it)
    speculative: bool = False
    # a draft head's features: the hidden states entering these layers at the rows from a position on
    # (runtime/features.py); each stage answers the layers it runs
    features: FeatureAsk | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.ids.shape[0]) if self.ids is not None else self.state.num_tokens  # type: ignore[union-attr]

    def carrying(self, state: ResidualState) -> SeqInput:
        """The same sequence for the next stage: the previous stage's output instead of ids."""
        return dataclasses.replace(self, ids=None, state=state)


@dataclass(frozen=True)
class SeqOutput:
    session_id: str
    state: ResidualState | None = None  # when this is not the last stage
    logits: torch.Tensor | None = None  # fp32 [T or 1, vocab] from the last stage
    features: Features = dataclasses.field(default_factory=dict)  # asked layers this stage runs -> [rows, D] fp32


def check_batch(cfg: ModelConfig, start: int, end: int, batch: list[SeqInput], limit: int | None,
                 all_logits: bool = False) -> None:
    """A forward's batch as stage [start, end) takes it, checked before any session changes; `limit`: the tokens
    one forward may carry (None: no limit)."""
    if not batch or len({b.session_id for b in batch}) != len(batch):
        raise InvalidInput("a forward call needs at least one sequence and distinct session ids")
    for item in batch:  # first: the token counts below need well-formed inputs
        _check_input(cfg, start, end, item)
    if all_logits and end == cfg.num_layers and sum(b.num_tokens for b in batch) > PIECE_TOKENS:
        raise InvalidInput(f"a forward that returns every position's logits carries at most {PIECE_TOKENS} "
                           "tokens (what the plan holds logits for): send it in pieces")
    tokens = sum(b.num_tokens for b in batch)
    if limit is not None and tokens > limit:
        raise InvalidInput(f"this forward carries {tokens} tokens; stage [{start}, {end}) was sized for "
                           f"at most {limit} per forward: send longer prompts in chunks")


def _check_input(cfg: ModelConfig, start: int, end: int, item: SeqInput) -> None:
    if item.cache_len < 0:
        raise InvalidInput(f"session {item.session_id!r}: negative cache_len")
    if start == 0:
        ids = item.ids
        if ids is None or ids.dim() != 1 or ids.numel() == 0 or ids.dtype not in (torch.int32, torch.int64):
            raise InvalidInput("stage 0 takes a non-empty 1-D integer tensor of token ids")
        if bool(((ids < 0) | (ids >= cfg.vocab_size)).any()):
            raise InvalidInput(f"token ids must be in [0, {cfg.vocab_size})")
    else:
        st, d, n = item.state, cfg.hidden_size, cfg.blocks_entering(start)
        if st is None:
            raise InvalidInput(f"stage [{start}, {end}) takes a residual state, not token ids")
        t = st.P.shape[0] if st.P.dim() else 0
        if st.P.shape != (t, d) or st.B.shape != (t, n, d) or t == 0:
            raise InvalidInput(f"residual state must be P [T, {d}] and B [T, {n}, {d}] with T > 0; got "
                               f"P {list(st.P.shape)}, B {list(st.B.shape)}")
        if not (torch.isfinite(st.P).all() and torch.isfinite(st.B).all()):
            raise InvalidInput("residual state contains NaN or Inf")
    if item.speculative and item.num_tokens > SPECULATIVE_TOKENS:
        raise InvalidInput(f"session {item.session_id!r}: a speculative forward verifies at most "
                           f"{SPECULATIVE_TOKENS} tokens (what a plan for drafting holds room for)")
    if item.features is not None:
        item.features.check(cfg.num_layers, f"session {item.session_id!r}")
    if item.speculative and item.save_at:
        raise InvalidInput(f"session {item.session_id!r}: a speculative forward cannot be kept as a prefix (its "
                           "drafts are not decided yet)")
    _check_save_at(item)


def _check_save_at(item: SeqInput) -> None:
    """The states a forward keeps: past the cache, within the forward, each under an id of its own."""
    end = item.cache_len + item.num_tokens
    if any(not item.cache_len < n <= end or not prefix_id for n, prefix_id in item.save_at) \
            or len({prefix_id for _, prefix_id in item.save_at}) != len(item.save_at):
        raise InvalidInput(f"session {item.session_id!r}: save_at names token counts in ({item.cache_len}, {end}] "
                           "(past the cache, within this forward), each under an id of its own")
