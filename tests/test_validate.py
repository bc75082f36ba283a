"""``hkvsim validate``'s statistics and its refusal of bad input (the real-NIXL run itself is
tested in tests/nixl/test_nixl_validate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hkvsim.cli import main
from hkvsim.validate import (ACCEPT_MEDIAN, ACCEPT_WORST, FileResult, ValidationError,
                             coalescing_model_check, markdown, post_call_totals,
                             resampled_verdict, steady_phase_means, steady_requests,
                             steady_transfer_mean, steady_unexplained_mean, summary, validate,
                             within_bounds, write_outputs)

pytestmark = pytest.mark.timeout(60)
ROOT = Path(__file__).resolve().parents[1]


def _req(index: int, seconds: float | None, handshake: float = 0.0, status: str = "ok",
         post: float = 0.0, wire: float = 0.0) -> dict:
    return {"index": index, "status": status, "transfer_seconds": seconds,
            "phases": {"handshake": handshake, "post": post, "wire": wire}}


def test_steady_state_leaves_out_handshakes_the_first_request_and_failures() -> None:
    data = {"request_details": [_req(0, 9.0, handshake=5.0), _req(1, 8.0), _req(2, 1.0),
                                _req(3, 2.0), _req(4, 3.0), _req(5, 100.0, status="failed"),
                                _req(6, None), _req(7, 7.0, handshake=0.1)]}
    assert steady_transfer_mean(data) == 3.5  # requests 1..4 -> mean of 8, 1, 2, 3
    data["request_details"][0]["phases"]["handshake"] = 0.0
    assert steady_transfer_mean(data) == 3.5  # request 0 is still the run's first
    assert steady_transfer_mean({"request_details": [_req(0, 1.0)]}) is None


def _timed(index: int, arrival: float, first_post: float, done: float,
           handshake: float = 0.0) -> dict:
    out = _req(index, done - first_post, handshake=handshake)
    out["times"] = {"start": arrival, "transfer_done": done}
    return out


def test_steady_state_leaves_out_requests_that_arrived_or_ran_during_the_warm_up() -> None:
    # request 0 runs the handshake and lives from 0 to 10. Request 1 arrived with it; request 7
    # arrived at 5 and posted only after 10: both waited on the warm-up. Request 2 arrives as it
    # ends (touching is not overlapping). Request 3 arrived before request 4 (a later handshake)
    # but its transfer overlaps request 4's life.
    data = {"request_details": [
        _timed(0, 0.0, 8.0, 10.0, handshake=7.0), _timed(1, 0.0, 9.0, 25.0),
        _timed(2, 10.0, 10.0, 12.0), _timed(3, 20.0, 31.0, 32.0),
        _timed(4, 30.0, 35.0, 38.0, handshake=1.0), _timed(5, 40.0, 41.0, 44.0),
        _timed(6, 40.0, 45.0, 49.0), _timed(7, 5.0, 15.0, 17.0)]}

    def steady() -> list[int]:
        return [r["index"] for r in steady_requests(data["request_details"])]

    assert steady() == [2, 5, 6]
    assert steady_transfer_mean(data) == 3.0  # 2, 3, 4
    data["request_details"][3]["times"]["transfer_done"] = 30.0  # ends as request 4 arrives
    data["request_details"][3]["transfer_seconds"] = 1.0
    assert steady() == [2, 3, 5, 6]
    assert steady_transfer_mean(data) == 2.5  # 2, 1, 3, 4


def test_unexplained_is_transfer_minus_post_and_wire_of_steady_requests() -> None:
    data = {"request_details": [_req(0, 9.0, post=1.0, wire=1.0), _req(1, 5.0, post=1.0, wire=2.0),
                                _req(2, 4.0, post=0.5, wire=0.5), _req(3, 6.0, post=1.0, wire=1.0,
                                                                       handshake=2.0)]}
    assert steady_unexplained_mean(data) == 2.5  # requests 1 (2.0) and 2 (3.0)


def test_phase_means_are_the_steady_requests_post_and_wire() -> None:
    data = {"request_details": [_req(0, 9.0, post=7.0, wire=1.0), _req(1, 5.0, post=1.0, wire=2.0),
                                _req(2, 4.0, post=3.0, wire=0.5), _req(3, 6.0, post=9.0, wire=9.0,
                                                                       handshake=2.0)]}
    assert steady_phase_means(data) == (2.0, 1.25)  # requests 1 and 2 only
    assert steady_phase_means({"request_details": [_req(0, 1.0, post=1.0)]}) is None


def _result(sim: float, reals: tuple[float, ...], coalesced: tuple = (5, 5)) -> FileResult:
    return FileResult(file="scenarios/validation/x.toml", scenario="x", profile="p",
                      sim_seconds=sim, real_seconds=reals, loads=(0.5, 3.0, 0.1),
                      descriptors_posted=(10, 10), descriptors_coalesced=coalesced,
                      outcomes=("ok",) * 4, unexplained=(0.001, 0.002, 0.004, 0.003),
                      post_seconds=(0.0005, 0.001, 0.0015, 0.002),
                      wire_seconds=(0.0002, 0.0007, 0.0009, 0.0008))


def test_error_spread_and_acceptance() -> None:
    good = _result(1.1, (1.0, 0.9, 1.2))
    assert good.real_median == 1.0
    assert good.error == pytest.approx(0.1)
    assert good.spread == pytest.approx(0.3)
    bad = _result(0.5, (1.0, 1.0, 1.0), coalesced=(5, 6))
    s = summary([good, good, bad])
    assert s["median_abs_error"] == pytest.approx(0.1)
    assert s["worst_abs_error"] == pytest.approx(0.5)
    assert not s["accepted"]  # worst 50 % > 40 %
    assert not s["coalesced_agree"]
    assert summary([good])["accepted"]
    text = markdown([good, bad], {"when": "now", "machine": "m", "repeats": 3})
    assert "| `x.toml` | 1100.000 | 1000.000 |" in text and "+10 %" in text and "-50 %" in text
    # post call, post end to completion, unexplained: sim, then the median of the real runs
    assert "| 0.500 / 1.500 | 0.200 / 0.800 | 1.000 / 3.000 |" in text
    assert "**NOT met**" in text
    assert "Coalesced descriptor totals differ" in text and "`x.toml` (block ids" in text
    assert "model was not checked on the real lists" in text  # no real counts in these results


def test_within_bounds_is_inclusive_and_needs_both_bounds() -> None:
    import numpy as np

    assert within_bounds(ACCEPT_MEDIAN, ACCEPT_WORST)  # on the bounds: met
    assert not within_bounds(ACCEPT_MEDIAN + 1e-9, 0.0)  # median over, worst fine
    assert not within_bounds(0.0, ACCEPT_WORST + 1e-9)  # worst over, median fine
    met = within_bounds(np.array([0.1, 0.2, 0.1]), np.array([0.3, 0.3, 0.5]))
    assert met.tolist() == [True, False, False]
    # the summary's verdict is the same test: a median over its bound refuses with every file
    # under the worst bound; just under both bounds accepts
    assert not summary([_result(1.2, (1.0,))] * 3)["accepted"]
    assert summary([_result(1.14, (1.0,)), _result(0.61, (1.0,)), _result(0.9, (1.0,))])["accepted"]


def test_coalescing_model_check_counts_mismatching_real_transfers() -> None:
    def req(*pairs: tuple) -> dict:
        return {"telemetry": [{"coalesced": real, "coalesced_model": model}
                              for model, real in pairs]}
    data = {"request_details": [req((3, 3), (5, 4)), req((2, None), (None, 7)), req((1, 1))]}
    assert coalescing_model_check(data) == (3, 1)  # unknown sides are not counted
    assert coalescing_model_check({"request_details": [{"telemetry": None}]}) == (0, 0)
    good = _result(1.0, (1.0,))
    bad = FileResult(**{**good.__dict__, "coalescing_model": (40, 2)})
    assert summary([good, bad])["coalescing_model_mismatches"] == 2
    text = markdown([good, bad], {"when": "now", "machine": "m", "repeats": 1})
    assert "DISAGREES on 2 transfers" in text and "40 transfers checked" in text
    assert "| 2 / 40 |" in text
    ok = markdown([FileResult(**{**good.__dict__, "coalescing_model": (40, 0)})], {})
    assert "agrees with NIXL's telemetry (40 transfers checked)" in ok


def test_refuses_no_files_sweeps_and_bad_repeats(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="no validation scenario files"):
        validate([])
    sweep = tmp_path / "s.toml"
    sweep.write_text('[scenario]\nname = "s"\n[model]\npreset = "tiny-llama"\n[workload]\n'
                     'requests = 2\nprompt_tokens = 100\n[sweep]\ndecode.tp = [1, 2]\n')
    with pytest.raises(ValidationError, match="2 variants; allowed: a scenario file without"):
        validate([sweep])
    with pytest.raises(ValidationError, match="--repeats 0: expected an integer >= 1"):
        validate([sweep], repeats=0)


def test_cli_bad_input_exits_2_with_one_line(tmp_path: Path, capsys) -> None:
    pytest.importorskip("nixl_cu12", reason="the CLI loads NIXL before anything else")
    sweep = tmp_path / "s.toml"
    sweep.write_text('[scenario]\nname = "s"\n[model]\npreset = "tiny-llama"\n[workload]\n'
                     'requests = 2\nprompt_tokens = 100\n[sweep]\ndecode.tp = [1, 2]\n')
    assert main(["validate", str(sweep)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2 variants" in err[0]


def test_timing_only_results_say_so_and_go_to_their_own_files(tmp_path: Path) -> None:
    good = _result(1.0, (1.0,))
    timing = FileResult(**{**good.__dict__, "verified": False})
    text = markdown([timing], {"when": "now", "machine": "m", "repeats": 1})
    assert "Timing-only runs" in text and "nothing was verified" in text
    assert "Verified runs" not in text
    assert "Verified runs: the oracle fills" in markdown([good], {})
    assert "Some files ran verified and some timing-only" in markdown([good, timing], {})
    paths = write_outputs([timing], tmp_path, {})
    assert [p.name for p in paths] == ["held-out-cpu-timing-only.md",
                                       "held-out-cpu-timing-only.json"]
    assert [p.name for p in write_outputs([good], tmp_path, {})] == ["held-out-cpu.md",
                                                                     "held-out-cpu.json"]


def test_reports_show_paths_inside_the_working_directory_relative(tmp_path: Path,
                                                                  monkeypatch) -> None:
    from hkvsim.validate import _shown_profile, shown_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "scenarios").mkdir()
    inside = tmp_path / "scenarios" / "x.toml"
    assert shown_path(inside) == "scenarios/x.toml"
    assert shown_path("scenarios/x.toml") == "scenarios/x.toml"
    outside = tmp_path.parent / "elsewhere" / "candidate.toml"
    assert shown_path(outside) == str(outside)
    assert _shown_profile(outside) == "candidate.toml (a file outside the working directory)"
    assert _shown_profile(inside) == "scenarios/x.toml"


def test_warm_up_passes_run_first_and_stay_out_of_every_figure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import hkvsim.drivers.nixl as dn
    import hkvsim.drivers.sim as ds
    import hkvsim.results as res

    files = [ROOT / "scenarios" / "validation" / "llama-pull-1to1-strided.toml",
             ROOT / "scenarios" / "validation" / "kl-pull-1to2-off.toml"]
    # real runs in call order: two warm-up passes (slow, 50-80 ms), then two measured passes
    real_ms = iter([50.0, 60.0, 70.0, 80.0, 1.0, 2.0, 3.0, 4.0])
    monkeypatch.setattr(ds, "run_scenario", lambda s, timing_only=False: 5.0)
    monkeypatch.setattr(dn, "run_scenario_nixl", lambda s, timing_only=False: next(real_ms))

    def fake_json(ms: float, requests: bool) -> dict:
        # the run's first request is never steady; the second carries the run's time
        return {"outcome": "ok", "verified": True, "rank_cpu": {},
                "requests": {"descriptors_posted": 1, "descriptors_coalesced": 1},
                "request_details": [_req(0, 1.0), _req(1, ms * 1e-3)]}

    monkeypatch.setattr(res, "result_json", fake_json)
    a, b = validate(files, repeats=2, warm_up=2)
    assert a.real_seconds == pytest.approx((1e-3, 3e-3))  # measured passes only
    assert b.real_seconds == pytest.approx((2e-3, 4e-3))
    assert a.warm_up_seconds == pytest.approx((50e-3, 70e-3))  # kept apart, in run order
    assert b.warm_up_seconds == pytest.approx((60e-3, 80e-3))
    assert len(a.loads) == 2 and a.real_median == pytest.approx(2e-3)
    # the simulated profile's coordinator CPU per call, read from the shipped profile
    assert a.profile_coordinator_call_us == pytest.approx(219.4)
    text = markdown([a, b], {"repeats": 2, "warm_up": 2})
    assert "after 2 warm-up passes over every file whose runs are left out" in text
    with pytest.raises(ValidationError, match="--warm-up -1: expected an integer >= 0"):
        validate(files, warm_up=-1)


def _with_coordinator(r: FileResult, calls: int, cpu: float, profile_us: float) -> FileResult:
    return FileResult(**{**r.__dict__, "profile_coordinator_call_us": profile_us,
                         "rank_cpu": {"coordinator": {"calls": calls, "cpu_seconds": cpu}}})


def test_host_cpu_drift_compares_the_real_coordinator_with_the_profiles() -> None:
    base = _result(1.0, (1.0,))
    # 300 + 100 calls in 0.2 s of CPU: 500 us per call, against a profile's 200 us
    slow = [_with_coordinator(base, 300, 0.12, 200.0), _with_coordinator(base, 100, 0.08, 200.0)]
    drift = summary(slow)["host_cpu_drift"]
    assert drift == {"real_coordinator_call_us": 500.0, "profile_coordinator_call_us": 200.0,
                     "ratio": 2.5}
    text = markdown(slow, {})
    assert "2.50x the 200 us" in text and "the host ran slower than when the profile" in text
    fast = [_with_coordinator(base, 100, 0.01, 200.0)]  # 100 us per call: 0.5x
    assert "the host ran faster than when" in markdown(fast, {})
    same = [_with_coordinator(base, 100, 0.024, 200.0)]  # 240 us: 1.2x, within 1.5x
    assert "ran at about its calibration's speed" in markdown(same, {})
    # a profile without coordinator CPU, or runs that counted none: unknown, never a ratio
    assert summary([_with_coordinator(base, 100, 0.02, 0.0)])["host_cpu_drift"] is None
    assert summary([_with_coordinator(base, 0, 0.0, 200.0)])["host_cpu_drift"] is None
    assert "speed against the profile's calibration is unknown" in markdown([base], {})


def test_post_call_totals_add_every_transfer_with_a_post_time() -> None:
    data = {"request_details": [
        {"telemetry": [{"nbytes": 1000, "post_seconds": 0.5},
                       {"nbytes": 3000, "post_seconds": 1.0}]},
        {"telemetry": None}, {"telemetry": [{"nbytes": 7, "post_seconds": None}]},
        {"telemetry": [{"nbytes": 500, "post_seconds": 0.25}]}]}
    assert post_call_totals(data) == (4500, 1.75)
    assert post_call_totals({}) == (0, 0.0)


def _with_posts(r: FileResult, *calls: tuple[int, float]) -> FileResult:
    return FileResult(**{**r.__dict__, "post_calls": calls})


def test_host_copy_drift_sets_the_real_post_calls_pace_against_the_simulated() -> None:
    base = _result(1.0, (1.0,))
    # sim 4 GB/s over both files (4e9 B in 1 s); real 0.6 GB/s over every real run (3e9 B in
    # 5 s; the first real run of each file alone would say 1 GB/s)
    slow = [_with_posts(base, (3 * 10**9, 0.75), (10**9, 1.0), (10**9, 3.0)),
            _with_posts(base, (10**9, 0.25), (10**9, 1.0))]
    drift = summary(slow)["host_copy_drift"]
    assert drift == {"sim_post_gbps": 4.0, "real_post_gbps": 0.6, "ratio": 6.67}
    text = markdown(slow, {})
    assert "real post calls moved 0.6 GB/s" in text and "took 6.67x as long" in text
    fast = [_with_posts(base, (10**9, 1.0), (10**9, 0.5))]  # flagged both ways
    assert "**the real calls took 0.50x as long" in markdown(fast, {})
    near = [_with_posts(base, (10**9, 1.0), (10**9, 1.2))]
    assert "(1.20x as long on the real side)" in markdown(near, {})
    assert summary([base])["host_copy_drift"] is None  # no post calls recorded
    assert summary([_with_posts(base, (10**9, 1.0), (0, 0.0))])["host_copy_drift"] is None
    assert "pace is unknown" in markdown([base], {})


def test_resampled_verdict_says_how_firmly_the_real_runs_decide() -> None:
    # identical real runs: nothing to resample, the verdict is firm either way
    firm = [_result(1.1, (1.0, 1.0, 1.0)), _result(0.9, (1.0, 1.0, 1.0))]
    v = resampled_verdict(firm)
    assert v["met_share"] == 1.0
    assert v["median_abs_error_p5_p95"] == pytest.approx([0.1, 0.1])
    assert v["worst_abs_error_p5_p95"] == pytest.approx([0.1, 0.1])
    # one file's real runs straddle the worst bound: sim 1.0 against runs of 0.6, 1.0 and 2.0
    # next to two exact files (the median |error| is always 0: only the worst bound decides)
    shaky = [_result(1.0, (1.0, 1.0, 1.0))] * 2 + [_result(1.0, (0.6, 1.0, 2.0))]
    v = resampled_verdict(shaky)
    # a draw meets the bounds iff the shaky file's resampled median is 1.0 (|error| 0); with
    # 0.6 it is +67 %, with 2.0 -50 %: P(median of 3 draws = 1.0) = 13/27
    assert v["met_share"] == pytest.approx(13 / 27, abs=0.04)
    assert v["median_abs_error_p5_p95"] == pytest.approx([0.0, 0.0])
    assert v["worst_abs_error_p5_p95"] == pytest.approx([0.0, 2 / 3])
    assert resampled_verdict(shaky) == v  # seeded: a report reproduces
    text = markdown(shaky, {})
    assert "Resampling each file's real runs (2,000 draws)" in text
    assert f"met in {100 * v['met_share']:.0f} % of the draws" in text
    assert "the verdict holds in every draw" in markdown(firm, {})
    assert resampled_verdict([]) is None


def test_judge_needs_one_set_of_real_runs_per_file() -> None:
    from hkvsim.validate import RealRuns, judge

    files = [ROOT / "scenarios" / "validation" / "llama-pull-1to1-strided.toml"]
    with pytest.raises(ValidationError, match="1 files but 2 sets of real runs"):
        judge(files, [RealRuns(), RealRuns()])
    with pytest.raises(ValidationError, match="a run did not complete its steady-state"):
        judge(files, [RealRuns()])  # no real run at all: nothing to set the sim against


def test_a_fit_refuses_a_simulated_run_that_did_not_complete() -> None:
    """The fit compares steady-state means: a scenario whose handshake is refused (here rule
    V5, KV layouts that differ) must stop the fit with its name, not enter it as a number."""
    from hkvsim.scenario import parse_scenarios
    from hkvsim.validate_fit import _sim

    (scenario,) = parse_scenarios("""
[scenario]
name = "refused pair"
[model]
preset = "tiny-llama"
[prefill]
kv_cache_layout = "NHD"
[decode]
kv_cache_layout = "HND"
[workload]
requests = 3
prompt_tokens = 300
""")
    with pytest.raises(ValidationError) as exc:
        _sim(scenario, None, {})
    assert str(exc.value).startswith("refused pair: the simulated run did not complete its "
                                     "steady-state requests")


def test_one_units_per_item_ratio_cannot_separate_a_per_item_cost() -> None:
    """Every file with the same bytes per operation (or posts per operation): the per-item and
    per-unit terms cannot be told apart, so all the CPU is per unit, even when the CPU per item
    varies between files."""
    from hkvsim.validate_fit import _per_item_and_unit

    same_ratio = [(10.0, 100.0, 1.0), (20.0, 200.0, 3.0)]
    assert _per_item_and_unit(same_ratio) == (4.0 / 300.0, 0.0)
    two_ratios = [(10.0, 100.0, 10 * 0.5 + 100 * 0.01), (10.0, 400.0, 10 * 0.5 + 400 * 0.01)]
    assert _per_item_and_unit(two_ratios) == pytest.approx((0.01, 0.5))


def test_the_warm_up_clause_counts_its_passes() -> None:
    from hkvsim.validate import _warm_up_clause

    assert _warm_up_clause(0) == ""
    assert _warm_up_clause(1).startswith(", after 1 warm-up pass over every file")
    assert _warm_up_clause(2).startswith(", after 2 warm-up passes over every file")


def test_validate_prints_each_files_error_and_names_the_files_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """What `hkvsim validate` prints and records, given the results (the real runs stubbed: no
    NIXL process here)."""
    import json

    import hkvsim.transport.nixl as nixl
    import hkvsim.validate as val

    folder = tmp_path / "held"
    folder.mkdir()
    files = [folder / "a.toml", folder / "b.toml"]
    results = [FileResult(file=str(f), scenario=f.stem, profile="cpu-ucx-loopback",
                          sim_seconds=sim, real_seconds=(1e-3, 1.1e-3, 0.9e-3),
                          loads=(0.5,) * 3, descriptors_posted=(1, 1),
                          descriptors_coalesced=(1, 1), outcomes=("ok",) * 4, rank_cpu={})
               for f, sim in zip(files, (1.1e-3, 0.7e-3))]
    monkeypatch.setattr(nixl, "load_nixl", lambda: None)
    monkeypatch.setattr(val, "validate", lambda files, **kw: results)
    code = main(["validate", *map(str, files), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code == 1  # the worst file is 30 % off: within 40 %, but the median 20 % is not 15
    assert "a.toml: sim 1.100 ms, real 1.000 ms (spread 20 %), error +10 %" in out
    assert "b.toml: sim 0.700 ms, real 1.000 ms (spread 20 %), error -30 %" in out
    assert "median |error| 20 %, worst 30 %: acceptance NOT met" in out
    (saved,) = (tmp_path / "out").glob("*.json")
    assert json.loads(saved.read_text())["meta"]["source"] == f"{folder}/"
