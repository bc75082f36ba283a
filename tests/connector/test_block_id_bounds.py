"""Block ids outside their engine's logical blocks are refused by name, before any descriptor is
made (ConnectorWorker._pair_blocks): an id past the end would otherwise address a block of the
next cache region -- another layer's bytes -- which a range check over the whole prepared list
notices only when it runs off the list's end. Both public calls, both sides, attention and
state."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from benchmarks.test_planning_public import PublicPlan

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module", params=["read", "write"])
def plan(request: pytest.FixtureRequest) -> PublicPlan:
    return PublicPlan(2_000, "off", op=request.param)


def _with(plan: PublicPlan, side: str, kind: str, value: int) -> object:
    """The plan's request with the last id of its first ``kind`` group on ``side`` replaced."""
    req = plan.request
    layout = plan.decode.layout
    group = next(g.group_id for g in layout.groups if g.kind == kind)
    blocks = dict(req.prefill_blocks if side == "prefill" else (
        req.decode_blocks if plan.op == "read" else req.registration.blocks))
    ids = blocks[group].copy()
    ids[-1] = value
    blocks[group] = ids
    if side == "prefill":
        return dataclasses.replace(req, prefill_blocks=blocks)
    if plan.op == "read":
        return dataclasses.replace(req, decode_blocks=blocks)
    return dataclasses.replace(req, registration=dataclasses.replace(req.registration,
                                                                     blocks=blocks))


@pytest.mark.parametrize("side", ["decode", "prefill"])
@pytest.mark.parametrize("kind", ["attention", "state"])
def test_a_block_id_outside_the_engine_is_refused_by_name(plan: PublicPlan, side: str,
                                                          kind: str) -> None:
    worker = plan.decode  # the worker that posts (prefill's when op = write)
    limit = worker.layout.num_logical_blocks  # both engines are alike here
    start = worker.start_write if plan.op == "write" else worker.start_read
    group = next(g.group_id for g in worker.layout.groups if g.kind == kind)
    for value in (limit, -1, limit + 10 ** 6):
        outcome = start(_with(plan, side, kind, value))
        assert outcome is not None and not outcome.ok, (side, kind, value)
        assert outcome.failure_class == "transfer_setup_failed"
        assert outcome.reason.startswith(f"{side} block id {value} (group {group}, position ")
        assert f"allowed: 0 to {limit - 1}" in outcome.reason
        assert outcome.transfers == 0 and worker.transport.open_handles() == 0
    # the last block is a block: that request moves
    original = plan.request
    plan.request = _with(plan, side, kind, limit - 1)
    try:
        _, descriptors = plan.once()
        assert descriptors > 0
    finally:
        plan.request = original


@pytest.mark.parametrize("ppl", [1, 30])
@pytest.mark.parametrize("side", ["decode", "prefill"])
def test_a_run_of_consecutive_ids_past_the_end_is_refused(plan: PublicPlan, side: str,
                                                          ppl: int) -> None:
    """Consecutive ids are checked by their first and last expanded id: the run [L-2, L-1, L]
    (L = the logical block count) still fails, whatever the blocks' ppl."""
    from hkvsim.connector.blocks import PairingError

    worker = plan.decode
    limit = worker.layout.num_logical_blocks
    group = next(g.group_id for g in worker.layout.groups if g.kind == "attention")
    good = {group: np.arange(limit - 3, limit)}
    bad = {group: np.arange(limit - 2, limit + 1)}
    pair = dict(hit_blocks=0, ppl_p=ppl, ppl_d=ppl, bsr=1, remote_blocks=limit)
    worker._pair_blocks(prefill_blocks=good, decode_blocks=good, **pair)
    with pytest.raises(PairingError, match=f"^{side} block id {limit} "):
        worker._pair_blocks(prefill_blocks=bad if side == "prefill" else good,
                            decode_blocks=bad if side == "decode" else good, **pair)
