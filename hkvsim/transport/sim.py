"""SimTransport: the Transport protocol over the simulated (simpy) fabric.

Memory holds real bytes (lazily committed), so transfers are byte-exact or visibly not. One
posted transfer is one fabric flow (O(1) simulated events), however many descriptors it has; its
posting is charged per descriptor left after NIXL's own coalescing (``coalesce.py``).
Hazards of real NIXL are mirrored as loud errors, the same ones ``NixlTransport`` raises: posting
a released handle, re-posting an active one, mismatched descriptor lengths, float descriptor ids,
unknown handles, wrong memory types, addresses outside registered memory, and remote lists or
transfers over memory the peer has withdrawn (its re-announced agent metadata no longer lists it;
such lists go stale, as local lists over deregistered memory do).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from functools import partial
from itertools import count
from typing import Any

import numpy as np
import simpy

from .base import (
    DONE,
    ERR,
    PROC,
    Memory,
    PeerRegistrations,
    TransportError,
    XferTelemetry,
    check_descriptor_array,
    check_handle,
    check_mem_type,
    check_op,
    AffineList,
    check_prep_descriptors,
    check_strided_array,
    decode_agent_metadata,
    encode_agent_metadata,
    expand_strided,
    held_resources,
    live_list,
    list_rows,
    overlapping,
    releasable_xfer,
    pair_descriptors,
    check_pairs,
    registration_problem,
)
from .coalesce import coalesced_count, coalesces
from .planned import nbytes_of
from .memory import copy_ranges, lazy_buffer

__all__ = ["SimWorld", "SimTransport"]

_NO_IDS = np.zeros(0, dtype=np.int64)
_PREPPED_COALESCES = coalesces("prepped")  # NIXL coalesces prepared lists (fixed per version)
_UNPREPPED_COALESCES = coalesces("non_prepped")  # initialize_xfer's lists (NIXL 1.5: not)
_ADDRESS_SPACE = 1 << 44  # each agent's memory lives in its own synthetic 16 TiB window


_ROW_IDS: dict[int, np.ndarray] = {}  # n -> [0..n) int64, read-only (make_xfer's row ids)


def _row_ids(n: int) -> np.ndarray:
    """``np.arange(n)`` as int64, read-only, shared by the transfers of n rows (only read)."""
    got = _ROW_IDS.get(n)
    if got is None:
        got = np.arange(n, dtype=np.int64)
        got.flags.writeable = False
        if len(_ROW_IDS) >= 1024:
            _ROW_IDS.clear()
        _ROW_IDS[n] = got
    return got


@dataclass(eq=False, slots=True)
class _Xfer:
    op: str
    local: "_DList"
    local_ids: np.ndarray
    remote: "_DList"
    remote_ids: np.ndarray
    notif: bytes
    state: str = "NEW"
    released: bool = False
    nbytes: int = 0
    submitted: float = 0.0
    timing: Any = None
    error: str | None = None
    error_kind: str = "transfer_failed"
    rows: int | None = None  # make_xfer: descriptors (or strided rows) as posted
    poll_raises: bool = False
    owner: Any = None  # SimWorld.post_owner when the transfer was created (who it is for)
    stray: bool = False  # the landing guard found it aimed at blocks its owner does not hold
    coalesced: int = 0  # descriptors after NIXL's coalescing: what posting is charged for
    unprepped: bool = False  # make_xfer (raw descriptors), not make_prepped_xfer
    handle: int = 0
    landing: Any = None  # (destination agent, addrs, lengths, guard memo) from the posting check


@dataclass(eq=False, slots=True)
class _DList:
    agent: str
    descs: "np.ndarray | AffineList"  # explicit (N, 3) rows, or the list's description
    released: bool = False
    stale: str | None = None  # why it may no longer be used


@dataclass(eq=False)
class _Agent:
    name: str
    endpoint: Hashable
    memories: list[Memory] = field(default_factory=list)
    inbox: dict[str, list[bytes]] = field(default_factory=dict)
    alive: bool = True


class SimWorld:
    """The shared simulated world: simpy environment, fabric, agents and their memory."""

    def __init__(self, env: simpy.Environment, fabric: Any, *, move_bytes: bool = True) -> None:
        self.env = env
        self.fabric = fabric
        self.move_bytes = move_bytes
        self._agents: dict[str, _Agent] = {}
        self._next_window = count(1)
        self._listeners: dict[str, list[Callable[[], None]]] = {}
        self.bytes_moved = 0
        self.faults: Any = None  # hkvsim.faults.FaultPlan, or None
        self.dropped_messages = 0
        # Who transfers created now are for (the driver sets it around a post; e.g. a request
        # index), and a check of a transfer's destination blocks, called when it is posted
        # (landed=False) and when its bytes land (landed=True):
        # guard(destination agent, absolute addresses, lengths, owner, landed, memo=dict) -> True
        # when some destination block is not its owner's (memo: the same dict at posting and at
        # landing of one transfer, for what the guard derives from the fixed addresses; when
        # it holds "runs" (token, side, first address) -- equal tokens and sides name equal runs
        # up to that address -- the addresses and lengths may be None, and its "extents" gives
        # them: the guard may know the runs' blocks by their key). The driver uses it to flag transfers aimed at
        # blocks their request does not hold (stray writes) and bytes landing in blocks their
        # request no longer holds (late landings).
        self.post_owner: Any = None
        self.on_death: Callable[[str], None] | None = None  # called with the agent that died
        self.killed_processes: set[str] = set()  # agents whose rank process died with them
        self.landing_guard: Callable[..., bool] | None = None
        # peer_progress(agent, t): when ``agent`` first calls into NIXL at or after time t (the
        # driver knows its rank's loop); None: completions do not wait for the remote
        self.peer_progress: Callable[[str, float], float] | None = None

    def create_agent(self, name: str, endpoint: Hashable) -> "SimTransport":
        if name in self._agents:
            raise TransportError(f"agent {name!r} already exists")
        self._agents[name] = _Agent(name=name, endpoint=endpoint)
        return SimTransport(self, name)

    def agent(self, name: str) -> _Agent:
        try:
            return self._agents[name]
        except KeyError:
            raise TransportError(f"unknown agent {name!r}", kind="remote_disconnect") from None

    def on_activity(self, agent: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever a transfer of, or a notification to, ``agent`` completes."""
        self._listeners.setdefault(agent, []).append(callback)

    def _wake(self, agent: str) -> None:
        listeners = self._listeners.get(agent)
        if listeners:
            for callback in listeners:
                callback()

    def kill(self, name: str, *, fault: str | None = None) -> None:
        """The agent dies: its peers' posts raise, in-flight transfers end in ERR. ``fault``:
        the fault kind that killed it, counted once (when the agent was alive); ``kill-rank``
        kills its rank's process too, so the rank answers nothing more either
        (``killed_processes``; ``disconnect-peer`` leaves the process running)."""
        if fault == "kill-rank":
            self.killed_processes.add(name)
        agent = self._agents.get(name)
        if agent is not None and agent.alive:
            if fault is not None and self.faults is not None:
                self.faults.count(fault)
            agent.alive = False
            if self.on_death is not None:
                self.on_death(name)
            for other in self._agents:
                self._wake(other)

    def is_alive(self, name: str) -> bool:
        agent = self._agents.get(name)
        return agent is not None and agent.alive

    def send(self, src: str, dst: str, message: bytes) -> None:
        """Deliver a notification after the fabric's latency, unless a fault drops or delays
        it."""
        delay = None
        if self.faults is not None:
            delay = self.faults.on_message(now=self.env.now, src=src, dst=dst, message=message)
            if delay == float("inf"):
                self.dropped_messages += 1
                return
        agents = self._agents  # (unknown names: agent()'s error)
        a, b = agents.get(src), agents.get(dst)
        event = self.fabric.notify((self.agent(src) if a is None else a).endpoint,
                                   (self.agent(dst) if b is None else b).endpoint)
        if delay:
            def later(_: Any, d: float = delay) -> None:
                self.env.timeout(d).callbacks.append(
                    lambda __: self._deliver(src, dst, message))
            event.callbacks.append(later)
        else:
            event.callbacks.append(lambda _: self._deliver(src, dst, message))

    def _deliver(self, src: str, dst: str, message: bytes) -> None:
        target = self._agents.get(dst)
        if target is None or not target.alive:
            return
        if self.peer_progress is not None:  # seen at the receiving rank's next NIXL poll
            seen = self.peer_progress(dst, self.env.now)
            if seen > self.env.now:
                self.env.timeout(seen - self.env.now).callbacks.append(
                    lambda _: self._take(target, src, message))
                return
        self._take(target, src, message)

    def _take(self, target: _Agent, src: str, message: bytes) -> None:
        if not target.alive:
            return
        dst = target.name
        target.inbox.setdefault(src, []).append(message)
        self._wake(dst)

    def _new_window(self) -> int:
        return next(self._next_window) * _ADDRESS_SPACE


def _resolve(memories: list[Memory], addr: np.ndarray, length: np.ndarray, who: str
             ) -> tuple[Memory, np.ndarray]:
    """Map absolute addresses to offsets in one registered memory; all must fall inside it."""
    if addr.size == 0:
        return (memories[0] if memories else None), addr  # type: ignore[return-value]
    for mem in memories:
        lo = addr.min()
        if mem.base_addr <= lo and (addr + length).max() <= mem.base_addr + mem.nbytes:
            return mem, (addr - mem.base_addr).astype(np.int64)
    bad = int(addr[0])
    raise TransportError(
        f"{who}: descriptors outside registered memory (first address {bad:#x}, "
        f"{addr.size} descriptors); NIXL would answer NOT_FOUND", kind="transfer_setup_failed")


class SimTransport:
    """One rank's agent on the simulated fabric."""

    #: make_prepped_xfer reads the structure of OuterIds (hkvsim.transport.outer)
    accepts_outer_ids = True

    def __init__(self, world: SimWorld, name: str) -> None:
        self.world = world
        self.name = name
        # this agent's record: agents are made once per name and never replaced or removed
        self._me: _Agent = world.agent(name)
        self._agents = world._agents  # the world's agents by name (never reassigned)
        self._dlists: dict[int, _DList] = {}
        self._outer_cache: dict[Any, Any] = {}  # check_pairs: geometry of OuterIds rows
        self._xfers: dict[int, _Xfer] = {}
        self._ids = count(1)
        self._remotes: set[str] = set()
        self._peers = PeerRegistrations()
        self._sizes: dict[int, int] = {}
        self._finished: list[int] = []  # handles that left PROC since take_finished()
        self._regions: np.ndarray | None = None  # _own_regions (None: to be built)
        self._make_xfer_what = f"{name}: make_xfer"  # (pair_descriptors' messages)

    # ---- memory --------------------------------------------------------------------------
    def allocate(self, nbytes: int, *, mem_type: str = "VRAM", device_id: int = 0) -> Memory:
        check_mem_type(mem_type, what=f"{self.name}: allocate")
        array = lazy_buffer(nbytes) if self.world.move_bytes else np.zeros(0, np.uint8)
        memory = Memory(base_addr=self.world._new_window(), array=array, mem_type=mem_type,
                        device_id=device_id)
        self._sizes[id(memory)] = nbytes  # timing-only memory holds no bytes but has a size
        return memory

    def _extent(self, memory: Memory) -> tuple[int, int, int]:
        return memory.base_addr, self._sizes.get(id(memory), memory.nbytes), memory.device_id

    def _own_regions(self) -> np.ndarray:
        """This agent's registered memory as (K, 3) uint64 (base, length, device), read-only;
        built once per registration (register_memory / deregister_memory drop it)."""
        regions = self._regions
        if regions is None:
            extents = [self._extent(m) for m in self.world.agent(self.name).memories]
            regions = np.array(extents, dtype=np.uint64).reshape(-1, 3)
            regions.flags.writeable = False
            self._regions = regions
        return regions

    def _own_registration_problem(self, descs: "np.ndarray | AffineList") -> str | None:
        return registration_problem(descs, self._own_regions(), whose="the registered memory")

    def register_memory(self, memory: Memory) -> None:
        agent = self.world.agent(self.name)
        if memory not in agent.memories:
            agent.memories.append(memory)
        self._regions = None

    def deregister_memory(self, memory: Memory) -> None:
        agent = self.world.agent(self.name)
        if memory not in agent.memories:
            raise TransportError(f"{self.name}: deregistering memory that is not registered")
        agent.memories.remove(memory)
        self._regions = None
        gone = np.array([self._extent(memory)], dtype=np.uint64)
        self._mark_stale(self.name, gone, "its memory was deregistered")

    def _mark_stale(self, owner: str, ranges: np.ndarray, why: str) -> None:
        """Lists of ``owner`` (this agent, or a peer) over ``ranges`` may no longer be used,
        including the lists of non-prepped transfers."""
        lists = {id(d): d for d in self._dlists.values() if not d.released}
        for x in self._xfers.values():
            if not x.released:
                lists.setdefault(id(x.local), x.local)
                lists.setdefault(id(x.remote), x.remote)
        for dl in lists.values():
            if dl.agent == owner and dl.stale is None and overlapping(dl.descs, ranges):
                dl.stale = why

    # ---- peers ---------------------------------------------------------------------------
    def get_agent_metadata(self) -> bytes:
        agent = self.world.agent(self.name)
        return encode_agent_metadata(self.name, b"", [self._extent(m) for m in agent.memories])

    def add_remote_agent(self, metadata: bytes) -> str:
        """Learn a peer, or (called again with its newer metadata) what it has registered now."""
        announced = decode_agent_metadata(metadata, what=f"{self.name}: add_remote_agent")
        name = announced.name
        if name == self.name:
            raise TransportError(f"{self.name}: add_remote_agent was given this agent's own "
                                 f"metadata", kind="handshake_failed")
        self.world.agent(name)
        self._remotes.add(name)
        withdrawn = self._peers.announce(name, announced.regions)
        if withdrawn.shape[0]:
            self._mark_stale(name, withdrawn, f"remote agent {name} deregistered that memory")
        return name

    def remove_remote_agent(self, name: str) -> None:
        self._remotes.discard(name)
        self._peers.forget(name)

    # ---- descriptor lists ----------------------------------------------------------------
    def prep_xfer_dlist(self, agent: str, descs: "np.ndarray | AffineList", *,
                        mem_type: str | None = None) -> int:
        """Prepare a list: explicit (N, 3) rows, or an affine list, kept as its description
        (addresses are computed from ids when a transfer uses them); either must lie in
        registered memory."""
        what = f"{self.name}: prep_xfer_dlist({agent or 'local'})"
        if mem_type is not None:
            check_mem_type(mem_type, what=what)
        arr = check_prep_descriptors(descs, what=what)
        owner = agent or self.name
        if agent and agent not in self._remotes:
            raise TransportError(f"{self.name}: prep_xfer_dlist for unknown remote agent {agent!r} "
                                 f"(add_remote_agent first)")
        if agent:
            problem = self._peers.problem(agent, arr)
        else:  # a local list must lie in our own registered memory, as NIXL checks it
            problem = self._own_registration_problem(arr)
        if problem is not None:
            raise TransportError(f"{what}: {problem}")
        handle = next(self._ids)
        self._dlists[handle] = _DList(agent=owner, descs=arr)
        return handle

    def release_dlist_handle(self, handle: int) -> None:
        dl = self._dlists.get(handle)
        if dl is not None:
            dl.released = True

    def _dlist(self, handle: int, side: str) -> _DList:
        return live_list(self._dlists, handle, owner=self.name, side=side)

    # ---- transfers -----------------------------------------------------------------------
    def make_prepped_xfer(self, op: str, local_dlist: int, local_ids: np.ndarray, remote_dlist: int,
                          remote_ids: np.ndarray, notif: bytes = b"") -> int:
        check_op(op, owner=self.name)
        dlists = self._dlists
        # the common case first: two known, live lists named by plain ints (else the checks
        # and messages of live_list)
        local = dlists.get(local_dlist) if type(local_dlist) is int else None
        if local is None or local.released or local.stale is not None:
            local = self._dlist(local_dlist, "local")
        remote = dlists.get(remote_dlist) if type(remote_dlist) is int else None
        if remote is None or remote.released or remote.stale is not None:
            remote = self._dlist(remote_dlist, "remote")
        if local.agent != self.name:
            raise TransportError(f"{self.name}: invalid sides (local list belongs to {local.agent})")
        pairs = check_pairs(local.descs, local_ids, remote.descs, remote_ids,
                            what=f"{self.name}: {op} with {remote.agent}",
                            outer_cache=self._outer_cache)
        li, ri = pairs.ids()
        handle = next(self._ids)
        x = _Xfer(op, local, li, remote, ri, notif if type(notif) is bytes else bytes(notif),
                  nbytes=pairs.nbytes, owner=self.world.post_owner,
                  coalesced=pairs.coalesced() if _PREPPED_COALESCES else int(li.size),
                  handle=handle)
        if self.world.landing_guard is not None and li.size:  # derive it while runs are known
            side = "local" if op == "READ" else "remote"
            runs = pairs.runs_key(side)
            if runs is None:
                self._set_landing(x, *pairs.extents(side))
            else:  # the guard may know the runs' blocks by their key: addresses when asked
                self._set_landing(x, None, None, runs=runs,
                                  extents=partial(pairs.extents, side))
        self._xfers[handle] = x
        return handle

    def make_xfer(self, op: str, local_descs: np.ndarray, remote_agent: str,
                  remote_descs: np.ndarray, notif: bytes = b"") -> int:
        """Non-prepped transfer (NIXL ``initialize_xfer``) from explicit (N, 3) descriptors, or
        (N, 5) strided rows, on both sides. Posting is charged per run (each row of an (N, 3)
        array, each of the ``count`` runs of a strided row): on the CPU VM strided lists cut
        prep time but not post time (docs/semantics.md §10). Telemetry reports the rows posted."""
        if op != "READ" and op != "WRITE":
            check_op(op, owner=self.name)
        if remote_agent not in self._remotes:
            raise TransportError(f"{self.name}: make_xfer to unknown remote agent "
                                 f"{remote_agent!r} (add_remote_agent first)")
        pairs = pair_descriptors(local_descs, remote_descs, what=self._make_xfer_what)
        ld, rd = pairs.local, pairs.remote
        rows = ld.shape[0] if pairs.local_strided is None else pairs.local_strided.shape[0]
        problem = self._own_registration_problem(ld)
        if problem is not None:
            raise TransportError(f"{self.name}: make_xfer local side: {problem}")
        problem = self._peers.problem(remote_agent, rd)
        if problem is not None:
            raise TransportError(f"{self.name}: make_xfer remote: {problem}")
        ids = _row_ids(ld.shape[0])
        handle = next(self._ids)
        nbytes = nbytes_of(ld)  # rows of a template: its byte count
        if nbytes is None:
            nbytes = int(ld[:, 1].sum())
        self._xfers[handle] = _Xfer(op=op, local=_DList(agent=self.name, descs=ld), local_ids=ids,
                                    remote=_DList(agent=remote_agent, descs=rd), remote_ids=ids,
                                    notif=bytes(notif), nbytes=nbytes,
                                    rows=int(rows), owner=self.world.post_owner, unprepped=True,
                                    # strided rows are prepared lists (coalesced); plain rows go
                                    # through initialize_xfer, which NIXL 1.5 does not coalesce
                                    coalesced=coalesced_count(ld, rd) if (
                                        _UNPREPPED_COALESCES if pairs.local_strided is None
                                        else _PREPPED_COALESCES)
                                    else int(ld.shape[0]),
                                    handle=handle)
        return handle

    def _xfer(self, handle: int) -> _Xfer:
        x = self._xfers.get(check_handle(handle, what=f"{self.name}: transfer"))
        if x is None:
            raise TransportError(f"{self.name}: unknown transfer handle {handle}")
        if x.released:
            # Real NIXL segfaults here (docs/semantics.md §11.4 hazard 1); refuse instead.
            raise TransportError(f"{self.name}: transfer handle {handle} was released")
        return x

    def transfer(self, handle: int) -> str:
        x = self._xfers.get(handle) if type(handle) is int else None
        if x is None or x.released:  # not a live handle: _xfer's checks and messages
            x = self._xfer(handle)
        if x.state == PROC:
            raise TransportError(f"{self.name}: transfer handle {handle} is still active")
        if x.local.stale is not None or x.remote.stale is not None:
            for side in (x.local, x.remote):
                if side.stale is not None:
                    raise TransportError(f"{self.name}: transfer {handle} uses a stale "
                                         f"descriptor list ({side.stale}); re-prepare it")
        remote_agent = self._agents.get(x.remote.agent)
        if remote_agent is None:  # an unknown name: agent()'s error
            remote_agent = self.world.agent(x.remote.agent)
        if not remote_agent.alive:
            raise TransportError(f"{self.name}: remote agent {x.remote.agent} disconnected",
                                 kind="remote_disconnect")
        world = self.world
        fault = None
        if world.faults is not None:
            from ..faults import request_index

            request = request_index(x.notif.decode(errors="replace"))
            for name, kind in world.faults.peers_to_kill(now=world.env.now, request=request,
                                                         initiator=self.name,
                                                         remote=x.remote.agent):
                world.kill(name, fault=kind)
            for agent in (remote_agent, self._me):
                if not agent.alive:
                    raise TransportError(f"{self.name}: agent {agent.name} disconnected",
                                         kind="remote_disconnect")
            fault = world.faults.on_post(now=world.env.now, initiator=self.name,
                                         remote=x.remote.agent, notif=x.notif)
        if fault is not None and fault.kind == "fail-setup":
            raise TransportError(f"{self.name}: injected failure posting transfer {handle}",
                                 kind="transfer_setup_failed")
        x.poll_raises = fault is not None and fault.kind == "fail-poll"
        x.state, x.submitted, x.timing, x.error = PROC, world.env.now, None, None
        x.stray = self._check_landing(x, landed=False)
        me = self._me
        src, dst = (remote_agent, me) if x.op == "READ" else (me, remote_agent)
        if fault is not None and fault.kind == "stall":
            # stuck in PROC (NIXL PR #2047 has no deadline); the transport gives up eventually
            world.env.timeout(fault.seconds).callbacks.append(
                lambda _, x=x: self._fail(x, f"injected stall: transfer stayed PROC for "
                                              f"{fault.seconds:g} s"))
            return PROC
        wire_bytes = x.nbytes * (fault.factor if fault is not None and fault.kind == "slow" else 1)
        # with NIXL's progress thread off a transfer that carries a notification completes only
        # once its remote calls into NIXL; one without does not wait (measured on UCX cma and
        # cuda_ipc: hkvsim.backends.progress_probe). Every connector transfer carries one.
        progress = world.peer_progress if x.notif else None
        event = world.fabric.transfer(
            initiator=me.endpoint, src=src.endpoint, dst=dst.endpoint, nbytes=int(wire_bytes),
            descriptors=x.coalesced, unprepped=x.unprepped,
            peer_progress=None if progress is None else partial(progress, x.remote.agent))
        if fault is not None and fault.kind == "fail":
            event.callbacks.append(lambda ev, x=x: self._fail(
                x, "injected transfer failure (state ERR)", timing=ev.value))
        else:
            event.callbacks.append(lambda ev, x=x: self._complete(x, ev.value))
        return PROC

    def _fail(self, x: _Xfer, reason: str, timing: Any = None) -> None:
        x.timing = None if timing is None else tuple(timing)
        if x.state == PROC:
            x.state, x.error = ERR, reason
            self._finished.append(x.handle)
        self.world._wake(self.name)

    def _complete(self, x: _Xfer, timing: Any) -> None:
        # the TransferTiming's fields as a plain tuple: numbers and the (shared) path, which the
        # garbage collector untracks (a long run keeps every transfer's record to its end)
        x.timing = tuple(timing)
        if x.released or x.state != PROC:
            return
        me, remote = self._me, self._agents.get(x.remote.agent)
        if remote is None:  # an unknown name: agent()'s error
            remote = self.world.agent(x.remote.agent)
        if not remote.alive or not me.alive:
            dead = remote.name if not remote.alive else me.name
            x.state, x.error, x.error_kind = ERR, f"agent {dead} disconnected", "remote_disconnect"
        else:
            try:
                if not x.stray:  # a stray transfer was reported when it was posted
                    self._check_landing(x, landed=True)
                if self.world.move_bytes:
                    self._move(x, me, remote)
                x.state = DONE
            except TransportError as exc:
                x.state, x.error = ERR, str(exc)
        self._finished.append(x.handle)
        if x.state == DONE and x.notif:
            self.world.send(self.name, remote.name, x.notif)
        self.world._wake(self.name)

    def _check_landing(self, x: _Xfer, *, landed: bool) -> bool:
        """Hand a transfer's destination runs to the world's landing guard (if any)."""
        guard = self.world.landing_guard
        if guard is None or x.local_ids.size == 0:
            return False
        if x.landing is None:  # the destination runs are fixed once posted: derive them once
            if x.op == "READ":
                rows = list_rows(x.local.descs, x.local_ids)
            else:
                rows = list_rows(x.remote.descs, x.remote_ids)
            self._set_landing(x, rows[:, 0].astype(np.int64), rows[:, 1].astype(np.int64))
        dst, addrs, lengths, memo = x.landing
        return bool(guard(dst, addrs, lengths, x.owner, landed, memo=memo))

    def _set_landing(self, x: _Xfer, addrs: np.ndarray | None, lengths: np.ndarray | None,
                     runs: Any = None, extents: Callable[[], Any] | None = None) -> None:
        """The destination byte runs of ``x``, for the landing guard: (agent, addresses,
        lengths, guard memo); the destination is the local side of a READ, the remote one of
        a WRITE. ``runs``: a key naming the runs up to their first address (the memo's
        "runs": (token, side, shift); equal tokens and sides, equal runs minus shift); then
        the addresses and lengths may be None and ``extents`` (the memo's "extents") gives
        them when the guard asks."""
        dst = self.name if x.op == "READ" else x.remote.agent
        memo: dict[str, Any] = {}
        if runs is not None:
            memo["runs"] = runs
        if addrs is None:
            assert runs is not None and extents is not None
            memo["extents"] = extents
        x.landing = (dst, addrs, lengths, memo)

    def _move(self, x: _Xfer, me: _Agent, remote: _Agent) -> None:
        ld, rd = list_rows(x.local.descs, x.local_ids), list_rows(x.remote.descs, x.remote_ids)
        lengths = ld[:, 1].astype(np.int64)
        lmem, loff = _resolve(me.memories, ld[:, 0].astype(np.int64), lengths, self.name)
        rmem, roff = _resolve(remote.memories, rd[:, 0].astype(np.int64), lengths, remote.name)
        if lengths.size == 0:
            return
        if x.op == "READ":
            moved = copy_ranges(lmem.array, loff, rmem.array, roff, lengths)
        else:
            moved = copy_ranges(rmem.array, roff, lmem.array, loff, lengths)
        self.world.bytes_moved += moved

    def wake_soon(self) -> None:
        """Have this agent's rank polled again at the current simulated time, after the call
        in progress returns (for a connector that learns of a failure only in its next poll,
        as vLLM's does after a post that raised: its engine would step again anyway)."""
        self.world.env.timeout(0).callbacks.append(lambda _event: self.world._wake(self.name))

    def take_finished(self) -> list[int]:
        """Handles whose transfer reached DONE or ERR since the last call (event-driven
        completion: a poller checks only these instead of every handle in flight)."""
        out, self._finished = self._finished, []
        return out

    def check_xfer_state(self, handle: int) -> str:
        x = self._xfer(handle)
        if x.poll_raises and x.state != PROC:
            x.poll_raises = False  # raises once, like a transient status-code exception
            raise TransportError(f"{self.name}: injected exception polling transfer {handle}",
                                 kind="transfer_exception")
        return x.state if x.state != "NEW" else PROC

    def xfer_failure(self, handle: int) -> tuple[str, str] | None:
        """(failure class, reason) of a transfer in ERR, else None."""
        x = self._xfers.get(handle)
        if x is None:
            return None
        return (x.error_kind, x.error) if x.state == ERR and x.error else None

    def release_xfer_handle(self, handle: int) -> None:
        x = releasable_xfer(self._xfers, handle, owner=self.name)
        if x is None:
            return
        x.released = True
        # keep the record (a released handle must still be refused by name) but not its id
        # arrays: long runs would otherwise hold every transfer's ids (memory ~ requests)
        if x.rows is None:
            x.rows = int(x.local_ids.size)
        x.local_ids = x.remote_ids = _NO_IDS
        x.landing = None

    def open_handles(self) -> int:
        return self.resources()["transfer_handles"]

    def resources(self) -> dict[str, int]:
        """What this agent still holds (all zero after a clean shutdown)."""
        return held_resources(self._xfers, self._dlists, remote_agents=len(self._remotes),
                              registered_memory=len(self.world.agent(self.name).memories))

    # ---- notifications -------------------------------------------------------------------
    def send_notif(self, agent: str, message: bytes) -> None:
        target = self.world.agent(agent)
        if not target.alive:
            raise TransportError(f"{self.name}: remote agent {agent} disconnected",
                                 kind="remote_disconnect")
        if not self.world.agent(self.name).alive:
            raise TransportError(f"{self.name}: this agent is dead", kind="remote_disconnect")
        self.world.send(self.name, agent, bytes(message))

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        agent = self._me
        inbox, agent.inbox = agent.inbox, {}
        return inbox

    def get_xfer_telemetry(self, handle: int) -> XferTelemetry:
        x = self._xfers.get(check_handle(handle, what=f"{self.name}: get_xfer_telemetry"))
        if x is None:
            raise TransportError(f"{self.name}: get_xfer_telemetry of unknown transfer handle "
                                 f"{handle}")
        t = x.timing  # TransferTiming's fields, in order, as a plain tuple
        if t is None:
            return XferTelemetry(nbytes=x.nbytes, descriptors=x.rows if x.rows is not None
                                 else int(x.local_ids.size),
                                 post_seconds=0.0, transfer_seconds=0.0, submitted=x.submitted,
                                 completed=None, coalesced=x.coalesced)
        submitted, post_start, post_end, _, _, done, _, _, path = t
        return XferTelemetry(nbytes=x.nbytes, descriptors=x.rows if x.rows is not None
                             else int(x.local_ids.size), post_seconds=post_end - post_start,
                             transfer_seconds=done - post_end, submitted=submitted,
                             completed=done, path=tuple(path), coalesced=x.coalesced)
