"""The Python API: K3 in this process or on workers, generating through the same Engine as the CLI and the HTTP
API (coordinator/engine/engine.py: one admission queue, one generation loop, the same stop tokens and prefix cache).

    import deltafin

    with deltafin.load("k3-dir", device="mps") as model:           # in this process (single-machine mode)
        out = model.generate("The capital of France is", max_tokens=16)
        print(out.text, out.finish_reason, out.usage.completion_tokens, out.timing.tokens_per_second)
        for piece in model.stream("Once upon a time", max_tokens=32):
            print(piece.text, end="", flush=True)
        reply = model.chat([{"role": "user", "content": "Hi!"}], thinking="low")
        print(reply.reasoning, reply.content)

    model = deltafin.connect("k3-dir", workers=["10.0.0.2:50051"])  # workers; discovered ones too unless
                                                                     # discover=False

Options are the coordinator's command-line options with underscores (`memory_gb=48`, `spine="int8"`,
`expert_cache_gb=8`, `max_active=2`, ...), built into the same typed options the command line builds
(ClusterOptions, StageOptions, ServingOptions), so a wrong name or value fails with the option's name before
anything loads. Generation is greedy unless `temperature` says otherwise. Every method is
synchronous and thread-safe: the engine runs on an event loop of its own thread, so several threads may generate
at once (they are batched, up to `max_active`). Errors are `deltafin.errors.DeltafinError` subclasses.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import re
import threading
from collections.abc import Coroutine, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from deltafin.coordinator.cluster.cluster_options import ClusterOptions
from deltafin.coordinator.engine.engine import open_engine
from deltafin.coordinator.engine.events import Finished
from deltafin.coordinator.engine.generation import Generation
from deltafin.coordinator.engine.serving_options import ServingOptions
from deltafin.coordinator.engine.token_loop import PlainText
from deltafin.errors import DeltafinError
from deltafin.options import from_values, option_names
from deltafin.paths import model_path as resolve_model_path
from deltafin.runtime.stage_options import StageOptions, stage_option_names, stage_options
from deltafin.runtime.worker_stats import StageStats
from deltafin.text.chat import (
    EFFORTS,
    SERVING_MAX_TOKENS,
    ChatOptions,
    OutputParser,
    ToolCall,
    assistant_message,
    encode_with_boundaries,
)
from deltafin.text.sampling_params import SamplingParams

log = logging.getLogger(__name__)

T = TypeVar("T")
THINKING = (*EFFORTS, "off")
_DONE = object()  # the end of a stream's events
SAMPLING = option_names(SamplingParams) - {"logprobs", "logit_bias"}  # a call's sampling keywords
# the flags named otherwise than their fields, as keywords too: every flag's name with underscores is an option
ALIASES = {"threads": "read_threads", "policy": "cache_policy", "max_context": "context"}
SWITCHES_OFF = {"no_prefetch": "prefetch", "no_discover": "discover", "no_recovery": "recovery",
                "no_expert_heat": "expert_heat"}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens resumed from a kept prefix instead of prefilled


@dataclass(frozen=True)
class Timing:
    prefill_s: float  # the prompt's forwards, to the first token
    decode_s: float  # every later forward
    decode_steps: int  # forwards after the prefill

    @property
    def tokens_per_second(self) -> float:
        return 0.0 if self.decode_s <= 0 else self.decode_steps / self.decode_s


@dataclass(frozen=True)
class Completion:
    """A finished generation: its text, the generated ids (the stop token that ended it not among them), why it
    ended ("stop": a stop token or string; "length": max_tokens or the context), and what it cost."""

    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    timing: Timing
    prompt_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ChatReply(Completion):
    """A chat turn's reply: `text` is the answer (`content`), `reasoning` what K3 thought first, `tool_calls` the
    calls it made (finish_reason "tool_calls"). `message` is the assistant message to append to the conversation."""

    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def content(self) -> str:
        return self.text

    @property
    def message(self) -> dict[str, Any]:
        return assistant_message(self.text, self.reasoning or None, self.tool_calls)


@dataclass(frozen=True)
class Piece:
    """One step of a stream: the text it added (`reasoning` and `tool_calls` in chat), the token (None for text
    held back until the end); the last piece has `finish_reason` and `completion`, the whole result."""

    text: str
    token_id: int | None = None
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    completion: Completion | None = None


class _Loop:
    """An event loop on a thread of its own, for the engine; coroutines are submitted to it from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="deltafin-engine", daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.submit(coro).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


def model_options(model_path: str | Path, options: dict[str, Any],
                  **fixed: Any) -> tuple[ClusterOptions, StageOptions, ServingOptions]:
    """The typed values `load` and `connect` open a model with: the user's keyword `options`, named as
    `deltafin-coordinator --model DIR ... serve` names its flags (with underscores), and what the call itself says
    (`fixed`); the same values the coordinator builds from its flags, checked before anything loads."""
    known = (option_names(ClusterOptions, ServingOptions) | stage_option_names() | set(ALIASES) | set(SWITCHES_OFF))
    known -= {"model", "local", *fixed}
    for name in options:
        if name not in known:
            raise DeltafinError(f"unknown option {name!r}; the options are: {', '.join(sorted(known))}")
    values = {ALIASES.get(k, k): v for k, v in options.items() if k not in SWITCHES_OFF}
    values.update({SWITCHES_OFF[k]: not v for k, v in options.items() if k in SWITCHES_OFF})
    values.update(fixed, model=str(resolve_model_path(model_path)))
    try:
        return ClusterOptions.of(values), stage_options(values), from_values(ServingOptions, values)
    except DeltafinError as e:  # the flags' names, as the keywords they are here
        raise DeltafinError(re.sub(r"--([a-z][a-z0-9-]*)", lambda m: m.group(1).replace("-", "_"), str(e))) from None


def _sampling(options: dict[str, Any]) -> SamplingParams:
    """SamplingParams from a call's keywords (greedy unless `temperature` says otherwise)."""
    unknown = set(options) - SAMPLING
    if unknown:
        raise DeltafinError(f"unknown sampling option {sorted(unknown)[0]!r}; they are: {', '.join(sorted(SAMPLING))}")
    return SamplingParams(**{"temperature": 0.0, **options})


def _chat_options(thinking: str, tools: list[dict[str, Any]] | None, tool_choice: str | None,
                  response_format: dict[str, Any] | None) -> ChatOptions:
    if thinking not in THINKING:
        raise DeltafinError(f"thinking must be one of {', '.join(THINKING)}, got {thinking!r}")
    on = thinking != "off"
    return ChatOptions(thinking=on, effort=thinking if on else None, tools=tools, tool_choice=tool_choice,
                       response_format=response_format)


class Model:
    """K3 ready to generate: from `deltafin.load` (this process) or `deltafin.connect` (workers). Close it (or use
    it as a context manager) to free the stages' memory or the workers' sessions."""

    def __init__(self, cluster: ClusterOptions, stage: StageOptions, serving: ServingOptions, progress: bool = True):
        self._loop = _Loop()
        try:
            self.engine = self._loop.run(open_engine(cluster, stage, serving, show_progress=progress))
        except BaseException:
            self._loop.stop()
            raise
        self.tokenizer = self.engine.tokenizer
        self.config = self.engine.cfg
        self.name = self.engine.model_name
        self._closed = False

    # ---- text ---------------------------------------------------------------------------------------------

    def generate(self, prompt: str | list[int], max_tokens: int | None = 256, *, stop: list[str] | None = None,
                 speculative: str | None = None, **sampling: Any) -> Completion:
        """Continue `prompt` (text, or token ids) by up to `max_tokens` tokens (None: until a stop token or the
        context's end). `speculative`: "ngram" or "none" for this call (None: the model's option). `sampling`:
        SamplingParams' fields (`temperature`, `top_p`, `top_k`, `min_p`, the penalties, `seed`; greedy unless
        `temperature` says otherwise)."""
        *_, last = self.stream(prompt, max_tokens, stop=stop, speculative=speculative, **sampling)
        assert last.completion is not None
        return last.completion

    def stream(self, prompt: str | list[int], max_tokens: int | None = 256, *, stop: list[str] | None = None,
               speculative: str | None = None, **sampling: Any) -> Iterator[Piece]:
        """`generate`, a token at a time; leaving the loop early stops the generation and frees its sessions."""
        ids = self._prompt_ids(prompt)
        return self._pieces(ids, PlainText(self.tokenizer), max_tokens, _sampling(sampling), stop, speculative,
                            chat=False)

    # ---- chat ---------------------------------------------------------------------------------------------

    def chat(self, messages: list[dict[str, Any]], max_tokens: int | None = SERVING_MAX_TOKENS, *,
             thinking: str = "low", tools: list[dict[str, Any]] | None = None, tool_choice: str | None = None,
             response_format: dict[str, Any] | None = None, stop: list[str] | None = None,
             speculative: str | None = None, **sampling: Any) -> ChatReply:
        """The assistant's reply to `messages` (OpenAI-style dicts: system, user, assistant with tool_calls,
        tool), rendered in K3's chat format. `thinking`: low | high | max (the effort K3 is told) or off;
        `sampling` as for `generate`."""
        *_, last = self.chat_stream(messages, max_tokens, thinking=thinking, tools=tools, tool_choice=tool_choice,
                                    response_format=response_format, stop=stop, speculative=speculative,
                                    **sampling)
        assert isinstance(last.completion, ChatReply)
        return last.completion

    def chat_stream(self, messages: list[dict[str, Any]], max_tokens: int | None = SERVING_MAX_TOKENS, *,
                    thinking: str = "low", tools: list[dict[str, Any]] | None = None,
                    tool_choice: str | None = None, response_format: dict[str, Any] | None = None,
                    stop: list[str] | None = None, speculative: str | None = None,
                    **sampling: Any) -> Iterator[Piece]:
        """`chat`, a token at a time: each piece's `reasoning`, `text` (the answer) and `tool_calls`."""
        options = _chat_options(thinking, tools, tool_choice, response_format)
        ids, ends = encode_with_boundaries(self.tokenizer, messages, options)
        return self._pieces(ids, OutputParser(self.tokenizer, thinking=options.thinking), max_tokens,
                            _sampling(sampling), stop, speculative, chat=True, boundaries=ends)

    # ---- the engine -----------------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab = self.tokenizer.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise DeltafinError(f"a prompt of token ids takes ints in 0..{vocab - 1}")
        return ids

    def _pieces(self, ids: list[int], view: Any, max_tokens: int | None, sampling: SamplingParams,
                stop: list[str] | None, speculative: str | None, chat: bool,
                boundaries: list[int] | None = None) -> Iterator[Piece]:
        """Run the engine's generation on its loop; its events come through a queue to this thread."""
        if self._closed:
            raise DeltafinError("this model is closed")
        if max_tokens is not None and max_tokens < 1:
            raise DeltafinError(f"max_tokens must be at least 1, got {max_tokens}")
        events: queue.Queue = queue.Queue()

        async def run() -> None:
            try:
                async for event in self.engine.run(ids, view, Generation(max_tokens, sampling, tuple(stop or ()),
                                                                              speculative=speculative),
                                                   boundaries=boundaries or ()):
                    events.put(event)
            except Exception as e:  # to the caller's thread (a cancellation is the caller's own doing)
                events.put(e)
                return
            events.put(_DONE)

        future = self._loop.submit(run())
        try:
            yield from self._collect(events, ids, chat)
        finally:
            if not future.done():  # the caller left early: stop the generation, free its sessions
                future.cancel()

    def _collect(self, events: queue.Queue, ids: list[int], chat: bool) -> Iterator[Piece]:
        """The engine's events as pieces, the last with the whole result."""
        out_ids: list[int] = []
        text: list[str] = []
        reasoning: list[str] = []
        calls: list[ToolCall] = []
        while (event := events.get()) is not _DONE:
            if isinstance(event, BaseException):
                raise event
            d = event.delta
            text.append(d.content)
            reasoning.append(d.reasoning)
            calls += d.tool_calls
            if isinstance(event, Finished):
                yield Piece(d.content, None, d.reasoning, d.tool_calls, self._reason(event.reason, calls, chat),
                            self._completion(event, ids, out_ids, text, reasoning, calls, chat))
                continue
            if not event.stop:
                out_ids.append(event.token_id)
            yield Piece(d.content, event.token_id, d.reasoning, d.tool_calls)

    @staticmethod
    def _reason(reason: str, calls: list[ToolCall], chat: bool) -> str:
        return "tool_calls" if chat and calls and reason == "stop" else reason

    def _completion(self, end: Any, ids: list[int], out_ids: list[int], text: list[str], reasoning: list[str],
                    calls: list[ToolCall], chat: bool) -> Completion:
        usage = Usage(end.usage.prompt_tokens, end.usage.completion_tokens, end.usage.cached_tokens)
        timing = Timing(end.timing.prefill_s, end.timing.decode_s, end.timing.decode_steps)
        reason = self._reason(end.reason, calls, chat)
        if chat:
            return ChatReply("".join(text), out_ids, reason, usage, timing, ids, "".join(reasoning), list(calls))
        return Completion("".join(text), out_ids, reason, usage, timing, ids)

    def stats(self) -> list[StageStats]:
        """Each stage's counters (and each wide expert holder's), cumulative since it was loaded: forwards, seconds
        of compute, of waiting on the disk and on other holders, expert cache hits and bytes read, its plan
        (`StageStats`; `.as_dict()` is its JSON, as `/v1/status` and `--json` show it)."""
        return self._loop.run(self.engine.worker_stats())

    def close(self) -> None:
        """Free the stages (in this process) or the sessions and connections (workers); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._loop.run(self.engine.close())
        finally:
            self._loop.stop()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load(model_path: str | Path, device: str = "auto", *, progress: bool = True, **options: Any) -> Model:
    """K3 in this process (single-machine mode, `deltafin-coordinator --local`): `device` auto | cpu | mps | cuda;
    `options` as the coordinator's (`local_stages=2`, `memory_gb=48`, `dtype="bf16"`, `spine="int8"`, ...).
    `progress`: show the load's progress on stderr."""
    return Model(*model_options(model_path, options, local=True, device=device), progress)


def connect(model_path: str | Path, workers: list[str] | None = None, *, discover: bool = True,
            progress: bool = True, **options: Any) -> Model:
    """K3 on `deltafin-worker`s: the ones at `workers` (HOST:PORT) and, unless `discover=False`, those found on
    the network; the coordinator plans the stages as `deltafin-coordinator` does. `model_path` is the checkpoint
    directory the workers have too (its config and tokenizer are read here)."""
    if not workers and not discover:
        raise DeltafinError("no workers: give their addresses (workers=[...]) or let them be discovered")
    return Model(*model_options(model_path, options, worker=list(workers or []), discover=discover), progress)


class KimiK3Engine:
    """A two-call interface for scripts written against one: `KimiK3Engine(model_path=..., device="mps")`, then
    `engine.generate(prompt, max_length=100)` gives the generated text (up to `max_length` new tokens, greedy
    unless `temperature` is given). `engine.model` is the full `Model` API."""

    def __init__(self, model_path: str | Path, device: str = "auto", **options: Any):
        self.model = load(model_path, device, **options)

    def generate(self, prompt: str, max_length: int = 100, **sampling: Any) -> str:
        return self.model.generate(prompt, max_length, **sampling).text

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> KimiK3Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
