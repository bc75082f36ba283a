"""Block ids as a warmed-up vLLM engine hands them out (``[prefill]``/``[decode]`` block_ids),
and what that does to the descriptors NIXL can coalesce (docs/semantics.md §10)."""

from __future__ import annotations

import numpy as np
import pytest

from hkvsim.cluster import run_scenario
from hkvsim.geometry import build_layout, preset
from hkvsim.pd.pool import BlockAllocator, EnginePool
from hkvsim.results import result_json
from hkvsim.scenario import ScenarioError, parse_scenarios

pytestmark = pytest.mark.timeout(120)

TEXT = """
[scenario]
name = "block ids"
seed = 11
[model]
preset = "tiny-llama"
[prefill]
tp = 1
num_blocks = 600
{prefill}
[decode]
tp = 1
num_blocks = 600
{decode}
[workload]
requests = 8
prompt_tokens = [900, 2000, 300, 1500, 700, 1200, 2500, 100]
"""


def _layout(num_blocks: int = 200):
    model = preset("tiny-kimi-linear")
    return build_layout(model, tp=1, block_size=model.attention.attention_backend.min_kernel_block,
                        num_blocks=num_blocks)


def test_fresh_allocator_frees_in_order_warmed_frees_tail_first() -> None:
    fresh, warmed = BlockAllocator(8), BlockAllocator(8, tail_first=True)
    for alloc in (fresh, warmed):
        ids = alloc.allocate(3)
        assert ids.tolist() == [0, 1, 2]
        alloc.free(ids)
    assert fresh.free_order().tolist() == [3, 4, 5, 6, 7, 0, 1, 2]
    assert warmed.free_order().tolist() == [3, 4, 5, 6, 7, 2, 1, 0]


def test_warm_up_is_seeded_leaves_an_empty_shuffled_pool() -> None:
    layout = _layout()
    a = EnginePool(layout, block_ids="warmed", warmup=50, seed=1)
    b = EnginePool(layout, block_ids="warmed", warmup=50, seed=1)
    c = EnginePool(layout, block_ids="warmed", warmup=50, seed=2)
    order = a.allocator.free_order()
    assert a.used == 0 and (a.owner == -1).all() and (a.version == 0).all()
    assert sorted(order.tolist()) == list(range(layout.num_logical_blocks))
    assert np.array_equal(order, b.allocator.free_order())  # same seed, same queue
    assert not np.array_equal(order, c.allocator.free_order())
    assert not np.array_equal(order, np.arange(order.size))  # churned
    fresh = EnginePool(layout)
    assert np.array_equal(fresh.allocator.free_order(), np.arange(layout.num_logical_blocks))


def test_pool_refuses_unknown_block_ids_and_warm_up_of_a_fresh_pool() -> None:
    with pytest.raises(ValueError, match="block_ids 'used'; allowed: fresh, warmed"):
        EnginePool(_layout(), block_ids="used")
    with pytest.raises(ValueError, match="only >= 1 with block_ids 'warmed'"):
        EnginePool(_layout(), warmup=3)


@pytest.mark.parametrize(("extra", "needle"), [
    ('block_ids = "hot"', "block_ids"),
    ("warmup_requests = 5", "warmup_requests applies only to block_ids = \"warmed\""),
    ('block_ids = "warmed"\nwarmup_requests = 0', "warmup_requests"),
])
def test_scenario_knob_errors_name_the_key(extra: str, needle: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenarios(TEXT.format(prefill="", decode=extra))
    message = str(info.value)
    assert needle in message and "decode" in message
    assert "\n" not in message.strip()


def _run(prefill: str, decode: str) -> dict:
    (scenario,) = parse_scenarios(TEXT.format(prefill=prefill, decode=decode))
    result = run_scenario(scenario)
    assert result.outcome == "ok" and result.verified and result.mismatched_bytes == 0
    return result_json(result, requests=True)


def test_warmed_engines_fragment_block_ids_and_nixl_coalesces_less() -> None:
    fresh = _run("", "")
    warm = 'block_ids = "warmed"'
    warmed = _run(warm, warm)
    again = _run(warm, warm)
    f, w = fresh["requests"], warmed["requests"]
    assert f["descriptors_posted"] == w["descriptors_posted"]  # the plan is the same size
    assert f["bytes"] == w["bytes"]
    # fresh ids coalesce to a handful per request; warmed ids are fragmented
    assert w["descriptors_coalesced"] > 2 * f["descriptors_coalesced"]
    assert w["coalesced_per_request"]["max"] > f["coalesced_per_request"]["max"]
    # deterministic: the same seed gives the same counts and the same simulated times
    assert again["requests"] == w and again["time"] == warmed["time"]
    # and the simulated post is charged for the coalesced count: warmed posts take longer
    assert warmed["time"]["post_seconds"]["p50"] > fresh["time"]["post_seconds"]["p50"]
