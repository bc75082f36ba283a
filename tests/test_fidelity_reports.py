"""reports/fidelity/published.md is what scripts/fidelity-published computes from the shipped
profiles now (a profile change that moves a prediction must regenerate it, on purpose)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[1]


def test_published_report_is_current(tmp_path: Path) -> None:
    script = runpy.run_path(str(ROOT / "scripts" / "fidelity-published"), run_name="lib")
    out = tmp_path / "published.md"
    assert script["main"]([str(out)]) == 0
    assert out.read_text() == (ROOT / "reports" / "fidelity" / "published.md").read_text(), (
        "reports/fidelity/published.md is stale: run scripts/fidelity-published")
    text = out.read_text()
    for url in ("https://github.com/ai-dynamo/nixl/pull/115",
                "https://github.com/ai-dynamo/nixl/issues/1695",
                "https://github.com/vllm-project/vllm/issues/55434"):
        assert url in text
