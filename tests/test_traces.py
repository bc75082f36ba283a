"""Trace workloads: the Mooncake JSONL and CSV formats, their one-line errors, the prefix-hit
cache model, the [workload] trace key, and byte-exact runs driven by a trace."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hkvsim.cluster import SimDriver, run_scenario
from hkvsim.results import result_json
from hkvsim.scenario import MAX_REQUESTS, MAX_TOKENS, Scenario, ScenarioError, load_scenarios
from hkvsim.traces import TraceError, load_trace

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "scenarios" / "traces"


def _load(path: Path):
    return load_trace(path, max_tokens=MAX_TOKENS, max_requests=MAX_REQUESTS)


def _mooncake(tmp_path: Path, rows: list[dict | str], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _row(ts: float, n: int, ids: list[int], out: int = 10) -> dict:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}


def _reference_hits(rows: list[dict]) -> list[int]:
    """The documented cache model, written out plainly: every block id of every earlier request
    is cached; the hit is the leading run of cached ids x 512, at most the prompt minus one."""
    cached: list[int] = []
    hits = []
    for row in rows:
        run = 0
        for block in row["hash_ids"]:
            if block not in cached:
                break
            run += 1
        hits.append(min(run * 512, row["input_length"] - 1))
        cached.extend(row["hash_ids"])
    return hits


# --- Mooncake format ----------------------------------------------------------------------------


def test_mooncake_hits_follow_the_leading_run_of_seen_block_ids(tmp_path: Path) -> None:
    rows = [
        _row(1000, 1200, [0, 1, 2]),  # nothing seen yet
        _row(1000, 1300, [0, 1, 3]),  # shares blocks 0, 1: 1,024 tokens
        _row(1500, 1100, [0, 1, 2]),  # all seen: capped at the prompt minus one
        _row(2500, 1300, [4, 0, 1]),  # its first block is new: no hit, whatever follows
        _row(2500, 600, [5, 5]),      # repeated inside one request: not a hit
        _row(2600, 1536, [4, 0, 6]),  # block 4 seen (request 3), then 0, then 6 is new
    ]
    trace = _load(_mooncake(tmp_path, rows))
    assert trace.format == "mooncake"
    assert trace.prefix_hit_tokens.tolist() == [0, 1024, 1099, 0, 0, 1024]
    assert trace.prefix_hit_tokens.tolist() == _reference_hits(rows)
    assert trace.prompt_tokens.tolist() == [1200, 1300, 1100, 1300, 600, 1536]
    assert trace.arrival_seconds.tolist() == [0.0, 0.0, 0.5, 1.5, 1.5, 1.6]


def test_shipped_synthetic_trace_matches_the_reference_cache_model() -> None:
    path = TRACES / "synthetic-mooncake.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    trace = _load(path)
    assert len(trace) == len(rows) == 24
    assert trace.prefix_hit_tokens.tolist() == _reference_hits(rows)
    assert trace.prefix_hit_tokens.max() > 0 and (trace.prefix_hit_tokens == 0).any()


def test_csv_trace_is_the_same_requests_as_the_mooncake_one() -> None:
    mooncake, table = _load(TRACES / "synthetic-mooncake.jsonl"), _load(TRACES / "synthetic.csv")
    assert table.format == "csv"
    assert np.array_equal(mooncake.prompt_tokens, table.prompt_tokens)
    assert np.array_equal(mooncake.prefix_hit_tokens, table.prefix_hit_tokens)
    assert np.allclose(mooncake.arrival_seconds, table.arrival_seconds, atol=5e-4)


def test_csv_arrivals_are_relative_to_the_first_request(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,prefix_hit_tokens\n\n5.0,100,0\n5.25, 200 ,64\n")
    trace = _load(path)
    assert trace.arrival_seconds.tolist() == [0.0, 0.25]
    assert trace.prompt_tokens.tolist() == [100, 200]
    assert trace.prefix_hit_tokens.tolist() == [0, 64]


@pytest.mark.parametrize(("rows", "line", "field", "problem"), [
    (["{\"timestamp\": 0"], 1, None, "not a JSON object"),
    (["[1, 2]"], 1, None, "expected a JSON object"),
    ([_row(0, 100, [0]), {"timestamp": 1, "input_length": 100, "hash_ids": [1]}], 2,
     "output_length", "required key is missing"),
    ([{**_row(0, 100, [0]), "session": 3}], 1, "session",
     "unknown key; allowed: timestamp, input_length, output_length, hash_ids"),
    (['{"timestamp": 0, "timestamp": 1, "input_length": 100, "output_length": 1, '
      '"hash_ids": [0]}'], 1, "timestamp", "key given twice"),
    ([_row(0, True, [0])], 1, "input_length", "expected an integer, got True"),
    ([_row(0, 100.0, [0])], 1, "input_length", "expected an integer, got 100.0"),
    ([_row(0, 1, [0])], 1, "input_length", "expected an integer from 2 to"),
    ([_row(0, 1200, [0, 1])], 1, "hash_ids",
     "expected 3 ids (one per 512-token block of input_length 1200), got 2"),
    ([_row(0, 100, [-1])], 1, "hash_ids[0]", "expected an integer from 0 to"),
    ([_row(0, 100, "0")], 1, "hash_ids", "expected a list of integers"),
    ([_row(0, 100, [0], out=-1)], 1, "output_length", "expected an integer from 0 to"),
    ([_row(5, 100, [0]), _row(4, 100, [1])], 2, "timestamp",
     "arrivals must not decrease: 4.0 after 5.0"),
    (['{"timestamp": NaN, "input_length": 100, "output_length": 1, "hash_ids": [0]}'], 1,
     None, "not a JSON number: NaN"),
    ([_row("0", 100, [0])], 1, "timestamp", "expected a number, got '0'"),
])
def test_mooncake_errors_name_file_line_and_field(tmp_path: Path, rows, line, field,
                                                  problem) -> None:
    path = _mooncake(tmp_path, rows)
    with pytest.raises(TraceError) as info:
        _load(path)
    message = str(info.value)
    prefix = f"{path}:{line}: " + (f"{field}: " if field else "")
    assert message.startswith(prefix), message
    assert problem in message and "\n" not in message


@pytest.mark.parametrize(("text", "line", "field", "problem"), [
    ("arrival,prompt,hit\n0,100,0\n", 1, None,
     "expected the header arrival_s,prompt_tokens,prefix_hit_tokens"),
    ("arrival_s,prompt_tokens,prefix_hit_tokens\n0,100\n", 2, None, "expected 3 fields"),
    ("arrival_s,prompt_tokens,prefix_hit_tokens\n0,100,0\n0.5,100,100\n", 3,
     "prefix_hit_tokens", "a hit must leave at least one token to prefill: 100 >= "),
    ("arrival_s,prompt_tokens,prefix_hit_tokens\n1,100,0\n0.5,100,0\n", 3, "arrival_s",
     "arrivals must not decrease"),
    ("arrival_s,prompt_tokens,prefix_hit_tokens\nnan,100,0\n", 2, "arrival_s",
     "expected a finite number >= 0, got nan"),
    ("arrival_s,prompt_tokens,prefix_hit_tokens\n0,lots,0\n", 2, "prompt_tokens",
     "expected an integer, got 'lots'"),
    ("arrival_s,prompt_tokens,prefix_hit_tokens\n0,100,-3\n", 2, "prefix_hit_tokens",
     "expected an integer from 0 to"),
])
def test_csv_errors_name_file_line_and_field(tmp_path: Path, text, line, field, problem) -> None:
    path = tmp_path / "t.csv"
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        _load(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: " + (f"{field}: " if field else "")), message
    assert problem in message


@pytest.mark.parametrize(("name", "text", "problem"), [
    ("t.jsonl", "\n\n", "no requests in the trace"),
    ("t.csv", "arrival_s,prompt_tokens,prefix_hit_tokens\n", "no requests in the trace"),
    ("t.csv", "", "empty file; expected the header"),
    ("t.json", "{}", "unknown trace format '.json'; allowed: .jsonl, .csv"),
])
def test_file_level_errors(tmp_path: Path, name: str, text: str, problem: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceError) as info:
        _load(path)
    assert str(info.value) == f"{path}: {problem}" or str(info.value).startswith(
        f"{path}: {problem}")


def test_a_changed_file_is_read_again(tmp_path: Path) -> None:
    path = _mooncake(tmp_path, [_row(0, 100, [0])])
    assert len(_load(path)) == 1
    _mooncake(tmp_path, [_row(0, 100, [0]), _row(1, 100, [0])])
    assert len(_load(path)) == 2


# --- [workload] trace ---------------------------------------------------------------------------

SCENARIO = """
[scenario]
name = "trace"
seed = 3
[model]
preset = "{model}"
[decode]
prefix_caching = {caching}
[workload]
trace = "{trace}"
{extra}
"""


def _scenario_file(tmp_path: Path, *, trace: str = "traces/t.jsonl", model: str = "tiny-deepseek",
                   caching: str = "true", extra: str = "") -> Path:
    path = tmp_path / "suite" / "s.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(SCENARIO.format(model=model, caching=caching, trace=trace, extra=extra))
    return path


def _small_trace(tmp_path: Path) -> list[dict]:
    rows = [_row(0, 1100, [0, 1, 2]), _row(20, 1500, [0, 1, 3]), _row(30, 600, [0, 4]),
            _row(50, 1100, [0, 1, 2])]
    (tmp_path / "suite" / "traces").mkdir(parents=True, exist_ok=True)
    _mooncake(tmp_path / "suite" / "traces", rows)
    return rows


def test_trace_path_is_relative_to_the_scenario_file(tmp_path: Path, monkeypatch) -> None:
    _small_trace(tmp_path)
    path = _scenario_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    (s,) = load_scenarios(Path("suite") / "s.toml")
    assert s.workload.trace == str(tmp_path / "suite" / "traces" / "t.jsonl")
    assert s.workload.num_requests == 4
    prompts, hits = s.request_lengths()
    assert prompts.tolist() == [1100, 1500, 600, 1100] and hits.tolist() == [0, 1024, 512, 1099]
    rng = np.random.default_rng(0)
    assert s.arrival_times(4, rng).tolist() == [0.0, 0.02, 0.03, 0.05]
    assert rng.bit_generator.state == np.random.default_rng(0).bit_generator.state  # no draws
    assert load_scenarios(path)[0].workload == s.workload  # same file from its own directory


@pytest.mark.parametrize("key", ["prompt_tokens = 100", "prefix_hit_tokens = 0",
                                 'arrival = "burst"', 'arrival = "poisson"\nrate = 2.0'])
def test_trace_refuses_what_it_fixes(tmp_path: Path, key: str) -> None:
    _small_trace(tmp_path)
    path = _scenario_file(tmp_path, extra=key)
    with pytest.raises(ScenarioError) as info:
        load_scenarios(path)
    name = key.split(" ")[0]
    assert str(info.value).startswith(f"{path}: workload.{name}: not allowed beside "
                                      f"workload.trace"), str(info.value)


def test_requests_caps_the_replay(tmp_path: Path) -> None:
    _small_trace(tmp_path)
    (s,) = load_scenarios(_scenario_file(tmp_path, extra="requests = 2"))
    assert s.workload.num_requests == 2
    prompts, hits = s.request_lengths()
    assert prompts.tolist() == [1100, 1500] and hits.tolist() == [0, 1024]
    assert s.arrival_times(2, np.random.default_rng(0)).tolist() == [0.0, 0.02]
    with pytest.raises(ScenarioError, match=r"workload.requests: the trace has only 4 "):
        load_scenarios(_scenario_file(tmp_path, extra="requests = 5"))
    # the cap's bounds: one request, and all of them
    (one,) = load_scenarios(_scenario_file(tmp_path, extra="requests = 1"))
    assert one.request_lengths()[0].tolist() == [1100]
    (every,) = load_scenarios(_scenario_file(tmp_path, extra="requests = 4"))
    assert every.workload.num_requests == 4
    trace = _load(Path(one.workload.trace))
    assert len(trace.head(1)) == 1 and len(trace.head(4)) == 4
    for bad in (0, 5):
        with pytest.raises(ValueError, match=f"n must be from 1 to 4, got {bad}"):
            trace.head(bad)


def test_requests_is_required_without_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text('[scenario]\nname = "x"\n[model]\npreset = "tiny-llama"\n[workload]\n'
                    "prompt_tokens = 100\n")
    with pytest.raises(ScenarioError, match=r"s.toml: workload.requests: required key is "
                                            r"missing \(or give workload.trace\)"):
        load_scenarios(path)


def test_trace_hits_need_decode_prefix_caching(tmp_path: Path) -> None:
    _small_trace(tmp_path)
    path = _scenario_file(tmp_path, caching="false")
    with pytest.raises(ScenarioError, match=r"workload.trace: the trace's prefix hits need "
                                            r"\[decode\] prefix_caching = true"):
        load_scenarios(path)


def test_trace_errors_are_scenario_errors_naming_the_key(tmp_path: Path) -> None:
    _small_trace(tmp_path)
    bad = tmp_path / "suite" / "traces" / "bad.jsonl"
    bad.write_text(json.dumps(_row(0, 100, [0])) + "\n" + json.dumps(_row(1, 1200, [1])) + "\n")
    path = _scenario_file(tmp_path, trace="traces/bad.jsonl")
    with pytest.raises(ScenarioError) as info:
        load_scenarios(path)
    assert str(info.value) == (f"{path}: workload.trace: {bad}:2: hash_ids: expected 3 ids (one "
                               f"per 512-token block of input_length 1200), got 1")
    with pytest.raises(ScenarioError, match=r"workload.trace: no such file: .*missing.jsonl"):
        load_scenarios(_scenario_file(tmp_path, trace="missing.jsonl"))


def test_faults_are_checked_against_the_trace_length(tmp_path: Path) -> None:
    _small_trace(tmp_path)
    path = _scenario_file(tmp_path, extra='[[faults]]\nkind = "drop-notification"\nrequest = 4\n')
    with pytest.raises(ScenarioError, match=r"faults\[0\].request: request 4 does not exist "
                                            r"\(4 request\(s\) in the workload\)"):
        load_scenarios(path)


def test_round_trip_keeps_the_trace_and_its_rules(tmp_path: Path) -> None:
    _small_trace(tmp_path)
    (s,) = load_scenarios(_scenario_file(tmp_path, extra="requests = 3"))
    data = json.loads(json.dumps(s.to_dict()))
    assert "prompt_tokens" not in data["workload"] and "arrival" not in data["workload"]
    again = Scenario.model_validate(data)
    assert again == s and again.workload.num_requests == 3


# --- runs driven by a trace -------------------------------------------------------------------


@pytest.mark.parametrize(("model", "logical_block"), [("tiny-deepseek", 64),
                                                    ("tiny-kimi-linear", 640)])
def test_mooncake_trace_drives_a_byte_exact_run_with_hits_from_hash_ids(
        tmp_path: Path, model: str, logical_block: int) -> None:
    """The acceptance: prefix hits come from the trace's hash_ids and every byte verifies."""
    trace = TRACES / "synthetic-mooncake.jsonl"
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(model=model, caching="true", trace=str(trace), extra=""))
    (s,) = load_scenarios(path)
    result = result_json(run_scenario(s), requests=True)
    assert result["outcome"] == "ok" and result["expectation_met"]
    assert result["requests"]["byte_exact"] == result["requests"]["total"] == 24
    assert result["requests"]["mismatched_bytes"] == 0
    details = result["request_details"]
    hits = _reference_hits(rows)
    assert [r["prefix_hit_tokens"] for r in details] == hits
    assert [r["prompt_tokens"] for r in details] == [r["input_length"] for r in rows]
    assert [r["arrival"] for r in details] == [r["timestamp"] / 1e3 for r in rows]
    # reused in whole logical blocks of decode (tiny-deepseek: 64 tokens, so all of it)
    reused = [h // logical_block * logical_block for h in hits]
    assert [r["effective_prefix_hit_tokens"] for r in details] == reused
    assert sum(reused) > 0
    assert len(result["warnings"]) == (0 if reused == hits else 1)


def test_trace_arrivals_pace_the_simulated_run(tmp_path: Path) -> None:
    _small_trace(tmp_path)
    (s,) = load_scenarios(_scenario_file(tmp_path))
    result = SimDriver(s).run()
    assert [r.arrival for r in result.records] == [0.0, 0.02, 0.03, 0.05]
    assert all(r.times["done"] >= r.arrival for r in result.records)
    assert result.outcome == "ok" and result.completed == 4


def test_poisson_arrivals_unchanged_by_the_move() -> None:
    """Arrivals moved from the drivers into Workload.arrival_times: same draws, same order."""
    (s,) = load_scenarios(ROOT / "scenarios" / "soak" / "mixed-faults.toml")
    assert s.workload.arrival == "poisson"
    rng = np.random.default_rng(s.scenario.seed)
    prompts, _ = s.request_lengths(rng)
    gaps = rng.exponential(1.0 / float(s.workload.rate), size=len(prompts))  # the old formula
    driver = SimDriver(s, timing_only=True)
    expected = np.cumsum(gaps) - gaps[0]
    driver.run()
    assert [r.arrival for r in driver.coord.records] == expected.tolist()


def test_generator_reproduces_the_shipped_traces(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "make-synthetic-trace"
    for fmt, name in (("mooncake", "synthetic-mooncake.jsonl"), ("csv", "synthetic.csv")):
        out = tmp_path / name
        subprocess.run([sys.executable, str(script), "--format", fmt, str(out)], check=True,
                       timeout=60)
        assert out.read_bytes() == (TRACES / name).read_bytes(), name
