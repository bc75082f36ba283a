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

from collections.abc import Sequence
from typing import Any

import numpy as np

from .affine import AffineList

__all__ = ["OuterIds", "OuterPairs", "outer_pairs"]

_EMPTY = np.zeros(0, dtype=np.int64)


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
    id and are dropped. ``np.asarray`` gives the flat int64 ids."""

    __slots__ = ("parts", "size", "_flat")

    def __init__(self, parts: Sequence[tuple[Any, Any]]) -> None:
        kept = []
        for starts, cols in parts:
            s, c = _int64(starts, "row starts"), _int64(cols, "columns")
            if s.size and c.size:
                kept.append((s, c))
        self.parts: tuple[tuple[np.ndarray, np.ndarray], ...] = tuple(kept)
        self.size = sum(s.size * c.size for s, c in kept)
        self._flat: np.ndarray | None = None

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

    __slots__ = ("starts", "col_lo", "col_hi", "plain", "at0", "stride", "length")

    def __init__(self, dl: AffineList, starts: np.ndarray) -> None:
        self.starts = starts  # kept alive: the cache is keyed by its id
        if not len(dl):  # an empty list: no row is inside it
            self.col_lo, self.col_hi, self.plain = 1, 0, True
            self.stride = self.length = self.at0 = np.zeros(starts.shape, dtype=np.int64)
            return
        seg = dl.segments(starts)
        inside = (seg >= 0)
        seg = np.where(inside, seg, 0)
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
                 "l_at0", "l_stride", "l_len", "r_at0", "r_stride", "r_len", "l_end0", "r_end0")

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


_CACHE_LIMIT = 4096  # pairs of (list, row starts) remembered; a run has a handful


class OuterPairs:
    """What :func:`outer_pairs` derived: the bytes, NIXL's coalesced count and each side's
    per-descriptor byte runs (computed when asked)."""

    def __init__(self, pair: _Pair, lo: OuterIds, ro: OuterIds, nbytes: int,
                 coalesced: int) -> None:
        self.pair, self.lo, self.ro, self.nbytes, self.coalesced = pair, lo, ro, nbytes, coalesced

    def extents(self, side: str) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, lengths) int64, one per descriptor of one side, in id-list order."""
        rows, ids = ((self.pair.local, self.lo) if side == "local"
                     else (self.pair.remote, self.ro))
        addrs, lengths = [], []
        for r, (_, cols) in zip(rows, ids.parts):
            addrs.append((r.at0[:, None] + cols[None, :] * r.stride[:, None]).reshape(-1))
            lengths.append(np.repeat(r.length, cols.size))
        if len(addrs) == 1:
            return addrs[0], lengths[0]
        return np.concatenate(addrs), np.concatenate(lengths)


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
    return int(cols.min()), int(cols.max()), int(cols[0]), int(cols[-1])


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


def outer_pairs(local: AffineList, lo: OuterIds, remote: AffineList, ro: OuterIds,
                cache: dict[Any, Any]) -> OuterPairs | None:
    """Check a transfer's paired ids given as outer sums over two affine lists, from their
    structure (see the module docstring). None when the structure does not settle it (the
    caller then checks the flat ids). ``cache``: a dict the caller keeps (geometry per list
    and row starts; an entry keeps what its key names alive)."""
    parts_l, parts_r = lo.parts, ro.parts
    if not parts_l or len(parts_l) != len(parts_r):
        return None
    key = (id(local), id(remote), *[id(a[0]) for a in parts_l], *[id(b[0]) for b in parts_r])
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
    if not pair.equal:
        return None
    nbytes = within = 0
    ends = []
    for (_, lc), (_, rc), a, b, cb, classes in zip(parts_l, parts_r, pair.local, pair.remote,
                                                   pair.col_bytes, pair.joins):
        k = lc.size
        if k != rc.size or not (a.plain and b.plain):
            return None
        lmin, lmax, l0, ll = _col_stats(lc)
        rmin, rmax, r0, rl = _col_stats(rc)
        if not (a.col_lo <= lmin and lmax <= a.col_hi and b.col_lo <= rmin and rmax <= b.col_hi):
            return None
        if k > 1:
            within += _joins(lc, rc, classes)
        nbytes += cb * k
        ends.append((l0, ll, r0, rl))
    between = 0
    if pair.l_at0.size > 1:  # joins between rows: a row's last descriptor, the next's first
        if len(ends) == 1:
            fl, la, fr, lr = ends[0]
        else:
            per_row = np.array(ends, dtype=np.int64)[pair.row_part]
            fl, la, fr, lr = per_row[:, 0], per_row[:, 1], per_row[:, 2], per_row[:, 3]
        tail_l = pair.l_end0 + la * pair.l_stride
        tail_r = pair.r_end0 + lr * pair.r_stride
        head_l = pair.l_at0 + fl * pair.l_stride
        head_r = pair.r_at0 + fr * pair.r_stride
        between = int(np.count_nonzero((head_l[1:] == tail_l[:-1]) & (head_r[1:] == tail_r[:-1])))
    return OuterPairs(pair, lo, ro, nbytes, lo.size - within - between)
