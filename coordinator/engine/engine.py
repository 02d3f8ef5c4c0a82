"""The serving engine: a backend, the tokenizer, the scheduler and the counters, behind one `run` call.

The HTTP API, `deltafin chat` and `deltafin-coordinator generate` all generate through `Engine.run`, so
they share the admission queue, the stop tokens, the context limit and the metrics.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deltafin.checkpoint.config import ModelConfig, load_config
from deltafin.coordinator.cluster.backend import Backend
from deltafin.coordinator.cluster.cluster_options import ClusterOptions
from deltafin.coordinator.cluster.connect import open_backend
from deltafin.coordinator.engine.events import Finished, PrefillProgress, TokenEvent
from deltafin.coordinator.engine.generation import GREEDY, Generation
from deltafin.coordinator.engine.prefix_index import PrefixIndex, PrefixSession, stage_shares
from deltafin.coordinator.engine.scheduler import Scheduler
from deltafin.coordinator.engine.serving_options import ServingOptions
from deltafin.coordinator.engine.token_loop import Request, Speculation, TextView, generate
from deltafin.errors import DeltafinError, DraftUnavailable, PromptTooLong, ShuttingDown
from deltafin.expert_modes import EXACT
from deltafin.plan.memory.sizing_options import SPECULATIVE_TOKENS
from deltafin.plan.timing.predict import forward_lengths, forward_read_bytes
from deltafin.runtime.head_drafter import DraftMemory, HeadDrafter, head_calibration, open_head
from deltafin.runtime.prefix_store import PrefixBudget
from deltafin.runtime.stage_options import StageOptions
from deltafin.runtime.worker_stats import StageStats
from deltafin.text.drafting import (
    MODES,
    Calibration,
    Cost,
    DraftLength,
    FittedCost,
    NgramDrafter,
    PlannedCost,
    default_cost,
)
from deltafin.text.sampling_params import SamplingParams
from deltafin.text.tokenizer import K3Tokenizer

log = logging.getLogger(__name__)

STOP_TOKENS = ("<|end_of_msg|>", "[EOS]")  # K3 stops on 163586 and 163585 (K3_SPEC §8)
DEFAULT_CONTEXT = 4096  # an engine over a backend that plans no context (tests' scripted models)


@dataclass
class Prefilling:
    """A request whose prompt is going into the caches: how far (tokens, expected bytes), since when."""

    progress: PrefillProgress
    started: float  # monotonic

    @property
    def done(self) -> float:
        return self.progress.tokens_done

    @property
    def total(self) -> int:
        return self.progress.tokens_total

    @property
    def seconds_left(self) -> float | None:
        """The bytes still to read at the rate read so far (None until some are)."""
        p, elapsed = self.progress, time.monotonic() - self.started
        if p.bytes_done <= 0 or elapsed <= 0:
            return None
        return (p.bytes_total - p.bytes_done) / (p.bytes_done / elapsed)


@dataclass
class Counters:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    last_tokens_per_second: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> count
    failed: int = 0
    cancelled: int = 0
    draft_tokens: int = 0  # speculative decoding: drafted tokens verified
    accepted_tokens: int = 0  # of them, taken
    forwards: int = 0  # forwards after the prefills

    def count(self, end: Finished) -> None:
        """A generation that finished."""
        self.finished[end.reason] = self.finished.get(end.reason, 0) + 1
        self.decode_seconds += end.timing.decode_s
        self.decode_steps += end.timing.decode_steps
        if end.timing.decode_steps:
            self.last_tokens_per_second = end.timing.tokens_per_second
        self.draft_tokens += end.drafting.draft_tokens
        self.accepted_tokens += end.drafting.accepted_tokens
        self.forwards += end.drafting.forwards


class Engine:
    def __init__(self, backend: Backend, tokenizer: K3Tokenizer, cfg: ModelConfig, model_name: str,
                 serving: ServingOptions | None = None, prefix_cache: bool = False, context: int | None = None):
        """`context`: tokens a request may have, where not the backend's plan's (tests over scripted models)."""
        serving = serving or ServingOptions()
        self.backend, self.tokenizer, self.cfg = backend, tokenizer, cfg
        self.model_name = model_name  # what responses carry, whatever name a request used ...
        self.model_dir: Path | None = None  # its directory (open_engine), for the routes that describe it
        self.expert_mode = EXACT  # the stages' expert mode (open_engine): a request may name no other
        self.strict_model_name = serving.strict_model_name  # ... unless this: then another name is model_not_found
        self._context = context
        self.default_max_tokens = serving.default_max_tokens  # chat requests that do not say (capped by the context)
        self.speculative, self.max_drafts = serving.speculative, serving.max_drafts  # requests that do not say
        self.draft_model = serving.draft_model  # the draft head's folder (None: the model's own draft/)
        self._draft_head: Any = None  # loaded at the first request that drafts with it
        self.draft_memory = DraftMemory()  # finished requests' draft caches, for those that resume their text
        self._cost: Cost | None = None  # what a verification pass costs (pass_cost)
        self.calibration = Calibration()  # how often the draft head's drafts are taken (draft_head: the one it ships)
        self.scheduler = Scheduler(backend, serving.max_active, serving.queue_depth, serving.pipeline_depth,
                                   serving.prefill_batches == "ride")
        self.counters = Counters()
        # token prefixes whose state the stages keep (coordinator/engine/prefix_index.py); None: every request prefills
        self.prefixes = PrefixIndex(cfg) if prefix_cache else None
        self._prefix_stages: list[PrefixBudget] = []
        self.prefilling: dict[str, Prefilling] = {}  # session id -> progress, while its prompt is prefilled
        self.started = time.time()
        self.active = 0  # requests admitted and not yet ended
        self.closing = False  # a shutdown began: no new requests
        ids = {tokenizer.specials[t] for t in STOP_TOKENS if t in tokenizer.specials}
        if cfg.eos_token_id is not None:
            ids.add(cfg.eos_token_id)
        self.stop_ids = frozenset(ids)

    @property
    def max_context(self) -> int:
        """Tokens a request may have (prompt and reply): the plan's (after a re-plan, the new one's)."""
        return self._context or getattr(self.backend, "context", None) or DEFAULT_CONTEXT

    async def run(self, prompt_ids: list[int], view: TextView, generation: Generation = GREEDY, *,
                  progress: Callable[[PrefillProgress], None] | None = None,
                  boundaries: Sequence[int] = ()) -> AsyncIterator[TokenEvent | Finished]:
        """Generate for one request as `generation` says: waits for a slot (QueueFull if the queue is full too),
        then yields the generation's events. `progress`: how far the prefill is; `boundaries`: where the prompt's
        messages and cache breakpoints end, in tokens (the prefix cache keeps state there: prefix_index.py)."""
        if self.closing:
            raise ShuttingDown("the server is shutting down: it takes no new requests")
        g = generation
        room = self._room(prompt_ids, g.max_tokens)
        req = Request(prompt_ids, g.max_tokens if g.max_tokens is not None else min(self.default_max_tokens, room),
                      g.sampling or SamplingParams(temperature=0.0), frozenset() if g.ignore_eos else self.stop_ids,
                      list(g.stop), g.return_logits, prefill_chunk=self._prefill_chunk(),
                      speculation=self._speculation(g.speculative),
                      forward_bytes=lambda tokens: forward_read_bytes(self.cfg, tokens),
                      pipelined=self.scheduler)
        req.progress = lambda p: self._track(req.session_id, p, progress)
        c = self.counters
        async with self.scheduler.slot():
            req.prefix = await self._prefix_session(prompt_ids, boundaries)  # now: what requests before it kept
            self._admitted(req)
            outcome = "cancelled"  # until the generation finishes or fails
            self.active += 1
            try:
                async for event in generate(self.scheduler.forward, self.scheduler.release, view, req):
                    if isinstance(event, Finished):
                        outcome = "finished"
                        c.count(event)
                    else:
                        c.generated_tokens += 1
                    yield event
            except Exception:
                outcome = "failed"
                raise
            finally:
                self._ended(req, outcome)

    def _ended(self, req: Request, outcome: str) -> None:
        """A request left its slot: finished (counted with its Finished), failed or cancelled."""
        self.active -= 1
        self.prefilling.pop(req.session_id, None)
        if outcome == "failed":
            self.counters.failed += 1
        elif outcome == "cancelled":
            self.counters.cancelled += 1

    def begin_shutdown(self, grace: float) -> None:
        """Take no new requests; generations still running `grace` seconds from now are ended: each one's
        forward (running or waiting) fails with ShuttingDown, which `run` raises after releasing its sessions and
        the API turns into an ending its clients read (a stream's error event, a 503)."""
        self.closing = True
        error = ShuttingDown("the server is shutting down: this generation was ended before it finished "
                             "(--shutdown-grace)")
        asyncio.get_running_loop().call_later(grace, self.scheduler.end, error)

    async def drained(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until no request is running; whether none is."""
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.active

    def _admitted(self, req: Request) -> None:
        """A request got its slot: counted, and with -v what its prefill will cost (tokens, forwards, reads)."""
        self.counters.requests += 1
        self.counters.prompt_tokens += len(req.prompt_ids)
        if not log.isEnabledFor(logging.DEBUG):
            return
        kept = req.prefix.cached_tokens if req.prefix is not None else 0
        left = len(req.prompt_ids) - kept
        forwards = forward_lengths(left, req.prefill_chunk or left)
        log.debug("request %s: %d prompt tokens (%d from a kept prefix), %d forward%s of up to %d tokens, about "
                  "%.2f GB of expert reads; max_tokens %d, %s", req.session_id[:8], len(req.prompt_ids), kept,
                  len(forwards), "" if len(forwards) == 1 else "s", max(forwards, default=0),
                  sum(forward_read_bytes(self.cfg, n) for n in forwards) / 1e9,
                  req.max_tokens, "greedy" if req.sampling.greedy else f"temperature {req.sampling.temperature:g}")

    def _room(self, prompt_ids: list[int], max_tokens: int | None) -> int:
        """Tokens the context has left after the prompt; PromptTooLong if that is none or less than asked."""
        if not prompt_ids:
            raise PromptTooLong("the prompt is empty")
        room = self.max_context - len(prompt_ids)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            asked = f" + max_tokens {max_tokens}" if max_tokens is not None else ""
            raise PromptTooLong(f"the prompt has {len(prompt_ids)} tokens{asked}, more than the context limit of "
                                f"{self.max_context} tokens (what the memory plan holds; --max-context N plans "
                                "for more)")
        return room

    def _track(self, session_id: str, p: PrefillProgress, progress: Callable[[PrefillProgress], None] | None
               ) -> None:
        """A prefill's progress: in `prefilling` (for /metrics) until it is done, and to the caller's callback."""
        if p.finished:
            self.prefilling.pop(session_id, None)
        else:
            now = self.prefilling.get(session_id)
            self.prefilling[session_id] = Prefilling(p, now.started if now else time.monotonic())
        if progress is not None:
            progress(p)

    async def _prefix_session(self, prompt_ids: list[int], boundaries: Sequence[int]) -> PrefixSession | None:
        """Where the request resumes (the longest kept prefix of its prompt every stage holds: index.py) and
        where it keeps state."""
        if self.prefixes is None:
            return None
        stages = list(self.backend.prefix_stages)
        if stages != self._prefix_stages:  # first use, or the cluster was planned again
            self._prefix_stages = stages
            evicted = self.prefixes.reshape(stage_shares(self.cfg, stages))
            if evicted:
                await self.scheduler.release_prefixes(evicted)
        if not self.prefixes.enabled:
            return None
        session = await PrefixSession.start(self.prefixes, self.scheduler.release_prefixes, prompt_ids,
                                            self.backend.held_prefixes, self.backend.find_prefix, boundaries)
        if session.resumed is not None:
            self.backend.resuming(session.resumed.prefix_id, list(session.resumed.tokens))
            log.debug("resuming %d of %d prompt tokens from a kept prefix%s", session.cached_tokens, len(prompt_ids),
                      " (the whole prompt: no token fed)" if session.logits is not None else "")
        return session

    def _prefill_chunk(self) -> int | None:
        """Prompt tokens per forward: what the stages take, less room for every active stream's decode step
        (with its drafts, when speculating) to ride in the same batch (scheduler.py)."""
        limit = self.backend.max_forward_tokens
        step = 1 + (self.max_drafts if self.speculative != "none" else 0)
        return None if limit is None else max(1, limit - self.scheduler.max_active * step)

    def _speculation(self, mode: str | None) -> Speculation | None:
        mode = mode or self.speculative
        if mode not in MODES:
            raise DeltafinError(f"unknown speculative mode {mode!r}: {', '.join(MODES)}")
        if mode == "none":
            return None
        limit = self.backend.max_forward_tokens
        # a pass fits one forward, and the stages' plan (sizing.SPECULATIVE_TOKENS)
        max_k = min(self.max_drafts, SPECULATIVE_TOKENS - 1, *(() if limit is None else (limit - 1,)))
        if max_k < 1:
            return None
        if mode == "draft":
            head = self.draft_head()  # first: loading it sets the calibration it ships
            return Speculation(HeadDrafter(head, self.draft_memory),
                               DraftLength(self.pass_cost(), max_k=max_k, calibration=self.calibration))
        return Speculation(NgramDrafter(), DraftLength(self.pass_cost(), max_k=max_k))

    def price_passes(self, cost: Cost) -> None:
        """Price every verification pass with `cost` from now on instead of the plan and the timed passes (the
        workload bench asks what another machine's plan would draft: drafting.reads_cost)."""
        self._cost = cost

    def pass_cost(self) -> Cost:
        """What a verification pass costs, shared by every request: the plan's prediction (in-process stages: priced
        once, their compute measured; one 64 GB Mac's split where nothing prices it: a scripted backend), then
        fitted to the passes as they are timed (drafting.FittedCost)."""
        if self._cost is None:
            priced = getattr(self.backend, "priced_plan", None)
            plan = priced() if priced is not None else None
            prior: Cost = PlannedCost(plan.verify) if plan is not None and plan.verify and plan.verify[0] > 0 \
                else default_cost(self.cfg.num_experts, self.cfg.experts_per_token)
            self._cost = FittedCost(prior, self.cfg.num_experts, self.cfg.experts_per_token, SPECULATIVE_TOKENS)
            log.info("drafting prices a decode step verifying k drafts at %s", self._cost.describe())
        return self._cost

    def draft_head(self) -> Any:
        """The learned draft head (runtime/head_drafter.py), loaded once; DeltafinError where there is none."""
        if self._draft_head is None:
            if self.model_dir is None:
                raise DraftUnavailable("--speculative draft needs the model's directory (a served model)")
            self._draft_head = open_head(self.draft_model, self.model_dir, self.cfg)
            self.calibration = head_calibration(self.draft_model, self.model_dir)
        return self._draft_head

    async def worker_stats(self) -> list[StageStats]:
        return await self.backend.stats()

    async def close(self) -> None:
        await self.scheduler.close()
        await self.backend.close()


async def open_engine(cluster: ClusterOptions, stage: StageOptions, serving: ServingOptions | None = None,
                      show_progress: bool = True) -> Engine:
    """Config and tokenizer first (fast, clear errors), then the backend, as one Engine; config.json is read
    once. `show_progress`: the load's progress and the plan on stderr (else the plan is logged)."""
    serving = serving or ServingOptions()
    asked = stage.sizing.sequences
    if asked is not None and asked < serving.max_active:  # more at once would evict each other's caches
        log.info("serving %d request(s) at once: --sequences %d plans caches for no more", asked, asked)
        serving = dataclasses.replace(serving, max_active=asked)
    cfg = load_config(cluster.model)
    tokenizer = K3Tokenizer.load(cluster.model)
    backend = await open_backend(cluster, planned_stage(stage, serving), cfg, show_progress)
    name = serving.served_model_name or Path(cluster.model).resolve().name
    engine = Engine(backend, tokenizer, cfg, name, serving, prefix_cache=True)
    engine.model_dir, engine.expert_mode = Path(cluster.model), stage.expert_mode
    if serving.speculative == "draft":  # a missing or foreign head is said before the first request
        engine.draft_head()
    if serving.speculative != "none":  # priced before the first request (in-process: its compute measured)
        await asyncio.to_thread(engine.pass_cost)
    return engine


def planned_stage(stage: StageOptions, serving: ServingOptions) -> StageOptions:
    """The stages' options as the plan needs them for this serving: caches for every request it runs at once
    (unless --sequences says; a bare one-worker plan would hold one), room for speculative forwards when
    drafting."""
    sequences = stage.sizing.sequences if stage.sizing.sequences is not None else serving.max_active
    return stage.replace(speculative_tokens=serving.speculative_tokens, sequences=sequences)
