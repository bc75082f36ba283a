"""Per-request planning through the public call (issue #14 item 5 / target 1).

``ConnectorWorker.start_read`` on a decode rank handshaken with a prefill rank over the
simulated transport, timed call by call: block expansion and pairing, descriptor ids, the
transport's id validation (range checks, paired lengths), byte sums, NIXL's coalescing count
and the post onto the fabric -- everything the connector does for one request before the
bytes move. The simulated transfer is then run to completion and the request polled and
released, untimed, so every timed call starts from the same state.

Both public calls: ``start_read`` (pull) and ``start_write`` (push: the prefill worker posts
WRITEs into decode's blocks, the same plan from the other side).

Sizes: ~1k descriptors (Kimi-Linear-48B, 8,192 tokens: 1,134 descriptors) and ~112k
(1,025,280 tokens, Kimi-Linear's 1M context: 112,224), each with ``descriptor_merge`` off,
contiguous and strided. Target: >= 20 M descriptors/s (descriptors = the per-block plan's
descriptor count, whatever merging makes of it).

    .venv/bin/python benchmarks/test_planning_public.py [--baseline DIR] [--json FILE]
        [--ops read,write] [--reps N]
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import numpy as np
import pytest

TARGET = 20e6  # descriptors per second
SIZES = {"1k": 8_193, "112k": 1_025_281}  # prompt tokens (N - 1 tokens are transferred)
MODES = ("off", "contiguous", "strided")
OPS = ("read", "write")  # start_read (pull), start_write (push)



class PublicPlan:
    """A decode and a prefill ConnectorWorker over SimTransport, handshaken, and the
    ReadRequest of one ``tokens``-token prompt (consecutive blocks from 1). ``op="write"``:
    the push path instead -- the prefill worker handshaken with decode, and the
    WriteRequest of the same blocks, timed through ``start_write``."""

    def __init__(self, tokens: int, merge: str, op: str = "read") -> None:
        import simpy

        from hkvsim.backends.overhead import SCENARIO as OVERHEAD_SCENARIO
        from hkvsim.connector.push import PushRegistration, WriteRequest
        from hkvsim.connector.worker import ConnectorSettings, ConnectorWorker, ReadRequest
        from hkvsim.fabric import Fabric, load_profile, place_engines
        from hkvsim.pd.deployment import engine_layout
        from hkvsim.scenario import parse_scenarios
        from hkvsim.transport.sim import SimWorld

        # the deployment of the NIXL overhead benchmark: Kimi-Linear-48B, P TP1 -> D TP1
        (scenario,) = parse_scenarios(OVERHEAD_SCENARIO.format(preset="kimi-linear-48b",
                                                               tokens=1000))
        self.env = simpy.Environment()
        profile = load_profile("cpu-ucx-loopback")
        fabric = Fabric(self.env, profile, place_engines(profile, [("prefill0", "prefill", 1),
                                                                    ("decode0", "decode", 1)]))
        world = SimWorld(self.env, fabric, move_bytes=False)
        workers = {}
        for role in ("prefill", "decode"):
            probe = engine_layout(scenario.model_spec(), getattr(scenario, role), num_blocks=1,
                                  registration_order=scenario.connector.registration_order,
                                  quirks=frozenset())
            logical = probe.blocks_for_tokens(tokens - 1) + 8
            layout = engine_layout(scenario.model_spec(), getattr(scenario, role),
                                   num_blocks=logical * probe.physical_blocks_per_logical,
                                   registration_order=scenario.connector.registration_order,
                                   quirks=frozenset())
            w = ConnectorWorker(engine_id=f"{role}0", role=role, tp_rank=0, layout=layout,
                                transport=world.create_agent(f"{role}0.0", (f"{role}0", 0)),
                                settings=ConnectorSettings(
                                    descriptor_merge=merge,
                                    mode="push" if op == "write" else "pull"))
            w.register(mem_type="DRAM")
            workers[role] = w
        self.decode, prefill = workers["decode"], workers["prefill"]
        if op == "write":  # prefill posts: it is the worker timed
            prefill.connect("decode0", {0: self.decode.handshake_payload()})
            self.decode = prefill
        else:
            self.decode.connect("prefill0", {0: prefill.handshake_payload()})
        blocks: dict[int, np.ndarray] = {}
        layout = self.decode.layout
        n = layout.blocks_for_tokens(tokens - 1)
        for group in layout.groups:
            blocks[group.group_id] = (np.arange(1, n + 1) if group.kind == "attention"
                                      else np.array([n + 1 + group.group_id]))
        self.op = op
        if op == "write":
            registration = PushRegistration(decode_request_id="r", decode_engine="decode0",
                                            decode_tp=1, prefill_engine="prefill0",
                                            blocks=blocks, hit_blocks=0)
            self.request: Any = WriteRequest(prefill_request_id="r", registration=registration,
                                             prefill_blocks=blocks)
        else:
            self.request = ReadRequest(request_id="r", prefill_request_id="r",
                                       remote_engine="prefill0", prefill_blocks=blocks,
                                       decode_blocks=blocks)
        self.descriptors = self.once()[1]

    def once(self) -> tuple[float, int]:
        """One timed start_read (seconds, descriptors), then the untimed completion. Each
        call gets a request object of its own, as every request does (nothing the connector
        remembers per request object is reused across calls)."""
        request = dataclasses.replace(self.request)
        start = self.decode.start_write if self.op == "write" else self.decode.start_read
        t0 = time.perf_counter()
        outcome = start(request)
        elapsed = time.perf_counter() - t0
        while outcome is None:
            self.env.run()
            done = self.decode.poll(self.decode.transport.take_finished())
            outcome = done[0] if done else None
        if not outcome.ok:
            raise RuntimeError(f"start_read failed: {outcome.reason}")
        return elapsed, outcome.descriptors

    def best(self, *, min_seconds: float = 0.3, rounds: int = 5) -> float:
        """Best per-call time over ``rounds`` batches lasting ``min_seconds`` in all."""
        n = 1
        while True:
            total = sum(self.once()[0] for _ in range(n))
            if total >= min_seconds / rounds or n >= 1 << 12:
                break
            n *= 2
        return min(sum(self.once()[0] for _ in range(n)) / n for _ in range(rounds))


@pytest.fixture(scope="module", params=list(SIZES))
def size(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("merge", MODES)
def test_public_planning(benchmark: Any, figures: Any, size: str, merge: str, op: str) -> None:
    plan = PublicPlan(SIZES[size], merge, op)
    benchmark.pedantic(plan.once, rounds=3, iterations=1)
    rate = plan.descriptors / plan.best()
    figures.add(f"public start_{op}: {plan.descriptors:,} descriptors, merge {merge}",
                rate / 1e6, "M desc/s", target=">= 20", met=rate >= TARGET)
    benchmark.extra_info["descriptors_per_second"] = rate
    assert plan.descriptors == (1_134 if size == "1k" else 112_224)


def _point(size: str, merge: str, op: str = "read") -> dict[str, Any]:
    plan = PublicPlan(SIZES[size], merge, op)
    t = plan.best()
    return {"size": size, "merge": merge, "op": op, "descriptors": plan.descriptors,
            "seconds": t, "rate": plan.descriptors / t}


def main(argv: list[str]) -> None:
    """Print the table; ``--baseline DIR`` also runs every point with ``PYTHONPATH=DIR``
    (another checkout, e.g. main), alternating child processes; ``--json FILE`` saves it."""
    import argparse
    import json
    import os
    import subprocess

    ap = argparse.ArgumentParser(description="start_read planning throughput")
    ap.add_argument("--baseline", default=None, metavar="DIR")
    ap.add_argument("--json", default=None, metavar="FILE")
    ap.add_argument("--ops", default="read,write",
                    help="which public calls to time: read (start_read), write (start_write)")
    ap.add_argument("--reps", type=int, default=1,
                    help="child processes per point and side, alternated; the best is kept "
                         "(a shared machine's load comes and goes)")
    ap.add_argument("--point", nargs=3, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.point:
        print(json.dumps(_point(*args.point)))
        return

    if args.reps < 1:
        ap.error(f"--reps {args.reps}: must be >= 1")
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        ap.error(f"--ops {args.ops!r}: allowed: {', '.join(OPS)} (comma-separated)")

    def child(size: str, merge: str, op: str, pythonpath: str | None) -> dict[str, Any]:
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        out = subprocess.run([sys.executable, __file__, "--point", size, merge, op], env=env,
                             capture_output=True, text=True, check=True, timeout=900, cwd="/")
        return json.loads(out.stdout.strip().splitlines()[-1])

    rows = []
    def best(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
        return b if a is None or b["seconds"] < a["seconds"] else a

    for op, size, merge in ((o, s, m) for o in ops for s in SIZES for m in MODES):
        row: dict[str, Any] = {"this": None}
        for _ in range(args.reps):  # alternated children; the best of each side
            row["this"] = best(row["this"], child(size, merge, op, None))
            if args.baseline:
                row["baseline"] = best(row.get("baseline"), child(size, merge, op,
                                                                  args.baseline))
        row["reps"] = args.reps
        t = row["this"]
        line = (f"{op:>5} {size:>5} {merge:>10}: {t['descriptors']:>7,} descriptors in "
                f"{t['seconds'] * 1e6:9,.0f} us = {t['rate'] / 1e6:6.1f} M desc/s")
        if "baseline" in row:
            b = row["baseline"]
            line += (f" | baseline {b['seconds'] * 1e6:9,.0f} us = {b['rate'] / 1e6:6.1f} "
                     f"M desc/s; speed-up {b['seconds'] / t['seconds']:.1f}x")
        print(line, flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"target_rate": TARGET, "points": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main(sys.argv[1:])
