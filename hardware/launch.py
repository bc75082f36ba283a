#!/usr/bin/env python3
"""GPU-lab launcher for hkvsim's real NIXL backend: the same scenario files, one process per rank,
across GPUs and nodes. Runbook: hardware/README.md.

    # one node (every rank on this machine; cuda: one GPU per rank)
    python hardware/launch.py local SCENARIO.toml --device cuda [--json]

    # several nodes: the same HKVSIM_TOKEN everywhere, then one command per node
    node 0:  python hardware/launch.py coordinator SCENARIO.toml --nodes 2 --bind 10.0.0.1 \\
                 --port 29555 --device cuda --gpus 8 [--json]
    node k:  python hardware/launch.py node --coordinator 10.0.0.1:29555 --node-rank k \\
                 --device cuda --gpus 8

The coordinator (node 0) plays the scheduler and proxy and starts node 0's ranks itself; every
other node runs a node agent that starts its share of the ranks with multiprocessing *spawn*
(hkvsim's equivalent of torchrun) and reports any that die. Results are the JSON of
`hkvsim run --json` (exit 0 = the scenario's [expect] is met, 1 = not met, 2 = could not run).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout without pip install


def _token(required: bool) -> str | None:
    token = os.environ.get("HKVSIM_TOKEN")
    if required and not token:
        raise SystemExit("hardware/launch.py: set the same HKVSIM_TOKEN on every node "
                         "(e.g. export HKVSIM_TOKEN=$(python -c 'import secrets; "
                         "print(secrets.token_hex(16))'))")
    return token


def _gpus(args: argparse.Namespace) -> int:
    if args.gpus:
        return args.gpus
    if args.device == "cuda":
        import torch  # the lab's CUDA torch (pip install -e '.[lab]')

        return torch.cuda.device_count()
    return os.cpu_count() or 1


def _report(results: list, args: argparse.Namespace) -> int:
    from hkvsim.results import result_json

    data = [result_json(r, requests=args.requests) for r in results]
    met = all(d["expectation_met"] for d in data)
    if args.json:
        json.dump(data[0] if len(data) == 1 else {"scenarios": data, "expectation_met": met},
                  sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        for d in data:
            r = d["requests"]
            met_text = "met" if d["expectation_met"] else "NOT MET"
            print(f"{d['scenario']}: {d['outcome']} ({met_text})"
                  f"; {r['completed']}/{r['total']} completed, byte-exact {r['byte_exact']}, "
                  f"{r['bytes']:,} B in {r['descriptors']:,} descriptors")
            for f in d["failures"][:3]:
                print(f"  request {f['request']} failed ({f['class']}): {f['reason']}")
    return 0 if met else 1


def _run(args: argparse.Namespace, *, multi_node: bool) -> int:
    from hkvsim.drivers.nixl import NixlRunError, NixlRunOptions, run_scenario_nixl
    from hkvsim.scenario import ScenarioError, load_scenarios
    from hkvsim.transport.nixl import NixlUnavailable

    try:
        scenarios = load_scenarios(args.file)
    except ScenarioError as exc:
        print(f"hardware/launch.py: error: {exc}", file=sys.stderr)
        return 2
    node0 = []
    log_dir = args.log_dir or str(Path("hkvsim-logs").resolve())
    token = _token(required=multi_node)

    def start_node0(host: str, port: int) -> None:
        from hkvsim.backends.launch import node_main

        proc = multiprocessing.get_context("spawn").Process(
            target=node_main, daemon=False,
            args=(args.bind if args.bind not in ("0.0.0.0", "::") else "127.0.0.1", port,
                  token, 0, _gpus(args), str(Path(log_dir) / "node0")))
        proc.start()
        node0.append(proc)

    results = []
    try:
        for scenario in scenarios:
            options = NixlRunOptions(
                device=args.device, host=args.bind if multi_node else "127.0.0.1",
                port=args.port if multi_node else 0, progress_thread=args.progress_thread,
                log_dir=str(Path(log_dir) / scenario.scenario.name.replace("/", "_")[:80]),
                spawn=not multi_node, nodes=args.nodes if multi_node else 1, token=token,
                on_listening=start_node0 if multi_node else None)
            results.append(run_scenario_nixl(scenario, options=options))
            for proc in node0:
                proc.join(60)
            node0.clear()
    except (NixlUnavailable, NixlRunError) as exc:
        print(f"hardware/launch.py: error: {exc}", file=sys.stderr)
        return 2
    return _report(results, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hardware/launch.py", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    for mode in ("local", "coordinator"):
        p = sub.add_parser(mode, help="run a scenario" + (" across nodes" if mode != "local"
                                                          else " on this node"))
        p.add_argument("file", help="scenario TOML file (a [sweep] runs every variant)")
        p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                       help="cpu: DRAM caches; cuda: VRAM caches, one GPU per rank")
        p.add_argument("--json", action="store_true", help="the JSON of hkvsim run --json")
        p.add_argument("--requests", action="store_true", help="per-request details in --json")
        p.add_argument("--progress-thread", action="store_true",
                       help="NIXL's progress thread on (default off: ranks poll NIXL)")
        p.add_argument("--log-dir", default=None, help="rank logs (default ./hkvsim-logs)")
        p.add_argument("--gpus", type=int, default=None,
                       help="rank slots on this node (default: CUDA devices, or CPU count)")
        if mode == "coordinator":
            p.add_argument("--nodes", type=int, required=True, help="node agents to expect")
            p.add_argument("--bind", required=True,
                           help="address the other nodes reach this one at (never 0.0.0.0 "
                                "unless the network is private)")
            p.add_argument("--port", type=int, default=29555)
    p = sub.add_parser("node", help="run a node agent: start this node's ranks")
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT")
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--gpus", type=int, default=None)
    p.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    if args.mode == "node":
        from hkvsim.backends.launch import run_node

        host, _, port = args.coordinator.rpartition(":")
        log_dir = args.log_dir or str(Path("hkvsim-logs").resolve() / f"node{args.node_rank}")
        return run_node(host, int(port), _token(required=True) or "", node=args.node_rank,
                        slots=_gpus(args), log_dir=log_dir)
    return _run(args, multi_node=args.mode == "coordinator")


if __name__ == "__main__":
    sys.exit(main())
