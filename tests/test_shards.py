"""Sweeps that scale out: ``--jobs N`` (child processes on this machine) and ``--shard i/n``
(a slice for another machine) give exactly the serial sweep's results, and ``hkvsim report``
merges the saved shard outputs into the serial sweep's report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hkvsim.cli import main
from hkvsim.shards import SelectionError, Shard, split

pytestmark = pytest.mark.timeout(240)

SWEEP = """
[scenario]
name = "shards"
seed = 5
[model]
preset = "tiny-kimi-linear"
[workload]
requests = 2
prompt_tokens = [300, 1800]
[sweep]
connector.mode = ["pull", "push"]
prefill.tp = [1, 2]
decode.tp = [1, 2]
"""


def _sweep_json(capsys: pytest.CaptureFixture, path: Path, *flags: str) -> dict:
    assert main(["sweep", str(path), "--json", "--requests", *flags]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def sweep_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("shards") / "shards.toml"
    path.write_text(SWEEP)
    return path


def test_jobs_and_shards_give_the_serial_results(sweep_file: Path, capsys) -> None:
    serial = _sweep_json(capsys, sweep_file)
    assert len(serial["scenarios"]) == 8 and serial["expectation_met"]
    parallel = _sweep_json(capsys, sweep_file, "--jobs", "2")
    assert parallel == serial
    shards = [_sweep_json(capsys, sweep_file, "--shard", f"{i}/3") for i in range(3)]
    assert [s["shard"] for s in shards] == ["0/3", "1/3", "2/3"]
    assert [len(s["scenarios"]) for s in shards] == [3, 3, 2]
    merged = sorted((d for s in shards for d in s["scenarios"]), key=lambda d: d["sweep_index"])
    assert merged == serial["scenarios"]
    # a shard run in parallel is still the same slice
    assert _sweep_json(capsys, sweep_file, "--shard", "1/3", "--jobs", "2") == shards[1]


def test_report_merges_shard_outputs_into_the_serial_report(sweep_file: Path, tmp_path,
                                                            capsys) -> None:
    saved = tmp_path / "serial.json"
    saved.write_text(json.dumps(_sweep_json(capsys, sweep_file)))
    parts = []
    for i in range(2):
        part = tmp_path / f"part{i}.json"
        part.write_text(json.dumps(_sweep_json(capsys, sweep_file, "--shard", f"{i}/2")))
        parts.append(part)
    reports = []
    for name, inputs in (("one", [saved]), ("merged", parts[::-1])):
        out = tmp_path / name
        assert main(["report", *map(str, inputs), "--out", str(out),
                     "--calibration", str(tmp_path / "none")]) == 0
        data = json.loads((out / "report.json").read_text())
        data.pop("command")
        reports.append((data, (out / "trace.json").read_bytes()))
    assert reports[0] == reports[1]
    assert reports[0][0]["variants"][0]["family"] == "shards"  # named after the scenario file
    # a missing shard is said, not hidden
    out = tmp_path / "half"
    assert main(["report", str(parts[0]), "--out", str(out),
                 "--calibration", str(tmp_path / "none")]) == 0
    assert "| shards | 4 of 8 |" in (out / "report.md").read_text()


def test_overlapping_shards_are_refused(sweep_file: Path, tmp_path, capsys) -> None:
    saved = tmp_path / "all.json"
    saved.write_text(json.dumps(_sweep_json(capsys, sweep_file)))
    part = tmp_path / "part.json"
    part.write_text(json.dumps(_sweep_json(capsys, sweep_file, "--shard", "0/2")))
    assert main(["report", str(saved), str(part), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is in the inputs twice" in err


@pytest.mark.parametrize("flags,needle", [
    (["--shard", "2/2"], "--shard '2/2': expected i/n with 0 <= i < n"),
    (["--shard", "x"], "--shard 'x': expected i/n"),
    (["--jobs", "0"], "--jobs 0: expected a number of processes >= 1"),
    (["--jobs", "2", "--backend", "nixl"], "--shard i/n instead"),
])
def test_bad_selection_is_one_line_exit_2(sweep_file: Path, flags, needle) -> None:
    proc = subprocess.run([sys.executable, "-m", "hkvsim.cli", "sweep", str(sweep_file), *flags],
                          capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and needle in proc.stderr


def test_shards_partition_the_variants() -> None:
    slices = [Shard.parse(f"{i}/4").select(10) for i in range(4)]
    assert sorted(sum(slices, [])) == list(range(10))
    assert slices[0] == [0, 4, 8] and slices[3] == [3, 7]
    assert split([0, 1, 2, 3, 4], 2) == [[0, 2, 4], [1, 3]]
    with pytest.raises(SelectionError):
        Shard.parse("-1/2")


def test_a_jobs_child_runs_only_variant_indices_that_exist() -> None:
    from hkvsim.shards import parse_variant_list

    assert parse_variant_list("3,0, 3,1", 4) == [0, 1, 3]
    for bad in ("", "4", "-1,2", "1,x", ","):
        with pytest.raises(SelectionError, match=f"--variants {bad!r}: expected comma-separated "
                                                 f"variant indices from 0 to 3"):
            parse_variant_list(bad, 4)


def test_each_finished_child_advances_the_progress_once(sweep_file: Path) -> None:
    from hkvsim.shards import run_children

    ticks: list[int] = []
    results = run_children(str(sweep_file), [0, 3, 5], jobs=2, flags=["--timing-only"],
                           on_chunk=lambda: ticks.append(1))
    assert [r["sweep_index"] for r in results] == [0, 3, 5]  # in variant order
    assert len(ticks) == 2  # two children: [0, 5] and [3]
    assert len(run_children(str(sweep_file), [1], jobs=2, flags=["--timing-only"])) == 1
