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
    # where the time goes, both sides: the post call (the copy inside it) and what follows it
    assert len(r.post_seconds) == len(r.wire_seconds) == 2
    assert all(t > 0 for t in r.post_seconds) and all(t >= 0 for t in r.wire_seconds)
    # the rank processes and the coordinator counted their CPU (what calibrate --host measures)
    ops = r.rank_cpu["by_op"]
    requests = 8  # the file's requests; one decode rank, one prefill rank
    assert ops["StartRead"][0] == requests and ops["OracleWrite"][0] == requests
    assert ops["Verify"][0] == requests and ops["Verify"][2] > 0 and ops["StartRead"][2] == 0
    assert r.rank_cpu["posts"] == r.transfers == requests  # one READ per request
    assert 0 < r.rank_cpu["post_cpu_seconds"] < ops["StartRead"][1]  # posts run inside it
    assert r.rank_cpu["coordinator"]["calls"] >= 3 * requests
    assert r.rank_cpu["coordinator"]["cpu_seconds"] > 0
    # each rank's loop counted its NIXL polls: idle ones (at least one per 1 ms idle period of
    # a run lasting tens of ms, on two ranks) and busy ones (after each READ's post)
    idle, busy = r.rank_cpu["polls"]["idle"], r.rank_cpu["polls"]["busy"]
    assert idle[0] >= 20 and idle[1] > 0 and busy[0] >= 1 and busy[1] > 0


def test_coalescing_model_matches_nixl_on_the_lists_really_posted(nixl_required: None) -> None:
    # warmed-up block ids under a burst (partial runs, timing-dependent allocation) and strided
    # merging: whatever ids a real run allocated, hkvsim's model of NIXL's coalescing applied to
    # the descriptor lists each rank posted must give the count NIXL's telemetry reports
    files = [ROOT / "scenarios" / "fit" / "deepseek-pull-1to2-burst3-warmed.toml",
             ROOT / "scenarios" / "fit" / "kl-pull-2to1-burst2-strided.toml"]
    for r in validate(files, repeats=1):
        checked, mismatched = r.coalescing_model
        assert checked >= 16, r.file  # every request's transfers of the run
        assert mismatched == 0, r.file


def test_timing_only_validation_runs_no_oracle_on_either_backend(nixl_required: None) -> None:
    (r,) = validate([ROOT / "scenarios" / "validation" / "llama-pull-1to1-strided.toml"],
                    repeats=1, timing_only=True)
    assert r.outcomes == ("ok", "ok") and r.sim_seconds > 0 and r.real_seconds[0] > 0
    assert r.verified is False  # read from the runs' own JSON, not from the flag
    (v,) = validate([ROOT / "scenarios" / "validation" / "llama-pull-1to1-strided.toml"],
                    repeats=1)
    assert v.verified is True
