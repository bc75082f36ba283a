"""The model directory the vLLM harness writes for vLLM's config loader (needs no vLLM): one
per config content, under a directory only this user may write."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest

from hkvsim.implementations.vllm import engine


@pytest.fixture
def temp_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(engine, "_HF_DIR", {})
    return tmp_path / f"hkvsim-vllm-models-{os.getuid()}"


def test_one_directory_per_config_content(temp_root: Path) -> None:
    first = engine._write_config({"model_type": "llama", "hidden_size": 64})
    assert Path(first).parent == temp_root and (temp_root.stat().st_mode & 0o777) == 0o700
    assert json.loads((Path(first) / "config.json").read_text()) == {
        "model_type": "llama", "hidden_size": 64}
    # the same content in another key order names the same directory; other content another
    assert engine._write_config({"hidden_size": 64, "model_type": "llama"}) == first
    assert engine._write_config({"model_type": "llama", "hidden_size": 128}) != first


@pytest.mark.parametrize("how", ["others may write it", "a link"])
def test_a_base_directory_others_could_change_is_refused(temp_root: Path, tmp_path: Path,
                                                         how: str) -> None:
    # another user could swap the config vLLM loads: a group- or world-writable base, or a
    # link in its place, is refused before anything is written
    if how == "a link":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        temp_root.symlink_to(tmp_path / "elsewhere")
    else:
        temp_root.mkdir()
        temp_root.chmod(0o777)
    with pytest.raises(RuntimeError, match="not a directory of this user's that only it can "
                                           "write"):
        engine._write_config({"model_type": "llama"})
    assert not any(temp_root.iterdir())
