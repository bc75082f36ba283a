"""How many descriptors a NIXL transfer really posts once NIXL has coalesced it.

NIXL merges a run of consecutive descriptor pairs when each pair continues the previous one on
BOTH sides: same device, and address = previous address + previous length, locally and
remotely (docs/semantics.md §10). Only runs in posting order merge: a list in descending address
order, or one whose remote side is shuffled, stays as posted. Measured with NIXL 1.5.1 telemetry
(``descCount``) on DRAM/UCX: 64 adjacent 4 KiB pairs posted with ``make_prepped_xfer`` -> 1; the
same list reversed -> 64; every other pair -> 32; local 0..7 against remote 0..3, 5..8 -> 2.
A non-prepped ``initialize_xfer`` of the same 64 adjacent pairs -> 64 (no coalescing); strided
lists are prepared lists, so they coalesce.

The merge happens in NIXL's core when a transfer is made, before a backend sees it, so the rule
is the same whatever UCX transport moves the bytes (cma, cuda_ipc, rc); only the NIXL version
matters (``COALESCING``; 1.5.1 is the only one measured). The simulated transport charges its
posting cost per coalesced descriptor (what the backend posts), and reports the posted and the
coalesced counts apart.
"""

from __future__ import annotations

import functools
from typing import Final

import numpy as np

from .planned import coalesced_of

__all__ = ["COALESCING", "coalesced_count", "coalesces"]

#: NIXL behaviour by (major.minor) version, as measured: whether prepared transfers
#: (``make_prepped_xfer``, strided lists) and non-prepped ones (``initialize_xfer``) coalesce.
#: Versions not listed are assumed to behave like the newest listed one.
COALESCING: Final[dict[str, dict[str, bool]]] = {
    "1.5": {"prepped": True, "non_prepped": False},
}
_NEWEST: Final[str] = max(COALESCING, key=lambda v: tuple(int(p) for p in v.split(".")))


@functools.lru_cache(maxsize=64)
def coalesces(kind: str, nixl_version: str | None = None) -> bool:
    """Whether a transfer of ``kind`` ("prepped" or "non_prepped") is coalesced by NIXL."""
    table = COALESCING.get(".".join((nixl_version or _NEWEST).split(".")[:2]),
                           COALESCING[_NEWEST])
    if kind not in table:
        raise ValueError(f"transfer kind {kind!r}; allowed: {', '.join(table)}")
    return table[kind]


def coalesced_count(local: np.ndarray, remote: np.ndarray) -> int:
    """Descriptors left after merging, in order, every pair that continues the previous pair on
    both sides. ``local`` and ``remote`` are (N, 3) (addr, len, device) rows, paired by row."""
    got = coalesced_of(local, remote)  # runs of PlannedRows: the template's count
    if got is not None:
        return got
    n = int(local.shape[0])
    if n != int(remote.shape[0]):
        raise ValueError(f"local and remote lists differ in length ({n} vs {remote.shape[0]})")
    if n <= 1:
        return n
    la = local.astype(np.uint64, copy=False)
    ra = remote.astype(np.uint64, copy=False)
    joins = (la[1:, 0] == la[:-1, 0] + la[:-1, 1]) & (ra[1:, 0] == ra[:-1, 0] + ra[:-1, 1])
    if not joins.any():  # (the devices matter only where both sides continue)
        return n
    joins &= (la[1:, 2] == la[:-1, 2]) & (ra[1:, 2] == ra[:-1, 2])
    return n - int(np.count_nonzero(joins))
