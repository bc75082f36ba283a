"""Does a NIXL transfer need the *remote* process to call into NIXL before it completes?

``python -m hkvsim.backends.progress_probe [--memory DRAM|VRAM]`` starts two processes (a
target that owns a registered buffer, an initiator that posts READs and WRITEs against it; the
same agents and buffers as ``hkvsim calibrate``'s sweep) and times transfers while the target

- ``polls``: calls ``get_new_notifs`` every ``--target-poll-ms`` (default 2 ms, what the
  calibration sweep's target does);
- ``cpu-busy``: runs Python for ``--busy-ms`` without calling into NIXL (a rank filling or
  checking oracle bytes, an engine step);
- ``gpu-busy`` (VRAM only): copies pageable host memory to its GPU and synchronises, in a loop,
  for ``--busy-ms``, also without calling into NIXL,

with and without a notification attached to the transfer (a connector's transfers carry one:
the decode side's READ tells the prefill side its blocks may be freed), and with the initiator
either spinning on ``check_xfer_state`` or checking every 100 us as a rank loop does.

Each cell reports the median time from post to DONE and, for the busy modes, the median time
from the end of the target's busy spell to DONE (both processes read CLOCK_MONOTONIC). A cell
whose transfers complete only after the busy spell ends (``waits_for_target``) shows that the
transfer's completion needs the target's progress, which the simulator's ``cpu-ucx-loopback``
model charges on DRAM and which a GPU lab can check for cuda_ipc here. Output: one JSON object
(``--out FILE``) and a table on stdout. Bytes are not checked here: this probe times, the
scenario runs verify.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from .calibrate import (_agent, _Memory, _recv, _redirect, _send, log_transports, run_pair,
                        serve_initiator)

__all__ = ["run_probe", "main", "TARGET_MODES"]

TARGET_MODES = ("polls", "cpu-busy", "gpu-busy")
INITIATOR_MODES = ("spin", "check-100us")


def _target_busy(kind: str, seconds: float, memory: _Memory) -> None:
    end = time.monotonic() + seconds
    if kind == "cpu-busy":
        x = 0
        while time.monotonic() < end:
            x += 1
        return
    import torch

    host = torch.empty(16 << 20, dtype=torch.uint8)  # pageable, as the oracle's host shadow
    while time.monotonic() < end:
        memory.tensor[: host.numel()].copy_(host)
        torch.cuda.synchronize(memory.device)


def _target_main(peer: Any, log_path: str, nbytes: int, mem_type: str, poll_s: float,
                 progress_thread: bool) -> None:
    _redirect(log_path)
    memory = _Memory(nbytes, mem_type)
    agent = _agent("probe-target", progress_thread=progress_thread)
    reg = memory.register(agent)
    _send(peer, {"md": agent.get_agent_metadata(), "addr": memory.addr})
    deadline = time.monotonic() + 600.0
    while time.monotonic() < deadline:
        agent.get_new_notifs()  # progress; the notifications themselves are not needed
        if not peer.poll(poll_s):
            continue
        msg = _recv(peer, 1.0)
        op = msg.get("op")
        if op == "md":
            agent.add_remote_agent(msg["md"])
            _send(peer, {"op": "ok"})
        elif op == "busy":
            _send(peer, {"op": "ok"})
            started = time.monotonic()
            _target_busy(msg["kind"], msg["seconds"], memory)
            _send(peer, {"op": "busy-done", "started": started, "ended": time.monotonic()})
        elif op == "stop":
            break
    agent.deregister_memory(reg)


def _initiator_main(peer: Any, parent: Any, log_path: str, nbytes: int, plan: dict[str, Any]
                    ) -> None:
    serve_initiator(peer, parent, log_path, lambda: _initiate(peer, nbytes, plan))


def _initiate(peer: Any, nbytes: int, plan: dict[str, Any]) -> dict[str, Any]:
    mem_type = plan["memory"]
    memory = _Memory(nbytes, mem_type)
    agent = _agent("probe-initiator", progress_thread=plan["progress_thread"])
    reg = memory.register(agent)
    hello = _recv(peer, 120.0)
    name = agent.add_remote_agent(hello["md"])
    name = name.decode() if isinstance(name, bytes) else name
    _send(peer, {"op": "md", "md": agent.get_agent_metadata()})
    _recv(peer, 30.0)
    size, count = plan["size"], plan["count"]
    offs = np.arange(count, dtype=np.uint64) * np.uint64(2 * size)  # never adjacent
    dev = np.full(count, memory.device, np.uint64)
    sizes = np.full(count, size, np.uint64)
    local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", agent.get_xfer_descs(
        np.stack([np.uint64(memory.addr) + offs, sizes, dev], axis=1), mem_type))
    remote = agent.prep_xfer_dlist(name, agent.get_xfer_descs(
        np.stack([np.uint64(hello["addr"]) + offs, sizes, dev], axis=1), mem_type))
    ids = np.arange(count, dtype=np.int64)

    def once(op: str, notif: bytes, initiator: str) -> tuple[float, float]:
        x = agent.make_prepped_xfer(op, local, ids, remote, ids, notif)
        w0 = time.monotonic()
        state = agent.transfer(x)
        while state == "PROC":
            if initiator == "check-100us":
                time.sleep(0.0001)
            state = agent.check_xfer_state(x)
        done = time.monotonic()
        if state != "DONE":
            raise RuntimeError(f"{op} ended in {state}")
        agent.release_xfer_handle(x)
        return w0, done

    cells = []
    for target in plan["targets"]:
        for notif in (b"", b"probe"):
            for op in ("READ", "WRITE"):
                for initiator in INITIATOR_MODES:
                    if target != "polls" and initiator != "spin":
                        continue  # the busy spells ask one question: does DONE wait for them
                    once(op, notif, initiator)  # warm-up
                    reps = plan["reps"] if target == "polls" else plan["busy_reps"]
                    took, after = [], []
                    for _ in range(reps):
                        if target == "polls":
                            w0, done = once(op, notif, initiator)
                            took.append(done - w0)
                            continue
                        _send(peer, {"op": "busy", "kind": target,
                                     "seconds": plan["busy_seconds"]})
                        _recv(peer, 30.0)
                        w0, done = once(op, notif, initiator)
                        spell = _recv(peer, 30.0 + plan["busy_seconds"])
                        took.append(done - w0)
                        after.append(done - spell["ended"])
                    cell = {"target": target, "notification": bool(notif), "op": op,
                            "initiator": initiator, "reps": reps,
                            "post_to_done_ms": statistics.median(took) * 1e3,
                            "max_ms": max(took) * 1e3}
                    if after:
                        cell["busy_end_to_done_ms"] = statistics.median(after) * 1e3
                        # completed after the spell ended in most repetitions: it waited
                        cell["waits_for_target"] = sum(a > 0 for a in after) > reps // 2
                    cells.append(cell)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(remote)
    agent.remove_remote_agent(name)
    agent.deregister_memory(reg)
    return {"cells": cells}


def run_probe(*, memory: str = "DRAM", size: int = 1 << 20, count: int = 64, reps: int = 20,
              busy_reps: int = 5, busy_ms: float = 100.0, targets: tuple[str, ...] | None = None,
              target_poll_ms: float = 2.0, progress_thread: bool = False,
              log_dir: str | None = None, timeout: float = 300.0) -> dict[str, Any]:
    """Run the probe in two spawned processes; returns ``{"cells": [...], ...}``."""
    if memory not in ("DRAM", "VRAM"):
        raise ValueError(f"memory must be DRAM or VRAM, got {memory!r}")
    if targets is None:
        targets = TARGET_MODES if memory == "VRAM" else TARGET_MODES[:2]
    bad = [t for t in targets if t not in TARGET_MODES]
    if bad or ("gpu-busy" in targets and memory != "VRAM"):
        raise ValueError(f"target modes {list(targets)}: allowed {list(TARGET_MODES)}, "
                         f"gpu-busy with VRAM only")
    if min(size, count, reps, busy_reps, busy_ms, target_poll_ms) <= 0:
        raise ValueError("size, count, reps, busy_reps, busy_ms and target_poll_ms must be "
                         "positive")
    import tempfile

    nbytes = 2 * size * count
    logs = Path(log_dir or tempfile.mkdtemp(prefix="hkvsim-probe-"))
    logs.mkdir(parents=True, exist_ok=True)
    plan = {"memory": memory, "size": size, "count": count, "reps": reps,
            "busy_reps": busy_reps, "busy_seconds": busy_ms / 1e3, "targets": list(targets),
            "target_poll_seconds": target_poll_ms / 1e3, "progress_thread": progress_thread}
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    parent_end, child_end = ctx.Pipe(duplex=False)
    target = ctx.Process(target=_target_main, args=(b, str(logs / "target.log"), nbytes, memory,
                                                         target_poll_ms / 1e3, progress_thread),
                         daemon=True)
    initiator = ctx.Process(target=_initiator_main,
                            args=(a, child_end, str(logs / "initiator.log"), nbytes, plan),
                            daemon=True)
    result = run_pair(target, initiator, parent_end, logs, timeout=timeout,
                      what="progress probe", max_bytes=1 << 24)
    return {**plan, "transports": log_transports(logs), "cells": result["cells"]}


def table(result: dict[str, Any]) -> str:
    """The probe's result as a markdown table, with a line saying what was measured."""
    thread = "on" if result.get("progress_thread") else "off"
    rows = [f"progress probe: {result['memory']}, {result['count']} x {result['size']:,} B "
            f"descriptors (never adjacent), target polls every "
            f"{result['target_poll_seconds'] * 1e3:g} ms, busy spells of "
            f"{result['busy_seconds'] * 1e3:.0f} ms; NIXL progress thread {thread}; UCX: "
            f"{', '.join(result['transports'])}",
            "", "| target | notification | op | initiator | post to DONE (median) | "
            "busy end to DONE | waits for target |", "|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        after = c.get("busy_end_to_done_ms")
        waits = c.get("waits_for_target")
        rows.append(f"| {c['target']} | {'yes' if c['notification'] else 'no'} | {c['op']} | "
                    f"{c['initiator']} | {c['post_to_done_ms']:.3f} ms | "
                    f"{'' if after is None else f'{after:+.3f} ms'} | "
                    f"{'' if waits is None else ('yes' if waits else 'no')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hkvsim.backends.progress_probe",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--memory", choices=["DRAM", "VRAM"], default="DRAM")
    p.add_argument("--size", type=int, default=1 << 20, help="bytes per descriptor")
    p.add_argument("--count", type=int, default=64, help="descriptors per transfer")
    p.add_argument("--reps", type=int, default=20, help="repetitions per polling cell")
    p.add_argument("--busy-reps", type=int, default=5, help="repetitions per busy cell")
    p.add_argument("--busy-ms", type=float, default=100.0, help="the target's busy spell")
    p.add_argument("--target-poll-ms", type=float, default=2.0,
                   help="the target's poll period between busy spells")
    p.add_argument("--progress-thread", action="store_true",
                   help="NIXL's progress thread on in both processes (default off, as hkvsim's "
                        "ranks run)")
    p.add_argument("--targets", nargs="+", choices=TARGET_MODES, default=None)
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--log-dir", help="keep the two processes' logs here")
    args = p.parse_args(argv)
    try:
        result = run_probe(memory=args.memory, size=args.size, count=args.count, reps=args.reps,
                           busy_reps=args.busy_reps, busy_ms=args.busy_ms,
                           targets=tuple(args.targets) if args.targets else None,
                           target_poll_ms=args.target_poll_ms,
                           progress_thread=args.progress_thread, log_dir=args.log_dir)
    except (ValueError, RuntimeError) as exc:
        print(f"progress probe: {exc}", file=sys.stderr)
        return 1
    print(table(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
