"""The real-NIXL driver: the coordinator's events and effects on processes and wall-clock time.

``hkvsim run FILE --backend nixl``: every rank of every prefill and decode engine is its own OS
process (:mod:`hkvsim.backends.rank`) with its own NIXL agent, registered memory (DRAM by default,
VRAM with ``device="cuda"``), the unchanged connector worker and the oracle on its own bytes. This
module only moves things between them and the sans-I/O coordinator (:mod:`hkvsim.pd.coordinator`),
which holds every lifecycle rule:

1. It listens on 127.0.0.1 (an ephemeral port) and starts the ranks with multiprocessing's
   *spawn* method (primitive arguments only). Each rank says HELLO with its one-time credential
   (``side_channel.HelloGate`` admits connections: few unauthenticated at once, a small first
   frame, a short deadline, no replayed HELLO), gets SETUP (the scenario, its engine, rank, block count, memory type), registers its cache and
   answers READY with its handshake payload and agent metadata. Under torchrun
   (:mod:`hkvsim.lab`) the driver runs in global rank 0 and spawns only that worker's own rank;
   the other ranks are torchrun workers, told where to connect and their credentials through
   torchrun's store (``NixlRunOptions.spawn_ranks`` / ``announce``).
2. Each coordinator :class:`~hkvsim.pd.coordinator.Call` is sent to its rank as the operation's
   wire form with the call id as ``seq``; the rank's ``reply`` is fed back to the coordinator.
   What ranks report on their own (``outcome``, ``notif``, ``released``) becomes rank events; a
   rank process that dies (exit, signal, closed channel) becomes a ``Died`` event, so its calls
   fail and the requests moving bytes with it fail at once, naming the death.
3. The coordinator's next deadline becomes a ``loop.call_at`` timer; its time is wall-clock
   seconds since the run started.
4. Once every request is terminal, holds still waiting for a notification get ``lease_grace``
   seconds, then are expired at once (times and counters as at their deadlines) instead of
   sleeping out the lease. Then every rank shuts down (release, remove agents, deregister; also
   after a failure) and the result is the simulator's :class:`~hkvsim.pd.records.RunResult`.

Faults: ``kill-rank`` (engine and/or rank; a request, or ``at_seconds``) SIGKILLs that rank's
process as the request starts moving bytes; ``fail-transfer``, ``stall-transfer`` and
``drop-notification`` are injected inside the rank processes (:mod:`hkvsim.transport.faulty`);
``abort-request`` and ``expire-lease-early`` act in the coordinator, as on the simulator. Other
kinds are refused before anything starts: real NIXL cannot inject them, and ignoring them would
change what the run means.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from ..backends.side_channel import (
    DEFAULT_HOST,
    MAX_UNAUTHENTICATED,
    ChannelClosed,
    HelloGate,
    ProtocolError,
    RankCredentials,
    pack,
    read_message,
)
from ..faults import FaultPlan
from ..pd.cpu import blocked_warnings, merge_rank_cpu, remote_hold_warnings
from ..pd.coordinator import Call, Coordinator, Posting
from .base import CoordinatorLoop
from ..pd.deployment import build_deployment
from ..pd.ops import (
    Died,
    Message,
    Outcome,
    RankError,
    RankId,
    Released,
    Reply,
    WireError,
    op_to_wire,
    outcome_from_wire,
    reply_value_from_wire,
)
from ..pd.records import RankSetupError, RunResult
from ..scenario import Scenario

__all__ = ["NixlRunOptions", "NixlRunError", "NixlDriver", "run_scenario_nixl", "run_for_cli",
           "COORDINATOR_FAULTS"]

log = logging.getLogger("hkvsim.nixl")

PRECOMMIT_LIMIT = 4 << 30
# fault kinds the coordinator itself applies (the same code on every backend)
COORDINATOR_FAULTS = ("abort-request", "expire-lease-early")


class NixlRunError(RuntimeError):
    """The run could not start or could not be carried out (not a request failure)."""


class NixlRankSetupError(NixlRunError, RankSetupError):
    """A rank process failed while setting up its connector (registration, its local lists)."""


class _RankDied(Exception):
    """A rank process is gone; the message says which, how and its last log lines."""


class _WaitTimeout(Exception):
    """A wait ran past its deadline."""


@dataclass(frozen=True, kw_only=True)
class NixlRunOptions:
    device: str = "cpu"  # cpu: DRAM caches; cuda: VRAM caches (torch tensors), one GPU per rank
    host: str = DEFAULT_HOST  # the side channel's bind address (loopback unless a lab says so)
    port: int = 0  # 0: an ephemeral port
    progress_thread: bool = False  # NIXL's progress thread (ranks poll NIXL in their loop)
    telemetry: bool = True
    ucx_proto_info: bool = True  # have UCX print its protocol choice to the rank logs
    startup_timeout: float = 120.0  # spawn + HELLO + SETUP/READY of every rank
    command_timeout: float = 60.0  # any one driver command to a rank (stats, shutdown)
    shutdown_timeout: float = 20.0
    run_timeout: float | None = None  # whole workload; default from the scenario
    lease_grace: float | None = 1.0  # see _drain_leases; None: sleep out every lease
    precommit: bool | None = None  # commit DRAM caches at setup; None: when they fit in RAM
    log_dir: str | None = None  # keep rank logs here (default: a temp dir, removed on success)
    # Which ranks this driver starts itself (multiprocessing spawn): None = every rank (``hkvsim
    # run --backend nixl``); a set = only these, the others are started elsewhere (torchrun
    # workers, hkvsim.lab) and get where to connect and their one-time credentials from
    # ``announce``.
    spawn_ranks: frozenset[tuple[str, int]] | None = None
    # The CUDA device of each rank, where the launcher placed it (torchrun: its local rank);
    # ranks not listed get their index in the run (rank i of the run uses GPU i).
    device_ids: tuple[tuple[str, int, int], ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # extra environment for spawned rank processes
    on_listening: Callable[[str, int], None] | None = None  # called once the channel is up
    # called once the channel is up, with (host, port, {rank: one-time credential}) of the
    # ranks this driver does not spawn (hkvsim.lab publishes them in torchrun's store)
    announce: Callable[[str, int, dict[tuple[str, int], str]], None] | None = None
    # an external rank's side channel closed: treat it as dead at once (no exit status to wait
    # for), naming where it ran (hkvsim.lab: its torchrun global rank)
    describe_rank: Callable[[str, int], str] | None = None

    @property
    def mem_type(self) -> str:
        return "VRAM" if self.device == "cuda" else "DRAM"


# ---- small helpers ------------------------------------------------------------------------------
def _describe_exit(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {-code} ({name})"
    return f"exited with status {code}"


_UCX_TABLE = re.compile(r"^\[[0-9.]+\] \[[^]]*\]\s+[|+]")


def _log_tail(path: str, lines: int = 4) -> str:
    """The last few meaningful lines of a rank's log (UCX's protocol tables left out)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 20000))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    if size > 20000:
        text = text.partition("\n")[2]  # drop the partial first line
    keep = [ln.strip() for ln in text.splitlines()
            if ln.strip() and not _UCX_TABLE.search(ln) and "UCX  INFO" not in ln]
    return " | ".join(keep[-lines:])


@dataclass(eq=False)
class _Rank:
    engine: str
    role: str
    rank: int
    device_id: int
    log_path: str
    proc: Any = None
    pid: int | None = None
    writer: asyncio.StreamWriter | None = None
    pending: dict[int, asyncio.Future] = field(default_factory=dict)  # driver commands
    seq: Any = field(default_factory=lambda: count(-1, -1))  # driver commands: negative
    hello: asyncio.Future | None = None
    ready: asyncio.Future | None = None
    payload: bytes = b""
    agent_metadata: bytes = b""
    agent: str = ""
    closing: bool = False
    dead: str | None = None
    exitcode: int | None = None
    transports: list[str] = field(default_factory=list)
    emulated: list[str] = field(default_factory=list)  # GPU RMA UCX emulates (rank.py)
    credential: str = ""  # its one-time HELLO credential (side_channel.RankCredentials)
    implementation: dict[str, str] = field(default_factory=dict)  # vLLM's name and version

    @property
    def label(self) -> str:
        return f"{self.engine} rank {self.rank}"

    @property
    def key(self) -> RankId:
        return (self.engine, self.rank)


class _CommandFailed(Exception):
    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


# ---- the driver ---------------------------------------------------------------------------------
class NixlDriver:
    """Runs one scenario over real NIXL (see the module docstring)."""

    def __init__(self, scenario: Scenario, *, timing_only: bool = False,
                 options: NixlRunOptions | None = None) -> None:
        self.scenario = scenario
        self.options = options or NixlRunOptions()
        if self.options.device not in ("cpu", "cuda"):
            raise NixlRunError(f"device {self.options.device!r}; allowed: cpu, cuda")
        if self.options.device == "cuda":
            from ..lab_env import EnvError, check_alloc_conf

            try:
                check_alloc_conf()
            except EnvError as exc:
                raise NixlRunError(str(exc)) from None
        self._kills = self._check_faults(scenario)
        self._rank_env()  # refuses a variable that is not allow-listed, before anything starts
        self.dep = build_deployment(scenario)
        self.verify = scenario.workload.verify and not timing_only
        if scenario.connector.implementation == "vllm" and not self.verify:
            raise NixlRunError(f"{scenario.where}: connector.implementation: vLLM's connector "
                               f"needs real cache bytes: run with the oracle (workload.verify "
                               f"= true, no --timing-only)")
        coordinator_faults = [f for f in scenario.faults if f.kind in COORDINATOR_FAULTS]
        plan = FaultPlan(coordinator_faults, seed=scenario.scenario.seed,
                         transfer_timeout=scenario.connector.transfer_timeout_seconds
                         ) if coordinator_faults else None
        self._fault_plan = plan
        self.coord = Coordinator(self.dep, verify=self.verify, faults=plan)
        self.credentials = RankCredentials()
        self.gate: HelloGate | None = None
        self.ranks: list[_Rank] = []
        self._by_key: dict[RankId, _Rank] = {}
        self._calls: dict[int, tuple[_Rank, Any]] = {}  # call id -> rank, op
        self._calls_sent = 0  # calls sent to ranks during the workload (the coordinator CPU per call)
        self._background: set[asyncio.Task] = set()
        self._failure: str | None = None  # a coordinator or protocol error: the run is void
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._after_shutdown = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._progress: asyncio.Event | None = None
        self.loop = CoordinatorLoop(self.coord, self._carry_out, self._after_input)
        self._counters: dict[str, int] = {}
        self._log_dir = self.options.log_dir
        self._own_log_dir = False
        self.server_address: tuple[str, int] | None = None

    @staticmethod
    def _check_faults(scenario: Scenario) -> list[Any]:
        """The kill-rank faults (the driver kills processes). fail-transfer, stall-transfer and
        drop-notification are injected inside the rank processes; abort-request and
        expire-lease-early by the coordinator; any other kind is refused (silently ignoring it
        would make the run mean something else)."""
        from ..transport.faulty import WRAPPABLE_FAULTS

        kills = []
        for i, f in enumerate(scenario.faults):
            where = f"{scenario.where}: faults[{i}]"
            if f.kind in WRAPPABLE_FAULTS or f.kind in COORDINATOR_FAULTS:
                continue
            if f.kind != "kill-rank":
                supported = ", ".join(("kill-rank", *WRAPPABLE_FAULTS, *COORDINATOR_FAULTS))
                raise NixlRunError(f"{where}: fault kind {f.kind!r} is not supported by the nixl "
                                   f"backend (supported: {supported}); run it with --backend sim")
            if f.probability is not None:
                raise NixlRunError(f"{where}: kill-rank with a probability is not supported by "
                                   f"the nixl backend; target a request or at_seconds")
            if f.engine is None and f.rank is None:
                raise NixlRunError(f"{where}: kill-rank needs engine and/or rank on the nixl "
                                   f"backend (which process to kill)")
            kills.append(f)
        return kills

    def _now(self) -> float:
        return time.monotonic() - self._t0

    # ---- public ----------------------------------------------------------------------------
    def run(self) -> RunResult:
        return asyncio.run(self._main())

    async def _main(self) -> RunResult:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(_quiet_cancellations)
        self._progress = asyncio.Event()
        if self._log_dir is None:
            self._log_dir = tempfile.mkdtemp(prefix="hkvsim-nixl-")
            self._own_log_dir = True
        else:
            os.makedirs(self._log_dir, exist_ok=True)
        self._plan_ranks()
        self.gate = HelloGate(credentials=self.credentials,
                              max_pending=max(MAX_UNAUTHENTICATED, 2 * len(self.ranks)))
        server = await asyncio.start_server(self._on_connection, host=self.options.host,
                                            port=self.options.port)
        sock = server.sockets[0].getsockname()
        self.server_address = (sock[0], sock[1])
        if self.options.on_listening is not None:
            self.options.on_listening(sock[0], sock[1])
        if self.options.announce is not None:
            self.options.announce(sock[0], sock[1], {
                r.key: r.credential for r in self.ranks if not self._spawns(r)})
        ok = False
        try:
            await self._start_ranks()
            self._t0, epoch = time.monotonic(), time.time()  # the run's time origin
            try:
                await asyncio.gather(*(self._command(r, "clock", epoch=float(epoch))
                                       for r in self.ranks))
            except _RankDied as exc:
                raise NixlRankSetupError(f"rank setup failed: {exc}") from None
            except (_WaitTimeout, _CommandFailed) as exc:
                raise NixlRunError(f"startup failed: {exc}") from None
            result = await self._run_workload()
            ok = not self._failure
            return result
        finally:
            await self._shutdown_all()
            server.close()
            try:
                await asyncio.wait_for(server.wait_closed(), 2.0)
            except (asyncio.TimeoutError, Exception):
                pass
            for task in list(self._background):
                task.cancel()
            if ok and self._own_log_dir:
                shutil.rmtree(self._log_dir, ignore_errors=True)
            elif self._own_log_dir:
                log.warning("rank logs kept in %s", self._log_dir)

    # ---- ranks: planning, spawning, setup ----------------------------------------------------
    def _spawns(self, r: _Rank) -> bool:
        """Whether this driver starts ``r``'s process itself (else a launcher does)."""
        chosen = self.options.spawn_ranks
        return chosen is None or r.key in chosen

    def _plan_ranks(self) -> None:
        slot = 0
        placed = {(e, r): d for e, r, d in self.options.device_ids}
        for spec in self.dep.all_engines():
            for r in range(spec.tp):
                path = os.path.join(self._log_dir or ".", f"{spec.engine_id}.{r}.log")
                rank = _Rank(engine=spec.engine_id, role=spec.role, rank=r,
                             device_id=placed.get((spec.engine_id, r), slot), log_path=path,
                             credential=self.credentials.issue(spec.engine_id, r))
                self.ranks.append(rank)
                self._by_key[rank.key] = rank
                slot += 1

    def _rank_env(self) -> dict[str, str]:
        env = {"NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
        if self.options.ucx_proto_info and "UCX_PROTO_INFO" not in os.environ:
            env["UCX_PROTO_INFO"] = "y"
        from ..lab_env import allowed

        refused = sorted(k for k, _ in self.options.env if not allowed(k))
        if refused:
            raise NixlRunError(f"rank environment: {', '.join(refused)} not allowed (allowed: "
                               f"UCX_*, NIXL_*, CUDA_VISIBLE_DEVICES, PYTORCH_CUDA_ALLOC_CONF)")
        env.update(dict(self.options.env))
        return env

    async def _start_ranks(self) -> None:
        assert self._loop is not None
        for r in self.ranks:
            r.hello = self._loop.create_future()
            r.ready = self._loop.create_future()
        if any(self._spawns(r) for r in self.ranks):
            from ..backends.rank import rank_entry

            ctx = multiprocessing.get_context("spawn")
            host, port = self.server_address  # type: ignore[misc]
            env = self._rank_env()
            for r in self.ranks:
                if not self._spawns(r):
                    continue
                proc = ctx.Process(target=rank_entry, name=f"hkvsim-{r.engine}.{r.rank}",
                                   args=(host, port, r.credential, r.engine, r.rank,
                                         r.log_path, env), daemon=True)
                proc.start()
                r.proc, r.pid = proc, proc.pid
                self._loop.add_reader(proc.sentinel, self._on_sentinel, r)
        deadline = self.options.startup_timeout
        try:
            await self._startup_wait([r.hello for r in self.ranks], deadline)
        except _WaitTimeout:
            missing = [r.label for r in self.ranks if not r.hello.done()]  # type: ignore[union-attr]
            raise NixlRunError(f"rank process(es) did not connect within {deadline} s: "
                               f"{', '.join(missing)}" + self._log_hint(missing)) from None
        except _RankDied as exc:
            raise NixlRunError(f"startup failed: {exc}") from None
        scenario_dict = self.scenario.to_dict()
        precommit = self._precommit()
        for r in self.ranks:
            spec = self.dep.engine(r.engine)
            self._send(r, {"op": "setup", "scenario": scenario_dict, "role": r.role,
                           "num_blocks": spec.layout.num_logical_blocks,
                           "mem_type": self.options.mem_type, "device_id": r.device_id,
                           "epoch": float(time.time()),
                           "progress_thread": self.options.progress_thread,
                           "telemetry": self.options.telemetry, "oracle": self.verify,
                           "precommit": precommit})
        try:
            await self._startup_wait([r.ready for r in self.ranks], deadline)
        except _WaitTimeout:
            missing = [r.label for r in self.ranks if not r.ready.done()]  # type: ignore[union-attr]
            raise NixlRunError(f"rank(s) did not finish setup within {deadline} s: "
                               f"{', '.join(missing)}") from None
        except _RankDied as exc:
            raise NixlRankSetupError(f"rank setup failed: {exc}") from None
        want = self.scenario.connector.implementation
        for r in self.ranks:  # a rank running another connector than asked must not pass for it
            got = r.implementation.get("name", "hkvsim")
            if got != want:
                raise NixlRankSetupError(f"rank setup failed: {r.label} runs the {got!r} "
                                         f"connector; the scenario asks for {want!r}")
        for r in self.ranks:
            self.coord.set_rank_info(r.key, payload=r.payload, agent=r.agent,
                                     agent_metadata=r.agent_metadata)

    async def _startup_wait(self, futures: list[Any], timeout: float) -> None:
        """Wait for every future, or the first rank death (a rank that failed its setup says
        so at once: no waiting out the deadline), or the deadline."""
        done, pending = await asyncio.wait(futures, timeout=timeout,
                                           return_when=asyncio.FIRST_EXCEPTION)
        failures = [exc for exc in (_consume(f) for f in done) if exc is not None]
        if failures:
            raise failures[0]
        if pending:
            raise _WaitTimeout(f"startup within {timeout} s")

    def _precommit(self) -> bool:
        """Commit DRAM caches at setup (like a real, preallocated cache) when they total at most
        PRECOMMIT_LIMIT and half of the available memory (committing costs ~1 s per GB on the
        2-core VM; a scenario may size pools far beyond RAM, and the simulator's are lazy).
        HKVSIM_NIXL_PRECOMMIT=1 / 0 forces it."""
        if self.options.precommit is not None:
            return self.options.precommit
        env = os.environ.get("HKVSIM_NIXL_PRECOMMIT")
        if env in ("0", "1"):
            return env == "1"
        if self.options.mem_type != "DRAM":
            return False
        total = sum(e.layout.total_bytes * e.tp for e in self.dep.all_engines())
        try:
            with open("/proc/meminfo") as fh:
                avail = next(int(line.split()[1]) * 1024 for line in fh
                             if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return False
        if total > min(avail // 2, PRECOMMIT_LIMIT):
            log.info("DRAM caches (%.1f GB) left lazily committed: first-touch page faults "
                     "inside the first transfers slow them (HKVSIM_NIXL_PRECOMMIT=1 commits "
                     "them at setup)", total / 1e9)
            return False
        return True

    def _log_hint(self, labels: list[str]) -> str:
        tails = []
        for r in self.ranks:
            if r.label in labels:
                tail = _log_tail(r.log_path, 2)
                if tail:
                    tails.append(f"{r.label}: {tail}")
        return ("; " + "; ".join(tails)) if tails else ""

    # ---- side channel ----------------------------------------------------------------------
    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        assert self.gate is not None
        hello = await self.gate.admit(reader, writer)  # None: refused, and closed
        if hello is None:
            return
        r = self._by_key.get((hello["engine"], hello["rank"]))
        if r is None or r.writer is not None:
            writer.close()
            return
        r.writer = writer
        if r.pid is None:
            r.pid = hello["pid"]
        assert r.hello is not None
        if not r.hello.done():
            r.hello.set_result(True)
        try:
            while True:
                message = await read_message(reader)
                try:
                    self._dispatch(r, message)
                except (ProtocolError, WireError):
                    raise
                except Exception as exc:  # a coordinator bug: void the run loudly, keep reading
                    log.exception("coordinator error on a message from %s", r.label)
                    self._void(f"coordinator error: {type(exc).__name__}: {exc}")
        except (ChannelClosed, ProtocolError, WireError) as exc:
            if not r.closing and r.dead is None:
                reason = ("closed its side channel" if isinstance(exc, ChannelClosed)
                          else f"closed its side channel ({exc})")
                if r.proc is not None:
                    try:
                        await asyncio.sleep(0.3)  # let the sentinel report the exit status first
                    except asyncio.CancelledError:  # the run is over
                        return
                elif self.options.describe_rank is not None:  # started by a launcher
                    reason += f" ({self.options.describe_rank(r.engine, r.rank)})"
                self._on_death(r, reason)

    def _send(self, r: _Rank, message: dict[str, Any]) -> None:
        if r.dead is not None or r.writer is None:
            raise _RankDied(r.dead or f"{r.label} is not connected")
        r.writer.write(pack(message))

    def _dispatch(self, r: _Rank, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "reply":
            seq = message.get("seq")
            if isinstance(seq, int) and seq < 0:  # a driver command
                fut = r.pending.pop(seq, None)
                if fut is not None and not fut.done():
                    fut.set_result(message)
                return
            call = self._calls.pop(seq, None) if isinstance(seq, int) else None
            if call is None:
                raise ProtocolError(f"reply to an unknown call {seq!r} from {r.label}")
            _, rank_op = call
            if message.get("ok"):
                reply = Reply(seq, value=reply_value_from_wire(rank_op, message.get("value")))
            else:
                reply = Reply(seq, error=RankError(str(message.get("kind") or "rank_error"),
                                                   str(message.get("error"))))
            self._deliver(lambda: self.coord.on_replies([reply], self._now()))
        elif op == "ready":
            payload, md = message.get("payload"), message.get("agent_metadata")
            if not isinstance(payload, bytes) or not isinstance(md, bytes):
                raise ProtocolError("ready: payload and agent_metadata must be bytes")
            r.payload, r.agent_metadata, r.agent = payload, md, str(message.get("agent"))
            impl = message.get("implementation")
            if impl is not None:
                if not isinstance(impl, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in impl.items()):
                    raise ProtocolError("ready: implementation must map str to str")
                r.implementation = dict(impl)
            if r.ready is not None and not r.ready.done():
                r.ready.set_result(True)
        elif op == "outcome":
            event = Outcome(r.key, outcome_from_wire(message.get("outcome")))
            self._deliver(lambda: self.coord.on_events([event], self._now()))
        elif op == "notif":
            messages = message.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, bytes) for m in messages):
                raise ProtocolError("notif: messages must be a list of bytes")
            events = [Message(r.key, m) for m in messages]
            self._deliver(lambda: self.coord.on_events(events, self._now()))
        elif op == "released":
            rids = message.get("request_ids")
            if not isinstance(rids, list) or not all(isinstance(x, str) for x in rids):
                raise ProtocolError("released: request_ids must be a list of str")
            events = [Released(r.key, rid) for rid in rids]
            self._deliver(lambda: self.coord.on_events(events, self._now()))
        elif op == "fatal":
            self._on_death(r, f"failed: {message.get('error')}")
        else:
            raise ProtocolError(f"unexpected message {op!r} from {r.label}")

    def _on_sentinel(self, r: _Rank) -> None:
        assert self._loop is not None
        self._loop.remove_reader(r.proc.sentinel)
        r.proc.join(1.0)  # the sentinel can be readable a moment before the child is reapable
        r.exitcode = r.proc.exitcode
        if not r.closing:
            self._on_death(r, _describe_exit(r.exitcode))

    def _on_death(self, r: _Rank, how: str) -> None:
        if r.dead is not None:
            return
        tail = _log_tail(r.log_path)
        reason = f"{r.label} (pid {r.pid}) died: {how}"
        if tail and "last log lines" not in how and tail not in how:  # (not the same twice)
            reason += f"; last log lines: {tail}"
        r.dead = reason
        for fut in r.pending.values():
            if not fut.done():
                fut.set_exception(_RankDied(reason))
        for fut in (r.hello, r.ready):  # a startup wait ends at once, not at its deadline
            if fut is not None and not fut.done():
                fut.set_exception(_RankDied(reason))
                fut.add_done_callback(_consume)  # nobody may be waiting for it any more
        r.pending.clear()
        for call_id, (who, _) in list(self._calls.items()):
            if who is r:  # the coordinator answers them itself on the Died event
                del self._calls[call_id]
        if r.closing:
            return
        log.error("%s", reason)
        self._counters["rank_deaths"] = self._counters.get("rank_deaths", 0) + 1
        self._deliver(lambda: self.coord.on_events([Died(r.key, reason)], self._now()))

    def _void(self, why: str) -> None:
        """Something that must never happen did (a coordinator bug, a launch misconfiguration):
        stop the run; unfinished requests fail with ``why``."""
        if self._failure is None:
            self._failure = why
        assert self._progress is not None
        self._progress.set()

    # ---- moving things between the coordinator and the ranks -----------------------------------
    def _deliver(self, feed: Callable[[], None]) -> None:
        try:
            self.loop.deliver(feed)
        except Exception as exc:  # a coordinator bug: void the run, do not hang
            log.exception("coordinator error")
            self._void(f"coordinator error: {type(exc).__name__}: {exc}")

    def _carry_out(self, effects: list[Any]) -> None:
        for effect in effects:
            if isinstance(effect, Posting):
                self._kill_for(effect.request)
            elif isinstance(effect, Call):
                self._send_call(effect)

    def _after_input(self) -> None:
        self._arm_timer()
        assert self._progress is not None
        self._progress.set()

    def _send_call(self, call: Call) -> None:
        r = self._by_key[call.rank]
        if r.dead is not None:
            reply = Reply(call.call_id, error=RankError("remote_disconnect", r.dead))
            self.loop.later(lambda: self.coord.on_replies([reply], self._now()))
            return
        self._calls[call.call_id] = (r, call.op)
        self._calls_sent += 1
        self._send(r, {**op_to_wire(call.op), "seq": call.call_id})

    def _arm_timer(self) -> None:
        assert self._loop is not None
        deadline = self.coord.next_timer()
        if deadline is None or (self._timer_at is not None and self._timer_at <= deadline):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = deadline
        when = self._loop.time() + max(0.0, deadline - self._now())
        self._timer = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, None
        self._deliver(lambda: self.coord.on_timer(max(self._now(), self.coord.now)))

    async def _command(self, r: _Rank, op: str, *, timeout: float | None = None,
                       **payload: Any) -> dict[str, Any]:
        """A driver command (clock, stats, shutdown), answered by the rank process itself."""
        assert self._loop is not None
        seq = next(r.seq)
        fut = self._loop.create_future()
        r.pending[seq] = fut
        self._send(r, {"op": op, "seq": seq, **payload})
        t = self.options.command_timeout if timeout is None else timeout
        try:
            reply = await asyncio.wait_for(asyncio.shield(fut), t)
        except asyncio.TimeoutError:
            r.pending.pop(seq, None)
            raise _WaitTimeout(f"{r.label} did not answer {op} within {t} s") from None
        if not reply.get("ok"):
            raise _CommandFailed(str(reply.get("error")), str(reply.get("kind") or "rank_error"))
        return reply

    # ---- the kill-rank fault ---------------------------------------------------------------
    def _kill_targets(self, fault: Any) -> list[_Rank]:
        return [r for r in self.ranks
                if (fault.engine is None or r.engine == fault.engine)
                and (fault.rank is None or r.rank == fault.rank) and r.dead is None]

    def _kill_for(self, request: int) -> None:
        """SIGKILL the targeted rank(s) as the request starts moving bytes."""
        for fault in self._kills:
            if fault.request is not None and fault.request == request:
                for r in self._kill_targets(fault):
                    self._kill(r, f"kill-rank fault during request {request}")

    async def _kill_at(self, fault: Any) -> None:
        await asyncio.sleep(float(fault.at_seconds))
        for r in self._kill_targets(fault):
            self._kill(r, f"kill-rank fault at {fault.at_seconds:g} s")

    def _kill(self, r: _Rank, why: str) -> None:
        log.warning("%s: SIGKILL %s (pid %s)", why, r.label, r.pid)
        self._counters["faults_injected"] = self._counters.get("faults_injected", 0) + 1
        self._counters["fault:kill-rank"] = self._counters.get("fault:kill-rank", 0) + 1
        if r.proc is not None and r.pid is not None:
            os.kill(r.pid, signal.SIGKILL)
            r.proc.join(10.0)  # reap it now, so the death is known before anything else runs
            r.exitcode = r.proc.exitcode
            self._on_death(r, f"{_describe_exit(r.exitcode)} ({why})")
        else:  # a rank a launcher started (torchrun): it SIGKILLs itself, torchrun sees it
            try:
                self._send(r, {"op": "die"})
            except _RankDied:
                pass

    # ---- the workload ----------------------------------------------------------------------
    async def _run_workload(self) -> RunResult:
        assert self._progress is not None
        for f in self._kills:
            if f.request is None and f.at_seconds is not None:
                self._spawn(self._kill_at(f))
        self._calls_sent = 0
        cpu_start = time.process_time()  # the coordinator's CPU (this process) during the run
        self._deliver(lambda: self.coord.start(self._now()))
        last_arrival = max((r.arrival for r in self.coord.records), default=0.0)
        deadline = self._now() + self._run_budget(last_arrival)
        while not self.coord.finished() and self._failure is None:
            self._progress.clear()
            left = deadline - self._now()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(self._progress.wait(), min(left, 1.0))
            except asyncio.TimeoutError:
                pass
        if not self.coord.finished():
            why = self._failure or f"the run did not finish within {deadline:.0f} s"
            self.coord.give_up("stall" if self._failure is None else "remote_disconnect", why)
        await self._drain_leases()
        coordinator_cpu = {"calls": self._calls_sent,
                           "cpu_seconds": time.process_time() - cpu_start}
        stats = await self._stats()
        counters = dict(self.coord.counters)
        counters["notification_failures"] += sum(s.get("notification_failures", 0)
                                                 for s in stats)
        counters["dropped_messages"] = 0
        injected = dict(self._counters)
        if self._fault_plan is not None:
            for kind, n in self._fault_plan.injected.items():
                injected[f"fault:{kind}"] = injected.get(f"fault:{kind}", 0) + n
                injected["faults_injected"] = injected.get("faults_injected", 0) + n
        counters.update(injected)
        pools = self.coord.leaks()
        leaks = {"prefill_blocks": pools["prefill_blocks"],
                 "decode_blocks": pools["decode_blocks"],
                 "open_handles": sum(s.get("open_handles", 0) for s in stats),
                 "quarantined_blocks": pools["quarantined_blocks"]}
        await self._shutdown_ranks()
        leaks["after_shutdown"] = self._after_shutdown
        layouts = {role: es[0].layout for role, es in self.dep.engines.items()}
        rank_cpu = merge_rank_cpu([s["cpu"] for s in stats if "cpu" in s])
        return RunResult(scenario=self.scenario, records=self.coord.records,
                         handshake_errors=self.coord.handshake_errors, leaks=leaks,
                         counters=counters, sim_seconds=self.coord.makespan(), layouts=layouts,
                         warnings=(self.coord.warnings() + self._emulation_warnings()
                                   + blocked_warnings(rank_cpu)
                                   + self._remote_hold_warnings(stats)),
                         verified=self.verify, backend="nixl",
                         link_segments=[], implementation=self._implementation(),
                         rank_cpu={**rank_cpu, "coordinator": coordinator_cpu})

    def _remote_hold_warnings(self, stats: list[dict[str, Any]]) -> list[str]:
        """Transfers that waited for their remote rank to call into NIXL (pd/cpu.py): only
        with NIXL's progress thread off, where a notified transfer cannot complete otherwise."""
        if self.options.progress_thread:
            return []
        long_ops = {s["agent"]: s["long_ops"] for s in stats if "agent" in s and "long_ops" in s}
        return remote_hold_warnings((t for rec in self.coord.records for t in rec.telemetry),
                                    long_ops)

    def _emulation_warnings(self) -> list[str]:
        """One warning per rank whose GPU-to-GPU RMA UCX did by software emulation: its transfer
        times are a host bounce over a network transport, not a GPU path."""
        return [f"{r.label}: UCX moves GPU memory by software emulation, not cuda_ipc or RDMA "
                f"({'; '.join(r.emulated)}); its transfer times are not a GPU path's. On a GPU "
                f"without active NVLink UCX turns cuda_ipc READ off: "
                f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y turns it on"
                for r in self.ranks if r.emulated]

    def _implementation(self) -> dict[str, str]:
        """The connector the ranks ran when not hkvsim's core (vLLM: its name and the version
        every rank imported). Ranks that ran different ones (launcher-started ranks in other
        environments) make a run no result can be attributed to."""
        seen = sorted({tuple(sorted(r.implementation.items())) for r in self.ranks})
        if len(seen) > 1:
            raise NixlRunError(f"the ranks ran different connector implementations: "
                               f"{[dict(s) or {'name': 'hkvsim'} for s in seen]}")
        return dict(seen[0]) if seen else {}

    def _run_budget(self, last_arrival: float) -> float:
        if self.options.run_timeout is not None:
            return self.options.run_timeout
        conn = self.scenario.connector
        return last_arrival + conn.transfer_timeout_seconds + conn.lease_seconds + 60.0 + (
            0.5 * len(self.coord.records))

    async def _drain_leases(self) -> None:
        """End the prefill holds left once every request is terminal. The simulator drains its
        event queue, so a hold with no notification coming expires at its lease deadline. Here,
        once no request is loading, nothing but a late notification can free a hold: we wait
        ``lease_grace`` seconds for one, then expire the rest at once (times and counters as
        at their deadlines) instead of sleeping out the lease; after a run failure, at once."""
        if not self.coord.holds():
            return
        grace = self.options.lease_grace
        limit = self.scenario.connector.lease_seconds * 2 + 10.0 if grace is None else grace
        end = self._now() + limit
        while self.coord.holds() and self._failure is None and self._now() < end:
            await asyncio.sleep(0.02)
        self._deliver(self.coord.expire_holds)

    async def _stats(self) -> list[dict[str, Any]]:
        """Every live rank's counters, once no rank still holds a handle it could not release
        (an injected stall ends by itself: wait for it, bounded, as the simulator does)."""
        timeout = self.scenario.connector.transfer_timeout_seconds
        stalls = [f.duration_seconds or 10 * timeout for f in self.scenario.faults
                  if f.kind == "stall-transfer"]
        deadline = self._now() + (max(stalls) + 2.0 if stalls else 0.0)
        while True:
            out = await self._stats_once()
            if not any(s.get("pending_releases", 0) for s in out) or self._now() >= deadline:
                return out
            await asyncio.sleep(0.05)

    async def _stats_once(self) -> list[dict[str, Any]]:
        out = []
        for r in self.ranks:
            if r.dead is not None:
                continue
            try:
                out.append(await self._command(r, "stats", timeout=10.0))
            except (_RankDied, _WaitTimeout, _CommandFailed):
                continue
        return out

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_consume)

    # ---- shutdown --------------------------------------------------------------------------
    async def _shutdown_ranks(self) -> None:
        """Every live rank releases its handles, lists and remote agents and deregisters its
        memory (worker.shutdown, then transport.close), also after a failure; what a rank still
        held after worker.shutdown is added to ``after_shutdown``."""
        live = [r for r in self.ranks if r.dead is None and r.writer is not None and not r.closing]

        async def close(r: _Rank) -> None:
            r.closing = True
            try:
                reply = await self._command(r, "shutdown", timeout=self.options.shutdown_timeout)
                r.transports = [str(t) for t in reply.get("transports", [])]
                r.emulated = [str(t) for t in reply.get("emulated", [])]
                self._after_shutdown += int(reply.get("leftover", 0))
            except (_RankDied, _WaitTimeout, _CommandFailed, ConnectionError) as exc:
                log.warning("%s: shutdown: %s", r.label, exc)

        await asyncio.gather(*(close(r) for r in live), return_exceptions=True)

    async def _shutdown_all(self) -> None:
        """Shut down whatever is still up, then reap every process (terminate, then kill, the
        ones that do not exit in time)."""
        await self._shutdown_ranks()
        if self._timer is not None:
            self._timer.cancel()
        for r in self.ranks:
            r.closing = True
            if r.writer is not None:
                try:
                    r.writer.close()
                except Exception:
                    pass
        end = time.monotonic() + self.options.shutdown_timeout
        for r in self.ranks:
            if r.proc is None:
                continue
            if self._loop is not None:
                try:
                    self._loop.remove_reader(r.proc.sentinel)
                except Exception:
                    pass
            r.proc.join(max(0.0, end - time.monotonic()))
            if r.proc.is_alive():
                log.warning("%s did not exit; terminating it", r.label)
                r.proc.terminate()
                r.proc.join(3.0)
                if r.proc.is_alive():
                    r.proc.kill()
                    r.proc.join(3.0)

    @property
    def transports(self) -> dict[str, list[str]]:
        """UCX transports each rank reported for RMA (from UCX_PROTO_INFO), after the run."""
        return {f"{r.engine}.{r.rank}": list(r.transports) for r in self.ranks}


def _quiet_cancellations(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """Waits cut short by a rank death or a deadline leave cancelled gathers behind; that is
    expected, not an error worth a traceback. Everything else goes to the default handler."""
    if isinstance(context.get("exception"), asyncio.CancelledError):
        return
    loop.default_exception_handler(context)


def _consume(task: Any) -> BaseException | None:
    """A finished task's exception (None if it succeeded or was cancelled), marked retrieved."""
    if not task.done():
        return None
    try:
        return task.exception()
    except asyncio.CancelledError:
        return None


def run_scenario_nixl(scenario: Scenario, *, timing_only: bool = False,
                      options: NixlRunOptions | None = None) -> RunResult:
    """Run one scenario over real NIXL, one process per rank (see the module docstring)."""
    return NixlDriver(scenario, timing_only=timing_only, options=options).run()


def run_for_cli(scenarios: list[Scenario], *, timing_only: bool = False,
                progress: Any = None, progress_thread: bool = False) -> list[RunResult]:
    """``hkvsim run|sweep --backend nixl``: every scenario in turn. A setup problem (NIXL not
    importable, a rank that cannot start, an unsupported fault) prints one line and exits 2."""
    import sys

    from ..transport.nixl import NixlUnavailable, load_nixl

    try:
        load_nixl()
        items = progress(scenarios, "running on NIXL") if progress is not None else scenarios
        options = NixlRunOptions(progress_thread=progress_thread)
        return [run_scenario_nixl(s, timing_only=timing_only, options=options) for s in items]
    except (NixlUnavailable, NixlRunError) as exc:
        print(f"hkvsim: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
