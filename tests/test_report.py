"""``hkvsim report``: report.md, the PNG figures, report.json and a valid Chrome/Perfetto
trace.json from a small sweep; deterministic; from a saved run; descriptor-merging section."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from hkvsim.cli import main

pytestmark = pytest.mark.timeout(120)

PNG = b"\x89PNG\r\n\x1a\n"

SWEEP = """
[scenario]
name = "report test"
seed = 3
[model]
preset = "tiny-kimi-linear"
[connector]
registration_order = "state-first"
[workload]
requests = 3
prompt_tokens = [300, 1200, 2500]
max_inflight = 1
[sweep]
connector.mode = ["pull", "push"]
prefill.tp = [1, 2]
decode.tp = [2, 4]
"""

MERGE = """
[scenario]
name = "merge test"
seed = 3
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 2
[decode]
tp = 4
[workload]
requests = 2
prompt_tokens = [700, 1501]
[sweep]
connector.descriptor_merge = ["off", "contiguous", "strided"]
"""


@pytest.fixture(scope="module")
def sweep_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("report")
    scenario = root / "small-sweep.toml"
    scenario.write_text(SWEEP)
    out = root / "out"
    assert main(["report", str(scenario), "--out", str(out),
                 "--calibration", str(root / "no-calibration")]) == 0
    return scenario, out


def test_report_writes_markdown_figures_and_trace(sweep_report: tuple[Path, Path]) -> None:
    _, out = sweep_report
    text = (out / "report.md").read_text()
    for figure in ("transfer-vs-prompt.png", "tp-heatmap.png", "kv-vs-state.png",
                   "time-breakdown.png", "link-utilisation.png"):
        assert (out / figure).read_bytes()[:8] == PNG, figure
        assert f"]({figure})" in text, figure
    for heading in ("## Summary", "## Transfer time and descriptors vs prompt length",
                    "## P TP x D TP", "## MLA KV vs KDA state", "## Time breakdown",
                    "## Link utilisation", "## Simulated vs measured", "## Trace"):
        assert heading in text
    assert "No measurements in" in text
    assert not (out / "simulated-vs-measured.png").exists()
    assert "The oracle checked every byte of every completed request in all 8 variants" in text
    # a complete family is counted as is ("8", not "8 of 8"), and the time breakdown keeps each
    # TP pair's first request (it pays the handshake) apart from its two warm ones
    assert "\n| small-sweep | 8 | 24/24 | ok 8 | 8/8 | verified 8 | - |" in text
    assert "\n| pull | P1->D2 | 262.0 | 2 | " in text and "\n| push | P1->D2 | 524.0 | 2 | " in text
    assert text.startswith("# report test\n")
    # one input and no --compare: nothing is put side by side
    assert json.loads((out / "report.json").read_text())["comparison"] is None
    assert "## Input `" not in text


def test_trace_is_valid_chrome_trace_of_every_transfer(sweep_report: tuple[Path, Path]) -> None:
    _, out = sweep_report
    trace = json.loads((out / "trace.json").read_text())
    events = trace["traceEvents"]
    assert isinstance(events, list) and events
    for e in events:
        assert e["ph"] in {"X", "b", "e", "C", "M"}
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] != "M":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    # every async begin has its end (same category, id and name), never before it
    opened: dict[tuple, float] = {}
    for e in events:
        key = (e.get("cat"), e.get("id"), e["name"], e["pid"])
        if e["ph"] == "b":
            opened[key] = e["ts"]
        elif e["ph"] == "e":
            assert e["ts"] >= opened.pop(key)
    assert not opened
    # one posting slice per transfer of every request of every variant
    report = json.loads((out / "report.json").read_text())
    transfers = sum(r["transfers"] for v in report["variants"] for r in v["requests"])
    assert transfers > 0
    assert sum(e["ph"] == "X" and e["cat"] == "post" for e in events) == transfers
    names = Counter(e["args"]["name"] for e in events if e["name"] == "process_name")
    assert len(names) == 8 and set(names.values()) == {1}
    # link counters: one sample per link and time (a zero only in a gap between segments)
    samples = Counter((e["pid"], e["name"], e["ts"]) for e in events if e["ph"] == "C")
    assert samples and set(samples.values()) == {1}
    # each request's transfer window; the posting threads are the initiators' endpoints (the
    # default profile packs prefill's ranks first: n0g0.., then decode's)
    assert sum(e["ph"] == "b" and e["name"] == "transfer window" for e in events) == 3 * 8
    for pid, name in ((e["pid"], e["args"]["name"]) for e in events
                      if e["name"] == "process_name"):
        point = dict(kv.split("=") for kv in name.split(" [")[1].rstrip("]").split(", "))
        p_tp, d_tp = int(point["prefill.tp"]), int(point["decode.tp"])
        posting = {e["args"]["name"] for e in events if e["pid"] == pid
                   and e["name"] == "thread_name" and e["tid"] > 0}
        gpus = range(p_tp) if point["connector.mode"] == "push" else range(p_tp, p_tp + d_tp)
        assert posting == {f"n0g{g} posting" for g in gpus}, (name, posting)


def test_report_is_deterministic(sweep_report: tuple[Path, Path], tmp_path: Path) -> None:
    scenario, out = sweep_report
    again = tmp_path / "again"
    assert main(["report", str(scenario), "--out", str(again),
                 "--calibration", str(scenario.parent / "no-calibration")]) == 0
    assert (again / "trace.json").read_bytes() == (out / "trace.json").read_bytes()
    first, second = (json.loads((d / "report.json").read_text()) for d in (out, again))
    assert first.pop("command") != second.pop("command")  # only the --out path differs
    assert first == second
    first = (out / "report.md").read_text().replace(str(out), "OUT")
    second = (again / "report.md").read_text().replace(str(again), "OUT")
    assert first == second


def test_report_from_saved_run_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    scenario = tmp_path / "small.toml"
    scenario.write_text(SWEEP)
    assert main(["run", str(scenario), "--json", "--requests"]) == 0
    saved = tmp_path / "saved.json"
    saved.write_text(capsys.readouterr().out)
    out = tmp_path / "from-json"
    assert main(["report", str(saved), "--out", str(out),
                 "--calibration", str(tmp_path / "none")]) == 0
    text = (out / "report.md").read_text()
    assert "## Transfer time and descriptors vs prompt length" in text
    assert (out / "tp-heatmap.png").read_bytes()[:8] == PNG
    assert not (out / "link-utilisation.png").exists()  # a saved run has no link segments
    json.loads((out / "trace.json").read_text())


def test_one_folder_of_several_families_is_not_compared_by_input(tmp_path: Path) -> None:
    """Several families in one input are reported together; only several inputs are put side
    by side by default."""
    family = tmp_path / "families"
    family.mkdir()
    (family / "merge.toml").write_text(MERGE.replace("requests = 2", "requests = 1"))
    (family / "other.toml").write_text(MERGE.replace('name = "merge test"', 'name = "other"')
                                       .replace("requests = 2", "requests = 1"))
    out = tmp_path / "out"
    assert main(["report", str(family), "--out", str(out),
                 "--calibration", str(tmp_path / "none")]) == 0
    assert json.loads((out / "report.json").read_text())["comparison"] is None


def test_merge_comparison_and_measured_hook(tmp_path: Path,
                                            capsys: pytest.CaptureFixture) -> None:
    family = tmp_path / "families"
    family.mkdir()
    (family / "tiny.toml").write_text(MERGE)
    out = tmp_path / "merge"
    assert main(["report", str(family), "--out", str(out),
                 "--calibration", str(tmp_path / "none")]) == 0
    text = (out / "report.md").read_text()
    assert "## Descriptor merging" in text and "| not measured |" in text
    assert (out / "descriptor-merging.png").read_bytes()[:8] == PNG
    (fam,) = json.loads((out / "report.json").read_text())["descriptor_merging"]
    modes = fam["modes"]
    assert fam["family"] == "tiny"
    assert modes["off"]["posted"] == modes["off"]["reference"]
    assert modes["contiguous"]["reference"] == modes["off"]["reference"]
    assert modes["strided"]["posted"] < modes["contiguous"]["posted"] < modes["off"]["posted"]
    assert modes["contiguous"]["nbytes"] == modes["off"]["nbytes"]
    assert all(m["byte_exact_variants"] == m["verified_variants"] == 1 for m in modes.values())
    # the NIXL-backend hook: a saved run of the same scenarios fills the measured column
    capsys.readouterr()
    assert main(["run", str(family / "tiny.toml"), "--json", "--requests"]) == 0
    measured = tmp_path / "measured.json"
    measured.write_text(capsys.readouterr().out)
    out2 = tmp_path / "merge-measured"
    assert main(["report", str(family), "--out", str(out2), "--measured", str(measured),
                 "--calibration", str(tmp_path / "none")]) == 0
    text = (out2 / "report.md").read_text()
    assert "| not measured |" not in text and "contiguous: " in text


def test_a_timing_only_merge_family_claims_no_byte_exact_run(tmp_path: Path) -> None:
    # nothing was checked: no variant may count as byte-exact, and the table says timing-only
    family = tmp_path / "families"
    family.mkdir()
    (family / "tiny.toml").write_text(MERGE.replace("requests = 2", "requests = 2\nverify = false")
                                     + "[expect]\nbyte_exact = false\n")
    out = tmp_path / "merge"
    assert main(["report", str(family), "--out", str(out),
                 "--calibration", str(tmp_path / "none")]) == 0
    (fam,) = json.loads((out / "report.json").read_text())["descriptor_merging"]
    assert all(m["byte_exact_variants"] == m["verified_variants"] == 0
               for m in fam["modes"].values())
    assert "| 0/0 verified runs exact (3 timing-only) |" in (out / "report.md").read_text()


def test_an_unknown_coalesced_count_is_never_summed_as_zero(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    # a backend that did not report NIXL's coalesced count for one transfer: that mode's
    # total is unknown (None), not the sum of the others
    from hkvsim.report.compare import merge_comparison
    from hkvsim.report.data import variants_from_json

    saved = _merge_sweep_json(tmp_path, capsys)
    path = _saved(tmp_path / "saved.json", saved)
    (fam,) = merge_comparison(variants_from_json(path))
    assert all(isinstance(m["coalesced"], int) and m["coalesced"] > 0
               for m in fam["modes"].values())
    # a family's variants differ only in the merge mode: the row is named by the scenario
    assert [row["label"] for row in fam["rows"]] == ["merge test"]
    entry = next(e for e in saved["scenarios"] if "=contiguous" in e["scenario"])
    del entry["request_details"][1]["telemetry"][0]["coalesced"]
    (fam,) = merge_comparison(variants_from_json(_saved(path, saved)))
    assert fam["modes"]["contiguous"]["coalesced"] is None
    assert isinstance(fam["modes"]["off"]["coalesced"], int)
    assert fam["rows"][0]["contiguous"]["coalesced"] is None


def test_a_saved_simulated_run_is_not_a_measurement(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    # a calibration directory holding a saved run of the same scenarios: points only when that
    # run came from a real backend, one per request, each against the simulated run's time
    from hkvsim.report.compare import calibration_points
    from hkvsim.report.data import variants_from_json

    saved = _merge_sweep_json(tmp_path, capsys)
    sims = variants_from_json(_saved(tmp_path / "sim.json", saved))
    cal = tmp_path / "calibration"
    cal.mkdir()
    _saved(cal / "run.json", saved)
    assert calibration_points(sims, cal) == []
    for entry in saved["scenarios"]:
        entry["backend"] = "nixl"
    _saved(cal / "run.json", saved)
    points = calibration_points(sims, cal)
    assert len(points) == 3 * 2  # three merge modes x two requests
    assert all(p["transport"] == "nixl" and p["simulated_seconds"] == p["measured_seconds"] > 0
               for p in points)


def _merge_sweep_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> dict:
    """`hkvsim sweep --json --requests` of the MERGE family, parsed."""
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(MERGE)
    assert main(["sweep", str(scenario), "--json", "--requests"]) == 0
    return json.loads(capsys.readouterr().out)


def _saved(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def test_calibration_points_are_plotted_for_the_profile_they_measured(
        sweep_report: tuple[Path, Path], tmp_path: Path) -> None:
    scenario, _ = sweep_report
    cal = tmp_path / "calibration"
    cal.mkdir()
    points = [{"label": "a", "simulated_seconds": 0.002, "measured_seconds": 0.003},
              {"label": "b", "simulated_seconds": 0.010, "measured_seconds": 0.009}]
    # a calibration of another profile (the CPU loopback one) says nothing about h200-nvlink
    (cal / "cpu-ucx-loopback.json").write_text(json.dumps({"points": points}))
    out = tmp_path / "cal"
    assert main(["report", str(scenario), "--out", str(out), "--calibration", str(cal)]) == 0
    assert not (out / "simulated-vs-measured.png").exists()
    assert "No measurements in" in (out / "report.md").read_text()
    # points of the profile the report's scenarios use are plotted
    (cal / "h200.json").write_text(json.dumps({"profile_name": "h200-nvlink", "points": points}))
    assert main(["report", str(scenario), "--out", str(out), "--calibration", str(cal)]) == 0
    assert (out / "simulated-vs-measured.png").read_bytes()[:8] == PNG
    text = (out / "report.md").read_text()
    assert "2 measured points" in text and "cpu-ucx-loopback.json" not in text


def test_bad_input_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["report", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hkvsim: error:") and err.count("\n") == 1
    # a saved sweep with no variant in it (an empty shard): said, nothing written
    empty = tmp_path / "empty-shard.json"
    empty.write_text(json.dumps({"source": "x.toml", "variants": 4, "shard": "4/4",
                                 "expectation_met": True, "verified": True, "scenarios": []}))
    assert main(["report", str(empty), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (f"hkvsim: error: {empty}: no variant to report (an "
                                       f"empty shard?)\n")
    assert main(["report", str(tmp_path / "missing.toml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hkvsim: error:") and err.count("\n") == 1
    # JSON that is not a saved run: named, whatever its shape
    for name, data in (("other.json", {"points": 3}), ("list.json", [{"outcome": "ok"}]),
                       ("envelope.json", {"scenarios": [1, 2]})):
        path = tmp_path / name
        path.write_text(json.dumps(data))
        assert main(["report", str(path), "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err == f"hkvsim: error: {path}: not a saved `hkvsim run --json` result\n", err
    assert not (tmp_path / "out").exists()


def test_matplotlib_is_imported_only_by_the_report_plots() -> None:
    code = ("import sys, hkvsim.cli, hkvsim.cluster, hkvsim.report; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_merge_comparison_needs_off_and_at_least_one_other_mode(tmp_path: Path) -> None:
    """A family is compared when it ran "off" (the reference) and one more mode; "off" alone,
    or merged modes without "off", has nothing to be compared against."""
    family = tmp_path / "families"
    family.mkdir()
    sweep = 'connector.descriptor_merge = ["off", "contiguous", "strided"]'
    for stem, modes in (("two", '["off", "contiguous"]'), ("alone", '["off"]'),
                        ("nooff", '["contiguous", "strided"]')):
        (family / f"{stem}.toml").write_text(
            MERGE.replace(sweep, f"connector.descriptor_merge = {modes}"))
    out = tmp_path / "merge"
    assert main(["report", str(family), "--out", str(out),
                 "--calibration", str(tmp_path / "none")]) == 0
    (fam,) = json.loads((out / "report.json").read_text())["descriptor_merging"]
    assert fam["family"] == "two" and set(fam["modes"]) == {"off", "contiguous"}
    assert fam["modes"]["contiguous"]["posted"] < fam["modes"]["off"]["posted"]


def test_the_geometry_lists_every_tp_the_model_shards_at() -> None:
    from hkvsim.geometry import preset
    from hkvsim.report.data import _geometry

    model = preset("tiny-kimi-linear")
    g = _geometry(model)
    assert list(g["kv_bytes_per_token"]) == ["1", "2", "4", "8"]
    assert g["kv_bytes_per_token"]["4"] == model.kv_bytes_per_token(4)
    assert g["state_bytes_per_request"]["8"] == model.state_bytes_per_request(8)
    assert (g["attention_kind"], g["state_kind"], g["is_hybrid"]) == ("MLA", "KDA", True)


def test_an_older_saved_result_is_read_without_calling_corrupted_bytes_verified(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Results saved before `verified`, `verification` and `requests.corrupted` existed: the
    verdict is derived from what they do carry, and a request with wrong words is corrupted."""
    from hkvsim.report.data import variants_from_json

    path = tmp_path / "s.toml"
    path.write_text(MERGE.split("[sweep]")[0])
    capsys.readouterr()
    assert main(["run", str(path), "--json", "--requests"]) == 0
    new = json.loads(capsys.readouterr().out)

    def old(change=None) -> Path:
        data = json.loads(json.dumps(new))
        for key in ("verified", "verification"):
            data.pop(key)
        data["requests"].pop("corrupted")
        if change:
            change(data)
        saved = tmp_path / "old.json"
        saved.write_text(json.dumps(data))
        return saved

    (v,) = variants_from_json(old())
    assert (v.verification, v.corrupted, v.mismatched_bytes) == ("verified", 0, 0)

    def corrupt(data: dict) -> None:
        data["requests"]["mismatched_bytes"] = 8
        data["request_details"][1]["mismatched_words"] = 2

    (v,) = variants_from_json(old(corrupt))
    assert (v.verification, v.corrupted) == ("failed", 1)

    def nothing_completed(data: dict) -> None:
        data["requests"]["completed"] = 0

    assert variants_from_json(old(nothing_completed))[0].verification == "nothing-checked"

    def timing_only(data: dict) -> None:
        data["requests"]["byte_exact"] = None
        data["requests"]["mismatched_bytes"] = 8

    (v,) = variants_from_json(old(timing_only))
    assert (v.verification, v.mismatched_bytes) == ("timing-only", None)
