"""Links and flows: the time a transfer takes on a shared fabric (no bytes move here).

Model of one ``Fabric.transfer``:

1. **Post.** Posting is serialised per initiator endpoint (one CPU thread posting for that
   rank: first come, first served); it takes ``transfer_launch + descriptors * per_descriptor``.
2. **Wire.** The bytes then move as ONE flow over the path:

   * same endpoint      -> ``[<ep>.hbm]``                (``local_bandwidth``)
   * same node          -> ``[<src>.nvl.tx, <dst>.nvl.rx]`` (``intra_node_bandwidth`` each)
   * different nodes    -> ``[<src>.nic.tx, <dst>.nic.rx]`` (``inter_node_bandwidth`` each)

   Concurrent flows share links **max-min fairly**, computed by progressive filling: repeatedly
   take the link with the smallest fair share (remaining capacity / unfrozen flows on it; ties
   to the link seen first, flows in start order), freeze its flows at that share and remove the
   share from every link they cross. Rates are recomputed whenever a flow starts or ends, after
   the remaining bytes of every active flow have been advanced at the old rates.
   **Host path** (a profile with ``host_copy_cores``, DRAM over UCX cma): the initiating rank's
   own thread copies the bytes inside its post and poll calls, so the copy is CPU work, not a
   flow. Each node has a FIFO pool of ``host_copy_cores`` cores shared by all its ranks; a
   transfer waits for its rank's thread, then for a core of its node, and holds both for
   ``rank_dispatch`` (the rank's work before the post; ``rank_dispatch_unprepped`` for a
   transfer made from raw descriptors, whose lists NIXL prepares on the call; the first
   transfer of an operation, those a rank posts at one instant, adds ``rank_op_dispatch``),
   the post, and ``nbytes / host_copy_core_bandwidth`` (the copy). Concurrent transfers of the
   node beyond its cores queue for one, which is what the ranks of a request see on a machine
   with fewer cores than ranks. The post call returns only when its copy is done (NIXL's
   telemetry on cma counts the copy in the post): the timing's ``post_end`` is ``wire_end``,
   and the wire (the copy) lies within the post.
   With ``peer_poll_*`` the transfer then completes no earlier than the remote agent's first
   NIXL poll since the post (``peer_progress``, given by the transport for a transfer that
   carries a notification, as every connector transfer does: NIXL's progress thread off). With
   ``poll_cpu_us`` the other rank processes of the node poll NIXL on the same cores: CPU work
   that finds ``k`` of the node's cores busy (itself included) is stretched by
   ``max(1, k / max(cores - demand, 1))``, ``demand`` being the other ranks' polling
   (``FabricProfile.poll_demand`` of a core each). With ``core_contention`` it is stretched
   by ``1 + core_contention * (k - 1)`` more (busy cores slow each other down).
3. **Latency.** ``done = wire_end + path latency`` (0 for a same-endpoint copy,
   ``intra_node_latency`` within a node, ``inter_node_latency`` across nodes) ``+ the profile's
   completion overhead`` (0 unless the profile models it). Paths, including the shared per-node
   ``cpu`` link of host-path profiles, come from :func:`hkvsim.fabric.topology.route`.

Event budget: O(1) simpy events per flow, whatever its descriptor count or size. A plain-path
transfer is a chain of callbacks, not a simpy process: one event when its post ends (the next
transfer queued on its poster starts its post then, and its flow starts) and one when it is
done (its returned event, scheduled at wire end + latency), with the order of every tie at equal
times that a process queuing on a ``simpy.Resource`` would give (``tests/test_fabric_chain.py``
checks it against that process). The fabric keeps a single completion timer for all flows;
every start or end of a flow replaces it (the old timer is disarmed by a generation counter and
fires as a no-op). The host path (CPU work on cores) keeps one simpy process per transfer.

Determinism: no randomness; simultaneous events run in simpy's insertion order and all
iteration is over insertion-ordered dicts.
"""

from __future__ import annotations

import math
import operator
from collections import deque
from collections.abc import Callable, Generator, Hashable, Mapping
from typing import Any, Final, NamedTuple

import simpy
from simpy.core import NORMAL

from hkvsim.fabric.fairshare import PathGroup, max_min_rates
from hkvsim.fabric.profile import FabricProfile
from hkvsim.fabric.topology import Endpoint, route

__all__ = ["FabricError", "TransferTiming", "LinkSegment", "Fabric"]

# A flow is complete once fewer than this fraction of its bytes remain (float round-off only).
_DONE_REL: Final[float] = 1e-9
# Flows whose finish time is within this relative distance of the earliest one end together.
_TIE_REL: Final[float] = 1e-12
# rate allocations remembered per set of active paths and their flow counts (a run meets the
# same few sets again and again); forgotten all at once past this many
_MEMO_LIMIT: Final[int] = 2048


class FabricError(ValueError):
    """A transfer, notification or handshake the fabric cannot route or accept."""


class TransferTiming(NamedTuple):
    """When each phase of one transfer happened, in simulated seconds.

    ``post_start - submitted`` is the wait for the initiator's posting thread; ``post_end -
    post_start`` the post call; ``wire_end - wire_start`` the (shared) wire time; ``done -
    wire_end`` the path latency. On the host path the copy runs inside the post call, so
    ``post_start <= wire_start <= wire_end == post_end``; elsewhere the wire follows the post.

    An immutable named tuple (every transfer makes one and its record keeps it: a tuple is
    several times cheaper to make than a frozen dataclass).
    """

    submitted: float
    post_start: float
    post_end: float
    wire_start: float
    wire_end: float
    done: float
    nbytes: int
    descriptors: int
    path: tuple[str, ...]

    @property
    def post_wait(self) -> float:
        return self.post_start - self.submitted

    @property
    def post_time(self) -> float:
        return self.post_end - self.post_start

    @property
    def wire_time(self) -> float:
        return self.wire_end - self.wire_start

    @property
    def total(self) -> float:
        return self.done - self.submitted


class LinkSegment(NamedTuple):
    """A stretch of time during which ``link`` carried ``rate`` bytes/s over ``flows`` flows.

    An immutable named tuple: a run logs ~20 per request and keeps them all."""

    link: str
    t_start: float
    t_end: float
    rate: float
    capacity: float
    flows: int

    @property
    def utilisation(self) -> float:
        return self.rate / self.capacity

    @property
    def nbytes(self) -> float:
        return self.rate * (self.t_end - self.t_start)


# TransferTiming / LinkSegment from a tuple of all their fields in order, without the keyword
# handling of their generated __new__ (the hot paths make one per transfer / link change)
_new_tuple = tuple.__new__


class _Link:
    """One direction of one port: its capacity, the path groups crossing it and its open log
    segment."""

    __slots__ = ("name", "capacity", "groups", "seg_start", "seg_rate", "seg_flows")

    def __init__(self, name: str, capacity: float) -> None:
        self.name = name
        self.capacity = capacity
        self.groups: list[PathGroup] = []
        self.seg_start = 0.0
        self.seg_rate = 0.0
        self.seg_flows = 0

class _Flight:
    """One plain-path transfer between its post and its arrival: when each phase happened,
    and the event that is scheduled (with its :class:`TransferTiming`) once it has arrived."""

    __slots__ = ("env", "links", "path", "latency", "nbytes", "descriptors", "submitted",
                 "post_start", "post_end", "done")

    def __init__(self, env: simpy.Environment, links: tuple[_Link, ...], path: tuple[str, ...],
                 latency: float, nbytes: int, descriptors: int, submitted: float) -> None:
        self.env = env
        self.links = links
        self.path = path  # the links' names
        self.latency = latency
        self.nbytes = nbytes
        self.descriptors = descriptors
        self.submitted = submitted
        self.post_start = self.post_end = submitted  # set when its post starts
        self.done = simpy.Event(env)

    def arrived(self, wire_end: float) -> None:
        """The last byte left the wire at ``wire_end`` (now): the transfer is done after the
        path latency."""
        done = self.done
        done._ok = True
        done._value = _new_tuple(TransferTiming, (
            self.submitted, self.post_start, self.post_end, self.post_end, wire_end,
            wire_end + self.latency, self.nbytes, self.descriptors, self.path))
        self.env.schedule(done, NORMAL, self.latency)


def _count(name: str, value: Any) -> int:
    try:
        n = operator.index(value)
    except TypeError:
        raise FabricError(f"{name} = {value!r}: expected an integer >= 0") from None
    if n < 0:
        raise FabricError(f"{name} = {value!r}: expected an integer >= 0")
    return n


class Fabric:
    """Simulated links between placed endpoints, on one simpy environment.

    ``placement`` maps any hashable key (typically ``(engine_id, rank)``) to its
    :class:`Endpoint`; every ``initiator``/``src``/``dst`` passed later must be one of its keys.
    ``link_log`` collects closed :class:`LinkSegment` records (per link, piecewise-constant
    aggregate rate) for utilisation plots; :meth:`link_segments` adds the still-open ones.
    While the run goes on they are kept as plain tuples of their fields (numbers and the
    link's name: the garbage collector untracks them, a long run keeps ~18 per request) and
    become :class:`LinkSegment` when ``link_log`` or :meth:`link_segments` is read.
    """

    def __init__(
        self,
        env: simpy.Environment,
        profile: FabricProfile,
        placement: Mapping[Hashable, Endpoint],
    ) -> None:
        self.env = env
        self.profile = profile
        self._placement: dict[Hashable, Endpoint] = dict(placement)
        for key, ep in self._placement.items():
            if not isinstance(ep, Endpoint):
                raise FabricError(f"placement[{key!r}] = {ep!r}: expected an Endpoint")
            if not 0 <= ep.gpu < profile.gpus_per_node:
                raise FabricError(
                    f"placement[{key!r}] = {ep}: gpu index must be in 0..{profile.gpus_per_node - 1}"
                )
        # one Endpoint object per distinct endpoint (keys placed on the same GPU share it), so
        # the plain path keys its posters by identity (hashing a dataclass costs a call)
        interned: dict[Endpoint, Endpoint] = {}
        self._placement = {key: interned.setdefault(ep, ep)
                           for key, ep in self._placement.items()}
        self._links: dict[str, _Link] = {}
        self._groups: dict[tuple[_Link, ...], PathGroup] = {}
        self._active: dict[PathGroup, None] = {}  # groups with flows, in first-use order
        self._routes: dict[tuple[Hashable, Hashable], tuple[tuple[_Link, ...], float]] = {}
        self._latencies: dict[tuple[Hashable, Hashable], float] = {}
        self._posting: dict[Endpoint, simpy.Resource] = {}  # host path: each rank's thread
        # host path, rank_thread_order "loop-batches": the loop iteration (batch) each rank's
        # thread is in (its messages of one batch, then its NIXL poll)
        self._loop_batches = profile.rank_thread_order == "loop-batches"
        self._batch: dict[Endpoint, int] = {}
        # host path: when each rank last started an operation's posts
        self._op_posted_at: dict[Endpoint, float] = {}
        # plain path: each busy poster's transfers waiting to post (a poster with none: free),
        # by the id of its (interned) Endpoint
        self._post_queue: dict[int, deque[_Flight]] = {}
        self._path_names: dict[tuple[_Link, ...], tuple[str, ...]] = {}
        self._cores: dict[int, simpy.Resource] = {}  # host path: each node's CPU cores
        self._coordinator: simpy.Resource | None = None  # the coordinator's thread
        # host path with polling CPU: how many rank processes each node runs
        self._ranks_on_node: dict[int, int] = {}
        for ep in set(self._placement.values()):
            self._ranks_on_node[ep.node] = self._ranks_on_node.get(ep.node, 0) + 1
        self._fid = 0
        self._nflows = 0
        self._last_update = env.now
        self._timer_gen = 0
        self._log: list[Any] = []  # closed segments: LinkSegment fields as plain tuples ...
        self._named = 0  # ... except the first _named, made LinkSegment when the log was read
        # (group index, flows) of every active group, flattened -> (their rates, (flows, rate)
        # of every link, flattened); numbers only, so the garbage collector does not track them
        self._rate_memo: dict[tuple[int, ...], tuple[tuple[float, ...], tuple[Any, ...]]] = {}
        # link loads last logged (every link's segment holds them), and per (last loads, new
        # loads) -- by identity, the tuples kept alive -- the links whose segment changes
        self._logged: tuple[Any, ...] | None = None
        self._link_seq: tuple[_Link, ...] = ()  # self._links' values, in creation order
        self._log_memo: dict[tuple[int, int], tuple[Any, Any, tuple[int, ...]]] = {}

    # ----------------------------------------------------------------- routing

    def endpoint(self, key: Hashable) -> Endpoint:
        """The endpoint of a placement key (FabricError if unknown)."""
        try:
            return self._placement[key]
        except KeyError:
            raise FabricError(
                f"{key!r} is not placed on this fabric; known keys: "
                f"{', '.join(repr(k) for k in self._placement) or '(none)'}"
            ) from None

    def _route(self, src: Hashable, dst: Hashable) -> tuple[tuple[_Link, ...], float]:
        """The links of ``src -> dst`` and the delay from wire end to a transfer's completion
        (path latency + the profile's completion overhead); cached per pair."""
        cached = self._routes.get((src, dst))
        if cached is None:
            cached = self._routes[(src, dst)] = self._new_route(src, dst)
        return cached

    def _new_route(self, src: Hashable, dst: Hashable) -> tuple[tuple[_Link, ...], float]:
        r = route(self.profile, self.endpoint(src), self.endpoint(dst))
        return tuple(self._link(n, c) for n, c in r.links), r.latency + r.completion

    def _link(self, name: str, capacity: float) -> _Link:
        link = self._links.get(name)
        if link is None:
            link = self._links[name] = _Link(name, capacity)
            self._rate_memo.clear()  # remembered link loads list every link
        return link

    def path(self, src: Hashable, dst: Hashable) -> tuple[str, ...]:
        """Names of the links a ``src -> dst`` flow crosses."""
        return self._path_of(self._route(src, dst)[0])

    def path_latency(self, src: Hashable, dst: Hashable) -> float:
        """One-way latency of the ``src -> dst`` path, in seconds (cached per pair)."""
        latency = self._latencies.get((src, dst))
        if latency is None:
            latency = self._latencies[(src, dst)] = route(
                self.profile, self.endpoint(src), self.endpoint(dst)).latency
        return latency

    def link_capacity(self, name: str) -> float:
        """Capacity in bytes/s of a link that some flow has used."""
        return self._links[name].capacity

    # ------------------------------------------------------------- public API

    def transfer(
        self,
        *,
        initiator: Hashable,
        src: Hashable,
        dst: Hashable,
        nbytes: int,
        descriptors: int,
        peer_progress: Callable[..., float] | None = None,
        unprepped: bool = False,
    ) -> simpy.Event:
        """Post and move ``nbytes`` from ``src`` to ``dst``; the initiator's CPU posts it.

        ``peer_progress(t)`` (host path only): when the remote agent first progresses at or
        after time ``t``; the transfer completes no earlier than that after its post started.
        ``peer_progress(t, median=True)``: the median of that time (``rank_thread_order``
        "loop-batches": whether the poll ending the post's batch sees the completion).
        ``unprepped`` (host path only): made from raw descriptors (``make_xfer``), so the rank's
        dispatch is ``rank_dispatch_unprepped`` when the profile gives one.

        Returns an event that succeeds with a :class:`TransferTiming` once the data has fully
        arrived at ``dst``. ``nbytes == 0`` costs the post and the path latency only.
        """
        # plain ints >= 0 (the common case) as they are; anything else through _count
        n = nbytes if type(nbytes) is int and nbytes >= 0 else _count("nbytes", nbytes)
        d = (descriptors if type(descriptors) is int and descriptors >= 0
             else _count("descriptors", descriptors))
        if n > 0 and d == 0:
            raise FabricError(f"nbytes = {n} with descriptors = 0: bytes need a descriptor")
        poster = self.endpoint(initiator)
        links, latency = self._route(src, dst)
        if self.profile.host_cores is not None:
            dispatch = self.profile.dispatch_time(unprepped=unprepped)
            # an operation posts all its transfers at one instant of simulated time: the first
            # carries the operation's own dispatch (it plans them all before posting)
            if self._op_posted_at.get(poster) != self.env.now:
                self._op_posted_at[poster] = self.env.now
                dispatch += self.profile.op_dispatch_time(unprepped=unprepped)
            return self.env.process(self._host_transfer(
                poster, links, latency, n, d, peer_progress, dispatch))
        return self._plain_transfer(poster, links, latency, n, d)

    def notify(self, src: Hashable, dst: Hashable) -> simpy.Event:
        """An event that succeeds when a notification sent now from ``src`` reaches ``dst``
        (path latency + ``notification_latency``). Its value is the arrival time."""
        delay = self.path_latency(src, dst) + self.profile.notification_latency
        return self.env.timeout(delay, value=self.env.now + delay)

    def cpu_work(self, at: Hashable, seconds: float) -> simpy.Event:
        """An event that succeeds once ``seconds`` of CPU work started now by the rank at ``at``
        has run on its thread and a core of its node (host-path profiles: it queues for both
        like a transfer; otherwise a plain delay)."""
        if self.profile.host_cores is None:
            return self.env.timeout(seconds)
        return self.env.process(self._on_a_core(self.endpoint(at), seconds))

    def coordinator_work(self, seconds: float) -> simpy.Event:
        """An event that succeeds once ``seconds`` of the coordinator's CPU work, started now,
        has run: on the coordinator's one thread, after its earlier work, and (host path) on a
        core of node 0, where the coordinator process runs."""
        if self._coordinator is None:
            self._coordinator = simpy.Resource(self.env, capacity=1)
        return self.env.process(self._coordinator_work(seconds))

    def _coordinator_work(self, seconds: float) -> Generator[simpy.Event, Any, None]:
        assert self._coordinator is not None
        with self._coordinator.request() as thread:
            yield thread
            if self.profile.host_cores is None:
                yield self.env.timeout(seconds)
                return
            with self._node_cores(0).request() as core:
                yield core
                yield self.env.timeout(seconds * self._cpu_stretch(0, own_rank=False))

    def _on_a_core(self, ep: Endpoint, seconds: float, request: Any = None
                   ) -> Generator[simpy.Event, Any, None]:
        """``seconds`` of CPU on the rank's one thread and a core of its node; ``request``: the
        thread, as requested by ``_thread`` (default: work arriving now)."""
        with request or self._thread(ep) as thread:  # the rank's one thread does it
            yield thread
            self._granted(ep, thread)
            with self._node_cores(ep.node).request() as core:
                yield core
                yield self.env.timeout(seconds * self._cpu_stretch(ep.node))

    def _cpu_stretch(self, node: int, own_rank: bool = True) -> float:
        """How many times longer CPU work starting now on a core of ``node`` takes because the
        node's rank processes (but the one doing it, ``own_rank``) poll NIXL on its cores and
        because its other busy cores slow it (``core_contention``) (module docstring, host
        path); 1.0 when the profile models neither."""
        p = self.profile
        if not p.poll_cpu and not p.core_contention:
            return 1.0
        cores = p.host_cores
        assert cores is not None
        held = self._node_cores(node).count  # cores doing work now, this job's included
        stretch = 1.0
        if p.poll_cpu:
            pollers = self._ranks_on_node.get(node, 0) - int(own_rank)
            stretch = max(1.0, held / max(cores - pollers * p.poll_demand, 1.0))
        if p.core_contention:  # busy cores slow each other (memory, caches, hypervisor)
            stretch *= 1.0 + p.core_contention * (held - 1)
        return stretch

    def handshake(self, src: Hashable, dst: Hashable) -> simpy.Event:
        """An event that succeeds when a handshake started now between ``src`` and ``dst``
        completes (``handshake_latency`` + path latency). Its value is the completion time."""
        delay = self.profile.handshake_latency + self.path_latency(src, dst)
        return self.env.timeout(delay, value=self.env.now + delay)

    @property
    def active_flows(self) -> int:
        """Number of flows currently on the wire."""
        return self._nflows

    @property
    def link_log(self) -> list[LinkSegment]:
        """The closed segments, in the order they closed (the list the fabric appends to)."""
        log = self._log
        for i in range(self._named, len(log)):  # in place: each plain tuple is freed at once
            log[i] = _new_tuple(LinkSegment, log[i])
        self._named = len(log)
        return log

    def link_segments(self) -> list[LinkSegment]:
        """``link_log`` plus the segments still open at ``env.now`` (truncated there)."""
        now = self.env.now
        open_ = [
            LinkSegment(l.name, l.seg_start, now, l.seg_rate, l.capacity, l.seg_flows)
            for l in self._links.values()
            if l.seg_rate > 0 and now > l.seg_start
        ]
        return [*self.link_log, *open_]

    # ------------------------------------------------------------- internals

    def _poster(self, ep: Endpoint) -> simpy.Resource:
        res = self._posting.get(ep)
        if res is None:
            kind = simpy.PriorityResource if self._loop_batches else simpy.Resource
            res = self._posting[ep] = kind(self.env, capacity=1)
        return res

    def _thread(self, ep: Endpoint, *, notice: bool = False, batch: int | None = None
                ) -> simpy.resources.base.Put:
        """A request for the rank's one thread (host path). FIFO, unless the profile's
        ``rank_thread_order`` is ``"loop-batches"``: the rank loop handles every message it has
        read (a batch), then polls NIXL once, so work that arrives while the thread is busy
        waits for the next batch, and a completion noticed (``notice``) while a batch runs is
        handled at that batch's end, before the next batch's messages (``batch``: the batch
        whose closing poll sees it, when known). An idle thread starts a new batch at once."""
        res = self._poster(ep)
        if not self._loop_batches:
            return res.request()
        if batch is not None:
            return res.request(priority=batch)
        batch = self._batch.get(ep, 0)
        if res.count == 0 and not res.queue:  # idle: this starts the next loop iteration
            self._batch[ep] = batch + 1
            return res.request(priority=batch + 1)
        return res.request(priority=batch if notice else batch + 1)

    def _granted(self, ep: Endpoint, req: Any) -> None:
        """The thread went to ``req``: with loop batches, its batch is the one running."""
        if self._loop_batches:
            self._batch[ep] = max(self._batch.get(ep, 0), req.priority)

    def _node_cores(self, node: int) -> simpy.Resource:
        res = self._cores.get(node)
        if res is None:
            cores = self.profile.host_cores
            assert cores is not None
            res = self._cores[node] = simpy.Resource(self.env, capacity=cores)
        return res

    def _path_latency_only(self, latency: float) -> float:
        """``latency`` of a cached route less the profile's completion overhead."""
        return max(latency - self.profile.completion_overhead, 0.0)

    def _host_transfer(
        self,
        poster: Endpoint,
        links: tuple[_Link, ...],
        latency: float,
        nbytes: int,
        descriptors: int,
        peer_progress: Callable[..., float] | None = None,
        dispatch: float = 0.0,
    ) -> Generator[simpy.Event, Any, TransferTiming]:
        """A host-path transfer: dispatch, post and copy on one core of the initiator's node,
        after the rank's thread and a core are free; then (with ``peer_progress``) the wait for
        the remote agent to progress (module docstring)."""
        env, p = self.env, self.profile
        submitted = env.now
        with self._thread(poster) as req:
            yield req
            self._granted(poster, req)
            with self._node_cores(poster.node).request() as core:
                yield core
                stretch = self._cpu_stretch(poster.node)
                if dispatch:
                    yield env.timeout(dispatch * stretch)
                post_start = env.now
                yield env.timeout(p.post_time(descriptors) * stretch)
                wire_start = env.now
                if nbytes > 0:
                    assert p.host_copy_core_bandwidth is not None
                    yield env.timeout(nbytes / p.host_copy_core_bandwidth * stretch)
                # cma copies inside the post call: the call returns when the copy is done (what
                # NIXL's telemetry reports as the post), so the wire lies within the post
                post_end = wire_end = env.now
            notice = None
            if (self._loop_batches and p.completion_notice
                    and (peer_progress is None
                         or peer_progress(post_start, median=True) <= env.now)):
                # complete when the post returns (the path latency is a fraction of a us; the
                # remote more likely than not progressed during the post): the NIXL poll that
                # ends this batch sees it, after the batch's other messages and before the
                # next batch's
                notice = self._thread(poster, notice=True, batch=req.priority)
        if peer_progress is not None:
            progressed = peer_progress(post_start)
            if progressed > env.now:
                yield env.timeout(progressed - env.now)
        yield env.timeout(self._path_latency_only(latency))
        # the rank's poll loop notices the completion (on the rank's one thread, after the posts
        # queued on it) and the coordinator takes the message (on its thread): CPU work too,
        # queued behind whatever holds the cores
        if p.completion_notice:  # in this process (``yield from``): no extra event reorders it
            yield from self._on_a_core(poster, p.completion_notice,
                                       notice or self._thread(poster, notice=True))
        if p.coordinator_message:
            yield self.coordinator_work(p.coordinator_message)
        return TransferTiming(submitted=submitted, post_start=post_start, post_end=post_end,
                              wire_start=wire_start, wire_end=wire_end, done=env.now,
                              nbytes=nbytes, descriptors=descriptors,
                              path=self._path_of(links))

    def _plain_transfer(
        self,
        poster: Endpoint,
        links: tuple[_Link, ...],
        latency: float,
        nbytes: int,
        descriptors: int,
    ) -> simpy.Event:
        """A transfer on the plain (link) path as a chain of callbacks, no simpy process: one
        event when its post ends (its flow starts then) and its returned event, scheduled when
        its bytes have arrived (its value the :class:`TransferTiming`) -- the times and the
        order a process that queued for the poster, posted, moved its flow and waited the
        latency would see.

        Each endpoint posts one transfer at a time, first come first served: a transfer
        called while another one's post has not ended waits in its endpoint's queue and
        starts its post when that one's end is processed."""
        now = self.env.now
        flight = _Flight(self.env, links, self._path_of(links), latency, nbytes, descriptors,
                         now)
        queue = self._post_queue.get(id(poster))
        if queue is None:  # the poster is free: the post starts now
            self._post_queue[id(poster)] = deque()
            self._post(id(poster), flight)
        else:
            queue.append(flight)
        return flight.done

    def _path_of(self, links: tuple[_Link, ...]) -> tuple[str, ...]:
        """The names of ``links`` (a route's), made once per route."""
        path = self._path_names.get(links)
        if path is None:
            path = self._path_names[links] = tuple(link.name for link in links)
        return path

    def _post(self, poster: int, flight: "_Flight") -> None:
        """Start ``flight``'s post now on its (free) poster (the id of its Endpoint): its end
        is one event."""
        env = self.env
        post_time = self.profile.post_time(flight.descriptors)
        flight.post_start = env.now
        flight.post_end = env.now + post_time  # the time the event is scheduled at
        step = simpy.Event(env)  # triggered, its value (poster, flight)
        step._ok = True
        step._value = (poster, flight)
        step.callbacks.append(self._posted)
        env.schedule(step, NORMAL, post_time)

    def _posted(self, step: simpy.Event) -> None:
        """A post ended: the poster takes its next transfer (before anything else, as a
        released resource grants its next request), then the bytes go on the wire."""
        poster, flight = step._value
        queue = self._post_queue[poster]
        if queue:
            self._post(poster, queue.popleft())
        else:
            del self._post_queue[poster]
        if flight.nbytes > 0:
            self._start_flow(flight.links, flight.nbytes, flight,
                             arm=not self._flow_starts_next())
        else:
            flight.arrived(self.env.now)

    def _flow_starts_next(self) -> bool:
        """Whether the next event simpy processes is another post's end, at this instant,
        whose flow starts then: nothing runs in between, so the completion timer need only be
        armed after that one (a request's transfers end their posts together).
        Reads simpy's event queue (``Environment._queue``); False where it has none."""
        queue = getattr(self.env, "_queue", None)
        if not queue:
            return False
        at, _, _, event = queue[0]
        if at != self.env.now:
            return False
        callbacks = event.callbacks
        return (callbacks is not None and len(callbacks) == 1 and callbacks[0] == self._posted
                and event._value[1].nbytes > 0)

    # Flows on the same path (the same links) always get the same max-min fair rate, so the
    # fabric keeps one PathGroup per path: its per-flow rate, a served-bytes clock (bytes each of
    # its flows has received since the group was created) and a heap of its flows' finish
    # values on that clock. A flow start or end costs O(log n) in the heap plus O(G * L) for the
    # G active paths over L links (bounded by the deployment, not by the flows in flight).

    def _start_flow(self, links: tuple[_Link, ...], nbytes: int, flight: "_Flight",
                    arm: bool = True) -> None:
        """A flow of ``nbytes`` starts now on ``links``: reallocate the rates, log them and
        re-arm the completion timer. ``arm`` False: another flow starts at this instant before
        anything else runs, and does all three for both (the rates in between would hold for
        no time: no bytes served, no segment logged, and the timer they armed would have been
        replaced before it fired)."""
        self._advance()
        group = self._groups.get(links)
        if group is None:
            group = self._groups[links] = PathGroup(links, len(self._groups))
            for link in links:
                link.groups.append(group)
        if group not in self._active:
            self._active[group] = None
        group.push(self._fid, nbytes, flight)
        self._fid += 1
        self._nflows += 1
        if arm:
            self._reallocate()

    def _advance(self) -> None:
        """Move every active path's served-bytes clock forward to ``env.now``."""
        now = self.env.now
        dt = now - self._last_update
        if dt > 0:
            for group in self._active:
                group.served += group.rate * dt
        self._last_update = now

    def _reallocate(self, arm: bool = True) -> None:
        """Max-min fair rates per path (progressive filling), then log rates and re-arm.

        The rates are a function of the active groups (in order) and their flow counts only,
        so an allocation met before is reused (the same floats: nothing is recomputed)."""
        active = self._active
        key: list[int] = []
        for g in active:
            key += (g.index, g.n)
        got = self._rate_memo.get(tkey := tuple(key))
        if got is None:
            max_min_rates(active)
            if len(self._rate_memo) >= _MEMO_LIMIT:
                self._rate_memo.clear()
            got = self._rate_memo[tkey] = (tuple([g.rate for g in active]), self._link_loads())
        else:
            for g, rate in zip(active, got[0]):
                g.rate = rate
        self._log_rates(got[1])
        if arm:
            self._arm_timer()

    def _link_loads(self) -> tuple[Any, ...]:
        """(flows on it, aggregate rate) of every link in creation order, flattened, from the
        groups' rates."""
        loads: list[Any] = []
        for link in self._links.values():
            nflows = 0
            rate = 0.0
            for g in link.groups:
                if g.n:
                    nflows += g.n
                    rate += g.rate * g.n
            loads += (nflows, rate)
        return tuple(loads)

    def _log_rates(self, loads: tuple[Any, ...]) -> None:
        """Close the segment of every link whose (flows, rate) changes and open its new one.
        Which links change depends only on the loads logged last and the new ones (every
        link's segment holds the loads logged last; a link created since starts idle), so it
        is remembered per pair of load tuples."""
        prev = self._logged
        got = self._log_memo.get((id(prev), id(loads)))
        if got is None or got[0] is not prev or got[1] is not loads:
            changed = tuple(i for i, (link, nflows, rate) in enumerate(
                zip(self._links.values(), loads[0::2], loads[1::2]))
                if not (rate == link.seg_rate and nflows == link.seg_flows))
            if len(self._log_memo) >= _MEMO_LIMIT:
                self._log_memo.clear()
            self._log_memo[(id(prev), id(loads))] = (prev, loads, changed)
        else:
            changed = got[2]
        self._logged = loads
        if not changed:
            return
        now = self.env.now
        links = self._link_seq
        if len(links) != len(self._links):  # links are only ever added
            links = self._link_seq = tuple(self._links.values())
        for i in changed:
            link = links[i]
            nflows, rate = loads[2 * i], loads[2 * i + 1]
            if link.seg_rate > 0 and now > link.seg_start:
                self._log.append((link.name, link.seg_start, now, link.seg_rate,
                                  link.capacity, link.seg_flows))
            link.seg_start, link.seg_rate, link.seg_flows = now, rate, nflows

    def _arm_timer(self) -> None:
        """Replace the single completion timer with one for the earliest finishing flow(s);
        flows finishing within a relative ``_TIE_REL`` of it are due with it."""
        self._timer_gen += 1
        if not self._nflows:
            return
        first = math.inf  # min over the groups of (first finish - served) / rate
        for g in self._active:
            heap, rate = g.heap, g.rate
            if heap and rate > 0:
                t = max(heap[0][0] - g.served, 0.0) / rate
                if t < first:
                    first = t
        slack = first * (1 + _TIE_REL)
        for g in self._active:
            g.due_limit = g.served + g.rate * slack
        gen = self._timer_gen
        timer = self.env.timeout(first)
        timer.callbacks.append(lambda _ev: self._on_timer(gen))

    def _on_timer(self, gen: int) -> None:
        if gen != self._timer_gen:
            return  # disarmed: a flow started or ended since this timer was set
        self._advance()
        done: list[tuple[int, _Flight]] = []
        for group in list(self._active):
            group.pop_done(_DONE_REL, done)
            if not group.n:
                del self._active[group]
                group.reset()
        self._nflows -= len(done)
        self._reallocate()
        done.sort(key=operator.itemgetter(0))  # flows in start order
        now = self.env.now
        for _, flight in done:
            flight.arrived(now)
