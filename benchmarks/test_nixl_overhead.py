"""Connector overhead over real NIXL (pytest-benchmark). Not part of the unit suite: run with

    .venv/bin/python -m pytest benchmarks/test_nixl_overhead.py -q --benchmark-enable

The same READ (Kimi-Linear-48B, one 8,192-token request, decode TP1 <- prefill TP1: 1,134
descriptors, 123 MB, docs/semantics.md §10) is posted side by side, in alternating rounds, by the
connector (ConnectorWorker.start_read + poll over NixlTransport) and by a bare loop of
nixl_agent calls on the same prepared lists, ids and notification. Acceptance: the connector
reaches >= 90 % of the bare loop's throughput. The measured ratio lands in extra_info (and in
--benchmark-json output). See hkvsim/backends/overhead.py.
"""

from __future__ import annotations

import pytest

from hkvsim.transport.nixl import nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL not installed "
                                "(pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1)")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("preset,tokens", [("kimi-linear-48b", 8192), ("tiny-kimi-linear", 1501)])
def test_connector_reaches_90_percent_of_bare_nixl(benchmark, request, preset: str,
                                                   tokens: int) -> None:
    from hkvsim.backends.overhead import measure_overhead

    result = benchmark.pedantic(measure_overhead, kwargs={"preset": preset, "tokens": tokens},
                                rounds=1, iterations=1)
    benchmark.extra_info.update({k: v for k, v in result.items() if v is not None})
    note = (f"{result['descriptors']} descriptors, {result['nbytes']:,} B; bare "
            f"{result['bare_gbps']:.2f} GB/s, connector {result['connector_gbps']:.2f} GB/s, "
            f"+{result['connector_overhead_us']:.0f} us per request")
    print(f"\n{preset} {tokens} tokens: {note}; ratio {result['ratio']:.3f}")
    figures = request.getfixturevalue("figures") if _has_figures(request) else None
    if figures is not None:  # benchmarks/conftest.py collects the headline figures
        figures.add(
            f"connector / bare NIXL throughput ({preset}, {tokens} tokens)", result["ratio"],
            "x", target=">= 0.9", met=result["ratio"] >= 0.9, note=note)
    assert result["descriptors"] > 0 and result["nbytes"] > 0 and result["ratio"] > 0, result
    # the target needs a quiet machine: asserted when benchmarking, not in CI's smoke run
    # (--benchmark-disable), where a busy machine measured 0.87 once; the figure row says it
    if figures is None or figures.enabled:
        assert result["ratio"] >= 0.9, result


def _has_figures(request) -> bool:
    try:
        request.getfixturevalue("figures")
    except pytest.FixtureLookupError:
        return False
    return True
