"""docs/semantics.md §4.4 validation rules: each failure is a HandshakeError naming the rule and both
values; the valid pairs the rules must accept (GQA cap, KimiLinear hybrid V6)."""

from __future__ import annotations

import itertools
from dataclasses import replace as dc_replace

import pytest

from hkvsim.connector.validate import (
    HandshakeError,
    PairSettings,
    block_size_ratio,
    validate_pair,
    validate_remote_ranks,
)
from hkvsim.geometry.presets import preset
from hkvsim.geometry.specs import GQAAttentionSpec, ModelSpec

from ._helpers import layout, meta, replace

NO_PC = PairSettings(prefix_caching=False)
PC = PairSettings(prefix_caching=True)


def _pair(model, *, d_tp, p_tp, d_block=64, p_block=64, d_rank=0, p_rank=0, num_blocks=4,
          d_kw=None, p_kw=None):
    d_lay = layout(model, d_tp, block_size=d_block, num_blocks=num_blocks, **(d_kw or {}))
    p_lay = layout(model, p_tp, block_size=p_block, num_blocks=num_blocks, **(p_kw or {}))
    return d_lay.model, meta(d_lay, d_rank, engine="d"), meta(p_lay, p_rank, engine="p",
                                                                 base=1 << 44)


def _check(model, d, p, settings=NO_PC):
    return validate_pair(model=model, local=d, remote=p, local_is_decode=True, settings=settings)


def _fails(rule, model, d, p, *numbers, settings=NO_PC):
    with pytest.raises(HandshakeError) as exc:
        _check(model, d, p, settings)
    assert exc.value.rule == rule, str(exc.value)
    text = str(exc.value)
    for n in numbers:
        assert str(n) in text, (n, text)
    return text


# ---- V1 --------------------------------------------------------------------------------------


def test_v1_tp_ratio_not_integral():
    model, d, p = _pair("kimi-linear-48b", d_tp=2, p_tp=1)
    _fails("V1", model, d, replace(p, tp_size=3), "local TP 2", "remote TP 3")


# ---- V2 --------------------------------------------------------------------------------------


def test_v2_prefill_block_larger_than_decode():
    model, d, p = _pair("tiny-llama", d_tp=1, p_tp=1, d_block=16, p_block=32)
    _fails("V2", model, d, p, "16", "32")


def test_v2_non_integral_ratio():
    model, d, p = _pair("tiny-llama", d_tp=1, p_tp=1, d_block=48, p_block=32)
    _fails("V2", model, d, p, "48", "32")
    with pytest.raises(HandshakeError) as exc:
        block_size_ratio(decode_kernel_tokens=48, prefill_kernel_tokens=32)
    assert exc.value.rule == "V2"


@pytest.mark.parametrize("d_block,bsr", [(16, 1), (32, 2), (64, 4)])
def test_v2_exact_ratio_accepted(d_block, bsr):
    model, d, p = _pair("tiny-llama", d_tp=1, p_tp=1, d_block=d_block, p_block=16)
    assert _check(model, d, p) == bsr


def test_v2_bsr_forbidden_with_host_buffer():
    model, d, p = _pair("tiny-llama", d_tp=1, p_tp=1, d_block=32, p_block=16)
    _fails("V2", model, replace(d, host_buffer=True), p, "2", "host buffer")
    # bsr 1 with the host buffer is fine
    model, d, p = _pair("tiny-llama", d_tp=1, p_tp=1, d_block=16, p_block=16)
    assert _check(model, replace(d, host_buffer=True), p) == 1


# ---- V3 --------------------------------------------------------------------------------------


def test_v3_replicated_remote_kv_with_r_negative():
    # tiny-llama K = 8: D TP2 <- P TP16 (remote TP > K) is rejected ...
    model, d, p = _pair("tiny-llama", d_tp=2, p_tp=16, d_block=16, p_block=16)
    _fails("V3", model, d, p, "2", "16", "8")
    # ... but D TP4 <- P TP8 (remote TP = K) is fine
    model, d, p = _pair("tiny-llama", d_tp=4, p_tp=8, d_block=16, p_block=16)
    assert _check(model, d, p) == 1


# ---- V4 --------------------------------------------------------------------------------------


def test_v4_hybrid_prefix_caching_with_different_ppl():
    # KimiLinear ppl 30 at TP1, 15 at TP2 (§2.3)
    model, d, p = _pair("kimi-linear-48b", d_tp=1, p_tp=2)
    text = _fails("V4", model, d, p, "30", "15", settings=PC)
    assert "disable prefix caching" in text
    assert _check(model, d, p, NO_PC) == 1  # prefix caching off: accepted
    # quirk front-trim-with-prefix-cache lets it through (bug replay)
    bug = PairSettings(prefix_caching=True, allow_heterogeneous_ppl_with_prefix_cache=True)
    assert _check(model, d, p, bug) == 1


@pytest.mark.parametrize("local_is_decode", [True, False])
@pytest.mark.parametrize("local_pc,remote_pc", [(True, False), (False, True), (True, True)])
def test_v4_whichever_side_enables_prefix_caching(local_is_decode, local_pc, remote_pc):
    # issue #10 item 7: push with prefix caching on decode only passed the handshake (prefill
    # validates, with its own setting off). The remote's setting travels in its metadata.
    model, d, p = _pair("kimi-linear-48b", d_tp=1, p_tp=2)
    local, remote = (d, p) if local_is_decode else (p, d)
    local = replace(local, prefix_caching=local_pc)
    remote = replace(remote, prefix_caching=remote_pc)
    with pytest.raises(HandshakeError) as exc:
        validate_pair(model=model, local=local, remote=remote, local_is_decode=local_is_decode,
                      settings=NO_PC)
    text = str(exc.value)
    assert exc.value.rule == "V4" and "disable prefix caching" in text
    on = {("local", local_pc), ("remote", remote_pc)}
    roles = {"local": "decode" if local_is_decode else "prefill",
             "remote": "prefill" if local_is_decode else "decode"}
    for side, enabled in on:
        assert (roles[side] in text.split("it is on for ")[1].split(";")[0]) == enabled, text
    # off on both sides: accepted
    assert validate_pair(model=model, local=replace(local, prefix_caching=False),
                         remote=replace(remote, prefix_caching=False),
                         local_is_decode=local_is_decode, settings=NO_PC) == 1


def test_v4_equal_ppl_allows_prefix_caching():
    # Qwen3-Next, align 16: ppl 66 at TP1 and TP2 (§2.4) -> prefix caching may stay on
    model, d, p = _pair("qwen3-next-80b", d_tp=2, p_tp=1, d_block=16, p_block=16, num_blocks=1)
    assert d.physical_blocks_per_logical == p.physical_blocks_per_logical == 66
    assert _check(model, d, p, PC) == 1
    model, d, p = _pair("kimi-linear-48b", d_tp=4, p_tp=4)
    assert _check(model, d, p, PC) == 1


# ---- V5 --------------------------------------------------------------------------------------


def test_v5_layout_mismatch():
    model, d, p = _pair("tiny-llama", d_tp=1, p_tp=1, d_block=16, p_block=16,
                        p_kw=dict(kv_cache_layout="NHD"))
    _fails("V5", model, d, p, "HND", "NHD")


def test_v5_head_splitting_needs_hnd():
    nhd = dict(kv_cache_layout="NHD")
    model, d, p = _pair("tiny-llama", d_tp=2, p_tp=1, d_block=16, p_block=16, d_kw=nhd, p_kw=nhd)
    _fails("V5", model, d, p, "NHD")
    model, d, p = _pair("tiny-llama", d_tp=1, p_tp=1, d_block=16, p_block=16, d_kw=nhd, p_kw=nhd)
    assert _check(model, d, p) == 1


# ---- V6 --------------------------------------------------------------------------------------


def test_v6_replicate_block_len_mismatch():
    model, d, p = _pair("tiny-deepseek", d_tp=1, p_tp=2)
    wrong = tuple(x // 2 for x in p.block_lens)
    _fails("V6", model, d, replace(p, block_lens=wrong), d.block_lens[0], wrong[0])


def _k2_model() -> ModelSpec:
    return ModelSpec(name="gqa-k2", architecture="LlamaForCausalLM", num_layers=2, hidden_size=64,
                     attention=GQAAttentionSpec(num_kv_heads=2, head_dim=64),
                     attention_layers=(0, 1))


def test_v6_gqa_cap_example_accepted():
    # §4.4 cap example: K = 2, P TP2, D TP4. heads_R = heads_L = 1, so len_R = len_L.
    model, d, p = _pair(_k2_model(), d_tp=4, p_tp=2, d_block=16, p_block=16)
    assert d.block_lens == p.block_lens
    for rank in range(4):
        assert _check(model, replace(d, tp_rank=rank), p) == 1
    # the same for the Qwen3-Next GQA+SSM hybrid (K = 2)
    model, d, p = _pair("qwen3-next-80b", d_tp=4, p_tp=2, d_block=16, p_block=16, num_blocks=1)
    assert _check(model, d, p) == 1
    # without the cap the check would demand 2x; a remote block of 2x is wrong and rejected
    model, d, p = _pair(_k2_model(), d_tp=4, p_tp=2, d_block=16, p_block=16)
    doubled = tuple(2 * x for x in p.block_lens)
    _fails("V6", model, d, replace(p, block_lens=doubled, block_strides=doubled),
           d.block_lens[0], doubled[0])


def test_v6_split_r_positive_with_bsr():
    # SPLIT, r > 0: len_R == (len_L * heads_R // heads_L) // bsr. tiny-llama D TP2 block 32 <-
    # P TP1 block 16: len_L = 8,192, heads 4 vs 8 -> len_R = 16,384 // 2 = 8,192.
    model, d, p = _pair("tiny-llama", d_tp=2, p_tp=1, d_block=32, p_block=16)
    assert (d.block_lens[0], p.block_lens[0]) == (8_192, 8_192)
    assert _check(model, d, p) == 2
    bad = tuple(x // 2 for x in p.block_lens)
    _fails("V6", model, d, replace(p, block_lens=bad), 8_192, 4_096)


def test_v6_split_r_negative_needs_bsr_1():
    # tiny-qwen3-next (K = 2): D TP2 block 32 <- P TP4 block 16. A single attention split
    # (P0, P1 both hold head 0), so V10 passes, but SPLIT with r < 0 needs bsr == 1.
    model, d, p = _pair("tiny-qwen3-next", d_tp=2, p_tp=4, d_block=32, p_block=16)
    _fails("V6", model, d, p, "2")


def test_v6_split_r_negative_length():
    # tiny-llama D TP1 <- P TP2: len_R == len_L * heads_R // heads_L = 8,192 * 4 // 8 = 4,096
    model, d, p = _pair("tiny-llama", d_tp=1, p_tp=2, d_block=16, p_block=16)
    assert (d.block_lens[0], p.block_lens[0]) == (8_192, 4_096)
    assert _check(model, d, p) == 1
    _fails("V6", model, d, replace(p, block_lens=(8_192,) * 4, block_strides=(8_192,) * 4),
           8_192, 4_096)


@pytest.mark.parametrize("d_tp,p_tp", list(itertools.product((1, 2, 4, 8), repeat=2)))
def test_v6_kimi_hybrid_accepts_73728_at_every_tp_pair(d_tp, p_tp):
    # §4.4: "KimiLinear: 73,728 = 73,728 at every TP pair."
    model, d, p = _pair("kimi-linear-48b", d_tp=d_tp, p_tp=p_tp, num_blocks=1)
    assert d.block_lens == p.block_lens == (73_728,) * 7
    assert _check(model, d, p) == 1


def test_v6_kimi_hybrid_wrong_block_len_rejected():
    model, d, p = _pair("kimi-linear-48b", d_tp=1, p_tp=2, num_blocks=1)
    wrong = (36_864,) * 7
    _fails("V6", model, d, replace(p, block_lens=wrong), 73_728, 36_864)


def test_skip_hybrid_block_len_check_lets_a_wrong_block_len_through():
    """Bug replay (pre-#49762, §3.2 point 4): the block_len check was skipped for mamba models.

    Documents the bug: the wrong block_len IS accepted with the setting on."""
    model, d, p = _pair("kimi-linear-48b", d_tp=1, p_tp=2, num_blocks=1)
    wrong = replace(p, block_lens=(36_864,) * 7)
    skip = PairSettings(prefix_caching=False, skip_hybrid_block_len_check=True)
    assert _check(model, d, wrong, skip) == 1
    # also for the GQA hybrid
    model, d, p = _pair("qwen3-next-80b", d_tp=2, p_tp=1, d_block=16, p_block=16, num_blocks=1)
    bad = replace(p, block_lens=tuple(x // 2 for x in p.block_lens))
    _fails("V6", model, d, bad)
    assert _check(model, d, bad, skip) == 1


# ---- V7 --------------------------------------------------------------------------------------


def test_v7_region_count():
    model, d, p = _pair("kimi-linear-48b", d_tp=1, p_tp=1, num_blocks=1)
    cut = {k: getattr(p, k)[:6] for k in ("base_addrs", "block_lens", "block_strides",
                                          "region_num_blocks", "region_is_mla", "group_ids")}
    _fails("V7", model, d, replace(p, **cut), "local 7", "remote 6")


def test_v7_stride_smaller_than_block_len():
    model, d, p = _pair("tiny-deepseek", d_tp=1, p_tp=1)
    strides = (4_096,) + p.block_strides[1:]
    _fails("V7", model, d, replace(p, block_strides=strides), 4_096, p.block_lens[0])


def test_v7_num_blocks_across_remote_ranks():
    _, _, p0 = _pair("kimi-linear-48b", d_tp=1, p_tp=2, num_blocks=2)
    p1 = replace(p0, tp_rank=1, num_blocks=45)
    validate_remote_ranks({0: p0, 1: replace(p0, tp_rank=1)}, expected_engine="p")
    with pytest.raises(HandshakeError) as exc:
        validate_remote_ranks({0: p0, 1: p1}, expected_engine="p")
    assert exc.value.rule == "V7"
    assert "30" in str(exc.value) and "45" in str(exc.value)


def test_v8_unexpected_engine_id():
    _, _, p0 = _pair("kimi-linear-48b", d_tp=1, p_tp=1, num_blocks=1)
    with pytest.raises(HandshakeError) as exc:
        validate_remote_ranks({0: p0}, expected_engine="other")
    assert exc.value.rule == "V8"


# ---- V10 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_name", ["tiny-llama", "tiny-qwen3-next"])
def test_v10_bsr_with_prefill_tp_above_decode_and_several_splits(model_name):
    model, d, p = _pair(model_name, d_tp=1, p_tp=2, d_block=32, p_block=16)
    _fails("V10", model, d, p, "2", "prefill TP 2", "decode TP 1")


def test_v10_all_replicate_is_allowed():
    # all regions REPLICATE (tiny-deepseek on triton-mla, 16-token kernel): bsr > 1 with
    # P_TP > D_TP is fine
    m = preset("tiny-deepseek")
    m = dc_replace(m, attention=dc_replace(m.attention, backend="triton-mla"))
    model, d, p = _pair(m, d_tp=1, p_tp=2, d_block=32, p_block=16)
    assert _check(model, d, p) == 2
    model, d, p = _pair(m, d_tp=2, p_tp=4, d_block=64, p_block=16, d_rank=1)
    assert _check(model, d, p) == 4


# ---- testbed SSM geometry check ---------------------------------------------------------------


def test_ssm_geometry_check():
    model, d, p = _pair("kimi-linear-48b", d_tp=2, p_tp=1, num_blocks=1)
    # correct: remote (conv, recurrent) = local x local_TP / remote_TP = (36,864, 1,048,576) x 2
    assert d.ssm_sizes == (36_864, 1_048_576)
    assert p.ssm_sizes == (73_728, 2_097_152)
    assert _check(model, d, p) == 1
    _fails("SSM", model, d, replace(p, ssm_sizes=(40_000, 2_097_152)), 36_864, 40_000)
    _fails("SSM", model, d, replace(p, ssm_sizes=(73_728, 1_048_576)), 1_048_576)


@pytest.mark.parametrize("model_name", ["kimi-linear-48b", "tiny-kimi-linear"])
def test_ssm_subregions_must_split_like_the_local_side(model_name):
    # same conv/recurrent totals, so only the sub-region checks can see it: a remote that splits
    # its conv state in two instead of three would have its bytes read at the local offsets
    model, d, p = _pair(model_name, d_tp=2, p_tp=1, num_blocks=1)
    conv = p.ssm_subregion_sizes[:-1]
    assert len(conv) == 3 and sum(conv) == p.ssm_sizes[0]
    two = (conv[0] + conv[1], conv[2], p.ssm_subregion_sizes[-1])
    text = _fails("SSM", model, d, replace(p, ssm_subregion_sizes=two))
    assert "sub-region count: local 4, remote 3" in text
    # three conv sub-regions of other sizes, same total: sub-region 0 is named
    skewed = (conv[0] + 512, conv[1] - 512, conv[2], p.ssm_subregion_sizes[-1])
    text = _fails("SSM", model, d, replace(p, ssm_subregion_sizes=skewed), conv[0] + 512)
    assert "state sub-region 0" in text and f"local {d.ssm_subregion_sizes[0]}" in text
    # every TP pair of the matrix splits consistently
    for d_tp, p_tp in [(1, 1), (2, 1), (1, 2), (4, 2), (2, 4), (8, 4)]:
        model, d, p = _pair(model_name, d_tp=d_tp, p_tp=p_tp, num_blocks=1)
        assert _check(model, d, p) == 1
