"""Descriptor ids as outer sums (hkvsim/transport/outer.py, issue #14): checked from their
structure, they must give exactly what the same ids give flat -- bytes, NIXL's coalesced
count, byte runs, rows, and the same refusals with the same messages. The reference is the
flat ids' rows walked with plain Python loops."""

from __future__ import annotations

import numpy as np
import pytest

from hkvsim.transport.affine import AffineList
from hkvsim.transport.base import TransportError, check_pairs
from hkvsim.transport.outer import OuterIds, outer_pairs

from tests.transport.test_affine_lists import _covered, _pair_reference


def _list(rng: np.random.Generator, base: int, *, plain: bool, flip: bool = False
          ) -> AffineList:
    """Attention-like segments (one per region: a stride of one block, or one block of a
    wider page) then state-like ones (a sub-region of a page), the same lengths on every
    list so that lists pair."""
    counts, bases, strides, lengths, subs, sub_strides = [], [], [], [], [], []
    at = base
    for r in range(4):
        n = 40
        length = 256
        stride = length if (r + flip) % 2 == 0 else 3 * length  # contiguous, or spaced
        sub = 1 if plain or r != 3 else 2
        counts.append(n * sub)
        bases.append(at)
        strides.append(stride)
        lengths.append(length // sub if sub > 1 else length)
        subs.append(sub)
        sub_strides.append(length // sub if sub > 1 else 0)
        at += n * stride + int(rng.integers(0, 2)) * 64  # adjacent regions, or a gap
    for q, size in enumerate((64, 64, 128)):
        counts.append(10)
        bases.append(at + q * 128)
        strides.append(512)
        lengths.append(size)
        subs.append(1)
        sub_strides.append(0)
    return AffineList(counts=counts, base=bases, stride=strides, length=lengths, sub=subs,
                      sub_stride=sub_strides, device=0)


def _cols(rng: np.random.Generator, n: int, hi: int) -> np.ndarray:
    """Column ids in [0, hi): runs of consecutive ids, jumps, repeats, steps back."""
    out: list[int] = []
    while len(out) < n:
        start = int(rng.integers(0, hi))
        out += [min(start + k, hi - 1) for k in range(int(rng.integers(1, 6)))]
    return np.array(out[:n], dtype=np.int64)


def _ids(dl: AffineList, cols_a: np.ndarray, cols_s: np.ndarray) -> OuterIds:
    first = dl.first
    return OuterIds([(first[:4], cols_a), (first[4:7], cols_s)])


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("small", [0, 1 << 20])
def test_structure_gives_what_flat_ids_give(seed: int, small: int,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """... with columns handled as numpy arrays (small = 0) or as Python ints."""
    from hkvsim.transport import outer

    monkeypatch.setattr(outer, "_SMALL", small)
    rng = np.random.default_rng(seed)
    plain = seed % 4 != 3
    # the remote list spaces the regions the local one packs, or the same ones
    la = _list(rng, 1 << 30, plain=plain)
    ra = _list(rng, 1 << 32, plain=plain, flip=seed % 3 == 0)
    k = int(rng.integers(1, 30))
    lo = _ids(la, _cols(rng, k, 40), _cols(rng, 2, 10))
    # the same blocks on both sides (as the connector's lists mostly pair), or others
    ro = (_ids(ra, *[c for _, c in lo.parts]) if seed % 2 == 0
          else _ids(ra, _cols(rng, k, 40), _cols(rng, 2, 10)))
    cache: dict = {}
    pairs = check_pairs(la, lo, ra, ro, what="t", outer_cache=cache)
    # the structure settled it (plain lists); sub-block segments go the flat way
    assert (pairs._outer is not None) == plain
    flat = check_pairs(la, lo.flat(), ra, ro.flat(), what="t")
    lref, rref = la.materialise(), ra.materialise()
    li, ri = lo.flat(), ro.flat()
    assert (li == np.asarray(lo)).all() and li.size == lo.size == len(lo)
    assert (pairs.nbytes, pairs.coalesced()) == _pair_reference(lref[li], rref[ri])
    assert (pairs.nbytes, pairs.coalesced()) == (flat.nbytes, flat.coalesced())
    for side, ref, ids in (("local", lref, li), ("remote", rref, ri)):
        assert (pairs.rows(side) == ref[ids]).all()
        addrs, lengths = pairs.extents(side)
        assert addrs.tolist() == ref[ids, 0].astype(np.int64).tolist()  # per descriptor
        assert _covered(addrs, lengths) == _covered(ref[ids, 0].astype(np.int64),
                                                    ref[ids, 1].astype(np.int64))
    # a second call answers from the cache, alike
    again = check_pairs(la, lo, ra, ro, what="t", outer_cache=cache)
    assert (again.nbytes, again.coalesced()) == (pairs.nbytes, pairs.coalesced())


def test_whole_rows_coalesce_across_regions() -> None:
    """Every block of adjacent contiguous regions, in order: one descriptor per side run."""
    dl = AffineList(counts=[8, 8], base=[0, 8 * 64], stride=[64, 64], length=[64, 64], device=0)
    ids = OuterIds([(dl.first[:2], np.arange(8))])
    pairs = check_pairs(dl, ids, dl, ids, what="t", outer_cache={})
    assert pairs._outer is not None
    assert (pairs.nbytes, pairs.coalesced()) == (16 * 64, 1)
    gap = AffineList(counts=[8, 8], base=[0, 9 * 64], stride=[64, 64], length=[64, 64], device=0)
    pairs = check_pairs(gap, OuterIds([(gap.first[:2], np.arange(8))]), gap,
                        OuterIds([(gap.first[:2], np.arange(8))]), what="t", outer_cache={})
    assert pairs.coalesced() == 2


def _message(fn) -> str:
    with pytest.raises(TransportError) as info:
        fn()
    return str(info.value)


def test_refusals_are_the_flat_ones() -> None:
    rng = np.random.default_rng(0)
    la, ra = _list(rng, 1 << 30, plain=True), _list(rng, 1 << 32, plain=True)
    cases = {
        # a column past the region: the row crosses into the next segment (allowed, flat)
        # and, past the list's end, out of range
        "out of range": (_ids(la, np.array([1, 2]), np.array([3])),
                         _ids(ra, np.array([1, 2]), np.array([30]))),
        "negative": (_ids(la, np.array([-500, 2]), np.array([3])),
                     _ids(ra, np.array([1, 2]), np.array([3]))),
        # state part against attention lengths: the pairs' lengths differ
        "length": (OuterIds([(la.first[:1], np.array([1, 2]))]),
                   OuterIds([(ra.first[4:5], np.array([1, 2]))])),
        "count": (_ids(la, np.array([1, 2]), np.array([3])),
                  _ids(ra, np.array([1, 2, 3]), np.array([3]))),
    }
    for name, (lo, ro) in cases.items():
        got = _message(lambda: check_pairs(la, lo, ra, ro, what="t", outer_cache={}))
        want = _message(lambda: check_pairs(la, lo.flat(), ra, ro.flat(), what="t"))
        assert got == want, name
    assert outer_pairs(la, *cases["length"][:1], ra, cases["length"][1], {}) is None
    empty = AffineList(counts=np.zeros(0, np.int64), base=np.zeros(0, np.int64),
                       stride=np.zeros(0, np.int64), length=np.zeros(0, np.int64), device=0)
    lo = OuterIds([(np.array([0]), np.array([0]))])
    got = _message(lambda: check_pairs(empty, lo, empty, lo, what="t", outer_cache={}))
    assert got == _message(lambda: check_pairs(empty, lo.flat(), empty, lo.flat(), what="t"))
    assert "the local list has 0 descriptors" in got


def test_a_row_crossing_segments_is_checked_flat() -> None:
    """Columns that carry a row into the next segment are valid ids: answered flat, alike."""
    rng = np.random.default_rng(1)
    la, ra = _list(rng, 1 << 30, plain=True), _list(rng, 1 << 32, plain=True)
    lo = OuterIds([(la.first[:1], np.array([38, 39, 40]))])  # region 0 into region 1
    ro = OuterIds([(ra.first[:1], np.array([38, 39, 40]))])
    back = (OuterIds([(la.first[1:2], np.array([-1, 0, 1]))]),  # region 1 back into 0
            OuterIds([(ra.first[1:2], np.array([-1, 0, 1]))]))
    # rows of another shape on each side, the same number of ids
    shape = (OuterIds([(la.first[:2], np.array([1, 2, 3]))]),
             OuterIds([(ra.first[:3], np.array([1, 2]))]))
    for lo, ro in ((lo, ro), back, shape):
        assert outer_pairs(la, lo, ra, ro, {}) is None
        pairs = check_pairs(la, lo, ra, ro, what="t", outer_cache={})
        assert (pairs.nbytes, pairs.coalesced()) == _pair_reference(
            la.materialise()[lo.flat()], ra.materialise()[ro.flat()])


def test_bad_outer_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="must be integers"):
        OuterIds([(np.array([0.5]), np.array([1]))])
    with pytest.raises(ValueError, match="must be 1-D"):
        OuterIds([(np.zeros((2, 2), np.int64), np.array([1]))])
    assert OuterIds([(np.array([3]), np.zeros(0, np.int64))]).size == 0


def _frozen_ids(dl: AffineList, cols_a: np.ndarray, cols_s: np.ndarray) -> OuterIds:
    first = dl.first
    return OuterIds([(first[:4], cols_a), (first[4:7], cols_s)], frozen=True)


def _shifted(dl: AffineList, shift: int) -> AffineList:
    return AffineList(counts=dl.counts, base=dl.base + shift, stride=dl.stride,
                      length=dl.length, sub=dl.sub, sub_stride=dl.sub_stride, device=0)


@pytest.mark.parametrize("seed", range(6))
def test_answers_shared_across_lists_of_one_shape(seed: int) -> None:
    """Frozen columns over lists that differ only by a shift per side (the ranks of an
    engine) share one answer; lists of another shape (other gaps between regions) do not.
    Every answer, and every side's byte runs, is what the flat ids give."""
    rng = np.random.default_rng(100 + seed)
    la, ra = _list(rng, 1 << 30, plain=True), _list(rng, 1 << 32, plain=True)
    other = _list(np.random.default_rng(200 + seed), 1 << 30, plain=True)  # other gaps
    k = int(rng.integers(2, 30))
    cols = [_cols(rng, k, 40), _cols(rng, 2, 10)]
    rcols = cols if seed % 2 else [_cols(rng, k, 40), _cols(rng, 2, 10)]
    cases = [(la, ra), (_shifted(la, 1 << 36), _shifted(ra, 3 << 36)),
             (_shifted(la, 5 << 36), ra), (other, ra), (la, ra)]
    answers = []
    for local, remote in cases:
        lo, ro = _frozen_ids(local, *cols), _frozen_ids(remote, *rcols)
        pairs = check_pairs(local, lo, remote, ro, what="t", outer_cache={})
        assert pairs._outer is not None
        answers.append(pairs._outer.answer)
        lref, rref = local.materialise(), remote.materialise()
        li, ri = lo.flat(), ro.flat()
        assert (pairs.nbytes, pairs.coalesced()) == _pair_reference(lref[li], rref[ri])
        for side, ref, ids in (("local", lref, li), ("remote", rref, ri)):
            addrs, lengths = pairs.extents(side)
            assert addrs.tolist() == ref[ids, 0].astype(np.int64).tolist()
            assert lengths.tolist() == ref[ids, 1].astype(np.int64).tolist()
    assert answers[1] is answers[0] and answers[2] is answers[0]  # shifted lists: shared


def test_columns_not_frozen_are_never_answered_from_memory() -> None:
    """Columns not declared frozen may change in place: they are checked anew on every call,
    so an id moved out of range after a first, valid transfer is refused with the flat
    path's message."""
    rng = np.random.default_rng(3)
    la, ra = _list(rng, 1 << 30, plain=True), _list(rng, 1 << 32, plain=True)
    cols = np.array([1, 2, 3], dtype=np.int64)
    slots = np.array([3], dtype=np.int64)
    lo, ro = _ids(la, cols, slots), _ids(ra, cols, slots)
    cache: dict = {}
    assert check_pairs(la, lo, ra, ro, what="t", outer_cache=cache)._outer is not None
    slots[0] = 30  # past the state segments: out of range
    lo, ro = _ids(la, cols, slots), _ids(ra, cols, slots)
    got = _message(lambda: check_pairs(la, lo, ra, ro, what="t", outer_cache=cache))
    assert got == _message(lambda: check_pairs(la, lo.flat(), ra, ro.flat(), what="t"))
    assert "out of range" in got


def test_runs_token_is_shared_by_equal_sides_only() -> None:
    """A side's runs token (what the landing guard keys its block lookup by) is shared by
    transfers whose rows on that side have one shape and whose columns there are the same
    frozen arrays, even where the other side's rows differ (two answers): the decode ranks of
    one engine read into equal runs from prefill rows at other offsets. Another shape on that
    side, or other columns, get another token; each token's runs are what the flat ids give."""
    rng = np.random.default_rng(7)
    la, ra = _list(rng, 1 << 30, plain=True), _list(rng, 1 << 32, plain=True)
    other_r = _list(np.random.default_rng(8), 1 << 32, plain=True)  # other gaps: other shape
    other_l = _list(np.random.default_rng(9), 1 << 30, plain=True)
    cols = [_cols(rng, 12, 40), _cols(rng, 2, 10)]
    more = [_cols(rng, 12, 40), _cols(rng, 2, 10)]

    def checked(local: AffineList, remote: AffineList, c: list[np.ndarray]) -> object:
        lo, ro = _frozen_ids(local, *c), _frozen_ids(remote, *c)
        pairs = check_pairs(local, lo, remote, ro, what="t", outer_cache={})
        assert pairs._outer is not None
        lref, rref = local.materialise(), remote.materialise()
        for side, ref, ids in (("local", lref, lo.flat()), ("remote", rref, ro.flat())):
            addrs, lengths = pairs.extents(side)
            assert addrs.tolist() == ref[ids, 0].astype(np.int64).tolist()
            assert lengths.tolist() == ref[ids, 1].astype(np.int64).tolist()
        return pairs

    first = checked(la, ra, cols)
    remote_other = checked(_shifted(la, 1 << 36), other_r, cols)  # same local side
    assert remote_other._outer.answer is not first._outer.answer  # the pairs' shapes differ
    assert remote_other.runs_key("local")[0] is first.runs_key("local")[0]
    assert remote_other.runs_key("remote")[0] is not first.runs_key("remote")[0]
    assert remote_other.runs_key("local")[2] - first.runs_key("local")[2] == 1 << 36
    local_other = checked(other_l, ra, cols)  # another local shape
    assert local_other.runs_key("local")[0] is not first.runs_key("local")[0]
    other_cols = checked(la, ra, more)  # the same lists, other columns
    assert other_cols.runs_key("local")[0] is not first.runs_key("local")[0]
    # not frozen: never shared
    lo, ro = _ids(la, *cols), _ids(ra, *cols)
    a = check_pairs(la, lo, ra, ro, what="t", outer_cache={})
    b = check_pairs(la, lo, ra, ro, what="t", outer_cache={})
    assert a.runs_key("local")[0] is not b.runs_key("local")[0]


def test_shape_numbers_are_never_reused_after_a_full_table_is_cleared(monkeypatch) -> None:
    """A shape's number keys remembered answers and runs tokens: a number given again to
    another shape after the table was cleared would hand one shape's answer to another, and
    entries keyed by the old numbers must go with the table."""
    from hkvsim.transport import outer

    monkeypatch.setattr(outer, "_CACHE_LIMIT", 3)
    numbers: dict = {}
    by_number: dict = {}
    given = [outer._number_of((k,), numbers, by_number) for k in range(3)]
    assert outer._number_of((1,), numbers, by_number) == given[1]  # known: the same number
    for n in given:
        by_number[n] = "answer"
    fresh = outer._number_of(("new",), numbers, by_number)  # the table is full: cleared
    assert fresh not in given
    assert by_number == {} and numbers == {("new",): fresh}
    again = outer._number_of((0,), numbers, by_number)  # forgotten: numbered anew
    assert again not in given and again != fresh
