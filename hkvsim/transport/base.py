"""The NIXL-shaped transport surface the connector core talks to.

``SimTransport`` (simulated fabric) and ``NixlTransport`` (real NIXL agents) implement it. The
connector only ever sees this protocol: register memory, exchange agent metadata, prepare
descriptor lists, post READ/WRITE with a notification, poll, release, notifications, telemetry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["DONE", "PROC", "ERR", "TransportError", "Memory", "XferTelemetry", "Transport",
           "check_descriptor_array", "check_paired_ids", "check_strided_array",
           "expand_strided"]

DONE, PROC, ERR = "DONE", "PROC", "ERR"
OPS = ("READ", "WRITE")


class TransportError(RuntimeError):
    """A transport call failed. ``kind`` classifies it for the failure path."""

    def __init__(self, message: str, *, kind: str = "transfer_setup_failed") -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True, eq=False)
class Memory:
    """A cache allocation: its base address as the transport sees it, and a uint8 view of it."""

    base_addr: int
    array: np.ndarray  # uint8, length = nbytes
    mem_type: str  # "VRAM" or "DRAM"
    device_id: int = 0

    @property
    def nbytes(self) -> int:
        return int(self.array.shape[0])


@dataclass(frozen=True, kw_only=True)
class XferTelemetry:
    nbytes: int
    descriptors: int
    post_seconds: float  # time to post (launch + per-descriptor cost)
    transfer_seconds: float  # post end to data complete
    submitted: float
    completed: float | None
    path: tuple[str, ...] = ()


def check_descriptor_array(descs: np.ndarray, *, what: str = "descriptor list") -> np.ndarray:
    """Validate an (N, 3) (addr, len, device) array before it reaches a transport.

    NIXL returns None on malformed input (DOMAIN.md §11.4 hazard 3); we refuse it loudly.
    """
    arr = np.asarray(descs)
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise TransportError(f"{what} must be an (N, 3) array of (addr, len, device); got shape "
                             f"{arr.shape}")
    if arr.dtype.kind not in "ui":
        raise TransportError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
        raise TransportError(f"{what} holds a negative address, length or device")
    return arr.astype(np.uint64, copy=False)


def check_strided_array(descs: np.ndarray, *, what: str = "strided descriptor list") -> np.ndarray:
    """Validate an (N, 5) strided array: rows (addr, len, dev, stride, count) naming ``count``
    runs of ``len`` bytes at ``addr + i * stride`` (NIXL PR #1978; DOMAIN.md §11.3 item 4).
    ``count`` >= 1, and ``stride`` >= ``len`` wherever count > 1 (runs never overlap)."""
    arr = np.asarray(descs)
    if arr.ndim != 2 or arr.shape[1] != 5:
        raise TransportError(f"{what} must be an (N, 5) array of (addr, len, device, stride, "
                             f"count); got shape {arr.shape}")
    if arr.dtype.kind not in "ui":
        raise TransportError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
        raise TransportError(f"{what} holds a negative field")
    arr = arr.astype(np.uint64, copy=False)
    if arr.size and (arr[:, 4] < 1).any():
        raise TransportError(f"{what}: a row has count 0")
    multi = arr[:, 4] > 1
    if (arr[multi, 3] < arr[multi, 1]).any():
        raise TransportError(f"{what}: a row's stride is smaller than its length (runs overlap)")
    return arr


def expand_strided(rows: np.ndarray) -> np.ndarray:
    """The (N, 3) (addr, len, device) runs an (M, 5) strided array names, row by row."""
    arr = np.asarray(rows, dtype=np.uint64)
    counts = arr[:, 4].astype(np.int64)
    if counts.size and (counts == 1).all():
        return np.ascontiguousarray(arr[:, :3])
    row = np.repeat(np.arange(counts.size), counts)
    within = (np.arange(int(counts.sum()), dtype=np.int64)
              - np.repeat(np.cumsum(counts) - counts, counts)).astype(np.uint64)
    out = np.empty((row.size, 3), dtype=np.uint64)
    out[:, 0] = arr[row, 0] + within * arr[row, 3]
    out[:, 1] = arr[row, 1]
    out[:, 2] = arr[row, 2]
    return out


def check_paired_ids(local_descs: np.ndarray, local_ids: np.ndarray, remote_descs: np.ndarray,
                     remote_ids: np.ndarray, *, what: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate a transfer's paired descriptor ids against two prepared lists: equal-length 1-D
    id lists, every id inside its list, and equal lengths pair by pair (NIXL answers all of these
    with a bare NOT_FOUND). Returns the int64 id arrays and the total bytes."""
    li = np.ascontiguousarray(local_ids, dtype=np.int64)
    ri = np.ascontiguousarray(remote_ids, dtype=np.int64)
    if li.ndim != 1 or li.shape != ri.shape:
        raise TransportError(f"{what}: local and remote id lists differ in length "
                             f"({li.size} vs {ri.size})")
    for ids, descs, side in ((li, local_descs, "local"), (ri, remote_descs, "remote")):
        n = descs.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            bad = int(np.flatnonzero((ids < 0) | (ids >= n))[0])
            raise TransportError(
                f"{what}: {side} descriptor id out of range at index {bad} (id "
                f"{int(ids[bad])}); ids span [{ids.min()}, {ids.max()}], the {side} list "
                f"has {n} descriptors")
    ll, rl = local_descs[li, 1], remote_descs[ri, 1]
    if not np.array_equal(ll, rl):
        i = int(np.flatnonzero(ll != rl)[0])
        raise TransportError(f"{what}: descriptor pair {i} (local id {int(li[i])}, remote id "
                             f"{int(ri[i])}) has local length {int(ll[i])} but remote length "
                             f"{int(rl[i])}")
    return li, ri, int(ll.sum())


@runtime_checkable
class Transport(Protocol):
    """One agent per rank, shaped like ``nixl_agent``."""

    name: str

    def allocate(self, nbytes: int, *, mem_type: str = "VRAM", device_id: int = 0) -> Memory: ...

    def register_memory(self, memory: Memory) -> None: ...

    def deregister_memory(self, memory: Memory) -> None: ...

    def get_agent_metadata(self) -> bytes: ...

    def add_remote_agent(self, metadata: bytes) -> str: ...

    def remove_remote_agent(self, name: str) -> None: ...

    def prep_xfer_dlist(self, agent: str, descs: np.ndarray) -> int:
        """``agent`` = "" for a local list, else the remote agent's name."""
        ...

    def release_dlist_handle(self, handle: int) -> None: ...

    def make_prepped_xfer(self, op: str, local_dlist: int, local_ids: np.ndarray, remote_dlist: int,
                          remote_ids: np.ndarray, notif: bytes = b"") -> int: ...

    def make_xfer(self, op: str, local_descs: np.ndarray, remote_agent: str,
                  remote_descs: np.ndarray, notif: bytes = b"") -> int:
        """A non-prepped transfer (NIXL ``initialize_xfer``): explicit descriptors on both
        sides, paired by position, instead of ids into prepared lists. Either two (N, 3)
        (addr, len, device) arrays, or two (N, 5) strided arrays (addr, len, device, stride,
        count) with equal len and count per row (NIXL's strided form; a real backend prepares
        them as strided lists and posts every run). Used by ``descriptor_merge``."""
        ...

    def transfer(self, handle: int) -> str: ...

    def check_xfer_state(self, handle: int) -> str: ...

    def release_xfer_handle(self, handle: int) -> None: ...

    def send_notif(self, agent: str, message: bytes) -> None: ...

    def get_new_notifs(self) -> dict[str, list[bytes]]: ...

    def get_xfer_telemetry(self, handle: int) -> XferTelemetry: ...

    def open_handles(self) -> int:
        """Transfer handles posted or created and not yet released (leak accounting)."""
        ...
