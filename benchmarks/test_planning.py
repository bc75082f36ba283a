"""Descriptor planning throughput (issue #7): the pure functions that turn a request's block ids
into paired descriptor ids, timed at the size of vLLM issue #55434 (~112K descriptors per
rank-transfer) and at smaller sizes to show how the cost grows.

The 112K case is Kimi-Linear-48B at 1,025,280 tokens (Kimi-Linear's 1M context), prefill TP1 ->
decode TP1: 534 logical blocks x ppl 30 = 16,020 kernel blocks x 7 MLA regions = 112,140
attention descriptors + 84 state descriptors = 112,224. Target: >= 10 million descriptors/s for
the per-request plan (expand_logical, pair_attention, attention_ids, state_ids).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from hkvsim.connector.blocks import expand_logical, pair_attention, pair_state_slots
from hkvsim.connector.descriptors import local_descriptors, remote_descriptors
from hkvsim.connector.merge import merge_contiguous, merge_strided, region_index
from hkvsim.connector.metadata import rank_metadata
from hkvsim.connector.tp import source_plan
from hkvsim.geometry.layout import build_layout
from hkvsim.geometry.presets import preset

TARGET = 10e6  # descriptors per second
KIMI = preset("kimi-linear-48b")


def _side(tp: int, logical: int, base: int, engine: str) -> tuple[Any, Any, list[int]]:
    lay = build_layout(KIMI, tp=tp, block_size=64, num_blocks=logical,
                       registration_order="state-first")
    meta = rank_metadata(layout=lay, engine_id=engine, tp_rank=0, agent_name=f"{engine}.0",
                         agent_metadata=b"", base_addr=base)
    state = set(KIMI.state_layers)
    regions = [i for i, r in enumerate(lay.regions) if state & set(r.layers)]
    return lay, meta, regions


class Plan:
    """Everything one decode rank needs to plan a pull of ``tokens`` tokens."""

    def __init__(self, tokens: int, p_tp: int = 1, d_tp: int = 1) -> None:
        probe_p = build_layout(KIMI, tp=p_tp, block_size=64, num_blocks=1)
        probe_d = build_layout(KIMI, tp=d_tp, block_size=64, num_blocks=1)
        n_p = probe_p.blocks_for_tokens(tokens - 1)
        n_d = probe_d.blocks_for_tokens(tokens - 1)
        self.p_lay, self.p_meta, _ = _side(p_tp, n_p + 8, 1 << 44, "prefill")
        self.d_lay, self.d_meta, self.regions = _side(d_tp, n_d + 8, 2 << 44, "decode")
        self.plan = source_plan(KIMI, local_tp=d_tp, remote_tp=p_tp, tp_rank=0)
        self.local = local_descriptors(self.d_meta, self.regions)
        self.remote = remote_descriptors(self.p_meta, self.d_meta, self.regions, self.plan, bsr=1)
        # the request's blocks: consecutive logical ids from 1, one state slot per state group
        self.groups = []
        for group in self.d_lay.groups:
            if group.kind == "attention":
                self.groups.append(("attention", np.arange(1, n_d + 1), np.arange(1, n_p + 1)))
            else:
                self.groups.append(("state", np.array([n_d + 1 + group.group_id]),
                                    np.array([n_p + 1 + group.group_id])))
        self.ppl_d = self.d_lay.physical_blocks_per_logical
        self.ppl_p = self.p_lay.physical_blocks_per_logical

    def ids(self) -> tuple[np.ndarray, np.ndarray]:
        """The worker's per-request planning (connector/worker.py _pair_blocks + _post_reads)."""
        la, ra, ls, rs = [], [], [], []
        for kind, d_ids, p_ids in self.groups:
            if kind == "attention":
                pairing = pair_attention(
                    decode_ids=expand_logical(d_ids, self.ppl_d),
                    prefill_ids=expand_logical(p_ids, self.ppl_p), decode_hit_units=0,
                    heterogeneous_ppl=self.ppl_d != self.ppl_p, ppl_decode=self.ppl_d,
                    ppl_prefill=self.ppl_p)
                la.append(pairing.local)
                ra.append(pairing.remote)
            else:
                d, p = pair_state_slots(d_ids, p_ids)
                ls.append(d)
                rs.append(p)
        la_, ra_, ls_, rs_ = (np.concatenate(x) for x in (la, ra, ls, rs))
        local_ids = np.concatenate([self.local.attention_ids(la_), self.local.state_ids(ls_)])
        remote_ids = np.concatenate([self.remote.attention_ids(ra_),
                                     self.remote.state_ids(rs_)])
        return local_ids, remote_ids

    def plan_with_bytes(self) -> int:
        local_ids, remote_ids = self.ids()
        return int(self.local.affine.lengths(local_ids).sum())


def _best(fn: Callable[[], Any], *, min_seconds: float = 0.3, rounds: int = 5) -> float:
    """Best time of ``rounds`` batches, each repeated until it lasts ``min_seconds``."""
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 >= min_seconds / rounds or n > 1 << 16:
            break
        n *= 2
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


@pytest.fixture(scope="module")
def plan_112k() -> Plan:
    plan = Plan(1_025_281)  # N - 1 = 1,025,280 tokens = 534 logical blocks at TP1
    local_ids, _ = plan.ids()
    assert local_ids.size == 112_224
    return plan


def test_plan_112k_descriptors(benchmark, figures, plan_112k: Plan) -> None:
    local_ids, remote_ids = benchmark(plan_112k.ids)
    n = local_ids.size
    assert remote_ids.size == n
    rate = n / _best(plan_112k.ids)
    figures.add("planning: per-request ids, 112,224 descriptors", rate / 1e6, "M desc/s",
                target=">= 10", met=rate >= TARGET)
    benchmark.extra_info["descriptors_per_second"] = rate
    if figures.enabled:
        assert rate >= TARGET


@pytest.mark.parametrize("fn", ["expand_logical", "pair_attention", "attention_ids",
                                "state_ids", "gather_bytes"])
def test_plan_112k_parts(benchmark, figures, plan_112k: Plan, fn: str) -> None:
    p = plan_112k
    kind, d_ids, p_ids = p.groups[0]
    d_kernel, p_kernel = expand_logical(d_ids, p.ppl_d), expand_logical(p_ids, p.ppl_p)
    local_ids, _ = p.ids()
    la = d_kernel
    slots = np.concatenate([d for k, d, _ in p.groups if k == "state"])
    calls: dict[str, tuple[Callable[[], Any], int]] = {
        # output sizes: 16,020 kernel ids; 16,020 pairs; 112,140 ids; 84 ids; 112,224 lengths
        "expand_logical": (lambda: expand_logical(d_ids, p.ppl_d), d_kernel.size),
        "pair_attention": (lambda: pair_attention(
            decode_ids=d_kernel, prefill_ids=p_kernel, decode_hit_units=0,
            heterogeneous_ppl=False, ppl_decode=p.ppl_d, ppl_prefill=p.ppl_p), d_kernel.size),
        "attention_ids": (lambda: p.local.attention_ids(la), la.size * 7),
        "state_ids": (lambda: p.local.state_ids(slots), 84),
        "gather_bytes": (lambda: int(p.local.affine.lengths(local_ids).sum()), local_ids.size),
    }
    call, n = calls[fn]
    benchmark(call)
    rate = n / _best(call)
    figures.add(f"planning: {fn} ({n:,} outputs)", rate / 1e6, "M/s")


@pytest.mark.parametrize("fn", ["local_descriptors", "remote_descriptors"])
def test_prepared_lists_112k(benchmark, figures, plan_112k: Plan, fn: str) -> None:
    """Registration-time lists (built once per engine / per remote rank): affine descriptions,
    O(regions), whatever num_blocks is."""
    p = plan_112k
    call = (lambda: local_descriptors(p.d_meta, p.regions)) if fn == "local_descriptors" else (
        lambda: remote_descriptors(p.p_meta, p.d_meta, p.regions, p.plan, bsr=1))
    n = len(call())
    benchmark(call)
    rate = n / _best(call, rounds=3)
    figures.add(f"planning: {fn} ({n:,} descriptors)", rate / 1e6, "M desc/s")


@pytest.mark.parametrize("mode", ["contiguous", "strided"])
def test_merge_112k(benchmark, figures, plan_112k: Plan, mode: str) -> None:
    p = plan_112k
    local_ids, remote_ids = p.ids()
    ld, rd = p.local.affine.rows(local_ids), p.remote.affine.rows(remote_ids)
    fn = merge_contiguous if mode == "contiguous" else merge_strided

    def merge() -> tuple:  # as the worker does it: region keys from both sides' bases
        regions = (region_index(p.d_meta.base_addrs, ld[:, 0]),
                   region_index(p.p_meta.base_addrs, rd[:, 0]))
        return fn(ld, rd, regions)

    out = benchmark(merge)
    rate = ld.shape[0] / _best(merge)
    figures.add(f"merge: {mode}, 112,224 -> {out[0].shape[0]:,} rows", rate / 1e6, "M desc/s")


@pytest.mark.parametrize("tokens,d_tp", [(1_025, 1), (8_193, 1), (65_537, 1), (1_025_281, 1),
                                         (65_537, 2), (65_537, 4), (65_537, 8)])
def test_planning_scaling(benchmark, figures, tokens: int, d_tp: int) -> None:
    """Per-request planning vs prompt length (TP1) and vs decode TP (64k tokens, prefill TP1):
    linear in the descriptors planned plus a fixed per-call cost."""
    plan = Plan(tokens, p_tp=1, d_tp=d_tp)
    n = plan.ids()[0].size
    benchmark(plan.ids)
    t = _best(plan.ids)
    figures.add(f"planning scale: {tokens - 1:,} tokens, D TP{d_tp}: {n:,} desc in "
                f"{t * 1e6:,.0f} us", n / t / 1e6, "M desc/s")
