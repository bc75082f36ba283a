"""Scenarios through the real NIXL backend (one OS process per rank, DRAM over UCX), each
compared with the simulator: same outcome, same bytes verified, zero mismatches."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hkvsim.drivers.nixl import NixlRunError, NixlRunOptions, run_scenario_nixl
from hkvsim.cluster import run_scenario
from hkvsim.results import result_json
from hkvsim.scenario import parse_scenarios

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.usefixtures("nixl_required")]

KIMI = """
[scenario]
name = "tiny-kimi-linear {mode} P TP{p} -> D TP{d}"
seed = 11
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = {p}
[decode]
tp = {d}
[connector]
mode = "{mode}"
registration_order = "state-first"
lease_seconds = 10.0
transfer_timeout_seconds = 20.0
[fabric]
profile = "cpu-ucx-loopback"
[workload]
requests = 3
# an odd length, N-1 an exact multiple of the TP1 logical block, a short one
prompt_tokens = [1501, 641, 37]
"""


def _one(text: str):
    (scenario,) = parse_scenarios(text)
    return scenario


def _both(scenario, tmp_path):
    nixl = run_scenario_nixl(scenario, options=NixlRunOptions(log_dir=str(tmp_path / "logs")))
    sim = run_scenario(scenario)
    return result_json(nixl, requests=True), result_json(sim, requests=True)


def _agree(nixl: dict, sim: dict) -> None:
    """The acceptance for sim-vs-nixl agreement."""
    assert nixl["outcome"] == sim["outcome"], (nixl["failures"], nixl["expectation_problems"])
    assert nixl["expectation_met"] == sim["expectation_met"]
    for key in ("total", "completed", "failed", "byte_exact", "mismatched_bytes", "bytes",
                "descriptors", "transfers"):
        assert nixl["requests"][key] == sim["requests"][key], key
    assert nixl["requests"]["mismatched_bytes"] == 0 and nixl["mismatches"] == []
    assert [f["class"] for f in nixl["failures"]] == [f["class"] for f in sim["failures"]]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode,p,d", [("pull", 1, 2), ("pull", 2, 1), ("push", 1, 2),
                                      ("push", 2, 1)])
def test_tiny_kimi_matches_the_simulator(tmp_path, mode: str, p: int, d: int) -> None:
    nixl, sim = _both(_one(KIMI.format(mode=mode, p=p, d=d)), tmp_path)
    _agree(nixl, sim)
    assert nixl["outcome"] == "ok" and nixl["expectation_met"]
    assert nixl["requests"]["byte_exact"] == 3
    assert {"prefill_blocks", "decode_blocks", "open_handles", "after_shutdown"} <= set(nixl["leaks"])
    assert not any(nixl["leaks"].values()), nixl["leaks"]
    assert nixl["counters"]["notifications"] == sim["counters"]["notifications"]
    paths = [t["path"] for r in nixl["request_details"] for t in r["telemetry"]]
    assert paths and all(path[0] == "UCX" for path in paths)
    # the JSON has the simulator's shape, plus the CPU the real processes spent
    assert set(nixl) == set(sim) | {"rank_cpu"} and set(nixl["requests"]) == set(sim["requests"])
    assert nixl["rank_cpu"]["by_op"]["StartRead" if mode == "pull" else "StartWrite"][0] > 0


@pytest.mark.timeout(90)
def test_prefix_hits(tmp_path) -> None:
    """No hit, a partial hit of one logical block, a full hit (notification only)."""
    text = KIMI.format(mode="pull", p=1, d=1).replace(
        "prompt_tokens = [1501, 641, 37]",
        "prompt_tokens = [1317, 1317, 1281]\nprefix_hit_tokens = [0, 640, 1280]").replace(
        "[decode]", "[decode]\nprefix_caching = true").replace(
        "[prefill]", "[prefill]\nprefix_caching = true")
    nixl, sim = _both(_one(text), tmp_path)
    _agree(nixl, sim)
    assert nixl["outcome"] == "ok" and nixl["requests"]["byte_exact"] == 3
    details = {r["index"]: r for r in nixl["request_details"]}
    assert details[0]["nbytes"] > details[1]["nbytes"] > 0
    assert details[2]["transfers"] == 0  # full hit: a notification, no bytes


@pytest.mark.timeout(90)
def test_handshake_refusal(tmp_path) -> None:
    text = """
[scenario]
name = "KV cache layout NHD vs HND"
[model]
preset = "tiny-llama"
[prefill]
kv_cache_layout = "NHD"
[decode]
kv_cache_layout = "HND"
[connector]
lease_seconds = 5.0
[workload]
requests = 2
prompt_tokens = 300
[expect]
outcome = "handshake-error"
error_match = "V5: KV cache layout mismatch: local HND, remote NHD"
"""
    start = time.monotonic()
    nixl, sim = _both(_one(text), tmp_path)
    _agree(nixl, sim)
    assert nixl["expectation_met"], nixl["expectation_problems"]
    assert nixl["handshake_errors"] == sim["handshake_errors"]
    assert {f["class"] for f in nixl["failures"]} == {"handshake_failed"}
    assert time.monotonic() - start < 60


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,engine,rank", [("pull", "prefill0", 0), ("push", "decode0", 1)])
def test_killed_rank_fails_the_run_quickly(tmp_path, mode: str, engine: str, rank: int) -> None:
    """SIGKILL one rank's process right after request 1 starts moving: requests 1 and 2 fail
    with the reason, nothing hangs, everything else is shut down."""
    text = KIMI.format(mode=mode, p=1, d=2).replace(
        "requests = 3", "requests = 3\nmax_inflight = 1") + f"""
[[faults]]
kind = "kill-rank"
engine = "{engine}"
rank = {rank}
request = 1
[expect]
outcome = "request-failure"
failed_requests = 2
reason = "remote_disconnect"
"""
    start = time.monotonic()
    result = run_scenario_nixl(_one(text), options=NixlRunOptions(log_dir=str(tmp_path)))
    elapsed = time.monotonic() - start
    data = result_json(result)
    assert data["outcome"] == "request-failure" and data["expectation_met"], data
    assert data["requests"]["completed"] == 1
    reasons = [f["reason"] for f in data["failures"]]
    assert all(f"{engine} rank {rank}" in r and "killed by signal 9 (SIGKILL)" in r
               for r in reasons), reasons
    assert data["counters"]["rank_deaths"] == 1
    assert elapsed < 40, elapsed


@pytest.mark.timeout(30)
def test_unsupported_fault_is_refused_before_starting() -> None:
    text = KIMI.format(mode="pull", p=1, d=1) + """
[[faults]]
kind = "slow-link"
engine = "decode0"
factor = 4.0
"""
    with pytest.raises(NixlRunError, match="not supported by the nixl backend"):
        run_scenario_nixl(_one(text))


@pytest.mark.timeout(150)
def test_cli_run_json(tmp_path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(KIMI.format(mode="pull", p=2, d=1))
    out = subprocess.run([sys.executable, "-m", "hkvsim.cli", "run", str(path), "--backend",
                          "nixl", "--json"], capture_output=True, text=True, cwd=ROOT,
                         timeout=80)
    assert out.returncode == 0, out.stderr[-2000:]
    nixl = json.loads(out.stdout)  # nothing but JSON on stdout (NIXL logs go to rank logs)
    sim = json.loads(subprocess.run(
        [sys.executable, "-m", "hkvsim.cli", "run", str(path), "--json"], capture_output=True,
        text=True, cwd=ROOT, timeout=60).stdout)
    assert set(nixl) == set(sim) | {"rank_cpu"} and "rank_cpu" not in sim
    assert nixl["outcome"] == "ok" and nixl["requests"]["bytes"] == sim["requests"]["bytes"]
    # the times say which clock they are on
    assert (nixl["backend"], nixl["time"]["clock"]) == ("nixl", "wall")
    assert (sim["backend"], sim["time"]["clock"]) == ("sim", "simulated")
    assert nixl["verified"] is True and nixl["requests"]["byte_exact"] == 3
    text = subprocess.run([sys.executable, "-m", "hkvsim.cli", "run", str(path), "--backend",
                           "nixl"], capture_output=True, text=True, cwd=ROOT, timeout=80).stdout
    assert "s (wall clock)" in text and "simulated" not in text
