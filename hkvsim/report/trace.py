"""Chrome / Perfetto trace export (the JSON ``traceEvents`` format; open it in ui.perfetto.dev or
chrome://tracing).

Layout: one process per scenario variant (its simulated clock starts at 0), and in it

* thread "requests": one async slice per request (arrival -> done) with its handshake and its
  transfer window nested inside;
* one thread per initiating GPU endpoint ("n1g3 posting"): the posting intervals, which never
  overlap because a rank posts serially (the cost model of hkvsim.fabric);
* one async slice per transfer (submitted -> data complete; its args give the post wait, post
  and wire times);
* counter tracks per link: the aggregate rate in GB/s (from ``RunResult.link_segments``).

Timestamps are microseconds of the variant's clock: simulated for the simulator (the file is
then a pure function of the run), wall-clock for a saved real-backend run.
"""

from __future__ import annotations

from typing import Any

from .data import Variant

__all__ = ["trace_events", "trace_document"]

_US = 1e6


def _ts(seconds: float) -> float:
    """Simulated seconds -> trace microseconds, to the nanosecond (keeps the file small)."""
    return round(seconds * _US, 3)


def _initiator(variant: Variant, tel: dict[str, Any]) -> str:
    """The endpoint that posted a transfer: decode reads (pull), prefill writes (push)."""
    path = tel.get("path") or []
    if not path:
        return "?"
    if len(path) == 1:  # same-GPU copy: "<ep>.hbm"
        return path[0].split(".")[0]
    src, dst = path[0].split(".")[0], path[-1].split(".")[0]
    return dst if variant.mode == "pull" else src


def _async(name: str, cat: str, ident: str, pid: int, start: float, end: float,
           args: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    begin = {"name": name, "cat": cat, "ph": "b", "id": ident, "pid": pid, "tid": 0,
             "ts": _ts(start)}
    if args:
        begin["args"] = args
    return [begin, {"name": name, "cat": cat, "ph": "e", "id": ident, "pid": pid, "tid": 0,
                    "ts": _ts(end)}]


def _variant_events(pid: int, variant: Variant) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": variant.name}},
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
         "args": {"sort_index": pid}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "requests"}},
    ]
    threads: dict[str, int] = {}
    op = "READ" if variant.mode == "pull" else "WRITE"
    for req in variant.requests:
        t = req["times"]
        i = req["index"]
        start = t.get("start", req.get("arrival", 0.0))
        end = t.get("done", t.get("transfer_done", start))
        rid = f"{pid}.r{i}"
        events += _async(f"request {i} ({req['prompt_tokens']} tokens)", "request", rid, pid,
                         start, end, {"status": req["status"], "descriptors": req["descriptors"],
                                      "bytes": req["nbytes"], "transfers": req["transfers"],
                                      "failure": req.get("failure_class")})
        hs = t.get("handshake")
        if hs and "transfer_start" in t:
            hs_start = t["transfer_start"] - hs if variant.mode == "pull" else t["transfer_start"]
            events += _async("handshake", "request", rid, pid, hs_start, hs_start + hs)
        if "transfer_start" in t and "transfer_done" in t:
            events += _async("transfer window", "request", rid, pid, t["transfer_start"],
                             t["transfer_done"])
        for k, tel in enumerate(req["telemetry"]):
            if tel.get("completed") is None:
                continue
            ep = _initiator(variant, tel)
            tid = threads.setdefault(ep, len(threads) + 1)
            post_end = tel["completed"] - tel["transfer_seconds"]
            post_start = post_end - tel["post_seconds"]
            path = "->".join(p.split(".")[0] for p in (tel.get("path") or [])[:1] +
                             (tel.get("path") or [])[-1:])
            name = f"{op} req {i} {path}"
            args = {"request": i, "descriptors": tel["descriptors"], "bytes": tel["nbytes"],
                    "post_wait_us": _ts(post_start - tel["submitted"]),
                    "post_us": _ts(tel["post_seconds"]), "wire_us": _ts(tel["transfer_seconds"]),
                    "path": list(tel.get("path") or [])}
            events.append({"name": name, "cat": "post", "ph": "X", "pid": pid, "tid": tid,
                           "ts": _ts(post_start), "dur": _ts(tel["post_seconds"])})
            events += _async(name, "transfer", f"{pid}.x{i}.{k}", pid, tel["submitted"],
                             tel["completed"], args)
    for ep, tid in threads.items():
        events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                       "args": {"name": f"{ep} posting"}})
    last_end: dict[str, float] = {}
    for seg in sorted(variant.link_segments, key=lambda s: (s["link"], s["t_start"])):
        link = seg["link"]
        if link in last_end and last_end[link] < seg["t_start"]:
            events.append({"name": link, "ph": "C", "pid": pid, "tid": 0,
                           "ts": _ts(last_end[link]), "args": {"GB/s": 0.0}})
        events.append({"name": link, "ph": "C", "pid": pid, "tid": 0, "ts": _ts(seg["t_start"]),
                       "args": {"GB/s": round(seg["rate"] / 1e9, 6)}})
        last_end[link] = seg["t_end"]
    for link, end in last_end.items():
        events.append({"name": link, "ph": "C", "pid": pid, "tid": 0, "ts": _ts(end),
                       "args": {"GB/s": 0.0}})
    return events


def trace_events(variants: list[Variant]) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for pid, v in enumerate(variants, start=1):
        events += _variant_events(pid, v)
    return events


def trace_document(variants: list[Variant]) -> dict[str, Any]:
    clocks = sorted({v.clock for v in variants})
    clock = ("simulated seconds x 1e6" if clocks == ["simulated"] else
             "seconds x 1e6 of each variant's own clock (simulated on the simulator, wall on a "
             "real backend)")
    return {"traceEvents": trace_events(variants), "displayTimeUnit": "ms",
            "otherData": {"generator": "hkvsim report", "clock": clock}}
