"""``hkvsim validate`` on real NIXL: one held-out file, one repeat (the committed table in
reports/fidelity/ comes from the full set)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hkvsim.validate import validate

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


def test_one_held_out_file_on_both_backends(nixl_required: None) -> None:
    (r,) = validate([ROOT / "scenarios" / "validation" / "llama-pull-1to1-strided.toml"],
                    repeats=1)
    assert r.outcomes == ("ok", "ok")
    assert r.sim_seconds > 0 and len(r.real_seconds) == 1 and r.real_seconds[0] > 0
    # the simulator and NIXL's telemetry count the same descriptors, before and after coalescing
    assert r.descriptors_posted[0] == r.descriptors_posted[1]
    assert r.descriptors_coalesced[0] == r.descriptors_coalesced[1] is not None
