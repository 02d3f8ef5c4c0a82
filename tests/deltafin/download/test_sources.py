"""The Hub transport of `deltafin download`, offline: whole shards through `hf_hub_download` from a prepared Hub
cache (models--ORG--NAME/blobs, snapshots/<rev>, refs/main), ranges of partial shards through an fsspec
filesystem put in HfFileSystem's place (fsspec's local one over that snapshot, publishing the blobs' sha256 as
the Hub publishes LFS hashes)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from fsspec.implementations.local import LocalFileSystem

from deltafin.checkpoint.config import load_config
from deltafin.checkpoint.manifest import recorded_sha256
from deltafin.checkpoint.shards import INDEX_NAME, open_checkpoint
from deltafin.download.fetch import download
from deltafin.download.sources import HubSource, LocalSource, open_source
from deltafin.errors import DeltafinError
from deltafin.plan.cluster.expert_placement import split

REPO, REVISION = "org/tiny-k3", "0123456789abcdef0123456789abcdef01234567"


class LfsFileSystem(LocalFileSystem):
    """fsspec's local filesystem over a Hub snapshot, listing each LFS file's sha256 (its blob's name) as
    HfFileSystem does; it counts the bytes read through it."""

    read = 0

    def find(self, path, maxdepth=None, withdirs=False, detail=False, **kwargs):
        found = super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=True, **kwargs)
        for name, info in found.items():
            if name.endswith(".safetensors"):
                info["lfs"] = {"sha256": Path(os.path.realpath(name)).name, "size": info["size"]}
        return found

    def open(self, path, mode="rb", **kwargs):
        f = super().open(path, mode, **kwargs)
        read = f.read

        def counted(n=-1):
            data = read(n)
            LfsFileSystem.read += len(data)
            return data

        f.read = counted
        return f


@pytest.fixture
def hub(tiny_dir, tmp_path, monkeypatch) -> Path:
    """An offline Hub cache holding the tiny checkpoint at REVISION (also refs/main); the snapshot's path."""
    import huggingface_hub.constants as constants

    repo = tmp_path / "hub" / f"models--{REPO.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    for f in sorted(tiny_dir.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / (hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors"
                                 else hashlib.sha1(data).hexdigest())
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_HUB_CACHE", str(tmp_path / "hub")),
                        ("HF_HOME", str(tmp_path / "home"))):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    LfsFileSystem.read = 0
    return snapshot


def _source(snapshot: Path, revision: str | None = REVISION) -> HubSource:
    return HubSource(REPO, revision, fs=LfsFileSystem(), root=str(snapshot))


def test_whole_shards_come_from_the_hub_cache_and_parts_through_the_filesystem(hub, tiny_dir, tmp_path):
    out = tmp_path / "out"
    summary = download(_source(hub), out, layers="0-2", experts="1/2", show_progress=False)
    cfg = load_config(out)
    index = json.loads((tiny_dir / INDEX_NAME).read_text())["weight_map"]
    dense, top = index[cfg.layer_tensor_specs(0)[0].name], index[cfg.top_tensor_specs()[0].name]
    for whole in (dense, top):  # every tensor needed: hf_hub_download's file (the cache's blob, linked)
        assert os.stat(out / whole).st_ino == os.stat(os.path.realpath(hub / whole)).st_ino
        # its sha256, checked against the Hub's, is recorded (for `deltafin doctor --full`)
        assert recorded_sha256(out)[whole] == hashlib.sha256((out / whole).read_bytes()).hexdigest()
    partial = index[cfg.layer_tensor_specs(1)[0].name]
    assert os.stat(out / partial).st_ino != os.stat(os.path.realpath(hub / partial)).st_ino
    src, ckpt = open_checkpoint(tiny_dir, cfg), open_checkpoint(out, cfg, strict=False)
    ckpt.raise_problems(layers=range(0, 3))
    lo, hi = split(0, cfg.num_experts, [1.0, 1.0])[1:3]
    for e in range(cfg.num_experts):
        for s, m in zip(src.expert(1, e).tensors, ckpt.expert(1, e).tensors, strict=True):
            assert _bytes(m) == (_bytes(s) if lo <= e < hi else bytes(s.nbytes))
    shards = {dense, top, partial, index[cfg.layer_tensor_specs(2)[0].name]}
    planning = sum((tiny_dir / p).stat().st_size for p in ("config.json", INDEX_NAME)) + sum(
        _header_bytes(tiny_dir / p) for p in shards)
    whole = sum((tiny_dir / p).stat().st_size for p in (dense, top))
    assert LfsFileSystem.read == planning + summary.bytes_read - whole  # the whole shards: not through it
    assert summary.bytes_apparent == sum((tiny_dir / p).stat().st_size for p in shards) + sum(
        f.stat().st_size for f in tiny_dir.iterdir() if f.suffix != ".safetensors")


def test_offline_the_cached_snapshot_is_the_whole_source(hub, tiny_dir, tmp_path):
    summary = download(open_source(f"hf:{REPO}"), tmp_path / "out", experts="0/2", show_progress=False)
    assert summary.bytes_apparent == sum(f.stat().st_size for f in tiny_dir.iterdir())
    assert (tmp_path / "out" / "config.json").read_bytes() == (tiny_dir / "config.json").read_bytes()


def test_a_corrupt_hub_file_is_named(hub, tmp_path):
    shard = "model-00001-of-00007.safetensors"
    blob = Path(os.path.realpath(hub / shard))
    data = bytearray(blob.read_bytes())
    data[-1] ^= 0xFF  # the blob no longer hashes to its name: what a damaged download looks like
    blob.write_bytes(bytes(data))
    with pytest.raises(DeltafinError, match=f"{shard}: sha256 .* publishes .* the download is corrupt"):
        download(_source(hub), tmp_path / "out", layers="0", show_progress=False)
    assert not (tmp_path / "out" / shard).exists()  # not kept: the next run fetches it again


def test_unknown_revisions_and_repositories_are_clear(hub, tmp_path):
    class Missing(LfsFileSystem):
        def find(self, path, **kwargs):  # what HfFileSystem raises for a revision the Hub does not have
            raise FileNotFoundError(f"Revision 'v9' does not exist for model '{REPO}'")

    with pytest.raises(DeltafinError, match=r"hf:org/tiny-k3@v9: no such repository or revision .*'v9' does not"):
        download(HubSource(REPO, "v9", fs=Missing(), root="x"), tmp_path / "o", show_progress=False)
    wrong = HubSource(REPO, "f" * 40, fs=LfsFileSystem(), root=str(hub))  # listed, but not in the cache
    with pytest.raises(DeltafinError, match="model-00001-of-00007.safetensors is not available"):
        download(wrong, tmp_path / "o", layers="0", show_progress=False)
    with pytest.raises(DeltafinError, match="hf:org/name@main: not in the Hub cache"):
        open_source("hf:org/name@main")  # offline, and the cache does not have it
    assert open_source(f"hf:{REPO}").revision is None
    assert isinstance(open_source(str(hub)), LocalSource)


def _header_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _bytes(loc) -> bytes:
    with open(loc.file, "rb") as f:
        f.seek(loc.offset)
        return f.read(loc.nbytes)
