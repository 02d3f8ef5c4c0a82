"""K3's chat format ("XTML", K3_SPEC §7): render conversations to tokens, parse the model's output back.

A tag is `<|open|>TAG attr="v"...<|sep|>` ... `<|close|>TAG<|sep|>`; every message ends with
`<|end_of_msg|>`. Rendering follows llama.cpp's `Kimi-K3.jinja` (tested against it): optional tool
declaration, the thinking-effort system message, the messages, then the generation prompt
`<|open|>message role="assistant"<|sep|><|open|>think<|sep|>` (or `response`). Markers are encoded as
special tokens; all other text with specials disabled, so a user typing `<|open|>` gets plain BPE.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deltafin.errors import ChatFormatError
from deltafin.text.tokenizer import K3Tokenizer

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
BREAKPOINT = ""  # a cache breakpoint inside a message: a segment of no text (encode_with_boundaries)
IMAGE = "<|kimi_image_placeholder|>"
MARKERS = (OPEN, CLOSE, SEP, EOM, IMAGE)
EFFORTS = ("low", "high", "max")
# What the server and `deltafin-coordinator chat` ask for when a request does not say. The chat template's
# own default is max; at a fraction of a token per second, max effort's long thinking costs a user hours
# before the answer starts (README, Defaults).
SERVING_EFFORT = "low"
SERVING_MAX_TOKENS = 1024  # a chat reply's length when the request does not say: ~1.5 h at 0.2 tok/s
TOOLS_HEADER = "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
DYNAMIC_TOOLS_HEADER = ("## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
                        "You have access to all existing and extended tools.\nHere are the specs for the extended "
                        "tools.\n\n```json\n")
EFFORT_TEXT = ("`thinking_effort` guides on how much to think in your thinking channel (not including the response "
               "channel), supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked "
               "with `thinking_effort={}`.")
JSON_ONLY = ("The system is invoked with `response_format=json_object`.\nYour response must be raw JSON data "
             "without markdown code blocks (```json) or any additional formatting.")
JSON_SCHEMA = ("The system is invoked with `response_format=json_schema`.\nYour response must be raw JSON data "
               "without markdown code blocks (```json) or any additional formatting.\nThe JSON data must match the "
               "following schema:\n```json\n{}\n```")




@dataclass(frozen=True)
class ChatOptions:
    thinking: bool = True
    effort: str | None = "max"  # low | high | max; None: no thinking-effort message
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | None = None  # "required" | "none" | None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True


Segment = tuple[str, bool]  # (text, is a special marker)


class _Out:
    def __init__(self) -> None:
        self.parts: list[Segment] = []

    def special(self, s: str) -> None:
        self.parts.append((s, True))

    def text(self, s: str) -> None:
        if s:
            self.parts.append((s, False))

    def breakpoint(self) -> None:
        """A cache breakpoint here (Anthropic's `cache_control` on a block): an empty marker, no text."""
        self.parts.append((BREAKPOINT, True))

    def open(self, tag: str, attrs: Iterable[tuple[str, Any]] = ()) -> None:
        self.special(OPEN)
        self.text(tag + "".join(f' {k}="{_escape(v)}"' for k, v in attrs))
        self.special(SEP)

    def close(self, tag: str) -> None:
        self.special(CLOSE)
        self.text(tag)
        self.special(SEP)


def _escape(value: Any) -> str:
    return _str(value).replace("&", "&amp;").replace('"', "&quot;")


def _str(value: Any) -> str:
    """Jinja's `string` filter: Python's str, except None/True/False as Python spells them."""
    return str(value)


def json_sorted(value: Any) -> str:
    """Compact JSON with keys sorted case-insensitively at every level (the template's dictsort)."""
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: str(kv[0]).lower())
        return "{" + ",".join(f"{json.dumps(k, ensure_ascii=False)}:{json_sorted(v)}" for k, v in items) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(json_sorted(v) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


def _xtml_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _content(out: _Out, content: Any) -> None:
    if content is None:
        return
    if isinstance(content, str):
        out.text(content)
        return
    if not isinstance(content, list):
        raise ChatFormatError("message content must be a string or a list of parts")
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("image", "image_url"):
            out.special(IMAGE)
        elif kind == "text" or (isinstance(part, dict) and "text" in part):
            out.text(_str(part.get("text", "")))
            if part.get("cache_control"):
                out.breakpoint()
        else:
            raise ChatFormatError(f"unsupported content part {kind!r}: Deltafin serves K3's text model")


def _internal(out: _Out, kind: str, body: str) -> None:
    out.open("message", [("role", "system"), ("type", kind)])
    out.text(body.strip())
    out.close("message")
    out.special(EOM)


def _tool_declare(out: _Out, tools: Any, dynamic: bool = False) -> None:
    out.open("message", [("role", "system"), ("type", "tool-declare")])
    out.text((DYNAMIC_TOOLS_HEADER if dynamic else TOOLS_HEADER) + json_sorted(tools) + "\n```")
    out.close("message")
    out.special(EOM)


def _function(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    return fn if isinstance(fn, dict) else call


def _assistant(out: _Out, msg: dict[str, Any], thinking: bool) -> None:
    if thinking:
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        out.open("think")
        if reasoning is not None and _str(reasoning).strip():
            out.text(_str(reasoning))
        out.close("think")
    out.open("response")
    _content(out, msg.get("content"))
    out.close("response")
    calls = msg.get("tool_calls")
    if not calls:
        return
    out.open("tools")
    for i, call in enumerate(calls, 1):
        if not isinstance(call, dict):
            raise ChatFormatError("Kimi K3 tool calls must be mappings")
        fn = _function(call)
        if fn.get("name") is None:
            raise ChatFormatError("Kimi K3 tool calls require a function name")
        out.open("call", [("tool", fn["name"]), ("index", i)])
        args = fn.get("arguments", {})
        if fn.get("_xtml_json_block") is not None:
            out.open("json", [("type", "object")])
            out.text(_str(fn["_xtml_json_block"]))
            out.close("json")
        elif isinstance(args, dict):
            for key, value in args.items():
                out.open("argument", [("key", key), ("type", _xtml_type(value))])
                out.text(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))
                out.close("argument")
        elif isinstance(args, str) and args.strip():
            out.open("json", [("type", "object")])
            out.text(args)
            out.close("json")
        elif args is not None and not isinstance(args, str):
            raise ChatFormatError("Kimi K3 tool call arguments must be a mapping or a JSON object string")
        out.close("call")
    out.close("tools")


@dataclass
class _State:
    tool_calls: list | None = None
    tool_index: int = 0


def _tool_message(out: _Out, msg: dict[str, Any], state: _State, resolved: str | None = None) -> None:
    state.tool_index += 1
    name = resolved if resolved is not None else msg["tool"] if "tool" in msg else msg.get("name")
    if name is None and state.tool_calls is not None and state.tool_index <= len(state.tool_calls):
        name = _function(state.tool_calls[state.tool_index - 1]).get("name")
    if name is None:
        raise ChatFormatError("Kimi K3 tool messages need a resolvable tool name: carry `tool`/`name`, or match a "
                              "preceding assistant tool_call by order")
    out.open("message", [("role", "tool"), ("tool", name), ("index", state.tool_index)])
    _content(out, msg.get("content"))
    out.close("message")
    out.special(EOM)


def _tool_run(out: _Out, run: list[dict[str, Any]], state: _State) -> None:
    """Consecutive tool messages: in the order of the assistant's calls when every one answers a call id."""
    ids = [str(c.get("id")) for c in state.tool_calls or [] if isinstance(c, dict) and c.get("id") is not None]
    answer_id = lambda m: m.get("tool_call_id", m.get("id"))
    if run and all(answer_id(m) is not None and str(answer_id(m)) in ids for m in run):
        emitted: list[str] = []
        for call in state.tool_calls or []:
            cid = call.get("id") if isinstance(call, dict) else None
            if cid is None or str(cid) in emitted:
                continue
            emitted.append(str(cid))
            for m in run:
                if str(answer_id(m)) == str(cid):
                    _tool_message(out, m, state, _function(call).get("name"))
    else:
        for m in run:
            _tool_message(out, m, state)


def render(messages: list[dict[str, Any]], options: ChatOptions = ChatOptions()) -> list[Segment]:
    o = options
    if o.thinking and o.effort is not None and o.effort not in EFFORTS:
        raise ChatFormatError(f"unsupported thinking effort {o.effort!r}; supported values are low, high and max")
    out, state = _Out(), _State()
    if o.tools:
        _tool_declare(out, o.tools)
    if o.thinking and o.effort in EFFORTS:
        _internal(out, "thinking-effort", EFFORT_TEXT.format(o.effort))
    i = 0
    while i < len(messages):
        msg = messages[i]
        if not isinstance(msg, dict) or "role" not in msg:
            raise ChatFormatError("Kimi K3 messages require a role")
        role = msg["role"]
        if role == "tool":
            run = []
            while i < len(messages) and isinstance(messages[i], dict) and messages[i].get("role") == "tool":
                run.append(messages[i])
                i += 1
            _tool_run(out, run, state)
            continue
        named = [("name", msg["name"])] if msg.get("name") else []
        if role in ("user", "system") and not (role == "system" and msg.get("tools")):
            out.open("message", [("role", role), *named])
            _content(out, msg.get("content"))
            out.close("message")
            out.special(EOM)
        elif role == "system":
            _tool_declare(out, msg["tools"], dynamic=True)
        elif role == "assistant":
            state.tool_calls, state.tool_index = msg.get("tool_calls"), 0
            out.open("message", [("role", "assistant"), *named])
            _assistant(out, msg, o.thinking)
            out.close("message")
            out.special(EOM)
        else:
            raise ChatFormatError(f"unknown message role {role!r} (expected system, user, assistant or tool)")
        i += 1
    if o.tool_choice == "required":
        _internal(out, "tool-choice", "The system is invoked with `tool_choice=required`.\nYou MUST call tools in "
                  "the next message.")
    elif o.tool_choice == "none":
        _internal(out, "tool-choice", "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools "
                  "in the next message.")
    _response_format(out, o.response_format)
    if o.add_generation_prompt:
        out.open("message", [("role", "assistant")])
        out.open("think" if o.thinking else "response")
    return out.parts


def _response_format(out: _Out, fmt: dict[str, Any] | None) -> None:
    if not fmt:
        return
    kind = fmt.get("type")
    if kind == "json_object":
        _internal(out, "response-format", JSON_ONLY)
    elif kind == "json_schema":
        wrapper = fmt.get("json_schema")
        if isinstance(wrapper, dict) and "schema" in wrapper:
            schema = wrapper["schema"]
        elif isinstance(wrapper, dict) and "json_schema" in wrapper:
            schema = wrapper["json_schema"]
        else:
            schema = wrapper
        _internal(out, "response-format", JSON_SCHEMA.format(json_sorted(schema)))


def render_text(messages: list[dict[str, Any]], options: ChatOptions = ChatOptions()) -> str:
    return "".join(text for text, _ in render(messages, options))


def encode(tokenizer: K3Tokenizer, messages: list[dict[str, Any]], options: ChatOptions = ChatOptions()) -> list[int]:
    return encode_with_boundaries(tokenizer, messages, options)[0]


def encode_with_boundaries(tokenizer: K3Tokenizer, messages: list[dict[str, Any]],
                           options: ChatOptions = ChatOptions()) -> tuple[list[int], list[int]]:
    """The prompt's ids and where its messages end: the token count after each end-of-message marker (the tool
    list, each system, user, assistant and tool message) and at each cache breakpoint (a text part that carries
    `cache_control`), in order. Segments are encoded one by one, so these are exact token positions: where
    conversations that share their first messages diverge (the prefix cache keeps state there)."""
    ids: list[int] = []
    ends: list[int] = []
    for text, special in render(messages, options):
        ids += tokenizer.encode(text, allow_special=special)
        if special and text in (EOM, BREAKPOINT) and (not ends or ends[-1] != len(ids)):
            ends.append(len(ids))
    return ids, ends


# ---- parsing the model's output -------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's API carries it
    index: int


def assistant_message(content: str, reasoning: str | None, tool_calls: list[ToolCall]) -> dict[str, Any]:
    """A reply as the assistant message a conversation carries on (OpenAI's shape, what `render` takes back):
    `reasoning` None leaves reasoning_content out."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    if tool_calls:
        msg["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in tool_calls]
    return msg


@dataclass
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def _parse_tag(header: str) -> tuple[str, dict[str, str]]:
    name, _, rest = header.strip().partition(" ")
    attrs: dict[str, str] = {}
    while rest.strip():
        rest = rest.strip()
        key, eq, rest = rest.partition("=")
        if not eq or not rest.startswith('"'):
            break
        value, _, rest = rest[1:].partition('"')
        attrs[key.strip()] = value.replace("&quot;", '"').replace("&amp;", "&")
    return name, attrs


class OutputParser:
    """Splits generated tokens into reasoning, response text and tool calls, incrementally.

    Starts inside the channel the generation prompt opened (think or response). Text outside any known
    element is treated as response text, so a model that ignores the format still gets its words out."""

    def __init__(self, tokenizer: K3Tokenizer, thinking: bool = True):
        self.tok = tokenizer
        self.ids = {tokenizer.specials[m]: m for m in MARKERS if m in tokenizer.specials}
        self.stack: list[tuple[str, dict[str, str]]] = [("think" if thinking else "response", {})]
        self.header: str | None = None  # reading a tag header (after <|open|> or <|close|>)
        self.closing = False
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.call: dict[str, Any] | None = None
        self.value = ""  # current argument / json text
        self.calls = 0

    def _channel(self) -> str:
        for name, _ in reversed(self.stack):
            if name in ("think", "response", "argument", "json"):
                return name
        return "response"

    def push(self, token_id: int) -> Delta:
        delta = Delta()
        marker = self.ids.get(token_id)
        if marker is None and token_id in self.tok.special_ids:
            return delta  # other specials ([EOS], reserved ids) carry no text
        if marker is None:
            text = self.utf8.decode(self.tok.token_bytes(token_id))
            if self.header is not None:
                self.header += text
            else:
                self._text(text, delta)
            return delta
        if marker in (OPEN, CLOSE):
            self._text(self.utf8.decode(b"", final=True), delta)
            self.header, self.closing = "", marker == CLOSE
        elif marker == SEP and self.header is not None:
            self._tag(self.header, self.closing, delta)
            self.header = None
        elif marker == IMAGE:
            self._text(IMAGE, delta)
        return delta

    def _text(self, text: str, delta: Delta) -> None:
        if not text:
            return
        channel = self._channel()
        if channel == "think":
            delta.reasoning += text
        elif channel in ("argument", "json"):
            self.value += text
        elif not self.stack or self.stack[-1][0] in ("response", "message", "think"):
            delta.content += text

    def _tag(self, header: str, closing: bool, delta: Delta) -> None:
        name, attrs = _parse_tag(header)
        if not closing:
            self.stack.append((name, attrs))
            if name == "call":
                self.call = {"name": attrs.get("tool", ""), "args": {}, "json": None}
            elif name in ("argument", "json"):
                self.value = ""
            return
        while self.stack and self.stack[-1][0] != name:  # tolerate unclosed inner tags
            self.stack.pop()
        if not self.stack:
            return
        _, attrs = self.stack.pop()
        if name == "argument" and self.call is not None:
            self.call["args"][attrs.get("key", "")] = _typed(self.value, attrs.get("type", "string"))
        elif name == "json" and self.call is not None:
            self.call["json"] = self.value
        elif name == "call" and self.call is not None:
            args = self.call["json"] if self.call["json"] is not None else json.dumps(self.call["args"],
                                                                                        ensure_ascii=False)
            delta.tool_calls.append(ToolCall(self.call["name"], args, self.calls))
            self.calls += 1
            self.call = None

    def flush(self) -> Delta:
        delta = Delta()
        self._text(self.utf8.decode(b"", final=True), delta)
        return delta


def _typed(text: str, kind: str) -> Any:
    if kind == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
