"""One terminal conversation: the messages so far and one reply per turn, generated through the Engine
(the same path as the HTTP API)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deltafin.coordinator.engine.engine import Engine
from deltafin.coordinator.engine.events import Finished
from deltafin.coordinator.engine.generation import Generation
from deltafin.coordinator.engine.report import PrefillReporter
from deltafin.text.chat import ChatOptions, OutputParser, ToolCall, assistant_message, encode_with_boundaries
from deltafin.text.sampling_params import SamplingParams


@dataclass
class Reply:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finished: Finished | None = None
    prompt_ids: list[int] = field(default_factory=list)


Sink = Callable[[str, str], None]  # (channel: "reasoning" | "content", text)


class ChatSession:
    def __init__(self, engine: Engine, sampling: SamplingParams, max_tokens: int | None = None,
                 system: str | None = None, thinking: str = "max"):
        self.engine, self.sampling, self.max_tokens = engine, sampling, max_tokens
        self.system, self.thinking = system, thinking
        self.messages: list[dict[str, Any]] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def options(self) -> ChatOptions:
        on = self.thinking != "off"
        return ChatOptions(thinking=on, effort=self.thinking if on else None)

    async def turn(self, text: str, sink: Sink | None = None) -> Reply:
        """One user message and the model's reply; the conversation keeps both once the reply finished."""
        messages = [*self.messages, {"role": "user", "content": text}]
        options = self.options()
        ids, ends = encode_with_boundaries(self.engine.tokenizer, messages, options)
        reply = Reply(prompt_ids=ids)
        parser = OutputParser(self.engine.tokenizer, thinking=options.thinking)
        async for event in self.engine.run(ids, parser, Generation(self.max_tokens, self.sampling),
                                           progress=PrefillReporter(), boundaries=ends):
            d = event.delta
            reply.reasoning += d.reasoning
            reply.content += d.content
            reply.tool_calls += d.tool_calls
            if sink is not None:
                if d.reasoning:
                    sink("reasoning", d.reasoning)
                if d.content:
                    sink("content", d.content)
            if isinstance(event, Finished):
                reply.finished = event
        assistant = assistant_message(reply.content, reply.reasoning if options.thinking else None, reply.tool_calls)
        self.messages = [*messages, assistant]
        return reply
