"""Kept prefixes on the disk: written once, read back exactly after a "restart" (a new stage of the same identity),
found by their tokens on the first stage, LRU within a byte budget; a damaged, truncated or foreign file is
ignored with a warning and removed (the prompt is prefilled again); two stages of one identity at once never
share a folder."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.shards import open_checkpoint
from deltafin.errors import PrefixNotFound
from deltafin.models.cache import KDACache
from deltafin.plan.memory.kept_prefixes import default_prefix_disk_bytes
from deltafin.runtime.prefix_disk import PrefixDisk
from deltafin.runtime.stage import Stage
from deltafin.runtime.stage_io import SeqInput
from deltafin.runtime.stage_options import StageOptions

CPU = torch.device("cpu")
PROMPT = [(7 * i) % 900 + 5 for i in range(300)]


@pytest.fixture(scope="module")
def ckpt(tiny_dir):
    return open_checkpoint(tiny_dir, load_config(tiny_dir))


def _stage(ckpt, folder: Path, start: int = 0, end: int = 6, disk_bytes: int = 10**9) -> Stage:
    return Stage(ckpt, start, end, device=CPU, options=StageOptions(prefix_dir=str(folder),
                                                                    prefix_disk_bytes=disk_bytes))


def test_the_disk_budget_is_the_models_default_unless_given(ckpt, tmp_path):
    """No --prefix-disk-gb: room for KEPT_ON_DISK of this model's states at the planned context (the one place
    doctor asks too), not a fixed 32 GB; one given wins."""
    stage = Stage(ckpt, 0, 6, device=CPU, options=StageOptions(prefix_dir=str(tmp_path / "a")).replace(context=2048))
    assert stage.prefixes.disk.budget == default_prefix_disk_bytes(ckpt.config, 2048, 4) < 10**8
    given = _stage(ckpt, tmp_path / "b", disk_bytes=5 * 10**9)
    assert given.prefixes.disk.budget == 5 * 10**9
    stage.close()
    given.close()


def test_a_prefix_survives_a_restart_and_resumes_exactly(ckpt, tmp_path):
    nxt = torch.tensor([11, 12, 13])
    stage = _stage(ckpt, tmp_path)
    stage.forward([SeqInput("a", 0, ids=torch.tensor(PROMPT))])
    stage.release("a", keep_as="p300")
    want = stage.forward([SeqInput("b", 300, ids=nxt, resume_from="p300")])[0].logits
    stage.close()  # the worker stops: memory is gone, the disk keeps its file

    again = _stage(ckpt, tmp_path)
    assert not again.prefixes.entries and again.prefixes.find(PROMPT + [1, 2]) == ("p300", 300)
    got = again.forward([SeqInput("c", 300, ids=nxt, resume_from="p300")])[0].logits
    assert torch.equal(got, want) and again.prefixes.stats.restored == 1
    assert again.sessions.tokens["c"].tolist() == PROMPT + nxt.tolist()  # the first stage knows the resumed tokens
    again.close()


def test_save_points_keep_their_tokens_and_later_stages_keep_theirs(ckpt, tmp_path):
    """A forward's save_at writes every stage's part under one id; only the first stage records the tokens."""
    first, second = _stage(ckpt, tmp_path, 0, 3), _stage(ckpt, tmp_path, 3, 6)
    out = first.forward([SeqInput("s", 0, ids=torch.tensor(PROMPT[:100]), save_at=((100, "p100"),))])[0]
    second.forward([SeqInput("s", 0, state=out.state, save_at=((100, "p100"),))])
    for s in (first, second):
        s.prefixes.disk.read("p100", torch.float32)  # waits for the background write
    assert first.prefixes.disk.tokens("p100").tolist() == PROMPT[:100]
    assert second.prefixes.disk.tokens("p100") is None and second.prefixes.disk.files["p100"].length == 100
    assert first.prefixes.disk.dir != second.prefixes.disk.dir  # another layer range, another identity
    first.close()
    second.close()


def test_the_disk_keeps_its_budget_least_recently_used_first(ckpt, tmp_path):
    stage = _stage(ckpt, tmp_path)
    stage.forward([SeqInput("a", 0, ids=torch.tensor(PROMPT[:50]), save_at=((50, "first"),))])
    disk = stage.prefixes.disk
    disk.read("first", torch.float32)
    one = disk.files["first"].nbytes
    stage.close()
    stage = _stage(ckpt, tmp_path, disk_bytes=2 * one + one // 2)  # room for two
    for i, name in enumerate(["second", "third"]):
        stage.forward([SeqInput(name, 0, ids=torch.tensor(PROMPT[i:i + 50]), save_at=((50, name),))])
        stage.prefixes.disk.read(name, torch.float32)
    assert sorted(stage.prefixes.disk.files) == ["second", "third"]  # the oldest went
    assert not (stage.prefixes.disk.dir / "first.prefix").exists()
    stage.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_file_is_ignored_and_the_prompt_prefilled_again(ckpt, tmp_path, caplog, damage):
    stage = _stage(ckpt, tmp_path)
    stage.forward([SeqInput("a", 0, ids=torch.tensor(PROMPT))])
    stage.release("a", keep_as="p300")
    path = stage.prefixes.disk.dir / "p300.prefix"
    stage.prefixes.disk.read("p300", torch.float32)
    stage.close()
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[: len(data) // 3]))
    else:  # a file of another stage identity put in this folder
        other = _stage(ckpt, tmp_path / "other", 0, 3)
        other.forward([SeqInput("x", 0, ids=torch.tensor(PROMPT[:40]), save_at=((40, "p300"),))])
        other.prefixes.disk.read("p300", torch.float32)
        other.close()
        path.write_bytes((other.prefixes.disk.dir / "p300.prefix").read_bytes())
    with caplog.at_level(logging.WARNING, logger="deltafin.runtime.prefix_disk"):
        again = _stage(ckpt, tmp_path)
        with pytest.raises(PrefixNotFound):
            again.forward([SeqInput("b", 300, ids=torch.tensor([1]), resume_from="p300")])
    assert "unusable" in caplog.text and not path.exists()
    again.close()


def test_two_stages_of_one_identity_never_share_a_folder(ckpt, tmp_path):
    a, b = _stage(ckpt, tmp_path), _stage(ckpt, tmp_path)
    assert a.prefixes.disk.dir != b.prefixes.disk.dir and b.prefixes.disk.dir.name.endswith(".2")
    a.close()
    c = _stage(ckpt, tmp_path)  # a's folder is free again: a restarted worker gets its files back
    assert c.prefixes.disk.dir == a.prefixes.disk.dir
    b.close()
    c.close()


def test_kda_and_mla_state_round_trip_in_bf16(ckpt, tmp_path):
    stage = Stage(ckpt, 0, 6, device=CPU, options=StageOptions(dtype=torch.bfloat16, prefix_dir=str(tmp_path)))
    stage.forward([SeqInput("a", 0, ids=torch.tensor(PROMPT[:70]), save_at=((70, "p"),))])
    kept = stage.prefixes.entries["p"]
    disk = PrefixDisk(tmp_path / "copy", stage.prefixes.disk.identity, 10**9, CPU)
    disk.write("q", kept, None).result()
    back = disk.read("q", torch.bfloat16)
    assert back.length == 70
    for i, c in kept.layers.items():
        d = back.layers[i]
        if isinstance(c, KDACache):
            assert torch.equal(c.conv, d.conv) and torch.equal(c.state, d.state)
        else:
            assert d.buf.dtype == torch.bfloat16 and torch.equal(c.buf[:70], d.buf[:70])
    disk.close()
    stage.close()


def test_folders_of_other_identities_give_way_when_nothing_holds_them(ckpt, tmp_path):
    """The budget is the prefix folder's: a stage of another identity (another spine, say) that no process holds
    loses its oldest files to make room; one a live stage holds keeps them."""
    old = _stage(ckpt, tmp_path)
    old.forward([SeqInput("a", 0, ids=torch.tensor(PROMPT))])
    old.release("a", keep_as="p300")
    old.prefixes.disk.read("p300", torch.float32)  # written
    size = old.prefixes.disk.files["p300"].nbytes
    other = PrefixDisk(tmp_path, "another-identity", size // 2, CPU)  # a live stage holds `old`'s folder
    assert (old.prefixes.disk.dir / "p300.prefix").exists()
    other.close()
    old.close()
    PrefixDisk(tmp_path, "another-identity", 10 * size, CPU).close()  # room enough: nothing goes
    assert (old.prefixes.disk.dir / "p300.prefix").exists()
    PrefixDisk(tmp_path, "another-identity", size // 2, CPU).close()
    assert not old.prefixes.disk.dir.exists()  # its only file went, and the empty folder with it
