"""Real-NIXL tests. They need `pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1` (scripts/test
installs it). Without NIXL they skip on a workstation; with ``CI`` set they FAIL instead, so a CI
run can never pass by silently skipping the real backend."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _nixl_problem() -> str | None:
    try:
        from hkvsim.transport.nixl import NixlUnavailable, load_nixl
    except ImportError as exc:  # pragma: no cover - the package itself is broken
        return f"hkvsim.transport.nixl does not import: {exc}"
    try:
        load_nixl()
    except NixlUnavailable as exc:
        return str(exc)
    return None


PROBLEM = _nixl_problem()


@pytest.fixture
def nixl_required() -> None:
    if PROBLEM is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but NIXL is not usable, and NIXL tests must not skip in CI: "
                    f"{PROBLEM}", pytrace=False)
    pytest.skip(f"NIXL not installed: {PROBLEM}")
