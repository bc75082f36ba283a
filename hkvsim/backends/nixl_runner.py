"""``hkvsim run FILE --backend nixl``: a scenario over real NIXL, one OS process per rank.

The coordinator (this module, in the CLI process) plays the scheduler and the proxy; every rank
of every prefill and decode engine is a separate process (:mod:`hkvsim.backends.rank`) with its
own NIXL agent, its own registered memory (DRAM by default, VRAM with ``device="cuda"``), the
unchanged :class:`~hkvsim.connector.worker.ConnectorWorker`, and the oracle on its own bytes.

Processes and messages (all over the side channel, :mod:`hkvsim.backends.side_channel`):

1. The coordinator listens on 127.0.0.1 (an ephemeral port) and starts the ranks with
   multiprocessing's *spawn* method (the launcher the lab launcher shares; primitive arguments
   only). Each rank says HELLO with the run's random token, gets SETUP (the scenario, its engine,
   rank, block count, memory type), registers its cache and answers READY with its handshake
   payload and agent metadata.
2. Per request, as :class:`hkvsim.cluster.Cluster` does it: the coordinator owns the block
   allocators; it tells every prefill rank to compute (oracle fill of N-1 tokens for models with
   state, N otherwise) and arms a wall-clock lease; it allocates decode's blocks and has decode
   ranks prefix-fill their hit tokens.
3. Pull: on first use of a pair, every decode rank runs ``worker.connect`` with all prefill
   payloads (a refusal becomes a ``handshake_failed`` request failure and a
   ``handshake_errors`` entry); each decode rank then posts its READs (``start_read``). Prefill
   ranks forward their NIXL notifications; the coordinator frees prefill blocks when every
   prefill rank has its expected count (or the lease expires).
4. Push: decode rank 0 learns prefill's agents (notification-only handshake) and sends the
   ``PUSH_REG:`` registration over NIXL notifications to every prefill rank; each prefill rank
   forwards it, the coordinator matches it to the published request (exact or base id, either
   arrival order), runs the reverse handshake and has that rank post its WRITEs (``start_write``);
   decode ranks forward the WRITE notifications, counted max(1, P_TP // D_TP) per rank.
5. Decode ranks post-process (block size ratio), verify every loaded byte against the oracle and
   compute token N. Then the coordinator collects open-handle counts, shuts every rank down
   (release, remove agents, deregister; also after a failure) and builds a
   :class:`hkvsim.cluster.RunResult`, so ``results.result_json`` gives the simulator's JSON.

Every wait has a deadline. A rank process that dies (exit, signal, closed channel) fails every
unfinished request with ``remote_disconnect`` and the reason ("decode0 rank 1 (pid 123) died:
killed by signal 9 (SIGKILL)", plus the tail of its log), then the run shuts down the survivors;
a rank that does not exit in time is terminated, then killed. Times in the result are wall-clock
seconds since the run started (``RunResult.backend = "nixl"``; the JSON says ``time.clock = "wall"``).

Faults: ``kill-rank`` (engine and/or rank; a request, or at_seconds) SIGKILLs that rank's process
right after the request's transfer starts. Other fault kinds are refused before anything starts:
real NIXL cannot inject them, and ignoring them would change what the run means.

Differences from the simulator, all from running in wall-clock time: notification-driven frees do
not bump block versions (NIXL sends a READ's notification only after the READ is done; here it can
reach the coordinator before decode's completion report); once every request is terminal, holds
still waiting for a notification are expired after ``lease_grace`` seconds instead of sleeping out
the lease; a rank death fails every unfinished request at once. DRAM caches are committed at setup
when they fit (see ``_precommit``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import re
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import numpy as np

from ..cluster import (
    BlockAllocator,
    RequestRecord,
    RunResult,
    default_num_blocks,
    engine_layout,
    freed_while_reading,
)
from ..connector.blocks import expand_logical, to_sub_blocks
from ..connector.push import PUSH_PREFIX, PushRegistration, base_request_id
from ..connector.quirks import check_quirks
from ..connector.worker import parse_notification
from ..geometry.layout import EngineLayout
from ..scenario import Scenario
from .side_channel import (
    DEFAULT_HOST,
    ChannelClosed,
    ProtocolError,
    groups_out,
    ids_out,
    pack,
    read_message,
    token_ok,
)

__all__ = ["NixlRunOptions", "NixlRunError", "run_scenario_nixl", "NixlCluster"]

log = logging.getLogger("hkvsim.nixl")


PRECOMMIT_LIMIT = 4 << 30


class NixlRunError(RuntimeError):
    """The run could not start or could not be carried out (not a request failure)."""


class RankDied(Exception):
    """A rank process is gone; the message says which, how and its last log lines."""


class WaitTimeout(Exception):
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
    command_timeout: float = 60.0  # any one command to a rank
    shutdown_timeout: float = 20.0
    run_timeout: float | None = None  # whole workload; default from the scenario
    lease_grace: float | None = 1.0  # see _drain_leases; None: sleep out every lease
    precommit: bool | None = None  # commit DRAM caches at setup; None: when they fit in RAM
    log_dir: str | None = None  # keep rank logs here (default: a temp dir, removed on success)
    spawn: bool = True  # False: ranks are started by node agents (hardware/launch.py)
    nodes: int = 1  # node agents expected when spawn is False
    env: tuple[tuple[str, str], ...] = ()  # extra environment for the rank processes
    token: str | None = None  # shared secret of a multi-node run (default: a random one)
    slots_per_node: int | None = None  # spawn=False: rank slots (GPUs) per node
    on_listening: Callable[[str, int], None] | None = None  # called once the channel is up

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
    pending: dict[int, asyncio.Future] = field(default_factory=dict)
    seq: Any = field(default_factory=lambda: count(1))
    hello: asyncio.Future | None = None
    ready: asyncio.Future | None = None
    payload: bytes = b""
    agent_metadata: bytes = b""
    agent: str = ""
    closing: bool = False
    dead: str | None = None
    exitcode: int | None = None
    transports: list[str] = field(default_factory=list)
    node: int = 0

    @property
    def label(self) -> str:
        return f"{self.engine} rank {self.rank}"


@dataclass(eq=False)
class _Engine:
    engine_id: str
    role: str
    layout: EngineLayout
    allocator: BlockAllocator
    ranks: list[_Rank] = field(default_factory=list)
    freed: asyncio.Future | None = None
    connections: dict[str, asyncio.Future] = field(default_factory=dict)
    block_version: np.ndarray | None = None  # bumped on every free (early-free detection)
    loading: dict[str, tuple[str, str]] = field(default_factory=dict)  # d rid -> (p engine, p rid)
    heartbeat: asyncio.Task | None = None
    last_used: dict[str, float] = field(default_factory=dict)
    notify_ready: dict[str, asyncio.Future] = field(default_factory=dict)

    @property
    def tp(self) -> int:
        return self.layout.tp


@dataclass(kw_only=True)
class _DecodeJob:
    blocks: dict[int, np.ndarray]
    load: dict[int, np.ndarray]
    hit_blocks: int
    load_tokens: int
    recomputed: bool = False


@dataclass(kw_only=True)
class _PushWait:
    done: asyncio.Future
    decode: _Engine
    counts: dict[int, int]


@dataclass(kw_only=True)
class _Outcome:
    """A RequestOutcome as it came over the side channel (the fields _account reads)."""

    request_id: str
    ok: bool
    reason: str | None
    failure_class: str | None
    descriptors: int
    nbytes: int
    transfers: int
    telemetry: list[dict[str, Any]]
    rank: _Rank | None = None


def _outcome_in(data: Any, rank: _Rank) -> _Outcome:
    if not isinstance(data, dict):
        raise ProtocolError("outcome must be a map")
    try:
        return _Outcome(request_id=str(data["request_id"]), ok=bool(data["ok"]),
                        reason=data["reason"], failure_class=data["failure_class"],
                        descriptors=int(data["descriptors"]), nbytes=int(data["nbytes"]),
                        transfers=int(data["transfers"]), telemetry=list(data["telemetry"]),
                        rank=rank)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(f"malformed outcome: {exc}") from None


# ---- the coordinator ----------------------------------------------------------------------------
class NixlCluster:
    """Runs one scenario over real NIXL (see the module docstring)."""

    def __init__(self, scenario: Scenario, *, timing_only: bool = False,
                 options: NixlRunOptions | None = None) -> None:
        self.scenario = scenario
        self.options = options or NixlRunOptions()
        if self.options.device not in ("cpu", "cuda"):
            raise NixlRunError(f"device {self.options.device!r}; allowed: cpu, cuda")
        self.model = scenario.model_spec()
        self.quirks = check_quirks(list(scenario.connector.quirks))
        self.verify = scenario.workload.verify and not timing_only
        self.rng = np.random.default_rng(scenario.scenario.seed)
        self.prompts, self.hits = scenario.request_lengths(self.rng)
        self.hybrid = self.model.is_hybrid
        self.token = self.options.token or secrets.token_hex(16)
        conn = scenario.connector
        self.engines: dict[str, list[_Engine]] = {"prefill": [], "decode": []}
        for role in ("prefill", "decode"):
            section = getattr(scenario, role)
            for i in range(section.instances):
                probe = engine_layout(self.model, section, num_blocks=1,
                                      registration_order=conn.registration_order,
                                      quirks=self.quirks)
                blocks = section.num_blocks or default_num_blocks(
                    probe, self.prompts, max_inflight=self.scenario.workload.max_inflight,
                    instances=section.instances)
                layout = engine_layout(self.model, section, num_blocks=blocks,
                                       registration_order=conn.registration_order,
                                       quirks=self.quirks)
                self.engines[role].append(_Engine(
                    engine_id=f"{role}{i}", role=role, layout=layout,
                    allocator=BlockAllocator(blocks),
                    block_version=np.zeros(layout.num_logical_blocks, dtype=np.int64)))
        self.records: list[RequestRecord] = []
        self.handshake_errors: list[str] = []
        self.counters = {"lease_expiries": 0, "late_notifications": 0, "notifications": 0,
                         "malformed_registrations": 0, "notification_failures": 0,
                         "recomputed": 0, "handshakes": 0, "evictions": 0}
        self._pending_notifs: dict[tuple[str, str], dict[int, int]] = {}
        self._prefill_held: dict[tuple[str, str], tuple[_Engine, dict[int, np.ndarray],
                                                        RequestRecord]] = {}
        self._decode_waiters: dict[str, tuple[asyncio.Future, dict[int, _Outcome], int]] = {}
        self._leases: dict[tuple[str, str], asyncio.Task] = {}
        self._lease_deadline: dict[tuple[str, str], float] = {}
        self._published: dict[tuple[str, str], tuple[str, dict[int, np.ndarray],
                                                     RequestRecord]] = {}
        self._deferred: dict[tuple[str, str], list[tuple[int, PushRegistration, bytes]]] = {}
        self._write_outcomes: dict[tuple[str, str], dict[int, _Outcome]] = {}
        self._registration_ids: dict[tuple[str, str], str] = {}
        self._push_waiters: dict[str, _PushWait] = {}
        self._telemetry_owner: list[tuple[dict[str, Any], _Rank]] = []
        self._background: set[asyncio.Task] = set()
        self._failure: str | None = None
        self._dead: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._kills = self._check_faults(scenario)
        self._after_shutdown = 0
        self._log_dir = self.options.log_dir
        self._own_log_dir = False
        self.server_address: tuple[str, int] | None = None
        self._nodes: list[dict[str, Any]] = []

    @staticmethod
    def _check_faults(scenario: Scenario) -> list[Any]:
        """The kill-rank faults (the coordinator kills processes). fail-transfer, stall-transfer
        and drop-notification are injected inside the rank processes; any other kind is refused
        (silently ignoring it would make the run mean something else)."""
        from ..transport.faulty import WRAPPABLE_FAULTS

        kills = []
        for i, f in enumerate(scenario.faults):
            where = f"{scenario.where}: faults[{i}]"
            if f.kind in WRAPPABLE_FAULTS:
                continue  # injected inside the rank processes (hkvsim/transport/faulty.py)
            if f.kind != "kill-rank":
                raise NixlRunError(f"{where}: fault kind {f.kind!r} is not supported by the nixl "
                                   f"backend (supported: kill-rank, {', '.join(WRAPPABLE_FAULTS)})"
                                   f"; run it with --backend sim")
            if f.probability is not None:
                raise NixlRunError(f"{where}: kill-rank with a probability is not supported by "
                                   f"the nixl backend; target a request or at_seconds")
            if f.engine is None and f.rank is None:
                raise NixlRunError(f"{where}: kill-rank needs engine and/or rank on the nixl "
                                   f"backend (which process to kill)")
            kills.append(f)
        return kills

    def prefill_tokens(self, prompt: int) -> int:
        return prompt - 1 if self.hybrid else prompt

    def _suffix(self) -> str:
        return f"{int(self.rng.integers(1 << 32)):08x}"

    def _now(self) -> float:
        return time.monotonic() - self._t0

    @property
    def all_ranks(self) -> list[_Rank]:
        return [r for es in self.engines.values() for e in es for r in e.ranks]

    # ---- public ----------------------------------------------------------------------------
    def run(self) -> RunResult:
        return asyncio.run(self._main())

    async def _main(self) -> RunResult:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(_quiet_cancellations)
        self._dead = asyncio.Event()
        if self._log_dir is None:
            self._log_dir = tempfile.mkdtemp(prefix="hkvsim-nixl-")
            self._own_log_dir = True
        else:
            os.makedirs(self._log_dir, exist_ok=True)
        self._plan_ranks()
        server = await asyncio.start_server(self._on_connection, host=self.options.host,
                                            port=self.options.port)
        sock = server.sockets[0].getsockname()
        self.server_address = (sock[0], sock[1])
        if self.options.on_listening is not None:
            self.options.on_listening(sock[0], sock[1])
        ok = False
        try:
            await self._start_ranks()
            self._t0, epoch = time.monotonic(), time.time()  # the run's time origin
            try:
                await self._call_all(self.all_ranks, "clock", epoch=float(epoch))
            except (RankDied, WaitTimeout, _CommandFailed) as exc:
                raise NixlRunError(f"startup failed: {exc}") from None
            for e in (e for es in self.engines.values() for e in es):
                e.freed = self._loop.create_future()
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
    def _plan_ranks(self) -> None:
        slot = 0
        for role in ("prefill", "decode"):
            for engine in self.engines[role]:
                for r in range(engine.tp):
                    path = os.path.join(self._log_dir or ".", f"{engine.engine_id}.{r}.log")
                    engine.ranks.append(_Rank(engine=engine.engine_id, role=role, rank=r,
                                              device_id=slot, log_path=path))
                    slot += 1

    def _rank(self, engine: str, rank: int) -> _Rank | None:
        for r in self.all_ranks:
            if r.engine == engine and r.rank == rank:
                return r
        return None

    def _rank_env(self) -> dict[str, str]:
        env = {"NIXL_LOG_LEVEL": os.environ.get("NIXL_LOG_LEVEL", "WARN")}
        if self.options.ucx_proto_info and "UCX_PROTO_INFO" not in os.environ:
            env["UCX_PROTO_INFO"] = "y"
        env.update(dict(self.options.env))
        return env

    async def _start_ranks(self) -> None:
        assert self._loop is not None
        for r in self.all_ranks:
            r.hello = self._loop.create_future()
            r.ready = self._loop.create_future()
        if self.options.spawn:
            from .rank import rank_entry

            ctx = multiprocessing.get_context("spawn")
            host, port = self.server_address  # type: ignore[misc]
            env = self._rank_env()
            for r in self.all_ranks:
                proc = ctx.Process(target=rank_entry, name=f"hkvsim-{r.engine}.{r.rank}",
                                   args=(host, port, self.token, r.engine, r.rank, r.log_path,
                                         env), daemon=True)
                proc.start()
                r.proc, r.pid = proc, proc.pid
                self._loop.add_reader(proc.sentinel, self._on_sentinel, r)
        deadline = self.options.startup_timeout
        try:
            await self._wait(asyncio.shield(asyncio.gather(*(r.hello for r in self.all_ranks))),
                             deadline, "every rank to connect")
        except WaitTimeout:
            missing = [r.label for r in self.all_ranks if not r.hello.done()]
            raise NixlRunError(f"rank process(es) did not connect within {deadline} s: "
                               f"{', '.join(missing)}" + self._log_hint(missing)) from None
        except RankDied as exc:
            raise NixlRunError(f"startup failed: {exc}") from None
        scenario_dict = self.scenario.to_dict()
        precommit = self._precommit()
        for r in self.all_ranks:
            engine = self._engine(r.engine)
            self._send(r, {"op": "setup", "scenario": scenario_dict, "role": r.role,
                           "num_blocks": engine.layout.num_logical_blocks,
                           "mem_type": self.options.mem_type, "device_id": r.device_id,
                           "epoch": float(time.time()),
                           "progress_thread": self.options.progress_thread,
                           "telemetry": self.options.telemetry, "oracle": self.verify,
                           "precommit": precommit})
        try:
            await self._wait(asyncio.shield(asyncio.gather(*(r.ready for r in self.all_ranks))),
                             deadline, "every rank to register its memory")
        except WaitTimeout:
            missing = [r.label for r in self.all_ranks if not r.ready.done()]
            raise NixlRunError(f"rank(s) did not finish setup within {deadline} s: "
                               f"{', '.join(missing)}") from None
        except RankDied as exc:
            raise NixlRunError(f"rank setup failed: {exc}") from None

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
        if self.options.mem_type != "DRAM" or not self.options.spawn:
            return False
        total = sum(e.layout.total_bytes * e.tp for es in self.engines.values() for e in es)
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
        for r in self.all_ranks:
            if r.label in labels:
                tail = _log_tail(r.log_path, 2)
                if tail:
                    tails.append(f"{r.label}: {tail}")
        return ("; " + "; ".join(tails)) if tails else ""

    def _engine(self, engine_id: str) -> _Engine:
        for es in self.engines.values():
            for e in es:
                if e.engine_id == engine_id:
                    return e
        raise KeyError(engine_id)

    # ---- side channel ----------------------------------------------------------------------
    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        try:
            hello = await asyncio.wait_for(read_message(reader), 30.0)
        except (asyncio.TimeoutError, ChannelClosed, ProtocolError):
            writer.close()
            return
        if not token_ok(hello.get("token"), self.token):
            log.warning("side channel: refused a connection with a wrong token")
            writer.close()
            return
        if hello.get("op") == "node_hello":
            await self._node_session(hello, reader, writer)
            return
        r = None
        if hello.get("op") == "hello" and isinstance(hello.get("engine"), str) and isinstance(
                hello.get("rank"), int) and not isinstance(hello.get("rank"), bool):
            r = self._rank(hello["engine"], hello["rank"])
        if r is None or r.writer is not None:
            writer.close()
            return
        r.writer = writer
        if r.pid is None and isinstance(hello.get("pid"), int):
            r.pid = hello["pid"]
        assert r.hello is not None
        if not r.hello.done():
            r.hello.set_result(True)
        try:
            while True:
                message = await read_message(reader)
                try:
                    self._dispatch(r, message)
                except ProtocolError:
                    raise
                except Exception as exc:  # a coordinator bug: fail the run loudly, keep reading
                    log.exception("coordinator error on a message from %s", r.label)
                    if self._failure is None:
                        self._failure = f"coordinator error: {type(exc).__name__}: {exc}"
                        assert self._dead is not None
                        self._dead.set()
        except (ChannelClosed, ProtocolError) as exc:
            if not r.closing and r.dead is None:
                reason = f"closed its side channel ({exc})" if isinstance(
                    exc, ProtocolError) else "closed its side channel"
                try:
                    await asyncio.sleep(0.3)  # let the sentinel report the exit status first
                except asyncio.CancelledError:  # the run is over
                    return
                self._on_death(r, reason)

    async def _node_session(self, hello: dict[str, Any], reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        """A node agent of the lab launcher: it gets the ranks it must start, and reports the
        ones that die. Ranks are given out node by node, engine by engine (an engine's ranks
        never straddle nodes when they fit on one)."""
        gpus = hello.get("slots")
        node = hello.get("node")
        if not isinstance(gpus, int) or not isinstance(node, int) or gpus < 1:
            writer.close()
            return
        if any(n["node"] == node for n in self._nodes):
            log.error("node %d connected twice; refused", node)
            writer.close()
            return
        self._nodes.append({"node": node, "slots": gpus, "writer": writer})
        assignments = self._assign_node(node, gpus)
        needed = 1 + max(r.node for r in self.all_ranks)
        if needed > self.options.nodes:
            self._failure = (f"the scenario needs {needed} node(s) of {gpus} slot(s) for "
                             f"{len(self.all_ranks)} ranks; the run was started with "
                             f"--nodes {self.options.nodes}")
            assert self._dead is not None
            self._dead.set()
        writer.write(pack({"op": "assign", "ranks": [
            [r.engine, r.rank, r.device_id, os.path.basename(r.log_path)] for r in assignments],
            "env": self._rank_env()}))
        try:
            while True:
                message = await read_message(reader)
                if message.get("op") == "died":
                    r = self._rank(str(message.get("engine")), int(message.get("rank", -1)))
                    if r is not None:
                        r.exitcode = message.get("exitcode") if isinstance(
                            message.get("exitcode"), int) else None
                        self._on_death(r, _describe_exit(r.exitcode) + (
                            f"; last log lines: {message['tail']}" if isinstance(
                                message.get("tail"), str) and message["tail"] else ""))
        except (ChannelClosed, ProtocolError):
            return

    def _assign_node(self, node: int, slots: int) -> list[_Rank]:
        """The ranks node ``node`` starts: engines are packed onto nodes in order (prefill
        engines first), an engine moving to the next node when it does not fit."""
        placement: list[tuple[int, int]] = []
        current, used = 0, 0
        for role in ("prefill", "decode"):
            for engine in self.engines[role]:
                if used + engine.tp > slots and used:
                    current, used = current + 1, 0
                for _ in engine.ranks:
                    placement.append((current, used))
                    used += 1
        out = []
        for r, (n, device) in zip(self.all_ranks, placement):
            r.node = n
            if n == node:
                r.device_id = device
                out.append(r)
        return out

    def _send(self, r: _Rank, message: dict[str, Any]) -> None:
        if r.dead is not None or r.writer is None:
            raise RankDied(r.dead or f"{r.label} is not connected")
        r.writer.write(pack(message))

    def _dispatch(self, r: _Rank, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "reply":
            fut = r.pending.pop(message.get("seq"), None)
            if fut is not None and not fut.done():
                fut.set_result(message)
        elif op == "ready":
            payload, md = message.get("payload"), message.get("agent_metadata")
            if not isinstance(payload, bytes) or not isinstance(md, bytes):
                raise ProtocolError("ready: payload and agent_metadata must be bytes")
            r.payload, r.agent_metadata, r.agent = payload, md, str(message.get("agent"))
            if r.ready is not None and not r.ready.done():
                r.ready.set_result(True)
        elif op == "outcome":
            self._on_outcome(r, _outcome_in(message.get("outcome"), r))
        elif op == "notif":
            messages = message.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, bytes) for m in messages):
                raise ProtocolError("notif: messages must be a list of bytes")
            for m in messages:
                self._on_message(r, m)
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
        if tail and "last log lines" not in how:
            reason += f"; last log lines: {tail}"
        r.dead = reason
        for fut in r.pending.values():
            if not fut.done():
                fut.set_exception(RankDied(reason))
        r.pending.clear()
        if r.closing:
            return
        log.error("%s", reason)
        if self._failure is None:
            self._failure = reason
            self.counters["rank_deaths"] = 0
        self.counters["rank_deaths"] += 1
        assert self._dead is not None
        self._dead.set()

    async def _wait(self, aw: Awaitable[Any], timeout: float | None, what: str, *,
                    check_dead: bool = True) -> Any:
        """Await ``aw`` with a deadline, racing a rank death (unless ``check_dead`` is False:
        shutdown still talks to the survivors)."""
        assert self._dead is not None
        if check_dead and self._dead.is_set():  # the run has failed: start nothing new
            if asyncio.isfuture(aw) or asyncio.iscoroutine(aw):
                asyncio.ensure_future(aw).cancel()
            raise RankDied(self._failure or "a rank died")
        task = asyncio.ensure_future(aw)
        waiters = {task}
        dead = asyncio.ensure_future(self._dead.wait()) if check_dead else None
        if dead is not None:
            waiters.add(dead)
        try:
            done, _ = await asyncio.wait(waiters, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if dead is not None:
                dead.cancel()
        if task in done:
            return task.result()
        task.cancel()
        task.add_done_callback(_consume)
        if check_dead and self._dead.is_set():
            raise RankDied(self._failure or "a rank died")
        raise WaitTimeout(f"no {what} within {timeout} s")

    async def _call(self, r: _Rank, op: str, *, timeout: float | None = None,
                    check_dead: bool = True, **payload: Any) -> dict[str, Any]:
        assert self._loop is not None
        seq = next(r.seq)
        fut = self._loop.create_future()
        r.pending[seq] = fut
        self._send(r, {"op": op, "seq": seq, **payload})
        t = self.options.command_timeout if timeout is None else timeout
        try:
            reply = await self._wait(fut, t, f"reply to {op} from {r.label}",
                                     check_dead=check_dead)
        except WaitTimeout:
            r.pending.pop(seq, None)
            raise WaitTimeout(f"{r.label} did not answer {op} within {t} s") from None
        if not reply.get("ok"):
            raise _CommandFailed(str(reply.get("error")), str(reply.get("kind") or "rank_error"))
        return reply

    async def _call_all(self, ranks: list[_Rank], op: str, **payload: Any
                        ) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self._call(r, op, **payload) for r in ranks)))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._background.discard(task)
        exc = _consume(task)
        if exc is not None:
            if not isinstance(exc, (RankDied, WaitTimeout, _CommandFailed)):
                log.error("background task failed: %r", exc)
                if self._failure is None:
                    self._failure = f"coordinator error: {type(exc).__name__}: {exc}"
                    assert self._dead is not None
                    self._dead.set()

    # ---- workload --------------------------------------------------------------------------
    async def _run_workload(self) -> RunResult:
        wl = self.scenario.workload
        if wl.arrival == "poisson":
            gaps = self.rng.exponential(1.0 / float(wl.rate), size=len(self.prompts))
            arrivals = np.cumsum(gaps) - gaps[0]
        else:
            arrivals = np.zeros(len(self.prompts))
        slots = asyncio.Semaphore(wl.max_inflight or len(self.prompts))
        for f in self._kills:
            if f.request is None and f.at_seconds is not None:
                self._spawn(self._kill_at(f))
        for i, (n, hit) in enumerate(zip(self.prompts.tolist(), self.hits.tolist())):
            self.records.append(RequestRecord(index=i, request_id=f"req-{i}-{self._suffix()}",
                                              prompt_tokens=int(n), prefix_hit_tokens=int(hit),
                                              arrival=float(arrivals[i])))
        budget = self._run_budget(float(arrivals.max(initial=0.0)))
        tasks = [asyncio.ensure_future(self._request(rec, slots)) for rec in self.records]
        done, pending = await asyncio.wait(tasks, timeout=budget)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            for rec in self.records:
                if rec.status == "pending":
                    self._fail(rec, "stall", f"the run did not finish within {budget:.0f} s")
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # a coordinator bug: surface it
        await self._drain_leases()
        stats = await self._stats()
        self.counters["notification_failures"] += sum(s.get("notification_failures", 0)
                                                      for s in stats)
        self.counters["dropped_messages"] = 0
        leaks = {
            "prefill_blocks": sum(e.allocator.used for e in self.engines["prefill"]),
            "decode_blocks": sum(e.allocator.used for e in self.engines["decode"]),
            "open_handles": sum(s.get("open_handles", 0) for s in stats),
        }
        await self._shutdown_ranks()
        leaks["after_shutdown"] = self._after_shutdown
        layouts = {role: es[0].layout for role, es in self.engines.items()}
        ends = [t for r in self.records for k, t in r.times.items()
                if k in ("done", "prefill_freed", "lease_expired")]
        return RunResult(scenario=self.scenario, records=self.records,
                         handshake_errors=self.handshake_errors, leaks=leaks,
                         counters=self.counters, sim_seconds=float(max(ends, default=0.0)),
                         layouts=layouts, link_segments=[], verified=self.verify, backend="nixl")

    def _run_budget(self, last_arrival: float) -> float:
        if self.options.run_timeout is not None:
            return self.options.run_timeout
        conn = self.scenario.connector
        return last_arrival + conn.transfer_timeout_seconds + conn.lease_seconds + 60.0 + (
            0.5 * len(self.records))

    async def _drain_leases(self) -> None:
        """End the prefill holds left once every request is terminal. The simulator drains its
        event queue, so a hold with no notification coming expires at its lease deadline. Here,
        once no request is loading, nothing but a late notification can free a hold: we wait
        ``lease_grace`` seconds for one, then expire the rest at once (times and counters as
        at their deadlines) instead of sleeping out the lease; after a rank death, at once."""
        leases = [t for t in self._leases.values() if not t.done()]
        if not leases:
            return
        grace = self.options.lease_grace
        limit = self.scenario.connector.lease_seconds * 2 + 10.0 if grace is None else grace
        if self._failure is None:
            try:
                await self._wait(asyncio.gather(*leases, return_exceptions=True), limit,
                                 "end of the prefill leases")
            except (WaitTimeout, RankDied):
                pass
        for key in list(self._leases):
            task = self._leases.pop(key)
            task.cancel()
            self._expire_lease(key, at=self._lease_deadline.get(key, self._now()))

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
        for r in self.all_ranks:
            if r.dead is not None:
                continue
            try:
                out.append(await self._call(r, "stats", timeout=10.0, check_dead=False))
            except (RankDied, WaitTimeout, _CommandFailed):
                continue
        return out

    async def _request(self, rec: RequestRecord, slots: asyncio.Semaphore) -> None:
        try:
            if rec.arrival > 0:
                await self._wait(asyncio.sleep(rec.arrival), rec.arrival + 1.0, "arrival")
            async with slots:
                await self._serve(rec)
        except RankDied as exc:
            self._fail(rec, "remote_disconnect", str(exc))
        except WaitTimeout as exc:
            self._fail(rec, "stall", str(exc))
        except _CommandFailed as exc:
            self._fail(rec, exc.kind, str(exc))

    async def _serve(self, rec: RequestRecord) -> None:
        prefill = self.engines["prefill"][rec.index % len(self.engines["prefill"])]
        decode = self.engines["decode"][rec.index % len(self.engines["decode"])]
        rec.prefill_engine, rec.decode_engine = prefill.engine_id, decode.engine_id
        rec.times["start"] = self._now()
        p_rid, p_blocks = await self._prefill(rec, prefill)
        assert prefill.block_version is not None
        versions = {g: prefill.block_version[ids].copy() for g, ids in p_blocks.items()}
        job = await self._decode_allocate(rec, decode)
        try:
            self._start_loading(decode, rec, prefill, p_rid)
            try:
                transfer = self._push if self.scenario.connector.mode == "push" else self._pull
                failure = await transfer(rec, prefill, decode, p_rid, p_blocks, job)
            finally:
                decode.loading.pop(rec.request_id, None)
            if failure is None and rec.transfers:
                failure = freed_while_reading(prefill.engine_id, prefill.block_version,
                                              p_blocks, versions)
            if failure is not None and not await self._recover(rec, decode, job, failure):
                self._fail(rec, *failure)
            if rec.status == "pending":
                await self._post_process(prefill, decode, job)
                await self._verify_and_compute(rec, decode, job)
                rec.status = "ok"
                rec.times["done"] = self._now()
        finally:
            self._free(decode, job.blocks)

    async def _recover(self, rec: RequestRecord, decode: _Engine, job: _DecodeJob,
                       failure: tuple[str, str]) -> bool:
        """kv_load_failure_policy = "recompute": decode recomputes the whole request (HMA: no
        invalid blocks are reported, state cannot be re-zeroed; DOMAIN.md §9.3)."""
        if self.scenario.connector.kv_load_failure_policy != "recompute":
            return False
        if any(r.dead is not None for r in decode.ranks):
            return False
        rec.recovered_from = failure[0]
        self.counters["recomputed"] += 1
        if self.verify:
            layout = decode.layout
            await self._call_all(decode.ranks, "oracle_write", request=rec.index,
                                 blocks=groups_out(job.blocks), tokens=[0, job.load_tokens],
                                 state_step=job.load_tokens if layout.is_hybrid else None)
        job.recomputed = True
        return True

    async def _allocate(self, engine: _Engine, n_attention: int) -> dict[int, np.ndarray]:
        layout = engine.layout
        need = n_attention * len(layout.attention_groups) + len(layout.state_groups)
        while not engine.allocator.can_allocate(need):
            assert engine.freed is not None
            await self._wait(asyncio.shield(engine.freed), None, "free blocks")
        blocks: dict[int, np.ndarray] = {}
        for group in layout.groups:
            n = n_attention if group.kind == "attention" else 1
            blocks[group.group_id] = engine.allocator.allocate(n)
        return blocks

    def _free(self, engine: _Engine, blocks: dict[int, np.ndarray], *, stamp: bool = True
              ) -> None:
        """Return blocks to the pool; ``stamp`` bumps their versions so a transfer still moving
        them is caught (push's own completion skips it)."""
        assert self._loop is not None and engine.block_version is not None
        for ids in blocks.values():
            engine.allocator.free(ids)
            if stamp:
                engine.block_version[ids] += 1
        old, engine.freed = engine.freed, self._loop.create_future()
        if old is not None and not old.done():
            old.set_result(None)

    async def _prefill(self, rec: RequestRecord, prefill: _Engine
                       ) -> tuple[str, dict[int, np.ndarray]]:
        """Allocate, compute (oracle fill of N-1 tokens with state, N without) and finish under
        a lease."""
        n_tokens = self.prefill_tokens(rec.prompt_tokens)
        layout = prefill.layout
        p_blocks = await self._allocate(prefill, layout.blocks_for_tokens(n_tokens))
        p_rid = f"{base_request_id(rec.request_id)}-{self._suffix()}"
        key = (prefill.engine_id, p_rid)
        try:
            if self.verify:
                await self._call_all(prefill.ranks, "oracle_write", request=rec.index,
                                     blocks=groups_out(p_blocks), tokens=[0, n_tokens],
                                     state_step=n_tokens if layout.is_hybrid else None)
        except BaseException:
            self._free(prefill, p_blocks)
            raise
        self._prefill_held[key] = (prefill, p_blocks, rec)
        self._pending_notifs[key] = {}
        self._lease_deadline[key] = self._now() + self.scenario.connector.lease_seconds
        self._leases[key] = asyncio.ensure_future(self._lease(key, rec))
        rec.times["prefill_done"] = self._now()
        if self.scenario.connector.mode == "push":
            self._publish(prefill, p_rid, p_blocks, rec)
        return p_rid, p_blocks

    async def _decode_allocate(self, rec: RequestRecord, decode: _Engine) -> _DecodeJob:
        """Decode's blocks for the whole prompt and its prefix hit: it loads [hit, N-1) and
        computes token N; a hit covering N-1 tokens moves nothing but a notification."""
        layout = decode.layout
        blocks = await self._allocate(decode, layout.blocks_for_tokens(rec.prompt_tokens))
        load_tokens = rec.prompt_tokens - 1
        hit_blocks = min(rec.prefix_hit_tokens, load_tokens) // layout.logical_block_size
        hit_tokens = hit_blocks * layout.logical_block_size
        full_hit = hit_tokens >= load_tokens
        job = _DecodeJob(blocks=blocks, load={}, hit_blocks=hit_blocks, load_tokens=load_tokens)
        try:
            if self.verify and hit_blocks:
                await self._call_all(decode.ranks, "oracle_write", request=rec.index,
                                     blocks=groups_out(blocks), tokens=[0, hit_tokens],
                                     state_step=hit_tokens if full_hit and layout.is_hybrid
                                     else None)
        except BaseException:
            self._free(decode, blocks)
            raise
        for group in layout.groups:
            ids = blocks[group.group_id]
            if group.kind == "attention":
                ids = ids[hit_blocks:layout.blocks_for_tokens(load_tokens)]
            elif full_hit:
                ids = ids[:0]
            job.load[group.group_id] = ids
        return job

    # ---- pull ------------------------------------------------------------------------------
    async def _pull(self, rec: RequestRecord, prefill: _Engine, decode: _Engine, p_rid: str,
                    p_blocks: dict[int, np.ndarray], job: _DecodeJob) -> tuple[str, str] | None:
        """Pull (DOMAIN.md §8.1); None on success, else (failure class, reason)."""
        assert self._loop is not None
        error = await self._connect(decode, prefill, rec)
        if error is not None:
            return ("handshake_failed", error)
        rec.times["transfer_start"] = self._now()
        done = self._loop.create_future()
        outcomes: dict[int, _Outcome] = {}
        self._decode_waiters[rec.request_id] = (done, outcomes, decode.tp)
        read = {"request_id": rec.request_id, "prefill_request_id": p_rid,
                "remote_engine": prefill.engine_id, "prefill_blocks": groups_out(p_blocks),
                "decode_blocks": groups_out(job.load), "decode_hit_blocks": job.hit_blocks}
        calls = [asyncio.ensure_future(self._call(r, "read", **read)) for r in decode.ranks]
        self._kill_for(rec)
        timeout = self.scenario.connector.transfer_timeout_seconds
        try:
            replies = await self._wait(asyncio.gather(*calls), self.options.command_timeout,
                                       "READ posts")
            for r, reply in zip(decode.ranks, replies):
                if reply.get("outcome") is not None:
                    self._collect(rec.request_id, r.rank, _outcome_in(reply["outcome"], r))
            await self._wait(asyncio.shield(done), timeout, "READ completion")
        except WaitTimeout:  # the watchdog: a transfer stuck in PROC becomes a failure
            rec.times["transfer_done"] = self._now()
            self._decode_waiters.pop(rec.request_id, None)
            for r in decode.ranks:
                try:
                    reply = await self._call(r, "abort", request_id=rec.request_id,
                                             reason="watchdog", failure_class="stall",
                                             timeout=10.0)
                    if reply.get("outcome") is not None:
                        outcomes.setdefault(r.rank, _outcome_in(reply["outcome"], r))
                except (WaitTimeout, _CommandFailed):
                    pass
            self._account(rec, outcomes.values())
            return ("stall", f"transfer still in progress after {timeout:g} s (watchdog)")
        finally:
            for c in calls:
                c.cancel()
        rec.times["transfer_done"] = self._now()
        self._account(rec, outcomes.values())
        failures = [o for o in outcomes.values() if not o.ok]
        if failures:
            return (failures[0].failure_class or "transfer_failed",
                    failures[0].reason or "transfer failed")
        return None

    def _collect(self, rid: str, rank: int, outcome: _Outcome) -> None:
        waiter = self._decode_waiters.get(rid)
        if waiter is None:
            return
        done, outcomes, expected = waiter
        outcomes[rank] = outcome
        if len(outcomes) == expected:
            del self._decode_waiters[rid]
            if not done.done():
                done.set_result(None)

    # ---- the kill-rank fault ---------------------------------------------------------------
    def _kill_targets(self, fault: Any) -> list[_Rank]:
        return [r for r in self.all_ranks
                if (fault.engine is None or r.engine == fault.engine)
                and (fault.rank is None or r.rank == fault.rank) and r.dead is None]

    def _kill_for(self, rec: RequestRecord) -> None:
        """SIGKILL the targeted rank(s) right after the request's transfer starts."""
        for fault in self._kills:
            if fault.request is not None and fault.request == rec.index:
                for r in self._kill_targets(fault):
                    self._kill(r, f"kill-rank fault during request {rec.index}")

    async def _kill_at(self, fault: Any) -> None:
        await asyncio.sleep(float(fault.at_seconds))
        for r in self._kill_targets(fault):
            self._kill(r, f"kill-rank fault at {fault.at_seconds:g} s")

    def _kill(self, r: _Rank, why: str) -> None:
        log.warning("%s: SIGKILL %s (pid %s)", why, r.label, r.pid)
        self.counters["faults_injected"] = self.counters.get("faults_injected", 0) + 1
        self.counters["fault:kill-rank"] = self.counters.get("fault:kill-rank", 0) + 1
        if r.proc is not None and r.pid is not None:
            os.kill(r.pid, signal.SIGKILL)
            r.proc.join(10.0)  # reap it now, so the death is known before anything else runs
            r.exitcode = r.proc.exitcode
            self._on_death(r, f"{_describe_exit(r.exitcode)} ({why})")
        else:  # a rank on another node: it SIGKILLs itself; its node agent reports the death
            try:
                self._send(r, {"op": "die"})
            except RankDied:
                pass

    # ---- push ------------------------------------------------------------------------------
    async def _push(self, rec: RequestRecord, prefill: _Engine, decode: _Engine, p_rid: str,
                    p_blocks: dict[int, np.ndarray], job: _DecodeJob) -> tuple[str, str] | None:
        """Push (DOMAIN.md §8.2): decode rank 0 registers decode's blocks with every prefill
        rank over NIXL notifications; prefill matches, reverse-handshakes and WRITEs; decode
        counts max(1, P_TP // D_TP) notifications per rank."""
        assert self._loop is not None
        first = decode.ranks[0]
        await self._notify_handshake(decode, first, prefill)
        registration = PushRegistration(
            decode_request_id=rec.request_id, decode_engine=decode.engine_id,
            decode_tp=decode.tp, prefill_engine=prefill.engine_id, blocks=job.load,
            hit_blocks=job.hit_blocks)
        rec.times["transfer_start"] = self._now()
        done = self._loop.create_future()
        self._push_waiters[rec.request_id] = _PushWait(done=done, decode=decode, counts={})
        timeout = self.scenario.connector.transfer_timeout_seconds
        try:
            try:
                await self._call(first, "send_notifs", agents=[r.agent for r in prefill.ranks],
                                 message=registration.encode())
            except _CommandFailed as exc:
                return (exc.kind, f"push registration not delivered: {exc}")
            self._kill_for(rec)
            result = await self._wait(asyncio.shield(done), timeout, "push completion")
        except WaitTimeout:
            rec.times["transfer_done"] = self._now()
            return ("stall", f"push: no WRITE completed within {timeout:g} s (decode watchdog)")
        finally:
            self._push_waiters.pop(rec.request_id, None)
        rec.times["transfer_done"] = self._now()
        return result

    async def _notify_handshake(self, local: _Engine, sender: _Rank, remote: _Engine) -> None:
        """``sender`` learns ``remote``'s agents to notify them (no descriptors), once."""
        assert self._loop is not None
        key = f"{sender.rank}:{remote.engine_id}"
        event = local.notify_ready.get(key)
        if event is None:
            event = self._loop.create_future()
            local.notify_ready[key] = event
            try:
                await self._call(sender, "connect_notify_only",
                                 metadata=[r.agent_metadata for r in remote.ranks])
                event.set_result(None)
            except BaseException as exc:
                event.set_exception(exc)
                event.exception()
                raise
            return
        await self._wait(asyncio.shield(event), self.options.command_timeout,
                         "notification handshake")

    def _publish(self, prefill: _Engine, p_rid: str, p_blocks: dict[int, np.ndarray],
                 rec: RequestRecord) -> None:
        key = (prefill.engine_id, base_request_id(p_rid))
        self._published[key] = (p_rid, p_blocks, rec)
        for rank, registration, raw in self._deferred.pop(key, []):
            self._spawn(self._write(prefill, rank, registration, raw, p_rid, p_blocks, rec))

    def _on_registration(self, prefill: _Engine, rank: int, registration: PushRegistration,
                         raw: bytes) -> None:
        """Match by exact request id, then by base id with the random suffix stripped."""
        key = (prefill.engine_id, base_request_id(registration.decode_request_id))
        published = self._published.get((prefill.engine_id, registration.decode_request_id),
                                         self._published.get(key))
        if published is None:
            self._deferred.setdefault(key, []).append((rank, registration, raw))
            return
        p_rid, p_blocks, rec = published
        self._spawn(self._write(prefill, rank, registration, raw, p_rid, p_blocks, rec))

    async def _write(self, prefill: _Engine, rank: int, registration: PushRegistration,
                     raw: bytes, p_rid: str, p_blocks: dict[int, np.ndarray],
                     rec: RequestRecord) -> None:
        decode = self._engine(registration.decode_engine)
        try:
            error = await self._connect(prefill, decode, rec)
        except (RankDied, WaitTimeout, _CommandFailed) as exc:
            self._push_result(registration.decode_request_id, (
                "remote_disconnect" if isinstance(exc, RankDied) else "handshake_failed",
                str(exc)))
            return
        key = (prefill.engine_id, p_rid)
        if error is not None:
            self._push_result(registration.decode_request_id, ("handshake_failed", error))
            return
        self._registration_ids[key] = registration.decode_request_id
        r = prefill.ranks[rank]
        try:
            reply = await self._call(r, "write", prefill_request_id=p_rid, registration=raw,
                                     prefill_blocks=groups_out(p_blocks))
        except (RankDied, WaitTimeout, _CommandFailed) as exc:
            self._push_result(registration.decode_request_id, (
                "remote_disconnect" if isinstance(exc, RankDied) else "transfer_setup_failed",
                str(exc)))
            return
        self._write_outcomes.setdefault(key, {})
        if reply.get("outcome") is not None:
            self._collect_write(prefill, rank, _outcome_in(reply["outcome"], r))

    def _collect_write(self, prefill: _Engine, rank: int, outcome: _Outcome) -> None:
        """Prefill is done with a request when every rank's WRITEs are DONE (or one failed)."""
        key = (prefill.engine_id, outcome.request_id)
        outcomes = self._write_outcomes.setdefault(key, {})
        outcomes[rank] = outcome
        published = self._published.get((prefill.engine_id, base_request_id(outcome.request_id)))
        if published is not None:
            self._account(published[2], [outcome])
        failed = [o for o in outcomes.values() if not o.ok]
        reg_id = self._registration_ids.get(key)
        if failed and reg_id is not None:
            self._push_result(reg_id, (failed[0].failure_class or "transfer_failed",
                                       failed[0].reason or "WRITE failed"))
        if len(outcomes) < prefill.tp:
            return
        del self._write_outcomes[key]
        self._published.pop((prefill.engine_id, base_request_id(outcome.request_id)), None)
        self._registration_ids.pop(key, None)
        if not failed:  # every WRITE is DONE: free without waiting for the lease
            self._release_prefill(prefill, outcome.request_id, stamp=False)

    def _push_result(self, decode_request_id: str, failure: tuple[str, str] | None) -> None:
        wait = self._push_waiters.get(decode_request_id)
        if wait is not None and not wait.done.done():
            wait.done.set_result(failure)

    def _on_push_notification(self, decode: _Engine, rank: int, rid: str, sender_world: int
                              ) -> bool:
        """Decode counts "{D_request_id}:{P_world_size}"; each rank expects
        max(1, P_TP // D_TP) (DOMAIN.md §8.2)."""
        wait = self._push_waiters.get(rid)
        if wait is None:
            return False
        self.counters["notifications"] += 1
        wait.counts[rank] = wait.counts.get(rank, 0) + 1
        expected = max(1, sender_world // decode.tp)
        if len(wait.counts) == decode.tp and all(v >= expected for v in wait.counts.values()):
            if not wait.done.done():
                wait.done.set_result(None)
        return True

    # ---- events from ranks -----------------------------------------------------------------
    def _on_outcome(self, r: _Rank, outcome: _Outcome) -> None:
        engine = self._engine(r.engine)
        if engine.role == "decode":
            self._collect(outcome.request_id, r.rank, outcome)
        else:
            self._collect_write(engine, r.rank, outcome)

    def _on_message(self, r: _Rank, message: bytes) -> None:
        engine = self._engine(r.engine)
        if engine.role == "decode":
            parsed = parse_notification(message)
            if parsed is None or not self._on_push_notification(engine, r.rank, *parsed):
                self.counters["late_notifications"] += 1
            return
        if message.startswith(b"HB:"):
            self._on_heartbeat(engine, message)
            return
        if message.startswith(PUSH_PREFIX):
            registration = PushRegistration.decode(message)
            if registration is None:
                self.counters["malformed_registrations"] += 1
                log.warning("malformed push registration dropped on %s", r.label)
            else:
                self._on_registration(engine, r.rank, registration, message)
            return
        parsed = parse_notification(message)
        if parsed is None:
            self.counters["late_notifications"] += 1
            return
        rid, n = parsed
        self.counters["notifications"] += 1
        key = (engine.engine_id, rid)
        pending = self._pending_notifs.get(key)
        if pending is None:
            self.counters["late_notifications"] += 1
            log.info("notification for unknown request %s on %s ignored", rid, r.label)
            return
        pending[r.rank] = pending.get(r.rank, 0) + 1
        if len(pending) == engine.tp and all(v >= n for v in pending.values()):
            # no version stamp: NIXL delivers a READ's notification only after the READ is done,
            # so this free cannot overlap it (in wall-clock time it can reach us before decode's
            # completion report does; the simulator's ordering hides that). Lease expiry stamps.
            self._release_prefill(engine, rid, stamp=False)

    # ---- leases and heartbeats -------------------------------------------------------------
    async def _lease(self, key: tuple[str, str], rec: RequestRecord) -> None:
        """Prefill holds a finished request's blocks until its notifications arrive or the
        lease deadline passes; decode's heartbeats move the deadline (DOMAIN.md §9.1)."""
        while True:
            wait = self._lease_deadline[key] - self._now()
            await asyncio.sleep(max(0.0, wait))
            if self._lease_deadline.get(key, 0.0) <= self._now():
                break
        self._leases.pop(key, None)
        self._expire_lease(key, at=self._now())

    def _expire_lease(self, key: tuple[str, str], *, at: float) -> None:
        self._lease_deadline.pop(key, None)
        held = self._prefill_held.pop(key, None)
        if held is None:
            return
        engine, blocks, rec = held
        self.counters["lease_expiries"] += 1
        rec.freed_by_lease = True
        rec.times["lease_expired"] = at
        log.info("lease expired for %s on %s", key[1], key[0])
        self._pending_notifs.pop(key, None)
        self._free(engine, blocks)

    def _on_heartbeat(self, prefill: _Engine, message: bytes) -> None:
        """'HB:r1,r2,...': each listed lease deadline becomes max(old, now + 2/3 lease)."""
        lease = self.scenario.connector.lease_seconds
        for rid in message[3:].decode(errors="replace").split(","):
            key = (prefill.engine_id, rid)
            if key in self._lease_deadline:
                self._lease_deadline[key] = max(self._lease_deadline[key],
                                                self._now() + 2 * lease / 3)

    def _start_loading(self, decode: _Engine, rec: RequestRecord, prefill: _Engine,
                       p_rid: str) -> None:
        decode.loading[rec.request_id] = (prefill.engine_id, p_rid)
        if decode.heartbeat is None or decode.heartbeat.done():
            decode.heartbeat = asyncio.ensure_future(self._heartbeats(decode))
            self._background.add(decode.heartbeat)
            decode.heartbeat.add_done_callback(self._task_done)

    async def _heartbeats(self, decode: _Engine) -> None:
        """Decode sends 'HB:...' every lease/6 for the requests it is still loading, from its
        first live rank, over NIXL notifications."""
        period = self.scenario.connector.lease_seconds / 6
        while decode.loading:
            await asyncio.sleep(period)
            by_prefill: dict[str, list[str]] = {}
            for p_engine, p_rid in decode.loading.values():
                by_prefill.setdefault(p_engine, []).append(p_rid)
            sender = next((r for r in decode.ranks if r.dead is None), None)
            if sender is None or self._failure is not None:
                return
            for p_engine, rids in by_prefill.items():
                prefill = self._engine(p_engine)
                message = ("HB:" + ",".join(sorted(rids))).encode()
                try:
                    await self._notify_handshake(decode, sender, prefill)
                    await self._call(sender, "send_notifs",
                                     agents=[r.agent for r in prefill.ranks], message=message)
                except _CommandFailed:
                    self.counters["notification_failures"] += 1

    # ---- handshake -------------------------------------------------------------------------
    async def _connect(self, local: _Engine, remote: _Engine, rec: RequestRecord) -> str | None:
        """Lazy handshake of ``local``'s ranks with ``remote`` on first use of the pair;
        concurrent requests wait for the same one. Returns the refusal, or None."""
        assert self._loop is not None
        event = local.connections.get(remote.engine_id)
        if event is None:
            await self._evict_stale(local)
            event = self._loop.create_future()
            local.connections[remote.engine_id] = event
            self.counters["handshakes"] += 1
            start = self._now()
            payloads = [[r.rank, r.payload] for r in remote.ranks]
            try:
                replies = await self._call_all(local.ranks, "connect",
                                               remote_engine=remote.engine_id, payloads=payloads)
            except BaseException as exc:
                event.set_exception(exc)
                event.exception()  # retrieved: waiters re-raise it themselves
                raise
            error = next((rep["error"] for rep in replies if rep.get("error")), None)
            if error is not None:
                arrow = "<-" if local.role == "decode" else "->"
                pair = (f"{local.engine_id} {arrow} {remote.engine_id}" if local.role == "decode"
                        else f"{remote.engine_id} <- {local.engine_id} (push)")
                self.handshake_errors.append(f"{pair}: {error}")
            rec.times["handshake"] = self._now() - start
            event.set_result(error)
        else:
            await self._wait(asyncio.shield(event), self.options.command_timeout, "handshake")
        local.last_used[remote.engine_id] = self._now()
        return event.result()

    async def _evict_stale(self, local: _Engine) -> None:
        """Evict remote engines idle past the TTL, checked when a new handshake starts
        (DOMAIN.md §9.4)."""
        ttl = self.scenario.connector.engine_ttl_seconds
        for remote, last in list(local.last_used.items()):
            event = local.connections.get(remote)
            if self._now() - last > ttl and event is not None and event.done():
                await self._call_all(local.ranks, "evict", engine=remote)
                del local.connections[remote], local.last_used[remote]
                self.counters["evictions"] += 1
                log.info("%s evicted idle engine %s", local.engine_id, remote)

    # ---- completion ------------------------------------------------------------------------
    def _account(self, rec: RequestRecord, outcomes: Any) -> None:
        for o in outcomes:
            rec.descriptors += o.descriptors
            rec.nbytes += o.nbytes
            rec.transfers += o.transfers
            for t in o.telemetry:
                rec.times["post"] = max(rec.times.get("post", 0.0), t["post_seconds"])
                rec.times["wire"] = max(rec.times.get("wire", 0.0), t["transfer_seconds"])
                entry = {"nbytes": t["nbytes"], "descriptors": t["descriptors"],
                         "submitted": t["submitted"], "post_seconds": t["post_seconds"],
                         "transfer_seconds": t["transfer_seconds"],
                         "completed": t["completed"], "path": list(t["path"])}
                rec.telemetry.append(entry)
                if o.rank is not None:
                    self._telemetry_owner.append((entry, o.rank))

    async def _post_process(self, prefill: _Engine, decode: _Engine, job: _DecodeJob) -> None:
        """Block size ratio: zero the untransferred sub-block tail, regroup heads (§6)."""
        layout = decode.layout
        bsr = layout.kernel_block_size // prefill.layout.kernel_block_size
        if bsr == 1 or not self.verify or job.recomputed:
            return
        ppl = layout.physical_blocks_per_logical
        p_kernel = prefill.layout.kernel_block_size
        for group in layout.attention_groups:
            kernel = expand_logical(job.load[group.group_id], ppl)
            subs = to_sub_blocks(kernel, bsr)
            first_sub = job.hit_blocks * ppl * bsr
            sent = job.load_tokens + (0 if prefill.layout.is_hybrid else 1)
            received = max(0, min(subs.size, -(-sent // p_kernel) - first_sub))
            await self._call_all(decode.ranks, "post_process", zero=ids_out(subs[received:]),
                                 kernel=ids_out(kernel), bsr=bsr)

    async def _verify_and_compute(self, rec: RequestRecord, decode: _Engine,
                                  job: _DecodeJob) -> None:
        """Every decode rank checks every loaded byte, then computes token N."""
        if not self.verify:
            return
        hybrid = decode.layout.is_hybrid
        replies = await self._call_all(
            decode.ranks, "verify", request=rec.index, blocks=groups_out(job.blocks),
            tokens=[0, job.load_tokens], state_step=job.load_tokens if hybrid else None,
            compute=[job.load_tokens, rec.prompt_tokens],
            compute_step=rec.prompt_tokens if hybrid else None)
        for reply in replies:
            rec.mismatched_words += int(reply["words"])
            found = [str(m) for m in reply["mismatches"]]
            rec.mismatches.extend(found[: max(0, 8 - len(rec.mismatches))])

    def _release_prefill(self, engine: _Engine, p_rid: str, *, stamp: bool = True) -> None:
        key = (engine.engine_id, p_rid)
        held = self._prefill_held.pop(key, None)
        self._pending_notifs.pop(key, None)
        self._lease_deadline.pop(key, None)
        lease = self._leases.pop(key, None)
        if lease is not None and not lease.done():
            lease.cancel()
        if held is not None:
            _, blocks, rec = held
            rec.times["prefill_freed"] = self._now()
            self._free(engine, blocks, stamp=stamp)

    def _fail(self, rec: RequestRecord, failure_class: str, reason: str) -> None:
        if rec.status == "pending":  # report once
            rec.status, rec.failure_class, rec.reason = "failed", failure_class, reason
            rec.times["done"] = self._now()

    # ---- shutdown --------------------------------------------------------------------------
    async def _shutdown_ranks(self) -> None:
        """Every live rank releases its handles, lists and remote agents and deregisters its
        memory (worker.shutdown, then transport.close), also after a failure; what a rank still
        held after worker.shutdown is added to ``after_shutdown``."""
        live = [r for r in self.all_ranks
                if r.dead is None and r.writer is not None and not r.closing]

        async def close(r: _Rank) -> None:
            r.closing = True
            try:
                reply = await self._call(r, "shutdown", timeout=self.options.shutdown_timeout,
                                         check_dead=False)
                r.transports = [str(t) for t in reply.get("transports", [])]
                self._after_shutdown += int(reply.get("leftover", 0))
            except (RankDied, WaitTimeout, _CommandFailed, ConnectionError) as exc:
                log.warning("%s: shutdown: %s", r.label, exc)

        await asyncio.gather(*(close(r) for r in live), return_exceptions=True)

    async def _shutdown_all(self) -> None:
        """Shut down whatever is still up, then reap every process (terminate, then kill, the
        ones that do not exit in time)."""
        await self._shutdown_ranks()
        for lease in list(self._leases.values()):
            lease.cancel()
        for r in self.all_ranks:
            r.closing = True
            if r.writer is not None:
                try:
                    r.writer.close()
                except Exception:
                    pass
        end = time.monotonic() + self.options.shutdown_timeout
        for r in self.all_ranks:
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
        for node in self._nodes:
            try:
                node["writer"].write(pack({"op": "done"}))
                node["writer"].close()
            except Exception:
                pass
        for entry, r in self._telemetry_owner:
            if r.transports:
                entry["path"] = list(entry["path"]) + [t for t in r.transports
                                                       if t not in entry["path"]]

    @property
    def transports(self) -> dict[str, list[str]]:
        """UCX transports each rank reported for RMA (from UCX_PROTO_INFO), after the run."""
        return {f"{r.engine}.{r.rank}": list(r.transports) for r in self.all_ranks}


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


class _CommandFailed(Exception):
    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


def run_scenario_nixl(scenario: Scenario, *, timing_only: bool = False,
                      options: NixlRunOptions | None = None) -> RunResult:
    """Run one scenario over real NIXL, one process per rank (see the module docstring)."""
    return NixlCluster(scenario, timing_only=timing_only, options=options).run()



def run_for_cli(scenarios: list[Scenario], *, timing_only: bool = False,
                progress: Any = None) -> list[RunResult]:
    """``hkvsim run|sweep --backend nixl``: every scenario in turn. A setup problem (NIXL not
    importable, a rank that cannot start, an unsupported fault) prints one line and exits 2."""
    import sys

    from ..transport.nixl import NixlUnavailable, load_nixl

    try:
        load_nixl()
        items = progress(scenarios, "running on NIXL") if progress is not None else scenarios
        return [run_scenario_nixl(s, timing_only=timing_only) for s in items]
    except (NixlUnavailable, NixlRunError) as exc:
        print(f"hkvsim: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
