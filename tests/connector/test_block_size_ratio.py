"""Block-size ratio end to end (issue acceptance: "byte-exact with block_size_ratio 1, 2 and 4
where the rules allow it"), docs/semantics.md §4.4 V2/V6/V10 and §6 (sub-block lists, clipping, tail
zeroing, head regrouping).

Prefill runs block_size 16; decode 16, 32 or 64, so bsr = 1, 2 or 4.
"""

from __future__ import annotations

import pytest

from ._helpers import run, scenario_text

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2)]
MODELS = {
    "tiny-llama": "",
    "tiny-qwen3-next": "",
    "tiny-deepseek": 'attention_backend = "triton-mla"',
    "tiny-kimi-linear": 'attention_backend = "triton-mla"',
}
PROMPTS = "[100, 333, 17, 1000]"

# The pairs the rules reject (P block 16), written out:
# * V10: bsr > 1 with P_TP > D_TP needs a single attention split or all regions REPLICATE.
#   tiny-llama (K = 8): P2->D1 and P4->D2 read 2 head splits. tiny-qwen3-next (K = 2): P2->D1
#   reads 2 head splits.
# * V6: SPLIT with r < 0 needs bsr == 1. tiny-qwen3-next P4->D2: P0/P1 both hold head 0, so
#   a single split passes V10, but the SPLIT rule for r < 0 still rejects bsr > 1.
# * tiny-deepseek is all REPLICATE (MLA): every pair is allowed.
# * tiny-kimi-linear: MLA attention (one source) and KDA state read from every prefill rank
#   it is split over: every pair is allowed, and P2->D1 / P4->D2 read through split handles
#   in decode sub-blocks (the Kimi-Linear path no other model here takes).
REJECTED = {
    ("tiny-llama", 2, 1, 32): "V10", ("tiny-llama", 2, 1, 64): "V10",
    ("tiny-llama", 4, 2, 32): "V10", ("tiny-llama", 4, 2, 64): "V10",
    ("tiny-qwen3-next", 2, 1, 32): "V10", ("tiny-qwen3-next", 2, 1, 64): "V10",
    ("tiny-qwen3-next", 4, 2, 32): "V6", ("tiny-qwen3-next", 4, 2, 64): "V6",
}

CASES = [(m, p, d, b) for m in MODELS for p, d in TP_PAIRS for b in (16, 32, 64)]


def _text(model, p_tp, d_tp, d_block, **kw):
    extra = MODELS[model]
    return scenario_text(model=model, p_tp=p_tp, d_tp=d_tp, p_block=16, d_block=d_block,
                         requests=4, prompt_tokens=PROMPTS, p_extra=extra,
                         d_extra=extra + kw.pop("d_extra", ""), **kw)


def _assert_clean_ok(result):
    assert result.outcome == "ok", (result.handshake_errors,
                                    [r.reason for r in result.records if r.reason])
    assert result.handshake_errors == []
    assert [r.status for r in result.records] == ["ok"] * len(result.records)
    assert sum(r.mismatched_words for r in result.records) == 0, [
        m for r in result.records for m in r.mismatches]
    assert {"prefill_blocks", "decode_blocks", "open_handles", "after_shutdown"} <= set(result.leaks)
    assert not any(result.leaks.values()), result.leaks
    assert all(r.descriptors > 0 and r.transfers > 0 for r in result.records)


@pytest.mark.parametrize("model,p_tp,d_tp,d_block", CASES)
def test_block_size_ratio_matrix(model, p_tp, d_tp, d_block):
    result = run(_text(model, p_tp, d_tp, d_block))
    rule = REJECTED.get((model, p_tp, d_tp, d_block))
    if rule is None:
        _assert_clean_ok(result)
        # kernel blocks as configured: bsr = decode / prefill kernel tokens
        assert result.layouts["prefill"].kernel_block_size == 16
        assert result.layouts["decode"].kernel_block_size == d_block
    else:
        assert result.outcome == "handshake-error"
        assert len(result.handshake_errors) == 1
        assert f"{rule}:" in result.handshake_errors[0]
        bsr = d_block // 16
        assert str(bsr) in result.handshake_errors[0]
        # every request takes the failure path (no hang, nothing leaked)
        assert all(r.status == "failed" and r.failure_class == "handshake_failed"
                   for r in result.records)
        assert {"prefill_blocks", "decode_blocks", "open_handles", "after_shutdown"} <= set(result.leaks)
        assert not any(result.leaks.values()), result.leaks


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-deepseek"])
@pytest.mark.parametrize("p_tp,d_tp", [(1, 1), (1, 2), (2, 4)])
@pytest.mark.parametrize("d_block", [32, 64])
def test_block_size_ratio_with_prefix_hits_non_hybrid(model, p_tp, d_tp, d_block):
    # §7 "Non-hybrid: end-trim": D holds a cached prefix (whole D logical blocks) and pulls
    # only its uncached suffix, in sub-block units when bsr > 1. Nothing here is heterogeneous
    # ppl (a non-hybrid has ppl 1 on both sides), so V4 / the hit refusal must not trigger.
    result = run(_text(model, p_tp, d_tp, d_block, prefix_hit_tokens="[0, 150, 5, 700]",
                       d_extra="\nprefix_caching = true"))
    _assert_clean_ok(result)
    hits = [r.prefix_hit_tokens for r in result.records]
    assert hits == [0, 150, 5, 700]


def test_prefix_hit_shrinks_the_transfer():
    # 1,000 tokens, D block 64 (bsr 4): a 700-token hit is 10 whole D blocks = 640 tokens = 40
    # P blocks, so D pulls ceil(1000/16) - 40 = 23 P blocks per region (4 regions) = 92
    # descriptors instead of 63 x 4 = 252.
    base = run(_text("tiny-llama", 1, 1, 64).replace(PROMPTS, "1000").replace(
        "requests = 4", "requests = 1"))
    hit = run(_text("tiny-llama", 1, 1, 64, prefix_hit_tokens="700",
                    d_extra="\nprefix_caching = true").replace(PROMPTS, "1000").replace(
        "requests = 4", "requests = 1"))
    _assert_clean_ok(base)
    _assert_clean_ok(hit)
    assert base.records[0].descriptors == 63 * 4
    assert hit.records[0].descriptors == 23 * 4


def test_hybrid_equal_ppl_with_bsr_and_prefix_hits():
    # tiny-qwen3-next at TP8: P block 32 and D block 64 both give ppl 1 (logical 32 / 64
    # tokens), so V4 accepts prefix caching, and §7 says "If the ppl are equal, end-trim":
    # requests with a prefix hit must pair (token-aligned) and arrive byte-exact, not fail.
    result = run(scenario_text(model="tiny-qwen3-next", p_tp=8, d_tp=8, p_block=32, d_block=64,
                               requests=4, prompt_tokens="[100, 333, 70, 1000]",
                               prefix_hit_tokens="[0, 150, 65, 700]",
                               d_extra="prefix_caching = true"))
    assert result.layouts["prefill"].physical_blocks_per_logical == 1
    assert result.layouts["decode"].physical_blocks_per_logical == 1
    _assert_clean_ok(result)


def test_hybrid_different_ppl_with_prefix_caching_is_refused_even_if_tokens_match():
    # tiny-qwen3-next TP8: P block 16 -> ppl 2 (logical 32), D block 32 -> ppl 1 (logical 32).
    # V4 compares ppl (§4.4), so the pair is refused at handshake with prefix caching on ...
    text = scenario_text(model="tiny-qwen3-next", p_tp=8, d_tp=8, p_block=16, d_block=32,
                         requests=2, prompt_tokens="[100, 333]", prefix_hit_tokens="[0, 40]",
                         d_extra="prefix_caching = true")
    result = run(text)
    assert result.outcome == "handshake-error"
    assert "V4:" in result.handshake_errors[0]
    # ... and accepted (front-trim, byte-exact) with prefix caching off and no hits
    result = run(text.replace("prefix_caching = true", "").replace("[0, 40]", "0"))
    _assert_clean_ok(result)


@pytest.mark.parametrize("model,p_tp,d_tp", [("tiny-llama", 1, 2), ("tiny-kimi-linear", 2, 1)])
def test_a_connector_that_does_not_zero_the_tail_is_caught(monkeypatch, model, p_tp, d_tp):
    # the untransferred sub-blocks of decode's last kernel block hold an earlier tenant's bytes
    # (the reference does not zero at allocation): a connector that skips the zeroing (#49612)
    # leaves them there, and the oracle must say so, on the requests whose tail is not empty
    from hkvsim.connector.worker import ConnectorWorker
    from hkvsim.results import result_json

    monkeypatch.setattr(ConnectorWorker, "zero_sub_blocks", lambda self, ids, bsr: None)
    result = run(_text(model, p_tp, d_tp, 64))
    assert result.outcome == "corruption"
    # 100, 333, 17, 1000 tokens: every request's last 64-token decode block ends past the last
    # 16-token prefill block sent, so each has a tail, and only the tail is wrong
    assert all(r.mismatched_words > 0 for r in result.records)
    found = [m for r in result.records for m in r.mismatches]
    assert found and all("untransferred tail" in m and "stale bytes" in m for m in found), found
    assert result_json(result)["requests"]["corrupted"] == 4
    assert result_json(result)["requests"]["byte_exact"] == 0
