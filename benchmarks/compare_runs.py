"""The 10,000-request Kimi-Linear timing-only run (benchmarks/test_simulation.py's workload) on
this checkout and on other checkouts of hkvsim, alternated, CPU seconds of each child process
(issue #14: ratios measured side by side in one session).

    .venv/bin/python benchmarks/compare_runs.py [--requests 10000] [--reps 2] \
        [--json FILE] NAME=DIR [NAME=DIR ...]

Each ``NAME=DIR`` is another checkout (``PYTHONPATH=DIR``), e.g. ``main=/path/to/main``.
Every run must succeed with the same simulated seconds on every checkout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from curves import run_child  # noqa: E402
from test_simulation import workload  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("checkouts", nargs="*", metavar="NAME=DIR")
    args = ap.parse_args(argv)
    codes: list[tuple[str, str | None]] = [("this", None)]
    for item in args.checkouts:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            ap.error(f"checkout {item!r}: expected NAME=DIR")
        codes.append((name, path))
    text = workload(requests=args.requests)
    rows: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for name, path in codes:
            d = run_child(text, path)
            cpu = d["run_cpu"] + d["setup_cpu"]
            rows.append({"rep": rep, "code": name, "cpu": cpu, **d})
            print(f"rep {rep} {name:>8}: {cpu:8.2f} s CPU ({1e3 * d['run_cpu'] / args.requests:.3f} "
                  f"ms/request, {1e6 * d['run_cpu'] / d['events']:.1f} us/event), peak "
                  f"{d['peak_bytes'] / 2**20:,.0f} MiB, simulated {d['sim_seconds']!r} s",
                  flush=True)
    sims = {r["sim_seconds"] for r in rows}
    if len(sims) != 1:
        raise RuntimeError(f"simulated seconds differ between checkouts: {sorted(sims)}")
    for rep in range(args.reps):
        ours = next(r["cpu"] for r in rows if r["rep"] == rep and r["code"] == "this")
        for name, _ in codes[1:]:
            theirs = next(r["cpu"] for r in rows if r["rep"] == rep and r["code"] == name)
            print(f"rep {rep}: {name} / this = {theirs / ours:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
