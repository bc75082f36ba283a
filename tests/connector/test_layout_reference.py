"""Geometry pinned to docs/semantics.md §2.3 / §2.4 reference values (all numbers written literally)."""

from __future__ import annotations

import dataclasses

import pytest

from hkvsim.geometry.layout import unify_pages
from hkvsim.geometry.presets import preset
from hkvsim.geometry.specs import GQAAttentionSpec, Sharding

from ._helpers import layout

# ---------------------------------------------------------------------------------------------
# §2.3 Kimi-Linear-48B-A3B table:
# TP | conv B | recurrent B | mamba page | logical | ppl | unified page | pad | Q/K/V/rec offsets
KIMI_TABLE = [
    (1, 73_728, 2_097_152, 2_170_880, 1_920, 30, 2_211_840, 40_960, (0, 24_576, 49_152, 73_728)),
    (2, 36_864, 1_048_576, 1_085_440, 960, 15, 1_105_920, 20_480, (0, 12_288, 24_576, 36_864)),
    (4, 18_432, 524_288, 542_720, 512, 8, 589_824, 47_104, (0, 6_144, 12_288, 18_432)),
    (8, 9_216, 262_144, 271_360, 256, 4, 294_912, 23_552, (0, 3_072, 6_144, 9_216)),
]


@pytest.mark.parametrize("tp,conv,rec,mamba,logical,ppl,unified,pad,offsets", KIMI_TABLE)
def test_kimi_linear_table(tp, conv, rec, mamba, logical, ppl, unified, pad, offsets):
    lay = layout("kimi-linear-48b", tp, block_size=64, num_blocks=4)
    state = lay.model.state
    assert state is not None
    assert state.conv_bytes(tp) == conv
    assert state.recurrent_bytes(tp) == rec
    assert state.page_bytes(tp) == mamba
    assert lay.state_page_bytes == mamba
    # §2.3: "Mamba page 2,170,880/t B"
    assert mamba * tp == 2_170_880
    assert lay.logical_block_size == logical
    assert lay.physical_blocks_per_logical == ppl
    assert lay.unified_page_bytes == unified
    assert lay.state_pad_bytes == pad
    assert state.subregion_offsets(tp) == offsets
    # Q, K, V are 4096/t columns x 3 rows x bf16 each; recurrent (32/t, 128, 128) fp32
    assert state.subregion_sizes(tp) == (conv // 3, conv // 3, conv // 3, rec)
    assert lay.ssm_sizes == (conv, rec)
    # §2.3: FlashMLA kernel block 64 tokens, MLA kernel page 73,728 B at every TP
    assert lay.kernel_block_size == 64
    assert lay.attention_page_bytes == 73_728
    # §3.1: num_blocks becomes kernel-granular
    assert lay.num_kernel_blocks == 4 * ppl


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_kimi_linear_regions_are_seven_dual_purpose_mla(tp):
    # §2.3 HMA layout: 7 shared tensors = 7 dual-purpose regions; the MLA view uses stride 73,728;
    # §3.2: every region MLA, group id -1 (shared by the MLA group and >= 1 KDA group).
    lay = layout("kimi-linear-48b", tp, block_size=64, num_blocks=4)
    assert len(lay.regions) == 7
    assert [r.is_mla for r in lay.regions] == [True] * 7
    assert [r.sharding for r in lay.regions] == [Sharding.REPLICATE] * 7
    assert [r.group_id for r in lay.regions] == [-1] * 7
    assert [r.block_len for r in lay.regions] == [73_728] * 7
    assert [r.stride for r in lay.regions] == [73_728] * 7
    ppl = {1: 30, 2: 15, 4: 8, 8: 4}[tp]
    assert [r.num_blocks for r in lay.regions] == [4 * ppl] * 7
    # all 7 regions carry a state view too (tensor 7 via KDA groups 1 and 2)
    assert len(lay.state_regions) == 7


def test_kimi_linear_hma_groups():
    # §2.3: 1 MLA group of 7 layers and 3 KDA groups of 7, 7 and 6.
    lay = layout("kimi-linear-48b", 1)
    assert [(g.kind, len(g.layers)) for g in lay.groups] == [
        ("attention", 7), ("state", 7), ("state", 7), ("state", 6)]
    # MLA at 1-based layers 4, 8, 12, 16, 20, 24 and 27
    assert lay.groups[0].layers == (3, 7, 11, 15, 19, 23, 26)
    assert len(lay.model.state_layers) == 20
    # Tensor i holds MLA layer i and layer i of each KDA group; group 3 has no layer on tensor 7.
    assert [len(t) for t in lay.tensor_layers] == [4, 4, 4, 4, 4, 4, 3]
    assert 26 in lay.tensor_layers[6]
    assert not set(lay.groups[3].layers) & set(lay.tensor_layers[6])
    for i, tensor in enumerate(lay.tensor_layers[:6]):
        assert set(tensor) == {lay.groups[g].layers[i] for g in range(4)}


def test_an_uneven_cache_group_is_told_apart():
    # KimiLinear's last KDA group holds fewer layers (48B: 7/7/6; tiny: 3/3/1), leaving shared
    # tensors that no layer of it uses; Qwen3-Next's 36 (9) GDN layers fill their groups of 12
    # (3), and a model without state has one group
    from hkvsim.geometry.layout import has_uneven_group

    assert has_uneven_group(preset("kimi-linear-48b"))
    assert has_uneven_group(preset("tiny-kimi-linear"))
    for name in ("qwen3-next-80b", "tiny-qwen3-next", "deepseek-v3", "tiny-llama"):
        assert not has_uneven_group(preset(name)), name


def test_kimi_linear_sizes_per_token_and_request():
    m = preset("kimi-linear-48b")
    # §2.3: MLA 1,152 B/token/layer, 8,064 B/token in total, at every TP (replicated)
    for tp in (1, 2, 4, 8):
        assert m.attention.bytes_per_token(tp) == 1_152
        assert m.kv_bytes_per_token(tp) == 8_064
    # §2.3: state per request 43,417,600/t B (41.4 MiB at TP1)
    for tp in (1, 2, 4, 8):
        assert m.state_bytes_per_request(tp) * tp == 43_417_600
    assert round(m.state_bytes_per_request(1) / 2**20, 1) == 41.4
    # §2.3 crossover ≈ 5,384 tokens at TP1
    assert round(m.state_bytes_per_request(1) / m.kv_bytes_per_token(1)) == 5_384


@pytest.mark.parametrize("tp,logical,ppl", [(1, 1_024, 16), (2, 512, 8), (4, 256, 4), (8, 128, 2)])
def test_kimi_linear_bf16_recurrent_variant(tp, logical, ppl):
    # §2.3: "With a bf16 recurrent state the logical blocks are 1,024/512/256/128 and ppl is
    # 16/8/4/2"; state 21.4 MiB at TP1.
    m = preset("kimi-linear-48b")
    m = dataclasses.replace(m, state=dataclasses.replace(m.state, recurrent_dtype="bfloat16"))
    lay = layout(m, tp, block_size=64)
    assert (lay.logical_block_size, lay.physical_blocks_per_logical) == (logical, ppl)
    if tp == 1:
        assert round(m.state_bytes_per_request(1) / 2**20, 1) == 21.4


# ---------------------------------------------------------------------------------------------
# §2.4 Qwen3-Next-80B: "at t = 1/2/4/8 it is 1,056/1,056/528/272 with align 16 (ppl 66/66/33/17),
# or 1,088/1,088/576/320 with align 64 (ppl 17/17/9/5)".
QWEN_ALIGN = {
    16: {1: (1_056, 66), 2: (1_056, 66), 4: (528, 33), 8: (272, 17)},
    64: {1: (1_088, 17), 2: (1_088, 17), 4: (576, 9), 8: (320, 5)},
}


@pytest.mark.parametrize("align", [16, 64])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_qwen3_next_logical_and_ppl(align, tp):
    lay = layout("qwen3-next-80b", tp, block_size=align, num_blocks=2)
    logical, ppl = QWEN_ALIGN[align][tp]
    assert lay.kernel_block_size == align
    assert lay.logical_block_size == logical
    assert lay.physical_blocks_per_logical == ppl
    assert unify_pages(lay.model, tp, align) == (align, logical)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_qwen3_next_sizes(tp):
    m = preset("qwen3-next-80b")
    s = m.state
    assert s is not None
    # §2.4: conv 8,192 columns (2,048|2,048|4,096) = 49,152/t B; recurrent 2,097,152/t B (fp32);
    # page 2,146,304/t B
    assert s.conv_columns_per_rank(tp) == (2_048 // tp, 2_048 // tp, 4_096 // tp)
    assert s.conv_bytes(tp) * tp == 49_152
    assert s.recurrent_bytes(tp) * tp == 2_097_152
    assert s.page_bytes(tp) * tp == 2_146_304
    # attention per rank: 2,048 B/token/layer at t=1 and 1,024 for t >= 2 (heads replicate)
    assert m.attention.bytes_per_token(tp) == (2_048 if tp == 1 else 1_024)
    lay = layout(m, tp, block_size=16, num_blocks=2)
    # §2.4: 12 regions, each SPLIT in its attention view; groups of 12 (12 GQA, 36 GDN)
    assert len(lay.regions) == 12
    assert all(r.sharding is Sharding.SPLIT for r in lay.regions)
    assert [(g.kind, len(g.layers)) for g in lay.groups] == [
        ("attention", 12), ("state", 12), ("state", 12), ("state", 12)]


def test_qwen3_next_per_token_and_request():
    m = preset("qwen3-next-80b")
    assert m.kv_bytes_per_token(1) == 24_576  # §2.4
    assert round(m.state_bytes_per_request(1) / 2**20, 1) == 73.7  # §2.4: 73.7 MiB
    bf16 = dataclasses.replace(m, state=dataclasses.replace(m.state, recurrent_dtype="bfloat16"))
    assert round(bf16.state_bytes_per_request(1) / 2**20, 1) == 37.7  # (37.7 bf16)
    assert round(m.state_bytes_per_request(1) / m.kv_bytes_per_token(1)) == 3_144  # crossover


def test_deepseek_v3_reference():
    m = preset("deepseek-v3")
    # §2.4: 61 MLA, latent 576, 70,272 B/token (fp8_ds_mla 40,016); replicated, ppl 1, 61 regions
    assert m.kv_bytes_per_token(1) == 70_272
    assert m.kv_bytes_per_token(8) == 70_272
    fp8 = dataclasses.replace(m, attention=dataclasses.replace(m.attention,
                                                                cache_dtype="fp8_ds_mla"))
    assert fp8.kv_bytes_per_token(1) == 40_016
    lay = layout(m, 1, block_size=64, num_blocks=2)
    assert lay.physical_blocks_per_logical == 1
    assert len(lay.regions) == 61
    assert all(r.is_mla for r in lay.regions)
    # "288 MB at 4K tokens"
    assert round(m.kv_bytes_per_token(1) * 4_096 / 1e6) == 288


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_llama_31_8b_reference(tp):
    m = preset("llama-3.1-8b")
    # §2.4: 131,072 B/token at TP1; 4,096/t B per token per layer; 32 regions, K and V packed
    assert m.kv_bytes_per_token(1) == 131_072
    assert m.attention.bytes_per_token(tp) * tp == 4_096
    lay = layout(m, tp, block_size=16, num_blocks=2)
    assert len(lay.regions) == 32
    assert all(r.sharding is Sharding.SPLIT for r in lay.regions)
    assert [r.block_len for r in lay.regions] == [16 * 4_096 // tp] * 32


def test_gqa_heads_replicate_once_tp_exceeds_k():
    # §2.1: heads = max(1, K // t); replicated once t > K
    attn = GQAAttentionSpec(num_kv_heads=2, head_dim=256)
    assert [attn.heads_per_rank(t) for t in (1, 2, 4, 8)] == [2, 1, 1, 1]
