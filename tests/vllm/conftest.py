"""Tests of vLLM's own connector on hkvsim. They need a provisioned vLLM:
``scripts/with-vllm 0.33.0 python -m pytest -q tests/vllm``. Elsewhere the tests that need vLLM
skip, naming the command; with ``HKVSIM_REQUIRE_VLLM`` set (the CI stage) they FAIL instead, so
that stage can never pass by silently skipping."""

from __future__ import annotations

import os

import pytest


def _problem() -> str | None:
    try:
        from hkvsim.implementations.vllm.engine import VllmUnavailable, load_vllm
    except ImportError as exc:  # pragma: no cover - the package itself is broken
        return f"hkvsim.implementations.vllm does not import: {exc}"
    try:
        load_vllm()
    except VllmUnavailable as exc:
        return str(exc)
    return None


@pytest.fixture(scope="session")
def vllm_required() -> str:
    problem = _problem()
    if problem is not None:
        if os.environ.get("HKVSIM_REQUIRE_VLLM"):
            pytest.fail(f"HKVSIM_REQUIRE_VLLM is set but vLLM is not usable: {problem}",
                        pytrace=False)
        pytest.skip(f"vLLM not provisioned ({problem})")
    from hkvsim.implementations.vllm.engine import vllm_version

    return str(vllm_version())


@pytest.fixture(scope="session")
def nixl_available() -> None:
    """Real NIXL (``--backend nixl``): scripts/with-vllm installs it, as scripts/test does for
    the main suite; with ``HKVSIM_REQUIRE_VLLM`` or ``CI`` set a missing NIXL fails."""
    from hkvsim.transport.nixl import NixlUnavailable, load_nixl

    try:
        load_nixl()
    except NixlUnavailable as exc:
        if os.environ.get("HKVSIM_REQUIRE_VLLM") or os.environ.get("CI"):
            pytest.fail(f"NIXL is not usable here, and these tests must not skip: {exc}",
                        pytrace=False)
        pytest.skip(f"NIXL not installed ({exc}); scripts/with-vllm installs it")
