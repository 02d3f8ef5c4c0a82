"""The chat session keeps the conversation: each turn's prompt is the whole history in K3's chat format."""

from __future__ import annotations

from deltafin.coordinator.engine.chat_session import ChatSession
from deltafin.coordinator.engine.engine import Engine
from deltafin.text.chat import ChatOptions, encode
from deltafin.text.sampling_params import SamplingParams


async def test_chat_session_keeps_the_conversation(local_engine: Engine) -> None:
    session = ChatSession(local_engine, SamplingParams(temperature=0.0), max_tokens=6, system="Be kind.",
                          thinking="off")
    try:
        first = await session.turn("hello")
        second = await session.turn("and again")
        messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "hello"},
                    {"role": "assistant", "content": first.content}, {"role": "user", "content": "and again"}]
        assert second.prompt_ids == encode(local_engine.tokenizer, messages, ChatOptions(thinking=False))
        assert first.finished is not None and first.finished.usage.completion_tokens == 6
        session.reset()
        assert session.messages == [{"role": "system", "content": "Be kind."}]
    finally:
        await local_engine.close()
