"""Descriptor ids as the connector builds them: row starts plus column ids (issue #14).

The connector names a transfer's descriptors region by region: attention id ``r * N_fa + k``
for every region ``r`` and block ``k``, state id ``base + q * N_log + b`` for every sub-region
``q`` and slot ``b`` (docs/semantics.md §5.4). Such a list is an *outer sum*: per part, a few
row starts (one per region) plus the request's block ids, repeated row by row.
:class:`OuterIds` keeps that structure. It is an id list like any other (``np.asarray`` gives
the flat int64 ids, row-major, part after part), so every transport accepts it; the simulated
transport also reads the structure (:func:`outer_pairs`): over two affine lists, when every row
lies inside one segment on each side, the range checks reduce to the columns' minimum and
maximum against bounds cached per (list, row starts), paired lengths and bytes to one number
per row, NIXL's coalescing to the columns' steps and the rows' first and last descriptors. Any
other case (a row crossing a segment, sub-block segments, an id out of range, unequal lengths)
returns None and the caller checks the flat ids, with the flat path's messages.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .affine import AffineList

__all__ = ["OuterIds", "OuterPairs", "outer_pairs", "pair_geometry"]

_EMPTY = np.zeros(0, dtype=np.int64)
_INT64 = np.dtype(np.int64)


def _int64(values: Any, what: str) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values  # the connector's ids: nothing to convert
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"outer ids: {what} must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"outer ids: {what} must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"outer ids: {what} hold {int(arr.max())}, beyond int64")
    return arr.astype(np.int64, copy=False)


class OuterIds:
    """Descriptor ids ``starts_p[r] + cols_p[c]`` for every part ``p``, row ``r`` (outer) and
    column ``c`` (inner), parts one after the other. Parts with no row or no column name no
    id and are dropped. ``np.asarray`` gives the flat int64 ids. ``frozen``: the caller
    promises never to modify the arrays (the connector's paired ids), so a transport may
    remember what it derived from them by their identity (:func:`outer_pairs`)."""

    __slots__ = ("parts", "size", "_flat", "frozen", "ranges")

    @classmethod
    def of_arrays(cls, parts: Sequence[tuple[np.ndarray, np.ndarray]], *,
                  frozen: bool = False, ranges: "Sequence[bool] | None" = None) -> "OuterIds":
        """The same, from parts that are already 1-D int64 arrays (the connector's: not
        converted again); anything else goes through the checked constructor. ``ranges``
        (frozen ids only): per part, whether the caller knows its columns to be consecutive
        ids ``c0, c0 + 1, ...`` (a promise, like ``frozen``; readers may then skip reading
        them: :attr:`ranges`)."""
        size = 0
        kept = []
        known = []
        for i, (s, c) in enumerate(parts):
            # (dtype identity: the int64 dtype numpy gives; any other goes the checked way)
            if not (type(s) is np.ndarray and type(c) is np.ndarray and s.dtype is _INT64
                    and c.dtype is _INT64 and s.ndim == 1 and c.ndim == 1):
                return cls(parts, frozen=frozen)
            n = s.size * c.size
            if n:
                kept.append((s, c))
                size += n
                if ranges is not None:
                    known.append(bool(ranges[i]))
        self = cls.__new__(cls)
        self.parts = tuple(kept)
        self.size = size
        self._flat = None
        self.frozen = frozen
        self.ranges = tuple(known) if ranges is not None and frozen and any(known) else None
        return self

    @classmethod
    def of_two(cls, s0: np.ndarray, c0: np.ndarray, s1: np.ndarray, c1: np.ndarray, *,
               frozen: bool = False, first_range: bool = False) -> "OuterIds":
        """``of_arrays(((s0, c0), (s1, c1)), frozen=frozen, ranges=(first_range, False) if
        first_range else None)``: the connector's two parts (attention, state), without the
        general loop when both are non-empty 1-D int64 arrays."""
        if (type(c0) is np.ndarray and type(c1) is np.ndarray and type(s0) is np.ndarray
                and type(s1) is np.ndarray and c0.dtype is _INT64 and c1.dtype is _INT64
                and s0.dtype is _INT64 and s1.dtype is _INT64 and c0.ndim == 1 and c1.ndim == 1
                and s0.ndim == 1 and s1.ndim == 1):
            n0, n1 = s0.size * c0.size, s1.size * c1.size
            if n0 and n1:
                self = cls.__new__(cls)
                self.parts = ((s0, c0), (s1, c1))
                self.size = n0 + n1
                self._flat = None
                self.frozen = frozen
                self.ranges = (True, False) if first_range and frozen else None
                return self
        return cls.of_arrays(((s0, c0), (s1, c1)), frozen=frozen,
                             ranges=(first_range, False) if first_range else None)

    def __init__(self, parts: Sequence[tuple[Any, Any]], *, frozen: bool = False) -> None:
        kept = []
        for starts, cols in parts:
            s, c = _int64(starts, "row starts"), _int64(cols, "columns")
            if s.size and c.size:
                kept.append((s, c))
        self.parts: tuple[tuple[np.ndarray, np.ndarray], ...] = tuple(kept)
        self.size = sum(s.size * c.size for s, c in kept)
        self._flat: np.ndarray | None = None
        self.frozen = frozen
        # per part, whether its columns are known to be consecutive ids (None: none known)
        self.ranges: tuple[bool, ...] | None = None

    @property
    def shape(self) -> tuple[int]:
        return (self.size,)

    ndim = 1

    def __len__(self) -> int:
        return self.size

    def flat(self) -> np.ndarray:
        """The ids as one int64 array (computed once)."""
        if self._flat is None:
            if not self.parts:
                self._flat = _EMPTY
            elif len(self.parts) == 1:
                s, c = self.parts[0]
                self._flat = (s[:, None] + c[None, :]).reshape(-1)
            else:
                self._flat = np.concatenate([(s[:, None] + c[None, :]).reshape(-1)
                                             for s, c in self.parts])
        return self._flat

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        flat = self.flat()
        return flat if dtype is None else flat.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"OuterIds({self.size} ids in {len(self.parts)} parts)"


class _Rows:
    """What one list's geometry says about rows starting at ``starts`` (cached per pair): the
    segment of each row's first id, the column bounds keeping every row inside that segment,
    and per row the address of column 0, the stride and the length."""

    __slots__ = ("starts", "col_lo", "col_hi", "plain", "at0", "stride", "length", "seg")

    def __init__(self, dl: AffineList, starts: np.ndarray) -> None:
        self.starts = starts  # kept alive: the cache is keyed by its id
        if not len(dl):  # an empty list: no row is inside it
            self.col_lo, self.col_hi, self.plain = 1, 0, True
            self.stride = self.length = self.at0 = np.zeros(starts.shape, dtype=np.int64)
            self.seg = np.zeros(starts.shape, dtype=np.int64)
            return
        seg = dl.segments(starts)
        inside = (seg >= 0)
        seg = np.where(inside, seg, 0)
        self.seg = seg
        lo = dl.first[seg] - starts
        hi = dl.first[seg + 1] - 1 - starts
        # a row starting outside the list never passes: bounds no column can meet
        self.col_lo = int(lo.max()) if inside.all() else 1
        self.col_hi = int(hi.min()) if inside.all() else 0
        self.plain = bool((dl.sub[seg] == 1).all())
        self.stride = dl.stride[seg]
        self.length = dl.length[seg]
        self.at0 = dl.base[seg] + (starts - dl.first[seg]) * self.stride


class _Pair:
    """Cached for (local list, its row starts per part, remote list, its row starts per part):
    both sides' rows, whether every row pair has equal lengths, bytes per column per part, and
    the rows of every part concatenated (for the joins between rows)."""

    __slots__ = ("keep", "local", "remote", "equal", "col_bytes", "joins", "row_part",
                 "l_at0", "l_stride", "l_len", "r_at0", "r_stride", "r_len", "l_end0", "r_end0",
                 "l_shift", "r_shift", "shape", "boundaries", "side_shapes")

    def __init__(self, local: list[_Rows], remote: list[_Rows], keep: Any) -> None:
        self.keep, self.local, self.remote = keep, local, remote
        self.equal = all(np.array_equal(a.length, b.length) for a, b in zip(local, remote))
        self.col_bytes = [int(a.length.sum()) for a in local]
        # per part: (rows, local stride, local length, remote stride, remote length) classes
        self.joins = []
        for a, b in zip(local, remote):
            classes: dict[tuple[int, int, int, int], int] = {}
            for key in zip(a.stride.tolist(), a.length.tolist(), b.stride.tolist(),
                           b.length.tolist()):
                classes[key] = classes.get(key, 0) + 1
            self.joins.append([(m, *k) for k, m in classes.items()])
        self.row_part = np.repeat(np.arange(len(local)), [a.starts.size for a in local])
        cat = (lambda parts: np.concatenate(parts) if len(parts) > 1 else parts[0])
        self.l_at0, self.l_stride, self.l_len = (cat([a.at0 for a in local]),
                                                 cat([a.stride for a in local]),
                                                 cat([a.length for a in local]))
        self.r_at0, self.r_stride, self.r_len = (cat([b.at0 for b in remote]),
                                                 cat([b.stride for b in remote]),
                                                 cat([b.length for b in remote]))
        self.l_end0, self.r_end0 = self.l_at0 + self.l_len, self.r_at0 + self.r_len
        self.boundaries = _boundaries(self)
        # what the answers depend on besides the columns (see _shape_of): transfers over
        # pairs of the same shape with the same columns get the same answers
        self.l_shift = int(self.l_at0[0]) if self.l_at0.size else 0
        self.r_shift = int(self.r_at0[0]) if self.r_at0.size else 0
        self.shape = _shape_of(self)
        # per side, a number naming its rows relative to its first row's address: equal for
        # pairs whose byte runs on that side are equal up to a shift (the other side may differ)
        self.side_shapes = (_side_shape_of(self.row_part, self.l_at0, self.l_shift,
                                           self.l_stride, self.l_len),
                            _side_shape_of(self.row_part, self.r_at0, self.r_shift,
                                           self.r_stride, self.r_len))


def _boundaries(pair: _Pair) -> list[tuple[int, int, int, int, int, int, dict[Any, int]]]:
    """The boundaries between consecutive rows, by class: (part before, part after, both
    sides' strides before and after) -> how many boundaries have each (local, remote) gap
    between the row before's end at column 0 and the row after's address at column 0. A
    boundary joins (its rows' last and first descriptors continue each other on both sides)
    when, per side, the gap equals ``last column x stride before - first column x stride
    after`` -- the same test as comparing the addresses, in Python ints per class (a run has
    a handful of classes) instead of numpy calls per transfer."""
    if pair.l_at0.size < 2:
        return []
    part = pair.row_part.tolist()
    ls, rs = pair.l_stride.tolist(), pair.r_stride.tolist()
    gap_l = (pair.l_at0[1:] - pair.l_end0[:-1]).tolist()
    gap_r = (pair.r_at0[1:] - pair.r_end0[:-1]).tolist()
    classes: dict[tuple[int, ...], dict[Any, int]] = {}
    for b in range(len(gap_l)):
        gaps = classes.setdefault((part[b], part[b + 1], ls[b], ls[b + 1], rs[b], rs[b + 1]), {})
        gaps[gap_l[b], gap_r[b]] = gaps.get((gap_l[b], gap_r[b]), 0) + 1
    return [(*key, gaps) for key, gaps in classes.items()]


_SHAPES: dict[tuple[Any, ...], int] = {}  # interned pair shapes -> small int
_SHAPE_NUMBERS = itertools.count()  # never reused, also after _SHAPES is cleared
# shape -> (columns, answer) of the last transfer of that shape whose columns cannot change
# (a request's transfers to the ranks of an engine come one after another)
_RESULTS: dict[int, tuple[list[np.ndarray], Any]] = {}
_SIDE_SHAPES: dict[tuple[Any, ...], int] = {}  # interned one-side shapes -> small int
# one-side shape -> (that side's columns, runs token) of the last transfer with that side shape
# whose columns cannot change (a request's transfers to the ranks of an engine read into equal
# runs on the reading side even where the other side's rows differ: two answers, one token)
_SIDE_RUNS: dict[int, tuple[list[np.ndarray], "_Runs"]] = {}


class _Runs:
    """A token naming one side's byte runs relative to its first row's address (equal tokens:
    equal runs up to the shift), and those runs once made (:meth:`OuterPairs.extents`)."""

    __slots__ = ("ext",)

    def __init__(self) -> None:
        self.ext: tuple[np.ndarray, np.ndarray] | None = None


def _number_of(key: tuple[Any, ...], numbers: dict[tuple[Any, ...], int],
               by_number: dict[int, Any]) -> int:
    """The number ``numbers`` gives ``key``; a new key gets a new number (never reused). A
    full table is cleared first, and with it ``by_number`` (entries keyed by its numbers)."""
    got = numbers.get(key)
    if got is None:
        if len(numbers) >= _CACHE_LIMIT:
            numbers.clear()
            by_number.clear()
        got = numbers[key] = next(_SHAPE_NUMBERS)
    return got


def _side_shape_of(row_part: np.ndarray, at0: np.ndarray, shift: int, stride: np.ndarray,
                   length: np.ndarray) -> int:
    """A number naming one side's rows (their parts, addresses relative to ``shift``, strides
    and lengths): everything that side's byte runs depend on besides its columns."""
    key = (row_part.tobytes(), (at0 - shift).tobytes(), stride.tobytes(), length.tobytes())
    return _number_of(key, _SIDE_SHAPES, _SIDE_RUNS)


def _shape_of(pair: _Pair) -> int:
    """A number naming everything :func:`outer_pairs` derives from a pair besides the
    columns: the column bounds and kinds, bytes per column, the join classes, and both
    sides' rows relative to their first row's address (rows whose addresses differ only by
    one shift per side -- the ranks of an engine -- have the same shape)."""
    key: list[Any] = [pair.equal, tuple(pair.col_bytes), pair.row_part.tobytes()]
    for a, b, classes in zip(pair.local, pair.remote, pair.joins):
        key += (a.col_lo, a.col_hi, a.plain, b.col_lo, b.col_hi, b.plain,
                tuple(tuple(c) for c in classes))
    for at0, shift, stride, length in ((pair.l_at0, pair.l_shift, pair.l_stride, pair.l_len),
                                       (pair.r_at0, pair.r_shift, pair.r_stride, pair.r_len)):
        key += ((at0 - shift).tobytes(), stride.tobytes(), length.tobytes())
    return _number_of(tuple(key), _SHAPES, _RESULTS)


_CACHE_LIMIT = 4096  # pairs of (list, row starts) remembered; a run has a handful


class _Answer:
    """What :func:`outer_pairs` derives for a pair shape and columns: the bytes and NIXL's
    coalesced count."""

    __slots__ = ("nbytes", "coalesced")

    def __init__(self, nbytes: int, coalesced: int) -> None:
        self.nbytes, self.coalesced = nbytes, coalesced


class OuterPairs:
    """What :func:`outer_pairs` derived: the bytes, NIXL's coalesced count and each side's
    per-descriptor byte runs (computed when asked)."""

    __slots__ = ("pair", "lo", "ro", "answer", "_tokens")

    def __init__(self, pair: _Pair, lo: OuterIds, ro: OuterIds, answer: _Answer) -> None:
        self.pair, self.lo, self.ro, self.answer = pair, lo, ro, answer
        self._tokens: list[_Runs | None] = [None, None]

    @property
    def nbytes(self) -> int:
        return self.answer.nbytes

    @property
    def coalesced(self) -> int:
        return self.answer.coalesced

    def _runs(self, local: bool) -> _Runs:
        """The runs token of one side: shared by transfers whose rows on that side have the
        same shape (``_Pair.side_shapes``) and whose columns there are the same frozen arrays;
        columns that may change get a token of their own."""
        i = 0 if local else 1
        token = self._tokens[i]
        if token is not None:
            return token
        ids = self.lo if local else self.ro
        if not ids.frozen:
            token = _Runs()
        else:
            cols = [c for _, c in ids.parts]
            shape = self.pair.side_shapes[i]
            got = _SIDE_RUNS.get(shape)
            if got is not None and len(got[0]) == len(cols) and all(
                    a is b for a, b in zip(got[0], cols)):
                token = got[1]
            else:  # remembered (the entry keeps the columns: ids stay theirs)
                token = _Runs()
                _SIDE_RUNS[shape] = (cols, token)
        self._tokens[i] = token
        return token

    def runs_key(self, side: str) -> tuple[Any, str, int]:
        """(token, side, shift): transfers with the same token and side have the same byte
        runs on that side up to ``shift`` (the side's first row address), which
        :meth:`extents` adds."""
        local = side == "local"
        return (self._runs(local), side, self.pair.l_shift if local else self.pair.r_shift)

    def extents(self, side: str) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, lengths) int64, one per descriptor of one side, in id-list order (the
        lengths array is shared and read-only)."""
        local = side == "local"
        shift = self.pair.l_shift if local else self.pair.r_shift
        token = self._runs(local)
        got = token.ext
        if got is None:
            rows, ids = (self.pair.local, self.lo) if local else (self.pair.remote, self.ro)
            addrs, lengths = [], []
            for r, (_, cols) in zip(rows, ids.parts):
                addrs.append(((r.at0 - shift)[:, None] + cols[None, :] * r.stride[:, None]
                              ).reshape(-1))
                lengths.append(np.repeat(r.length, cols.size))
            if len(addrs) == 1:
                got = (addrs[0], lengths[0])
            else:
                got = (np.concatenate(addrs), np.concatenate(lengths))
            got[0].flags.writeable = got[1].flags.writeable = False
            token.ext = got
        return got[0] + shift, got[1]


def _rows(dl: AffineList, starts: np.ndarray, cache: dict[Any, Any]) -> _Rows:
    # an entry keeps its list and row starts alive, so their ids cannot name other objects
    key = (id(dl), id(starts))
    got = cache.get(key)
    if got is None:
        got = cache[key] = (dl, _Rows(dl, starts))
    return got[1]


_SMALL = 16  # columns up to this many are handled as Python ints (fewer numpy calls)


def _col_stats(cols: np.ndarray) -> tuple[int, int, int, int]:
    """(min, max, first, last) of a non-empty column array, as Python ints."""
    if cols.size <= _SMALL:
        v = cols.tolist()
        return min(v), max(v), v[0], v[-1]
    return int(cols.min()), int(cols.max()), cols.item(0), cols.item(-1)


def _joins_small(lc: np.ndarray, rc: np.ndarray, classes: list[tuple[int, ...]]) -> int:
    """:func:`_joins` for a few columns, in Python ints."""
    lv, rv = lc.tolist(), rc.tolist()
    steps = [(b - a, d - c) for a, b, c, d in zip(lv, lv[1:], rv, rv[1:])]
    return sum(m * sum(1 for dl, dr in steps if dl * ls == ln and dr * rs == rn)
               for m, ls, ln, rs, rn in classes)


def _joins(lc: np.ndarray, rc: np.ndarray, classes: list[tuple[int, ...]]) -> int:
    """Joins inside rows: consecutive columns that continue the previous descriptor on both
    sides (addresses step by the column step times the row's stride), summed over the row
    classes (rows, local stride, local length, remote stride, remote length)."""
    if lc.size <= _SMALL:
        return _joins_small(lc, rc, classes)
    dl, dr = lc[1:] - lc[:-1], rc[1:] - rc[:-1]
    within = 0
    for m, ls, ln, rs, rn in classes:
        jl = dl == 1 if ls == ln > 0 else dl * ls == ln
        jr = dr == 1 if rs == rn > 0 else dr * rs == rn
        within += m * int(np.count_nonzero(jl & jr))
    return within


def pair_geometry(local: AffineList, lo: OuterIds, remote: AffineList, ro: OuterIds,
                  cache: dict[Any, Any]) -> "_Pair | None":
    """What two affine lists say about the rows of two OuterIds (cached in ``cache`` per list
    and row starts): each row's segment, column bounds, first address, stride and length
    per side. None when the parts do not pair (their number, or a part's rows, differ)."""
    parts_l, parts_r = lo.parts, ro.parts
    if not parts_l or len(parts_l) != len(parts_r):
        return None
    if len(parts_l) == 2:  # the connector's: attention and state (the same key, built inline)
        key: tuple[int, ...] = (id(local), id(remote), id(parts_l[0][0]), id(parts_l[1][0]),
                                id(parts_r[0][0]), id(parts_r[1][0]))
    else:
        key = (id(local), id(remote), *[id(a[0]) for a in parts_l + parts_r])
    pair = cache.get(key)
    if pair is None:
        for (ls, _), (rs, _) in zip(parts_l, parts_r):
            if ls.size != rs.size:
                return None
        if len(cache) > _CACHE_LIMIT:
            cache.clear()
        pair = cache[key] = _Pair([_rows(local, s, cache) for s, _ in parts_l],
                                  [_rows(remote, s, cache) for s, _ in parts_r],
                                  (local, remote, [a[0] for a in parts_l],
                                   [b[0] for b in parts_r]))
    return pair


def outer_pairs(local: AffineList, lo: OuterIds, remote: AffineList, ro: OuterIds,
                cache: dict[Any, Any]) -> OuterPairs | None:
    """Check a transfer's paired ids given as outer sums over two affine lists, from their
    structure (see the module docstring). None when the structure does not settle it (the
    caller then checks the flat ids). ``cache``: a dict the caller keeps (geometry per list
    and row starts; an entry keeps what its key names alive)."""
    pair = pair_geometry(local, lo, remote, ro, cache)
    if pair is None:
        return None
    parts_l, parts_r = lo.parts, ro.parts
    # the same shape and the same columns: the same answer (a request's transfers to the
    # ranks of an engine). Remembered only for frozen columns (never modified: the
    # connector's paired ids), by identity
    cols = [c for _, c in parts_l] + [c for _, c in parts_r]
    got = _RESULTS.get(pair.shape)  # the last answer for this shape, and its columns
    if got is not None and len(got[0]) == len(cols):
        for a, b in zip(got[0], cols):
            if a is not b:
                break
        else:
            return None if got[1] is None else OuterPairs(pair, lo, ro, got[1])
    answer = _answer(pair, parts_l, parts_r, lo.size, lo.ranges, ro.ranges)
    if lo.frozen and ro.frozen:  # remembered (the entry keeps the columns: ids stay theirs)
        _RESULTS[pair.shape] = (cols, answer)
    return None if answer is None else OuterPairs(pair, lo, ro, answer)


def _answer(pair: _Pair, parts_l: tuple[tuple[np.ndarray, np.ndarray], ...],
            parts_r: tuple[tuple[np.ndarray, np.ndarray], ...], size: int,
            lo_ranges: "tuple[bool, ...] | None" = None,
            ro_ranges: "tuple[bool, ...] | None" = None) -> _Answer | None:
    """The checks and counts of :func:`outer_pairs` for one pair and columns (None: the
    structure does not settle them). ``lo_ranges`` / ``ro_ranges``: OuterIds.ranges."""
    if not pair.equal:
        return None
    nbytes = within = 0
    ends = []
    ranges_l, ranges_r = lo_ranges or (), ro_ranges or ()
    for p, ((_, lc), (_, rc), a, b, cb, classes) in enumerate(zip(
            parts_l, parts_r, pair.local, pair.remote, pair.col_bytes, pair.joins)):
        k = lc.size
        if k != rc.size or not (a.plain and b.plain):
            return None
        # columns known to be consecutive ids (OuterIds.ranges) are not read: first + k - 1
        l_range = p < len(ranges_l) and ranges_l[p]
        r_range = p < len(ranges_r) and ranges_r[p]
        if l_range:
            lmin = l0 = lc.item(0)
            lmax = ll = l0 + k - 1
        else:
            lmin, lmax, l0, ll = _col_stats(lc)
        if r_range:
            rmin = r0 = rc.item(0)
            rmax = rl = r0 + k - 1
        else:
            rmin, rmax, r0, rl = _col_stats(rc)
        if not (a.col_lo <= lmin and lmax <= a.col_hi and b.col_lo <= rmin and rmax <= b.col_hi):
            return None
        if k > 1:
            if l_range and r_range:  # every step is 1 on both sides (see _joins)
                within += (k - 1) * sum([m for m, ls, ln, rs, rn in classes
                                         if ls == ln and rs == rn])
            else:
                within += _joins(lc, rc, classes)
        nbytes += cb * k
        ends.append((l0, ll, r0, rl))
    # joins between rows: a row's last descriptor and the next row's first (see _boundaries)
    between = 0
    for p0, p1, ls0, ls1, rs0, rs1, gaps in pair.boundaries:
        between += gaps.get((ends[p0][1] * ls0 - ends[p1][0] * ls1,
                             ends[p0][3] * rs0 - ends[p1][2] * rs1), 0)
    return _Answer(nbytes, size - within - between)
