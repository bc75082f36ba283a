"""Merged plans from templates (hkvsim/connector/templates.py, issue #14): for every transfer
a template applies to, the rows must be exactly those of the full path -- check the flat ids,
collapse, merge (connector/merge.py) -- on random geometries and columns, including the
transfers that reuse a template with shifted columns; a template must refuse (None) what it
cannot settle. PlannedRows through pair_descriptors and the registration check must answer
as plain rows do."""

from __future__ import annotations

import numpy as np
import pytest

from hkvsim.connector.merge import collapsed_pairs, expand, merge_descriptors
from hkvsim.connector.templates import PlanTemplates
from hkvsim.transport import base as tbase
from hkvsim.transport.affine import AffineList
from hkvsim.transport.base import TransportError, check_pairs, pair_descriptors, \
    registration_problem
from hkvsim.transport.outer import OuterIds
from hkvsim.transport.planned import PlannedRows, runs_hull

KIB = 1024


def _geometry(rng: np.random.Generator, base: int, *, lens: list[int], state_lens: list[int],
              spaced: list[int], page: int, gap: int) -> tuple[AffineList, list[int]]:
    """Attention segments (one per region; stride = length x spaced[r]) then state pages of
    len(state_lens) sub-regions (one segment each, stride ``page``). Returns the list and one
    region base per attention segment and per state page."""
    counts, bases, strides, lengths, regions = [], [], [], [], []
    at = base
    for r, (n, s) in enumerate(zip(lens, spaced)):
        counts.append(40)
        bases.append(at)
        strides.append(n * s)
        lengths.append(n)
        regions.append(at)
        at += 40 * n * s + gap
    for _ in range(2):  # two state regions, each a page per slot
        regions.append(at)
        off = 0
        for size in state_lens:
            counts.append(6)
            bases.append(at + off)
            strides.append(page)
            lengths.append(size)
            off += size
        at += 6 * page + gap
    return AffineList(counts=counts, base=bases, stride=strides, length=lengths,
                      device=int(rng.integers(0, 2))), regions


def _pattern(rng: np.random.Generator, n: int, kind: str) -> np.ndarray:
    """Columns relative to the first: consecutive, runs with gaps, steps back, repeats."""
    if kind == "consecutive":
        return np.arange(n, dtype=np.int64)
    out = [0]
    while len(out) < n:
        step = int(rng.choice([1, 1, 1, 2, 3, -1, 0, 5])) if kind == "mixed" else (
            1 if rng.random() < 0.7 else int(rng.integers(2, 5)))
        out.append(out[-1] + step)
    return np.array(out, dtype=np.int64)


def _reference(local: AffineList, lo: OuterIds, remote: AffineList, ro: OuterIds, mode: str,
               lbases: list[int], rbases: list[int]):
    """The full path (ConnectorWorker._make_xfer without templates)."""
    pairs = check_pairs(local, lo, remote, ro, what="t")
    lrows, rrows, regions = collapsed_pairs(pairs, lbases, rbases)
    return merge_descriptors(lrows, rrows, mode, regions)


def _case(seed: int):
    rng = np.random.default_rng(seed)
    n_attn = int(rng.integers(1, 4))
    lens = [int(rng.choice([256, 512])) for _ in range(n_attn)]
    state_lens = [int(v) for v in rng.choice([64, 128, 1024], size=int(rng.integers(1, 4)))]
    page = sum(state_lens) + int(rng.choice([0, 64]))
    gap_l, gap_r = (int(v) for v in rng.choice([0, 0, 4096], size=2))
    spaced_l = [int(v) for v in rng.choice([1, 1, 2], size=n_attn)]
    spaced_r = [int(v) for v in rng.choice([1, 1, 3], size=n_attn)]
    local, lreg = _geometry(rng, 1 << 32, lens=lens, state_lens=state_lens, spaced=spaced_l,
                            page=page, gap=gap_l)
    remote, rreg = _geometry(rng, 1 << 40, lens=lens, state_lens=state_lens, spaced=spaced_r,
                             page=page, gap=gap_r)
    # registered regions: one per segment group, sometimes two groups sharing one region
    # (rows of one region with other strides), sometimes a base inside a segment
    if rng.random() < 0.3 and len(lreg) > 1:
        lreg = lreg[:1] + lreg[2:]
    if rng.random() < 0.15:
        lreg = lreg + [lreg[0] + 7 * lens[0]]
    if rng.random() < 0.2 and len(rreg) > 1:
        rreg = rreg[1:]
    return rng, local, remote, lreg, rreg, n_attn, len(state_lens)


_STARTS: dict[int, tuple[AffineList, np.ndarray, np.ndarray]] = {}


def _ids(dl: AffineList, n_attn: int, n_state: int, attn: np.ndarray, slots: np.ndarray
         ) -> OuterIds:
    """Row starts are the same objects for every transfer over ``dl`` (as the connector's:
    geometry and templates are kept per list and row starts)."""
    got = _STARTS.get(id(dl))
    if got is None or got[0] is not dl:
        got = _STARTS[id(dl)] = (dl, dl.first[:n_attn].copy(),
                                 dl.first[n_attn:n_attn + 2 * n_state].copy())
    return OuterIds([(got[1], attn), (got[2], slots)], frozen=True)


def _coalesced_reference(local: np.ndarray, remote: np.ndarray) -> int:
    """NIXL's coalescing walked in plain Python (pairs continuing the previous on both sides,
    same device)."""
    n = len(local)
    for i in range(1, len(local)):
        if all(int(s[i, 0]) == int(s[i - 1, 0]) + int(s[i - 1, 1]) and s[i, 2] == s[i - 1, 2]
               for s in (local, remote)):
            n -= 1
    return n


def _check(got, ref) -> None:
    lrows, rrows = got
    assert lrows.token is rrows.token
    assert np.array_equal(lrows.rows, ref.local) and np.array_equal(rrows.rows, ref.remote)
    assert lrows.rows.dtype == ref.local.dtype == np.uint64
    for side in (lrows, rrows):
        assert np.array_equal(side.runs, expand(side.rows))
        assert side.hull == runs_hull(side.runs)
    assert lrows.coalesced == _coalesced_reference(lrows.runs, rrows.runs)


@pytest.mark.parametrize("mode", ["contiguous", "strided"])
def test_templates_give_the_full_paths_rows(mode: str) -> None:
    """400 random geometries x 4 column shifts of one pattern each (the shifts reuse the
    template): every answer equals the full path's rows; a template refuses ids outside
    their segment and the full path refuses them too."""
    used = refused = out_of_range = reused = 0
    tokens: set = set()
    for seed in range(400):
        rng, local, remote, lreg, rreg, n_attn, n_state = _case(seed)
        templates = PlanTemplates(sightings=1)
        n = int(rng.integers(1, 12))
        kind = str(rng.choice(["consecutive", "runs", "mixed"]))
        pa, pr = _pattern(rng, n, kind), _pattern(rng, n, kind)
        if rng.random() < 0.5:
            pr = pa.copy()
        k = int(rng.integers(1, 4))
        sa, sr = _pattern(rng, k, "runs"), _pattern(rng, k, kind)
        for _ in range(4):
            la = pa + int(rng.integers(-1, 20))
            ra = pr + int(rng.integers(-1, 20))
            ls = sa + int(rng.integers(-1, 4))
            rs = sr + int(rng.integers(-1, 4))
            lo = _ids(local, n_attn, n_state, la, ls)
            ro = _ids(remote, n_attn, n_state, ra, rs)
            got = templates.plan(local, lo, remote, ro, mode, lreg, rreg)
            try:
                ref = _reference(local, lo, remote, ro, mode, lreg, rreg)
            except TransportError:
                out_of_range += 1
                assert got is None
                continue
            if got is None:
                refused += 1
                continue
            used += 1
            reused += got[0].token in tokens
            tokens.add(got[0].token)
            _check(got, ref)
    # the cases exercise both answers (and the geometry conditions: see the planted-bug
    # notes in the report)
    assert used > 500 and reused > 250 and refused > 50 and out_of_range > 50, (
        used, reused, refused, out_of_range)


def test_template_refuses_geometries_it_cannot_settle() -> None:
    """Two rows of one registered region (on both sides) with different strides: their
    distance depends on the columns, so no template; in two regions on either side: a
    template. A registration boundary inside a segment: no template."""
    rng = np.random.default_rng(0)
    local, lreg = _geometry(rng, 1 << 32, lens=[256, 256], state_lens=[64], spaced=[1, 2],
                            page=64, gap=0)
    remote, rreg = _geometry(rng, 1 << 40, lens=[256, 256], state_lens=[64], spaced=[1, 2],
                             page=64, gap=0)
    cols = np.arange(3, dtype=np.int64)
    lo, ro = _ids(local, 2, 1, cols, cols[:1]), _ids(remote, 2, 1, cols, cols[:1])

    def plan1(lbases: list[int], rbases: list[int]):
        return PlanTemplates(sightings=1).plan(local, lo, remote, ro, "strided", lbases, rbases)

    assert plan1(lreg, rreg) is not None
    # both attention segments in one region on one side: merging never joins them
    shared_l, shared_r = lreg[:1] + lreg[2:], rreg[:1] + rreg[2:]
    assert plan1(shared_l, rreg) is not None
    # ... on both sides: it may, depending on the columns
    assert plan1(shared_l, shared_r) is None
    inside = lreg + [lreg[0] + 5 * 256]  # a registration boundary inside a segment
    assert plan1(inside, rreg) is None


def _planned(mode: str = "strided"):
    rng = np.random.default_rng(3)
    local, lreg = _geometry(rng, 1 << 32, lens=[256], state_lens=[64, 128], spaced=[1],
                            page=256, gap=0)
    remote, rreg = _geometry(rng, 1 << 40, lens=[256], state_lens=[64, 128], spaced=[3],
                             page=256, gap=0)
    cols = np.array([1, 2, 3, 7, 8, 9], dtype=np.int64)
    slots = np.array([0, 2], dtype=np.int64)
    templates = PlanTemplates(sightings=1)
    return lambda shift: templates.plan(local, _ids(local, 1, 2, cols + shift, slots),
                                        remote, _ids(remote, 1, 2, cols + shift, slots),
                                        mode, lreg, rreg)


def test_pair_descriptors_checks_a_template_in_full_once() -> None:
    """The first PlannedRows of a template are checked like plain rows (and their token
    marked); later ones of the token are taken with their expansion; rows whose given
    expansion or hull disagrees with their own are never marked."""
    plan = _planned()
    lrows, rrows = plan(0)
    token = lrows.token
    assert tbase._CHECKED_TOKENS.get(id(token)) is not token
    first = pair_descriptors(lrows, rrows, what="t")
    plain = pair_descriptors(lrows.rows, rrows.rows, what="t")
    assert np.array_equal(first.local, plain.local) and np.array_equal(first.remote, plain.remote)
    assert tbase._CHECKED_TOKENS.get(id(token)) is token
    l2, r2 = plan(5)
    again = pair_descriptors(l2, r2, what="t")
    assert again.local is l2.runs and again.remote is r2.runs
    assert np.array_equal(again.local, pair_descriptors(l2.rows, r2.rows, what="t").local)
    # the template's byte count is the runs' own (make_xfer takes it instead of summing)
    assert again_bytes(l2) == int(l2.runs[:, 1].sum())
    # a wrong expansion, a wrong hull, count or byte count: checked in full, not marked
    for bad in ("runs", "hull", "coalesced", "nbytes"):
        other = _planned()
        bl, br = other(0)
        if bad == "runs":
            bl.runs = bl.runs.copy()
            bl.runs[0, 0] += 1
        elif bad == "hull":
            bl.hull = (bl.hull[0], bl.hull[1] - 1, bl.hull[2])
        elif bad == "nbytes":
            bl.nbytes += 1
        else:
            bl.coalesced += 1
        got = pair_descriptors(bl, br, what="t")
        assert np.array_equal(got.local, expand(bl.rows))
        assert tbase._CHECKED_TOKENS.get(id(bl.token)) is not bl.token


def again_bytes(rows) -> int:
    """The byte count a transport takes for vouched-for runs (nbytes_of), asserted known."""
    from hkvsim.transport.planned import nbytes_of

    got = nbytes_of(rows.runs)
    assert got is not None and got == rows.nbytes
    return got


def test_pair_descriptors_refuses_bad_planned_rows_like_plain_rows() -> None:
    lrows, rrows = _planned()(0)
    lrows.rows = lrows.rows.copy()
    lrows.rows[0, 1] = 0  # a zero-length run (a fresh token: not checked yet)
    lrows.token = rrows.token = object()
    with pytest.raises(TransportError) as planned:
        pair_descriptors(lrows, rrows, what="t")
    with pytest.raises(TransportError) as plain:
        pair_descriptors(lrows.rows, rrows.rows, what="t")
    assert str(planned.value) == str(plain.value)


def test_registration_hull_answers_like_rows() -> None:
    """registration_problem with the hull fast path (and a hull handed by pair_descriptors)
    gives the per-row answer and message on random rows and ranges."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        n = int(rng.integers(1, 8))
        rows = np.zeros((n, 3), dtype=np.uint64)
        rows[:, 0] = rng.integers(0, 1 << 20, n)
        rows[:, 1] = rng.integers(0, 1 << 12, n)
        rows[:, 2] = rng.integers(0, 2, n) if rng.random() < 0.2 else 0
        if rng.random() < 0.05:
            rows[0, 0] = (1 << 64) - 8  # an end that wraps
            rows[0, 1] = 64
        k = int(rng.integers(1, 3))
        ranges = np.zeros((k, 3), dtype=np.uint64)
        ranges[:, 0] = rng.integers(0, 1 << 19, k)
        ranges[:, 1] = rng.integers(1, 1 << 21, k)
        ranges[:, 2] = rng.integers(0, 2, k)
        got = registration_problem(rows, ranges, whose="w")
        # the reference: each row inside some range, with plain Python ints
        inside = [any(int(a) <= int(r[0]) and int(r[0]) + int(r[1]) <= int(a) + int(m)
                      and int(r[2]) == int(d) for a, m, d in ranges) for r in rows]
        assert (got is None) == all(inside)
        if not all(inside):
            assert got.startswith(f"descriptor {inside.index(False)} ")


def test_worker_posts_template_rows_and_refuses_bad_ids(monkeypatch) -> None:
    """Through ConnectorWorker.start_read over the simulated transport: merged rows of
    fragmented requests (templates reused across shifted block ids) equal the full path's,
    and an id out of range still fails the request: by its block id, and (that check off)
    with the transport's full check's message."""
    import dataclasses

    from hkvsim.connector import worker as worker_module

    from benchmarks.test_planning_public import PublicPlan
    from hkvsim.transport.planned import PlannedRows as PR

    for mode in ("contiguous", "strided"):
        plan = PublicPlan(2_000, mode)
        worker = plan.decode
        posted: list[tuple[np.ndarray, np.ndarray]] = []
        real = worker.transport.make_xfer

        def spy(op, local, agent, remote, notif=b"", real=real):
            posted.append((np.asarray(local).copy(), np.asarray(remote).copy(),
                           type(local) is PR))
            return real(op, local, agent, remote, notif)

        worker.transport.make_xfer = spy
        n = next(iter(plan.request.decode_blocks.values())).size
        rng = np.random.default_rng(1)
        for shift in (0, 3, 3, 5):
            blocks = {g: (v if v.size == 1 else
                          np.concatenate([v[: n // 2], v[n // 2 + 2:] + 1]) + shift)
                      for g, v in plan.request.decode_blocks.items()}
            req = dataclasses.replace(plan.request, decode_blocks=blocks, prefill_blocks=blocks)
            first = worker._remotes["prefill0"][0]
            paired = worker._pair_blocks(prefill_blocks=blocks, decode_blocks=blocks,
                                         hit_blocks=0, ppl_p=first.meta.physical_blocks_per_logical,
                                         ppl_d=worker.layout.physical_blocks_per_logical, bsr=1)
            ll, _ = worker._local_list(1)
            lo = ll.outer_ids(paired.attention_decode, paired.state_decode)
            ro = first.remote_list.outer_ids(paired.attention_prefill, paired.state_prefill)
            ref = _reference(ll.affine, lo, first.remote_list.affine, ro, mode,
                             list(worker.metadata.base_addrs), list(first.meta.base_addrs))
            plan.request = req
            plan.once()
            local, remote, was_planned = posted[-1]
            assert was_planned == (shift != 0)  # a template from the second sighting on
            assert np.array_equal(local, ref.local) and np.array_equal(remote, ref.remote)
        del rng
        # a block id beyond the engine's blocks: refused by name before any descriptor
        huge = {g: v + 10 ** 6 for g, v in plan.request.decode_blocks.items()}
        outcome = worker.start_read(dataclasses.replace(plan.request, decode_blocks=huge))
        assert outcome is not None and not outcome.ok
        assert "decode block id 1000001 (group 0, position 0) is outside" in outcome.reason
        # and without that check, the transport's own: not a template's answer
        monkeypatch.setattr(worker_module, "_check_block_ids", lambda *args: None)
        outcome = worker.start_read(dataclasses.replace(plan.request, decode_blocks=huge))
        assert outcome is not None and not outcome.ok
        assert "descriptor id out of range" in outcome.reason
        monkeypatch.undo()


@pytest.mark.parametrize("pattern", [[0], [0, 1, 3]])
def test_rows_sharing_a_region_with_other_strides_merge_as_the_full_path(pattern: list[int]
                                                                         ) -> None:
    """Two attention rows in one region on both sides, strides 256 and 512: whether merging
    joins them depends on the first column (a strided run across both rows for some shifts
    only), so every shift must give the full path's rows."""
    rng = np.random.default_rng(0)
    local, lreg = _geometry(rng, 1 << 32, lens=[256, 256], state_lens=[64], spaced=[1, 2],
                            page=64, gap=0)
    remote, rreg = _geometry(rng, 1 << 40, lens=[256, 256], state_lens=[64], spaced=[1, 2],
                             page=64, gap=0)
    lreg, rreg = lreg[:1] + lreg[2:], rreg[:1] + rreg[2:]
    templates = PlanTemplates(sightings=1)
    checked = 0
    for c0 in list(range(0, 36)) + list(range(35, -1, -1)):
        cols = np.array(pattern, dtype=np.int64) + c0
        lo = _ids(local, 2, 1, cols, np.array([0], dtype=np.int64))
        ro = _ids(remote, 2, 1, cols, np.array([0], dtype=np.int64))
        ref = _reference(local, lo, remote, ro, "strided", lreg, rreg)
        got = templates.plan(local, lo, remote, ro, "strided", lreg, rreg)
        if got is not None:
            _check(got, ref)
        checked += 1
    assert checked == 72


def test_registration_hull_at_the_range_end() -> None:
    """A row ending exactly at the range's end is inside; one byte further is not."""
    ranges = np.array([[4096, 8192, 0]], dtype=np.uint64)
    rows = np.array([[4096, 100, 0], [12188, 100, 0]], dtype=np.uint64)
    assert registration_problem(rows, ranges, whose="w") is None
    rows[1, 1] = 101
    assert registration_problem(rows, ranges, whose="w").startswith("descriptor 1 ")
    rows[1, 1] = 100
    rows[0, 0] = 4095
    assert registration_problem(rows, ranges, whose="w").startswith("descriptor 0 ")


@pytest.mark.parametrize("mode", ["contiguous", "strided"])
def test_coalescing_across_parts_follows_the_shift(mode: str) -> None:
    """The last attention block and the first state slot are adjacent in memory (different
    registered regions: merging keeps them apart, NIXL's coalescing does not) only for some
    shifts of the columns: a template's coalesced count must follow every shift."""
    rng = np.random.default_rng(0)
    local, lreg = _geometry(rng, 1 << 32, lens=[256], state_lens=[64, 128], spaced=[1],
                            page=192, gap=0)
    remote, rreg = _geometry(rng, 1 << 40, lens=[256], state_lens=[64, 128], spaced=[1],
                             page=192, gap=0)
    templates = PlanTemplates(sightings=1)
    counts = set()
    for c0 in (37, 36, 35, 37, 30, 37):
        cols = np.array([0, 1, 2], dtype=np.int64) + c0
        slots = np.array([0], dtype=np.int64)
        lo, ro = _ids(local, 1, 2, cols, slots), _ids(remote, 1, 2, cols, slots)
        got = templates.plan(local, lo, remote, ro, mode, lreg, rreg)
        _check(got, _reference(local, lo, remote, ro, mode, lreg, rreg))
        counts.add(got[0].coalesced)
    assert len(counts) == 2  # adjacent (37) or not


def test_a_template_is_made_at_the_second_sighting() -> None:
    """By default a pattern seen once is merged by the caller (None); the second transfer
    with it makes the template, the third reuses it."""
    rng = np.random.default_rng(3)
    local, lreg = _geometry(rng, 1 << 32, lens=[256], state_lens=[64], spaced=[1], page=64,
                            gap=0)
    remote, rreg = _geometry(rng, 1 << 40, lens=[256], state_lens=[64], spaced=[2], page=64,
                             gap=0)
    templates = PlanTemplates()
    slots = np.array([1], dtype=np.int64)
    got = []
    for shift in (0, 4, 9):
        cols = np.array([0, 1, 4], dtype=np.int64) + shift
        lo, ro = _ids(local, 1, 1, cols, slots), _ids(remote, 1, 1, cols, slots)
        got.append(templates.plan(local, lo, remote, ro, "strided", lreg, rreg))
        if got[-1] is not None:
            _check(got[-1], _reference(local, lo, remote, ro, "strided", lreg, rreg))
    assert got[0] is None and got[1] is not None and got[2][0].token is got[1][0].token


def test_templates_stay_within_their_memory_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the bound every template is dropped (and made again when a pattern comes back);
    answers stay the full path's."""
    from hkvsim.connector import templates as module

    monkeypatch.setattr(module, "_MAX_BYTES", 16384)
    rng = np.random.default_rng(11)
    local, lreg = _geometry(rng, 1 << 32, lens=[256], state_lens=[64], spaced=[1], page=64,
                            gap=0)
    remote, rreg = _geometry(rng, 1 << 40, lens=[256], state_lens=[64], spaced=[3], page=64,
                             gap=0)
    templates = PlanTemplates(sightings=1)
    slots = np.array([2], dtype=np.int64)
    held, drops = 0, 0
    for _ in range(40):
        cols = _pattern(rng, 12, "runs") + 1
        lo, ro = _ids(local, 1, 1, cols, slots), _ids(remote, 1, 1, cols, slots)
        got = templates.plan(local, lo, remote, ro, "strided", lreg, rreg)
        assert got is not None
        _check(got, _reference(local, lo, remote, ro, "strided", lreg, rreg))
        assert templates._stored <= 16384
        now = sum(len(info.templates) for info in templates._infos.values())
        drops += now < held
        held = now
    assert drops >= 2
