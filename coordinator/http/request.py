"""The one generation request every HTTP API maps its body to (`GenerationRequest`: the prompt, as chat messages or
raw text or ids, the sampling and limits, the chat options), and what reading any API's body needs: the typed field
reader, the served model's name, the common sampling fields, the limits, and `ApiError`, a refusal that each
adapter (openai_api.py, anthropic_api.py, ollama_api.py, responses_api.py) answers in its own API's shape.

The adapters depend on this module and on nothing of each other's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltafin.coordinator.engine.generation import Generation
from deltafin.errors import DeltafinError, SamplingError
from deltafin.expert_modes import parse as parse_mode
from deltafin.text.chat import ChatOptions
from deltafin.text.drafting import MODES
from deltafin.text.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512  # a stop string's length (matching is linear in it; no client needs more)


class ApiError(Exception):
    """A request's refusal: its HTTP status, message, kind (OpenAI's error types name them) and the parameter at
    fault; each API's adapter gives it its own shape (`error_body`)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def bad(param: str | None, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ---- reading fields ------------------------------------------------------------------------------------

_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object",
               list: "an array"}


def as_float(value: int | float, name: str) -> float:
    """A JSON number as a float; one too large (hundreds of digits) is a 400 naming `name`."""
    try:
        return float(value)
    except OverflowError:
        raise bad(name, f"'{name}' is out of range") from None


def _json_type(value: Any) -> str:
    for kind, name in [(bool, "a boolean"), *_TYPE_NAMES.items()]:
        if isinstance(value, kind):
            return name
    return "null" if value is None else type(value).__name__


def json_field(body: dict[str, Any], name: str, kind: type, default: Any = None) -> Any:
    """body[name] checked against a JSON type; absent or null gives the default."""
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return as_float(value, name)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise bad(name, f"'{name}' must be {_TYPE_NAMES[kind]}, got {_json_type(value)}")
    return value


@dataclass(frozen=True)
class Params:
    """What chat and text completions share."""

    model: str
    max_tokens: int | None
    sampling: SamplingParams
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    speculative: str | None = None  # none | ngram | draft for this request; None: the server's --speculative
    expert_mode: str | None = None  # the expert mode the request expects, in its one spelling (None: the server's);
    # a server runs the one it was started with (--expert-mode): any other is refused (server.py)

    @property
    def generation(self) -> Generation:
        """How the engine continues the prompt, as these parameters say."""
        return Generation(self.max_tokens, self.sampling, tuple(self.stop), self.ignore_eos,
                          speculative=self.speculative)


def served_model(requested: str, served: str, strict: bool) -> str:
    """The name a response carries: the served one, whatever name the request used (clients configured with
    their own model names work), unless `strict` (`--strict-model-name`): then another name is a 404."""
    if strict and requested != served:
        raise ApiError(404, f"The model '{requested}' does not exist; this server serves '{served}'",
                       param="model", code="model_not_found")
    return served


def common_params(body: dict[str, Any], served: str, strict: bool, logprobs: int | None = None) -> Params:
    """A body's model, limits, sampling and streaming in the names OpenAI's chat and text completions, its
    Responses API, vLLM and llama.cpp's servers share (`max_tokens`, `temperature`, `top_p`, `stop`, ...)."""
    model = served_model(json_field(body, "model", str, served), served, strict)  # (left out: the served one)
    n = json_field(body, "n", int, 1)
    if n != 1:
        raise bad("n", "only n=1 is supported: Deltafin generates one choice per request")
    if json_field(body, "best_of", int, 1) != 1:
        raise bad("best_of", "only best_of=1 is supported")
    max_tokens = json_field(body, "max_completion_tokens", int, None)
    if max_tokens is None:
        max_tokens = json_field(body, "max_tokens", int, None)
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is not None and max_tokens < 1:
        raise bad(param, f"'{param}' must be at least 1, got {max_tokens}")
    stream = json_field(body, "stream", bool, False)
    options = json_field(body, "stream_options", dict, None)
    if options is not None and not stream:
        raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    include_usage = bool(options and json_field(options, "include_usage", bool, False))
    speculative = json_field(body, "speculative", str, None)
    if speculative is not None and speculative not in MODES:
        raise bad("speculative", f"'speculative' must be one of {', '.join(MODES)}, got {speculative!r}")
    return Params(model, max_tokens, _sampling(body, logprobs), _stops(body), stream, include_usage,
                  json_field(body, "ignore_eos", bool, False), speculative, expert_mode_field(body, "expert_mode"))


def check_expert_mode(p: Params, served: str, param: str) -> None:
    """A request may name the expert mode its server runs (`served`, its --expert-mode), and no other."""
    if p.expert_mode is not None and p.expert_mode != served:
        raise bad(param, f"this server runs expert mode {served!r} (its --expert-mode): a request cannot ask for "
                  f"{p.expert_mode!r}")


def expert_mode_field(body: dict[str, Any], param: str) -> str | None:
    """Deltafin's `expert_mode` (deltafin/expert_modes.py) in its one spelling; None where the body has none."""
    value = json_field(body, param.rpartition(".")[2], str, None)
    if value is None:
        return None
    try:
        return parse_mode(value).name
    except DeltafinError as e:
        raise bad(param, f"'{param}': {str(e).removeprefix('--expert-mode: ')}") from None


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad("stop", "'stop' must be a string or an array of strings")
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad("stop", f"'stop' takes up to {MAX_STOP_STRINGS} non-empty strings of up to {MAX_STOP_CHARS} "
                  "characters")
    return stops


def _sampling(body: dict[str, Any], logprobs: int | None) -> SamplingParams:
    bias_in = json_field(body, "logit_bias", dict, {})
    try:
        bias = tuple((int(k), float(v)) for k, v in bias_in.items())
    except (TypeError, ValueError, OverflowError):
        raise bad("logit_bias", "'logit_bias' maps token ids (strings of integers) to numbers") from None
    try:
        return SamplingParams(
            temperature=json_field(body, "temperature", float, 1.0), top_p=json_field(body, "top_p", float, 1.0),
            top_k=max(0, json_field(body, "top_k", int, 0)),  # vLLM spells "off" as -1
            min_p=json_field(body, "min_p", float, 0.0),
            repetition_penalty=json_field(body, "repetition_penalty", float, 1.0),
            presence_penalty=json_field(body, "presence_penalty", float, 0.0),
            frequency_penalty=json_field(body, "frequency_penalty", float, 0.0),
            seed=json_field(body, "seed", int, None), logprobs=logprobs, logit_bias=bias)
    except SamplingError as e:
        raise bad(e.param, str(e)) from None


@dataclass(frozen=True)
class GenerationRequest:
    """What a request asks, whatever its API: a chat (`messages`, rendered with `options`) or a raw prompt (`prompt`
    text, or `prompt_ids` where the request gave ids), and how to generate (`params`)."""

    params: Params
    messages: list[dict[str, Any]] | None  # OpenAI-style chat messages, as deltafin.text.chat renders them; None: raw
    options: ChatOptions = field(default_factory=lambda: ChatOptions(thinking=False, effort=None))
    prompt: str = ""  # a raw prompt's text
    prompt_ids: list[int] | None = None  # a raw prompt's ids, where the request gave them or tokenized them
    top_logprobs: int | None = None  # a chat's logprobs: None for none, else the alternatives a token
    echo: bool = False  # a raw prompt's text before the completion (OpenAI's text completions)
    context: int | None = None  # a context this request asks for (Ollama's num_ctx), within the server's
