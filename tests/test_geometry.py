"""Geometry acceptance numbers (issue: foundation) with their derivations, and tiny-twin rules."""

from __future__ import annotations

import dataclasses

import itertools
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvsim.geometry import GeometryError, build_layout, preset, preset_names
from hkvsim.geometry.layout import registration_walk
from hkvsim.geometry.specs import (DTYPE_BYTES, GQAAttentionSpec, MLAAttentionSpec, ModelSpec,
                                   kda_state)

TPS = (1, 2, 4, 8)


@pytest.mark.parametrize("tp,ppl,logical", [(1, 30, 1920), (2, 15, 960), (4, 8, 512), (8, 4, 256)])
def test_kimi_linear_unified_geometry(tp: int, ppl: int, logical: int) -> None:
    # mamba page = conv 3 x (4096/t cols x 3 rows x 2 B) + recurrent (32/t x 128 x 128 x 4 B)
    #            = 2,170,880 / t B; MLA kernel page = 64 tokens x (512 + 64) x 2 B = 73,728 B;
    # logical = 64 * ceil(mamba_page / 73,728); ppl = logical / 64 (docs/semantics.md §2.3 table).
    layout = build_layout(preset("kimi-linear-48b"), tp=tp, block_size=64, num_blocks=8)
    assert layout.kernel_block_size == 64
    assert layout.logical_block_size == logical
    assert layout.physical_blocks_per_logical == ppl
    assert layout.state_page_bytes == 2_170_880 // tp
    assert layout.unified_page_bytes == logical * 1152
    assert len(layout.regions) == 7
    assert all(r.is_mla for r in layout.regions)
    assert {r.block_len for r in layout.regions} == {73_728}
    assert [len(g.layers) for g in layout.groups] == [7, 7, 7, 6]
    assert layout.model.state_bytes_per_request(tp) == 20 * 2_170_880 // tp


def test_reference_bytes_per_token() -> None:
    # DeepSeek-V3: 61 x (512 + 64) x 2 B; Llama-3.1-8B: 32 x 2 x 8 heads x 128 x 2 B;
    # Qwen3-Next-80B: 12 x 2 x 2 heads x 256 x 2 B; Kimi-Linear: 7 x 1,152 B.
    assert preset("deepseek-v3").kv_bytes_per_token(1) == 70_272
    assert preset("llama-3.1-8b").kv_bytes_per_token(1) == 131_072
    assert preset("qwen3-next-80b").kv_bytes_per_token(1) == 24_576
    assert preset("kimi-linear-48b").kv_bytes_per_token(1) == 8_064


@pytest.mark.parametrize("name", [n for n in preset_names() if n.startswith("tiny-")])
def test_tiny_twins_accept_tp_1_2_4_8_with_8_byte_slices(name: str) -> None:
    model = preset(name)
    for tp in TPS:
        layout = build_layout(model, tp=tp, block_size=model.attention.attention_backend
                              .min_kernel_block, num_blocks=4)
        attn_row = model.attention.bytes_per_token(tp)
        assert attn_row % 8 == 0
        if not model.attention.is_mla:
            assert (attn_row // (2 * model.attention.heads_per_rank(tp))) % 8 == 0
        if model.is_hybrid:
            assert all(s % 8 == 0 for s in model.state.subregion_sizes(tp))
            assert layout.unified_page_bytes >= layout.state_page_bytes


@pytest.mark.parametrize("name,big", [("tiny-kimi-linear", "kimi-linear-48b"),
                                      ("tiny-qwen3-next", "qwen3-next-80b")])
def test_tiny_hybrid_twins_keep_tp_dependent_ppl(name: str, big: str) -> None:
    for model_name in (name, big):
        model = preset(model_name)
        block = model.attention.attention_backend.min_kernel_block
        ppl = [build_layout(model, tp=tp, block_size=block, num_blocks=2)
               .physical_blocks_per_logical for tp in TPS]
        assert ppl[0] > 2, "the state page must span several kernel pages at TP 1"
        assert ppl[0] > ppl[-1] and len(set(ppl)) >= 3, ppl


def test_tiny_kimi_keeps_irregular_interleave_and_uneven_last_group() -> None:
    model = preset("tiny-kimi-linear")
    gaps = {b - a for a, b in itertools.pairwise(model.attention_layers)}
    assert len(gaps) > 1  # irregular, like Kimi's 4, 8, ..., 24, 27
    layout = build_layout(model, tp=1, block_size=64, num_blocks=2)
    sizes = [len(g.layers) for g in layout.state_groups]
    assert sizes[-1] < sizes[0]
    q, k, v = (c for _, c in model.state.conv_subprojections)
    assert q == k == v  # KDA: equal sub-projections
    gq, gk, gv = (c for _, c in preset("tiny-qwen3-next").state.conv_subprojections)
    assert gq == gk != gv  # GDN: unequal


def test_first_registration_quirk_breaks_kda_first_kimi() -> None:
    layout = build_layout(preset("kimi-linear-48b"), tp=2, block_size=64, num_blocks=4,
                          registration_order="state-first", first_registration_wins=True)
    # the bug: KDA registered first, so the dual-purpose regions are flagged SPLIT with the
    # state view's stride (the unified page) and logical block count
    assert not any(r.is_mla for r in layout.regions)
    assert {r.stride for r in layout.regions} == {layout.unified_page_bytes}
    assert {r.num_blocks for r in layout.regions} == {4}


@pytest.mark.parametrize("name", preset_names())
def test_named_registration_orders_agree(name: str) -> None:
    model = preset(name)
    block = model.attention.attention_backend.min_kernel_block
    layouts = [build_layout(model, tp=2, block_size=block, num_blocks=3, registration_order=o)
               for o in ("sorted", "state-first", "attention-first")]
    assert layouts[0].regions == layouts[1].regions == layouts[2].regions


@st.composite
def hybrid_models(draw: st.DrawFn) -> tuple[ModelSpec, int, list[int]]:
    layers = draw(st.integers(3, 14))
    n_attn = draw(st.integers(1, layers - 1))
    attn_layers = tuple(sorted(draw(st.permutations(range(layers)))[:n_attn]))
    if draw(st.booleans()):
        attention = MLAAttentionSpec(kv_lora_rank=8 * draw(st.integers(1, 16)), rope_dim=8)
    else:
        attention = GQAAttentionSpec(num_kv_heads=draw(st.sampled_from([1, 2, 4, 8])),
                                     head_dim=8 * draw(st.integers(1, 8)))
    state = kda_state(num_heads=draw(st.sampled_from([8, 16])), head_dim=8 * draw(
        st.integers(1, 4)), conv_kernel=draw(st.integers(2, 4)))
    model = ModelSpec(name="random", architecture="X", num_layers=layers, hidden_size=64,
                      attention=attention, attention_layers=attn_layers, state=state)
    tp = draw(st.sampled_from(TPS))
    walk = draw(st.permutations(range(layers)))
    return model, tp, list(walk)


@settings(max_examples=150, deadline=None)
@given(hybrid_models())
def test_any_registration_order_gives_identical_regions(case) -> None:
    model, tp, walk = case
    try:
        reference = build_layout(model, tp=tp, block_size=64, num_blocks=3)
    except GeometryError:
        return  # this TP does not fit the heads: nothing to compare
    shuffled = build_layout(model, tp=tp, block_size=64, num_blocks=3, registration_order=walk)
    assert shuffled.regions == reference.regions
    for region in reference.regions:
        has_attention = bool(set(region.layers) & set(model.attention_layers))
        assert region.is_mla == (has_attention and model.attention.is_mla)
        if has_attention:  # the attention (kernel) view wins, whatever registered first
            assert region.stride == reference.attention_page_bytes


@pytest.mark.parametrize("call,message", [
    (lambda: build_layout(preset("kimi-linear-48b"), tp=3, block_size=64, num_blocks=2),
     "does not divide"),
    (lambda: build_layout(preset("llama-3.1-8b"), tp=3, block_size=16, num_blocks=2),
     "TP 3 does not divide the 8 KV heads"),
    (lambda: build_layout(preset("deepseek-v3"), tp=1, block_size=16, num_blocks=2),
     "fixes the kernel block at 64 tokens"),
    (lambda: build_layout(preset("llama-3.1-8b"), tp=1, block_size=24, num_blocks=2),
     "multiple of 16"),
    (lambda: build_layout(preset("llama-3.1-8b"), tp=1, block_size=16, num_blocks=0),
     "num_blocks must be a positive integer"),
    (lambda: build_layout(preset("llama-3.1-8b"), tp=1, block_size=0, num_blocks=2),
     "block_size must be a positive integer, got 0"),
    (lambda: build_layout(preset("tiny-kimi-linear"), tp=1, block_size=-16, num_blocks=2),
     "block_size must be a positive integer, got -16"),
    (lambda: build_layout(preset("llama-3.1-8b"), tp=1, block_size=16, num_blocks=2,
                          registration_order="random"), "unknown registration_order"),
    (lambda: preset("llama-70b"), "unknown model preset 'llama-70b'; allowed:"),
    # zero sizes in a model's own geometry (a hand-written or HF config), each by name
    (lambda: dataclasses.replace(preset("tiny-deepseek").attention, kv_lora_rank=0),
     "kv_lora_rank must be a positive integer, got 0"),
    (lambda: dataclasses.replace(preset("tiny-llama").attention, head_dim=0),
     "head_dim must be a positive integer, got 0"),
    (lambda: dataclasses.replace(preset("tiny-llama"), num_layers=0),
     "num_layers must be a positive integer, got 0"),
    (lambda: dataclasses.replace(preset("tiny-kimi-linear").state, recurrent_heads=0),
     "recurrent_heads must be a positive integer, got 0"),
])
def test_invalid_geometry_is_one_clear_error(call, message: str) -> None:
    with pytest.raises(GeometryError, match=message):
        call()


def test_registration_walks() -> None:
    model = preset("tiny-kimi-linear")
    assert registration_walk(model, "state-first")[:2] == (0, 1)
    assert registration_walk(model, "attention-first")[:3] == (2, 5, 9)
    with pytest.raises(GeometryError, match="permutation"):
        registration_walk(model, [0, 0, 1])


def test_dtype_sizes_follow_their_bit_widths() -> None:
    # every byte count of the geometry scales with these: bfloat16 / float16 16 bits, float32
    # 32, fp8 8 (the width each name ends with)
    assert DTYPE_BYTES  # a dtype table emptied by mistake fails here, not silently
    for name, size in DTYPE_BYTES.items():
        bits = int(re.search(r"(\d+)$", name).group(1))
        assert size * 8 == bits, (name, size)
