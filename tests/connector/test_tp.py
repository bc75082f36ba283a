"""docs/semantics.md §1 tp_ratio, §4.1 handshake targets, §5.1 source ranks, §5.2 split-handle rule."""

from __future__ import annotations

import pytest

from hkvsim.connector.tp import TPError, handshake_targets, source_plan, tp_ratio
from hkvsim.geometry.presets import preset


@pytest.mark.parametrize("local,remote,r", [
    (1, 1, 1), (4, 2, 2), (8, 1, 8), (2, 4, -2), (1, 8, -8), (2, 2, 1),
])
def test_tp_ratio(local, remote, r):
    # §1: local/remote when local >= remote, otherwise -remote/local
    assert tp_ratio(local, remote) == r


@pytest.mark.parametrize("local,remote", [(3, 2), (2, 3), (4, 6)])
def test_tp_ratio_must_be_exact(local, remote):
    with pytest.raises(TPError, match="V1") as exc:
        tp_ratio(local, remote)
    assert str(local) in str(exc.value) and str(remote) in str(exc.value)


@pytest.mark.parametrize("local,remote,rank,targets", [
    # r > 0: [tp_rank // r]
    (4, 2, 0, (0,)), (4, 2, 1, (0,)), (4, 2, 2, (1,)), (4, 2, 3, (1,)),
    (8, 1, 7, (0,)), (2, 2, 1, (1,)),
    # r < 0: [tp_rank*|r| + i for i < |r|]
    (1, 4, 0, (0, 1, 2, 3)), (2, 8, 1, (4, 5, 6, 7)), (2, 4, 0, (0, 1)), (2, 4, 1, (2, 3)),
])
def test_handshake_targets(local, remote, rank, targets):
    assert handshake_targets(local, remote, rank) == targets


def test_gqa_ssm_k2_p_tp4_to_d_tp1():
    # §5.1 example: GQA+SSM, K = 2, P TP4 -> D TP1: attention candidates 0..3 hold heads 0,0,1,1
    # and de-duplicate to [0, 2]; SSM comes from [0..3] (P1 and P3 read for state only).
    plan = source_plan(preset("qwen3-next-80b"), local_tp=1, remote_tp=4, tp_rank=0)
    assert plan.tp_ratio == -4
    assert plan.attention_sources == (0, 2)
    assert plan.state_sources == (0, 1, 2, 3)
    assert plan.all_sources == (0, 1, 2, 3)
    assert plan.fa_splits == 2 and plan.ssm_splits == 4
    assert [plan.attention_slot(p) for p in (0, 2)] == [0, 1]
    assert [plan.state_chunk(p) for p in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert plan.rank_offset_factor == 0
    assert plan.use_split_handles


def test_gqa_attention_sources_not_deduplicated_when_heads_differ():
    # K = 8, P TP4 -> D TP2 rank 1: candidates 2, 3 hold distinct heads (4, 6): both read.
    plan = source_plan(preset("llama-3.1-8b"), local_tp=2, remote_tp=4, tp_rank=1)
    assert plan.attention_sources == (2, 3)
    assert plan.state_sources == ()
    assert plan.all_sources == (2, 3)


@pytest.mark.parametrize("model,local,remote,rank,source", [
    # §5.1: MLA readers spread as tp_rank * remote_TP // local_TP (0, k, 2k ...)
    ("deepseek-v3", 2, 8, 0, 0), ("deepseek-v3", 2, 8, 1, 4),
    ("deepseek-v3", 4, 8, 3, 6), ("deepseek-v3", 1, 4, 0, 0),
    ("deepseek-v3", 4, 2, 3, 1), ("deepseek-v3", 4, 2, 1, 0),
    ("kimi-linear-48b", 2, 8, 1, 4), ("kimi-linear-48b", 4, 1, 3, 0),
    # local >= remote, GQA: one rank
    ("llama-3.1-8b", 4, 2, 3, 1), ("qwen3-next-80b", 8, 2, 5, 1),
])
def test_single_attention_source(model, local, remote, rank, source):
    plan = source_plan(preset(model), local_tp=local, remote_tp=remote, tp_rank=rank)
    assert plan.attention_sources == (source,)


def test_hybrid_mla_state_sources_cover_all_ranks():
    # §5.1: SSM, local_TP < remote_TP: all |r| ranks, even when attention is replicated.
    plan = source_plan(preset("kimi-linear-48b"), local_tp=2, remote_tp=8, tp_rank=1)
    assert plan.attention_sources == (4,)
    assert plan.state_sources == (4, 5, 6, 7)
    assert plan.all_sources == (4, 5, 6, 7)
    # SSM, otherwise: as attention
    plan = source_plan(preset("kimi-linear-48b"), local_tp=4, remote_tp=2, tp_rank=3)
    assert plan.attention_sources == plan.state_sources == (1,)


def test_pure_mla_has_no_state_sources():
    plan = source_plan(preset("deepseek-v3"), local_tp=1, remote_tp=4, tp_rank=0)
    assert plan.state_sources == ()
    assert plan.all_sources == (0,)


@pytest.mark.parametrize("model,local,remote,rank,factor", [
    # 0 for MLA or local_TP <= remote_TP
    ("deepseek-v3", 8, 1, 5, 0), ("kimi-linear-48b", 4, 1, 3, 0),
    ("llama-3.1-8b", 2, 4, 1, 0), ("llama-3.1-8b", 2, 2, 1, 0),
    # otherwise, local_TP <= K: tp_rank % (local_TP // remote_TP)
    ("llama-3.1-8b", 4, 2, 3, 1), ("llama-3.1-8b", 4, 2, 2, 0), ("llama-3.1-8b", 8, 2, 7, 3),
    ("llama-3.1-8b", 8, 1, 6, 6),
    # local_TP > K (K = 2): local_head - first_remote_head
    #   D TP4 <- P TP1, rank 3: local head 1, source P0 holds head 0 first -> 1
    ("qwen3-next-80b", 4, 1, 3, 1), ("qwen3-next-80b", 4, 1, 1, 0),
    #   D TP8 <- P TP1, rank 5: local head 5*2//8 = 1 -> 1
    ("qwen3-next-80b", 8, 1, 5, 1),
    #   D TP4 <- P TP2, rank 3: head 1; source P1 holds exactly head 1 -> 0
    #   (tp_rank % ratio would give 1 here: the GQA cap case)
    ("qwen3-next-80b", 4, 2, 3, 0), ("qwen3-next-80b", 8, 2, 7, 0),
])
def test_rank_offset_factor(model, local, remote, rank, factor):
    plan = source_plan(preset(model), local_tp=local, remote_tp=remote, tp_rank=rank)
    assert plan.rank_offset_factor == factor


@pytest.mark.parametrize("model,local,remote,expected", [
    # §5.2: "pure MLA (also with DCP) no; hybrid MLA+SSM yes; GQA yes; r > 0 no"
    ("deepseek-v3", 1, 2, False),
    ("deepseek-v3", 2, 8, False),
    ("kimi-linear-48b", 1, 2, True),
    ("kimi-linear-48b", 2, 8, True),
    ("llama-3.1-8b", 1, 2, True),
    ("qwen3-next-80b", 1, 4, True),
    ("kimi-linear-48b", 2, 1, False),
    ("llama-3.1-8b", 4, 2, False),
    ("qwen3-next-80b", 2, 1, False),
    ("kimi-linear-48b", 2, 2, False),
    ("llama-3.1-8b", 1, 1, False),
])
def test_split_handle_rule(model, local, remote, expected):
    for rank in range(local):
        plan = source_plan(preset(model), local_tp=local, remote_tp=remote, tp_rank=rank)
        assert plan.use_split_handles is expected
