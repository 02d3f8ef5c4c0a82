"""What the HTTP API's tests share: the independent argmax reference, and a scripted 'model' whose output is
a known token sequence (K3's think tags, response text, tool calls) for checking the response plumbing."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from deltafin.errors import ClusterUnavailable
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.runtime.stage_io import SeqInput, SeqOutput
from deltafin.text.tokenizer import K3Tokenizer

MARKERS = ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>")


def argmax_loop(pipe: LocalPipeline, ids: list[int], n: int, stop: set[int]) -> tuple[list[int], list[torch.Tensor]]:
    """The reference: prefill, then feed back the argmax, n times or until a stop id."""
    sid = uuid.uuid4().hex
    out, rows = [], []
    logits = pipe.forward([SeqInput(sid, 0, ids=torch.tensor(ids))])[0].logits
    try:
        for i in range(n):
            row = logits[-1].float()
            t = int(row.argmax())
            out.append(t)
            rows.append(row)
            if t in stop:
                break
            logits = pipe.forward([SeqInput(sid, len(ids) + i, ids=torch.tensor([t]))])[0].logits
    finally:
        pipe.release(sid)
    return out, rows


def stop_ids(tok: K3Tokenizer) -> set[int]:
    return {tok.specials["<|end_of_msg|>"], tok.specials["[EOS]"]}


def script_ids(tok: K3Tokenizer, text: str) -> list[int]:
    """The tokens of `text` as the model writes them: K3's markers as special tokens, the rest as text."""
    out, buf, i = [], "", 0
    while i < len(text):
        m = next((m for m in MARKERS if text.startswith(m, i)), None)
        if m is None:
            buf += text[i]
            i += 1
            continue
        out += tok.encode(buf) if buf else []
        out += tok.encode(m, allow_special=True)
        buf, i = "", i + len(m)
    return out + (tok.encode(buf) if buf else [])


class ScriptedBackend:
    """A 'model' that emits a fixed token sequence (one-hot logits), then repeats its last token."""

    max_forward_tokens: int | None = None
    parallel_stages = 1

    def __init__(self, vocab: int, script: list[int]):
        self.vocab, self.script = vocab, script
        self.pos: dict[str, int] = {}
        self.released: list[str] = []

    async def forward(self, batch: list[SeqInput], all_logits: bool = False, progress=None) -> list[SeqOutput]:
        out = []
        for b in batch:
            i = self.pos.get(b.session_id, 0)
            self.pos[b.session_id] = i + 1
            logits = torch.full((1, self.vocab), -10.0)
            logits[0, self.script[min(i, len(self.script) - 1)]] = 10.0
            out.append(SeqOutput(b.session_id, logits=logits))
        return out

    async def release(self, session_ids: list[str], keep_as: list[str] | None = None, keep_lengths=None) -> None:
        self.released += session_ids

    async def stats(self) -> list[dict]:
        return [{"name": "scripted", "sessions": len(set(self.pos) - set(self.released))}]

    async def close(self) -> None:
        pass


class SlowPrefill(ScriptedBackend):
    """A prompt that goes in chunks, each slower than a heartbeat (with HEARTBEAT_S patched to 0.05); the script
    starts after the prompt's last chunk. `fail = True`: the next prompt chunk fails as a lost cluster would."""

    max_forward_tokens = 8
    fail = False

    async def forward(self, batch: list[SeqInput], all_logits: bool = False, progress=None) -> list[SeqOutput]:
        if any(b.num_tokens > 1 for b in batch):
            await asyncio.sleep(0.12)
            if self.fail:
                raise ClusterUnavailable("the workers that answer cannot run the model")
            self.pos = {b.session_id: 0 for b in batch}
        return await super().forward(batch, all_logits)


async def serve(backend, tok: K3Tokenizer, cfg, model: str = "tiny", api_key: str | None = None,
                max_body: int = 1 << 20, **engine_options) -> tuple:
    """An Engine named `model` over `backend`, served on 127.0.0.1 (a free port): (engine, runner, url)."""
    from deltafin.coordinator.engine.engine import Engine
    from deltafin.coordinator.engine.serving_options import ServingOptions
    from deltafin.coordinator.http.server import start

    prefix_cache, context = engine_options.pop("prefix_cache", False), engine_options.pop("max_context", None)
    engine = Engine(backend, tok, cfg, model, ServingOptions(**engine_options), prefix_cache=prefix_cache,
                    context=context)
    runner, port = await start(engine, "127.0.0.1", 0, max_body_bytes=max_body, api_key=api_key)
    return engine, runner, f"http://127.0.0.1:{port}"


@dataclass
class ServedApi:
    """A served engine's HTTP API, with the official clients pointed at it."""

    engine: Any
    url: str  # http://127.0.0.1:PORT

    def openai(self, api_key: str = "unused"):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def anthropic(self, api_key: str = "unused"):
        import anthropic

        return anthropic.AsyncAnthropic(base_url=self.url, api_key=api_key, max_retries=0, timeout=120)

    def spy(self) -> list[list[int]]:
        """The prompt ids of every request from now on."""
        prompts, run = [], self.engine.run

        def spied(ids, *args, **kwargs):
            prompts.append(ids)
            return run(ids, *args, **kwargs)

        self.engine.run = spied
        return prompts


async def serve_api(backend, tok: K3Tokenizer, cfg, **options) -> tuple:
    """`serve` with the URL as a ServedApi: (engine, runner, api)."""
    engine, runner, url = await serve(backend, tok, cfg, **options)
    return engine, runner, ServedApi(engine, url)


@contextlib.asynccontextmanager
async def served_pipeline(pipeline: LocalPipeline, tok: K3Tokenizer, cfg, **options):
    """The module's in-process stages behind a served engine, for one test: (engine, url); the stages stay open."""
    from deltafin.coordinator.cluster.backend import LocalBackend

    backend = LocalBackend(pipeline)
    engine, runner, url = await serve(backend, tok, cfg, **options)
    try:
        yield engine, url
    finally:
        await runner.cleanup()
        await engine.scheduler.close()
        backend.executor.shutdown(wait=True)  # the pipeline itself is shared by the module
