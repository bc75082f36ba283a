"""``hkvsim calibrate --host --replay JSON``: refit and judge a host-path calibration on the real
runs stored in its JSON with the code as it is now (hkvsim/validate_fit.py ``replay_host``).

The stored "real" times here are made from the simulator itself at a known grid point, so the
refit must find that point and the held-out error is known exactly."""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from hkvsim.backends.calibrate import DEFAULT_PROFILE
from hkvsim.cli import main
from hkvsim.validate import ValidationError, _load
from hkvsim.validate_fit import HostFit, _sim, replay_host

ROOT = Path(__file__).resolve().parents[1]
FIT = ROOT / "scenarios" / "fit" / "llama-pull-1to1-off.toml"
HELD = ROOT / "scenarios" / "validation" / "llama-pull-1to1-strided.toml"
# what a calibration measured (the replay keeps these) and stored as its fit (it refits these)
STORED = HostFit(cores=2, core_gbps=1.0, completion_notice_us=1.0, coordinator_message_us=8.0,
                 rank_dispatch_us=200.0, peer_poll_idle_us=1000.0, peer_poll_busy_us=100.0,
                 coordinator_call_us=200.0)
TRUE_GBPS, TRUE_NOTICE = 2.4414, 500.0
GRID, NOTICES = (1.0, TRUE_GBPS), (1.0, TRUE_NOTICE)
CONTENTIONS = (0.0,)  # the stored times have none (fit with contention: tests/test_host_path.py)


@pytest.fixture(scope="module")
def truth() -> tuple[float, float]:
    """The simulated steady-state times of the FIT and the held-out file at the true point."""
    point = replace(STORED, core_gbps=TRUE_GBPS, completion_notice_us=TRUE_NOTICE).overrides()
    fit, held = _load([FIT, HELD])
    return _sim(fit, DEFAULT_PROFILE, point), _sim(held, DEFAULT_PROFILE, point)


def _record(fit_real: list[float], held_real: list[float]) -> dict:
    return {"fit": asdict(STORED), "meta": {"when": "2026-12-02 10:42 UTC"},
            "fit_files": [{"file": str(FIT), "real_seconds": fit_real}],
            "held_out_files": [{"file": str(HELD), "real_seconds": held_real}]}


def test_replay_refits_on_the_stored_fit_runs_and_judges_the_stored_held_out_runs(truth):
    fit_t, held_t = truth
    before = DEFAULT_PROFILE.read_bytes()
    # FIT runs around the truth (median = truth); held-out runs 1.5x faster than simulated
    record = _record([fit_t * 0.9, fit_t, fit_t * 1.2], [held_t / 1.5] * 3)
    out = replay_host(record, profile_in=DEFAULT_PROFILE, grid=GRID, notice_grid=NOTICES,
                      contention_grid=CONTENTIONS)
    # the rate and notice are refitted (the stored 1.0 GB/s / 1 us are not kept) ...
    assert (out["fit"]["core_gbps"], out["fit"]["completion_notice_us"]) == (TRUE_GBPS,
                                                                            TRUE_NOTICE)
    assert out["stored_fit"]["core_gbps"] == 1.0
    # ... and the measured constants are the record's
    assert out["fit"]["rank_dispatch_us"] == 200.0 and out["fit"]["coordinator_call_us"] == 200.0
    assert out["fit_files"][0]["error"] == pytest.approx(0.0, abs=1e-9)
    # the held-out file is simulated with the refitted candidate, against its stored runs
    assert out["held_out_files"][0]["sim_seconds"] == pytest.approx(held_t, rel=1e-9)
    assert out["held_out_files"][0]["error"] == pytest.approx(0.5, rel=1e-6)
    assert out["held_out_worst"] == pytest.approx(0.5, rel=1e-6)
    assert out["within_bounds"] is False
    assert out["resampled"]["met_share"] == 0.0
    assert out["profile_written"] is None
    assert DEFAULT_PROFILE.read_bytes() == before  # a replay never writes the profile


def test_a_replay_within_the_bounds_exits_0_and_one_outside_exits_1(truth, tmp_path, capsys,
                                                                    monkeypatch):
    fit_t, held_t = truth
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_record([fit_t], [held_t * 1.05, held_t, held_t * 0.95])))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_record([fit_t], [held_t / 1.5])))
    import hkvsim.validate_fit as vf

    # the CLI uses the full grid; keep this test short with the two-point grid
    full = vf.fit_host

    def small(*args, **kwargs):
        return full(*args, **{**kwargs, "grid": GRID, "notice_grid": NOTICES,
                               "contention_grid": CONTENTIONS})

    monkeypatch.setattr(vf, "fit_host", small)
    assert main(["calibrate", "--host", "--replay", str(good)]) == 0
    said = capsys.readouterr().out
    assert "within the bounds" in said and "nothing written" in said
    assert main(["calibrate", "--host", "--replay", str(bad)]) == 1
    assert "outside the bounds" in capsys.readouterr().out


@pytest.mark.parametrize("mangle, says", [
    (lambda r: r.pop("fit_files"), "'fit_files' missing"),
    (lambda r: r["held_out_files"][0].pop("real_seconds"), "held_out_files[0] needs"),
    (lambda r: r["held_out_files"][0].update(real_seconds=[]), "at least one positive time"),
    (lambda r: r["fit_files"][0].update(file="scenarios/fit/nope.toml"), "nope.toml not found"),
    (lambda r: r["fit"].update(warp_factor=9), "unknown fit key(s) warp_factor"),
    (lambda r: r.pop("fit"), "no 'fit' object"),
])
def test_bad_records_are_refused_naming_what_is_wrong(mangle, says):
    record = _record([1e-3], [1e-3])
    mangle(record)
    with pytest.raises(ValidationError) as err:
        replay_host(record, profile_in=DEFAULT_PROFILE, grid=GRID, notice_grid=NOTICES,
                    contention_grid=CONTENTIONS)
    assert says in str(err.value)


def test_the_replay_cli_needs_no_nixl_and_refuses_bad_input(tmp_path, monkeypatch, capsys):
    import hkvsim.transport.nixl as nixl

    def no_nixl():
        raise nixl.NixlUnavailable("NIXL is not installed")

    monkeypatch.setattr(nixl, "load_nixl", no_nixl)
    not_json = tmp_path / "x.json"
    not_json.write_text("{")
    assert main(["calibrate", "--host", "--replay", str(not_json)]) == 2
    err = capsys.readouterr().err
    assert "not JSON" in err and "NIXL" not in err
    assert main(["calibrate", "--host", "--replay", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    assert main(["calibrate", "--host", "--replay", str(empty)]) == 2
    assert "no 'fit' object" in capsys.readouterr().err
    assert main(["calibrate", "--replay", str(empty)]) == 2  # without --host
    assert "--replay needs --host" in capsys.readouterr().err


def test_the_committed_refused_calibration_replays_to_its_own_simulated_times():
    """A replay at the record's own fitted point reproduces every simulated time of the
    committed report: the report is still what the code predicts with those constants (a
    change to the host-path model makes it stale: rerun `hkvsim calibrate --host`)."""
    path = ROOT / "reports" / "calibration" / "host-path-refused.json"
    record = json.loads(path.read_text())
    fit = record["fit"]
    out = replay_host(record, profile_in=DEFAULT_PROFILE, grid=(fit["core_gbps"],),
                      notice_grid=(fit["completion_notice_us"],),
                      contention_grid=(fit.get("core_contention", 0.0),))
    for key in ("fit_files", "held_out_files"):
        assert [r["sim_seconds"] for r in out[key]] == pytest.approx(
            [r["sim_seconds"] for r in record[key]], rel=1e-9), key
    assert out["held_out_median"] == pytest.approx(
        record["held_out_summary"]["median_abs_error"], rel=1e-9)
    assert out["within_bounds"] is record["accepted"]
