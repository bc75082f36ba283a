"""Reports that compare: several inputs each drawn and put side by side (or any axis:
--compare connector.mode), wording derived from each model's geometry, a per-request CSV and
the P/D sizing view ([prefill] tokens_per_second)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hkvsim.cli import main

pytestmark = pytest.mark.timeout(120)

PNG = b"\x89PNG\r\n\x1a\n"
BODY = """
[scenario]
name = "{name}"
seed = 3
[model]
preset = "{model}"
[prefill]
tokens_per_second = {rate}
[workload]
requests = 3
prompt_tokens = [300, 1200, 2500]
max_inflight = 1
[sweep]
connector.mode = ["pull", "push"]
prefill.tp = [1, 2]
decode.tp = [2, 4]
"""


@pytest.fixture(scope="module")
def two_inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict]:
    root = tmp_path_factory.mktemp("two")
    kimi = root / "kimi.toml"
    kimi.write_text(BODY.format(name="kimi side", model="tiny-kimi-linear", rate="2000000.0"))
    qwen = root / "qwen.toml"
    qwen.write_text(BODY.format(name="qwen side", model="tiny-qwen3-next", rate="1000.0"))
    out = root / "out"
    assert main(["report", str(kimi), str(qwen), "--out", str(out), "--csv",
                 "--calibration", str(root / "none")]) == 0
    return out, (out / "report.md").read_text(), json.loads((out / "report.json").read_text())


def test_two_inputs_are_both_drawn(two_inputs) -> None:
    out, text, data = two_inputs
    for family in ("kimi", "qwen"):
        assert f"## Input `{family}`" in text
        for stem in ("transfer-vs-prompt", "tp-heatmap", "kv-vs-state", "time-breakdown",
                     "pd-sizing"):
            assert (out / f"{stem}-{family}.png").read_bytes()[:8] == PNG, (stem, family)
            assert f"]({stem}-{family}.png)" in text
    assert {v["family"] for v in data["variants"]} == {"kimi", "qwen"}
    assert set(data["crossover_tokens"]) == {"kimi", "qwen"}


def test_wording_follows_each_model(two_inputs) -> None:
    _, text, _ = two_inputs
    kimi, qwen = text.split("## Input `kimi`")[1].split("## Input `qwen`")
    assert "### MLA KV vs KDA state" in kimi and "MLA KV is the same on every rank" in kimi
    assert "### GQA KV vs GDN state" in qwen and "GQA KV is split over TP by KV head" in qwen
    assert "MLA" not in qwen.split("## Link utilisation")[0]
    assert "KDA" not in qwen.split("## Link utilisation")[0]


def test_two_inputs_side_by_side(two_inputs) -> None:
    out, text, data = two_inputs
    assert "## Side by side: input" in text and "](compare.png)" in text
    assert (out / "compare.png").read_bytes()[:8] == PNG
    comparison = data["comparison"]
    assert comparison["axis"] == "input" and comparison["values"] == ["kimi", "qwen"]
    assert comparison["matched_requests"] == {"qwen": 24}
    row = comparison["rows"][0]
    assert set(row["cells"]) == {"kimi", "qwen"}
    assert comparison["geomean_ratio"]["qwen"] > 1  # the GDN state is larger


def test_requests_csv_has_a_row_per_request(two_inputs) -> None:
    out, _, data = two_inputs
    with open(out / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == sum(len(v["requests"]) for v in data["variants"]) == 48
    first = rows[0]
    assert first["input"] == "kimi" and first["verification"] == "verified"
    assert first["connector.mode"] == "pull" and first["status"] == "ok"
    exported = {(r["variant"], int(r["request"])): float(r["transfer_seconds"]) for r in rows}
    for v in data["variants"]:
        for r in v["requests"]:
            assert exported[(v["name"], r["index"])] == pytest.approx(r["transfer_seconds"],
                                                                     rel=1e-9)


def test_sizing_view_shows_when_the_transfer_limits_ttft(two_inputs) -> None:
    _, text, data = two_inputs
    for v in data["variants"]:
        for r in v["requests"]:
            rate = 2000000.0 if v["family"] == "kimi" else 1000.0
            prefill = (r["prompt_tokens"] - r["prefix_hit_tokens"]) / (rate * v["prefill_tp"])
            assert r["prefill_seconds"] == pytest.approx(prefill, rel=1e-9)
            share = r["transfer_seconds"] / (prefill + r["transfer_seconds"])
            assert r["transfer_share_of_ttft"] == pytest.approx(share, rel=1e-9)
    kimi, qwen = text.split("## Input `kimi`")[1].split("## Input `qwen`")
    # 2M tokens/s per rank: prefill of 300 tokens takes 0.15 ms, less than the transfer
    assert "The transfer limits TTFT somewhere for:" in kimi and "**" in kimi
    # 1k tokens/s per rank: prefill dominates everywhere
    assert "Prefill compute exceeds the transfer everywhere here." in qwen


def test_compare_along_a_sweep_axis(tmp_path) -> None:
    path = tmp_path / "modes.toml"
    path.write_text(BODY.format(name="modes", model="tiny-kimi-linear", rate="1000.0"))
    out = tmp_path / "out"
    assert main(["report", str(path), "--out", str(out), "--compare", "connector.mode",
                 "--calibration", str(tmp_path / "none")]) == 0
    comparison = json.loads((out / "report.json").read_text())["comparison"]
    assert comparison["values"] == ["pull", "push"]
    assert len(comparison["rows"]) == 4  # the four TP pairs, each with pull and push
    assert all(set(r["cells"]) == {"pull", "push"} for r in comparison["rows"])
    assert comparison["matched_requests"] == {"push": 12}


def test_bad_compare_axis_and_rate_are_one_line(tmp_path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(BODY.format(name="s", model="tiny-kimi-linear", rate="1000.0"))
    proc = subprocess.run([sys.executable, "-m", "hkvsim.cli", "report", str(path), "--out",
                           str(tmp_path / "o"), "--compare", "connector.nope"],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "--compare 'connector.nope'" in proc.stderr and "allowed: input, backend" in proc.stderr
    path.write_text(BODY.format(name="s", model="tiny-kimi-linear", rate="0"))
    proc = subprocess.run([sys.executable, "-m", "hkvsim.cli", "run", str(path)],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "prefill.tokens_per_second" in proc.stderr and "> 0" in proc.stderr


def test_an_axis_asked_for_is_kept_with_several_inputs(tmp_path) -> None:
    """Two inputs are put side by side by input only when no other axis is asked for."""
    small = BODY.replace("prefill.tp = [1, 2]\ndecode.tp = [2, 4]\n", "").replace(
        "[300, 1200, 2500]", "[300]").replace("requests = 3", "requests = 1")
    paths = []
    for name, model in (("a", "tiny-kimi-linear"), ("b", "tiny-qwen3-next")):
        paths.append(tmp_path / f"{name}.toml")
        paths[-1].write_text(small.format(name=name, model=model, rate="1000.0"))
    out = tmp_path / "out"
    assert main(["report", *map(str, paths), "--out", str(out), "--compare", "connector.mode",
                 "--calibration", str(tmp_path / "none")]) == 0
    comparison = json.loads((out / "report.json").read_text())["comparison"]
    assert comparison["axis"] == "connector.mode"
    assert comparison["values"] == ["pull", "push"]


def test_ratios_are_taken_request_by_request_and_averaged_geometrically(monkeypatch) -> None:
    """Each request's time on a value over its own time on the baseline, a geometric mean over
    the requests matched: faster and slower requests both count, a request without a time on
    either side is left out, and a zero baseline time is never divided by."""
    from hkvsim.report import axis as axis_module
    from hkvsim.report.data import Variant

    monkeypatch.setattr(axis_module, "transfer_seconds", lambda v, r: r["t"])

    def variant(mode: str, times: list[float | None]) -> Variant:
        return Variant(
            name=f"s [connector.mode={mode}]", family="s", source="s.toml",
            sweep_point={"connector.mode": mode}, model="m", mode=mode, merge="off",
            prefill_tp=1, decode_tp=1, profile="p", outcome="ok", expectation_met=True,
            verification="verified", mismatched_bytes=0, sim_seconds=1.0,
            requests=[{"index": i, "status": "ok", "t": t, "telemetry": [{"descriptors": 3}]}
                      for i, t in enumerate(times)],
            settings={"connector.mode": mode})

    # request 0: 2x slower; 1: 8x faster; 2: no time on push; 3: a zero baseline
    comparison = axis_module.compare_along(
        [variant("pull", [1.0, 8.0, 1.0, 0.0]), variant("push", [2.0, 1.0, None, 1.0])],
        "connector.mode")
    assert comparison["values"] == ["pull", "push"] and comparison["baseline"] == "pull"
    assert comparison["matched_requests"] == {"push": 2}
    assert comparison["pairs"]["push"] == [(1.0, 2.0), (8.0, 1.0)]
    assert comparison["geomean_ratio"]["push"] == pytest.approx((2.0 * 0.125) ** 0.5)
    (row,) = comparison["rows"]
    assert row["cells"]["pull"]["descriptors_posted"] == 12
    assert row["cells"]["pull"]["transfer_seconds_mean"] == pytest.approx(2.5)


def test_sizing_counts_only_the_tokens_prefill_computes() -> None:
    """A prefix-cache hit is not computed again: prefill time = (prompt - hit) / (rate x TP);
    a request with nothing to compute and nothing to move has a zero share, not a crash; a
    variant without the knob is left out."""
    from types import SimpleNamespace

    from hkvsim.report.sizing import KNOB, sizing_rows

    rated, unrated = (SimpleNamespace(settings={KNOB: 1000.0}), SimpleNamespace(settings={}))
    rows = [{"variant": rated, "prefill_tp": 2, "prompt_tokens": 3000, "hit_tokens": 1000,
             "transfer": 0.5},
            {"variant": rated, "prefill_tp": 2, "prompt_tokens": 64, "hit_tokens": 64,
             "transfer": 0.0},
            {"variant": unrated, "prefill_tp": 2, "prompt_tokens": 64, "hit_tokens": 0,
             "transfer": 0.1}]
    first, empty = sizing_rows(rows)
    assert (first["prefill_seconds"], first["ttft_seconds"]) == (1.0, 1.5)
    assert first["transfer_share"] == pytest.approx(1 / 3)
    assert (empty["prefill_seconds"], empty["ttft_seconds"], empty["transfer_share"]) == (
        0.0, 0.0, 0.0)


def test_requests_csv_phases_are_filled_for_completed_requests(two_inputs) -> None:
    out, _, data = two_inputs
    with open(out / "requests.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        assert r["status"] == "ok"
        phases = [float(r[f"{p}_seconds"]) for p in ("post_wait", "post", "wire")]
        assert all(p >= 0 for p in phases) and float(r["wire_seconds"]) > 0
