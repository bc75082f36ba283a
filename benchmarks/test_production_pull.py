"""Production-geometry benchmarks (pytest-benchmark). Not part of the unit suite: run them with

    .venv/bin/python -m pytest benchmarks -q --benchmark-enable

The 64k-token Kimi-Linear request moves ~4.3 GB (eight decode ranks each receive every MLA
block) through lazily committed memory: the pools are sized for the request but only touched
pages cost memory.
"""

from __future__ import annotations

import resource

import pytest

from hkvsim.cluster import run_scenario
from hkvsim.scenario import parse_scenarios

KIMI_64K = """
[scenario]
name = "kimi-linear-48b 64k tokens, P TP2 -> D TP8"
[model]
preset = "kimi-linear-48b"
[prefill]
tp = 2
[decode]
tp = 8
[connector]
registration_order = "state-first"
[workload]
requests = 1
prompt_tokens = 65536
"""


@pytest.mark.timeout(900)
def test_kimi_64k_tp2_to_tp8_byte_exact(benchmark) -> None:
    (scenario,) = parse_scenarios(KIMI_64K)
    result = benchmark.pedantic(run_scenario, args=(scenario,), rounds=1, iterations=1)
    (record,) = result.records
    assert result.outcome == "ok"
    assert record.status == "ok" and record.mismatched_words == 0
    # Decode TP8 has 256-token logical blocks (ppl 4): the 65,535 loaded tokens (N-1) fill 256
    # logical = 1,024 kernel blocks, paired front-first with prefill's 69 x 15 = 1,035. Per
    # decode rank: 7 MLA regions x 1,024 + 3 KDA groups x 7 regions x 4 sub-regions = 7,252.
    assert record.descriptors == 8 * (7 * 1024 + 84)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    benchmark.extra_info["peak_rss_mib"] = round(peak_mib)
    benchmark.extra_info["bytes_moved"] = record.nbytes
