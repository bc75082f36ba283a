"""Rows of a non-prepped transfer made from a template (issue #14, planning with merging).

The connector merges a transfer's descriptors into rows (connector/merge.py) and posts them
with ``Transport.make_xfer``. Transfers whose ids have the same structure (the same geometry,
merge mode and columns up to one shift per part and side) merge into the same rows up to one
address shift per row (connector/templates.py), so the connector computes such rows from a
template instead of merging again. :class:`PlannedRows` hands them to a transport together
with their per-run expansion and the template's ``token``: rows of one token differ from one
another only in their addresses (each row, and the runs it names, shifted by one amount).

Every check ``pair_descriptors`` makes on rows (shape, counts, strides, equal lengths and
counts on both sides, no zero length) is blind to such shifts, so it checks the rows of a
token in full the first time it sees the token (and that the given expansion is the rows'
expansion), and afterwards takes the expansion as given. The checks that depend on addresses
(registration, coalescing) run on every transfer, as for any rows; the registration check
starts from the hull the template gives (one range holding it holds every run; otherwise
the runs are checked one by one). ``np.asarray`` gives the
plain rows: any other consumer sees an ordinary (M, 3) or (M, 5) array.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["PlannedRows", "runs_hull", "vouch", "hull_of", "coalesced_of", "nbytes_of"]


# the runs of the last transfer whose PlannedRows were taken as given (vouch) -> their facts
_LAST: dict[int, tuple[Any, ...]] = {}


def vouch(local: PlannedRows, remote: PlannedRows) -> None:
    """pair_descriptors hands out the runs of checked PlannedRows: remember their facts for
    the rest of the same transfer's checks (hull_of, coalesced_of), by identity. The runs are
    made read-only; only the last transfer's are remembered."""
    global _LAST
    lr, rr = local.runs, remote.runs
    lr.flags.writeable = rr.flags.writeable = False
    _LAST = {id(lr): (lr, local.hull, rr, local.coalesced, local.nbytes),
             id(rr): (rr, remote.hull, None, None, None)}


def hull_of(runs: np.ndarray) -> tuple[int, int, int] | None:
    """The hull of runs just vouched for, else None."""
    got = _LAST.get(id(runs))
    return got[1] if got is not None and got[0] is runs else None


def coalesced_of(local: np.ndarray, remote: np.ndarray) -> int | None:
    """NIXL's coalesced count of a pair of runs just vouched for, else None."""
    got = _LAST.get(id(local))
    return got[3] if got is not None and got[0] is local and got[2] is remote else None


def nbytes_of(local: np.ndarray) -> int | None:
    """The bytes of the local runs of a transfer just vouched for (their lengths' sum),
    else None."""
    got = _LAST.get(id(local))
    return got[4] if got is not None and got[0] is local else None


def runs_hull(runs: np.ndarray) -> tuple[int, int, int] | None:
    """(device, lowest address, highest end) of non-empty uint64 (N, 3) runs on one device
    whose ends do not wrap, else None."""
    if not runs.shape[0]:
        return None
    amin, _, dmin = runs.min(axis=0).tolist()
    amax, lmax, dmax = runs.max(axis=0).tolist()
    if dmin != dmax or amax + lmax >= 1 << 64:
        return None
    return dmin, amin, int((runs[:, 0] + runs[:, 1]).max())


class PlannedRows:
    """One side's rows (``rows``: (M, 3) or (M, 5) uint64), their per-run (N, 3) uint64
    expansion (``runs``; the rows themselves when M x 3), the template they came from
    (``token``, the same object on both sides of a transfer) and the runs' hull (``hull``:
    device, lowest address, highest end) and, on the local side, NIXL's coalesced count of the
    runs of both sides (``coalesced``; None: not known) and the bytes of its runs (``nbytes``,
    the sum of their lengths; None: not known) -- all computed from the template and compared
    with the runs' own when the token is checked."""

    __slots__ = ("rows", "runs", "token", "hull", "coalesced", "nbytes")

    def __init__(self, rows: np.ndarray, runs: np.ndarray, token: Any,
                 hull: tuple[int, int, int], coalesced: int | None = None,
                 nbytes: int | None = None) -> None:
        self.rows, self.runs, self.token, self.hull = rows, runs, token, hull
        self.coalesced = coalesced  # NIXL's coalesced count of the runs of both sides
        self.nbytes = nbytes  # the runs' bytes (local side)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.rows.shape

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return self.rows if dtype is None else self.rows.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"PlannedRows({self.rows.shape[0]} rows, {self.runs.shape[0]} runs)"
