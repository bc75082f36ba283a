"""Hostile handshake payloads at scale (issue #10 item 6): the campaign of
tests/connector/hostile.py with 100,000 cases and other seeds than CI's (which runs 10,000).

    .venv/bin/python -m pytest benchmarks/test_handshake_fuzz.py -q --benchmark-enable

Records the cases per second and the worst call (seconds, traced MB); fails on any exception
other than HandshakeError, any call over 1 s or 64 MB, or anything a refusal left behind. With
--benchmark-disable (the default) it runs 2,000 cases as a smoke test.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from connector import hostile  # noqa: E402  (tests/connector/hostile.py)


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [1, 2])
def test_hostile_handshake_campaign(figures, seed: int) -> None:
    count = 50_000 if figures.enabled else 1_000
    start = time.perf_counter()
    result = hostile.run_campaign(count, seed=seed)
    seconds = time.perf_counter() - start
    assert result.problems == [], "\n".join(result.problems[:20])
    assert result.cases == count and result.accepted > 0
    figures.add(f"hostile handshakes (seed {seed}, {count:,} cases)", count / seconds, "cases/s",
                note=f"worst call {result.worst_seconds * 1e3:.0f} ms, "
                     f"{result.worst_bytes / 2**20:.1f} MiB traced; rules {result.rules}")
