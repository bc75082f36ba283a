"""Run results as JSON (the machine-readable contract documented in README.md) and expectation checks."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .pd.records import RunResult

__all__ = ["NOT_VERIFIED", "PHASES", "clock", "coalesced_descriptors", "descriptor_counts",
           "expectation_problems", "phases", "posted_descriptors", "request_timing",
           "result_json", "summary_row", "transfer_span", "verification"]

#: The phases of one request's transfer time, reported apart by every command (plan, run,
#: sweep, report), in plotting order.
PHASES = ("handshake", "post wait", "post", "wire", "notification")

# the reason a run that moved no bytes (or did not check them) cannot meet byte_exact = true
NOT_VERIFIED = ("[expect] byte_exact = true, but no byte was verified (a timing-only run: "
                "--timing-only or [workload] verify = false); verify the bytes, or set [expect] "
                "byte_exact = false for a timing-only scenario")


def transfer_span(times: Mapping[str, float], telemetry: Sequence[Mapping[str, Any]]
                  ) -> float | None:
    """A request's own transfer time: from its first READ (pull) or WRITE (push) starting to
    post to its transfer completing on decode (every READ DONE; every WRITE notification in).

    Time spent before that, waiting for a slot, for blocks, for a handshake (push: prefill's
    reverse handshake) or behind another request's posts on the same rank, is not transfer
    time: with it, a request queued behind a longer one looks slower than the longer one. None
    for a request that completed no transfer (a full prefix hit only notifies)."""
    starts = [t["completed"] - t["transfer_seconds"] - t["post_seconds"] for t in telemetry
              if t.get("completed") is not None]
    if "transfer_done" not in times or not starts:
        return None
    return max(times["transfer_done"] - min(starts), 0.0)


def phases(times: Mapping[str, float], telemetry: Sequence[Mapping[str, Any]], mode: str
           ) -> dict[str, float]:
    """Seconds per phase of one request, along its critical (last-completing) transfer:
    *handshake* (the lazy handshakes this request ran: decode's with prefill in pull; in push
    decode's notification-only one and prefill's reverse one; first request of a pair only),
    *post wait* (queued behind the rank's posting thread), *post* (launch + coalesced
    descriptors x per-descriptor cost; on the host path, where cma copies inside the post call,
    the copy too), *wire* (bytes on the shared links + path latency; on the host path what
    follows the post call: the wait for the remote's progress and the completion notice) and
    *notification* (data complete -> the peer knows: prefill frees in pull, decode completes in
    push). The handshake is never part of :func:`transfer_span`; the notification is in push
    (decode completes on it) and after it in pull."""
    out = dict.fromkeys(PHASES, 0.0)
    out["handshake"] = float(times.get("handshake", 0.0))
    tel = [x for x in telemetry if x.get("completed") is not None]
    if not tel:
        return out
    crit = max(tel, key=lambda x: x["completed"])
    post_end = crit["completed"] - crit["transfer_seconds"]
    post_start = post_end - crit["post_seconds"]
    out["post wait"] = max(0.0, post_start - crit["submitted"])
    out["post"] = float(crit["post_seconds"])
    out["wire"] = float(crit["transfer_seconds"])
    end = times.get("prefill_freed") if mode == "pull" else times.get("transfer_done")
    if end is not None:
        out["notification"] = max(0.0, end - crit["completed"])
    return out


def request_timing(times: Mapping[str, float], telemetry: Sequence[Mapping[str, Any]],
                   mode: str) -> dict[str, Any]:
    """One request's transfer time as every command reports it: ``transfer_seconds``
    (:func:`transfer_span`, None when nothing was transferred) and its ``phases``
    (:func:`phases`, keys with underscores)."""
    return {"transfer_seconds": transfer_span(times, telemetry),
            "phases": {k.replace(" ", "_"): v for k, v in phases(times, telemetry, mode).items()}}


def posted_descriptors(telemetry: Sequence[Mapping[str, Any]]) -> int:
    """Descriptors a request handed to the backend (rows of its transfers, as posted)."""
    return sum(int(t["descriptors"]) for t in telemetry)


def coalesced_descriptors(telemetry: Sequence[Mapping[str, Any]]) -> int | None:
    """Descriptors the backend posted after NIXL's own coalescing (pairs adjacent on both
    sides merge); None when a transfer's backend did not report it (real NIXL without
    telemetry)."""
    counts = [t.get("coalesced") for t in telemetry]
    if any(c is None for c in counts):
        return None
    return sum(int(c) for c in counts)


def descriptor_counts(requests: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Totals of the three descriptor counts over ``requests`` (records as dicts): the per-block
    plan (``descriptors``), what was posted, what NIXL posted after coalescing (None if any
    request's is unknown), and the distribution of coalesced descriptors per request."""
    coalesced = [coalesced_descriptors(r["telemetry"]) for r in requests]
    known = None if any(c is None for c in coalesced) else [int(c) for c in coalesced]
    dist: dict[str, float] = {}
    if known:
        arr = np.asarray(known, dtype=np.float64)
        dist = {"min": float(arr.min()), "p50": float(np.percentile(arr, 50)),
                "p90": float(np.percentile(arr, 90)), "max": float(arr.max())}
    return {"descriptors": sum(int(r["descriptors"]) for r in requests),
            "descriptors_posted": sum(posted_descriptors(r["telemetry"]) for r in requests),
            "descriptors_coalesced": None if known is None else sum(known),
            "coalesced_per_request": dist}


def verification(result: RunResult) -> str:
    """What the oracle says about a run: ``verified`` (it checked every completed request, at
    least one, and found no wrong byte), ``failed`` (it found wrong bytes), ``nothing-checked``
    (it ran, but no request completed, so no byte reached it: a refused handshake, every request
    failed) or ``timing-only`` (it did not run)."""
    if not result.verified:
        return "timing-only"
    if result.mismatched_bytes:
        return "failed"
    if not any(r.status == "ok" for r in result.records):
        return "nothing-checked"
    return "verified"


def clock(result: RunResult) -> str:
    """Which clock the run's times are on: ``simulated`` (the simulator) or ``wall`` (a real
    backend)."""
    return "simulated" if result.backend == "sim" else "wall"


def expectation_problems(result: RunResult) -> list[str]:
    """Why the scenario's [expect] is not met; empty when it is."""
    expect = result.scenario.expect
    problems: list[str] = []
    if expect.byte_exact and not result.verified:
        problems.append(NOT_VERIFIED)
    outcome = result.outcome
    if outcome == "corruption" and not expect.byte_exact:
        outcome = result.outcome_besides_corruption
    expired = sum(r.freed_by_lease for r in result.records)
    if expect.lease_expiries is not None:
        if expired != expect.lease_expiries:
            problems.append(f"{expired} lease expiries, expected {expect.lease_expiries}")
        if outcome == "lease-expired":
            outcome = "ok"
    recomputed = sum(r.recovered_from is not None for r in result.records)
    if expect.aborted_requests is not None and result.aborted != expect.aborted_requests:
        problems.append(f"{result.aborted} aborted request(s), expected "
                        f"{expect.aborted_requests}")
    if expect.recomputed is not None and recomputed != expect.recomputed:
        problems.append(f"{recomputed} request(s) recomputed, expected {expect.recomputed}")
    if result.hung:
        problems.append(f"{result.hung} request(s) never reached a terminal state")
    if outcome != expect.outcome and not (outcome == "hang" and problems):
        problems.append(f"outcome is {outcome!r}, expected {expect.outcome!r}"
                        + _outcome_detail(result))
    if expect.byte_exact and result.corrupted:
        problems.append(f"{result.corrupted} request(s) reported successful with wrong bytes")
    if expect.byte_exact and result.late_landings:
        problems.append(f"{result.late_landings} transfer(s) landed in blocks their request no "
                        f"longer owned (late landings)")
    if expect.byte_exact and result.stray_writes:
        problems.append(f"{result.stray_writes} transfer(s) were posted into blocks their "
                        f"request does not hold (stray writes)")
    if expect.error_match is not None:
        pattern = re.compile(expect.error_match)
        messages = result.handshake_errors if expect.outcome == "handshake-error" else [
            f"{r.failure_class}: {r.reason}" for r in result.records if r.status == "failed"]
        if not messages:
            problems.append(f"no error to match /{expect.error_match}/")
        else:
            unmatched = [m for m in messages if not pattern.search(m)]
            if unmatched:
                problems.append(f"error does not match /{expect.error_match}/: {unmatched[0]}")
    if expect.failed_requests is not None and result.failed != expect.failed_requests:
        problems.append(f"{result.failed} failed request(s), expected {expect.failed_requests}")
    if expect.reason is not None:
        wrong = [r for r in result.records if r.status == "failed"
                 and expect.reason not in (r.failure_class or "")]
        if wrong:
            problems.append(f"request {wrong[0].index} failed with {wrong[0].failure_class!r}, "
                            f"expected {expect.reason!r}")
    if expect.outcome != "ok":
        leaks = {k: v for k, v in result.leaks.items() if v}
        if leaks:
            problems.append(f"leaks after the run: {leaks}")
    return problems


def _outcome_detail(result: RunResult) -> str:
    if result.handshake_errors:
        return f": {result.handshake_errors[0]}"
    failed = [r for r in result.records if r.status == "failed"]
    if failed:
        return f": request {failed[0].index} {failed[0].failure_class}: {failed[0].reason}"
    bad = [r for r in result.records if r.mismatches]
    if bad:
        return f": request {bad[0].index}: {bad[0].mismatches[0]}"
    expired = [r for r in result.records if r.freed_by_lease]
    if expired:
        return (f": prefill freed request {expired[0].index} by lease expiry, not by the expected "
                f"notifications")
    leaks = {k: v for k, v in result.leaks.items() if v}
    return f": leaks {leaks}" if leaks else ""


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values)
    return {"mean": float(arr.mean()), "p50": float(np.percentile(arr, 50)),
            "p99": float(np.percentile(arr, 99)), "max": float(arr.max())}


def result_json(result: RunResult, *, requests: bool = False,
                position: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """The JSON of one run. ``position``: (index, count) of the variant in its file's sweep
    (``(0, 1)`` without one), so shards of a sweep can be put back in order.

    Nothing unverified is reported as checked: without the oracle (``verified`` false),
    ``requests.byte_exact``, ``requests.mismatched_bytes`` and ``requests.corrupted`` are
    ``None``."""
    problems = expectation_problems(result)
    recs = result.records
    checked = result.verified
    spans = [transfer_span(r.times, r.telemetry) for r in recs if r.status == "ok"]
    mode = result.scenario.connector.mode
    done_phases = [phases(r.times, r.telemetry, mode) for r in recs
                   if r.status == "ok" and any(t.get("completed") is not None
                                               for t in r.telemetry)]
    counts = descriptor_counts([{"descriptors": r.descriptors, "telemetry": r.telemetry}
                                for r in recs if r.telemetry])
    transfer = [t for t in spans if t is not None]
    out: dict[str, Any] = {
        "scenario": result.scenario.scenario.name,
        "source": result.scenario.source,
        "sweep_point": result.scenario.sweep_point,
        "sweep_index": position[0],
        "sweep_variants": position[1],
        "backend": result.backend,
        "outcome": result.outcome,
        "verified": checked,
        "verification": verification(result),
        "expectation_met": not problems,
        "expectation_problems": problems,
        "warnings": list(result.warnings),
        "requests": {
            "total": len(recs),
            "completed": result.completed,
            "failed": result.failed,
            "aborted": result.aborted,
            "hung": result.hung,
            "byte_exact": sum(r.status == "ok" and r.mismatched_words == 0 for r in recs)
            if checked else None,
            "corrupted": result.corrupted if checked else None,
            "mismatched_bytes": result.mismatched_bytes if checked else None,
            "freed_by_lease": sum(r.freed_by_lease for r in recs),
            "recomputed": sum(r.recovered_from is not None for r in recs),
            "descriptors": sum(r.descriptors for r in recs),
            "descriptors_posted": counts["descriptors_posted"],
            "descriptors_coalesced": counts["descriptors_coalesced"],
            "coalesced_per_request": counts["coalesced_per_request"],
            "bytes": sum(r.nbytes for r in recs),
            "transfers": sum(r.transfers for r in recs),
        },
        "leaks": dict(result.leaks),
        "handshake_errors": list(result.handshake_errors),
        "failures": [{"request": r.index, "class": r.failure_class, "reason": r.reason}
                     for r in recs if r.status == "failed"],
        "recovered": [{"request": r.index, "recovered_from": r.recovered_from}
                      for r in recs if r.recovered_from is not None],
        "mismatches": [m for r in recs for m in r.mismatches][:16],
        "misplaced_writes": list(result.misplaced_write_reports),
        "counters": dict(result.counters),
        "time": {
            "clock": clock(result),
            "elapsed_seconds": result.sim_seconds,
            "max_seconds_to_terminal": max((r.times["done"] - r.arrival for r in recs
                                            if "done" in r.times), default=0.0),
            "transfer_seconds": _stats(transfer),
            "handshake_seconds": _stats([r.times["handshake"] for r in recs
                                         if "handshake" in r.times]),
            # along each completed request's critical transfer (results.phases)
            **{f"{k.replace(' ', '_')}_seconds": _stats([p[k] for p in done_phases])
               for k in PHASES[1:]},
        },
    }
    if result.implementation:  # absent for hkvsim's own core (keeps its outputs unchanged)
        out["implementation"] = dict(result.implementation)
    if result.rank_cpu:  # real backends: CPU per operation kind (hkvsim/pd/cpu.py)
        out["rank_cpu"] = dict(result.rank_cpu)
    if requests:
        out["request_details"] = [{**r.as_dict(), **request_timing(r.times, r.telemetry, mode)}
                                  for r in recs]
    return out


def summary_row(data: dict[str, Any]) -> dict[str, Any]:
    """The sweep table's row of one run's JSON (:func:`result_json`)."""
    req = data["requests"]
    return {
        "scenario": data["scenario"],
        "outcome": data["outcome"],
        "met": data["expectation_met"],
        "requests": f"{req['completed']}/{req['total']}",
        "verification": data["verification"],
        "corrupted": req["corrupted"],
        "mismatched_bytes": req["mismatched_bytes"],
        "descriptors": req["descriptors"],
        "coalesced": req.get("descriptors_coalesced"),
        "transfer_p50_ms": 1e3 * data["time"]["transfer_seconds"]["p50"]
        if data["time"]["transfer_seconds"] else None,
    }
