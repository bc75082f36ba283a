"""Multi-node launch for the NIXL run (the lab launcher's engine; hardware/launch.py is its CLI).

One coordinator (the scheduler / proxy, :class:`~hkvsim.drivers.nixl.NixlDriver` with
``spawn=False``) listens on an address the nodes can reach. On every node one *node agent*
connects to it, says how many rank slots (GPUs) it has, gets the ranks it must run (engines are
packed onto nodes in order, prefill first; an engine never straddles nodes when it fits) and
starts them with multiprocessing *spawn* -- the same entry point, :func:`hkvsim.backends.rank.
rank_entry`, that a single-node run uses. The node agent watches its children and reports one
that dies (exit status and log tail) to the coordinator, which fails the run with that reason.

A node agent proves itself with a shared token (``HKVSIM_TOKEN``), compared in constant time;
the coordinator hands it one one-time credential per rank, which the rank's HELLO carries.
Every wait has a deadline.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import sys
import time
from pathlib import Path
from typing import Any

from .side_channel import Channel, ChannelClosed, ProtocolError

__all__ = ["node_main", "run_node"]


def _tail(path: str, lines: int = 3) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 8000))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    keep = [ln.strip() for ln in text.splitlines() if ln.strip() and "| " not in ln]
    return " | ".join(keep[-lines:])


def run_node(host: str, port: int, token: str, *, node: int, slots: int, log_dir: str,
             connect_timeout: float = 120.0, run_timeout: float = 7200.0) -> int:
    """Run one node agent until the coordinator says done (or goes away). Returns an exit
    status: 0 when every rank exited cleanly."""
    from .rank import rank_entry

    end = time.monotonic() + connect_timeout
    while True:
        try:
            chan = Channel.connect(host, port, timeout=10.0)
            break
        except OSError:
            if time.monotonic() > end:
                print(f"node {node}: no coordinator at {host}:{port} within {connect_timeout} s",
                      file=sys.stderr)
                return 3
            time.sleep(1.0)
    chan.send({"op": "node_hello", "token": token, "node": node, "slots": slots})
    try:
        assign = chan.recv(connect_timeout)
    except (TimeoutError, ChannelClosed) as exc:
        print(f"node {node}: no assignment from the coordinator: {exc}", file=sys.stderr)
        return 3
    if assign.get("op") != "assign" or not isinstance(assign.get("ranks"), list):
        print(f"node {node}: unexpected answer {assign.get('op')!r}", file=sys.stderr)
        return 3
    env = {str(k): str(v) for k, v in (assign.get("env") or {}).items()}
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    procs: list[tuple[Any, str, int, str]] = []
    for engine, rank, _device, logname, credential in assign["ranks"]:
        log_path = str(Path(log_dir) / str(logname))
        proc = ctx.Process(target=rank_entry, name=f"hkvsim-{engine}.{rank}",
                           args=(host, port, str(credential), str(engine), int(rank), log_path,
                                 env), daemon=True)
        proc.start()
        procs.append((proc, str(engine), int(rank), log_path))
    print(f"node {node}: started {len(procs)} rank(s): "
          + ", ".join(f"{e}.{r}" for _, e, r, _ in procs), file=sys.stderr, flush=True)
    reported: set[int] = set()
    done = False
    deadline = time.monotonic() + run_timeout
    status = 0
    while time.monotonic() < deadline:
        sentinels = [p.sentinel for p, *_ in procs if p.exitcode is None]
        readable, _, _ = select.select([chan.sock, *sentinels], [], [], 1.0)
        if chan.sock in readable:
            try:
                for msg in chan.poll(0.0):
                    if msg.get("op") == "done":
                        done = True
            except (ChannelClosed, ProtocolError):
                done = True
        for proc, engine, rank, log_path in procs:
            if proc.exitcode is not None and id(proc) not in reported:
                reported.add(id(proc))
                if proc.exitcode != 0:
                    status = 1
                    if not done:
                        try:
                            chan.send({"op": "died", "engine": engine, "rank": rank,
                                       "exitcode": proc.exitcode, "tail": _tail(log_path)})
                        except ChannelClosed:
                            pass
        if done or all(p.exitcode is not None for p, *_ in procs):
            break
    for proc, *_ in procs:
        proc.join(20.0)
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
    chan.close()
    return status


def node_main(host: str, port: int, token: str, node: int, slots: int, log_dir: str) -> None:
    """multiprocessing target: the coordinator's own node agent (node 0)."""
    sys.exit(run_node(host, port, token, node=node, slots=slots, log_dir=log_dir))
