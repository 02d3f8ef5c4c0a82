"""`deltafin doctor`: every check on a sound setup passes; a truncated shard, a file whose bytes no longer match
the Hub's sha256 and an unreadable cluster key file each fail with the fix, and the exit status says so."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from deltafin.cli.commands import main

SHARD = "model-00003-of-00007.safetensors"


def _checks(capsys, *args: str) -> tuple[int, dict[str, list[dict]]]:
    rc = main(["doctor", "--device", "cpu", "--json", "--interface", "127.0.0.1", *args])
    out: dict[str, list[dict]] = {}
    for c in json.loads(capsys.readouterr().out):
        out.setdefault(c["name"], []).append(c)
    return rc, out


def test_a_sound_model_passes_every_check(tiny_dir: Path, capsys) -> None:
    rc, checks = _checks(capsys, "--model", str(tiny_dir))
    assert rc == 0
    assert not [c for cs in checks.values() for c in cs if c["status"] == "fail"]
    for name in ("python", "torch", "device", "memory", "plan", "config", "tokenizer", "shards", "disk",
                 "cache disk", "bonjour", "port"):
        assert name in checks, name
    assert "layers 0-5 of 6" in checks["shards"][0]["detail"]


def test_damage_and_bad_files_fail_with_their_fix(tiny_dir: Path, tmp_path: Path, capsys) -> None:
    model = tmp_path / "m"
    shutil.copytree(tiny_dir, model)
    good = hashlib.sha256((model / "model-00002-of-00007.safetensors").read_bytes()).hexdigest()
    (model / ".deltafin-download.json").write_text(json.dumps({"sha256": {
        "model-00002-of-00007.safetensors": good, "model-00004-of-00007.safetensors": "0" * 64}}))
    shard = model / SHARD
    shard.write_bytes(shard.read_bytes()[:1000])
    (tmp_path / "key").write_text("short")
    rc, checks = _checks(capsys, "--model", str(model), "--full", "--cluster-key-file", str(tmp_path / "key"))
    assert rc == 1
    (shards,) = checks["shards"]
    assert shards["status"] == "fail" and SHARD in shards["detail"] and "download" in shards["fix"]
    (sha,) = checks["sha256"]
    assert sha["status"] == "fail" and "model-00004-of-00007.safetensors" in sha["detail"]
    assert [c["status"] for c in checks["security"]] == ["fail"]
    assert main(["doctor", "--device", "cpu", "--interface", "127.0.0.1", "--model", str(model)]) == 1
    text = capsys.readouterr().out
    assert "✘ shards" in text and "fix: copy or download the file again" in text


def test_the_cache_room_is_asked_for_the_prefix_budget_the_model_gets(tmp_path: Path, k3_config_raw, monkeypatch,
                                                                      capsys) -> None:
    """16.5 GB free: enough for k3-mini's kept prefixes (0.36 GB by default; it warned for 32 GB), not for K3's."""
    from deltafin.cli import doctor

    free = shutil.disk_usage(tmp_path)._replace(free=int(16.5e9))
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda path: free)
    _, checks = _checks(capsys)  # no --model: `deltafin serve`'s, k3-mini
    (room,) = checks["cache disk"]
    assert room["status"] == "ok" and "16.5 GB free" in room["detail"]
    assert "for 0.36 GB of kept prefixes (--prefix-disk-gb's default for k3-mini)" in room["detail"]
    k3 = tmp_path / "k3"
    k3.mkdir()
    (k3 / "config.json").write_text(json.dumps(k3_config_raw))
    _, checks = _checks(capsys, "--model", str(k3))
    (room,) = checks["cache disk"]
    assert room["status"] == "warn" and "and 32.00 GB of kept prefixes (--prefix-disk-gb's default for k3)" \
        in room["detail"]


def test_bonjour_is_checked_by_hearing_this_machines_own_announcement(capsys, monkeypatch) -> None:
    """On loopback the announcement is heard; where it is not (macOS's Local Network setting off for the app: no
    error, no packets; simulated here), the check fails naming that setting on a Mac, multicast elsewhere, and
    --worker HOST:PORT either way."""
    from deltafin.transport import discovery

    rc, checks = _checks(capsys)
    assert checks["bonjour"][0]["status"] == "ok" and "hears its own announcement" in checks["bonjour"][0]["detail"]
    monkeypatch.setattr(discovery, "hears_itself", lambda interfaces=None, timeout=5.0: False)
    for platform, named in (("darwin", "Privacy & Security › Local Network"), ("linux", "UDP 5353")):
        monkeypatch.setattr("sys.platform", platform)
        rc, checks = _checks(capsys)
        (bonjour,) = checks["bonjour"]
        assert rc == 1 and bonjour["status"] == "fail"
        assert named in bonjour["fix"] and "--worker HOST:PORT" in bonjour["fix"]


def test_an_interface_this_machine_lacks_is_named_with_the_ones_it_has(capsys) -> None:
    rc = main(["doctor", "--device", "cpu", "--json", "--interface", "not-an-ip"])
    (bonjour,) = [c for c in json.loads(capsys.readouterr().out) if c["name"] == "bonjour"]
    assert rc == 1 and bonjour["status"] == "fail"
    assert "not-an-ip: not an address of this machine" in bonjour["detail"] and "127.0.0.1" in bonjour["fix"]
