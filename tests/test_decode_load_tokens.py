"""How many prompt tokens decode loads (docs/semantics.md §6, §7): a model with state loads N-1
and computes token N; a model without state loads all N (vLLM's scheduler matches every prompt
token it has not cached and recomputes token N over the received KV). Loading N-1 for a model
without state leaves decode one block short of prefill whenever N-1 fills whole blocks, and
vLLM's connector then end-trims prefill's list by a block: every token lands a block early."""

from __future__ import annotations

import pytest

from hkvsim.cluster import run_scenario
from hkvsim.pd.coordinator import Coordinator
from hkvsim.scenario import parse_scenarios

TEXT = """
[scenario]
name = "load tokens"
[model]
preset = "{preset}"
[prefill]
block_size = 16
[decode]
block_size = {d_block}
prefix_caching = {caching}
[connector]
mode = "{mode}"
[workload]
requests = {requests}
prompt_tokens = {prompts}
prefix_hit_tokens = {hits}
"""


def _run(preset: str, prompts: list[int], *, hits: list[int] | None = None,
         mode: str = "pull", d_block: int = 16):
    text = TEXT.format(preset=preset, prompts=prompts, hits=hits or [0] * len(prompts),
                       requests=len(prompts), caching=str(bool(hits)).lower(), mode=mode,
                       d_block=d_block)
    (scenario,) = parse_scenarios(text, source="load-tokens.toml")
    result = run_scenario(scenario)
    assert result.verified and result.failed == 0 and result.hung == 0
    assert [r.status for r in result.records] == ["ok"] * len(prompts)
    assert result.mismatched_bytes == 0
    return result


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_model_without_state_loads_every_prompt_block(mode: str) -> None:
    # 16-token blocks: 1,025 and 1,041 tokens have N-1 on a block boundary (64 and 65 blocks
    # hold N-1, 65 and 66 hold N); 1,040 has N on one (65 blocks hold both)
    result = _run("tiny-llama", [1025, 1040, 1041], mode=mode)
    per_block = result.records[1].nbytes // 65
    assert per_block > 0
    assert [r.nbytes for r in result.records] == [65 * per_block, 65 * per_block,
                                                  66 * per_block]


def test_a_model_with_state_still_loads_n_minus_1() -> None:
    # tiny-qwen3-next at TP1: 80-token logical blocks; prefill computes N-1 tokens, and decode
    # loads exactly those: 81 tokens need 1 attention block from prefill, 82 need 2
    result = _run("tiny-qwen3-next", [81, 82])
    one, two = (r.nbytes for r in result.records)
    assert 0 < one < two


def test_a_hit_on_every_block_but_the_last_still_loads_token_n() -> None:
    # 1,025 tokens with a 1,024-token hit (64 whole blocks), 1,041 with 1,040 (65): the hit
    # covers all N-1 tokens, and without state the block holding token N still comes from
    # prefill -- not a full hit that moves nothing
    result = _run("tiny-llama", [1025, 1041, 1041], hits=[1024, 1040, 0])
    one_block = result.records[2].nbytes // 66
    assert [r.effective_prefix_hit_tokens for r in result.records] == [1024, 1040, 0]
    assert [r.nbytes for r in result.records] == [one_block, one_block, 66 * one_block]


def test_with_state_a_hit_on_every_loaded_token_is_a_full_hit() -> None:
    # tiny-qwen3-next: 161 tokens, an 160-token hit covers all N-1 loaded tokens: only the
    # notification moves (the cached prefix holds the state at its end)
    result = _run("tiny-qwen3-next", [161, 161], hits=[160, 0])
    assert result.records[0].effective_prefix_hit_tokens == 160
    assert result.records[0].nbytes == 0 < result.records[1].nbytes


def test_block_size_ratio_zeroes_the_tail_past_token_n(monkeypatch) -> None:
    # decode kernel 64 = 4 prefill blocks: 1,025 and 1,040 tokens are 65 prefill blocks (1,040
    # token slots); decode loads 17 blocks (1,088 slots), so slots 1,040-1,088 hold an earlier
    # tenant's bytes that the connector must zero, and the oracle checks exactly that range
    tails = []
    original = Coordinator._zeroed_tail

    def spy(self, prefill, decode, job):
        tails.append(original(self, prefill, decode, job))
        return tails[-1]

    monkeypatch.setattr(Coordinator, "_zeroed_tail", spy)
    result = _run("tiny-llama", [1025, 1040], d_block=64)
    assert result.records[0].nbytes == result.records[1].nbytes > 0
    # once before the transfer (stale bytes written), once at verification, per request
    assert tails == [(1040, 1088)] * 4
