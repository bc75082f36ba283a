"""The NIXL-shaped transport surface the connector core talks to.

``SimTransport`` (simulated fabric) and ``NixlTransport`` (real NIXL agents) implement it. The
connector only ever sees this protocol: register memory, exchange agent metadata, prepare
descriptor lists, post READ/WRITE with a notification, poll, release, notifications, telemetry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import msgpack
import numpy as np

from .affine import AffineList, PairedRuns
from .outer import OuterIds, OuterPairs, outer_pairs
from .coalesce import coalesced_count
from .planned import PlannedRows, hull_of, runs_hull, vouch

__all__ = ["DONE", "PROC", "ERR", "MEM_TYPES", "TransportError", "Memory", "XferTelemetry",
           "Transport", "AgentAnnouncement", "PeerRegistrations", "check_descriptor_array",
           "check_handle", "check_mem_type", "check_op", "live_list", "held_resources", "releasable_xfer", "check_paired_ids", "check_prep_descriptors",
           "check_strided_array", "registration_problem", "PairedDescriptors", "pair_descriptors",
           "decode_agent_metadata", "encode_agent_metadata", "expand_strided", "overlapping",
           "AffineList", "CheckedPairs", "check_pairs", "list_rows"]

DONE, PROC, ERR = "DONE", "PROC", "ERR"
OPS = ("READ", "WRITE")
MEM_TYPES = ("DRAM", "VRAM")  # case-sensitive, as NIXL's (a wrong one is a bare KeyError there)
MAX_AGENT_METADATA = 1 << 20
MAX_ANNOUNCED_REGIONS = 1 << 10
_UINT64 = np.dtype(np.uint64)


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
    # descriptors the backend posted after NIXL's own coalescing of pairs adjacent on both
    # sides (hkvsim.transport.coalesce); None when the backend did not say
    coalesced: int | None = None
    # real backends only: what hkvsim's coalescing model predicts for the descriptor lists this
    # transfer really posted (checks the model against ``coalesced`` from NIXL's telemetry,
    # independently of which block ids the run happened to allocate); None on the simulator,
    # whose ``coalesced`` is the model itself
    coalesced_model: int | None = None
    # real backends only: the remote agent's name (``<engine>.<rank>``), so a run can tell which
    # rank a transfer waited on; None on the simulator
    peer: str | None = None


def check_mem_type(mem_type: Any, *, what: str) -> str:
    if not isinstance(mem_type, str) or mem_type not in MEM_TYPES:
        raise TransportError(f"{what}: memory type {mem_type!r:.40}; allowed: "
                             f"{', '.join(MEM_TYPES)}")
    return mem_type


def check_handle(handle: Any, *, what: str) -> int:
    """A transfer or list handle must be an int this transport gave out (not a bool or float)."""
    if type(handle) is int:  # the common case (bool is a subclass, not the type)
        return handle
    if not isinstance(handle, (int, np.integer)) or isinstance(handle, (bool, np.bool_)):
        raise TransportError(f"{what}: handle must be an int, got {type(handle).__name__} "
                             f"{handle!r:.40}")
    return int(handle)


def check_op(op: str, *, owner: str) -> str:
    """READ or WRITE (NIXL raises a bare KeyError for a wrong or lower-case op)."""
    if op not in OPS:
        raise TransportError(f"{owner}: unknown op {op!r}; allowed: {', '.join(OPS)}")
    return op


def live_list(lists: dict[int, Any], handle: Any, *, owner: str, side: str) -> Any:
    """The prepared descriptor list ``handle`` names in a transport's ledger ``lists``, if it is
    still usable: not released, not unknown, not stale (its memory withdrawn). One lookup for
    every transport, so the simulator refuses exactly the handles NIXL refuses."""
    dl = lists.get(check_handle(handle, what=f"{owner}: {side} list"))
    if dl is None or dl.released:
        raise TransportError(f"{owner}: {side} descriptor list {handle} is released or unknown")
    if dl.stale is not None:
        raise TransportError(f"{owner}: {side} descriptor list {handle} is stale: {dl.stale}")
    return dl


def releasable_xfer(xfers: dict[int, Any], handle: int, *, owner: str) -> Any:
    """The ledger's transfer ``handle`` if it may be released now; None if it is unknown or
    already released (releasing twice is a no-op, as in NIXL). A transfer still in PROC is
    refused on every transport: its DMA may be live (docs/semantics.md §11.4)."""
    x = xfers.get(handle)
    if x is None or x.released:
        return None
    if x.state == PROC:
        raise TransportError(f"{owner}: cannot release transfer {handle} while it is "
                             f"active (DMA may be live)")
    return x


def held_resources(xfers: dict[int, Any], lists: dict[int, Any], *, remote_agents: int,
                   registered_memory: int) -> dict[str, int]:
    """What a transport still holds, counted from its ledger (all zero after a clean shutdown);
    the same keys on every transport, so leak checks compare backends field by field."""
    return {"transfer_handles": sum(1 for x in xfers.values() if not x.released),
            "dlist_handles": sum(1 for d in lists.values() if not d.released),
            "remote_agents": remote_agents, "registered_memory": registered_memory}


def _ids(ids: Any, *, what: str, side: str) -> np.ndarray:
    """Descriptor ids as int64: integers only (a float id would be silently truncated)."""
    arr = np.asarray(ids)
    if arr.size and arr.dtype.kind not in "iu":
        raise TransportError(f"{what}: {side} descriptor ids must be integers, got dtype "
                             f"{arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise TransportError(f"{what}: {side} descriptor id {int(arr.max())} out of range")
    return np.ascontiguousarray(arr, dtype=np.int64)


def check_descriptor_array(descs: np.ndarray, *, what: str = "descriptor list") -> np.ndarray:
    """Validate an (N, 3) (addr, len, device) array before it reaches a transport.

    NIXL returns None on malformed input (docs/semantics.md §11.4 hazard 3); we refuse it loudly.
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
    runs of ``len`` bytes at ``addr + i * stride`` (NIXL PR #1978; docs/semantics.md §11.3 item 4).
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
    return _expand_strided((np.asarray(rows, dtype=np.uint64),))[0]


def _expand_strided(sides: tuple[np.ndarray, ...]) -> list[np.ndarray]:
    """:func:`expand_strided` of uint64 (M, 5) arrays with the same counts (column 4), the
    run numbering shared."""
    counts = sides[0][:, 4].astype(np.int64)
    if counts.size and (counts == 1).all():
        return [np.ascontiguousarray(arr[:, :3]) for arr in sides]
    within = (np.arange(int(counts.sum()), dtype=np.int64)
              - np.repeat(np.cumsum(counts) - counts, counts)).astype(np.uint64)
    out = []
    for arr in sides:
        rep = np.repeat(arr, counts, axis=0)  # each row once per run it names
        runs = np.ascontiguousarray(rep[:, :3])
        runs[:, 0] += within * rep[:, 3]
        out.append(runs)
    return out


def list_rows(descs: "np.ndarray | AffineList", ids: np.ndarray) -> np.ndarray:
    """(n, 3) uint64 rows of ``ids`` (already checked) in a prepared list of either form."""
    return descs.rows(ids) if isinstance(descs, AffineList) else descs[ids]


def _list_size(descs: "np.ndarray | AffineList") -> int:
    return len(descs) if isinstance(descs, AffineList) else int(descs.shape[0])


#: transfers of at least this many descriptors over two affine lists are analysed per run of
#: consecutive ids; smaller ones per descriptor (fewer numpy calls). Both give the same answers.
RUNS_FROM = 2048


class CheckedPairs:
    """A transfer's paired ids, checked (:func:`check_pairs`): the ids, the bytes, and what a
    transport derives from the rows -- NIXL's coalesced count, each side's rows, the byte runs
    of a side. Over two affine lists it works on runs of consecutive ids (no per-descriptor
    addresses unless rows are asked for); over explicit rows, on the rows."""

    def __init__(self, li: np.ndarray, ri: np.ndarray, nbytes: int, *,
                 runs: "PairedRuns | None" = None, lrows: np.ndarray | None = None,
                 rrows: np.ndarray | None = None, outer: OuterPairs | None = None,
                 descs: tuple[Any, Any] | None = None) -> None:
        self.nbytes = nbytes
        self._li, self._ri = li, ri
        self._runs, self._rows = runs, {"local": lrows, "remote": rrows}
        self._outer, self._descs = outer, descs

    @property
    def li(self) -> np.ndarray:
        """The local ids (int64, flat)."""
        return np.asarray(self._li)

    @property
    def ri(self) -> np.ndarray:
        """The remote ids (int64, flat)."""
        return np.asarray(self._ri)

    def ids(self) -> tuple[Any, Any]:
        """(local, remote) ids as given: flat arrays, or OuterIds (flattened when used)."""
        return self._li, self._ri

    @property
    def runs(self) -> "PairedRuns | None":
        """The joint runs of consecutive ids (two affine lists), else None."""
        return self._runs

    def rows(self, side: str) -> np.ndarray:
        rows = self._rows[side]
        if rows is None:
            if self._runs is not None:
                rows = self._runs.rows(side)
            else:
                assert self._descs is not None
                rows = list_rows(self._descs[side == "remote"],
                                 self.li if side == "local" else self.ri)
            self._rows[side] = rows
        return rows

    def coalesced(self) -> int:
        """Descriptors left after NIXL coalesces pairs adjacent on both sides."""
        if self._outer is not None:
            return self._outer.coalesced
        from .coalesce import coalesced_count

        n = self._runs.coalesced() if self._runs is not None else None
        return n if n is not None else coalesced_count(self.rows("local"), self.rows("remote"))

    def runs_key(self, side: str) -> "tuple[Any, str, int] | None":
        """For ids checked from their structure: (token, side, shift), equal for transfers
        whose byte runs on ``side`` are the same up to ``shift`` (see OuterPairs.runs_key);
        else None."""
        return None if self._outer is None else self._outer.runs_key(side)

    def extents(self, side: str) -> tuple[np.ndarray, np.ndarray]:
        """(addresses, lengths) int64 byte runs naming exactly one side's bytes, each inside
        one registered region's segment (contiguous descriptors may come as one run)."""
        if self._outer is not None:
            return self._outer.extents(side)
        if self._runs is not None:
            return self._runs.extents(side)
        rows = self.rows(side)
        return rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64)


def check_pairs(local_descs: "np.ndarray | AffineList", local_ids: np.ndarray,
                remote_descs: "np.ndarray | AffineList", remote_ids: np.ndarray, *, what: str,
                outer_cache: dict[Any, Any] | None = None) -> CheckedPairs:
    """:func:`check_paired_ids`, keeping what the checks derived (see CheckedPairs).

    Ids given as :class:`~hkvsim.transport.outer.OuterIds` on both sides over two affine
    lists are checked from their structure when it settles every check (``outer_cache``: a
    dict the caller keeps for the geometry it derives); otherwise, as any ids, flat."""
    if isinstance(local_ids, OuterIds) and isinstance(remote_ids, OuterIds):
        if (outer_cache is not None and isinstance(local_descs, AffineList)
                and isinstance(remote_descs, AffineList)):
            got = outer_pairs(local_descs, local_ids, remote_descs, remote_ids, outer_cache)
            if got is not None:
                return CheckedPairs(local_ids, remote_ids, got.nbytes, outer=got,
                                    descs=(local_descs, remote_descs))
        local_ids, remote_ids = local_ids.flat(), remote_ids.flat()
    li = _ids(local_ids, what=what, side="local")
    ri = _ids(remote_ids, what=what, side="remote")
    if li.ndim != 1 or li.shape != ri.shape:
        raise TransportError(f"{what}: local and remote id lists differ in length "
                             f"({li.size} vs {ri.size})")
    for ids, descs, side in ((li, local_descs, "local"), (ri, remote_descs, "remote")):
        n = _list_size(descs)
        if ids.size and (ids.min() < 0 or ids.max() >= n):
            bad = int(np.flatnonzero((ids < 0) | (ids >= n))[0])
            raise TransportError(
                f"{what}: {side} descriptor id out of range at index {bad} (id "
                f"{int(ids[bad])}); ids span [{ids.min()}, {ids.max()}], the {side} list "
                f"has {n} descriptors")
    if (isinstance(local_descs, AffineList) and isinstance(remote_descs, AffineList)
            and li.size >= RUNS_FROM):
        runs = PairedRuns(local_descs, li, remote_descs, ri)
        i = runs.first_length_mismatch()
        if i is None:
            return CheckedPairs(li, ri, runs.nbytes(), runs=runs)
        ll = int(local_descs.length[local_descs.segments(li[i:i + 1])[0]])
        rl = int(remote_descs.length[remote_descs.segments(ri[i:i + 1])[0]])
        raise TransportError(f"{what}: descriptor pair {i} (local id {int(li[i])}, remote id "
                             f"{int(ri[i])}) has local length {ll} but remote length {rl}")
    lrows, rrows = list_rows(local_descs, li), list_rows(remote_descs, ri)
    lengths_l, lengths_r = lrows[:, 1], rrows[:, 1]
    if not np.array_equal(lengths_l, lengths_r):
        i = int(np.flatnonzero(lengths_l != lengths_r)[0])
        raise TransportError(f"{what}: descriptor pair {i} (local id {int(li[i])}, remote id "
                             f"{int(ri[i])}) has local length {int(lengths_l[i])} but remote "
                             f"length {int(lengths_r[i])}")
    return CheckedPairs(li, ri, int(lengths_l.sum()), lrows=lrows, rrows=rrows)


def check_paired_ids(local_descs: "np.ndarray | AffineList", local_ids: np.ndarray,
                     remote_descs: "np.ndarray | AffineList", remote_ids: np.ndarray, *,
                     what: str) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate a transfer's paired descriptor ids against two prepared lists (explicit (N, 3)
    arrays or affine lists): equal-length 1-D id lists, every id inside its list (a range
    check), and equal lengths pair by pair (NIXL answers all of these with a bare NOT_FOUND).
    Returns the int64 id arrays and the total bytes."""
    pairs = check_pairs(local_descs, local_ids, remote_descs, remote_ids, what=what)
    return pairs.li, pairs.ri, pairs.nbytes


# ---- what a peer announces about its memory -----------------------------------------------------
@dataclass(frozen=True, eq=False)
class AgentAnnouncement:
    """One agent's metadata as both transports exchange it: its name, the transport's own blob
    (NIXL's agent metadata; empty on the simulated fabric) and the memory it has registered,
    (K, 3) uint64 rows of (addr, len, device)."""

    name: str
    native: bytes
    regions: np.ndarray


def encode_agent_metadata(name: str, native: bytes,
                          regions: Sequence[tuple[int, int, int]]) -> bytes:
    """The agent metadata a transport hands out, with its registered (addr, len, device)
    regions. It is re-sent over the side channel whenever the agent's registrations change, so
    its peers learn about deregistered memory."""
    return msgpack.packb({"agent": name, "native": bytes(native),
                          "regions": [[int(a), int(n), int(d)] for a, n, d in regions]},
                         use_bin_type=True)


class _ListBudget:
    """msgpack ``list_hook``: stop once the lists decoded hold more than ``left`` entries (a
    blob of nested one-element lists would otherwise cost ~1 s per MiB to decode)."""

    def __init__(self, left: int) -> None:
        self.left = left

    def __call__(self, items: list) -> list:
        self.left -= len(items) + 1
        if self.left < 0:
            raise ValueError("too many list entries")
        return items


def decode_agent_metadata(blob: Any, *, what: str) -> AgentAnnouncement:
    """Strictly decode a peer's agent metadata; a TransportError (kind handshake_failed) says
    what is wrong."""
    def bad(why: str) -> TransportError:
        return TransportError(f"{what}: bad agent metadata: {why}", kind="handshake_failed")

    if not isinstance(blob, (bytes, bytearray)) or not blob:
        raise bad(f"expected non-empty bytes, got {type(blob).__name__}")
    if len(blob) > MAX_AGENT_METADATA:
        raise bad(f"{len(blob)} bytes, over the {MAX_AGENT_METADATA}-byte limit")
    try:
        msg = msgpack.unpackb(bytes(blob), raw=False, strict_map_key=True, max_map_len=8,
                              max_array_len=MAX_ANNOUNCED_REGIONS, max_str_len=4096,
                              max_bin_len=MAX_AGENT_METADATA,
                              list_hook=_ListBudget(5 * MAX_ANNOUNCED_REGIONS))
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise bad(f"undecodable ({type(exc).__name__}: {exc})") from None
    if not isinstance(msg, dict) or set(msg) != {"agent", "native", "regions"}:
        raise bad("expected a map with keys agent, native, regions")
    name, native, regions = msg["agent"], msg["native"], msg["regions"]
    if not isinstance(name, str) or not name:
        raise bad("'agent' must be a non-empty string")
    if not isinstance(native, bytes):
        raise bad("'native' must be bytes")
    ok = isinstance(regions, list) and all(
        isinstance(r, list) and len(r) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64 for v in r)
        for r in regions)
    if not ok:
        raise bad("'regions' must be a list of [addr, len, device] non-negative integers")
    arr = np.array(regions, dtype=np.uint64).reshape(-1, 3)
    if arr.size and ((arr[:, 0] + arr[:, 1] < arr[:, 0]) | (arr[:, 1] == 0)).any():
        raise bad("a region is empty or overflows the address space")
    return AgentAnnouncement(name=name, native=native, regions=arr)


def overlapping(descs: "np.ndarray | AffineList", ranges: np.ndarray) -> bool:
    """Whether any (addr, len, device) descriptor overlaps any (addr, len, device) range (an
    affine list: segment by segment, materialising only segments whose extent overlaps)."""
    if isinstance(descs, AffineList):
        if not ranges.shape[0]:
            return False
        same_dev = ranges[ranges[:, 2] == descs.device]
        for s, _, lo, hi in descs.hulls():
            if any(lo < int(a) + int(n) and hi > int(a) for a, n, _ in same_dev):
                if overlapping(descs.segment_rows(s), ranges):
                    return True
        return False
    if descs.shape[0] == 0 or ranges.shape[0] == 0:
        return False
    addr, end, dev = descs[:, 0:1], descs[:, 0:1] + descs[:, 1:2], descs[:, 2:3]
    lo, hi = ranges[None, :, 0], ranges[None, :, 0] + ranges[None, :, 1]
    return bool(((addr < hi) & (end > lo) & (dev == ranges[None, :, 2])).any())


class PeerRegistrations:
    """The memory every remote agent announced as registered (its latest agent metadata).

    NIXL keeps accepting transfers into memory its peer has deregistered (docs/semantics.md §11.4
    hazard 2): the WRITE is DONE and lands. Both transports consult this ledger instead:
    a remote list, or a transfer, must lie inside what the peer announced, and when a newer
    announcement withdraws a range, every list over it goes stale.
    """

    def __init__(self) -> None:
        self._ranges: dict[str, np.ndarray] = {}

    def announce(self, agent: str, regions: np.ndarray) -> np.ndarray:
        """Record ``agent``'s regions; returns the previously announced ranges it withdrew."""
        old = self._ranges.get(agent)
        self._ranges[agent] = regions
        if old is None or old.shape[0] == 0:
            return np.zeros((0, 3), dtype=np.uint64)
        kept = [bool(((regions[:, 0] <= row[0]) & (row[0] + row[1] <= regions[:, 0] + regions[:, 1])
                      & (regions[:, 2] == row[2])).any()) for row in old]  # K: a handful
        return old[~np.asarray(kept, dtype=bool)]

    def forget(self, agent: str) -> None:
        self._ranges.pop(agent, None)

    def problem(self, agent: str, descs: np.ndarray) -> str | None:
        """Why ``descs`` (N, 3) do not all lie in memory ``agent`` announced, or None."""
        ranges = self._ranges.get(agent)
        if ranges is None:
            ranges = np.zeros((0, 3), dtype=np.uint64)
        return registration_problem(descs, ranges,
                                    whose=f"the memory remote agent {agent} has registered")


def registration_problem(descs: "np.ndarray | AffineList", ranges: np.ndarray, *, whose: str,
                         first_index: int = 0) -> str | None:
    """Why ``descs`` (N, 3) (addr, len, device) do not all lie inside ``ranges`` (K, 3)
    (base, len, device), or None. One check for local lists (a transport's own registrations)
    and remote ones (what a peer announced), on every transport. An affine list is checked
    segment by segment: a segment whose whole extent lies in one range is inside; any other is
    materialised and checked descriptor by descriptor (the same answer, the same message).
    ``first_index``: the id of ``descs``' first row (in the message)."""
    if not (type(ranges) is np.ndarray and ranges.dtype is _UINT64 and ranges.ndim == 2
            and ranges.shape[1] == 3):
        ranges = np.asarray(ranges, dtype=np.uint64).reshape(-1, 3)
    if type(descs) is np.ndarray:  # runs just vouched for (PlannedRows): the template's hull
        hull = hull_of(descs)
        if hull is not None:
            dev, lo, hi = hull
            for a, n, d in ranges.tolist():
                if d == dev and a <= lo and hi <= a + n:
                    return None
    if isinstance(descs, AffineList):
        spans = [(int(a), int(a) + int(n)) for a, n, d in ranges if int(d) == descs.device]
        for s, first, lo, hi in descs.hulls():
            if any(a <= lo and hi <= end for a, end in spans):
                continue
            problem = registration_problem(descs.segment_rows(s), ranges, whose=whose,
                                           first_index=first)
            if problem is not None:
                return problem
        return None
    if descs.shape[0] == 0:
        return None
    if descs.dtype == np.uint64 and ranges.shape[0]:
        # every row inside one range: the rows' hull is (one device, no address wraps)
        hull = hull_of(descs) or runs_hull(descs)  # (PlannedRows' runs: the template's)
        if hull is not None:
            dev, lo, hi = hull
            for a, n, d in ranges.tolist():
                if d == dev and a <= lo and hi <= a + n:
                    return None
    addr, length, dev = descs[:, 0:1], descs[:, 1:2], descs[:, 2:3]
    end = addr + length
    inside = ((end >= addr) & (addr >= ranges[None, :, 0])
              & (end <= ranges[None, :, 0] + ranges[None, :, 1])
              & (dev == ranges[None, :, 2])).any(axis=1)
    if inside.all():
        return None
    i = int(np.flatnonzero(~inside)[0])
    index = first_index + i
    listed = ", ".join(f"[{int(lo):#x}, {int(lo + n):#x}) device {int(d)}"
                       for lo, n, d in ranges[:4]) or "none"
    return (f"descriptor {index} ({int(descs[i, 0]):#x}, {int(descs[i, 1])} B, device "
            f"{int(descs[i, 2])}) is outside {whose} "
            f"(registered: {listed}{', ...' if ranges.shape[0] > 4 else ''})")


@dataclass(frozen=True)
class PairedDescriptors:
    """Both sides of a non-prepped transfer, checked: (N, 3) rows that pair one to one, with the
    strided (N, 5) rows they were expanded from when the caller gave strided rows."""

    local: np.ndarray
    remote: np.ndarray
    local_strided: np.ndarray | None = None
    remote_strided: np.ndarray | None = None


#: templates (PlannedRows.token) whose rows pair_descriptors has checked in full, by id (the
#: entry keeps the token alive, so its id names no other object)
_CHECKED_TOKENS: dict[int, Any] = {}


def pair_descriptors(local_descs: Any, remote_descs: Any, *, what: str) -> PairedDescriptors:
    """The one check of a non-prepped transfer's descriptors (NIXL ``initialize_xfer``), for
    every transport: two (N, 3) arrays, or two (N, 5) strided arrays with the same run lengths
    and counts; the pairs have equal lengths and none is zero-length.

    Two :class:`~hkvsim.transport.planned.PlannedRows` of one template: checked in full (and
    their given expansion compared with the rows' own) the first time the template is seen;
    afterwards their expansion is taken as given (every check here is blind to the address
    shifts by which rows of one template differ; see transport/planned.py)."""
    if type(local_descs) is PlannedRows and type(remote_descs) is PlannedRows:
        token = local_descs.token
        if remote_descs.token is token:
            strided = local_descs.rows.shape[1] == 5
            if _CHECKED_TOKENS.get(id(token)) is token:
                vouch(local_descs, remote_descs)
                return PairedDescriptors(  # (local, remote, local_strided, remote_strided)
                    local_descs.runs, remote_descs.runs,
                    local_descs.rows if strided else None, remote_descs.rows if strided else None)
            checked = pair_descriptors(local_descs.rows, remote_descs.rows, what=what)
            if (np.array_equal(checked.local, local_descs.runs)
                    and np.array_equal(checked.remote, remote_descs.runs)
                    and runs_hull(checked.local) == local_descs.hull
                    and runs_hull(checked.remote) == remote_descs.hull
                    and local_descs.coalesced in (None, coalesced_count(checked.local,
                                                                        checked.remote))
                    and local_descs.nbytes in (None, int(checked.local[:, 1].sum()))):
                if len(_CHECKED_TOKENS) >= 4096:
                    _CHECKED_TOKENS.clear()
                _CHECKED_TOKENS[id(token)] = token
            return checked
        local_descs, remote_descs = local_descs.rows, remote_descs.rows
    la, ra = np.asarray(local_descs), np.asarray(remote_descs)
    lrows = rrows = None
    if la.ndim == 2 and la.shape[1] == 5:
        lrows = np.ascontiguousarray(check_strided_array(la, what=f"{what}: local"))
        rrows = np.ascontiguousarray(check_strided_array(ra, what=f"{what}: remote"))
        if lrows.shape != rrows.shape or not np.array_equal(lrows[:, [1, 4]], rrows[:, [1, 4]]):
            raise TransportError(f"{what}: strided rows differ in number, length or count "
                                 f"between the local and the remote side")
        ld, rd = _expand_strided((lrows, rrows))  # equal counts: checked above
    else:
        ld = np.ascontiguousarray(check_descriptor_array(la, what=f"{what}: local"),
                                  dtype=np.uint64)
        rd = np.ascontiguousarray(check_descriptor_array(ra, what=f"{what}: remote"),
                                  dtype=np.uint64)
        if ld.shape != rd.shape:
            raise TransportError(f"{what}: local and remote descriptor lists differ in "
                                 f"length ({ld.shape[0]} vs {rd.shape[0]})")
        if not np.array_equal(ld[:, 1], rd[:, 1]):
            i = int(np.flatnonzero(ld[:, 1] != rd[:, 1])[0])
            raise TransportError(f"{what}: descriptor pair {i} has local length "
                                 f"{int(ld[i, 1])} but remote length {int(rd[i, 1])}")
    if ld.shape[0] and (ld[:, 1] == 0).any():
        raise TransportError(f"{what}: a descriptor has length 0")
    return PairedDescriptors(local=ld, remote=rd, local_strided=lrows, remote_strided=rrows)


def check_prep_descriptors(descs: "np.ndarray | AffineList", *, what: str
                           ) -> "np.ndarray | AffineList":
    """A list to prepare: a well-formed (N, 3) array, or an affine list (well-formed by
    construction), with no zero-length descriptor (NIXL accepts one silently; both transports
    refuse it)."""
    if isinstance(descs, AffineList):
        i = descs.zero_length_id()
        if i is not None:
            raise TransportError(f"{what}: descriptor {i} has length 0 (NIXL accepts it "
                                 f"silently; we refuse it)")
        return descs
    arr = np.ascontiguousarray(check_descriptor_array(descs, what=what), dtype=np.uint64)
    if arr.shape[0] and (arr[:, 1] == 0).any():
        i = int(np.flatnonzero(arr[:, 1] == 0)[0])
        raise TransportError(f"{what}: descriptor {i} has length 0 (NIXL accepts it "
                             f"silently; we refuse it)")
    return arr


@runtime_checkable
class Transport(Protocol):
    """One agent per rank, shaped like ``nixl_agent``."""

    name: str

    def allocate(self, nbytes: int, *, mem_type: str = "VRAM", device_id: int = 0) -> Memory: ...

    def register_memory(self, memory: Memory) -> None: ...

    def deregister_memory(self, memory: Memory) -> None: ...

    def get_agent_metadata(self) -> bytes: ...

    def add_remote_agent(self, metadata: bytes) -> str:
        """Learn a peer from its agent metadata; called again with newer metadata, it updates
        what the peer has registered (lists over withdrawn memory go stale)."""
        ...

    def remove_remote_agent(self, name: str) -> None: ...

    def prep_xfer_dlist(self, agent: str, descs: np.ndarray, *, mem_type: str | None = None
                        ) -> int:
        """``agent`` = "" for a local list, else the remote agent's name: the list must lie in
        memory that agent announced (its latest agent metadata)."""
        ...

    def release_dlist_handle(self, handle: int) -> None: ...

    def make_prepped_xfer(self, op: str, local_dlist: int, local_ids: np.ndarray, remote_dlist: int,
                          remote_ids: np.ndarray, notif: bytes = b"") -> int:
        """Ids are integer arrays; a transport whose ``accepts_outer_ids`` is true also takes
        :class:`~hkvsim.transport.outer.OuterIds` (the same ids with their structure)."""
        ...

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
