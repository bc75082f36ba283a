"""Connector overhead over real NIXL: the same READ, posted by the connector and by a bare loop.

A spawned *prefill* process holds a registered cache (the unchanged ConnectorWorker, real NIXL
agent) and keeps calling into NIXL. This process is a *decode* rank: its ConnectorWorker
handshakes with the prefill payload, then, side by side in rounds (the order alternating):

* **connector**: ``worker.start_read(request)`` and ``worker.poll()`` until the outcome: block
  expansion and pairing, descriptor ids, make_prepped_xfer, transfer, polling, telemetry,
  release -- everything the connector does per request;
* **bare**: ``nixl_agent.make_prepped_xfer`` on the *same* prepared lists with the *same* ids and
  notification the connector used (captured from its first post), transfer, poll, release.

Throughput = bytes / median time per transfer; the ratio connector / bare is the overhead
figure (the acceptance asks for >= 0.9).
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import tempfile
import time
from typing import Any

import msgpack
import numpy as np

__all__ = ["measure_overhead", "SCENARIO"]

SCENARIO = """
[scenario]
name = "connector overhead"
[model]
preset = "{preset}"
[prefill]
tp = 1
[decode]
tp = 1
[workload]
requests = 1
prompt_tokens = {tokens}
"""


def _scenario(preset: str, tokens: int) -> Any:
    from ..scenario import parse_scenarios

    (scenario,) = parse_scenarios(SCENARIO.format(preset=preset, tokens=tokens))
    return scenario


def _worker(scenario: Any, role: str, num_blocks: int, name: str) -> Any:
    from ..pd.deployment import engine_layout
    from ..connector.worker import ConnectorSettings, ConnectorWorker
    from ..transport.nixl import NixlTransport

    section = getattr(scenario, role)
    layout = engine_layout(scenario.model_spec(), section, num_blocks=num_blocks,
                           registration_order=scenario.connector.registration_order,
                           quirks=frozenset())
    worker = ConnectorWorker(engine_id=f"{role}0", role=role, tp_rank=0, layout=layout,
                             transport=NixlTransport(name), settings=ConnectorSettings(),
                             device_id=0)
    worker.register(mem_type="DRAM")
    assert worker.memory is not None
    worker.memory.array.fill(0x5A)  # commit the pages: no zero-page reads
    return worker


def _prefill_main(conn: Any, preset: str, tokens: int, num_blocks: int, log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    worker = _worker(_scenario(preset, tokens), "prefill", num_blocks, "overhead-prefill")
    conn.send_bytes(msgpack.packb({"payload": worker.handshake_payload()}))
    notifications = 0
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        notifications += len(worker.take_messages())  # keeps calling into NIXL
        if conn.poll(0.001):
            break
    worker.shutdown()
    worker.transport.close()
    conn.send_bytes(msgpack.packb({"notifications": notifications}))


def _blocks(layout: Any, tokens: int) -> dict[int, np.ndarray]:
    out, nxt = {}, 0
    for group in layout.groups:
        n = layout.blocks_for_tokens(tokens) if group.kind == "attention" else 1
        out[group.group_id] = np.arange(nxt, nxt + n, dtype=np.int64)
        nxt += n
    return out


def measure_overhead(*, preset: str = "kimi-linear-48b", tokens: int = 8192, rounds: int = 7,
                     iterations: int = 8) -> dict[str, Any]:
    """Connector vs bare NIXL throughput for one request's READ (decode TP1 <- prefill TP1)."""
    from ..pd.deployment import engine_layout
    from ..connector.worker import ReadRequest

    scenario = _scenario(preset, tokens)
    layout = engine_layout(scenario.model_spec(), scenario.decode, num_blocks=1,
                           registration_order=scenario.connector.registration_order,
                           quirks=frozenset())
    num_blocks = layout.blocks_for_tokens(tokens) * len(layout.attention_groups) + len(
        layout.state_groups)
    logs = tempfile.mkdtemp(prefix="hkvsim-overhead-")
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    peer = ctx.Process(target=_prefill_main, daemon=True,
                       args=(there, preset, tokens, num_blocks, os.path.join(logs, "p.log")))
    peer.start()
    try:
        if not here.poll(120):
            raise RuntimeError(f"the prefill process did not start (logs in {logs})")
        payload = msgpack.unpackb(here.recv_bytes(), raw=False)["payload"]
        decode = _worker(scenario, "decode", num_blocks, "overhead-decode")
        decode.connect("prefill0", {0: payload})
        transport = decode.transport
        captured: list[tuple] = []
        original = transport.make_prepped_xfer

        def capture(op, local, lids, remote, rids, notif=b""):  # type: ignore[no-untyped-def]
            captured.append((op, local, np.array(lids), remote, np.array(rids), notif))
            return original(op, local, lids, remote, rids, notif)

        transport.make_prepped_xfer = capture  # type: ignore[method-assign]
        blocks = _blocks(decode.layout, tokens - 1)
        request = ReadRequest(request_id="req-0-0", prefill_request_id="req-0-1",
                              remote_engine="prefill0", prefill_blocks=blocks,
                              decode_blocks=blocks)

        def connector_once() -> tuple[float, int, int]:
            t0 = time.perf_counter()
            outcome = decode.start_read(request)
            while outcome is None:
                done = decode.poll()
                outcome = done[0] if done else None
            elapsed = time.perf_counter() - t0
            if not outcome.ok:
                raise RuntimeError(f"connector READ failed: {outcome.reason}")
            return elapsed, outcome.nbytes, outcome.descriptors

        _, nbytes, descriptors = connector_once()  # wire-up, and capture the posted READ
        (op, local, lids, remote, rids, notif), = captured[-1:]
        agent = transport.native_agent
        lh, rh = transport.native_dlist(local), transport.native_dlist(remote)

        def bare_once() -> float:
            t0 = time.perf_counter()
            x = agent.make_prepped_xfer(op, lh, lids, rh, rids, notif)
            state = agent.transfer(x)
            while state == "PROC":
                state = agent.check_xfer_state(x)
            agent.release_xfer_handle(x)
            elapsed = time.perf_counter() - t0
            if state != "DONE":
                raise RuntimeError(f"bare READ ended in {state}")
            return elapsed

        bare, conn = [], []
        for r in range(rounds):
            order = (("bare", "connector") if r % 2 == 0 else ("connector", "bare"))
            for kind in order:
                for _ in range(iterations):
                    if kind == "bare":
                        bare.append(bare_once())
                    else:
                        conn.append(connector_once()[0])
        decode.shutdown()
        transport.close()
        here.send_bytes(b"stop")
        notes = msgpack.unpackb(here.recv_bytes(), raw=False) if here.poll(30) else {}
    finally:
        peer.join(30)
        if peer.is_alive():
            peer.kill()
    import shutil

    shutil.rmtree(logs, ignore_errors=True)
    t_bare, t_conn = statistics.median(bare), statistics.median(conn)
    return {"preset": preset, "tokens": tokens, "descriptors": descriptors, "nbytes": nbytes,
            "samples": len(bare), "bare_seconds": t_bare, "connector_seconds": t_conn,
            "bare_gbps": nbytes / t_bare / 1e9, "connector_gbps": nbytes / t_conn / 1e9,
            "ratio": t_bare / t_conn, "connector_overhead_us": (t_conn - t_bare) * 1e6,
            "notifications_received": notes.get("notifications")}
