"""NixlTransport: the Transport protocol over a real ``nixl_agent`` (DRAM, VRAM).

A thin, hardened adapter. The connector core only ever hands it int handles; the NIXL handle
objects stay in here, next to our own ledger of what is registered, prepared, posted and
released, so that the hazards of NIXL's Python API (docs/semantics.md §11.4) become loud, readable
``TransportError``\\ s instead of segfaults, silent writes or bare status codes:

1. ``transfer()`` on a released handle segfaults and ``check_xfer_state`` on one says "DONE":
   we refuse released handles ourselves (as ``SimTransport`` does).
2. Writes into memory the peer deregistered, or re-posts after a local deregistration, succeed
   silently: every local descriptor list is checked against our registration ledger when it is
   prepared, and a list (and every transfer built on it) goes stale when its memory is
   deregistered; remote lists go stale when their agent is removed (hazard 7: re-prepare them).
   Our agent metadata wraps NIXL's with the memory we have registered
   (:func:`~hkvsim.transport.base.encode_agent_metadata`); a peer re-sends it over the side
   channel when that changes, and ``add_remote_agent`` with the newer metadata withdraws what is
   gone: remote lists (and non-prepped transfers) over it go stale, and no remote list or
   transfer outside what the peer announced is accepted (NIXL itself would let a WRITE into
   the deregistered range report DONE and land).
3. ``get_xfer_descs`` returns None on malformed input: arrays are validated (shape, dtype,
   overflow, lengths, registered ranges) before NIXL sees them, and a None result is refused.
   A wrong memory type (a bare ``KeyError`` in NIXL), float descriptor ids (truncated by a cast)
   and unknown handles are refused the same way, as ``SimTransport`` refuses them.
4. Errors carry only a status code: every NIXL exception is re-raised as a ``TransportError``
   naming the operation, the agent, the lists' lengths and the first offending index.
5. The built-in listener binds 0.0.0.0: it is always off here; metadata travels over
   :mod:`hkvsim.backends.side_channel`, bound to 127.0.0.1 by default. UCX's own tcp interfaces
   listen on every network device it uses (measured: one listener per rank on the machine's
   external address as well as on lo), so an agent created here restricts UCX to loopback
   (``UCX_NET_DEVICES=lo``, via :data:`NixlConfig.net_devices`) unless the environment names
   devices itself; shared-memory transports (cma, cuda_ipc) are not network devices and are
   unaffected. Runs across nodes set ``net_devices=None`` (UCX's own choice).
6. With the progress thread off the first transfer hangs in PROC unless the target keeps calling
   into NIXL: the rank processes of :mod:`hkvsim.backends.rank` poll
   ``get_new_notifs`` in their loop, so the thread is off by default (on a 2-core box its busy
   polling starves the copies: 12.5 GB/s with it off vs 1-10 GB/s, erratic, with it on).
7. Peer death: a post or notify raises REMOTE_DISCONNECT, mapped to ``kind="remote_disconnect"``.

Backends are verified after agent creation (an unknown backend only logs a warning in NIXL), and
``close()`` releases every handle and list, removes remote agents and deregisters memory, also
after a failure; it reports what it released and what it had to leave (a transfer whose release
failed while its DMA may be live).

nixl is imported lazily (:func:`nixl_api_candidates`: the one backend wheel installed, else the
``nixl`` meta package), torch only for VRAM. Neither is needed to import this module.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

import numpy as np

from .base import (
    DONE,
    ERR,
    PROC,
    Memory,
    PeerRegistrations,
    TransportError,
    AffineList,
    XferTelemetry,
    check_descriptor_array,
    check_handle,
    check_mem_type,
    check_op,
    check_paired_ids,
    check_prep_descriptors,
    check_strided_array,
    decode_agent_metadata,
    encode_agent_metadata,
    expand_strided,
    held_resources,
    live_list,
    overlapping,
    releasable_xfer,
    pair_descriptors,
    registration_problem,
)
from .coalesce import coalesced_count, coalesces
from .memory import lazy_buffer

__all__ = ["NixlConfig", "NixlTransport", "load_nixl", "nixl_available", "NixlUnavailable"]


class NixlUnavailable(ImportError):
    """NIXL cannot be imported (not installed, or its native libraries fail to load)."""


_API: Any = None


#: NIXL's backend wheels (the ``nixl`` meta package picks one of them at import).
NIXL_BACKEND_MODULES = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def installed_nixl_backends() -> tuple[str, ...]:
    """The NIXL backend wheels installed here (found without importing them)."""
    return tuple(name for name in NIXL_BACKEND_MODULES if importlib.util.find_spec(name))


def nixl_api_candidates() -> tuple[str, ...]:
    """The API modules :func:`load_nixl` tries, in order.

    The ``nixl`` meta package chooses its backend wheel by the CUDA major version of the process,
    and with a CPU build of torch installed but not imported it finds that by importing torch
    (about 2.4 s per process on a 2-core box; every real-NIXL rank process paid it). With one
    backend wheel installed there is no choice to make, so that wheel is imported directly
    unless torch is already loaded (VRAM ranks import torch first: then the meta package's
    check is free and its choice is kept). With several wheels the meta package chooses."""
    backends = installed_nixl_backends()
    if len(backends) == 1 and "torch" not in sys.modules:
        return (f"{backends[0]}._api", "nixl._api")
    # the meta package first; should it fail, each backend wheel in turn (one list of names)
    return ("nixl._api", *(f"{name}._api" for name in NIXL_BACKEND_MODULES))


def load_nixl() -> Any:
    """The NIXL Python API module (``nixl._api`` or a backend wheel's ``_api``, see
    :func:`nixl_api_candidates`); NixlUnavailable if none imports."""
    global _API
    if _API is not None:
        return _API
    errors = []
    for name in nixl_api_candidates():
        try:
            _API = importlib.import_module(name)
            return _API
        except ImportError as exc:  # missing package, or the shim found no backend wheel
            errors.append(f"{name}: {exc}")
    raise NixlUnavailable("NIXL is not importable; install it without the CUDA stack with "
                          "`pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1` (" +
                          "; ".join(errors) + ")")


def nixl_available() -> bool:
    try:
        load_nixl()
    except NixlUnavailable:
        return False
    return True


@dataclass(frozen=True, kw_only=True)
class NixlConfig:
    """How an agent is created. The listener is not configurable: it is always off."""

    backends: tuple[str, ...] = ("UCX",)
    progress_thread: bool = False  # see hazard 6 in the module docstring
    telemetry: bool = True
    num_threads: int = 0
    # UCX_NET_DEVICES for the agent when the environment does not set it (hazard 5): "lo" keeps
    # UCX's tcp listeners on loopback (every rank on one machine); None leaves UCX's default
    net_devices: str | None = "lo"


@dataclass(eq=False)
class _Registration:
    memory: Memory
    reg: Any  # nixlRegDList
    lo: int
    hi: int


@dataclass(eq=False)
class _DList:
    agent: str  # "" = local
    descs: np.ndarray
    handle: Any  # nixl_prepped_dlist_handle
    mem_type: str
    memory: Memory | None = None  # local lists: the registered memory they lie in
    released: bool = False
    stale: str | None = None  # why it may no longer be used
    users: int = 0  # unreleased transfers built on it
    release_pending: bool = False


@dataclass(eq=False)
class _Xfer:
    op: str
    local: _DList
    remote: _DList
    n_desc: int
    nbytes: int
    notif: bytes
    handle: Any = None  # nixl_xfer_handle; None for an empty transfer (notification only)
    state: str = "NEW"
    released: bool = False
    error: str | None = None
    error_kind: str = "transfer_failed"
    owned: tuple[_DList, ...] = ()  # temporary lists of a non-prepped transfer
    submitted: float = 0.0
    post_seconds: float = 0.0
    completed: float | None = None
    merged_descriptors: int | None = None
    coalesced_model: int | None = None  # hkvsim's coalescing model on the rows really posted


def _describe(exc: BaseException) -> str:
    """'NIXL_ERR_NOT_FOUND (nixlNotFoundError)' from a NIXL exception."""
    text = str(exc).strip() or "no message"
    return f"{text} ({type(exc).__name__})"


def _is_disconnect(exc: BaseException) -> bool:
    return "RemoteDisconnect" in type(exc).__name__ or "REMOTE_DISCONNECT" in str(exc)


_NOT_FOUND_HINT = ("NIXL answers NOT_FOUND for an out-of-range address, unregistered memory, a "
                   "wrong device id or an unknown agent")


class NixlTransport:
    """One rank's agent over real NIXL. ``clock`` gives the seconds used in telemetry."""

    def __init__(self, name: str, *, config: NixlConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.config = config or NixlConfig()
        self._clock = clock
        api = load_nixl()
        if self.config.net_devices is not None:  # read by UCX when the agent's context starts
            os.environ.setdefault("UCX_NET_DEVICES", self.config.net_devices)
        conf = api.nixl_agent_config(
            enable_prog_thread=self.config.progress_thread,
            enable_listen_thread=False,  # hazard 5: never the 0.0.0.0 listener
            capture_telemetry=self.config.telemetry,
            num_threads=self.config.num_threads,
            backends=list(self.config.backends))
        try:
            self._agent = api.nixl_agent(name, conf)
        except Exception as exc:
            raise TransportError(f"{name}: creating the NIXL agent failed: {_describe(exc)}",
                                 kind="transfer_setup_failed") from None
        missing = [b for b in self.config.backends if b not in self._agent.backends]
        if missing:
            available = ", ".join(self._agent.get_plugin_list()) or "(none)"
            raise TransportError(
                f"{name}: NIXL backend(s) {', '.join(missing)} did not start (NIXL only logs a "
                f"warning for this); plugins available: {available}",
                kind="transfer_setup_failed")
        self._registrations: list[_Registration] = []
        self._dlists: dict[int, _DList] = {}
        self._xfers: dict[int, _Xfer] = {}
        self._posted: set[int] = set()  # handles whose post returned in progress (pruned lazily)
        self._ids = count(1)
        self._remotes: set[str] = set()
        self._peers = PeerRegistrations()
        self._leaked: list[int] = []
        self._telemetry_ok = self.config.telemetry
        self._torch_buffers: dict[int, Any] = {}
        self.closed = False

    # ---- introspection -------------------------------------------------------------------
    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self._agent.backends)

    @property
    def native_agent(self) -> Any:
        """The underlying ``nixl_agent`` (diagnostics and benchmarks; bypasses every guard)."""
        self._check_open()
        return self._agent

    def native_dlist(self, handle: int) -> Any:
        """The NIXL prepared-list handle behind one of our list handles."""
        return self._dlist(handle, "requested").handle

    def backend_mem_types(self, backend: str = "UCX") -> list[str]:
        return list(self._agent.get_backend_mem_types(backend))

    def _check_open(self) -> None:
        if self.closed:
            raise TransportError(f"{self.name}: the NIXL agent is closed")

    # ---- memory --------------------------------------------------------------------------
    def allocate(self, nbytes: int, *, mem_type: str = "DRAM", device_id: int = 0) -> Memory:
        """DRAM: lazily committed anonymous memory (pages cost only when touched). VRAM: a torch
        uint8 tensor on ``cuda:<device_id>`` with a host shadow array for the oracle (see
        :func:`device_sync`)."""
        self._check_open()
        check_mem_type(mem_type, what=f"{self.name}: allocate")
        if nbytes <= 0:
            raise TransportError(f"{self.name}: cannot allocate {nbytes} bytes")
        if mem_type == "DRAM":
            array = lazy_buffer(nbytes)
            return Memory(base_addr=int(array.ctypes.data), array=array, mem_type="DRAM",
                          device_id=device_id)
        try:
            torch = importlib.import_module("torch")
        except ImportError:
            raise TransportError(f"{self.name}: VRAM needs torch with CUDA (pip install torch); "
                                 f"it is not installed") from None
        if not torch.cuda.is_available():
            raise TransportError(f"{self.name}: VRAM requested but torch sees no CUDA device")
        tensor = torch.zeros(nbytes, dtype=torch.uint8, device=f"cuda:{device_id}")
        shadow = lazy_buffer(nbytes)
        memory = Memory(base_addr=int(tensor.data_ptr()), array=shadow, mem_type="VRAM",
                        device_id=device_id)
        self._torch_buffers[id(memory)] = tensor
        return memory

    def device_tensor(self, memory: Memory) -> Any:
        """The torch tensor behind a VRAM allocation (None for DRAM)."""
        return self._torch_buffers.get(id(memory))

    def register_memory(self, memory: Memory) -> None:
        self._check_open()
        if any(r.memory is memory for r in self._registrations):
            return  # NIXL is silent on double registration; so is SimTransport
        descs = np.array([[memory.base_addr, memory.nbytes, memory.device_id]], dtype=np.uint64)
        try:
            reg = self._agent.register_memory(descs, memory.mem_type)
        except Exception as exc:
            raise TransportError(
                f"{self.name}: register_memory({memory.mem_type}, {memory.nbytes} B at "
                f"{memory.base_addr:#x}, device {memory.device_id}) failed: {_describe(exc)}"
            ) from None
        if reg is None:
            raise TransportError(f"{self.name}: register_memory got no registration list back")
        self._registrations.append(_Registration(memory=memory, reg=reg, lo=memory.base_addr,
                                                 hi=memory.base_addr + memory.nbytes))

    def deregister_memory(self, memory: Memory) -> None:
        self._check_open()
        entry = next((r for r in self._registrations if r.memory is memory), None)
        if entry is None:
            raise TransportError(f"{self.name}: deregistering memory that is not registered")
        active = [h for h, x in self._xfers.items() if not x.released and x.state == PROC
                  and x.local.memory is memory]
        if active:
            raise TransportError(f"{self.name}: cannot deregister memory while transfer(s) "
                                 f"{active} are active on it (DMA may be live)")
        try:
            self._agent.deregister_memory(entry.reg)
        except Exception as exc:
            raise TransportError(f"{self.name}: deregister_memory failed: {_describe(exc)}"
                                 ) from None
        self._registrations.remove(entry)
        for dl in self._live_lists():  # hazard 2: a list over deregistered memory is stale
            if dl.memory is memory and dl.stale is None:
                dl.stale = "its memory was deregistered"

    def _live_lists(self) -> list[_DList]:
        """Every unreleased list: prepared ones, and those of non-prepped transfers."""
        lists = {id(d): d for d in self._dlists.values() if not d.released}
        for x in self._xfers.values():
            if not x.released:
                for side in (x.local, x.remote):
                    lists.setdefault(id(side), side)
        return list(lists.values())

    def _registered(self, descs: np.ndarray) -> tuple[Memory | None, str | None]:
        """The registered memory holding every descriptor, or why none does."""
        if descs.shape[0] == 0:
            return (self._registrations[0].memory if self._registrations else None), None
        addr = descs[:, 0]
        end = addr + descs[:, 1]
        if (end < addr).any():
            i = int(np.flatnonzero(end < addr)[0])
            return None, f"descriptor {i} overflows the address space"
        for r in self._registrations:
            inside = (addr >= r.lo) & (end <= r.hi)
            if inside.all():
                return r.memory, None
        ranges = np.array([(r.lo, r.hi - r.lo, r.memory.device_id) for r in self._registrations],
                          dtype=np.uint64).reshape(-1, 3)
        problem = registration_problem(descs, ranges, whose="the registered memory")
        return None, problem or "descriptors span more than one registration"

    # ---- peers ---------------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        """NIXL's agent metadata wrapped with the memory registered now (hazard 2): send it
        again whenever that changes."""
        self._check_open()
        return encode_agent_metadata(self.name, bytes(self._agent.get_agent_metadata()),
                                     [(r.lo, r.hi - r.lo, r.memory.device_id)
                                      for r in self._registrations])

    def add_remote_agent(self, metadata: bytes) -> str:
        """Load a peer's metadata into NIXL and record the memory it announced. Called again with
        the peer's newer metadata it withdraws what the peer no longer lists (hazard 2)."""
        self._check_open()
        announced = decode_agent_metadata(metadata, what=f"{self.name}: add_remote_agent")
        if not announced.native:
            raise TransportError(f"{self.name}: add_remote_agent: the metadata of "
                                 f"{announced.name!r:.60} carries no NIXL metadata",
                                 kind="handshake_failed")
        try:
            raw = self._agent.add_remote_agent(announced.native)
        except Exception as exc:
            raise TransportError(f"{self.name}: add_remote_agent ({len(metadata)} B of metadata) "
                                 f"failed: {_describe(exc)}", kind="handshake_failed") from None
        name = raw.decode() if isinstance(raw, (bytes, bytearray)) else str(raw)
        if name == self.name:
            raise TransportError(f"{self.name}: add_remote_agent was given this agent's own "
                                 f"metadata", kind="handshake_failed")
        if name != announced.name:
            if name not in self._remotes:
                try:
                    self._agent.remove_remote_agent(name)
                except Exception:
                    pass
            raise TransportError(f"{self.name}: add_remote_agent: metadata announced agent "
                                 f"{announced.name!r:.60} but NIXL loaded {name!r:.60}",
                                 kind="handshake_failed")
        self._remotes.add(name)
        withdrawn = self._peers.announce(name, announced.regions)
        if withdrawn.shape[0]:
            for dl in self._live_lists():
                if dl.agent == name and dl.stale is None and overlapping(dl.descs, withdrawn):
                    dl.stale = f"remote agent {name} deregistered that memory"
        return name

    def remove_remote_agent(self, name: str) -> None:
        if self.closed or name not in self._remotes:
            return  # NIXL is silent for unknown names; so are we
        for dl in self._dlists.values():  # hazard 7: remote lists must be re-prepared
            if dl.agent == name and dl.stale is None:
                dl.stale = f"remote agent {name} was removed"
        self._remotes.discard(name)
        self._peers.forget(name)
        try:
            self._agent.remove_remote_agent(name)
        except Exception:  # already gone (peer died): nothing left to undo
            pass

    # ---- descriptor lists ----------------------------------------------------------------
    def prep_xfer_dlist(self, agent: str, descs: "np.ndarray | AffineList", *,
                        mem_type: str | None = None) -> int:
        """``agent`` = "" for a local list (checked against our registrations), else the name of
        an added remote agent. ``mem_type`` defaults to our registered memory's type. NIXL
        prepares explicit rows: an affine list is materialised here (the only place that does)."""
        self._check_open()
        if isinstance(descs, AffineList):
            descs = descs.materialise()
        what = f"{self.name}: prep_xfer_dlist({'local' if not agent else agent})"
        if mem_type is not None:
            check_mem_type(mem_type, what=what)
        arr = check_prep_descriptors(descs, what=what)
        memory = None
        if agent:
            if agent not in self._remotes:
                raise TransportError(f"{what}: unknown remote agent {agent!r} (add_remote_agent "
                                     f"first)")
            problem = self._peers.problem(agent, arr)
            if problem is not None:
                raise TransportError(f"{what}: {problem}")
        else:
            memory, problem = self._registered(arr)
            if problem is not None:
                raise TransportError(f"{what}: {problem}")
        kind = mem_type or (memory.mem_type if memory is not None else self._default_mem_type())
        if arr.shape[0] == 0:  # NIXL may refuse an empty list; keep an emulated one
            handle = None
        else:
            xfer_descs = self._agent.get_xfer_descs(arr, kind)
            if xfer_descs is None:  # hazard 3
                raise TransportError(f"{what}: NIXL rejected the descriptor array "
                                     f"(shape {arr.shape}, dtype {arr.dtype}, mem type {kind})")
            try:
                handle = self._agent.prep_xfer_dlist(agent or "NIXL_INIT_AGENT", xfer_descs)
            except Exception as exc:
                hint = f"; {_NOT_FOUND_HINT}" if "NOT_FOUND" in str(exc) else ""
                raise TransportError(f"{what}: {arr.shape[0]} descriptors ({kind}): "
                                     f"{_describe(exc)}{hint}",
                                     kind="remote_disconnect" if _is_disconnect(exc)
                                     else "transfer_setup_failed") from None
        h = next(self._ids)
        self._dlists[h] = _DList(agent=agent, descs=arr, handle=handle, mem_type=kind,
                                 memory=memory)
        return h

    def _default_mem_type(self) -> str:
        return self._registrations[0].memory.mem_type if self._registrations else "DRAM"

    def release_dlist_handle(self, handle: int) -> None:
        dl = self._dlists.get(handle)
        if dl is None or dl.released:
            return
        if dl.users:  # transfers built on it are still alive: release when the last one goes
            dl.release_pending = True
            return
        self._release_dlist(dl)

    def _release_dlist(self, dl: _DList) -> None:
        dl.released = True
        if dl.handle is not None and not self.closed:
            try:
                self._agent.release_dlist_handle(dl.handle)
            except Exception:
                pass  # releasing a list of a vanished peer: nothing to do

    def _dlist(self, handle: int, side: str) -> _DList:
        return live_list(self._dlists, handle, owner=self.name, side=side)

    # ---- transfers -----------------------------------------------------------------------
    def make_prepped_xfer(self, op: str, local_dlist: int, local_ids: np.ndarray, remote_dlist: int,
                          remote_ids: np.ndarray, notif: bytes = b"") -> int:
        self._check_open()
        check_op(op, owner=self.name)
        local, remote = self._dlist(local_dlist, "local"), self._dlist(remote_dlist, "remote")
        if local.agent:
            raise TransportError(f"{self.name}: invalid sides (the local list belongs to remote "
                                 f"agent {local.agent})")
        if not remote.agent:
            raise TransportError(f"{self.name}: invalid sides (a local list was passed as the "
                                 f"remote side)")
        what = f"{self.name}: {op} with {remote.agent}"
        li, ri, nbytes = check_paired_ids(local.descs, local_ids, remote.descs, remote_ids,
                                          what=what)
        x = _Xfer(op=op, local=local, remote=remote, n_desc=int(li.size), nbytes=nbytes,
                  notif=bytes(notif))
        x.coalesced_model = (coalesced_count(local.descs[li], remote.descs[ri])
                             if coalesces("prepped") else int(li.size))
        if li.size:
            try:
                x.handle = self._agent.make_prepped_xfer(op, local.handle, li, remote.handle, ri,
                                                         bytes(notif))
            except Exception as exc:
                hint = f"; {_NOT_FOUND_HINT}" if "NOT_FOUND" in str(exc) else ""
                raise TransportError(
                    f"{what}: make_prepped_xfer of {li.size} descriptors ({x.nbytes} B): "
                    f"{_describe(exc)}{hint}",
                    kind="remote_disconnect" if _is_disconnect(exc)
                    else "transfer_setup_failed") from None
        local.users += 1
        remote.users += 1
        h = next(self._ids)
        self._xfers[h] = x
        return h

    def make_xfer(self, op: str, local_descs: np.ndarray, remote_agent: str,
                  remote_descs: np.ndarray, notif: bytes = b"") -> int:
        """A non-prepped transfer from explicit descriptors paired by position: two (N, 3)
        arrays (NIXL ``initialize_xfer``), or two (N, 5) strided arrays, which are prepared as
        strided lists (NIXL PR #1978) and posted run by run. Validated like prepared lists."""
        self._check_open()
        check_op(op, owner=self.name)
        what = f"{self.name}: {op} (non-prepped) with {remote_agent}"
        if remote_agent not in self._remotes:
            raise TransportError(f"{what}: unknown remote agent (add_remote_agent first)")
        pairs = pair_descriptors(local_descs, remote_descs, what=what)
        ld, rd, lrows, rrows = pairs.local, pairs.remote, pairs.local_strided, pairs.remote_strided
        strided = lrows is not None
        memory, problem = self._registered(ld)
        if problem is not None:
            raise TransportError(f"{what}: local side: {problem}")
        problem = self._peers.problem(remote_agent, rd)
        if problem is not None:
            raise TransportError(f"{what}: remote side: {problem}")
        kind = memory.mem_type if memory is not None else self._default_mem_type()
        local = _DList(agent="", descs=ld, handle=None, mem_type=kind, memory=memory)
        remote = _DList(agent=remote_agent, descs=rd, handle=None, mem_type=kind)
        x = _Xfer(op=op, local=local, remote=remote, n_desc=int((lrows if strided else ld).shape[0]),
                  nbytes=int(ld[:, 1].sum()) if ld.size else 0, notif=bytes(notif),
                  owned=(local, remote))
        # strided lists are prepared lists; plain rows go through initialize_xfer
        x.coalesced_model = (coalesced_count(ld, rd) if coalesces(
            "prepped" if strided else "non_prepped") else int(ld.shape[0]))
        if ld.shape[0]:
            try:
                if strided:
                    local.handle = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", lrows, kind)
                    remote.handle = self._agent.prep_xfer_dlist(remote_agent, rrows, kind)
                    ids = np.arange(ld.shape[0], dtype=np.int64)
                    x.handle = self._agent.make_prepped_xfer(op, local.handle, ids,
                                                             remote.handle, ids, bytes(notif))
                else:
                    lx = self._agent.get_xfer_descs(ld, kind)
                    rx = self._agent.get_xfer_descs(rd, kind)
                    if lx is None or rx is None:  # hazard 3
                        raise TransportError(f"{what}: NIXL rejected the descriptor arrays")
                    x.handle = self._agent.initialize_xfer(op, lx, rx, remote_agent,
                                                           bytes(notif))
            except TransportError:
                self._drop_owned(x)
                raise
            except Exception as exc:
                self._drop_owned(x)
                hint = f"; {_NOT_FOUND_HINT}" if "NOT_FOUND" in str(exc) else ""
                raise TransportError(
                    f"{what}: {ld.shape[0]} descriptors ({x.nbytes} B): {_describe(exc)}{hint}",
                    kind="remote_disconnect" if _is_disconnect(exc)
                    else "transfer_setup_failed") from None
        local.users = remote.users = 1
        h = next(self._ids)
        self._xfers[h] = x
        return h

    def _drop_owned(self, x: _Xfer) -> None:
        for dl in x.owned:
            if dl.handle is not None and not dl.released:
                self._release_dlist(dl)
            dl.released = True

    def _xfer(self, handle: int) -> _Xfer:
        x = self._xfers.get(check_handle(handle, what=f"{self.name}: transfer"))
        if x is None:
            raise TransportError(f"{self.name}: unknown transfer handle {handle}")
        if x.released:  # hazard 1: NIXL segfaults (transfer) or lies "DONE" (check)
            raise TransportError(f"{self.name}: transfer handle {handle} was released")
        return x

    def transfer(self, handle: int) -> str:
        self._check_open()
        x = self._xfer(handle)
        if x.state == PROC:
            raise TransportError(f"{self.name}: transfer handle {handle} is still active")
        for side in (x.local, x.remote):
            if side.stale is not None or side.released:
                raise TransportError(f"{self.name}: transfer {handle} uses a "
                                     f"{'released' if side.released else 'stale'} descriptor list"
                                     f" ({side.stale or 'released'}); re-prepare it")
        x.error, x.error_kind, x.completed, x.merged_descriptors = (None, "transfer_failed",
                                                                     None, None)
        x.submitted = self._clock()
        start = time.perf_counter()
        if x.handle is None:  # nothing to move: deliver the notification, as a transfer would
            if x.notif:
                self.send_notif(x.remote.agent, x.notif)
            x.post_seconds = time.perf_counter() - start
            x.state, x.completed = DONE, self._clock()
            return DONE
        try:
            state = self._agent.transfer(x.handle)
        except Exception as exc:
            x.state = ERR
            x.error = (f"{x.op} of {x.n_desc} descriptors ({x.nbytes} B) with {x.remote.agent}: "
                       f"post failed: {_describe(exc)}")
            x.error_kind = ("remote_disconnect" if _is_disconnect(exc)
                            else "transfer_setup_failed")
            raise TransportError(f"{self.name}: {x.error}", kind=x.error_kind) from None
        x.post_seconds = time.perf_counter() - start
        self._set_state(x, state, "post")
        if x.state == PROC:
            self._posted.add(handle)
        return x.state

    def _set_state(self, x: _Xfer, state: str, where: str) -> None:
        if state == DONE:
            x.state = DONE
            if x.completed is None:
                x.completed = self._clock()
        elif state == PROC:
            x.state = PROC
        else:
            x.state = ERR
            x.error = x.error or (f"NIXL reported {state!r} at {where} for {x.op} of {x.n_desc} "
                                  f"descriptors ({x.nbytes} B) with {x.remote.agent}")

    def check_xfer_state(self, handle: int) -> str:
        x = self._xfer(handle)
        if x.state in (DONE, ERR):
            return x.state
        if x.state == "NEW":
            return PROC
        if self.closed:
            return ERR
        try:
            state = self._agent.check_xfer_state(x.handle)
        except Exception as exc:
            x.state = ERR
            x.error = (f"{x.op} of {x.n_desc} descriptors with {x.remote.agent}: polling "
                       f"failed: {_describe(exc)}")
            x.error_kind = "remote_disconnect" if _is_disconnect(exc) else "transfer_exception"
            raise TransportError(f"{self.name}: {x.error}", kind=x.error_kind) from None
        self._set_state(x, state, "poll")
        return x.state

    def transfers_in_progress(self) -> int:
        """Transfers last seen in progress (posted, not yet seen done or failed): what a rank
        that stops polling NIXL delays the completion of. 0 where UCX copies inside the post."""
        done = [h for h in self._posted
                if self._xfers[h].state != PROC or self._xfers[h].released]
        self._posted.difference_update(done)
        return len(self._posted)

    def xfer_error(self, handle: int) -> str | None:
        x = self._xfers.get(handle)
        return None if x is None else x.error

    def xfer_failure(self, handle: int) -> tuple[str, str] | None:
        """(failure class, reason) of a transfer that ended in ERR, else None."""
        x = self._xfers.get(handle)
        if x is None or x.state != ERR:
            return None
        return x.error_kind, x.error or "NIXL reported ERR"

    def release_xfer_handle(self, handle: int) -> None:
        x = releasable_xfer(self._xfers, handle, owner=self.name)
        if x is None:
            return
        self._release_xfer(handle, x)

    def _release_xfer(self, handle: int, x: _Xfer) -> bool:
        if x.handle is not None and not self.closed:
            try:
                self._agent.release_xfer_handle(x.handle)
            except Exception:
                if handle not in self._leaked:
                    self._leaked.append(handle)
                return False
        x.released = True
        for side in (x.local, x.remote):
            side.users -= 1
            if side.users == 0 and side.release_pending and not side.released:
                self._release_dlist(side)
        self._drop_owned(x)
        return True

    def open_handles(self) -> int:
        return self.resources()["transfer_handles"]

    def resources(self) -> dict[str, int]:
        """What this agent still holds (all zero after a clean shutdown)."""
        return held_resources(self._xfers, self._dlists, remote_agents=len(self._remotes),
                              registered_memory=len(self._registrations))

    # ---- notifications -------------------------------------------------------------------
    def send_notif(self, agent: str, message: bytes) -> None:
        self._check_open()
        if agent not in self._remotes:
            raise TransportError(f"{self.name}: send_notif to unknown agent {agent!r} "
                                 f"(add_remote_agent first)", kind="remote_disconnect")
        try:
            self._agent.send_notif(agent, bytes(message))
        except Exception as exc:
            raise TransportError(f"{self.name}: send_notif to {agent} ({len(message)} B) failed: "
                                 f"{_describe(exc)}",
                                 kind="remote_disconnect" if _is_disconnect(exc)
                                 else "notification_failed") from None

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        if self.closed:
            return {}
        try:
            raw = self._agent.get_new_notifs()
        except Exception as exc:
            raise TransportError(f"{self.name}: get_new_notifs failed: {_describe(exc)}",
                                 kind="transfer_exception") from None
        out: dict[str, list[bytes]] = {}
        for agent, messages in raw.items():
            key = agent.decode() if isinstance(agent, (bytes, bytearray)) else str(agent)
            out.setdefault(key, []).extend(bytes(m) for m in messages)
        return out

    def progress(self) -> dict[str, list[bytes]]:
        """Call into NIXL once (hazard 6): what a polling loop runs when it has nothing else."""
        return self.get_new_notifs()

    # ---- telemetry -----------------------------------------------------------------------
    def get_xfer_telemetry(self, handle: int) -> XferTelemetry:
        x = self._xfers.get(check_handle(handle, what=f"{self.name}: get_xfer_telemetry"))
        if x is None:
            raise TransportError(f"{self.name}: get_xfer_telemetry of unknown transfer handle "
                                 f"{handle}")
        post, total = x.post_seconds, None
        if x.handle is not None and self._telemetry_ok and x.state == DONE and not x.released:
            try:
                t = self._agent.get_xfer_telemetry(x.handle)
                post, total = t.postDuration / 1e6, t.xferDuration / 1e6
                x.merged_descriptors = int(t.descCount)
            except Exception:  # nixlNoTelemetryError: fall back to our own clock
                self._telemetry_ok = False
        if total is None:
            total = (x.completed - x.submitted) if x.completed is not None else post
        path = tuple(self.backends[:1]) + (
            (f"merged:{x.merged_descriptors}",) if x.merged_descriptors is not None else ())
        return XferTelemetry(nbytes=x.nbytes, descriptors=x.n_desc, post_seconds=post,
                             transfer_seconds=max(0.0, total - post), submitted=x.submitted,
                             completed=x.completed, path=path, coalesced=x.merged_descriptors,
                             coalesced_model=x.coalesced_model, peer=x.remote.agent or None)

    # ---- shutdown ------------------------------------------------------------------------
    def close(self, *, deadline_s: float = 5.0) -> dict[str, int]:
        """Release every transfer, list and remote agent, then deregister memory. Safe to call
        after a failure and more than once. A transfer still in PROC is polled until
        ``deadline_s``; one whose release then fails is left (counted as ``leaked``) and its
        memory stays registered, since a DMA may still be live."""
        if self.closed:
            return {"released_xfers": 0, "released_dlists": 0, "removed_agents": 0,
                    "deregistered": 0, "leaked": 0}
        report = {"released_xfers": 0, "released_dlists": 0, "removed_agents": 0,
                  "deregistered": 0, "leaked": 0}
        end = time.monotonic() + deadline_s
        live = [(h, x) for h, x in self._xfers.items() if not x.released]
        while any(x.state == PROC for _, x in live) and time.monotonic() < end:
            for h, x in live:
                if x.state == PROC:
                    try:
                        self.check_xfer_state(h)
                    except TransportError:
                        pass
            time.sleep(0.0005)
        busy: set[int] = set()
        for h, x in live:
            if self._release_xfer(h, x):  # NIXL tries to cancel a still-active one
                report["released_xfers"] += 1
            else:
                report["leaked"] += 1
                if x.local.memory is not None:
                    busy.add(id(x.local.memory))
        for dl in self._dlists.values():
            if not dl.released and not dl.users:
                self._release_dlist(dl)
                report["released_dlists"] += 1
        for name in sorted(self._remotes):
            self.remove_remote_agent(name)
            report["removed_agents"] += 1
        for r in list(self._registrations):
            if id(r.memory) in busy:
                continue
            try:
                self._agent.deregister_memory(r.reg)
                report["deregistered"] += 1
            except Exception:
                report["leaked"] += 1
            self._registrations.remove(r)
        self.closed = True
        self._torch_buffers.clear()
        self._agent = None
        return report


MASKED_CHUNK_BYTES = 64 << 20  # device_write_changed moves a span in pieces of at most this


def device_write_changed(transport: Any, memory: Memory, lo: int, changed: np.ndarray) -> int:
    """Write the host shadow's bytes ``[lo, lo + changed.size)`` to the device where ``changed``
    (a bool array) is set, leaving every other device byte as it is on the device now (a DMA may
    be landing there). Per piece of at most :data:`MASKED_CHUNK_BYTES`: one host-to-device copy of
    the values, one of the mask, and one masked assignment on the device, however scattered the
    changed bytes are (an oracle write's changed bytes come in runs of a few bytes: copying run
    by run took 145,782 copies for one 1.2 MB tiny-kimi-linear write). Returns
    the bytes moved host to device (values and mask). A no-op for DRAM."""
    tensor = getattr(transport, "device_tensor", lambda m: None)(memory)
    if tensor is None or not changed.any():
        return 0
    torch = importlib.import_module("torch")
    moved = 0
    for start in range(0, changed.size, MASKED_CHUNK_BYTES):
        mask = changed[start:start + MASKED_CHUNK_BYTES]
        if not mask.any():
            continue
        a, b = lo + start, lo + start + mask.size
        values = torch.from_numpy(memory.array[a:b]).to(tensor.device)
        where = torch.from_numpy(np.ascontiguousarray(mask)).to(tensor.device)
        view = tensor[a:b]
        view[where] = values[where]  # in place on the device tensor: only the changed bytes
        moved += 2 * mask.size
    torch.cuda.synchronize(tensor.device)
    return moved


def device_sync(transport: Any, memory: Memory, *, to_device: bool,
                ranges: Sequence[tuple[int, int]] | None = None) -> None:
    """Copy a VRAM allocation's host shadow to the device (``to_device``) or back, for the byte
    ranges given (default: all). A no-op for DRAM, where ``memory.array`` is the memory itself."""
    tensor = getattr(transport, "device_tensor", lambda m: None)(memory)
    if tensor is None:
        return
    torch = importlib.import_module("torch")
    spans = ranges if ranges is not None else [(0, memory.nbytes)]
    for lo, hi in spans:
        if hi <= lo:
            continue
        host = torch.from_numpy(memory.array[lo:hi])
        if to_device:
            tensor[lo:hi].copy_(host)
        else:
            host.copy_(tensor[lo:hi])
    torch.cuda.synchronize(tensor.device)
