"""The presets' configs: the special-token ids they name are where K3's vocabulary (text/vocab.py) puts them."""

from __future__ import annotations

import pytest

from deltafin.checkpoint.config import parse_config
from deltafin.checkpoint.presets import CONFIG_SPECIALS, N_SPECIAL, PRESETS, preset_config
from deltafin.text import vocab


def test_the_config_specials_are_the_vocabularys() -> None:
    assert N_SPECIAL == vocab.N_SPECIAL
    assert all(vocab.NAMED_SPECIALS[offset] == token for token, offset in CONFIG_SPECIALS.items())


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_presets_token_ids_are_its_vocabularys_specials(name: str) -> None:
    raw = preset_config(name)
    specials = vocab.special_tokens(PRESETS[name].vocab_size - vocab.N_SPECIAL)
    assert (raw["bos_token_id"], raw["eos_token_id"], raw["pad_token_id"], raw["media_placeholder_token_id"]) == (
        specials["[BOS]"], specials["<|end_of_msg|>"], specials["[PAD]"], specials["<|kimi_image_placeholder|>"])
    assert parse_config(raw).vocab_size == PRESETS[name].vocab_size
