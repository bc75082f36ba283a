"""A ``nixl_agent``-shaped object over hkvsim's :class:`~hkvsim.transport.base.Transport`.

vLLM's NIXL connector worker constructs ``nixl_agent(name, config)`` and then speaks NIXL's Python
API to it: register memory by host address ranges, exchange agent metadata, prepare (strided)
descriptor lists, post READ/WRITE with a notification, poll, read telemetry, release. This
adapter gives the worker that API over any hkvsim transport (the simulated fabric or real NIXL),
so vLLM's own connector code moves the bytes that hkvsim's oracle then checks.

Addresses: vLLM names memory by the host address of its tensors (``data_ptr()``); the transport
names it by the base address of each :class:`Memory` it allocated. The adapter keeps, per agent,
the table (host address, length, transport address) of registered memory and translates every
descriptor. Its agent metadata carries that table next to the transport's own metadata, so a
peer adapter translates remote descriptors the same way. Nothing here reads a clock or starts a
thread. Needs numpy and msgpack only (vLLM is not imported).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from ...transport.base import (
    MEM_TYPES,
    Memory,
    Transport,
    TransportError,
    XferTelemetry,
    check_strided_array,
    expand_strided,
)

__all__ = ["NixlAgentError", "RegDescs", "XferDescs", "Telemetry", "TransportNixlAgent",
           "host_address"]

LOCAL_AGENT_NAMES = ("", "NIXL_INIT_AGENT")  # what vLLM passes for "this agent's own list"
_MAX_METADATA = 1 << 21


class NixlAgentError(RuntimeError):
    """What ``nixl_agent`` raises (NIXL's nixlBackendError, nixlInvalidParamError, ...):
    ``kind`` is hkvsim's failure class for it."""

    def __init__(self, message: str, *, kind: str = "transfer_setup_failed") -> None:
        super().__init__(message)
        self.kind = kind


def host_address(memory: Memory) -> int:
    """The host address of a memory's bytes (what ``torch.Tensor.data_ptr()`` reports for a
    tensor viewing it)."""
    return int(memory.array.ctypes.data)


@dataclass(frozen=True)
class RegDescs:
    """``get_reg_descs`` result: (addr, len, device) rows and their memory type."""

    rows: np.ndarray  # (N, 3) uint64, host addresses
    mem_type: str


@dataclass(frozen=True)
class XferDescs:
    """``get_xfer_descs`` result (vLLM <= 0.26 builds lists with it before ``prep_xfer_dlist``)."""

    rows: np.ndarray  # (N, 3) or (N, 5) uint64, host addresses
    mem_type: str


@dataclass(frozen=True)
class Telemetry:
    """``get_xfer_telemetry`` result, in NIXL's field names and units (microseconds)."""

    startTime: int
    postDuration: int
    xferDuration: int
    totalBytes: int
    descCount: int


def _rows(descs: Any, *, what: str) -> np.ndarray:
    """(N, 3) or (N, 5) integer rows from an array, a list of tuples (a trailing name field
    ignored), or a RegDescs/XferDescs."""
    if isinstance(descs, (RegDescs, XferDescs)):
        return descs.rows
    if isinstance(descs, np.ndarray):
        arr = descs
    else:
        items = list(descs)
        if items and isinstance(items[0], (tuple, list)) and len(items[0]) == 4:
            items = [tuple(r[:3]) for r in items]  # (addr, len, dev, name)
        arr = np.asarray(items, dtype=np.int64).reshape(-1, 3) if items else np.zeros(
            (0, 3), np.int64)
    if arr.ndim != 2 or arr.shape[1] not in (3, 5) or (arr.size and arr.dtype.kind not in "ui"):
        raise NixlAgentError(f"{what}: descriptors must be (N, 3) (addr, len, dev) or (N, 5) "
                             f"strided integer rows; got shape {arr.shape}, dtype {arr.dtype}",
                             kind="transfer_setup_failed")
    if arr.dtype.kind == "i" and arr.size and arr.min() < 0:
        raise NixlAgentError(f"{what}: a descriptor has a negative field")
    return arr.astype(np.uint64, copy=False)


def _mem_type(mem_type: Any, *, what: str) -> str:
    if mem_type not in MEM_TYPES:
        raise NixlAgentError(f"{what}: memory type {mem_type!r}; allowed: "
                             f"{', '.join(MEM_TYPES)}")
    return str(mem_type)


class _AddressMap:
    """(host address, length, transport address) of an agent's registered memories."""

    def __init__(self, table: Iterable[Sequence[int]] = ()) -> None:
        t = np.asarray(list(table), dtype=np.uint64).reshape(-1, 3)
        self.table = t[np.argsort(t[:, 0], kind="stable")] if t.size else t

    def translate(self, rows: np.ndarray, *, who: str, what: str) -> np.ndarray:
        """(N, 3) host rows -> transport rows; every run must lie in one mapped memory."""
        out = rows.copy()
        if rows.shape[0] == 0:
            return out
        if self.table.shape[0] == 0:
            raise NixlAgentError(f"{what}: {who} has registered no memory",
                                 kind="transfer_setup_failed")
        lo = self.table[:, 0]
        idx = np.searchsorted(lo, rows[:, 0], side="right").astype(np.int64) - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        end = rows[:, 0] + rows[:, 1]
        ok &= end <= lo[safe] + self.table[safe, 1]
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise NixlAgentError(
                f"{what}: descriptor {i} ({int(rows[i, 0]):#x}, {int(rows[i, 1])} B) is not "
                f"inside memory {who} registered", kind="transfer_setup_failed")
        out[:, 0] = rows[:, 0] - lo[safe] + self.table[safe, 2]
        return out


class TransportNixlAgent:
    """The ``nixl_agent`` calls vLLM's connector worker makes, over an hkvsim Transport.

    ``memories``: the Memory objects (allocated by ``transport``) that vLLM's tensors view; a
    registration must lie inside one of them. ``name`` is the transport agent's name (vLLM's
    random uuid name is ignored, so runs are reproducible).
    """

    def __init__(self, transport: Transport, memories: Sequence[Memory]) -> None:
        self.transport = transport
        self.name = transport.name
        self._memories = list(memories)
        self._registered: dict[int, int] = {}  # index into _memories -> registrations over it
        self._remote_maps: dict[str, _AddressMap] = {}
        self._lists: dict[int, str] = {}  # list handle -> "" (local) or remote agent
        self.calls: dict[str, int] = {}  # call counts, for reports and tests
        self._created: list[int] = []  # transfer handles, in creation order
        self._telemetry: dict[int, XferTelemetry] = {}  # kept when a handle is released
        self._post_errors: dict[int, tuple[str, str]] = {}  # handle -> (class, message)
        self._poll_errors: dict[int, tuple[str, str]] = {}  # check_xfer_state raised
        self._ended: dict[int, str] = {}  # handle -> DONE / ERR, as vLLM last saw it
        self._posted: set[int] = set()  # handles vLLM posted (transfer called)
        self._released: set[int] = set()  # handles vLLM released (their DMA is over)
        self._held: dict[str, list[bytes]] = {}  # notifications peeked, not yet read by vLLM
        # when set, get_new_notifs returns only what peek_notifs took: with a real transport a
        # notification can arrive between the peek and vLLM's read, and must not reach vLLM
        # before whoever peeks has seen it
        self.gate_notifs = False

    def _count(self, call: str) -> None:
        self.calls[call] = self.calls.get(call, 0) + 1

    # ---- memory ---------------------------------------------------------------------------
    def _memory_index(self, addr: int, length: int, *, what: str) -> int:
        for i, m in enumerate(self._memories):
            base = host_address(m)
            if base <= addr and addr + length <= base + m.nbytes:
                return i
        raise NixlAgentError(f"{what}: range ({addr:#x}, {length} B) is not inside memory this "
                             f"agent can register", kind="transfer_setup_failed")

    def get_reg_descs(self, descs: Any, mem_type: str = "DRAM", *args: Any, **kw: Any) -> RegDescs:
        self._count("get_reg_descs")
        return RegDescs(_rows(descs, what=f"{self.name}: get_reg_descs"),
                        _mem_type(mem_type, what=f"{self.name}: get_reg_descs"))

    def get_xfer_descs(self, descs: Any, mem_type: str = "DRAM", *args: Any, **kw: Any
                       ) -> XferDescs:
        self._count("get_xfer_descs")
        return XferDescs(_rows(descs, what=f"{self.name}: get_xfer_descs"),
                         _mem_type(mem_type, what=f"{self.name}: get_xfer_descs"))

    def register_memory(self, descs: Any, mem_type: str | None = None, backends: Any = None,
                        **kw: Any) -> RegDescs:
        self._count("register_memory")
        what = f"{self.name}: register_memory"
        reg = descs if isinstance(descs, RegDescs) else RegDescs(
            _rows(descs, what=what), _mem_type(mem_type or "DRAM", what=what))
        for addr, length, _dev in reg.rows[:, :3].tolist():
            i = self._memory_index(int(addr), int(length), what=what)
            if self._registered.get(i, 0) == 0:
                m = self._memories[i]
                if m.mem_type != reg.mem_type:
                    raise NixlAgentError(f"{what}: memory type {reg.mem_type} but the memory "
                                         f"was allocated as {m.mem_type}")
                self._call(self.transport.register_memory, m)
            self._registered[i] = self._registered.get(i, 0) + 1
        return reg

    def deregister_memory(self, descs: Any, backends: Any = None, **kw: Any) -> None:
        self._count("deregister_memory")
        what = f"{self.name}: deregister_memory"
        rows = _rows(descs, what=what)
        for addr, length, _dev in rows[:, :3].tolist():
            i = self._memory_index(int(addr), int(length), what=what)
            if self._registered.get(i, 0) == 0:
                raise NixlAgentError(f"{what}: range ({int(addr):#x}, {int(length)} B) is not "
                                     f"registered")
            self._registered[i] -= 1
            if self._registered[i] == 0:
                self._call(self.transport.deregister_memory, self._memories[i])

    def _local_map(self) -> _AddressMap:
        return _AddressMap((host_address(self._memories[i]), self._memories[i].nbytes,
                            self._memories[i].base_addr)
                           for i, n in sorted(self._registered.items()) if n > 0)

    # ---- peers ----------------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        self._count("get_agent_metadata")
        table = self._local_map().table
        return msgpack.packb({"transport": self._call(self.transport.get_agent_metadata),
                              "map": [[int(v) for v in row] for row in table]},
                             use_bin_type=True)

    def add_remote_agent(self, metadata: bytes) -> str:
        self._count("add_remote_agent")
        what = f"{self.name}: add_remote_agent"
        if not isinstance(metadata, (bytes, bytearray)) or len(metadata) > _MAX_METADATA:
            raise NixlAgentError(f"{what}: agent metadata must be bytes of at most "
                                 f"{_MAX_METADATA} B", kind="handshake_failed")
        try:
            msg = msgpack.unpackb(bytes(metadata), raw=False, strict_map_key=True,
                                  max_array_len=1 << 12)
            inner, table = msg["transport"], msg["map"]
            amap = _AddressMap(table)
        except Exception as exc:  # msgpack/shape errors of a malformed blob
            raise NixlAgentError(f"{what}: undecodable agent metadata ({type(exc).__name__}: "
                                 f"{exc})", kind="handshake_failed") from None
        name = self._call(self.transport.add_remote_agent, inner, kind="handshake_failed")
        self._remote_maps[name] = amap
        return name

    def remove_remote_agent(self, agent: str) -> None:
        self._count("remove_remote_agent")
        self._remote_maps.pop(agent, None)
        self._call(self.transport.remove_remote_agent, agent)

    def check_remote_metadata(self, agent: str, descs: Any = None) -> bool:
        self._count("check_remote_metadata")
        return agent in self._remote_maps

    # ---- descriptor lists -----------------------------------------------------------------
    def prep_xfer_dlist(self, agent: str, descs: Any, mem_type: str | None = None,
                        *args: Any, **kw: Any) -> int:
        """``agent`` "" or "NIXL_INIT_AGENT": a local list. (N, 5) strided rows are expanded;
        descriptor ids then count the individual runs, as in NIXL."""
        self._count("prep_xfer_dlist")
        what = f"{self.name}: prep_xfer_dlist({agent or 'local'})"
        if isinstance(descs, XferDescs) and mem_type is None:
            mem_type = descs.mem_type
        rows = _rows(descs, what=what)
        if rows.shape[1] == 5:
            try:
                rows = expand_strided(check_strided_array(rows, what=what))
            except TransportError as exc:
                raise NixlAgentError(str(exc)) from None
        local = agent in LOCAL_AGENT_NAMES
        if local:
            amap, who, target = self._local_map(), self.name, ""
        else:
            if agent not in self._remote_maps:
                raise NixlAgentError(f"{what}: unknown remote agent {agent!r} "
                                     f"(add_remote_agent first)")
            amap, who, target = self._remote_maps[agent], f"remote agent {agent}", agent
        translated = amap.translate(rows, who=who, what=what)
        handle = self._call(self.transport.prep_xfer_dlist, target, translated,
                            mem_type=None if mem_type is None else
                            _mem_type(mem_type, what=what))
        self._lists[handle] = target
        return handle

    def release_dlist_handle(self, handle: int) -> None:
        self._count("release_dlist_handle")
        self._lists.pop(handle, None)
        self._call(self.transport.release_dlist_handle, handle)

    # ---- transfers ------------------------------------------------------------------------
    def make_prepped_xfer(self, operation: str, local_xfer_side: int, local_indices: Any,
                          remote_xfer_side: int, remote_indices: Any, notif_msg: Any = b"",
                          backends: Any = None, skip_desc_merge: bool = False) -> int:
        self._count("make_prepped_xfer")
        handle = self._call(self.transport.make_prepped_xfer, operation, local_xfer_side,
                          _indices(local_indices), remote_xfer_side,
                          _indices(remote_indices), _message(notif_msg))
        self._created.append(handle)
        # a handle number made again starts a new transfer
        self._ended.pop(handle, None)
        self._telemetry.pop(handle, None)
        self._post_errors.pop(handle, None)
        self._poll_errors.pop(handle, None)
        self._posted.discard(handle)
        self._released.discard(handle)
        return handle

    def created_handles(self) -> list[int]:
        """Every transfer handle made through this agent, in order (a copy)."""
        return list(self._created)

    def telemetry_of(self, handle: int) -> XferTelemetry | None:
        """hkvsim's telemetry of a transfer made here (also after vLLM released it)."""
        if handle in self._telemetry:
            return self._telemetry[handle]
        try:
            return self.transport.get_xfer_telemetry(handle)
        except TransportError:
            return None

    def transfer(self, handle: int, notif_msg: Any = None) -> str:
        """Post; "DONE" or "PROC". A failure to post raises (as NIXL's ``transfer`` does), is
        remembered per handle (:meth:`post_failure`), and gets the rank polled again: vLLM
        reports such a request in a later ``get_finished``, which an engine's next step calls
        (on the simulated fabric no transfer event would come to trigger it)."""
        self._count("transfer")
        self._posted.add(handle)
        try:
            return self._call(self.transport.transfer, handle)
        except NixlAgentError as exc:
            self._post_errors[handle] = (exc.kind or "transfer_setup_failed", str(exc))
            wake = getattr(self.transport, "wake_soon", None)
            if wake is not None:
                wake()
            raise

    def post_failure(self, handle: int) -> tuple[str, str] | None:
        """(failure class, message) of a transfer whose post raised, else None."""
        return self._post_errors.get(handle)

    def check_xfer_state(self, handle: int) -> str:
        """NIXL's state of a transfer; a check that raises is remembered per handle
        (:meth:`poll_failure`)."""
        self._count("check_xfer_state")
        try:
            state = self._call(self.transport.check_xfer_state, handle)
        except NixlAgentError as exc:
            # vLLM's name for it whatever raised (its log's failure_type), as hkvsim's core
            self._poll_errors[handle] = ("transfer_exception", str(exc))
            raise
        if state in ("DONE", "ERR"):
            self._ended[handle] = state
        return state

    def ended_as(self, handle: int) -> str | None:
        """"DONE" or "ERR" once vLLM's check of this transfer saw it end, else None."""
        return self._ended.get(handle)

    def poll_failure(self, handle: int) -> tuple[str, str] | None:
        """(failure class, message) of a transfer whose state check raised, else None."""
        return self._poll_errors.get(handle)

    def release_xfer_handle(self, handle: int) -> None:
        self._count("release_xfer_handle")
        with contextlib.suppress(TransportError):
            self._telemetry[handle] = self.transport.get_xfer_telemetry(handle)
        self._call(self.transport.release_xfer_handle, handle)
        self._released.add(handle)

    def is_live(self, handle: int) -> bool:
        """May this transfer still move bytes? Yes from its post until vLLM released its handle
        (one never posted, or whose post raised, moved nothing). vLLM 0.33.0 keeps a handle whose
        release failed, "a status error does not guarantee that the backend stopped DMA"; so
        does this."""
        return (handle in self._posted and handle not in self._released
                and handle not in self._post_errors)

    def get_xfer_telemetry(self, handle: int) -> Telemetry:
        self._count("get_xfer_telemetry")
        t = self._call(self.transport.get_xfer_telemetry, handle)
        return Telemetry(startTime=round(t.submitted * 1e6), postDuration=round(t.post_seconds
                                                                                * 1e6),
                         xferDuration=round(t.transfer_seconds * 1e6), totalBytes=t.nbytes,
                         descCount=t.descriptors)

    # ---- notifications --------------------------------------------------------------------
    def send_notif(self, remote_agent_name: str, notif_msg: Any) -> None:
        self._count("send_notif")
        self._call(self.transport.send_notif, remote_agent_name, _message(notif_msg))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        self._count("get_new_notifs")
        if self.gate_notifs:
            held, self._held = self._held, {}
            return held
        fresh = self._call(self.transport.get_new_notifs)
        if not self._held:
            return fresh
        held, self._held = self._held, {}
        for agent, messages in fresh.items():
            held.setdefault(agent, []).extend(messages)
        return held

    def peek_notifs(self) -> dict[str, list[bytes]]:
        """Take the transport's new notifications without consuming them: the next
        ``get_new_notifs`` (vLLM's) still returns them, in order."""
        fresh = self._call(self.transport.get_new_notifs)
        for agent, messages in fresh.items():
            self._held.setdefault(agent, []).extend(messages)
        return fresh

    # ---- other agent calls vLLM makes that change nothing here -----------------------------
    def create_backend(self, *args: Any, **kw: Any) -> None:
        self._count("create_backend")

    # ---- errors ---------------------------------------------------------------------------
    @staticmethod
    def _call(fn: Any, *args: Any, kind: str | None = None, **kw: Any) -> Any:
        try:
            return fn(*args, **kw)
        except TransportError as exc:
            raise NixlAgentError(str(exc), kind=kind or exc.kind) from None


def _indices(ids: Any) -> np.ndarray:
    """Descriptor indices as NIXL's binding takes them: it casts a float array to integers
    (vLLM 0.27 passes float64 ids when a group's block list is empty: ``np.asarray([])`` is
    float). Whole-valued floats are cast here too; a fractional id stays an error (NIXL would
    truncate it silently), and so does anything else the transport refuses."""
    arr = np.asarray(ids)
    if arr.size and arr.dtype.kind == "f" and np.array_equal(arr, np.floor(arr)):
        return arr.astype(np.int64)
    return arr


def _message(msg: Any) -> bytes:
    if msg is None:
        return b""
    if isinstance(msg, str):
        return msg.encode()
    if isinstance(msg, (bytes, bytearray, memoryview)):
        return bytes(msg)
    raise NixlAgentError(f"notification must be bytes or str, got {type(msg).__name__}")
