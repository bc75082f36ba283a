"""CPU a rank process spends, per kind of operation: what the host-path model of a DRAM profile
charges to a node's cores (hkvsim/fabric/links.py), measured where it is spent.

A real rank (hkvsim/backends/rank.py) adds up, per operation kind, how many it carried out, the
CPU seconds they took (``time.process_time``: this process's CPU, not the wall clock, so time
spent waiting for a core is not counted) and the bytes its oracle touched; and, separately, the
CPU spent inside the transport's post calls (which, on UCX cma, include the copy), and the
iterations of its loop that call into NIXL (progress, completions, notifications) with their CPU,
idle and with transfers in flight. From these,
``hkvsim calibrate --host`` reads what one core fills or checks with the oracle and what a rank
spends on a transfer before posting it, and what a rank's polling costs, instead of fitting
them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["OpCpu", "RankCpu", "LongOps", "oracle_bytes", "merge_rank_cpu", "blocked_warnings",
           "remote_hold_warnings"]


def oracle_bytes(layout: Any, blocks: Mapping[int, Any]) -> int:
    """Bytes of a rank's cache the oracle touches for ``blocks`` (group id -> logical block
    ids): every layer of each group, a whole page per block (an estimate of its work)."""
    total = 0
    for group in layout.groups:
        ids = blocks.get(group.group_id)
        if ids is None:
            continue
        page = (layout.attention_page_bytes * layout.physical_blocks_per_logical
                if group.kind == "attention" else layout.state_page_bytes)
        total += len(ids) * len(group.layers) * page
    return total


@dataclass
class OpCpu:
    """One operation kind on one rank: how many, CPU seconds, oracle bytes."""

    ops: int = 0
    cpu_seconds: float = 0.0
    oracle_bytes: int = 0


@dataclass
class RankCpu:
    """Everything one rank process adds up (module docstring)."""

    by_op: dict[str, OpCpu] = field(default_factory=dict)
    posts: int = 0  # transport post calls
    post_cpu_seconds: float = 0.0  # CPU inside them
    # loop iterations calling into NIXL, [iterations, CPU seconds], idle / with transfers in flight
    poll_idle: list[float] = field(default_factory=lambda: [0, 0.0])
    poll_busy: list[float] = field(default_factory=lambda: [0, 0.0])
    # rank operations started while a NIXL transfer of this rank was last seen in progress: the
    # loop polls NIXL only between them, so NIXL sees (and times) a completion that lands
    # meanwhile only afterwards. {op name: [count, wall seconds, longest wall seconds]}
    blocked: dict[str, list[float]] = field(default_factory=dict)

    def add_op(self, name: str, cpu_seconds: float, oracle: int = 0) -> None:
        entry = self.by_op.setdefault(name, OpCpu())
        entry.ops += 1
        entry.cpu_seconds += cpu_seconds
        entry.oracle_bytes += oracle

    def add_post(self, cpu_seconds: float) -> None:
        self.posts += 1
        self.post_cpu_seconds += cpu_seconds

    def add_poll(self, busy: bool, cpu_seconds: float) -> None:
        entry = self.poll_busy if busy else self.poll_idle
        entry[0] += 1
        entry[1] += cpu_seconds

    def add_blocked(self, name: str, wall_seconds: float) -> None:
        entry = self.blocked.setdefault(name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += wall_seconds
        entry[2] = max(entry[2], wall_seconds)

    def to_wire(self) -> dict[str, Any]:
        return {"by_op": {k: [v.ops, v.cpu_seconds, v.oracle_bytes]
                          for k, v in sorted(self.by_op.items())},
                "posts": self.posts, "post_cpu_seconds": self.post_cpu_seconds,
                "polls": {"idle": list(self.poll_idle), "busy": list(self.poll_busy)},
                "blocked": {k: list(v) for k, v in sorted(self.blocked.items())}}


def merge_rank_cpu(parts: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The sum of several :meth:`RankCpu.to_wire` dicts (ranks of a run, or runs), in the same
    form, with their ``coordinator`` entries ({"calls", "cpu_seconds"}: the coordinator's CPU
    over a run, added by the real driver) and ``polls`` entries summed too when present;
    malformed parts raise ValueError naming what was wrong."""
    by_op: dict[str, list[float]] = {}
    posts, post_cpu = 0, 0.0
    calls, coordinator_cpu, with_coordinator = 0, 0.0, False
    polls: dict[str, list[float]] | None = None
    blocked: dict[str, list[float]] | None = None
    for part in parts:
        try:
            if "coordinator" in part:
                with_coordinator = True
                calls += int(part["coordinator"]["calls"])
                coordinator_cpu += float(part["coordinator"]["cpu_seconds"])
            for name, (ops, cpu, nbytes) in part["by_op"].items():
                acc = by_op.setdefault(str(name), [0, 0.0, 0])
                acc[0] += int(ops)
                acc[1] += float(cpu)
                acc[2] += int(nbytes)
            posts += int(part["posts"])
            post_cpu += float(part["post_cpu_seconds"])
            if "polls" in part:
                polls = polls or {"idle": [0, 0.0], "busy": [0, 0.0]}
                for kind in ("idle", "busy"):
                    n, cpu = part["polls"][kind]
                    polls[kind][0] += int(n)
                    polls[kind][1] += float(cpu)
            if "blocked" in part:
                blocked = {} if blocked is None else blocked
                for name, (n, total, longest) in part["blocked"].items():
                    acc = blocked.setdefault(str(name), [0, 0.0, 0.0])
                    acc[0] += int(n)
                    acc[1] += float(total)
                    acc[2] = max(acc[2], float(longest))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"rank CPU record {part!r}: {exc}; allowed: {{'by_op': {{name: "
                             "[ops, cpu_seconds, oracle_bytes]}, 'posts': int, "
                             "'post_cpu_seconds': float, optional 'polls': {'idle': "
                             "[iterations, cpu_seconds], 'busy': [...]}, optional 'blocked': "
                             "{name: [count, wall_seconds, longest_seconds]}}") from None
    out: dict[str, Any] = {"by_op": {k: by_op[k] for k in sorted(by_op)}, "posts": posts,
                           "post_cpu_seconds": post_cpu}
    if polls is not None:
        out["polls"] = polls
    if blocked is not None:
        out["blocked"] = {k: blocked[k] for k in sorted(blocked)}
    if with_coordinator:
        out["coordinator"] = {"calls": calls, "cpu_seconds": coordinator_cpu}
    return out


BLOCKED_WARN_SECONDS = 0.05


def blocked_warnings(rank_cpu: Mapping[str, Any]) -> list[str]:
    """A warning per operation kind that held a rank's loop for :data:`BLOCKED_WARN_SECONDS` or
    more while one of its NIXL transfers was in progress: NIXL times a transfer from its post to
    the poll that sees it done, so such a transfer's time includes the wait (on the first H200
    run, oracle steps of 0.9-3 s did this). Rarer on UCX cma, where the copy finishes inside the
    post, but a transfer that carries a notification stays in progress there too until its remote
    next calls into NIXL (progress thread off)."""
    out = []
    for name, (count, total, longest) in sorted((rank_cpu.get("blocked") or {}).items()):
        if longest >= BLOCKED_WARN_SECONDS:
            out.append(f"ranks ran {name} {int(count)} time(s) while a NIXL transfer of theirs "
                       f"was in progress, for up to {longest:.3f} s ({total:.3f} s in all), "
                       f"without polling NIXL: a transfer that completed meanwhile is timed "
                       f"(wire) up to that much too long")
    return out


LONG_OP_SECONDS = 0.02  # a rank operation this long (wall) is kept in LongOps
LONG_OPS_KEPT = 4096  # per rank; later ones are counted, not kept


@dataclass
class LongOps:
    """The operations that held one rank's loop for :data:`LONG_OP_SECONDS` or more, each as
    ``[name, start, end]`` on the run's clock (the clock of NIXL telemetry's submitted and
    completed times): while one runs, the rank makes no NIXL call, and with NIXL's progress
    thread off a transfer that carries a notification completes only once its remote calls into
    NIXL (measured on UCX cma and on cuda_ipc: hkvsim.backends.progress_probe)."""

    ops: list[list[Any]] = field(default_factory=list)
    dropped: int = 0

    def add(self, name: str, start: float, end: float) -> None:
        if end - start < LONG_OP_SECONDS:
            return
        if len(self.ops) >= LONG_OPS_KEPT:
            self.dropped += 1
            return
        self.ops.append([name, start, end])

    def to_wire(self) -> dict[str, Any]:
        return {"ops": [list(op) for op in self.ops], "dropped": self.dropped}


def remote_hold_warnings(telemetry: Iterable[Mapping[str, Any]],
                         long_ops: Mapping[str, Mapping[str, Any]],
                         *, threshold: float = BLOCKED_WARN_SECONDS) -> list[str]:
    """One warning (or none) for transfers that waited on their remote rank: a transfer (a
    telemetry entry with ``peer``, ``submitted`` and ``completed``) that was in progress while
    its peer ran a long operation (``long_ops``: agent name -> :meth:`LongOps.to_wire`) and
    completed only after that operation ended, for ``threshold`` seconds or more of overlap.
    With NIXL's progress thread off that is what a notified transfer does (it cannot complete
    while its remote makes no NIXL call), so its wire time includes the wait; the caller asks
    only then. A transfer that completed *during* a remote operation shows it did not wait,
    and is not counted."""
    spans: dict[str, tuple[np.ndarray, np.ndarray, list[str]]] = {}
    for agent, entry in long_ops.items():
        ops = sorted(entry.get("ops") or [], key=lambda op: float(op[1]))
        spans[agent] = (np.array([float(op[1]) for op in ops]),
                        np.array([float(op[2]) for op in ops]), [str(op[0]) for op in ops])
    held_times: list[float] = []
    names: set[str] = set()
    total = 0
    for t in telemetry:
        peer, completed = t.get("peer"), t.get("completed")
        if peer is None or completed is None:
            continue
        total += 1
        if peer not in spans:
            continue
        starts, ends, op_names = spans[peer]
        submitted = float(t["submitted"])
        # a rank runs one operation at a time: starts and ends both ascend
        lo = int(np.searchsorted(ends, submitted, side="right"))
        hi = int(np.searchsorted(starts, completed, side="left"))
        held = 0.0
        for k in range(lo, hi):
            if ends[k] <= completed:  # outlasted by the transfer: it may have waited for it
                overlap = ends[k] - max(submitted, starts[k])
                if overlap >= threshold:
                    held += overlap
                    names.add(op_names[k])
        if held > 0.0:
            held_times.append(held)
    dropped = sum(int(entry.get("dropped") or 0) for entry in long_ops.values())
    unkept = ([f"{dropped} long rank operations past the first {LONG_OPS_KEPT} of a rank were "
               f"not kept: transfers they held are not counted"] if dropped else [])
    if not held_times:
        return unkept
    return unkept + [f"{len(held_times)} of {total} transfers were in progress while their remote rank "
            f"ran {', '.join(sorted(names))} for {threshold:g} s or more without calling into "
            f"NIXL, and completed only after it ended (up to {max(held_times):.3f} s of a "
            f"transfer, {sum(held_times):.3f} s in all): with NIXL's progress thread off a "
            f"transfer that carries a notification completes only once its remote calls into "
            f"NIXL, so their wire times include that wait (NIXL's progress thread on removes "
            f"it: hkvsim.lab --progress-thread; vLLM's connector runs with it on)"]
