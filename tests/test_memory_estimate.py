"""The memory estimate `plan` prints and the guard `run` applies (issue #14)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hkvsim import memory_estimate
from hkvsim.cli import EXIT_INPUT, main
from hkvsim.memory_estimate import MemoryGuardError, check_fits, estimate_memory
from hkvsim.pd.deployment import build_deployment
from hkvsim.scenario import load_scenarios, parse_scenarios

ROOT = Path(__file__).resolve().parents[1]
KIMI = ROOT / "scenarios" / "kimi-linear" / "pull-2p-tp2-to-d-tp4.toml"


def test_cache_pages_are_the_blocks_the_requests_touch() -> None:
    """Derived independently here: a FIFO pool touches min(blocks, blocks requested) blocks per
    engine, each num_tensors unified pages on every rank."""
    (s,) = load_scenarios(KIMI)
    dep = build_deployment(s)
    est = estimate_memory(dep)
    want = 0
    for role, engines in dep.engines.items():
        lay = engines[0].layout
        per_request = [
            -(-(int(p) - (1 if role == "prefill" and dep.hybrid else 0)) // lay.logical_block_size)
            * len(lay.attention_groups) + len(lay.state_groups) for p in dep.prompts]
        blocks = min(sum(per_request), len(engines) * lay.num_logical_blocks)
        want += blocks * lay.num_tensors * lay.unified_page_bytes * lay.tp
    assert est.cache_pages == want > 0
    assert est.verified > est.timing_only > est.descriptor_lists > 0


def test_more_requests_touch_more_pages_until_the_pool_is_full() -> None:
    (s,) = load_scenarios(KIMI)
    dep = build_deployment(s)
    one = estimate_memory(dep).cache_pages
    dep.prompts = dep.prompts.repeat(1000)  # far more blocks than the pools hold
    full = estimate_memory(dep).cache_pages
    cap = sum(len(es) * es[0].layout.num_logical_blocks * es[0].layout.num_tensors
              * es[0].layout.unified_page_bytes * es[0].layout.tp for es in dep.engines.values())
    assert one < full == cap


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 4), (4, 1), (2, 2)])
def test_bookkeeping_parts_do_not_depend_on_num_blocks_and_records_follow_requests(
        mode: str, p_tp: int, d_tp: int) -> None:
    # prepared descriptor lists are affine descriptions (independent of num_blocks), one
    # record per request; every part is positive whichever side initiates and has more ranks
    def estimate(num_blocks: int, requests: int):
        (s,) = parse_scenarios(f"""
[scenario]
name = "estimate"
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = {p_tp}
num_blocks = {num_blocks}
[decode]
tp = {d_tp}
num_blocks = {num_blocks}
[connector]
mode = "{mode}"
[workload]
requests = {requests}
prompt_tokens = 300
""")
        return estimate_memory(build_deployment(s))

    small, large, twice = estimate(64, 10), estimate(4096, 10), estimate(64, 20)
    assert small.descriptor_lists == large.descriptor_lists > 0
    # the pools' bookkeeping is per logical block per engine (a free-queue slot, an owner and a
    # version): it grows with num_blocks, 20 bytes each
    assert (small.pools, large.pools) == (20 * 64 * 2, 20 * 4096 * 2)
    assert twice.records == 2 * small.records > 0
    assert all(v > 0 for v in small.as_dict().values()), small.as_dict()


def test_a_hybrid_list_counts_its_state_sub_regions() -> None:
    # a rank's state comes in sub-regions: a hybrid's lists are larger than the same engines'
    # lists would be without its state regions
    layout = build_deployment(load_scenarios(KIMI)[0]).engines["decode"][0].layout
    assert memory_estimate._list_bytes(layout) > (
        memory_estimate.LIST_BYTES + len(layout.regions) * memory_estimate.SEGMENT_BYTES)


def test_guard_refuses_a_verified_run_that_does_not_fit() -> None:
    (s,) = load_scenarios(KIMI)
    need = estimate_memory(build_deployment(s)).verified
    with pytest.raises(MemoryGuardError, match=r"needs about .* but .* is available; run it "
                                               r"with --timing-only"):
        check_fits(s, timing_only=False, available=need - 1)
    check_fits(s, timing_only=False, available=need)  # fits
    check_fits(s, timing_only=True, available=1)  # timing-only commits no cache page


def test_run_refuses_unless_forced(monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(memory_estimate, "available_memory", lambda: 64 * 2**20)
    assert main(["run", str(KIMI)]) == EXIT_INPUT
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--force" in err and "verified run needs about" in err
    assert main(["run", str(KIMI), "--timing-only", "--json"]) != EXIT_INPUT
    capsys.readouterr()
    assert main(["run", str(KIMI), "--force", "--json"]) == 0
    assert '"verified": true' in capsys.readouterr().out


def test_plan_prints_the_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(KIMI)]) == 0
    out = capsys.readouterr().out
    assert "peak memory (estimate): verified run 2." in out and "timing-only" in out


_PEAK = """
import sys
from hkvsim.cluster import run_scenario
from hkvsim.memory_estimate import estimate_memory
from hkvsim.pd.deployment import build_deployment
from hkvsim.scenario import parse_scenarios
(s,) = parse_scenarios(sys.stdin.read())
estimate = estimate_memory(build_deployment(s)).timing_only
run_scenario(s)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(int(hwm) * 1024, estimate)
"""


@pytest.mark.timeout(120)
def test_the_timing_only_estimate_is_near_the_peak_a_run_measures() -> None:
    """The estimate against what a fresh process really peaks at (its own VmHWM: ru_maxrss
    would carry the parent's peak across fork and exec): a
    timing-only run of 3,000 requests, where the interpreter, the per-request records and the
    rest each count. Measured: 115 MB peak, 111 MB estimated."""
    import subprocess
    import sys

    text = """
[scenario]
name = "peak"
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 1
[decode]
tp = 2
[workload]
requests = 3000
prompt_tokens = 300
verify = false
"""
    out = subprocess.run([sys.executable, "-c", _PEAK], input=text, capture_output=True,
                         text=True, timeout=100, check=True)
    peak, estimate = (int(v) for v in out.stdout.split())
    assert 0.7 * peak <= estimate <= 1.3 * peak, (peak, estimate)



def test_descriptor_lists_count_each_rank_and_each_pairing() -> None:
    """Pull, P TP2 -> D TP1: each prefill rank prepares its local list; the decode rank its
    local list, one split list per prefill rank it pairs with (2) and that rank's list (2).
    Push turns the roles around: P TP2's ranks each pair with the one decode rank."""
    def lists(mode: str) -> tuple[int, int, int]:
        (s,) = parse_scenarios(f"""
[scenario]
name = "lists"
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 2
[decode]
tp = 1
[connector]
mode = "{mode}"
[workload]
requests = 1
prompt_tokens = 300
""")
        dep = build_deployment(s)
        one = memory_estimate._list_bytes
        return (estimate_memory(dep).descriptor_lists, one(dep.engines["prefill"][0].layout),
                one(dep.engines["decode"][0].layout))

    pulled, p, d = lists("pull")
    assert pulled == 2 * p + (d * (1 + 2) + 2 * p)
    pushed, p, d = lists("push")
    assert pushed == d + 2 * (p * (1 + 1) + d)
