"""One rank of a NIXL run: its own OS process, its NIXL agent, the unchanged ConnectorWorker, the
oracle on its own memory, and a polling loop.

The process connects to the coordinator's side channel, proves it belongs to the run (its
one-time credential, issued by the coordinator for this rank of this run),
receives SETUP (the scenario, its engine, rank, block count and memory type), registers its cache
and answers READY with its handshake payload. Then it loops:

* operations of the coordinator (:mod:`hkvsim.pd.ops`: compute, connect, READ, WRITE, verify,
  ...) are carried out by the same :class:`~hkvsim.pd.rank.RankExecutor` the simulator runs in
  process, and answered (``reply`` with the operation's ``seq``); a few driver commands (clock,
  stats, shutdown) are answered here;
* transfers that reached a terminal state go out as ``outcome`` events, notifications as
  ``notif`` events, handles released late as ``released`` events. NIXL is polled on every
  iteration, busy or idle: with NIXL's progress thread off this is what lets a peer's first
  transfer to this agent finish (docs/semantics.md §11.4 hazard 6).

It imports neither simpy nor the simulated fabric. stdout and stderr go to a per-rank log file
(NIXL prints INFO lines to stdout, UCX and NIXL's C++ layer to stderr); the coordinator quotes its
tail when the rank dies. Every wait has a deadline: a rank whose coordinator goes away exits.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import traceback
import zlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from ..pd.ops import (
    Message,
    OracleWrite,
    Verify,
    WriteStale,
    Outcome,
    Released,
    WireError,
    op_from_wire,
    outcome_to_wire,
    reply_value_to_wire,
)
from ..pd.cpu import LongOps, RankCpu, oracle_bytes
from ..pd.rank import RankExecutor
from ..transport.base import TransportError
from .side_channel import Channel, ChannelClosed, ProtocolError, fields

__all__ = ["rank_entry", "serve_rank", "select_cuda_device", "staging_spans", "RankProcess", "hello_message", "ucx_transports", "ucx_emulated_device_rma", "EXIT_OK",
           "EXIT_SETUP", "EXIT_LOST", "EXIT_UNREACHABLE"]

EXIT_OK, EXIT_SETUP, EXIT_LOST, EXIT_CRASH, EXIT_UNREACHABLE = 0, 3, 4, 5, 6
_IDLE_POLL_S = 0.001  # idle loop period: the side channel select timeout
_BUSY_POLL_S = 0.0001  # while transfers are in flight
_SETUP_TIMEOUT_S = 120.0


def rank_entry(host: str, port: int, credential: str, engine: str, rank: int, log_path: str,
               env: dict[str, str] | None = None) -> None:
    """Process entry point (multiprocessing spawn target; primitive arguments only).
    ``credential`` is this rank's one-time HELLO credential; ``env`` may only hold
    allow-listed variables (:mod:`hkvsim.lab_env`)."""
    from ..lab_env import allowed

    refused = sorted(k for k in (env or {}) if not allowed(k))
    if refused:  # the driver filters; anything else here is a bug, not a setting
        raise SystemExit(f"rank {engine}.{rank}: environment {refused} not allowed")
    for key, value in (env or {}).items():
        os.environ[key] = value
    sys.exit(serve_rank(host, port, credential, engine, rank, log_path))


def serve_rank(host: str, port: int, credential: str, engine: str, rank: int,
               log_path: str) -> int:
    """Run one rank of one run in this process until the coordinator shuts it down; returns
    its exit status (EXIT_*). stdout and stderr go to ``log_path`` from here on (a torchrun
    worker calls this once per scenario variant, each with its own log; they are restored
    afterwards). A coordinator that cannot be reached is said on the process's own stderr."""
    try:
        chan = Channel.connect(host, port, timeout=30.0)
    except OSError as exc:
        print(f"rank {engine}.{rank}: cannot reach the coordinator at {host}:{port}: {exc}",
              file=sys.stderr, flush=True)
        return EXIT_UNREACHABLE
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        return RankProcess(chan, credential=credential, engine=engine, rank=rank,
                           log_path=log_path).run()
    finally:
        chan.close()
        sys.stdout.flush()
        sys.stderr.flush()
        for target, fd in zip((1, 2), saved):  # the process's own output again (next round)
            os.dup2(fd, target)
            os.close(fd)


_PROTO_HEADER = re.compile(r"remote memory (read|write) by ucp_(get|put)")
_PROTO_CFG = re.compile(r"\|\s*\S+ (intra-node|inter-node|self) cfg#\d+")
_PROTO_ROW = re.compile(r"\|\s*[0-9.]+(?:inf)?\s*\|\s*[^|]+?\|\s*([^|]+?)\s*\|\s*$")


def _proto_lines(log_text: str) -> Iterator[tuple[str | None, str | None]]:
    """(scope, body) per line of a log's UCX_PROTO_INFO output, the timestamp prefix removed:
    ``scope`` is the configuration the line belongs to ("intra-node", "inter-node", "self"; None
    before any), and a configuration's own header line comes with ``body`` None (a new table
    group starts there)."""
    scope = None
    for line in log_text.splitlines():
        body = line.split("]", 2)[-1] if line.startswith("[") else line
        cfg = _PROTO_CFG.search(body)
        if cfg:
            scope = cfg.group(1)
            yield scope, None
        else:
            yield scope, body


def ucx_transports(log_text: str) -> list[str]:
    """UCX transports chosen for RMA (get/put) to other processes, from UCX_PROTO_INFO tables
    in a log ("cma/memory", "tcp/lo", "rc_mlx5/mlx5_0:1", ...); empty when none were printed."""
    found: list[str] = []
    in_rma = False
    for scope, body in _proto_lines(log_text):
        if body is None:
            in_rma = False
            continue
        if _PROTO_HEADER.search(body):
            in_rma = scope in ("intra-node", "inter-node")
            continue
        if in_rma:
            row = _PROTO_ROW.search(body)
            if row:
                for part in row.group(1).split():
                    for tl in part.split(","):
                        tl = tl.strip()
                        if "/" in tl and tl not in found:
                            found.append(tl)
    return found


_DEVICE_RMA_HEADER = re.compile(
    r"remote memory (read|write) by ucp_\w+\*\S* (?:into|from) (host memory|\S+) "
    r"(?:from|to) (host memory|\S+)")
_EMULATED_ROW = re.compile(r"\|\s*software emulation\s*\|\s*([^|]+?)\s*\|\s*$")


def ucx_emulated_device_rma(log_text: str) -> list[str]:
    """GPU-to-GPU RMA between processes that UCX does by *software emulation* (a bounce through
    host memory over a network transport such as tcp/lo) instead of cuda_ipc or RDMA, from the
    UCX_PROTO_INFO tables in a log: one line per (operation, memory pair, transport), e.g.
    ``"read into cuda/GPU0 from cuda/dev[1]: software emulation over tcp/lo"``. UCX does this
    for READ on a GPU without active NVLink, where it turns cuda_ipc GET off."""
    found: list[str] = []
    table = None
    for scope, body in _proto_lines(log_text):
        if body is None:
            table = None
            continue
        header = _DEVICE_RMA_HEADER.search(body)
        if header:
            op, first, second = header.groups()
            both_gpu = first.startswith("cuda") and second.startswith("cuda")
            where = "into" if op == "read" else "from"
            other = "from" if op == "read" else "to"
            table = (f"{op} {where} {first} {other} {second}"
                     if both_gpu and scope in ("intra-node", "inter-node") else None)
            continue
        if "remote memory" in body or "active message" in body:
            table = None
            continue
        row = _EMULATED_ROW.search(body) if table else None
        if row:
            entry = f"{table}: software emulation over {row.group(1)}"
            if entry not in found:
                found.append(entry)
    return found


def staging_spans(layout: Any, blocks: Mapping[int, Any]) -> list[tuple[int, int]]:
    """The byte ranges of a rank's allocation that hold the given logical blocks, in every
    tensor: what an oracle step on those blocks may read or write (a region view), so a VRAM
    rank stages only these through host memory instead of its whole cache.

    From the allocation's tensor geometry alone (tensor i starts at i * tensor_stride; within
    it, logical block b is the b-th unified page, and the attention view's kernel blocks of b
    are its b*ppl-th.. pages), never from the connector's descriptors. Sorted, merged."""
    parts = [np.asarray(v, dtype=np.int64).reshape(-1) for v in blocks.values()]
    ids = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
    if ids.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1)
    first = ids[np.concatenate([[0], breaks + 1])]
    last = ids[np.concatenate([breaks, [ids.size - 1]])] + 1
    pages = {int(layout.unified_page_bytes),
             int(layout.physical_blocks_per_logical * layout.attention_page_bytes)}
    lo_parts, hi_parts = [], []
    for t in range(layout.num_tensors):
        base, limit = t * layout.tensor_stride, t * layout.tensor_stride + layout.tensor_bytes
        for page in pages:
            lo_parts.append(np.minimum(base + first * page, limit))
            hi_parts.append(np.minimum(base + last * page, limit))
    lo, hi = np.concatenate(lo_parts), np.concatenate(hi_parts)
    keep = hi > lo
    lo, hi = lo[keep], hi[keep]
    order = np.argsort(lo, kind="stable")
    lo, hi = lo[order], np.maximum.accumulate(hi[order])
    new = np.concatenate([[True], lo[1:] > hi[:-1]])  # a gap before this span
    starts = lo[new]
    ends = hi[np.concatenate([np.flatnonzero(new)[1:] - 1, [lo.size - 1]])]
    return [(int(a), int(b)) for a, b in zip(starts, ends)]


class _HostStagedExecutor(RankExecutor):
    """A rank executor whose cache may live in VRAM: oracle steps run on the host shadow. Only
    the region the step touches is copied from the device (its blocks' pages, see
    :func:`staging_spans`; the whole cache for a step without block ids), and only the bytes a
    write changed are pushed back, in one masked copy per span (DMA may be landing elsewhere
    meanwhile)."""

    def __init__(self, rank: Any, worker: Any, oracle: Any, transport: Any) -> None:
        super().__init__(rank, worker, oracle)
        self.transport = transport
        self._spans: list[tuple[int, int]] | None = None  # the current op's region
        self.staged_bytes = 0  # device <-> host bytes moved for oracle steps (both ways)

    def execute(self, op: Any) -> Any:
        blocks = getattr(op, "blocks", None) if isinstance(op, (OracleWrite, WriteStale,
                                                                  Verify)) else None
        self._spans = None if blocks is None else staging_spans(self.worker.layout, blocks)
        try:
            return super().execute(op)
        finally:
            self._spans = None

    def access(self, write: bool, fn: Callable[[np.ndarray], Any]) -> Any:
        from ..transport.nixl import device_sync, device_write_changed

        memory = self.worker.memory
        if memory.mem_type != "VRAM":
            return fn(memory.array)
        spans = self._spans if self._spans is not None else [(0, memory.nbytes)]
        device_sync(self.transport, memory, to_device=False, ranges=spans)
        self.staged_bytes += sum(b - a for a, b in spans)
        before = [memory.array[a:b].copy() for a, b in spans] if write else []
        result = fn(memory.array)
        for (a, b), old in zip(spans, before):  # push back only the bytes this rank wrote
            self.staged_bytes += device_write_changed(self.transport, memory, a,
                                                      memory.array[a:b] != old)
        return result


def select_cuda_device(device_id: int) -> None:
    """Make ``cuda:<device_id>`` this process's current device, refusing an allocator setting
    that cuda_ipc cannot serve. Called before the NIXL agent is created."""
    from ..lab_env import check_alloc_conf

    check_alloc_conf()
    import torch  # the lab's CUDA torch (pip install '.[lab]')

    if not torch.cuda.is_available():
        raise RuntimeError("VRAM requested but torch sees no CUDA device")
    count = torch.cuda.device_count()
    if not 0 <= device_id < count:
        raise RuntimeError(f"VRAM on cuda:{device_id} requested, but this node has {count} "
                           f"CUDA device(s)")
    torch.cuda.set_device(device_id)


def hello_message(credential: str, engine: str, rank: int) -> dict[str, Any]:
    """A rank's first message: who it is, and its one-time credential."""
    return {"op": "hello", "credential": credential, "engine": engine, "rank": rank,
            "pid": os.getpid()}


class RankProcess:
    def __init__(self, chan: Channel, *, credential: str, engine: str, rank: int, log_path: str
                 ) -> None:
        self.chan = chan
        self.credential = credential
        self.engine = engine
        self.rank = rank
        self.log_path = log_path
        self.executor: RankExecutor | None = None
        self.transport: Any = None
        self._send_withheld: Callable[[], int] | None = None  # the fault wrapper's, if any
        self.epoch = time.time()
        self._transports_seen: list[str] = []
        self.cpu = RankCpu()  # CPU per operation kind and inside post calls (pd/cpu.py)
        # operations that held this rank's loop (no NIXL call) for LONG_OP_SECONDS or more:
        # [name, start, end] on the run's clock (pd/cpu.py, remote_hold_warnings)
        self.long_ops = LongOps()

    @property
    def worker(self) -> Any:
        return None if self.executor is None else self.executor.worker

    # ---- lifecycle ------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self.chan.send(hello_message(self.credential, self.engine, self.rank))
            setup = self.chan.recv(_SETUP_TIMEOUT_S)
        except (ChannelClosed, TimeoutError, ProtocolError) as exc:
            print(f"{self.engine}.{self.rank}: no SETUP from the coordinator: {exc}",
                  file=sys.stderr, flush=True)
            return EXIT_LOST
        if setup.get("op") == "shutdown":
            return EXIT_OK
        try:
            ready = self._setup(setup)
        except Exception as exc:
            from ..scenario import ScenarioError

            text = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ScenarioError):  # one line saying what to change (e.g. vLLM)
                text = str(exc)
                print(text, file=sys.stderr, flush=True)
            elif isinstance(exc, TransportError):  # NIXL / UCX said why just above in this log
                print(text, file=sys.stderr, flush=True)
            else:
                traceback.print_exc()
            self._send_quietly({"op": "fatal", "error": text})
            self._close_transport()
            return EXIT_SETUP
        self.chan.send(ready)
        try:
            return self._loop()
        except ChannelClosed:
            print(f"{self.engine}.{self.rank}: coordinator went away; closing", file=sys.stderr,
                  flush=True)
            self._close_transport()
            return EXIT_LOST
        except Exception as exc:
            traceback.print_exc()
            self._send_quietly({"op": "fatal", "error": f"{type(exc).__name__}: {exc}"})
            self._close_transport()
            return EXIT_CRASH

    def _send_quietly(self, message: dict[str, Any]) -> None:
        try:
            self.chan.send(message)
        except ChannelClosed:
            pass

    def _shutdown_worker(self) -> int:
        """Release everything the connector holds; returns what the transport still holds."""
        if self.worker is None:
            return 0
        give_up = getattr(self.worker.transport, "give_up_stalls", None)
        if give_up is not None:  # an injected stall ends with the run, as a UCX timeout would
            give_up()
        try:
            self.worker.shutdown()
        except Exception as exc:  # keep going: close() releases what shutdown could not
            print(f"worker.shutdown: {type(exc).__name__}: {exc}", file=sys.stderr)
        self.executor = None
        held = self.transport.resources()
        if sum(held.values()):
            print(f"resources left after worker.shutdown: {held}", file=sys.stderr)
        return sum(held.values())

    def _close_transport(self) -> dict[str, int]:
        self._shutdown_worker()
        return self.transport.close() if self.transport is not None else {}

    def _setup(self, message: dict[str, Any]) -> dict[str, Any]:
        f = fields(message, {"scenario": dict, "role": str, "num_blocks": int, "mem_type": str,
                             "device_id": int, "epoch": float, "progress_thread": bool,
                             "telemetry": bool, "oracle": bool, "precommit": bool})
        if message["op"] != "setup":
            raise ProtocolError(f"expected setup, got {message['op']}")
        from ..connector.quirks import check_quirks
        from ..connector.worker import ConnectorWorker
        from ..faults import FaultPlan
        from ..oracle import Oracle
        from ..pd.deployment import connector_settings, engine_layout
        from ..scenario import Scenario
        from ..transport.faulty import WRAPPABLE_FAULTS, FaultInjectingTransport
        from ..transport.nixl import NixlConfig, NixlTransport

        scenario = Scenario.model_validate(f["scenario"])
        role = f["role"]
        section = getattr(scenario, role)
        model = scenario.model_spec()
        quirks = check_quirks(list(scenario.connector.quirks))
        conn = scenario.connector
        layout = engine_layout(model, section, num_blocks=f["num_blocks"],
                               registration_order=conn.registration_order, quirks=quirks)
        self.epoch = f["epoch"]
        if f["mem_type"] == "VRAM":  # before the NIXL agent exists (UCX binds its CUDA context)
            select_cuda_device(f["device_id"])
        self.transport = NixlTransport(
            f"{self.engine}.{self.rank}",
            config=NixlConfig(progress_thread=f["progress_thread"], telemetry=f["telemetry"]),
            clock=lambda: time.time() - self.epoch)
        connector_transport: Any = self.transport
        injected = [x for x in scenario.faults if x.kind in WRAPPABLE_FAULTS]
        if injected:  # fail / stall / drop faults, decided per transfer from the seeded plan
            plan = FaultPlan(injected, seed=zlib.crc32(f"{scenario.scenario.seed}:{self.engine}."
                                                       f"{self.rank}".encode()),
                             transfer_timeout=conn.transfer_timeout_seconds)
            connector_transport = FaultInjectingTransport(
                self.transport, plan, clock=lambda: time.time() - self.epoch)
            self._send_withheld = connector_transport.send_withheld
        make_worker: Callable[..., Any] = ConnectorWorker
        implementation: dict[str, str] | None = None
        if conn.implementation == "vllm":  # vLLM's own worker over this rank's NIXL agent
            make_worker, implementation = self._vllm_worker_factory(scenario, f)
        worker = make_worker(engine_id=self.engine, role=role, tp_rank=self.rank,
                             layout=layout, transport=connector_transport,
                             settings=connector_settings(scenario, role),
                             device_id=f["device_id"])
        worker.register(mem_type=f["mem_type"])
        self._time_posts()
        if f["precommit"] and worker.memory.mem_type == "DRAM":
            # commit every page now (as a real, preallocated cache is): a page first touched
            # inside a cma READ costs a fault there, 8x slower on the 2-core VM
            worker.memory.array.fill(0)
        oracle = Oracle(layout.model) if f["oracle"] else None
        self.executor = _HostStagedExecutor((self.engine, self.rank), worker, oracle,
                                            self.transport)
        ready = {"op": "ready", "payload": worker.handshake_payload(),
                 "agent_metadata": self.transport.get_agent_metadata(),
                 "agent": self.transport.name, "total_bytes": int(layout.total_bytes),
                 "backends": list(self.transport.backends)}
        if implementation is not None:
            ready["implementation"] = dict(implementation)
        return ready

    def _time_posts(self) -> None:
        """Add the CPU of every post call of this rank's NIXL agent to ``self.cpu`` (on UCX cma
        the copy runs inside it)."""
        post = self.transport.transfer

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.process_time()
            try:
                return post(*args, **kwargs)
            finally:
                self.cpu.add_post(time.process_time() - started)

        self.transport.transfer = timed

    def _vllm_worker_factory(self, scenario: Any, f: dict[str, Any]
                             ) -> tuple[Callable[..., Any], dict[str, str]]:
        """``[connector] implementation = "vllm"``: vLLM's worker (this process must have vLLM:
        run under ``scripts/with-vllm VERSION``), over this rank's NIXL agent through the same
        nixl_agent-shaped adapter as on the simulated fabric; its clock is the run's. Every
        reason it cannot run is one ScenarioError line."""
        from ..implementations.vllm.run import vllm_worker_factory
        from ..pd.deployment import build_deployment
        from ..scenario import ScenarioError

        if f["mem_type"] != "DRAM":
            raise ScenarioError(f"vLLM's connector runs over host memory here; memory type "
                                f"{f['mem_type']} is not driven (allowed: DRAM)",
                                source=scenario.source, key="connector.implementation")
        return vllm_worker_factory(build_deployment(scenario),
                                   now=lambda: time.time() - self.epoch,
                                   moves_bytes=f["oracle"])

    # ---- loop -----------------------------------------------------------------------------
    def _loop(self) -> int:
        assert self.executor is not None
        executor = self.executor
        while True:
            busy = executor.busy()
            for message in self.chan.poll(_BUSY_POLL_S if busy else _IDLE_POLL_S):
                if message.get("op") == "shutdown":
                    self._shutdown(message)
                    return EXIT_OK
                if message.get("op") == "die":  # the kill-rank fault on a rank of another node
                    os.kill(os.getpid(), signal.SIGKILL)
                self._command(message)
            started = time.process_time()
            self._report(executor.poll())  # calls into NIXL every iteration
            if self._send_withheld is not None:  # after the report (transport/faulty.py)
                self._send_withheld()
            self.cpu.add_poll(busy, time.process_time() - started)

    def _report(self, events: list[Any]) -> None:
        """Forward what happened on this rank: outcomes, notifications, late releases."""
        messages = [e.message for e in events if isinstance(e, Message)]
        for e in events:
            if isinstance(e, Outcome):
                self.chan.send({"op": "outcome", "outcome": self._outcome_out(e.outcome)})
        if messages:
            self.chan.send({"op": "notif", "messages": messages})
        released = [e.request_id for e in events if isinstance(e, Released)]
        if released:
            self.chan.send({"op": "released", "request_ids": released})

    def _outcome_out(self, outcome: Any) -> dict[str, Any]:
        """An outcome on the wire; each transfer's path ends with the UCX transports this rank
        uses for RMA (from UCX_PROTO_INFO in its log, once UCX has printed them)."""
        data = outcome_to_wire(outcome)
        transports = self._rma_transports()
        for t in data["telemetry"]:
            t["path"] = list(t["path"]) + [x for x in transports if x not in t["path"]]
        return data

    def _rma_transports(self) -> list[str]:
        if not self._transports_seen:
            self._transports_seen = ucx_transports(self._log_text())
        return self._transports_seen

    def _shutdown(self, message: dict[str, Any]) -> None:
        seq = message.get("seq")
        leftover = self._shutdown_worker()
        report = self._close_transport()
        log = self._log_text()
        self._send_quietly({"op": "reply", "seq": seq, "ok": True, "closed": report,
                            "leftover": leftover, "transports": ucx_transports(log),
                            "emulated": ucx_emulated_device_rma(log)})

    def _log_text(self) -> str:
        """This rank's log so far (UCX writes its protocol tables there); "" if unreadable."""
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return fh.read()
        except OSError:
            return ""

    def _command(self, message: dict[str, Any]) -> None:
        """A driver command (clock, stats, ping) or a coordinator operation (pd.ops)."""
        op, seq = message.get("op"), message.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool):
            self.chan.send({"op": "reply", "seq": -1, "ok": False,
                            "error": f"command {op!r} without an int seq"})
            return
        driver = getattr(self, f"_cmd_{op}", None) if isinstance(op, str) else None
        try:
            if driver is not None:
                self.chan.send({"op": "reply", "seq": seq, "ok": True, **driver(message)})
                return
            rank_op = op_from_wire(message)
            assert self.executor is not None
            started, wall = time.process_time(), time.perf_counter()
            clock = time.time() - self.epoch
            waiting = getattr(self.transport, "transfers_in_progress", lambda: 0)()
            value = self.executor.execute(rank_op)
            held = time.perf_counter() - wall
            self.long_ops.add(type(rank_op).__name__, clock, clock + held)
            if waiting:
                self.cpu.add_blocked(type(rank_op).__name__, held)
            blocks = getattr(rank_op, "blocks", None)
            self.cpu.add_op(type(rank_op).__name__, time.process_time() - started,
                            oracle_bytes(self.worker.layout, blocks)
                            if self.executor.oracle is not None
                            and isinstance(rank_op, (OracleWrite, Verify)) else 0)
            self.chan.send({"op": "reply", "seq": seq, "ok": True,
                            "value": reply_value_to_wire(rank_op, value)})
        except TransportError as exc:
            self.chan.send({"op": "reply", "seq": seq, "ok": False, "error": str(exc),
                            "kind": exc.kind})
        except (ProtocolError, WireError, ValueError, KeyError, AssertionError) as exc:
            traceback.print_exc()
            self.chan.send({"op": "reply", "seq": seq, "ok": False,
                            "error": f"{type(exc).__name__}: {exc}", "kind": "rank_error"})

    # ---- driver commands ------------------------------------------------------------------
    def _cmd_stats(self, message: dict[str, Any]) -> dict[str, Any]:
        fields(message, {})
        return {"open_handles": int(self.transport.open_handles()),
                "in_flight": int(self.worker.in_flight()),
                "pending_releases": int(self.worker.pending_releases()),
                "notification_failures": int(self.worker.notification_failures),
                "cpu": self.cpu.to_wire(), "agent": f"{self.engine}.{self.rank}",
                "long_ops": self.long_ops.to_wire()}

    def _cmd_clock(self, message: dict[str, Any]) -> dict[str, Any]:
        """The run starts now: telemetry times count from ``epoch`` (wall clock)."""
        self.epoch = fields(message, {"epoch": float})["epoch"]
        return {}

    def _cmd_ping(self, message: dict[str, Any]) -> dict[str, Any]:
        fields(message, {})
        return {"pid": os.getpid()}
