"""The GPU-lab entry: hkvsim's real-NIXL run, launched by torchrun, one worker per rank.

    torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m hkvsim.lab SCENARIO.toml [--device cuda] [--json] [--requests]
    python -m hkvsim.lab_torchrun --standalone --nproc-per-node 3 -m hkvsim.lab SCENARIO.toml
        # one node: torchrun with its store on loopback only (hkvsim.lab_torchrun)

Every torchrun worker serves one prefill or decode rank (its own NIXL agent, cache, connector
and oracle: :mod:`hkvsim.backends.rank`). Global rank 0 also runs the coordinator (the asyncio
driver, :mod:`hkvsim.drivers.nixl`); its own rank is a child process of it. The coordinator's
address, the run's one-time per-rank credentials and each worker's place (node, local rank, GPU
count) travel through torchrun's store (:mod:`hkvsim.lab_store`); there is no launcher
protocol of hkvsim's own. A scenario file with a [sweep] runs its variants one after another
on the same workers; a variant that needs more workers or GPUs than there are fails alone.

Rank failure is torchrun's: a worker that dies fails the run (torchrun stops the others and
names the worker); the coordinator says which hkvsim rank it was. A death of rank 0's own rank
process ends the run the same way (exit status 3).

Exit status (rank 0): 0 every variant's [expect] met; 1 one was not; 2 a variant could not run
(one line says why); 3 a rank died. Output: what ``hkvsim run --json`` prints.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from .lab_env import EnvError, TorchrunEnv, check_alloc_conf, read_torchrun_env
from .lab_place import PlacementError, Slot, place
from .lab_store import (
    LabStore,
    StoreTimeout,
    check_run,
    check_slot,
    connect_torchrun_store,
    round_key,
    slot_key,
)

__all__ = ["main", "EXIT_OK", "EXIT_EXPECTATION", "EXIT_NOT_RUN", "EXIT_RANK_DIED"]

EXIT_OK, EXIT_EXPECTATION, EXIT_NOT_RUN, EXIT_RANK_DIED = 0, 1, 2, 3
log = logging.getLogger("hkvsim.lab")
_current: dict[str, Any] = {}  # rank 0: the driver of the round in progress (for SIGTERM)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="torchrun ... -m hkvsim.lab",
                                description="hkvsim over real NIXL, one torchrun worker per rank")
    p.add_argument("file", help="scenario TOML file (a [sweep] runs every variant)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: DRAM caches; cuda: VRAM caches, each worker on its local-rank GPU")
    p.add_argument("--ranks-per-gpu", type=_positive_int, default=1, metavar="K",
                   help="with --device cuda: K workers share one GPU (local rank i uses GPU "
                        "i // K); default 1. 2 runs a P rank and a D rank on a one-GPU machine")
    p.add_argument("--json", action="store_true", help="the JSON of hkvsim run --json")
    p.add_argument("--requests", action="store_true", help="per-request details in --json")
    p.add_argument("--timing-only", action="store_true",
                   help="skip the byte oracle (bytes are then reported as not verified)")
    p.add_argument("--progress-thread", action=argparse.BooleanOptionalAction, default=None,
                   help="NIXL's progress thread in every rank (default: on with --device cuda, "
                        "as vLLM's connector runs it; off with cpu, where ranks poll NIXL in "
                        "their loop). With it off a transfer that carries a notification "
                        "completes only at its remote rank's next NIXL call")
    p.add_argument("--bind", default=None,
                   help="address of rank 0's side channel (default: 127.0.0.1 on one node; "
                        "across nodes, rank 0's address on the route to torchrun's store)")
    p.add_argument("--log-dir", default=None,
                   help="rank logs, on each node (default ./hkvsim-logs/<torchrun run id>)")
    p.add_argument("--wait", type=float, default=3600.0,
                   help="how long a worker waits for its next assignment (s)")
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of at least 1 is allowed, got {text!r}")
    return value


def default_progress_thread(device: str) -> bool:
    """NIXL's progress thread unless asked: on with ``cuda`` (what vLLM's connector runs), off
    with ``cpu`` (ranks poll NIXL in their loop; on a 2-core box the thread's busy polling
    starves the copies). gpu-check uses the same rule."""
    return device == "cuda"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the defaults that depend on the device resolved."""
    args = _parser().parse_args(argv)
    if args.progress_thread is None:
        args.progress_thread = default_progress_thread(args.device)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        env = read_torchrun_env()
        if args.device == "cuda":
            check_alloc_conf()
        if not env.agent_store:
            raise EnvError("TORCHELASTIC_USE_AGENT_STORE is not True: start hkvsim.lab with "
                           "torchrun (its agent hosts the store the workers meet in)")
    except EnvError as exc:
        print(f"hkvsim.lab: error: {exc}", file=sys.stderr)
        return EXIT_NOT_RUN
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format=f"hkvsim.lab[{env.rank}]: %(message)s")
    if not env.single_node:  # ranks on other nodes: UCX needs the network devices, not only lo
        os.environ.setdefault("UCX_NET_DEVICES", "all")  # (one node: loopback, NixlConfig)
    prefix = f"hkvsim/{_safe(env.run_id)}/{env.restart}/"
    store = LabStore(connect_torchrun_store(env.master_addr, env.master_port, prefix,
                                            timeout=max(args.wait, 60.0)))
    store.put(slot_key(env.rank), {"op": "slot", "node": env.node, "local_rank": env.local_rank,
                                   "gpus": _gpu_count() if args.device == "cuda" else None})
    log_root = Path(args.log_dir or Path("hkvsim-logs") / _safe(env.run_id or "run"))
    if env.rank == 0:
        return Coordinator(args, env, store, log_root).run()
    return serve_worker(env, store, log_root, wait=args.wait)


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:80] or "run"


def _gpu_count() -> int:
    """CUDA devices this worker sees (0 without CUDA torch): the placement checks them."""
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


# ---- workers other than rank 0 -------------------------------------------------------------------
def serve_worker(env: TorchrunEnv, store: LabStore, log_root: Path, *, wait: float) -> int:
    """Serve whatever rank 0 assigns, round after round, until it says "end"."""
    from .backends.rank import EXIT_OK as RANK_OK
    from .backends.rank import EXIT_UNREACHABLE, serve_rank

    # UCX prints its protocol choice to the rank log, which the run parses into each transfer's
    # telemetry path (as for a rank the driver spawns); UCX_PROTO_INFO=n on the node turns it off
    os.environ.setdefault("UCX_PROTO_INFO", "y")
    round_no = 0
    while True:
        try:
            msg = store.take(round_key(round_no, env.rank), wait)
        except StoreTimeout as exc:
            print(f"hkvsim.lab[{env.rank}]: error: no assignment from rank 0: {exc}",
                  file=sys.stderr)
            return EXIT_NOT_RUN
        op = msg["op"]
        if op == "end":
            return EXIT_OK
        if op == "run":
            run = check_run(msg)
            log_dir = log_root / f"round{round_no:03d}"
            log_dir.mkdir(parents=True, exist_ok=True)
            code = serve_rank(run["host"], run["port"], run["credential"], run["engine"],
                              run["rank"], str(log_dir / f"{run['engine']}.{run['rank']}.log"))
            if code == EXIT_UNREACHABLE:  # fail the run now (torchrun), not at rank 0's deadline
                print(f"hkvsim.lab[{env.rank}]: error: {run['engine']} rank {run['rank']}: rank "
                      f"0's side channel {run['host']}:{run['port']} is unreachable from node "
                      f"{env.node} (rank 0's --bind must be an address this node reaches)",
                      file=sys.stderr, flush=True)
                return EXIT_RANK_DIED
            if code != RANK_OK:  # the coordinator knows why (the rank told it, or lost it)
                log.warning("%s rank %d ended with status %d (its log: %s)", run["engine"],
                            run["rank"], code, log_dir)
        elif op != "idle":
            print(f"hkvsim.lab[{env.rank}]: error: unknown assignment {op!r:.40}",
                  file=sys.stderr)
            return EXIT_NOT_RUN
        round_no += 1


# ---- rank 0 ------------------------------------------------------------------------------------
class Coordinator:
    """Rank 0: place each variant on the workers, run it with the NIXL driver, report."""

    def __init__(self, args: argparse.Namespace, env: TorchrunEnv, store: LabStore,
                 log_root: Path) -> None:
        self.args, self.env, self.store, self.log_root = args, env, store, log_root
        self.round_no = 0

    def run(self) -> int:
        signal.signal(signal.SIGTERM, _on_sigterm)
        try:
            return self._run()
        finally:
            for g in range(1, self.env.world_size):  # every worker leaves, whatever happened
                self.store.put(round_key(self.round_no, g), {"op": "end"})

    def _run(self) -> int:
        from .drivers.nixl import NixlRunError
        from .results import result_json
        from .scenario import ScenarioError, load_scenarios
        from .transport.nixl import NixlUnavailable

        try:
            scenarios = load_scenarios(self.args.file)
            host = self._bind_address()
            slots = self._slots()
        except (ScenarioError, EnvError, StoreTimeout) as exc:
            print(f"hkvsim.lab: error: {exc}", file=sys.stderr)
            return EXIT_NOT_RUN
        data: list[dict[str, Any]] = []
        not_run: list[dict[str, Any]] = []
        count = len(scenarios)
        for index, scenario in enumerate(scenarios):
            name = scenario.scenario.name
            try:
                placed = place([(e.engine_id, e.tp) for e in _engines(scenario)], slots)
                result = self._round(scenario, placed, host)
            except (PlacementError, NixlRunError, NixlUnavailable) as exc:
                print(f"hkvsim.lab: error: {name}: {exc}", file=sys.stderr)
                not_run.append({"scenario": name, "variant": index, "error": str(exc)})
                continue
            data.append(result_json(result, requests=self.args.requests,
                                    position=(index, count)))
            deaths = _deaths()
            if deaths:  # torchrun's rule: a dying rank fails the run
                print("hkvsim.lab: error: " + "; ".join(deaths), file=sys.stderr)
                self._emit(scenarios, data, not_run)
                return EXIT_RANK_DIED
        self._emit(scenarios, data, not_run)
        if not_run:
            return EXIT_NOT_RUN
        return EXIT_OK if all(d["expectation_met"] for d in data) else EXIT_EXPECTATION

    # ---- pieces -------------------------------------------------------------------------
    def _slots(self) -> list[Slot]:
        out = []
        for g in range(self.env.world_size):
            f = check_slot(self.store.take(slot_key(g), 120.0))
            out.append(Slot(rank=g, node=f["node"], local_rank=f["local_rank"], gpus=f["gpus"],
                            ranks_per_gpu=self.args.ranks_per_gpu))
        return out

    def _bind_address(self) -> str:
        if self.args.bind:
            return self.args.bind
        if self.env.single_node:
            return "127.0.0.1"
        # the address other nodes reach this one at: ours on the route to torchrun's store
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((self.env.master_addr, self.env.master_port))
            addr = s.getsockname()[0]
        if addr.startswith("127.") or addr == "0.0.0.0":
            raise EnvError(f"several nodes, but the route to torchrun's store "
                           f"({self.env.master_addr}) leaves from {addr}; give --bind ADDR, "
                           f"rank 0's address on the lab network")
        return addr

    def _round(self, scenario: Any, placed: list[Any], host: str) -> Any:
        from .drivers.nixl import NixlDriver, NixlRunOptions

        round_no = self.round_no
        where = {(p.engine, p.tp_rank): p for p in placed}
        users = {p.rank for p in placed}
        announced: list[bool] = []

        def announce(bind: str, port: int, credentials: dict[tuple[str, int], str]) -> None:
            announced.append(True)
            for (engine, tp_rank), credential in credentials.items():
                p = where[(engine, tp_rank)]
                self.store.put(round_key(round_no, p.rank), {
                    "op": "run", "host": bind, "port": port, "engine": engine,
                    "rank": tp_rank, "credential": credential})
            for g in range(1, self.env.world_size):
                if g not in users:
                    self.store.put(round_key(round_no, g), {"op": "idle"})

        def describe(engine: str, tp_rank: int) -> str:
            p = where[(engine, tp_rank)]
            gpu = f", GPU {p.device}" if self.args.device == "cuda" else ""
            return f"torchrun global rank {p.rank}, node {p.node}, local rank {p.local_rank}{gpu}"

        options = NixlRunOptions(
            device=self.args.device, host=host, progress_thread=self.args.progress_thread,
            log_dir=str(self.log_root / f"round{round_no:03d}"),
            spawn_ranks=frozenset((p.engine, p.tp_rank) for p in placed if p.rank == 0),
            device_ids=tuple((p.engine, p.tp_rank, p.device) for p in placed),
            announce=announce, describe_rank=describe,
            precommit=None if self.env.single_node else False)
        driver = NixlDriver(scenario, timing_only=self.args.timing_only, options=options)
        _current.update(driver=driver, scenario=scenario.scenario.name)
        self.round_no += 1  # the workers have their keys for this round (or leave at "end")
        try:
            return driver.run()
        finally:
            _current["deaths"] = [r.dead for r in driver.ranks if r.dead]
            if not announced:  # it failed before telling anyone: the workers skip the round
                for g in range(1, self.env.world_size):
                    self.store.put(round_key(round_no, g), {"op": "idle"})

    def _emit(self, scenarios: list[Any], data: list[dict[str, Any]],
              not_run: list[dict[str, Any]]) -> None:
        if self.args.json:
            flat = len(scenarios) == 1 and not scenarios[0].sweep_point and data
            out: Any = data[0] if flat else {
                "source": self.args.file, "variants": len(scenarios), "shard": None,
                "expectation_met": bool(data) and not not_run and all(
                    d["expectation_met"] for d in data),
                "verified": bool(data) and all(d["verified"] for d in data),
                "scenarios": data, "not_run": not_run}
            json.dump(out, sys.stdout, indent=2, default=str)
            sys.stdout.write("\n")
            sys.stdout.flush()
            return
        for d in data:
            r = d["requests"]
            met = "met" if d["expectation_met"] else "NOT MET"
            print(f"{d['scenario']}: {d['outcome']} ({met}); {r['completed']}/{r['total']} "
                  f"completed, byte-exact {r['byte_exact']}, {r['bytes']:,} B in "
                  f"{r['descriptors']:,} descriptors")
            for f in d["failures"][:3]:
                print(f"  request {f['request']} failed ({f['class']}): {f['reason']}")
        for n in not_run:
            print(f"{n['scenario']}: NOT RUN: {n['error']}")
        sys.stdout.flush()


def _engines(scenario: Any) -> list[Any]:
    from .pd.deployment import build_deployment

    return list(build_deployment(scenario).all_engines())


def _deaths() -> list[str]:
    return list(_current.get("deaths") or [])


def _on_sigterm(signum: int, _frame: Any) -> None:
    """torchrun stops rank 0 when another worker died: say which rank that was, then go."""
    driver = _current.get("driver")
    dead = [r.dead for r in driver.ranks if r.dead] if driver is not None else []
    what = "; ".join(dead) if dead else "no rank death seen by the coordinator yet"
    print(f"hkvsim.lab: error: torchrun stopped the run (signal {signum}) during "
          f"{_current.get('scenario', 'startup')}: {what}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
