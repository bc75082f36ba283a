"""The suite's own time bound: a test whose pytest-timeout fires inside a garbage-collector
callback must fail, not pass (pyproject.toml's filterwarnings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]

_SLOW_IN_GC = '''
import gc, time, pytest

@pytest.mark.timeout(1)
def test_slow_in_a_gc_callback():
    def callback(phase, info):
        if phase == "start":
            time.sleep(3)
    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)


def test_quick_gc_callback_passes():
    gc.callbacks.append(lambda phase, info: None)
    try:
        gc.collect()
    finally:
        gc.callbacks.pop()
'''


def test_a_timeout_inside_a_gc_callback_fails_the_test(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(_SLOW_IN_GC)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-c", str(ROOT / "pyproject.toml"),
                          "--rootdir", str(tmp_path), str(tmp_path)],
                         capture_output=True, text=True, timeout=50, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert "FAILED" in out and "test_slow_in_a_gc_callback" in out, out
    assert "1 failed, 1 passed" in out, out
    assert run.returncode == 1, out
