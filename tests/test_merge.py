"""Descriptor merging (``[connector] descriptor_merge``): the merge functions keep exactly the
(local byte, remote byte) pairs, and merged runs through the cluster stay byte-exact while
posting fewer descriptors where blocks are contiguous (issue #7)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvsim.cluster import run_scenario
from hkvsim.connector.merge import (
    byte_pairs,
    expand,
    merge_contiguous,
    merge_descriptors,
    merge_strided,
    region_index,
)
from hkvsim.scenario import parse_scenarios
from hkvsim.transport.base import TransportError, check_strided_array, expand_strided

pytestmark = pytest.mark.timeout(120)


def descs(rows: list[tuple[int, int]], dev: int = 0) -> np.ndarray:
    return np.array([(a, n, dev) for a, n in rows], dtype=np.uint64)


# ---- the merge functions -----------------------------------------------------------------------
def test_contiguous_on_both_sides_merges():
    local = descs([(0, 8), (8, 8), (16, 8), (100, 8)])
    remote = descs([(1000, 8), (1008, 8), (1016, 8), (1024, 8)])
    ml, mr = merge_contiguous(local, remote)
    assert ml.tolist() == [[0, 24, 0], [100, 8, 0]]
    assert mr.tolist() == [[1000, 24, 0], [1024, 8, 0]]


def test_contiguous_on_one_side_only_does_not_merge():
    local = descs([(0, 8), (8, 8), (16, 8)])
    remote = descs([(1000, 8), (1016, 8), (1032, 8)])  # head slices: stride 16, length 8
    ml, mr = merge_contiguous(local, remote)
    assert ml.tolist() == local.tolist() and mr.tolist() == remote.tolist()
    # ... but that is one strided row: local stride 8 (contiguous), remote stride 16
    sl, sr = merge_strided(local, remote)
    assert sl.tolist() == [[0, 8, 0, 8, 3]]
    assert sr.tolist() == [[1000, 8, 0, 16, 3]]
    np.testing.assert_array_equal(expand(sl), local)
    np.testing.assert_array_equal(expand(sr), remote)


def test_runs_never_span_devices():
    local = np.array([[0, 8, 0], [8, 8, 1]], dtype=np.uint64)
    remote = np.array([[0, 8, 0], [8, 8, 0]], dtype=np.uint64)
    assert merge_contiguous(local, remote)[0].shape[0] == 2
    assert merge_strided(local, remote)[0].shape[0] == 2


def test_runs_never_span_registered_regions():
    # two cache tensors back to back in memory: contiguous, but two registrations on each side
    local = descs([(0, 8), (8, 8), (16, 8), (24, 8)])
    remote = descs([(100, 8), (108, 8), (116, 8), (124, 8)])
    regions = (region_index([0, 16], local[:, 0]), region_index([100, 116], remote[:, 0]))
    assert regions[0].tolist() == [1, 1, 2, 2] and regions[1].tolist() == [1, 1, 2, 2]
    assert merge_contiguous(local, remote)[0].tolist() == [[0, 32, 0]]
    ml, mr = merge_contiguous(local, remote, regions)
    assert ml.tolist() == [[0, 16, 0], [16, 16, 0]]
    # and no strided row joins the two halves either
    sl, _ = merge_strided(local, remote, regions)
    assert sl[:, 4].tolist() == [1, 1]


def test_strided_keeps_contiguous_runs_and_joins_equal_strides():
    # three logical blocks of 2 contiguous kernel blocks each, placed 100 B apart on both sides
    local = descs([(0, 10), (10, 10), (100, 10), (110, 10), (200, 10), (210, 10)])
    remote = descs([(5000, 10), (5010, 10), (7000, 10), (7010, 10), (9000, 10), (9010, 10)])
    assert merge_contiguous(local, remote)[0].shape[0] == 3
    sl, sr = merge_strided(local, remote)
    assert sl.tolist() == [[0, 20, 0, 100, 3]]
    assert sr.tolist() == [[5000, 20, 0, 2000, 3]]


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="pair 1"):
        merge_contiguous(descs([(0, 8), (8, 8)]), descs([(0, 8), (8, 4)]))
    with pytest.raises(ValueError, match="unknown descriptor_merge"):
        merge_descriptors(descs([(0, 8)]), descs([(0, 8)]), "diagonal")


def test_strided_array_checks():
    with pytest.raises(TransportError, match=r"\(N, 5\)"):
        check_strided_array(np.zeros((2, 3), np.uint64))
    with pytest.raises(TransportError, match="overlap"):
        check_strided_array(np.array([[0, 8, 0, 4, 2]], np.uint64))
    with pytest.raises(TransportError, match="count 0"):
        check_strided_array(np.array([[0, 8, 0, 8, 0]], np.uint64))
    rows = np.array([[0, 4, 0, 10, 3], [100, 2, 1, 2, 1]], np.uint64)
    assert expand_strided(rows).tolist() == [[0, 4, 0], [10, 4, 0], [20, 4, 0], [100, 2, 1]]


# hypothesis: descriptors on a small grid so that contiguity, equal strides and overlaps all occur
_desc = st.tuples(st.integers(0, 24), st.integers(0, 24), st.integers(1, 4), st.integers(0, 1))


@st.composite
def _plans(draw):
    items = draw(st.lists(_desc, min_size=0, max_size=40))
    local = np.array([(4 * a, n, d) for a, _, n, d in items], dtype=np.uint64).reshape(-1, 3)
    remote = np.array([(1000 + 4 * b, n, 0) for _, b, n, _ in items],
                      dtype=np.uint64).reshape(-1, 3)
    return local, remote


@settings(max_examples=300, deadline=None)
@given(_plans(), st.sampled_from(["contiguous", "strided"]), st.booleans())
def test_merging_preserves_exactly_the_byte_pairs(plan, mode, with_regions):
    local, remote = plan
    # registered regions of 32 bytes on each side (no original descriptor crosses one)
    regions = ((region_index(np.arange(0, 128, 32), local[:, 0]),
                region_index(np.arange(1000, 1128, 32), remote[:, 0]))
               if with_regions else None)
    merged = merge_descriptors(local, remote, mode, regions)
    np.testing.assert_array_equal(byte_pairs(merged.local, merged.remote),
                                  byte_pairs(local, remote))
    assert merged.rows <= local.shape[0]
    assert merged.nbytes == int(local[:, 1].sum())
    if mode == "strided":  # strided rows are never more than the contiguous merge's
        contiguous = merge_contiguous(local, remote, regions)[0].shape[0]
        assert merged.rows <= contiguous and merged.runs == contiguous
    if with_regions:  # every merged run, and every strided row, stays inside one region
        for rows, base in ((merged.local, 0), (merged.remote, 1000)):
            r = rows.astype(np.int64)
            first = r[:, 0] - base
            span = (r[:, 4] - 1) * r[:, 3] + r[:, 1] if merged.strided else r[:, 1]
            assert ((first // 32) == ((first + span - 1) // 32)).all()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=2, max_size=30, unique=True))
def test_nothing_contiguous_means_nothing_merged(starts):
    # runs of 4 bytes at multiples of 8: never contiguous on the local side
    local = descs([(8 * a, 4) for a in starts])
    remote = descs([(4 * i, 4) for i in range(len(starts))])  # always contiguous remotely
    assert merge_contiguous(local, remote)[0].shape[0] == len(starts)


# ---- through the cluster: byte-exact, fewer descriptors ----------------------------------------
def _scenario(*, model: str, p_tp: int, d_tp: int, mode: str = "pull", merge: str,
              prompts: str = "[777, 64, 1501]", extra: str = "", workload: str = "",
              requests: int = 3) -> str:
    return f"""
[scenario]
name = "merge {model} P{p_tp} D{d_tp} {mode} {merge}"
seed = 4
[model]
preset = "{model}"
[prefill]
tp = {p_tp}
{extra}
[decode]
tp = {d_tp}
[connector]
mode = "{mode}"
registration_order = "state-first"
descriptor_merge = "{merge}"
[workload]
requests = {requests}
prompt_tokens = {prompts}
{workload}
"""


def _run(text: str):
    (s,) = parse_scenarios(text)
    result = run_scenario(s)
    assert result.outcome == "ok", (result.handshake_errors,
                                    [(r.failure_class, r.reason, r.mismatches[:2])
                                     for r in result.records])
    assert result.mismatched_bytes == 0
    assert all(r.status == "ok" and r.mismatched_words == 0 for r in result.records)
    reference = sum(r.descriptors for r in result.records)
    posted = sum(t["descriptors"] for r in result.records for t in r.telemetry)
    nbytes = sum(r.nbytes for r in result.records)
    return reference, posted, nbytes


CONTIGUOUS_CASES = [
    # (model, P TP, D TP, mode): hybrid MLA+KDA (equal and heterogeneous TP, both directions),
    # hybrid GQA+GDN, pure MLA, dense GQA; pull and push
    ("tiny-kimi-linear", 1, 1, "pull"),
    ("tiny-kimi-linear", 2, 4, "pull"),
    ("tiny-kimi-linear", 4, 1, "pull"),
    ("tiny-kimi-linear", 1, 4, "push"),
    ("tiny-kimi-linear", 4, 2, "push"),
    ("tiny-qwen3-next", 1, 1, "pull"),
    ("tiny-deepseek", 1, 2, "pull"),
    ("tiny-llama", 2, 2, "push"),
]


@pytest.mark.parametrize("model,p_tp,d_tp,mode", CONTIGUOUS_CASES,
                         ids=[f"{m}-P{p}-D{d}-{o}" for m, p, d, o in CONTIGUOUS_CASES])
@pytest.mark.parametrize("merge", ["contiguous", "strided"])
def test_merged_runs_are_byte_exact_with_fewer_descriptors(model, p_tp, d_tp, mode, merge):
    ref_plan, ref_posted, ref_bytes = _run(_scenario(model=model, p_tp=p_tp, d_tp=d_tp,
                                                     mode=mode, merge="off"))
    plan, posted, nbytes = _run(_scenario(model=model, p_tp=p_tp, d_tp=d_tp, mode=mode,
                                          merge=merge))
    assert ref_posted == ref_plan  # off: every per-block descriptor is posted
    assert plan == ref_plan and nbytes == ref_bytes  # the same per-block plan, the same bytes
    assert posted < ref_posted  # adjacent kernel blocks are contiguous on both sides


def test_prefix_hit_and_block_size_ratio_are_byte_exact_merged():
    prefix = dict(model="tiny-kimi-linear", p_tp=2, d_tp=2, prompts="[677, 677, 641]",
                  extra="prefix_caching = true",
                  workload="prefix_hit_tokens = [0, 320, 640]")
    text = _scenario(merge="contiguous", **prefix).replace(
        "[decode]\n", "[decode]\nprefix_caching = true\n")
    ref = _run(_scenario(merge="off", **prefix).replace(
        "[decode]\n", "[decode]\nprefix_caching = true\n"))
    got = _run(text)
    assert got[0] == ref[0] and got[2] == ref[2] and got[1] < ref[1]
    bsr = _scenario(model="tiny-llama", p_tp=1, d_tp=2, merge="strided",
                    extra="block_size = 16").replace("[decode]\n", "[decode]\nblock_size = 64\n")
    _run(bsr)


def test_merged_descriptors_stay_inside_one_cache_tensor():
    # pure MLA, one tensor per layer, allocated back to back; one request sized to fill every
    # tensor, so the last block of a tensor touches the first block of the next on both sides:
    # a contiguous plan still posts one descriptor per region (tensor), never one spanning two
    # registrations
    for merge in ("contiguous", "strided"):
        text = _scenario(model="tiny-deepseek", p_tp=1, d_tp=1, merge=merge, requests=1,
                         prompts="1501")
        (s,) = parse_scenarios(text)
        result = run_scenario(s)
        assert result.outcome == "ok" and result.mismatched_bytes == 0
        (rec,) = result.records
        assert [t["descriptors"] for t in rec.telemetry] == [len(result.layouts["decode"].regions)]


def test_nothing_contiguous_posts_as_many_descriptors():
    # dense GQA, P TP1 -> D TP2: every decode rank reads its head slice of each prefill block
    # (remote stride = the prefill block, length = half of it) and each request fits in one
    # block per layer, so no two descriptors of a READ are contiguous on both sides...
    case = dict(model="tiny-llama", p_tp=1, d_tp=2, prompts="[9, 12, 15]")
    ref_plan, ref_posted, _ = _run(_scenario(merge="off", **case))
    _, posted, _ = _run(_scenario(merge="contiguous", **case))
    assert posted == ref_posted == ref_plan
    # ... while a longer prompt's consecutive slices are one strided row per layer
    case["prompts"] = "[500, 500, 500]"
    ref_plan, _, _ = _run(_scenario(merge="off", **case))
    _, contiguous, _ = _run(_scenario(merge="contiguous", **case))
    _, strided, _ = _run(_scenario(merge="strided", **case))
    assert contiguous == ref_plan
    assert strided < contiguous


def test_head_slices_merge_only_strided():
    # hybrid GQA+GDN, P TP2 -> D TP1: decode lands each prefill rank's head in a slice of its
    # own blocks (local stride = the block, length = half of it) and its state chunk in a slice
    # of each sub-region: contiguous merging finds nothing, strided rows do
    case = dict(model="tiny-qwen3-next", p_tp=2, d_tp=1)
    ref_plan, ref_posted, ref_bytes = _run(_scenario(merge="off", **case))
    assert _run(_scenario(merge="contiguous", **case)) == (ref_plan, ref_posted, ref_bytes)
    plan, strided, nbytes = _run(_scenario(merge="strided", **case))
    assert (plan, nbytes) == (ref_plan, ref_bytes) and strided < ref_posted


@pytest.mark.parametrize("mode", ["contiguous", "strided"])
def test_merging_refuses_pairs_of_different_lengths(mode: str) -> None:
    """A pair whose two sides differ in length cannot move byte for byte: merging refuses it,
    naming the pair, instead of joining it into a run."""
    local = np.array([[0, 4096, 0], [4096, 4096, 0], [8192, 4096, 0]], dtype=np.uint64)
    remote = local.copy()
    remote[:, 0] += 1 << 30
    remote[1, 1] = 2048
    with pytest.raises(ValueError, match="descriptor pair 1 has local length 4096 but remote "
                                         "length 2048"):
        merge_descriptors(local, remote, mode)
