"""One rank of a NIXL run: its own OS process, its NIXL agent, the unchanged ConnectorWorker, the
oracle on its own memory, and a polling loop.

The process connects to the coordinator's side channel, proves it belongs to the run (token),
receives SETUP (the scenario, its engine, rank, block count and memory type), registers its cache
and answers READY with its handshake payload. Then it loops:

* commands from the coordinator (oracle fill, connect, READ, WRITE, verify, ...) are executed
  and answered (``reply`` with the command's ``seq``);
* ``worker.poll()`` reports finished transfers as ``outcome`` events;
* ``worker.take_messages()`` (NIXL ``get_new_notifs``) forwards every notification as a
  ``notif`` event. It runs on every iteration, busy or idle: with NIXL's progress thread off this
  is what lets a peer's first transfer to this agent finish (DOMAIN.md §11.4 hazard 6).

stdout and stderr go to a per-rank log file (NIXL prints INFO lines to stdout, UCX and NIXL's C++
layer to stderr); the coordinator quotes its tail when the rank dies. Every wait has a deadline:
a rank whose coordinator goes away exits.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ..transport.base import TransportError
from .side_channel import Channel, ChannelClosed, ProtocolError, fields, groups_in, ids_in

__all__ = ["rank_entry", "RankProcess", "ucx_transports", "EXIT_OK", "EXIT_SETUP", "EXIT_LOST"]

EXIT_OK, EXIT_SETUP, EXIT_LOST, EXIT_CRASH = 0, 3, 4, 5
_IDLE_POLL_S = 0.001  # idle loop period: the side channel select timeout
_BUSY_POLL_S = 0.0001  # while transfers are in flight
_SETUP_TIMEOUT_S = 120.0


def rank_entry(host: str, port: int, token: str, engine: str, rank: int, log_path: str,
               env: dict[str, str] | None = None) -> None:
    """Process entry point (multiprocessing spawn target; primitive arguments only)."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for key, value in (env or {}).items():
        os.environ[key] = value
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        chan = Channel.connect(host, port, timeout=30.0)
    except OSError as exc:
        print(f"rank {engine}.{rank}: cannot reach the coordinator at {host}:{port}: {exc}",
              file=sys.stderr, flush=True)
        sys.exit(EXIT_LOST)
    code = RankProcess(chan, token=token, engine=engine, rank=rank, log_path=log_path).run()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


_PROTO_HEADER = re.compile(r"remote memory (read|write) by ucp_(get|put)")
_PROTO_CFG = re.compile(r"\|\s*\S+ (intra-node|inter-node|self) cfg#\d+")
_PROTO_ROW = re.compile(r"\|\s*[0-9.]+(?:inf)?\s*\|\s*[^|]+?\|\s*([^|]+?)\s*\|\s*$")


def ucx_transports(log_text: str) -> list[str]:
    """UCX transports chosen for RMA (get/put) to other processes, from UCX_PROTO_INFO tables
    in a log ("cma/memory", "tcp/lo", "rc_mlx5/mlx5_0:1", ...); empty when none were printed."""
    found: list[str] = []
    scope = None
    in_rma = False
    for line in log_text.splitlines():
        body = line.split("]", 2)[-1] if line.startswith("[") else line
        cfg = _PROTO_CFG.search(body)
        if cfg:
            scope, in_rma = cfg.group(1), False
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


def _outcome_out(outcome: Any) -> dict[str, Any]:
    return {
        "request_id": outcome.request_id, "ok": bool(outcome.ok), "reason": outcome.reason,
        "failure_class": outcome.failure_class, "descriptors": int(outcome.descriptors),
        "nbytes": int(outcome.nbytes), "transfers": int(outcome.transfers),
        "telemetry": [{"nbytes": int(t.nbytes), "descriptors": int(t.descriptors),
                       "post_seconds": float(t.post_seconds),
                       "transfer_seconds": float(t.transfer_seconds),
                       "submitted": float(t.submitted),
                       "completed": None if t.completed is None else float(t.completed),
                       "path": [str(p) for p in t.path]} for t in outcome.telemetry],
    }


class RankProcess:
    def __init__(self, chan: Channel, *, token: str, engine: str, rank: int, log_path: str
                 ) -> None:
        self.chan = chan
        self.token = token
        self.engine = engine
        self.rank = rank
        self.log_path = log_path
        self.worker: Any = None
        self.transport: Any = None
        self.oracle: Any = None
        self.layout: Any = None
        self.epoch = time.time()

    # ---- lifecycle ------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self.chan.send({"op": "hello", "token": self.token, "engine": self.engine,
                            "rank": self.rank, "pid": os.getpid()})
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
            text = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, TransportError):  # NIXL / UCX said why just above in this log
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

    def _close_transport(self) -> dict[str, int]:
        report: dict[str, int] = {}
        if self.worker is not None:
            give_up = getattr(self.worker.transport, "give_up_stalls", None)
            if give_up is not None:  # an injected stall ends with the run, as a UCX timeout would
                give_up()
            try:
                self.worker.shutdown()
            except Exception as exc:  # keep going: close() releases what shutdown could not
                print(f"worker.shutdown: {type(exc).__name__}: {exc}", file=sys.stderr)
        if self.transport is not None:
            report = self.transport.close()
        return report

    def _setup(self, message: dict[str, Any]) -> dict[str, Any]:
        f = fields(message, {"scenario": dict, "role": str, "num_blocks": int, "mem_type": str,
                             "device_id": int, "epoch": float, "progress_thread": bool,
                             "telemetry": bool, "oracle": bool, "precommit": bool})
        if message["op"] != "setup":
            raise ProtocolError(f"expected setup, got {message['op']}")
        from ..cluster import engine_layout
        from ..connector.quirks import check_quirks
        from ..connector.worker import ConnectorSettings, ConnectorWorker
        from ..oracle import Oracle
        from ..scenario import Scenario
        from ..faults import FaultPlan
        from ..transport.faulty import WRAPPABLE_FAULTS, FaultInjectingTransport
        from ..transport.nixl import NixlConfig, NixlTransport

        scenario = Scenario.model_validate(f["scenario"])
        role = f["role"]
        section = getattr(scenario, role)
        model = scenario.model_spec()
        quirks = check_quirks(list(scenario.connector.quirks))
        conn = scenario.connector
        self.layout = engine_layout(model, section, num_blocks=f["num_blocks"],
                                    registration_order=conn.registration_order, quirks=quirks)
        settings = ConnectorSettings(mode=conn.mode, quirks=quirks,
                                     prefix_caching=section.prefix_caching,
                                     host_buffer=conn.host_buffer,
                                     enforce_handshake_compat=conn.enforce_handshake_compat,
                                     descriptor_merge=conn.descriptor_merge)
        self.epoch = f["epoch"]
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
        self.worker = ConnectorWorker(engine_id=self.engine, role=role, tp_rank=self.rank,
                                      layout=self.layout, transport=connector_transport,
                                      settings=settings, device_id=f["device_id"])
        self.worker.register(mem_type=f["mem_type"])
        if f["precommit"] and self.worker.memory.mem_type == "DRAM":
            # commit every page now (as a real, preallocated cache is): a page first touched
            # inside a cma READ costs a fault there, 8x slower on the 2-core VM
            self.worker.memory.array.fill(0)
        self.oracle = Oracle(self.layout.model) if f["oracle"] else None
        return {"op": "ready", "payload": self.worker.handshake_payload(),
                "agent_metadata": self.transport.get_agent_metadata(),
                "agent": self.transport.name, "total_bytes": int(self.layout.total_bytes),
                "backends": list(self.transport.backends)}

    # ---- loop -----------------------------------------------------------------------------
    def _loop(self) -> int:
        while True:
            busy = self.worker.in_flight() > 0 or self.worker.pending_releases() > 0
            for message in self.chan.poll(_BUSY_POLL_S if busy else _IDLE_POLL_S):
                if message.get("op") == "shutdown":
                    self._shutdown(message)
                    return EXIT_OK
                if message.get("op") == "die":  # the kill-rank fault on a rank of another node
                    os.kill(os.getpid(), signal.SIGKILL)
                self._command(message)
            if self.worker.in_flight() or self.worker.pending_releases():
                for outcome in self.worker.poll():
                    self.chan.send({"op": "outcome", "outcome": _outcome_out(outcome)})
            messages = self.worker.take_messages()  # calls into NIXL every iteration
            if messages:
                self.chan.send({"op": "notif", "messages": messages})

    def _shutdown(self, message: dict[str, Any]) -> None:
        seq = message.get("seq")
        leftover = 0
        if self.worker is not None:
            give_up = getattr(self.worker.transport, "give_up_stalls", None)
            if give_up is not None:  # an injected stall ends with the run, as a UCX timeout would
                give_up()
            try:
                self.worker.shutdown()
            except Exception as exc:
                print(f"worker.shutdown: {type(exc).__name__}: {exc}", file=sys.stderr)
            self.worker = None
            held = self.transport.resources()
            leftover = sum(held.values())
            if leftover:
                print(f"resources left after worker.shutdown: {held}", file=sys.stderr)
        report = self._close_transport()
        self._send_quietly({"op": "reply", "seq": seq, "ok": True, "closed": report,
                            "leftover": leftover, "transports": self._transports()})

    def _transports(self) -> list[str]:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as fh:
                return ucx_transports(fh.read())
        except OSError:
            return []

    def _command(self, message: dict[str, Any]) -> None:
        op, seq = message.get("op"), message.get("seq")
        handler: Callable[[dict[str, Any]], dict[str, Any]] | None = getattr(
            self, f"_op_{op}", None)
        if handler is None or not isinstance(seq, int):
            self.chan.send({"op": "reply", "seq": seq if isinstance(seq, int) else -1,
                            "ok": False, "error": f"unknown command {op!r}"})
            return
        try:
            result = handler(message)
        except TransportError as exc:
            self.chan.send({"op": "reply", "seq": seq, "ok": False, "error": str(exc),
                            "kind": exc.kind})
            return
        except (ProtocolError, ValueError, KeyError, AssertionError) as exc:
            traceback.print_exc()
            self.chan.send({"op": "reply", "seq": seq, "ok": False,
                            "error": f"{type(exc).__name__}: {exc}", "kind": "rank_error"})
            return
        self.chan.send({"op": "reply", "seq": seq, "ok": True, **result})

    # ---- memory access (VRAM goes through the host shadow) --------------------------------
    def _host(self, write: bool, fn: Callable[[np.ndarray], Any]) -> Any:
        from ..transport.nixl import device_sync

        memory = self.worker.memory
        if memory.mem_type != "VRAM":
            return fn(memory.array)
        device_sync(self.transport, memory, to_device=False)
        before = memory.array.copy() if write else None
        result = fn(memory.array)
        if write:
            words_now = memory.array[: memory.nbytes // 8 * 8].view(np.uint64)
            words_old = before[: memory.nbytes // 8 * 8].view(np.uint64)
            changed = np.flatnonzero(words_now != words_old)
            if changed.size:  # push back only what this rank wrote (DMA may be landing elsewhere)
                breaks = np.flatnonzero(np.diff(changed) != 1)
                starts = np.concatenate([[changed[0]], changed[breaks + 1]])
                ends = np.concatenate([changed[breaks], [changed[-1]]]) + 1
                device_sync(self.transport, memory, to_device=True,
                            ranges=[(int(a) * 8, int(b) * 8) for a, b in zip(starts, ends)])
            tail = memory.nbytes % 8
            if tail:
                device_sync(self.transport, memory, to_device=True,
                            ranges=[(memory.nbytes - tail, memory.nbytes)])
        return result

    # ---- commands -------------------------------------------------------------------------
    def _op_oracle_write(self, message: dict[str, Any]) -> dict[str, Any]:
        f = fields(message, {"request": int, "blocks": list, "tokens": list,
                             "state_step": (int, type(None))})
        if self.oracle is None:
            return {}
        blocks = groups_in(f["blocks"])
        a, b = _token_range(f["tokens"])
        self._host(True, lambda arr: self.oracle.write(
            arr, self.layout, self.rank, f["request"], blocks=blocks, tokens=(a, b),
            state_step=f["state_step"]))
        return {}

    def _op_verify(self, message: dict[str, Any]) -> dict[str, Any]:
        """Check the loaded bytes, then compute token N (as Cluster._verify_and_compute)."""
        f = fields(message, {"request": int, "blocks": list, "tokens": list,
                             "state_step": (int, type(None)), "compute": list,
                             "compute_step": (int, type(None))})
        if self.oracle is None:
            return {"words": 0, "mismatches": []}
        blocks = groups_in(f["blocks"])
        a, b = _token_range(f["tokens"])
        c0, c1 = _token_range(f["compute"])

        def run(arr: np.ndarray) -> tuple[int, list]:
            words, found = self.oracle.verify(arr, self.layout, self.rank, f["request"],
                                              engine=self.engine, blocks=blocks, tokens=(a, b),
                                              state_step=f["state_step"])
            self.oracle.write(arr, self.layout, self.rank, f["request"], blocks=blocks,
                              tokens=(c0, c1), state_step=f["compute_step"])
            return words, found

        words, found = self._host(True, run)
        return {"words": int(words), "mismatches": [str(m) for m in found[:8]]}

    def _op_post_process(self, message: dict[str, Any]) -> dict[str, Any]:
        f = fields(message, {"zero": list, "kernel": list, "bsr": int})
        zero, kernel = ids_in(f["zero"], "zero"), ids_in(f["kernel"], "kernel")

        def run(_arr: np.ndarray) -> None:
            self.worker.zero_sub_blocks(zero, f["bsr"])
            self.worker.regroup_heads(kernel, f["bsr"])

        self._host(True, run)
        return {}

    def _op_connect(self, message: dict[str, Any]) -> dict[str, Any]:
        from ..connector.validate import HandshakeError
        from ..geometry.specs import GeometryError

        f = fields(message, {"remote_engine": str, "payloads": list})
        payloads: dict[int, bytes] = {}
        for item in f["payloads"]:
            if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], int)
                    or not isinstance(item[1], bytes)):
                raise ProtocolError("connect: payloads must be [rank, bytes] pairs")
            payloads[item[0]] = item[1]
        start = time.perf_counter()
        try:
            self.worker.connect(f["remote_engine"], payloads)
        except (HandshakeError, GeometryError) as exc:
            return {"error": str(exc)}
        return {"error": None, "seconds": time.perf_counter() - start}

    def _op_connect_notify_only(self, message: dict[str, Any]) -> dict[str, Any]:
        """Notification-only handshake (decode learns prefill's agents, no descriptors)."""
        f = fields(message, {"metadata": list})
        if not all(isinstance(md, bytes) for md in f["metadata"]):
            raise ProtocolError("connect_notify_only: metadata must be bytes")
        self.worker.connect_notify_only(f["metadata"])
        return {}

    def _op_evict(self, message: dict[str, Any]) -> dict[str, Any]:
        f = fields(message, {"engine": str})
        self.worker.evict(f["engine"])
        return {}

    def _op_send_notifs(self, message: dict[str, Any]) -> dict[str, Any]:
        f = fields(message, {"agents": list, "message": bytes})
        for agent in f["agents"]:
            if not isinstance(agent, str):
                raise ProtocolError("send_notifs: agents must be str")
            self.transport.send_notif(agent, f["message"])
        return {}

    def _op_read(self, message: dict[str, Any]) -> dict[str, Any]:
        from ..connector.worker import ReadRequest

        f = fields(message, {"request_id": str, "prefill_request_id": str,
                             "remote_engine": str, "prefill_blocks": list,
                             "decode_blocks": list, "decode_hit_blocks": int})
        req = ReadRequest(request_id=f["request_id"],
                          prefill_request_id=f["prefill_request_id"],
                          remote_engine=f["remote_engine"],
                          prefill_blocks=groups_in(f["prefill_blocks"], "prefill_blocks"),
                          decode_blocks=groups_in(f["decode_blocks"], "decode_blocks"),
                          decode_hit_blocks=f["decode_hit_blocks"])
        outcome = self.worker.start_read(req)
        return {"outcome": None if outcome is None else _outcome_out(outcome)}

    def _op_write(self, message: dict[str, Any]) -> dict[str, Any]:
        from ..connector.push import PushRegistration, WriteRequest

        f = fields(message, {"prefill_request_id": str, "registration": bytes,
                             "prefill_blocks": list})
        registration = PushRegistration.decode(f["registration"])
        if registration is None:
            raise ProtocolError("write: malformed push registration")
        outcome = self.worker.start_write(WriteRequest(
            prefill_request_id=f["prefill_request_id"], registration=registration,
            prefill_blocks=groups_in(f["prefill_blocks"], "prefill_blocks")))
        return {"outcome": None if outcome is None else _outcome_out(outcome)}

    def _op_abort(self, message: dict[str, Any]) -> dict[str, Any]:
        f = fields(message, {"request_id": str, "reason": str, "failure_class": str})
        outcome = self.worker.abort(f["request_id"], f["reason"], f["failure_class"])
        return {"outcome": None if outcome is None else _outcome_out(outcome)}

    def _op_stats(self, message: dict[str, Any]) -> dict[str, Any]:
        fields(message, {})
        return {"open_handles": int(self.transport.open_handles()),
                "in_flight": int(self.worker.in_flight()),
                "pending_releases": int(self.worker.pending_releases()),
                "notification_failures": int(self.worker.notification_failures)}

    def _op_clock(self, message: dict[str, Any]) -> dict[str, Any]:
        """The run starts now: telemetry times count from ``epoch`` (wall clock)."""
        self.epoch = fields(message, {"epoch": float})["epoch"]
        return {}

    def _op_ping(self, message: dict[str, Any]) -> dict[str, Any]:
        fields(message, {})
        return {"pid": os.getpid()}


def _token_range(value: Any) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
            or value[0] > value[1]):
        raise ProtocolError(f"a token range must be [start, stop] with 0 <= start <= stop, got "
                            f"{value!r}")
    return value[0], value[1]
