"""Affine descriptor lists (issue #14 item 1): a prepared list kept as its description.

Every check compares the affine form with the same list written out row by row with plain
Python loops (an independent reference): the rows, and the simulated transport's answers --
acceptance, refusal messages, bytes moved -- must be the same for both forms.
"""

from __future__ import annotations

import numpy as np
import pytest
import simpy

from hkvsim.connector.descriptors import local_descriptors, remote_descriptors
from hkvsim.connector.tp import source_plan
from hkvsim.fabric import Fabric, load_profile, place_engines
from hkvsim.transport.affine import AffineList
from hkvsim.transport.base import DONE, TransportError, overlapping, registration_problem
from hkvsim.transport.sim import SimWorld

from tests.connector._helpers import layout, meta, state_regions

KIB = 1024


@pytest.fixture(params=["runs", "rows"])
def analysis(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test with transfers analysed per run of ids (every size) and per descriptor."""
    from hkvsim.transport import base

    monkeypatch.setattr(base, "RUNS_FROM", 0 if request.param == "runs" else 1 << 40)
    return request.param


def _reference_rows(segments: list[dict], device: int) -> np.ndarray:
    """The list written out descriptor by descriptor (no numpy arithmetic)."""
    rows = []
    for seg in segments:
        sub, sub_stride = seg.get("sub", 1), seg.get("sub_stride", 0)
        for j in range(seg["count"]):
            addr = seg["base"] + (j // sub) * seg["stride"] + (j % sub) * sub_stride
            rows.append([addr, seg["length"], device])
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def _affine(segments: list[dict], device: int = 0) -> AffineList:
    return AffineList(counts=[s["count"] for s in segments], base=[s["base"] for s in segments],
                      stride=[s["stride"] for s in segments],
                      length=[s["length"] for s in segments],
                      sub=[s.get("sub", 1) for s in segments],
                      sub_stride=[s.get("sub_stride", 0) for s in segments], device=device)


def _segments(base: int) -> list[dict]:
    return [
        {"count": 6, "base": base, "stride": 4 * KIB, "length": 4 * KIB},  # contiguous blocks
        {"count": 0, "base": base, "stride": 1, "length": 1},  # an empty segment is skipped
        {"count": 8, "base": base + 64 * KIB, "stride": 8 * KIB, "length": 2 * KIB, "sub": 2,
         "sub_stride": 2 * KIB},  # sub-blocks
        {"count": 5, "base": base + 256 * KIB + 512, "stride": 16 * KIB, "length": 512},  # state
    ]


@pytest.mark.parametrize("plain", [False, True])
def test_rows_match_the_reference_for_any_ids(plain: bool) -> None:
    segs = _segments(1 << 30)
    if plain:  # no sub-block segment: the list takes the plain (sub = 1) arithmetic
        segs = [s for s in segs if s.get("sub", 1) == 1]
    dl, ref = _affine(segs, device=3), _reference_rows(segs, 3)
    assert len(dl) == ref.shape[0] == (11 if plain else 19)
    assert (dl.materialise() == ref).all()
    ids = np.random.default_rng(1).integers(0, len(dl), 200)
    assert (dl.addresses(ids) == ref[ids, 0].astype(np.int64)).all()
    assert (dl.rows(ids) == ref[ids]).all()
    assert (dl.lengths(ids) == ref[ids, 1].astype(np.int64)).all()
    assert dl.nbytes() == int(ref[:, 1].sum())


def test_connector_lists_do_not_grow_with_num_blocks() -> None:
    """The prepared lists' description is the same size at 4k and at 131k blocks."""
    sizes = []
    for blocks in (4_096, 131_072):
        lay = layout("kimi-linear-48b", 1, num_blocks=blocks)
        m = meta(lay)
        lists = [local_descriptors(m, state_regions(lay)),
                 remote_descriptors(m, m, state_regions(lay), source_plan(
                     lay.model, local_tp=1, remote_tp=1, tp_rank=0), bsr=1)]
        assert len(lists[0]) > blocks  # it names every block ...
        sizes.append(sum(a.nbytes for dl in lists for a in (
            dl.affine.first, dl.affine.base, dl.affine.stride, dl.affine.length,
            dl.affine.sub, dl.affine.sub_stride, dl.affine.counts)))
    assert sizes[0] == sizes[1]  # ... in a description of constant size


@pytest.mark.parametrize("form", ["affine", "explicit"])
def test_registration_checks_answer_alike(form: str) -> None:
    """Refusals name the same descriptor, whichever form the list was given in."""
    lo = 1 << 30
    segs = _segments(lo)
    dl = _affine(segs) if form == "affine" else _reference_rows(segs, 0)
    end = int(_reference_rows(segs, 0)[-1, 0]) + 512
    inside = np.array([[lo, end - lo, 0]], dtype=np.uint64)
    assert registration_problem(dl, inside, whose="w") is None
    # two adjacent ranges splitting segment 0 between them: every descriptor is still inside
    split = np.array([[lo, 8 * KIB, 0], [lo + 8 * KIB, end - lo - 8 * KIB, 0]], dtype=np.uint64)
    assert registration_problem(dl, split, whose="w") is None
    short = np.array([[lo, end - lo - 1, 0]], dtype=np.uint64)  # the last byte is outside
    problem = registration_problem(dl, short, whose="w")
    assert problem is not None and problem.startswith("descriptor 18 (")
    mid = np.array([[lo, 67 * KIB, 0], [lo + 67 * KIB, end, 0]], dtype=np.uint64)
    problem = registration_problem(dl, mid, whose="w")  # id 7 straddles the two ranges
    assert problem is not None and problem.startswith("descriptor 7 (")
    other_device = np.array([[lo, end - lo, 1]], dtype=np.uint64)
    problem = registration_problem(dl, other_device, whose="w")
    assert problem is not None and problem.startswith("descriptor 0 (")
    for ranges, expected in ((np.array([[lo + 70 * KIB, 1, 0]], np.uint64), False),
                             (np.array([[lo + 66 * KIB, 1, 0]], np.uint64), True),
                             (np.array([[lo + 66 * KIB, 1, 1]], np.uint64), False)):
        assert overlapping(dl, ranges) is expected


def _world() -> tuple[simpy.Environment, SimWorld]:
    env = simpy.Environment()
    profile = load_profile("cpu-ucx-loopback")
    fabric = Fabric(env, profile, place_engines(profile, [("a", "prefill", 1),
                                                          ("b", "decode", 1)]))
    return env, SimWorld(env, fabric)


def _messages(fn) -> str:
    with pytest.raises(TransportError) as info:
        fn()
    return str(info.value)


def test_sim_transport_treats_both_forms_alike(analysis: str) -> None:
    env, world = _world()
    a, b = world.create_agent("t-a", ("a", 0)), world.create_agent("t-b", ("b", 0))
    ma, mb = a.allocate(1 << 20, mem_type="DRAM"), b.allocate(1 << 20, mem_type="DRAM")
    a.register_memory(ma)
    b.register_memory(mb)
    name = a.add_remote_agent(b.get_agent_metadata())
    segs_a, segs_b = _segments(ma.base_addr), _segments(mb.base_addr)
    lists = {form: (a.prep_xfer_dlist("", _affine(segs_a) if form == "affine"
                                      else _reference_rows(segs_a, 0)),
                    a.prep_xfer_dlist(name, _affine(segs_b) if form == "affine"
                                      else _reference_rows(segs_b, 0)))
             for form in ("affine", "explicit")}
    ids = np.array([0, 1, 2, 6, 7, 12, 18])
    ma.array[:] = np.arange(ma.nbytes, dtype=np.uint64).astype(np.uint8)
    moved = {}
    for form, (local, remote) in lists.items():
        mb.array[:] = 0
        h = a.make_prepped_xfer("WRITE", local, ids, remote, ids)
        a.transfer(h)
        env.run()
        assert a.check_xfer_state(h) == DONE
        moved[form] = mb.array.copy()
        a.release_xfer_handle(h)
    assert (moved["affine"] == moved["explicit"]).all() and moved["affine"].any()
    # refusals: the same message for both forms
    for bad in ([0, 19], [-1, 0]):
        msgs = {form: _messages(lambda: a.make_prepped_xfer("READ", local, np.array(bad), remote,
                                                              np.array([0, 1])))
                for form, (local, remote) in lists.items()}
        assert msgs["affine"] == msgs["explicit"] and "out of range" in msgs["affine"]
    msgs = {form: _messages(lambda: a.make_prepped_xfer("READ", local, np.array([0, 18]),
                                                          remote, np.array([0, 13])))
            for form, (local, remote) in lists.items()}
    assert msgs["affine"] == msgs["explicit"] and "length" in msgs["affine"]
    far = _segments(ma.base_addr + ma.nbytes - 8 * KIB)  # runs past the registered memory
    msgs = {form: _messages(lambda: a.prep_xfer_dlist("", dl))
            for form, dl in (("affine", _affine(far)), ("explicit", _reference_rows(far, 0)))}
    assert msgs["affine"] == msgs["explicit"] and "is outside the registered memory" in msgs[
        "affine"]
    zero = [dict(_segments(ma.base_addr)[0]), {"count": 2, "base": ma.base_addr, "stride": 8,
                                                "length": 0}]
    msgs = {form: _messages(lambda: a.prep_xfer_dlist("", dl))
            for form, dl in (("affine", _affine(zero)), ("explicit", _reference_rows(zero, 0)))}
    assert msgs["affine"] == msgs["explicit"] and "descriptor 6 has length 0" in msgs["affine"]


def test_bad_descriptions_are_refused() -> None:
    with pytest.raises(ValueError, match="base must lie in"):
        AffineList(counts=[1], base=[-1], stride=[0], length=[1], device=0)
    with pytest.raises(ValueError, match="sub must be >= 1"):
        AffineList(counts=[1], base=[0], stride=[0], length=[1], sub=[0], device=0)
    with pytest.raises(ValueError, match="one value per segment"):
        AffineList(counts=[1, 2], base=[0], stride=[0, 0], length=[1, 1], device=0)
    with pytest.raises(ValueError, match="ends beyond"):
        AffineList(counts=[3], base=[(1 << 63) - 10], stride=[8], length=[8], device=0)


def _pair_reference(lrows: np.ndarray, rrows: np.ndarray) -> tuple[int, int]:
    """(bytes, NIXL-coalesced count) from explicit rows, with plain Python loops."""
    count = 0
    prev = None
    for (la, ln, ld), (ra, rn, rd) in zip(lrows.tolist(), rrows.tolist()):
        if prev is None or not (la == prev[0] + prev[1] and ra == prev[2] + prev[3]
                                and ld == prev[4] and rd == prev[5]):
            count += 1
        prev = (la, ln, ra, rn, ld, rd)
    return int(sum(int(r[1]) for r in lrows.tolist())), count


def _covered(addrs: np.ndarray, lengths: np.ndarray) -> list[int]:
    return sorted(b for a, n in zip(addrs.tolist(), lengths.tolist()) for b in range(a, a + n))


@pytest.mark.parametrize("seed", range(6))
def test_paired_runs_agree_with_rows(seed: int, analysis: str) -> None:
    """Checks, bytes, coalescing and destination runs computed per run of consecutive ids equal
    what the rows give, for ids that cross segments, repeat, go backwards or jump."""
    from hkvsim.transport.base import check_pairs

    rng = np.random.default_rng(seed)
    lo, hi = 1 << 30, 1 << 32
    contiguous = [  # the same lengths as _segments, stride = length where it can be
        {"count": 6, "base": lo, "stride": 4 * KIB, "length": 4 * KIB},
        {"count": 8, "base": lo + 64 * KIB, "stride": 4 * KIB, "length": 2 * KIB, "sub": 2,
         "sub_stride": 2 * KIB},
        {"count": 5, "base": lo + 128 * KIB, "stride": 512, "length": 512},
    ]
    remote_segs = _segments(hi) if seed % 2 else [dict(s, base=s["base"] - lo + hi)
                                                  for s in contiguous]
    local_segs = contiguous if seed < 3 else _segments(lo)
    la, ra = _affine(local_segs), _affine(remote_segs)
    lref, rref = _reference_rows(local_segs, 0), _reference_rows(remote_segs, 0)
    # ids with equal lengths on both sides: pick positions by length class
    by_len: dict[int, tuple[list[int], list[int]]] = {}
    for i, n in enumerate(lref[:, 1].tolist()):
        by_len.setdefault(n, ([], []))[0].append(i)
    for i, n in enumerate(rref[:, 1].tolist()):
        by_len.setdefault(n, ([], []))[1].append(i)
    li, ri = [], []
    for _ in range(12):
        n = int(rng.choice([k for k, (a, b) in by_len.items() if a and b]))
        ls, rs = by_len[n]
        m = int(rng.integers(1, 6))
        l0, r0 = int(rng.integers(len(ls))), int(rng.integers(len(rs)))
        li += [ls[min(l0 + k, len(ls) - 1)] for k in range(m)]
        ri += [rs[min(r0 + k, len(rs) - 1)] for k in range(m)]
    li_a, ri_a = np.array(li), np.array(ri)
    pairs = check_pairs(la, li_a, ra, ri_a, what="t")
    assert (pairs.runs is not None) == (analysis == "runs")
    nbytes, coalesced = _pair_reference(lref[li_a], rref[ri_a])
    assert pairs.nbytes == nbytes
    assert pairs.coalesced() == coalesced
    for side, ref, ids in (("local", lref, li_a), ("remote", rref, ri_a)):
        assert (pairs.rows(side) == ref[ids]).all()
        addrs, lengths = pairs.extents(side)
        assert _covered(addrs, lengths) == _covered(ref[ids, 0].astype(np.int64),
                                                    ref[ids, 1].astype(np.int64))
    # a whole-list transfer, in order: long runs across every segment boundary
    whole = np.arange(len(la))
    same = check_pairs(la, whole, _affine(local_segs), whole, what="t")
    assert (same.nbytes, same.coalesced()) == _pair_reference(lref, lref)


@pytest.mark.parametrize("stride_kib", [4, 8])
def test_one_run_in_one_segment_coalesces_like_rows(stride_kib: int, analysis: str) -> None:
    """A single joint run (one segment, consecutive ids on both sides): back-to-back blocks
    coalesce into one descriptor, blocks with gaps between them stay one descriptor each."""
    from hkvsim.transport.base import check_pairs

    seg = {"count": 6, "base": 1 << 30, "stride": stride_kib * KIB, "length": 4 * KIB}
    remote = dict(seg, base=1 << 32)
    lref, rref = _reference_rows([seg], 0), _reference_rows([remote], 0)
    for ids in (np.arange(6), np.arange(1, 4)):
        pairs = check_pairs(_affine([seg]), ids, _affine([remote]), ids, what="t")
        want = _pair_reference(lref[ids], rref[ids])[1]
        assert pairs.coalesced() == want == (1 if stride_kib == 4 else ids.size)


@pytest.mark.parametrize("seed", range(4))
def test_runs_meeting_across_adjacent_segments_coalesce_like_rows(seed: int, analysis: str
                                                                  ) -> None:
    """Segments that follow each other in memory (regions registered back to back, as the
    hybrid models' shared cache tensors are): a run cut at a segment boundary continues in
    the next segment's first descriptor, and NIXL joins the two; ids also jump inside a
    segment and between sides, where nothing joins."""
    from hkvsim.transport.base import check_pairs

    rng = np.random.default_rng(200 + seed)
    lo, hi = 1 << 30, 1 << 32
    segs = [{"count": 6, "base": lo, "stride": 4 * KIB, "length": 4 * KIB},
            {"count": 4, "base": lo + 24 * KIB, "stride": 4 * KIB, "length": 4 * KIB},
            {"count": 3, "base": lo + 40 * KIB, "stride": 2 * KIB, "length": 2 * KIB}]
    remote_segs = [dict(s, base=s["base"] - lo + hi) for s in segs]
    la, ra = _affine(segs), _affine(remote_segs)
    lref, rref = _reference_rows(segs, 0), _reference_rows(remote_segs, 0)
    whole = np.arange(len(la))
    pairs = check_pairs(la, whole, ra, whole, what="t")
    assert pairs.coalesced() == _pair_reference(lref, rref)[1] == 1
    # random runs of consecutive ids (crossing the boundaries or not), the remote side shifted
    # by one block in some of them
    starts = rng.integers(0, 12, 5)
    li = np.concatenate([np.arange(a, min(a + int(rng.integers(2, 8)), 13)) for a in starts])
    ri = li.copy()
    if seed % 2:
        ri[: li.size // 2] = np.clip(ri[: li.size // 2] + 1, 0, 9)  # 4 KiB ids only
        keep = lref[li, 1] == rref[ri, 1]
        li, ri = li[keep], ri[keep]
    pairs = check_pairs(la, li, ra, ri, what="t")
    assert (pairs.nbytes, pairs.coalesced()) == _pair_reference(lref[li], rref[ri])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", ["contiguous", "strided"])
def test_collapsed_runs_merge_like_rows(seed: int, mode: str, analysis: str) -> None:
    """Merging a transfer from its collapsed runs gives the rows merging its per-descriptor
    rows gives (hkvsim.connector.merge.collapsed_pairs), region boundaries included."""
    from hkvsim.connector.merge import collapsed_pairs, merge_descriptors, region_index
    from hkvsim.transport.base import check_pairs

    rng = np.random.default_rng(100 + seed)
    lo, hi = 1 << 30, 1 << 32
    segs = [{"count": 40, "base": lo, "stride": 4 * KIB, "length": 4 * KIB},
            {"count": 40, "base": lo + 160 * KIB, "stride": 4 * KIB, "length": 4 * KIB},
            {"count": 20, "base": lo + 400 * KIB, "stride": 8 * KIB, "length": 4 * KIB}]
    local, remote = _affine(segs), _affine([dict(s, base=s["base"] - lo + hi) for s in segs])
    # region bases: one per segment, plus one inside segment 0 (a registration boundary
    # crossing a contiguous run must stop the merge there)
    lbases = [lo, lo + 160 * KIB, lo + 400 * KIB] + ([lo + 80 * KIB] if seed % 2 else [])
    rbases = [hi, hi + 160 * KIB, hi + 400 * KIB]
    ids = np.concatenate([np.arange(a, a + int(rng.integers(1, 30)))
                          for a in rng.integers(0, 70, 6)]).clip(0, 99)
    shifted = np.where(rng.random(ids.size) < 0.1, ids[::-1], ids) if seed > 2 else ids
    pairs = check_pairs(local, ids, remote, shifted, what="t")
    lrows, rrows = pairs.rows("local"), pairs.rows("remote")
    full = merge_descriptors(lrows, rrows, mode, (region_index(lbases, lrows[:, 0]),
                                                  region_index(rbases, rrows[:, 0])))
    cl, cr, regions = collapsed_pairs(pairs, lbases, rbases)
    fast = merge_descriptors(cl, cr, mode, regions)
    assert (fast.local == full.local).all() and (fast.remote == full.remote).all()


@pytest.mark.parametrize("plain", [False, True])
def test_an_id_out_of_range_is_named_by_its_index_and_value(plain: bool) -> None:
    from hkvsim.transport.base import check_pairs

    segs = [{"count": 6, "base": 1 << 30, "stride": 4 * KIB, "length": 4 * KIB}]
    local = _affine(segs) if not plain else _reference_rows(segs, 0)
    remote = _affine(segs)
    ok = np.array([0, 1, 2])
    cases = [("local", [0, 6, 7], ok, 1, 6), ("remote", ok, [-1, 2, 9], 0, -1),
             ("remote", ok, [3, 4, 6], 2, 6)]
    for side, li, ri, at, value in cases:
        with pytest.raises(TransportError) as exc:
            check_pairs(local, np.array(li), remote, np.array(ri), what="t")
        text = str(exc.value)
        assert text.startswith(
            f"t: {side} descriptor id out of range at index {at} (id {value}); ids span "), text
        assert text.endswith(f"the {side} list has 6 descriptors")
