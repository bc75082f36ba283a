"""Scaling curves of the simulator (issue #14): CPU seconds and peak memory of timing-only runs
as requests, prompt length, decode TP, requests in flight and num_blocks grow, plus the cost of
one simulated event next to a plain simpy loop in the same process.

    .venv/bin/python benchmarks/curves.py [--out reports/performance] [--baseline DIR] [--smoke]

Every run is a child process (CPU time and VmHWM are its own). ``--baseline DIR`` runs each
point a second time with ``PYTHONPATH=DIR`` (another checkout of hkvsim, e.g. main), alternating
with this one, so that ratios are measured side by side under the same load. ``--smoke`` runs
tiny sizes only (CI: the script and its children still work). CPU seconds, not wall seconds:
the machine is shared, and CPU time is what a run costs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_simulation import workload  # noqa: E402

_CHILD = textwrap.dedent("""
    import json, sys, time
    t0 = time.process_time()
    from hkvsim.cluster import SimDriver
    from hkvsim.scenario import parse_scenarios

    def peak():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        return 0

    (s,) = parse_scenarios(sys.stdin.read())
    t1 = time.process_time()
    driver = SimDriver(s, timing_only=True)
    t2 = time.process_time()
    ev = {"n": 0}
    step = driver.env.step
    def counted():
        ev["n"] += 1
        step()
    driver.env.step = counted
    result = driver.run()
    t3 = time.process_time()
    print(json.dumps({"setup_cpu": t2 - t1, "run_cpu": t3 - t2, "events": ev["n"],
                      "outcome": result.outcome, "completed": result.completed,
                      "sim_seconds": result.sim_seconds, "peak_bytes": peak()}))
""")

_SIMPY_LOOP = textwrap.dedent("""
    import json, time, simpy
    env = simpy.Environment()
    N = int(__import__("sys").argv[1])
    def proc(env, k):
        for _ in range(N // 100):
            yield env.timeout(1.0 + k * 1e-3)
    for k in range(100):
        env.process(proc(env, k))
    n = 0
    t0 = time.process_time()
    while env.peek() != float("inf"):
        env.step()
        n += 1
    print(json.dumps({"events": n, "cpu": time.process_time() - t0}))
""")


def run_child(text: str, pythonpath: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    out = subprocess.run([sys.executable, "-c", _CHILD], input=text, capture_output=True,
                         text=True, check=True, timeout=1800, env=env, cwd="/")
    data = json.loads(out.stdout.strip().splitlines()[-1])
    if data["outcome"] != "ok":
        raise RuntimeError(f"run did not succeed: {data}")
    return data


def simpy_loop(events: int) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", _SIMPY_LOOP, str(events)], capture_output=True,
                         text=True, check=True, timeout=600)
    return json.loads(out.stdout)


def points(smoke: bool) -> list[tuple[str, str, int, dict[str, Any], bool]]:
    """(axis, label, requests, workload kwargs, also run the baseline)."""
    if smoke:
        return [("requests", "200", 200, dict(requests=200), True),
                ("in flight", "16", 200, dict(requests=200, rate=None, max_inflight=16), False),
                ("num_blocks", "4,096", 20, dict(requests=20, prompt="8192", num_blocks=4096),
                 False)]
    pts: list[tuple[str, str, int, dict[str, Any], bool]] = []
    for n in (1_000, 10_000):
        pts.append(("requests", f"{n:,}", n, dict(requests=n), True))
    for k in (16, 64, 256, 1024):
        pts.append(("in flight", f"{k:,}", 2_000, dict(requests=2_000, rate=None,
                                                       max_inflight=k, prompt="4096"), True))
    for b in (4_096, 16_384, 65_536, 131_072):
        pts.append(("num_blocks", f"{b:,}", 200, dict(requests=200, prompt="8192",
                                                      num_blocks=b), b <= 16_384))
    for p in (1024, 8192, 32768):
        pts.append(("prompt tokens", f"{p:,}", 1_000, dict(requests=1_000, prompt=str(p),
                                                           rate=100.0), False))
    for tp in (1, 2, 8):
        pts.append(("decode TP", str(tp), 1_000, dict(requests=1_000, d_tp=tp, prompt="8192",
                                                      rate=100.0), False))
    pts.append(("requests", "100,000", 100_000, dict(requests=100_000), False))  # last: longest
    return pts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write curves.json there")
    ap.add_argument("--baseline", default=None, metavar="DIR",
                    help="another hkvsim checkout to run side by side (PYTHONPATH=DIR)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CI)")
    ap.add_argument("--only", default=None, help="run only the points of this axis")
    ap.add_argument("--render", default=None, metavar="DIR",
                    help="only write DIR/curves.md from DIR/curves.json")
    args = ap.parse_args()
    if args.render:
        render(Path(args.render))
        return 0
    rows = []
    for axis, label, n, kw, with_baseline in points(args.smoke):
        if args.only and axis != args.only:
            continue
        text = workload(**kw)
        row: dict[str, Any] = {"axis": axis, "point": label, "requests": n}
        row["this"] = run_child(text, None)
        if args.baseline and with_baseline:
            row["baseline"] = run_child(text, args.baseline)
            if row["baseline"]["sim_seconds"] != row["this"]["sim_seconds"]:
                rel = abs(row["baseline"]["sim_seconds"] / row["this"]["sim_seconds"] - 1)
                row["sim_seconds_rel_diff"] = rel
        this = row["this"]
        line = (f"{axis:>13} {label:>8}: {this['run_cpu']:8.2f} s CPU run "
                f"({1e3 * this['run_cpu'] / n:6.2f} ms/request, "
                f"{this['events'] / max(this['run_cpu'], 1e-9):9,.0f} events/s), setup "
                f"{this['setup_cpu']:6.2f} s, peak {this['peak_bytes'] / 2**20:7,.0f} MiB")
        if "baseline" in row:
            b = row["baseline"]
            line += (f" | baseline {b['run_cpu'] + b['setup_cpu']:8.2f} s, "
                     f"{b['peak_bytes'] / 2**20:7,.0f} MiB; speed-up "
                     f"{(b['run_cpu'] + b['setup_cpu']) / (this['run_cpu'] + this['setup_cpu']):.2f}x")
        print(line, flush=True)
        rows.append(row)
        if args.out:  # written as it goes: a long run leaves what it measured
            _save(Path(args.out), rows, None)
    events = sum(r["this"]["events"] for r in rows) // max(len(rows), 1)
    loop = simpy_loop(max(events, 10_000))
    print(f"plain simpy loop: {loop['events'] / loop['cpu']:,.0f} events/s", flush=True)
    if args.out:
        _save(Path(args.out), rows, loop)
    return 0


def render(out: Path) -> None:
    """curves.md: one table per axis from curves.json."""
    doc = json.loads((out / "curves.json").read_text())
    lines = [f"# Scaling curves ({doc['when']}, {doc['cpus']} CPUs)", "",
             "Generated by `benchmarks/curves.py` from `curves.json` (timing-only runs of the "
             "Kimi-Linear-48B 2x P TP4 -> 2x D TP8 workload of benchmarks/test_simulation.py; "
             "CPU seconds of each child process; 'baseline' = main, run alternately in the same "
             "session).", ""]
    loop = doc.get("simpy_loop")
    if loop:
        lines += [f"Plain simpy loop in this session: {loop['events'] / loop['cpu']:,.0f} "
                  f"events/s ({1e6 * loop['cpu'] / loop['events']:.2f} us per event).", ""]
    axes: dict[str, list[dict[str, Any]]] = {}
    for row in doc["points"]:
        axes.setdefault(row["axis"], []).append(row)
    for axis, rows in axes.items():
        lines += [f"## {axis}", "",
                  "| point | requests | run CPU s | ms/request | events/s | us/event | setup s "
                  "| peak MiB | main CPU s (run+setup) | main peak MiB | speed-up |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            t, n = row["this"], row["requests"]
            cells = [row["point"], f"{n:,}", f"{t['run_cpu']:.2f}",
                     f"{1e3 * t['run_cpu'] / n:.2f}", f"{t['events'] / t['run_cpu']:,.0f}",
                     f"{1e6 * t['run_cpu'] / t['events']:.1f}", f"{t['setup_cpu']:.2f}",
                     f"{t['peak_bytes'] / 2**20:,.0f}"]
            b = row.get("baseline")
            if b:
                ours, theirs = t["run_cpu"] + t["setup_cpu"], b["run_cpu"] + b["setup_cpu"]
                cells += [f"{theirs:.2f}", f"{b['peak_bytes'] / 2**20:,.0f}",
                          f"{theirs / ours:.2f}x"]
            else:
                cells += ["-", "-", "-"]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    (out / "curves.md").write_text("\n".join(lines))


def _save(out: Path, rows: list[dict[str, Any]], loop: dict[str, Any] | None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"cpus": os.cpu_count(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "simpy_loop": loop, "points": rows}
    (out / "curves.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
