"""The served API the route tests share: in-process stages of `tiny` behind one engine (two requests at once, a
queue of one, a 512-token context), on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltafin.checkpoint.config import load_config
from deltafin.runtime.pipeline import LocalPipeline
from deltafin.text.tokenizer import K3Tokenizer
from tests.support.serving import ServedApi, served_pipeline


@pytest.fixture
async def server(pipeline: LocalPipeline, tok: K3Tokenizer, tiny_dir: Path):
    async with served_pipeline(pipeline, tok, load_config(tiny_dir), model="tiny", max_active=2, queue_depth=1,
                               max_context=512) as (engine, url):
        yield ServedApi(engine, url)
