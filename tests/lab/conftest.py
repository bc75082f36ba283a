"""GPU-lab path tests (hkvsim.lab under torchrun, on CPU). The torchrun ones need the CPU torch
wheel (`pip install torch==2.13.0`, which scripts/test installs) and NIXL. Without them they skip
on a workstation; with ``CI`` set they FAIL instead, so CI never passes by skipping the lab."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _torchrun_problem() -> str | None:
    try:
        import torch.distributed  # noqa: F401
    except ImportError as exc:
        return f"torch is not installed (pip install torch==2.13.0): {exc}"
    if shutil.which("torchrun", path=str(Path(sys.executable).parent)) is None:
        return "the torchrun script is not beside this interpreter"
    from hkvsim.transport.nixl import NixlUnavailable, load_nixl

    try:
        load_nixl()
    except NixlUnavailable as exc:
        return str(exc)
    return None


PROBLEM = _torchrun_problem()


@pytest.fixture
def torchrun() -> list[str]:
    """torchrun as hkvsim launches it on one machine: ``python -m hkvsim.lab_torchrun`` (torchrun
    with its stores on loopback; skips without torch and NIXL; fails in CI)."""
    if PROBLEM is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but the lab path cannot run, and it must not skip in CI: "
                        f"{PROBLEM}", pytrace=False)
        pytest.skip(PROBLEM)
    return [sys.executable, "-m", "hkvsim.lab_torchrun"]
