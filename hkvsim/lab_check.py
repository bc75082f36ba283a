"""``hardware/gpu-check``: what a GPU lab runs first, writing ``reports/gpu/``.

First a preflight: torch with CUDA and the GPUs asked for (``--gpus``: 2 by default where two
are visible, else 1), NIXL importable, no ``expandable_segments:True`` (it refuses clearly
otherwise, before anything runs). Then the steps:

1. VRAM registration: on each GPU used, a NIXL agent registers a VRAM buffer and deregisters it
   (NIXL issue #334 shows up here);
2. tiny-kimi-linear pull and push under torchrun (P on GPU 0, D on GPU 1; with one GPU both
   ranks share GPU 0, so the copy stays inside one device and no GPU-to-GPU link is used),
   every byte checked by the oracle;
3. a NIXL transfer sweep between two processes on the lab's memory (VRAM on GPU 0 with
   ``--device cuda``, DRAM on cpu): descriptor sizes x counts, READ and WRITE, NIXL's own
   telemetry per point, the first transfer's cost, and each point as the shipped profile
   predicts it;
4. a short calibration sweep (kimi-linear-48b geometry, prompt lengths x descriptor merging),
   measured next to the simulator's prediction for the same file (whose profile models two
   GPUs on NVLink: on one GPU the summary says so);
5. the progress probe (:mod:`hkvsim.backends.progress_probe`): whether a transfer completes
   while the remote process is busy without calling into NIXL, with and without a
   notification attached;
6. tiny-kimi-linear between unequal TP sizes (P TP 1/2/4 x D TP 1/2/4, pull and push) under
   torchrun with eight workers (on one GPU all eight share it; on two, four each), every byte
   checked: the state page split across ranks and heterogeneous TP on GPU memory.

NIXL's progress thread is on in every rank and in the probe with ``--device cuda`` (what vLLM's
connector runs), off with ``--device cpu`` (hkvsim's ranks then poll NIXL in their loop, as on a
2-core CI box, where the thread's busy polling starves the copies); ``--progress-thread`` /
``--no-progress-thread`` choose. With it off, a transfer that carries a notification completes
only at its remote rank's next NIXL call, so a remote busy with oracle work holds it (measured on
one H200: reports/gpu/README.md).

Steps 2 and 4 are the torchrun path of :mod:`hkvsim.lab`; CI runs the same code on CPU
(``--device cpu``, which skips step 1 and the CUDA preflight) so only CUDA itself is untested
there. Exit status: 0 every step passed, 1 a step failed, 2 refused (preflight).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["main", "preflight", "byte_problems", "calibration_rows"]

SCENARIOS = Path(__file__).resolve().parents[1] / "hardware" / "scenarios"  # in a checkout
TIMED_OUT = 124  # torchrun_json's exit status for a step killed at its timeout (as timeout(1))


def preflight(device: str, gpus: int = 2) -> list[str]:
    """Why this machine cannot run the check (empty: it can)."""
    problems: list[str] = []
    from .lab_env import EnvError, check_alloc_conf
    from .transport.nixl import NixlUnavailable, load_nixl

    try:
        import torch
    except ImportError:
        return ["torch is not installed (pip install -e '.[lab]')"]
    if device == "cuda":
        try:
            check_alloc_conf()
        except EnvError as exc:
            problems.append(str(exc))
        if not torch.cuda.is_available():
            problems.append("no CUDA device: torch.cuda.is_available() is False (a CPU-only "
                            "machine, a CPU build of torch, or no driver); this check needs "
                            f"{gpus} GPU(s)")
        elif torch.cuda.device_count() < gpus:
            problems.append(f"{torch.cuda.device_count()} CUDA device(s) visible; this check "
                            f"needs {gpus} (see CUDA_VISIBLE_DEVICES; --gpus 1 puts P and D on "
                            f"one GPU)")
    try:
        load_nixl()
    except NixlUnavailable as exc:
        problems.append(str(exc))
    return problems


def _visible_gpus() -> int:
    """2 where torch sees at least two CUDA devices, else 1 (preflight refuses 0)."""
    from .lab import _gpu_count

    return 2 if _gpu_count() >= 2 else 1


def gpu_placement(device: str, gpus: int) -> tuple[int, str]:
    """(workers per GPU, a line saying where P and D run) for the two-rank steps."""
    if device != "cuda":
        return 1, "P and D in DRAM"
    if gpus == 1:  # the P and the D worker both on GPU 0
        return 2, "P and D both on GPU 0: the copy stays inside one device"
    return 1, "P on GPU 0, D on GPU 1"


def vram_registration(devices: list[int], nbytes: int = 64 << 20) -> dict[str, Any]:
    """Register and deregister a VRAM buffer with a NIXL agent on each device (CUDA only)."""
    import torch

    from .transport.nixl import NixlTransport

    out: dict[str, Any] = {"bytes": nbytes, "devices": []}
    for device in devices:
        torch.cuda.set_device(device)  # before the agent, as every rank does
        entry: dict[str, Any] = {"device": device, "name": torch.cuda.get_device_name(device)}
        transport = NixlTransport(f"gpu-check.{device}")
        try:
            t0 = time.perf_counter()
            memory = transport.allocate(nbytes, mem_type="VRAM", device_id=device)
            transport.register_memory(memory)
            entry["register_s"] = time.perf_counter() - t0
            transport.deregister_memory(memory)
            entry["ok"] = True
        except Exception as exc:  # reported, not raised: the summary says what failed
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        finally:
            transport.close()
        out["devices"].append(entry)
    out["ok"] = all(d["ok"] for d in out["devices"])
    return out


def torchrun_json(scenario: Path, *, nproc: int, device: str, log_dir: Path,
                  timeout: float, ranks_per_gpu: int = 1, progress_thread: bool = False
                  ) -> tuple[int, dict[str, Any] | None, str]:
    """Run ``scenario`` under ``torchrun --standalone``, through hkvsim.lab_torchrun (its store
    on loopback only); (exit status, JSON or None, stderr). Past ``timeout`` seconds the whole
    process tree (torchrun and every worker and rank it started) is killed and the exit status
    is :data:`TIMED_OUT`, with stderr saying so: a step that hangs fails, the check goes on."""
    cmd = [sys.executable, "-m", "hkvsim.lab_torchrun", "--standalone", "--nproc-per-node",
           str(nproc), "-m", "hkvsim.lab", str(scenario), "--device", device, "--json",
           "--requests", "--log-dir", str(log_dir), "--ranks-per-gpu", str(ranks_per_gpu),
           # always said: hkvsim.lab's own default depends on the device
           "--progress-thread" if progress_thread else "--no-progress-thread"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
                                "OMP_NUM_THREADS", "1")})
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        try:
            _, stderr = proc.communicate(timeout=10.0)
        except subprocess.TimeoutExpired:  # something we could not kill holds the pipes
            stderr = ""
        stdout, code = "", TIMED_OUT
        stderr += (f"\nhardware/gpu-check: {scenario.name} did not finish within {timeout:g} s "
                   f"(--timeout); torchrun and its workers were killed")
    try:
        data = json.loads(stdout) if stdout.strip() else None
    except json.JSONDecodeError:
        data = None
    return code, data, stderr


def _stat(path: Path) -> list[str] | None:
    """The fields of a /proc/<pid>/stat after the command name (state, ppid, ..., start time
    at index 19), or None once the process is gone."""
    try:
        fields = path.read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) >= 20 else None


def _descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid`` (from /proc), each with its start time (so a pid reused by
    another process later is not mistaken for it): torchrun starts its workers in sessions of
    their own, so its process group does not hold them."""
    children: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat(stat)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append((int(stat.parent.name), fields[19]))
    out: dict[int, str] = {}
    todo = [pid]
    while todo:
        for child, started in children.get(todo.pop(), []):
            out[child] = started
            todo.append(child)
    return out


def _started(pid: int) -> str | None:
    """The start time of a live process (None once it is gone or a zombie)."""
    fields = _stat(Path(f"/proc/{pid}/stat"))
    return None if fields is None or fields[0] == "Z" else fields[19]


def _pipe_holders(proc: subprocess.Popen[str]) -> dict[int, str]:
    """Processes other than this one holding ``proc``'s stdout or stderr pipe, with their
    start times: whatever torchrun started, also a worker it started after the tree was listed
    and that outlived it (re-parented, so no longer below it)."""
    pipes = {f"pipe:[{os.fstat(f.fileno()).st_ino}]" for f in (proc.stdout, proc.stderr)
             if f is not None}
    out: dict[int, str] = {}
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        pid = int(fd_dir.parent.name)
        if pid == os.getpid():
            continue
        try:
            if any(os.readlink(fd) in pipes for fd in fd_dir.iterdir()):
                started = _started(pid)
                if started is not None:
                    out[pid] = started
        except OSError:  # gone meanwhile, or not ours to look at
            continue
    return out


def _kill_tree(proc: subprocess.Popen[str], grace: float = 5.0) -> None:
    """SIGTERM to torchrun (its agent stops its workers), then SIGKILL to whatever of the tree
    is left after ``grace`` seconds, and to anything still holding its output pipes."""
    tree = _descendants(proc.pid)
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
    end = time.monotonic() + grace
    while True:
        tree.update(_descendants(proc.pid))
        tree.update(_pipe_holders(proc))
        alive = {pid: s for pid, s in tree.items() if _started(pid) == s}
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not alive or time.monotonic() > end:
            return
        tree = {}
        time.sleep(0.1)


def _variants(data: dict[str, Any] | None) -> list[dict[str, Any]]:
    if data is None:
        return []
    return list(data["scenarios"]) if "scenarios" in data else [data]


def byte_problems(data: dict[str, Any] | None, expected_variants: int) -> list[str]:
    """Why a lab result is not a byte-exact success of every variant (empty: it is)."""
    if data is None:
        return ["no result JSON (see the rank logs)"]
    problems = [f"{n['scenario']}: not run: {n['error']}" for n in data.get("not_run", [])]
    runs = _variants(data)
    if len(runs) != expected_variants:
        problems.append(f"{len(runs)} variant(s) ran, {expected_variants} expected")
    for d in runs:
        r = d["requests"]
        if not d["verified"] or r["byte_exact"] != r["total"] or r["corrupted"] or (
                d["outcome"] != "ok"):
            problems.append(f"{d['scenario']}: outcome {d['outcome']}, verified "
                            f"{d['verified']}, byte-exact {r['byte_exact']}/{r['total']}, "
                            f"corrupted {r['corrupted']}")
    return problems


def run_warnings(data: dict[str, Any] | None) -> list[str]:
    """Each variant's run warnings, once each, prefixed with the variant (a pull whose GPU reads
    UCX emulated over tcp, or whose transfer times include oracle steps, still passes: its bytes
    are right, its times are not a GPU path's, and the summary must say so)."""
    out: list[str] = []
    for d in _variants(data):
        label = ", ".join(f"{k}={v}" for k, v in (d.get("sweep_point") or {}).items())
        for w in d.get("warnings", []):
            line = f"{label}: {w}" if label else w
            if line not in out:
                out.append(line)
    return out


def calibration_rows(measured: dict[str, Any] | None, scenario: Path) -> list[dict[str, Any]]:
    """Per variant: the measured median transfer time next to the simulator's for the file."""
    from .cluster import run_scenario
    from .results import result_json
    from .scenario import load_scenarios

    runs = {d["sweep_index"]: d for d in _variants(measured)}
    rows = []
    scenarios = load_scenarios(str(scenario))
    for i, s in enumerate(scenarios):
        sim = result_json(run_scenario(s), position=(i, len(scenarios)))
        real = runs.get(i)
        sim_p50 = (sim["time"]["transfer_seconds"] or {}).get("p50")
        real_p50 = ((real or {}).get("time", {}).get("transfer_seconds") or {}).get("p50")
        rows.append({"variant": i, "point": s.sweep_point, "bytes": sim["requests"]["bytes"],
                     "descriptors": sim["requests"]["descriptors"],
                     "simulated_p50_s": sim_p50, "measured_p50_s": real_p50,
                     "error": (sim_p50 - real_p50) / real_p50 if sim_p50 and real_p50 else None,
                     "measured_byte_exact": None if real is None else
                     real["requests"]["byte_exact"]})
    return rows


SWEEP_PROFILES = {"VRAM": "h200-nvlink", "DRAM": "cpu-ucx-loopback"}
TP_PAIR_WORKERS = 8  # step 6: P TP4 + D TP4, the largest pair of gpu-tp-pairs.toml


def transfer_sweep(memory: str, budget: float, *, quick: bool = False) -> dict[str, Any]:
    """Step 3: the calibration sweep of ``hkvsim calibrate`` on ``memory``, with the simulator's
    fitted constants for it (reported, never written to a profile) and each point as the
    shipped profile for that memory predicts it (untuned: a prediction, not a fit)."""
    from .backends.calibrate import SweepPoint, fit, predict, run_sweep
    from .fabric.profile import load_profile

    raw = run_sweep(quick=quick, budget=budget, memory=memory)
    points = [SweepPoint(**p) for p in raw["points"]]
    raw["profile"] = SWEEP_PROFILES[memory]
    for p, seconds in zip(raw["points"], predict(load_profile(raw["profile"]), points)):
        p["simulated_us"] = seconds * 1e6
    # a term the fit could not resolve (every point dominated by the others) comes out infinite;
    # JSON has no infinity, so it is written as null and shown as "not resolved"
    raw["fit"] = {k: (v if math.isfinite(v) else None)
                  for k, v in fit(points).items()}
    return raw


def _sweep_markdown(sweep: dict[str, Any]) -> list[str]:
    fitted = sweep["fit"]
    bandwidth = ("bandwidth not resolved (the per-descriptor cost dominates every point)"
                 if fitted["bandwidth"] is None else f"{fitted['bandwidth'] / 1e9:.1f} GB/s")
    lines = ["", f"## NIXL transfer sweep ({sweep['memory']}, two processes)", "",
             f"UCX transports: {', '.join(sweep['transports']) or 'unknown'}; first transfer "
             f"(wire-up) {sweep['wireup_s'] * 1e3:.1f} ms; handshake "
             f"{sweep['handshake_s'] * 1e3:.1f} ms; local copy {sweep['memcpy_gbps']:.0f} GB/s; "
             f"fit: {fitted['intercept'] * 1e6:.1f} us + {fitted['per_descriptor'] * 1e6:.3f} "
             f"us/descriptor, {bandwidth}.", "",
             f"Simulated: each point as the `{sweep['profile']}` profile predicts it, untuned; "
             f"median |error| {100 * _median_error(sweep['points']):.0f} %.", "",
             "| op | descriptor | count | bytes | NIXL time | post | GB/s | merged | reps | "
             "simulated | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in sweep["points"]:
        nbytes = p["size"] * p["count"]
        error = (p["simulated_us"] - p["total_us"]) / p["total_us"]
        lines.append(f"| {p['op']} | {p['size']:,} | {p['count']:,} | {nbytes:,} | "
                     f"{p['total_us']:.1f} us | {p['post_us']:.1f} us | "
                     f"{nbytes / max(p['total_us'], 1e-3) / 1e3:.2f} | {p['merged']} | "
                     f"{p['reps']} | {p['simulated_us']:.1f} us | {100 * error:+.0f} % |")
    return lines


def _median_error(points: list[dict[str, Any]]) -> float:
    return float(np.median([abs(p["simulated_us"] - p["total_us"]) / p["total_us"]
                            for p in points]))


def _markdown(summary: dict[str, Any]) -> str:
    lines = ["# GPU check", "", f"- when: {summary['when']}", f"- device: {summary['device']}",
             f"- host: {summary['host']}"]
    if summary.get("gpus"):
        lines.append(f"- GPUs used: {summary['gpus']} ({summary['placement']})")
    lines.append(f"- NIXL progress thread: {'on' if summary.get('progress_thread') else 'off'}")
    lines.append("")
    for name, step in summary["steps"].items():
        lines.append(f"- **{name}**: {'passed' if step['ok'] else 'FAILED'}"
                     + ("" if step["ok"] else f" -- {'; '.join(step.get('problems', []))}"))
        lines += [f"  - warning: {w}" for w in step.get("warnings", [])]
    if summary.get("transfer_sweep"):
        lines += _sweep_markdown(summary["transfer_sweep"])
    if summary.get("progress_probe"):
        from .backends.progress_probe import table

        lines += ["", "## Progress probe", "", table(summary["progress_probe"])]
    rows = summary.get("calibration") or []
    if rows:
        lines += ["", "## Calibration sweep: measured vs simulated (median transfer time)", "",
                  "| variant | point | bytes | descriptors | measured | simulated | error |",
                  "|---|---|---|---|---|---|---|"]
        if summary.get("gpus") == 1:
            lines[-2:-2] = ["The simulated column uses the file's profile, which models P and D on "
                            "two GPUs joined by NVLink; here both ran on one GPU, so the measured "
                            "copy never left the device. Read the error column with that in mind.",
                            ""]
        for r in rows:
            fmt = (lambda v: "-" if v is None else f"{v * 1e3:.3f} ms")
            err = "-" if r["error"] is None else f"{r['error'] * 100:+.0f} %"
            lines.append(f"| {r['variant']} | {json.dumps(r['point'])} | {r['bytes']:,} | "
                         f"{r['descriptors']:,} | {fmt(r['measured_p50_s'])} | "
                         f"{fmt(r['simulated_p50_s'])} | {err} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hardware/gpu-check", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="reports/gpu", help="where the results go")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda (the lab); cpu runs the same torchrun steps on DRAM (CI)")
    p.add_argument("--gpus", type=int, choices=[1, 2], default=None,
                   help="GPUs to use: 2 puts P and D on different GPUs, 1 puts both on GPU 0 "
                        "(no GPU-to-GPU link is exercised); default 2 where two are visible")
    p.add_argument("--skip-sweep", action="store_true", help="no NIXL transfer sweep (step 3)")
    p.add_argument("--sweep-budget", type=float, default=60.0,
                   help="seconds of measuring for the transfer sweep (default 60)")
    p.add_argument("--skip-calibration", action="store_true",
                   help="no scenario calibration sweep (step 4)")
    p.add_argument("--skip-probe", action="store_true", help="no progress probe (step 5)")
    p.add_argument("--skip-tp-pairs", action="store_true",
                   help="no TP-pairs run (step 6, eight workers)")
    p.add_argument("--progress-thread", action=argparse.BooleanOptionalAction, default=None,
                   help="NIXL's progress thread in the ranks and the probe (default: on with "
                        "--device cuda, as vLLM runs it; off with cpu, where ranks poll NIXL in "
                        "their loop)")
    p.add_argument("--timeout", type=float, default=900.0, help="per torchrun step (s)")
    p.add_argument("--scenarios", default=str(SCENARIOS),
                   help="folder with gpu-pull-push.toml, gpu-calibration.toml and "
                        "gpu-tp-pairs.toml")
    args = p.parse_args(argv)
    if args.progress_thread is None:
        from .lab import default_progress_thread

        args.progress_thread = default_progress_thread(args.device)
    gpus = args.gpus or (_visible_gpus() if args.device == "cuda" else 2)
    problems = preflight(args.device, gpus=gpus)
    if problems:
        for text in problems:
            print(f"hardware/gpu-check: refused: {text}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                               "device": args.device, "host": os.uname().nodename, "steps": {},
                               "progress_thread": args.progress_thread,
                               "environment": {k: v for k, v in sorted(os.environ.items())
                                               if k.startswith(("UCX_", "NIXL_"))}}
    share, placement = gpu_placement(args.device, gpus)
    if args.device == "cuda":
        summary.update(gpus=gpus, placement=placement)
    steps = summary["steps"]
    if args.device == "cuda":
        reg = vram_registration(list(range(gpus)))
        (out / "vram-registration.json").write_text(json.dumps(reg, indent=2) + "\n")
        steps["vram registration"] = {"ok": reg["ok"], "problems": [
            f"cuda:{d['device']}: {d['error']}" for d in reg["devices"] if not d["ok"]]}
    memory = "VRAM" if args.device == "cuda" else "DRAM"

    def torchrun_step(title: str, file: str, name: str, json_name: str, *, nproc: int,
                      ranks_per_gpu: int) -> tuple[Path, dict[str, Any] | None]:
        """A torchrun step: run the scenario file, write its JSON, and pass only when torchrun
        exited 0 and every variant of the file ran byte-exact."""
        from .scenario import load_scenarios

        scenario = Path(args.scenarios) / file
        rc, data, err = torchrun_json(scenario, nproc=nproc, device=args.device,
                                      log_dir=out / "logs" / name, timeout=args.timeout,
                                      ranks_per_gpu=ranks_per_gpu,
                                      progress_thread=args.progress_thread)
        (out / json_name).write_text(json.dumps(data, indent=2, default=str) + "\n")
        found = byte_problems(data, len(load_scenarios(str(scenario)))) + (
            [f"torchrun exit status {rc}: {err.strip()[-400:]}"] if rc else [])
        steps[title] = {"ok": not found, "problems": found, "warnings": run_warnings(data)}
        return scenario, data

    def measured_step(title: str, key: str, json_name: str, measure: Any,
                      **dump: Any) -> None:
        """A step measured in this process (the sweep, the probe): fails with its message."""
        try:
            result = measure()
        except (RuntimeError, ValueError) as exc:
            steps[title] = {"ok": False, "problems": [str(exc)]}
            return
        summary[key] = result
        (out / json_name).write_text(json.dumps(result, indent=2, **dump) + "\n")
        steps[title] = {"ok": True, "problems": []}

    torchrun_step("tiny-kimi-linear pull and push, 2 ranks", "gpu-pull-push.toml", "pull-push",
                  "pull-push.json", nproc=2, ranks_per_gpu=share)
    if not args.skip_sweep:
        measured_step(f"NIXL transfer sweep ({memory})", "transfer_sweep", "transfer-sweep.json",
                      lambda: transfer_sweep(memory, args.sweep_budget), allow_nan=False)
    if not args.skip_calibration:
        calib, data = torchrun_step("calibration sweep", "gpu-calibration.toml", "calibration",
                                    "calibration-measured.json", nproc=2, ranks_per_gpu=share)
        summary["calibration"] = calibration_rows(data, calib)
    if not args.skip_probe:
        from .backends.progress_probe import run_probe

        measured_step(f"progress probe ({memory})", "progress_probe", "progress-probe.json",
                      lambda: run_probe(memory=memory, progress_thread=args.progress_thread,
                                        timeout=args.timeout))
    if not args.skip_tp_pairs:
        torchrun_step(f"tiny-kimi-linear TP pairs, {TP_PAIR_WORKERS} workers",
                      "gpu-tp-pairs.toml", "tp-pairs", "tp-pairs.json", nproc=TP_PAIR_WORKERS,
                      ranks_per_gpu=TP_PAIR_WORKERS // gpus if args.device == "cuda" else 1)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    (out / "summary.md").write_text(_markdown(summary))
    ok = all(s["ok"] for s in steps.values())
    print(_markdown(summary))
    print(f"hardware/gpu-check: {'passed' if ok else 'FAILED'}; results in {out}/")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
