"""Consecutive block ids known without reading them (issue #14, planning round 5).

The connector knows when a request's attention blocks expand to consecutive ids (fresh
blocks: logical ids ``b, b + 1, ...``; ``expand_logical_range``) and says so with the
OuterIds it posts (``OuterIds.ranges``). The transport's structural checks (outer_pairs) and
the merge templates then skip reading those columns. Every answer must be the one the
columns themselves give: the flag must be exact, and a hinted transfer must get the same
bytes, coalesced count and rows as the same ids without the hint (and as the full path)."""

from __future__ import annotations

import numpy as np
import pytest

from hkvsim.connector.blocks import expand_logical, expand_logical_range
from hkvsim.connector.templates import PlanTemplates
from hkvsim.transport.base import TransportError
from hkvsim.transport.outer import OuterIds, outer_pairs

from .test_merge_templates import _case, _check, _reference


def _consecutive(v: np.ndarray) -> bool:
    return bool(v.size) and bool((np.diff(v) == 1).all())


def test_the_range_flag_is_exact() -> None:
    """True exactly when the expansion is consecutive ids (for up to 64 logical ids; longer
    lists are not checked and say False), and the ids are expand_logical's either way."""
    rng = np.random.default_rng(5)
    cases = [np.arange(3, 9), np.array([4]), np.array([2, 3, 5]), np.array([3, 2, 1]),
             np.array([7, 7]), np.array([-2, -1, 0]), np.arange(64), np.arange(65),
             np.array([], dtype=np.int64), np.array([0, 1, 2, 1, 2, 3]),
             np.arange(5, dtype=np.int32), [1, 2, 3]]
    cases += [np.sort(rng.choice(40, size=int(rng.integers(1, 9)), replace=False))
              for _ in range(200)]
    seen = {True: 0, False: 0}
    for ids in cases:
        for ppl in (1, 2, 30):
            got, known = expand_logical_range(ids, ppl)
            arr = np.asarray(ids, dtype=np.int64)
            ref = (arr[:, None] * ppl + np.arange(ppl)[None, :]).reshape(-1)
            assert got.dtype == np.int64 and np.array_equal(got, ref), (ids, ppl)
            assert np.array_equal(expand_logical(ids, ppl), ref)
            expect = 0 < arr.size <= 64 and _consecutive(arr)
            assert known == expect, (ids, ppl)
            seen[known] += 1
            if known:
                assert np.array_equal(got, np.arange(got[0], got[0] + got.size))
            assert got is not ids  # always a new array (the caller keeps it)
    assert seen[True] > 50 and seen[False] > 50, seen


def _hinted(ids: OuterIds, known: bool) -> OuterIds:
    """The same ids (new column arrays: nothing is answered from memory by identity), with
    the attention part's range flag as given."""
    parts = [(s, c.copy()) for s, c in ids.parts]
    return OuterIds.of_arrays(parts, frozen=True, ranges=[known] + [False] * (len(parts) - 1))


@pytest.mark.parametrize("mode", ["contiguous", "strided"])
def test_hinted_ids_answer_as_their_columns(mode: str) -> None:
    """Random geometries (those of test_merge_templates), consecutive attention columns of
    several lengths and shifts: outer_pairs' bytes and coalesced count, and the templates'
    rows, are the same with the hint as without, and the templates' equal the full path's."""
    compared = templated = 0
    for seed in range(300):
        rng, local, remote, lreg, rreg, n_attn, n_state = _case(seed)
        lfirst, rfirst = local.first, remote.first
        lstarts, lstate = lfirst[:n_attn].copy(), lfirst[n_attn:n_attn + 2 * n_state].copy()
        rstarts, rstate = rfirst[:n_attn].copy(), rfirst[n_attn:n_attn + 2 * n_state].copy()
        hinted_templates = PlanTemplates(sightings=1)
        plain_templates = PlanTemplates(sightings=1)
        for _ in range(6):
            k = int(rng.integers(1, 30))  # more than 16 columns takes the array path
            la = np.arange(k, dtype=np.int64) + int(rng.integers(-1, 20))
            ra = np.arange(k, dtype=np.int64) + int(rng.integers(-1, 20))
            slots = int(rng.integers(1, 3))
            ls = np.arange(slots, dtype=np.int64) + int(rng.integers(0, 4))
            rs = np.arange(slots, dtype=np.int64) + int(rng.integers(0, 4))
            lo = OuterIds.of_arrays([(lstarts, la), (lstate, ls)], frozen=True)
            ro = OuterIds.of_arrays([(rstarts, ra), (rstate, rs)], frozen=True)
            plain = outer_pairs(local, lo, remote, ro, {})
            lh, rh = _hinted(lo, True), _hinted(ro, True)
            hinted = outer_pairs(local, lh, remote, rh, {})
            assert (plain is None) == (hinted is None)
            if plain is not None:
                compared += 1
                assert (hinted.nbytes, hinted.coalesced) == (plain.nbytes, plain.coalesced)
            got = hinted_templates.plan(local, lh, remote, rh, mode, lreg, rreg)
            ref_got = plain_templates.plan(local, _hinted(lo, False), remote,
                                           _hinted(ro, False), mode, lreg, rreg)
            assert (got is None) == (ref_got is None)
            if got is None:
                continue
            try:
                ref = _reference(local, lo, remote, ro, mode, lreg, rreg)
            except TransportError:  # a template answers only ids the full path accepts
                raise AssertionError("a template answered ids the full path refuses")
            _check(got, ref)
            assert np.array_equal(got[0].rows, ref_got[0].rows)
            assert np.array_equal(got[1].rows, ref_got[1].rows)
            templated += 1
    assert compared > 300 and templated > 300, (compared, templated)


def test_only_frozen_ids_carry_the_hint() -> None:
    """A hint on ids the caller may modify is dropped (the promise needs frozen columns)."""
    starts, cols = np.array([0, 100], dtype=np.int64), np.arange(5, dtype=np.int64)
    assert OuterIds.of_arrays([(starts, cols)], ranges=[True]).ranges is None
    assert OuterIds.of_arrays([(starts, cols)], frozen=True, ranges=[True]).ranges == (True,)
    # parts with no id are dropped together with their flag
    empty = np.zeros(0, dtype=np.int64)
    got = OuterIds.of_arrays([(starts, empty), (starts, cols)], frozen=True,
                             ranges=[False, True])
    assert got.ranges == (True,) and len(got.parts) == 1
