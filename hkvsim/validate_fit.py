"""``hkvsim calibrate --host``: fit the host-path constants of a DRAM profile on a FIT set of
scenario files, then judge them on a held-out set and write the profile only if they pass.

The host-path model (hkvsim/fabric/profile.py, links.py) treats a node's CPU cores as a FIFO
pool that every rank process of the node competes for: a transfer holds one core for the rank's
dispatch, its post and its copy (and its rank's one thread); noticing its completion (on that
thread), the coordinator's work per call and per message (on its own thread) and, in a verified
run, the oracle's fill and check queue for a core too. Its constants:

* ``host_copy_cores``: the node's CPU cores (``os.cpu_count()``; measured, not fitted);
* ``coordinator_message_us``: one rank -> coordinator message: half the median round trip of
  a 64-byte ping-pong between two spawned processes over a local pipe (measured, not fitted);
* ``peer_poll_idle_us`` / ``peer_poll_busy_us``: how often a rank process calls into NIXL
  when idle / with transfers in flight (its loop's select timeouts in hkvsim/backends/rank.py;
  read from there, not fitted): a cma transfer completes only once the remote agent has
  progressed since the post, and a notification is seen at the receiver's next poll;
* ``poll_cpu_us``: the CPU of one idle iteration of a rank's loop that calls into NIXL: every
  rank's polling takes ``poll_cpu_us / (peer_poll_idle_us + poll_cpu_us)`` of the node's cores
  (measured in the FIT runs' loops, not fitted);
* ``oracle_core_gbps`` / ``oracle_op_us``: what one core fills or checks with the oracle, and
  its CPU per fill or check besides the bytes,
* ``rank_dispatch_us`` / ``rank_dispatch_unprepped_us``: a rank's CPU on a transfer before its
  post, from prepared lists / from raw descriptors (FIT files that merge), with
  ``rank_op_dispatch_us`` / ``rank_op_dispatch_unprepped_us``, its CPU per operation before
  the operation's first post, and
* ``coordinator_call_us``: the coordinator's CPU per call it sends a rank: all three measured
  in the FIT runs' own processes (CPU time per operation kind, :func:`measured_cpu`), not
  fitted;
* ``host_copy_core_gbps``: what one core copies, as whole scenarios see it (fitted);
* ``completion_notice_us``: a completed transfer noticed by the rank's poll loop (fitted);
* ``core_contention``: how much busy cores of a node slow each other's work (fitted).

Procedure (nothing here looks at the held-out files until the constants are fixed):

1. Load detection: the 1-minute load average is recorded; above one runnable task per core the
   fit is refused (a loaded machine measures the other load, not the copy path) unless
   ``force``, and the load stays in the report either way.
2. Every FIT and every held-out file runs ``repeats`` times on real NIXL in one series,
   interleaved across the files of both sets (:func:`hkvsim.validate.measure_real`: every pass
   runs each FIT file, then each held-out file), after ``warm_up`` passes that are left out, so
   both sets see the same hours of a drifting machine (run one set after the other, the held-out
   half of a calibration met a different machine: on this VM two sessions ten minutes apart
   differed by as much as the bound). Per FIT file the median of the runs' steady-state means
   is the target, their spread is reported; the held-out runs are not looked at until step 4.
3. Every FIT file is simulated at every point of a grid of (core contention, per-core rate,
   completion notice), with the measured constants;
   the point with the smallest root mean square of log(simulated / real) over the FIT files
   wins (least squares in log space: symmetric in over- and under-prediction). The mean
   |log| (an L1 fit) used before let one file go: on the 2026-12-04 calibration it chose a
   point 54 % off on one FIT file to bring the others within a few %, where the held-out bound
   judges the worst file too (the square's point: 31 % at worst in sample). Both moved far less
   between fits of this machine than the median-|error| criterion tried first, which jumped
   between 0.9 GB/s + 1 us and 3.6 GB/s + 2.3 ms.
4. The candidate profile (the shipped profile's sweep-fitted keys + the host constants)
   simulates the held-out files, set against their real runs from step 2; if the held-out
   median |error| exceeds :data:`ACCEPT_MEDIAN` or the worst exceeds :data:`ACCEPT_WORST`, no
   profile is written and the per-file errors say why.

:func:`replay_host` (``calibrate --host --replay FILE``) repeats steps 3 and 4 on the real runs
a calibration stored in its JSON, with the code as it is now: a change to the model is scored
against a machine's measurements without running anything real, and nothing is written.
"""

from __future__ import annotations

import itertools
import json
import math
import multiprocessing
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from .validate import (ACCEPT_MEDIAN, ACCEPT_WORST, FileResult, SimAgainstReal,
                       ValidationError, judge, measure_real, resampled_sentence,
                       resampled_verdict, shown_path, steady_transfer_mean, summary,
                       with_profile, within_bounds)

__all__ = ["HostFit", "LoadError", "GRID_GBPS", "GRID_NOTICE_US", "GRID_CONTENTION", "HOST_KEYS",
           "check_load",
           "dispatch_split", "fit_host", "host_block", "measure_coordinator_message",
           "measured_cpu", "oracle_cost", "rank_poll_periods_us", "replace_host_block",
           "calibrate_host", "ReplayedFile", "replay_host"]

#: Per-core copy rates tried (GB/s): geometric, 1 .. ~14.6 (x 1.25).
GRID_GBPS: tuple[float, ...] = tuple(round(1.25 ** k, 4) for k in range(0, 13))
#: Completion notices tried (us).
GRID_NOTICE_US: tuple[float, ...] = (1.0, 50.0, 100.0, 200.0, 300.0, 500.0, 700.0, 1000.0,
                                     1500.0)
#: Core contentions tried (``core_contention``: slowdown per other busy core of the node).
GRID_CONTENTION: tuple[float, ...] = (0.0, 0.25, 0.5)
#: The profile keys of the host-path block (what ``replace_host_block`` removes).
HOST_KEYS = ("host_copy_cores", "host_copy_core_gbps", "rank_dispatch_us", "rank_op_dispatch_us",
             "rank_op_dispatch_unprepped_us", "oracle_core_gbps",
             "oracle_op_us", "peer_poll_idle_us", "peer_poll_busy_us", "completion_notice_us",
             "coordinator_message_us", "coordinator_call_us", "rank_dispatch_unprepped_us",
             "poll_cpu_us", "core_contention")
_BLOCK_START = "# ---- host-path model (hkvsim calibrate --host"


class LoadError(RuntimeError):
    """The machine is too loaded to fit on (and ``force`` was not given)."""


@dataclass(frozen=True)
class HostFit:
    cores: int
    core_gbps: float
    completion_notice_us: float
    coordinator_message_us: float
    rank_dispatch_us: float = 0.0  # 0: not modelled
    oracle_core_gbps: float | None = None  # None: the oracle costs no simulated time
    peer_poll_idle_us: float = 0.0  # 0: completions do not wait for the remote's progress
    peer_poll_busy_us: float = 0.0
    coordinator_call_us: float = 0.0  # 0: the coordinator's CPU is not modelled
    rank_dispatch_unprepped_us: float = 0.0  # 0: rank_dispatch_us for every transfer
    oracle_op_us: float = 0.0  # the oracle's CPU per fill or check besides its bytes
    rank_op_dispatch_us: float = 0.0  # a rank's CPU per StartRead / StartWrite, before its posts
    rank_op_dispatch_unprepped_us: float = 0.0  # ... when it posts raw descriptors
    poll_cpu_us: float = 0.0  # a rank loop's CPU per idle NIXL poll (0: not modelled)
    core_contention: float = 0.0  # slowdown per other busy core of the node (0: none)
    rank_thread_order: str = "fifo"  # how a rank's thread orders its work (profile key)

    def overrides(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "host_copy_cores": self.cores, "host_copy_core_gbps": self.core_gbps,
            "completion_notice_us": self.completion_notice_us,
            "coordinator_message_us": self.coordinator_message_us}
        if self.rank_dispatch_us:
            out["rank_dispatch_us"] = self.rank_dispatch_us
        if self.oracle_core_gbps:
            out["oracle_core_gbps"] = self.oracle_core_gbps
            if self.oracle_op_us:
                out["oracle_op_us"] = self.oracle_op_us
        if self.peer_poll_idle_us:
            out["peer_poll_idle_us"] = self.peer_poll_idle_us
            out["peer_poll_busy_us"] = self.peer_poll_busy_us
            if self.poll_cpu_us:
                out["poll_cpu_us"] = self.poll_cpu_us
        if self.coordinator_call_us:
            out["coordinator_call_us"] = self.coordinator_call_us
        if self.rank_dispatch_unprepped_us:
            out["rank_dispatch_unprepped_us"] = self.rank_dispatch_unprepped_us
        if self.rank_op_dispatch_us:
            out["rank_op_dispatch_us"] = self.rank_op_dispatch_us
        if self.rank_op_dispatch_unprepped_us:
            out["rank_op_dispatch_unprepped_us"] = self.rank_op_dispatch_unprepped_us
        if self.core_contention:
            out["core_contention"] = self.core_contention
        if self.rank_thread_order != "fifo":
            out["rank_thread_order"] = self.rank_thread_order
        return out


def check_load(*, force: bool, cores: int | None = None,
               load: float | None = None) -> tuple[float, int]:
    """(1-minute load average, cores); LoadError when load > cores and not ``force``."""
    cores = cores or os.cpu_count() or 1
    load = os.getloadavg()[0] if load is None else load
    if load > cores and not force:
        raise LoadError(
            f"1-minute load average {load:.2f} > {cores} core(s): a fit on a loaded machine "
            "measures the other load, not the copy path; rerun when the machine is quiet, or "
            "pass --force to fit anyway (the load is recorded in the report)")
    return load, cores


# ---- coordinator message: a ping-pong between two processes -----------------------------------
def _echo(conn: Any, n: int) -> None:
    for _ in range(n):
        conn.send_bytes(conn.recv_bytes())
    conn.close()


def measure_coordinator_message(rounds: int = 200) -> float:
    """Half the median round trip (seconds) of a 64-byte message between two processes."""
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(there, rounds + 10), daemon=True)
    proc.start()
    payload = b"x" * 64
    rtts = []
    try:
        for i in range(rounds + 10):
            t0 = time.perf_counter()
            here.send_bytes(payload)
            if not here.poll(10.0):
                raise RuntimeError("coordinator-message probe: no echo within 10 s")
            here.recv_bytes()
            if i >= 10:  # the first ones warm up the child
                rtts.append(time.perf_counter() - t0)
    finally:
        proc.join(10.0)
        if proc.is_alive():
            proc.kill()
    return statistics.median(rtts) / 2


# ---- fit ---------------------------------------------------------------------------------------
def _sim(scenario: Any, profile: Path | None, overrides: dict[str, Any]) -> float:
    from .drivers.sim import run_scenario
    from .results import result_json

    data = result_json(run_scenario(with_profile(scenario, profile, overrides)), requests=True)
    t = steady_transfer_mean(data)
    if t is None or data["outcome"] != "ok":
        raise ValidationError(f"{scenario.scenario.name}: the simulated run did not complete "
                              f"its steady-state requests (outcome {data['outcome']})")
    return t


def fit_cost(sims: Sequence[float], real: Sequence[float]) -> float:
    """What the fit minimises over the FIT files: the root mean square of log(simulated /
    real) (module docstring, step 3)."""
    return math.sqrt(statistics.fmean(math.log(s / r) ** 2 for s, r in zip(sims, real)))


def fit_host(scenarios: Sequence[Any], real: Sequence[float], *, base: HostFit,
             profile: Path | None = None, grid: Sequence[float] = GRID_GBPS,
             notice_grid: Sequence[float] = GRID_NOTICE_US,
             dispatch_grid: Sequence[float] | None = None,
             contention_grid: Sequence[float] = GRID_CONTENTION) -> tuple[HostFit, list[float]]:
    """The (per-core rate, rank dispatch, completion notice, core contention) grid point that
    best predicts ``real`` (seconds, one per scenario) and the simulated times of the FIT files
    with it (module docstring, step 3); ties go to the point met first (grid order). ``base``
    holds the constants that are not fitted (its rate and notice are ignored); the dispatch is
    fitted only when ``dispatch_grid`` is given (the calibration measures it: ``base``'s)."""
    if len(scenarios) != len(real) or not scenarios:
        raise ValidationError("fit_host: need one real time per FIT scenario, at least one")
    best: tuple[float, HostFit, list[float]] | None = None
    points = itertools.product(contention_grid, grid, dispatch_grid or (base.rank_dispatch_us,),
                               notice_grid)
    for contention, gbps, dispatch, notice in points:
        trial = replace(base, core_gbps=gbps, completion_notice_us=notice,
                        rank_dispatch_us=dispatch, core_contention=contention)
        sims = [_sim(s, profile, trial.overrides()) for s in scenarios]
        cost = fit_cost(sims, real)
        if best is None or cost < best[0]:
            best = (cost, trial, sims)
    assert best is not None
    return best[1], best[2]


def rank_poll_periods_us() -> tuple[float, float]:
    """(idle, busy) period of a real rank's loop between NIXL polls, in us (backends/rank.py)."""
    from .backends import rank

    return round(rank._IDLE_POLL_S * 1e6, 3), round(rank._BUSY_POLL_S * 1e6, 3)


def _op_totals(rank_cpu: Any, names: tuple[str, ...]) -> tuple[int, float, int]:
    """(operations, CPU seconds, oracle bytes) of the operation kinds ``names`` in one
    ``rank_cpu`` record (pd/cpu.py)."""
    by_op = (rank_cpu or {}).get("by_op", {})
    rows = [by_op.get(k, [0, 0.0, 0]) for k in names]
    return sum(r[0] for r in rows), sum(r[1] for r in rows), sum(r[2] for r in rows)


def _per_item_and_unit(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(seconds per unit, seconds per item) from one point per file (items, units, CPU
    seconds): least squares of ``cpu = items * per_item + units * per_unit``. With one
    units-per-item ratio only (within 10 %), or a fit that would make per_item negative or
    per_unit not positive, everything is per unit: (CPU / units, 0)."""
    a = np.array(points, dtype=float)
    per_unit_only = (float(a[:, 2].sum() / a[:, 1].sum()), 0.0)
    ratio = a[:, 1] / np.maximum(a[:, 0], 1.0)
    if ratio.max() < 1.1 * ratio.min():
        return per_unit_only
    (per_item, per_unit), *_ = np.linalg.lstsq(a[:, :2], a[:, 2], rcond=None)
    if per_item < 0 or per_unit <= 0:
        return per_unit_only
    return float(per_unit), float(per_item)


def oracle_cost(results: Sequence[FileResult]) -> tuple[float | None, float]:
    """(GB/s per core, us per operation) of the oracle's fills and checks in ``results``' real
    ranks: each file with oracle work is one point (operations, bytes, CPU seconds), and
    ``cpu = ops * op_us + bytes / rate`` is fitted by least squares over the files. Measured on
    CPU loopback, a fill or check cost ~1.2 ms whatever its size plus ~10 GB/s: bytes alone
    made a 1 MB check of a hybrid model cost half of what it did and a 6 MB one twice. With
    one size per operation only, or a fit that would make either term negative, the cost is
    bytes alone (op_us = 0, rate = bytes / CPU). (None, 0.0) when no run ran the oracle."""
    points = []
    for r in results:
        n, cpu, nbytes = _op_totals(r.rank_cpu, ("OracleWrite", "Verify"))
        if n and nbytes and cpu > 0:
            points.append((n, nbytes, cpu))
    if not points:
        return None, 0.0
    per_byte, per_op = _per_item_and_unit(points)
    return round(1.0 / per_byte / 1e9, 4), round(per_op * 1e6, 1)


def dispatch_split(results: Sequence[FileResult]) -> tuple[float | None, float]:
    """(us per post, us per operation) of the ranks' CPU on StartRead / StartWrite besides
    their post calls, over ``results``: each file that posted is one point (operations, posts,
    CPU), fitted by least squares as ``ops * per_op + posts * per_post``. An operation that
    posts to k remote ranks plans them all before its first post: measured on CPU loopback,
    transfers from raw descriptors cost ~0.4 ms per operation plus ~0.4 ms per post, prepared
    ones ~0.25 ms per post and nothing per operation. With one posts-per-operation ratio only,
    or a fit that would make a term negative, everything is per post (per_op = 0). (None, 0.0)
    when nothing was posted."""
    points = []
    for r in results:
        if r.rank_cpu and r.rank_cpu.get("posts"):
            n, cpu, _ = _op_totals(r.rank_cpu, ("StartRead", "StartWrite"))
            points.append((n, int(r.rank_cpu["posts"]),
                           max(cpu - float(r.rank_cpu["post_cpu_seconds"]), 0.0)))
    if not points:
        return None, 0.0
    per_post, per_op = _per_item_and_unit(points)
    return round(per_post * 1e6, 1), round(per_op * 1e6, 1)


def measured_cpu(results: Sequence[FileResult],
                 unprepped: Sequence[bool] | None = None) -> dict[str, Any]:
    """What the real processes of ``results`` (FIT runs) spent, per core (pd/cpu.py):
    ``oracle_core_gbps`` (oracle bytes over the CPU of the fills and checks; None when no run
    ran the oracle), ``rank_dispatch_us`` (CPU of the StartRead / StartWrite operations less
    the CPU inside their post calls, per post) and ``coordinator_call_us`` (the coordinator
    process's CPU over the runs per call it sent a rank), ``poll_cpu_us`` / ``poll_busy_cpu_us``
    (a rank loop's CPU per iteration calling into NIXL, idle / with transfers in flight; 0.0
    when the runs' ranks reported none; only the first is modelled), with the totals they come
    from.
    ``unprepped`` (one flag per result): the file posts transfers made from raw descriptors
    (``descriptor_merge`` contiguous or strided), whose lists NIXL prepares on each call; with
    files of both kinds, ``rank_dispatch_us`` comes from the others and
    ``rank_dispatch_unprepped_us`` from these (else None)."""
    from .pd.cpu import merge_rank_cpu

    total = merge_rank_cpu([r.rank_cpu for r in results if r.rank_cpu])
    oracle_ops, oracle_cpu, oracle_b = _op_totals(total, ("OracleWrite", "Verify"))
    start_ops, start_cpu, _ = _op_totals(total, ("StartRead", "StartWrite"))
    posts = int(total["posts"])
    if posts == 0 or start_cpu <= 0:
        raise ValidationError("the FIT runs' ranks reported no post calls or no StartRead / "
                              "StartWrite CPU (a real backend that does not count them?); "
                              "allowed: FIT files run on hkvsim's NIXL backend")
    dispatch, op_dispatch = dispatch_split(results)
    flags = list(unprepped) if unprepped is not None else [False] * len(results)
    prepped = [r for r, raw in zip(results, flags) if not raw]
    raw_lists = [r for r, raw in zip(results, flags) if raw]
    dispatch_unprepped, op_dispatch_unprepped = None, 0.0
    if prepped and raw_lists:
        from_prepped = dispatch_split(prepped)
        if from_prepped[0] is not None:
            dispatch, op_dispatch = from_prepped
        dispatch_unprepped, op_dispatch_unprepped = dispatch_split(raw_lists)
    coordinator = total.get("coordinator") or {"calls": 0, "cpu_seconds": 0.0}
    calls = int(coordinator["calls"])
    oracle_gbps, oracle_op_us = oracle_cost(results)
    polls = total.get("polls") or {"idle": [0, 0.0], "busy": [0, 0.0]}
    return {"poll_cpu_us": _per_iteration_us(polls["idle"]),
            "poll_busy_cpu_us": _per_iteration_us(polls["busy"]),
            "poll_iterations": (int(polls["idle"][0]), int(polls["busy"][0])),
            "rank_dispatch_us": dispatch, "rank_dispatch_unprepped_us": dispatch_unprepped,
            "rank_op_dispatch_us": op_dispatch,
            "rank_op_dispatch_unprepped_us": op_dispatch_unprepped,
            "unprepped_files": len(raw_lists),
            "oracle_core_gbps": oracle_gbps, "oracle_op_us": oracle_op_us,
            "oracle_ops": oracle_ops,
            "coordinator_call_us": round(coordinator["cpu_seconds"] / calls * 1e6, 1)
            if calls else 0.0,
            "coordinator_calls": calls,
            "coordinator_cpu_seconds": float(coordinator["cpu_seconds"]),
            "oracle_bytes": oracle_b, "oracle_cpu_seconds": oracle_cpu,
            "start_ops": start_ops,
            "start_cpu_seconds": start_cpu, "posts": posts,
            "post_cpu_seconds": float(total["post_cpu_seconds"])}


def _per_iteration_us(entry: Sequence[float]) -> float:
    """CPU per loop iteration (us) of an ``[iterations, cpu_seconds]`` entry; 0.0 without any
    (a polling cost is modelled only where it was measured)."""
    n, cpu = int(entry[0]), float(entry[1])
    return round(cpu / n * 1e6, 1) if n and cpu > 0 else 0.0


# ---- the profile's host block ------------------------------------------------------------------
def _dispatch_lines(fit: HostFit) -> str:
    """The host block's dispatch and peer-poll lines (none for a constant not modelled)."""
    out = ""
    if fit.rank_dispatch_us:
        out += f"""# A rank's CPU work on a transfer before its post (the coordinator's order, descriptors, the
# NIXL request): measured in the FIT runs' rank processes (CPU of StartRead / StartWrite less
# the CPU inside their post calls, per post).
rank_dispatch_us = {fit.rank_dispatch_us}
"""
    if fit.rank_dispatch_unprepped_us:
        out += f"""# The same for a transfer made from raw descriptors (descriptor_merge contiguous / strided:
# NIXL prepares its lists on each call), measured on the FIT files that merge.
rank_dispatch_unprepped_us = {fit.rank_dispatch_unprepped_us}
"""
    if fit.rank_op_dispatch_us or fit.rank_op_dispatch_unprepped_us:
        out += """# A rank's CPU per operation (StartRead / StartWrite) before its first post, besides the
# per-post dispatch: least squares of each FIT file's CPU over its operations and posts.
"""
        if fit.rank_op_dispatch_us:
            out += f"rank_op_dispatch_us = {fit.rank_op_dispatch_us}\n"
        if fit.rank_op_dispatch_unprepped_us:
            out += f"rank_op_dispatch_unprepped_us = {fit.rank_op_dispatch_unprepped_us}\n"
    if fit.coordinator_call_us:
        out += f"""# The coordinator's CPU per call it sends a rank (on its one thread and a core), measured:
# the coordinator process's CPU over the FIT runs per call sent.
coordinator_call_us = {fit.coordinator_call_us}
"""
    if fit.peer_poll_idle_us:
        out += f"""# A rank calls into NIXL every peer_poll_busy_us with transfers in flight, every
# peer_poll_idle_us otherwise, and when a message wakes it (backends/rank.py): a transfer that
# carries a notification (every connector transfer) completes once the remote agent has
# progressed since the post; a notification is seen at the receiver's next poll.
peer_poll_idle_us = {fit.peer_poll_idle_us}
peer_poll_busy_us = {fit.peer_poll_busy_us}
"""
        if fit.poll_cpu_us:
            out += f"""# The CPU of one idle loop iteration (NIXL progress and notification checks), measured in
# the FIT runs' rank loops: every rank's polling takes poll_cpu_us / (peer_poll_idle_us +
# poll_cpu_us) of a core from its node's cores.
poll_cpu_us = {fit.poll_cpu_us}
"""
    return out.rstrip("\n")


def _oracle_lines(fit: HostFit) -> str:
    if not fit.oracle_core_gbps:
        return "# oracle_core_gbps: not measured (the FIT runs ran no oracle)"
    if not fit.oracle_op_us:
        return f"""# What one core fills or checks with the byte oracle (verified runs): measured in the FIT
# runs' rank processes (oracle bytes over the CPU of their fills and checks).
oracle_core_gbps = {fit.oracle_core_gbps}"""
    return f"""# The byte oracle's CPU (verified runs): a fill or check of n bytes costs oracle_op_us +
# n / oracle_core_gbps on one core, measured in the FIT runs' rank processes (least squares of
# each file's fill and check CPU over its operations and bytes).
oracle_core_gbps = {fit.oracle_core_gbps}
oracle_op_us = {fit.oracle_op_us}"""


def _contention_lines(fit: HostFit) -> str:
    if not fit.core_contention:
        return "# core_contention: none (the fit's grid point 0: busy cores do not slow each other)"
    return f"""# Busy cores slow each other (memory, caches, the hypervisor): CPU work that
# finds k of the node's cores busy runs 1 + core_contention * (k - 1) times as long; fitted
# with host_copy_core_gbps (above).
core_contention = {fit.core_contention}"""


def _thread_order_lines(fit: HostFit) -> str:
    if fit.rank_thread_order == "fifo":
        return "# A rank's one thread takes its work first come, first served."
    return ("# A rank's one thread works as the rank loop does (backends/rank.py): every message "
            "it\n# has read (a batch), then one NIXL poll that notices the completions.\n"
            f'rank_thread_order = "{fit.rank_thread_order}"')


def host_block(fit: HostFit, meta: dict[str, Any]) -> str:
    """The profile lines for the host constants, each with where it comes from."""
    return f"""
{_BLOCK_START}, {meta['when']}; do not edit by hand) ----
# Fitted on the FIT set {meta['fit_source']} ({meta['fit_files']} files x {meta['repeats']} real
# runs, interleaved, after {meta.get('warm_up', 0)} warm-up pass(es) left out; load average
# {meta['load_min']:.1f}-{meta['load_max']:.1f} on {fit.cores} core(s)
# during the fit{', started above the core count with --force' if meta['forced'] else ''}),
# judged on the held-out set {meta['held_out_source']}: median |error| {meta['held_out_median']}, worst
# {meta['held_out_worst']} (bounds {100 * ACCEPT_MEDIAN:.0f} % / {100 * ACCEPT_WORST:.0f} %). See reports/calibration/host-path.md.
# The copies of UCX cma run on the node's CPU cores, shared by all its ranks: os.cpu_count().
host_copy_cores = {fit.cores}
# A transfer holds one core (FIFO) for its dispatch, post and copy; noticing its completion, the
# message to the coordinator and (verified runs) the oracle's work queue for a core too.
{_thread_order_lines(fit)}
# What one core copies, as whole scenarios see it (a machine shared with other work sees less):
# with completion_notice_us, the grid point whose simulation of the FIT files has the smallest
# root mean square of log(simulated / real).
host_copy_core_gbps = {fit.core_gbps}
{_dispatch_lines(fit)}
# A completed transfer noticed by the rank's poll loop (it sleeps 0.1 ms busy / 1 ms idle
# between NIXL polls), plus scheduling: fitted with host_copy_core_gbps (above).
completion_notice_us = {fit.completion_notice_us}
{_contention_lines(fit)}
{_oracle_lines(fit)}
# The rank's completion message to the coordinator: half the median round trip of a 64-byte
# ping-pong between two spawned processes over a local pipe (200 rounds).
coordinator_message_us = {fit.coordinator_message_us}
"""


def replace_host_block(text: str, block: str | None) -> str:
    """``text`` (a profile) without its host block (and its host keys), plus ``block``."""
    cut = text.find("\n" + _BLOCK_START)
    if cut >= 0:
        text = text[:cut + 1]
    keys = "|".join(HOST_KEYS)
    text = re.sub(rf"(?m)^({keys})\s*=.*\n?", "", text).rstrip("\n") + "\n"
    return text + (block or "")


# ---- the whole step ----------------------------------------------------------------------------
def _load_files(files: Sequence[Path]) -> list[Any]:
    from .validate import _load

    return _load(files)


def _source(files: Sequence[Path]) -> str:
    """The files' common folder, relative to the working directory when inside it."""
    common = Path(os.path.commonpath([str(Path(f).resolve().parent) for f in files]))
    try:
        return str(common.relative_to(Path.cwd())) + "/"
    except ValueError:
        return str(common) + "/"


def _table(rows: list[tuple[str, float, FileResult]]) -> list[str]:
    out = ["| file | sim (ms) | real median (ms) | real runs (ms) | spread | error | max load |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for name, sim, r in rows:
        err = (sim - r.real_median) / r.real_median
        out.append(f"| `{name}` | {sim * 1e3:.3f} | {r.real_median * 1e3:.3f} | "
                   f"{', '.join(f'{t * 1e3:.3f}' for t in r.real_seconds)} | "
                   f"{100 * r.spread:.0f} % | {100 * err:+.0f} % | {max(r.loads):.1f} |")
    return out


def calibrate_host(fit_files: Sequence[Path], held_out_files: Sequence[Path], *,
                   profile_in: Path, profile_out: Path | None, report_dir: Path | None,
                   repeats: int = 3, force: bool = False, warm_up: int = 0,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Steps 1-4 of the module docstring. Returns a summary; ``profile_written`` is None when
    the held-out bounds were not met (``refused`` then says why, per file)."""
    say = progress or (lambda _t: None)
    load0, cores = check_load(force=force)
    overlap = {Path(f).resolve() for f in fit_files} & {Path(f).resolve() for f in held_out_files}
    if overlap:
        raise ValidationError(f"{len(overlap)} file(s) in both the FIT and the held-out set "
                              f"({', '.join(sorted(p.name for p in overlap))}); allowed: "
                              "disjoint sets")
    fit_scen = _load_files(fit_files)
    _load_files(held_out_files)  # bad held-out input fails before any real run
    say(f"load average {load0:.2f} on {cores} core(s)")
    coord_us = round(measure_coordinator_message() * 1e6, 1)
    say(f"coordinator message {coord_us} us")
    # the real runs of both sets in one interleaved series (every pass runs each FIT file,
    # then each held-out file), so both sets see the same hours of a drifting machine; nothing
    # of the held-out runs is looked at until the constants are fixed
    reals = measure_real([*fit_files, *held_out_files], repeats=repeats, progress=say,
                         warm_up=warm_up)
    fit_real = judge(fit_files, reals[:len(fit_files)], progress=say, profile=profile_in)
    cpu = measured_cpu(fit_real, [s.connector.descriptor_merge != "off" for s in fit_scen])
    say(f"measured in the FIT runs: dispatch {cpu['rank_dispatch_us']} us per post + "
        f"{cpu['rank_op_dispatch_us']} us per operation ({cpu['rank_dispatch_unprepped_us']} + "
        f"{cpu['rank_op_dispatch_unprepped_us']} us from raw descriptors), oracle "
        f"{cpu['oracle_core_gbps']} GB/s per core + {cpu['oracle_op_us']} us per operation, "
        f"coordinator {cpu['coordinator_call_us']} us per call, a rank loop's NIXL poll "
        f"{cpu['poll_cpu_us']} / {cpu['poll_busy_cpu_us']} us (idle / busy)")
    real = [r.real_median for r in fit_real]
    measured = HostFit(cores, GRID_GBPS[0], GRID_NOTICE_US[0], coord_us,
                       cpu["rank_dispatch_us"], cpu["oracle_core_gbps"], *rank_poll_periods_us(),
                       cpu["coordinator_call_us"], cpu["rank_dispatch_unprepped_us"] or 0.0,
                       cpu["oracle_op_us"], cpu["rank_op_dispatch_us"],
                       cpu["rank_op_dispatch_unprepped_us"], cpu["poll_cpu_us"],
                       rank_thread_order="loop-batches")  # as backends/rank.py's loop runs
    fit, fit_sims = fit_host(fit_scen, real, base=measured, profile=profile_in)
    say(f"fit: {fit}")
    loads = [x for r in fit_real for x in r.loads] + [load0]
    meta = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "fit_source": _source(fit_files), "held_out_source": _source(held_out_files),
            "fit_files": len(fit_files), "repeats": repeats, "warm_up": warm_up,
            "load_min": min(loads), "load_max": max(loads), "loaded": max(loads) > cores,
            "load_start": load0, "forced": load0 > cores,
            "held_out_median": "?", "held_out_worst": "?"}
    with tempfile.TemporaryDirectory() as tmp:
        trial = Path(tmp) / "candidate.toml"
        trial.write_text(replace_host_block(Path(profile_in).read_text(), host_block(fit, meta)))
        held = judge(held_out_files, reals[len(fit_files):], progress=say, profile=trial)
    s = summary(held)
    meta["held_out_median"] = f"{100 * s['median_abs_error']:.0f} %"
    meta["held_out_worst"] = f"{100 * s['worst_abs_error']:.0f} %"
    meta["load_max"] = max([meta["load_max"], *(x for r in held for x in r.loads)])
    accepted = bool(s["accepted"])
    refused = None if accepted else (
        f"held-out median |error| {100 * s['median_abs_error']:.0f} % (bound "
        f"{100 * ACCEPT_MEDIAN:.0f} %), worst {100 * s['worst_abs_error']:.0f} % (bound "
        f"{100 * ACCEPT_WORST:.0f} %): " + "; ".join(
            f"{Path(r.file).name} {100 * r.error:+.0f} %" for r in held))
    written = None
    if accepted and profile_out is not None:
        text = replace_host_block(Path(profile_in).read_text(), host_block(fit, meta))
        profile_out.write_text(text)
        from .fabric.profile import load_profile

        load_profile(profile_out)  # what we wrote must load
        written = shown_path(profile_out)  # relative in a committed report
    result = {"accepted": accepted, "refused": refused, "fit": asdict(fit), "measured_cpu": cpu,
              "profile_written": written, "meta": meta, "held_out_summary": s,
              # each FIT file's real runs and their processes' CPU (what the measured
              # constants come from): a replay (:func:`replay_host`) refits on these
              "fit_files": [{"file": r.file, "sim_seconds": sim, "real_seconds": r.real_seconds,
                             "real_median": r.real_median, "spread": r.spread,
                             "loads": r.loads, "rank_cpu": r.rank_cpu,
                             "error": (sim - r.real_median) / r.real_median}
                            for r, sim in zip(fit_real, fit_sims)],
              "held_out_files": [{**asdict(r), "real_median": r.real_median, "error": r.error,
                                  "spread": r.spread} for r in held]}
    if report_dir is not None:
        result["report"] = str(_write_report(report_dir, result, fit_real, fit_sims, held,
                                             cores))
    return result


def _write_report(directory: Path, result: dict[str, Any], fit_real: list[FileResult],
                  fit_sims: list[float], held: list[FileResult], cores: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    meta, fit, s = result["meta"], result["fit"], result["held_out_summary"]
    cpu = result["measured_cpu"]
    fit_errs = [abs(x["error"]) for x in result["fit_files"]]
    verdict = ("accepted: profile written" if result["accepted"] and result["profile_written"]
               else "accepted (no profile path given)" if result["accepted"]
               else "REFUSED: no profile written")
    lines = [
        "# Host-path calibration: the node's CPU cores and per-transfer CPU work (cpu-ucx-loopback)",
        "",
        f"Written by `hkvsim calibrate --host` ({meta['when']}; {cores} core(s)). Load average "
        f"{meta['load_min']:.1f}-{meta['load_max']:.1f} while it ran"
        + (" (sampled before each real run; the runs' own rank processes count too): above "
           "the core count, so the real times include waiting for a core." if meta["loaded"]
           else " (sampled before each real run).")
        + (f" The fit started at load {meta['load_start']:.2f} > {cores} core(s) and ran only "
           "because of --force." if meta["forced"] else ""),
        "",
        "| constant | value | how |", "|---|---:|---|",
        f"| host_copy_cores | {fit['cores']} | os.cpu_count() |",
        f"| host_copy_core_gbps | {fit['core_gbps']} | fitted on the FIT set (grid "
        f"{GRID_GBPS[0]}..{GRID_GBPS[-1]} GB/s, x1.25), with the notice: smallest root mean "
        "square of log(sim / real) |",
        f"| rank_thread_order | {fit['rank_thread_order']} | the rank loop's order "
        "(backends/rank.py): every message read, then one NIXL poll |",
        f"| rank_dispatch_us | {fit['rank_dispatch_us']} | measured in the FIT runs' ranks: CPU "
        "of StartRead / StartWrite less the CPU inside their post calls, per post, on the FIT "
        "files posting prepared lists (all FIT files together: "
        f"{cpu['start_ops']:,} operations, {1e3 * cpu['start_cpu_seconds']:.1f} ms, of which "
        f"{1e3 * cpu['post_cpu_seconds']:.1f} ms in {cpu['posts']:,} post calls) |",
        f"| rank_dispatch_unprepped_us | {fit['rank_dispatch_unprepped_us'] or '-'} | measured "
        f"the same way on the {cpu['unprepped_files']} FIT file(s) whose transfers are made from "
        "raw descriptors (descriptor_merge contiguous / strided); rank_dispatch_us from the "
        "others |",
        f"| rank_op_dispatch_us / rank_op_dispatch_unprepped_us | {fit['rank_op_dispatch_us']} / "
        f"{fit['rank_op_dispatch_unprepped_us']} | measured with the two above: least squares of "
        "each file's CPU over its operations and posts (an operation plans every transfer it "
        "posts before the first); 0 where the files cannot tell them apart |",
        f"| coordinator_call_us | {fit['coordinator_call_us']} | measured in the FIT runs: the "
        f"coordinator process's CPU ({1e3 * cpu['coordinator_cpu_seconds']:.1f} ms) over the "
        f"{cpu['coordinator_calls']:,} calls it sent |",
        f"| peer_poll_idle_us / peer_poll_busy_us | {fit['peer_poll_idle_us']:g} / "
        f"{fit['peer_poll_busy_us']:g} | the rank loop's NIXL poll periods (backends/rank.py) |",
        f"| poll_cpu_us | {fit['poll_cpu_us']:g} | measured in the FIT runs' rank loops: CPU "
        f"per idle iteration that calls into NIXL ({cpu['poll_iterations'][0]:,} idle "
        f"iterations; the {cpu['poll_iterations'][1]:,} with transfers in flight cost "
        f"{cpu['poll_busy_cpu_us']:g} us each: the completion notice, fitted; 0 = none "
        "measured, not modelled) |",
        f"| completion_notice_us | {fit['completion_notice_us']} | fitted, with the rate (grid "
        f"{', '.join(f'{n:g}' for n in GRID_NOTICE_US)} us) |",
        f"| core_contention | {fit.get('core_contention', 0.0):g} | fitted, with the rate (grid "
        f"{', '.join(f'{c:g}' for c in GRID_CONTENTION)}): work that finds k of the node's "
        "cores busy runs 1 + core_contention x (k - 1) times as long |",
        f"| oracle_core_gbps / oracle_op_us | {fit['oracle_core_gbps']} / "
        f"{fit['oracle_op_us']} | measured in the FIT runs' ranks: "
        f"{cpu['oracle_ops']:,} fills and checks of {cpu['oracle_bytes'] / 1e6:,.1f} MB in "
        f"{1e3 * cpu['oracle_cpu_seconds']:.1f} ms of CPU (least squares per file: CPU = "
        "operations x oracle_op_us + bytes / oracle_core_gbps) |",
        f"| coordinator_message_us | {fit['coordinator_message_us']} | measured: 64-byte pipe "
        "ping-pong / 2, median of 200 |",
        "",
        f"Each file ran {meta['repeats']} times on real NIXL in one series over both sets "
        "(every pass runs each FIT file, then each held-out file, so both sets met the same "
        f"machine), after {meta.get('warm_up', 0)} warm-up pass(es) over both sets whose runs "
        "are left out (the first runs after an idle spell are slow).",
        "",
        f"## FIT set ({meta['fit_source']}), in sample",
        "",
        *_table([(Path(r.file).name, sim, r) for r, sim in zip(fit_real, fit_sims)]),
        "",
        f"In-sample median |error| {100 * statistics.median(fit_errs):.0f} %, worst "
        f"{100 * max(fit_errs):.0f} %.",
        "",
        f"## Held-out set ({meta['held_out_source']}), never used for fitting",
        "",
        *_table([(Path(r.file).name, r.sim_seconds, r) for r in held]),
        "",
        f"Held-out median |error| {100 * s['median_abs_error']:.0f} %, worst "
        f"{100 * s['worst_abs_error']:.0f} % (bounds: median <= {100 * ACCEPT_MEDIAN:.0f} %, "
        f"worst <= {100 * ACCEPT_WORST:.0f} %): **{verdict}**."
        + (f" Why: {result['refused']}." if result["refused"] else "")
        + (f" {resampled_sentence(s.get('resampled'))}" if s.get("resampled") else ""),
    ]
    # a refused calibration does not replace the report of the accepted one that the shipped
    # profile cites
    stem = "host-path" if result["accepted"] else "host-path-refused"
    md = directory / f"{stem}.md"
    md.write_text("\n".join(lines) + "\n")
    (directory / f"{stem}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return md


# ---- replay: refit and judge on a calibration's stored real runs -------------------------------
@dataclass(frozen=True)
class ReplayedFile(SimAgainstReal):
    """One file of a replayed calibration: simulated now, real as stored."""

    file: str
    sim_seconds: float
    real_seconds: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        """The replay's row: the file, its simulated time now, its stored real median, the error."""
        return {"file": self.file, "sim_seconds": self.sim_seconds,
                "real_median": self.real_median, "error": self.error}


def _stored_files(record: Any, key: str) -> list[tuple[Path, tuple[float, ...]]]:
    """``record[key]`` (a calibration JSON's ``fit_files`` / ``held_out_files``) as (scenario
    file, real steady-state means); ValidationError naming what is wrong."""
    entries = record.get(key) if isinstance(record, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValidationError(f"replay: {key!r} missing or empty; allowed: the JSON that "
                              "`hkvsim calibrate --host` writes (host-path.json or "
                              "host-path-refused.json)")
    out = []
    for i, entry in enumerate(entries):
        try:
            path = Path(str(entry["file"]))
            real = tuple(float(x) for x in entry["real_seconds"])
        except (KeyError, TypeError, ValueError):
            raise ValidationError(f"replay: {key}[{i}] needs 'file' (a path) and 'real_seconds' "
                                  "(a list of seconds)") from None
        if not real or min(real) <= 0:
            raise ValidationError(f"replay: {key}[{i}] ({path}): real_seconds must hold at "
                                  "least one positive time")
        if not path.is_file():
            raise ValidationError(f"replay: {key}[{i}]: scenario file {path} not found (paths "
                                  "are relative to the directory the calibration ran in; run "
                                  "the replay from the repository root)")
        out.append((path, real))
    return out


def replay_host(record: Any, *, profile_in: Path, grid: Sequence[float] = GRID_GBPS,
                notice_grid: Sequence[float] = GRID_NOTICE_US,
                contention_grid: Sequence[float] = GRID_CONTENTION) -> dict[str, Any]:
    """Refit and judge a ``calibrate --host`` run on its stored real runs with the code as it
    is now (what a change to the host-path model would have scored on that machine), without
    running anything real. The measured constants are the record's (measured then); the
    per-core rate, the completion notice and the core contention are refitted on the FIT files'
    stored real medians (:func:`fit_host`), and the held-out files are simulated with the
    candidate and set against their stored runs. Nothing is written: the held-out runs of a
    record have been looked at before, so a replay explores a model change; only a fresh
    calibration may accept one."""
    if not isinstance(record, dict) or not isinstance(record.get("fit"), dict):
        raise ValidationError("replay: no 'fit' object; allowed: the JSON that `hkvsim "
                              "calibrate --host` writes")
    known = set(HostFit.__dataclass_fields__)
    unknown = sorted(set(record["fit"]) - known)
    if unknown:
        raise ValidationError(f"replay: unknown fit key(s) {', '.join(unknown)}; allowed: "
                              f"{', '.join(sorted(known))}")
    try:
        base = HostFit(**record["fit"])
    except TypeError as exc:
        raise ValidationError(f"replay: fit: {exc}") from None
    fit_stored = _stored_files(record, "fit_files")
    held_stored = _stored_files(record, "held_out_files")
    fit_scen = _load_files([p for p, _ in fit_stored])
    held_scen = _load_files([p for p, _ in held_stored])
    fit, fit_sims = fit_host(fit_scen, [float(statistics.median(r)) for _, r in fit_stored],
                             base=base, profile=profile_in, grid=grid, notice_grid=notice_grid,
                             contention_grid=contention_grid)
    meta = dict(record.get("meta") or {})
    meta.setdefault("when", "?")
    block_meta = {"fit_source": "?", "held_out_source": "?", "fit_files": len(fit_stored),
                  "repeats": "?", "load_min": 0.0, "load_max": 0.0, "forced": False,
                  **meta, "held_out_median": "?", "held_out_worst": "?"}
    with tempfile.TemporaryDirectory() as tmp:
        trial = Path(tmp) / "candidate.toml"
        trial.write_text(replace_host_block(Path(profile_in).read_text(),
                                            host_block(fit, block_meta)))
        held_sims = [_sim(s, trial, {}) for s in held_scen]
    fitted = [ReplayedFile(shown_path(p), s, r) for (p, r), s in zip(fit_stored, fit_sims)]
    held = [ReplayedFile(shown_path(p), s, r) for (p, r), s in zip(held_stored, held_sims)]
    errors = [abs(r.error) for r in held]
    median, worst = float(statistics.median(errors)), max(errors)
    return {"measured_at": meta["when"], "fit": asdict(fit),
            "stored_fit": asdict(base),
            "fit_files": [r.to_json() for r in fitted],
            "held_out_files": [r.to_json() for r in held],
            "held_out_median": median, "held_out_worst": worst,
            "within_bounds": bool(within_bounds(median, worst)),
            "resampled": resampled_verdict(held),  # type: ignore[arg-type]
            "profile_written": None}
