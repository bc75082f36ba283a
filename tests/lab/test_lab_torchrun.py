"""The GPU-lab path on CPU: ``torchrun --standalone --nproc-per-node K -m hkvsim.lab`` with DRAM
NIXL, one torchrun worker per rank, the coordinator in global rank 0, everything met through
torchrun's store. The same code a lab runs with ``--device cuda`` (issue #13 item 7)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from .conftest import ROOT

KIMI_SWEEP = """
[scenario]
name = "tiny-kimi-linear lab"
seed = 11
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 1
[decode]
tp = 2
[connector]
registration_order = "state-first"
lease_seconds = 10.0
transfer_timeout_seconds = 20.0
[fabric]
profile = "cpu-ucx-loopback"
[workload]
requests = 3
# an odd length, N-1 an exact multiple of the TP1 logical block, a short one
prompt_tokens = [1501, 641, 37]
[sweep]
"connector.mode" = ["pull", "push"]
"decode.tp" = [2, 4]
"""

KILL = """
[scenario]
name = "a decode rank dies under torchrun"
seed = 11
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 1
[decode]
tp = 2
[connector]
lease_seconds = 10.0
transfer_timeout_seconds = 20.0
[workload]
requests = 3
prompt_tokens = [1501, 641, 37]
[[faults]]
kind = "kill-rank"
engine = "decode0"
rank = 1
request = 1
"""


def _torchrun(torchrun: list[str], tmp_path, text: str, *extra: str, nproc: int = 3,
              timeout: float = 240, env: dict[str, str] | None = None
              ) -> subprocess.CompletedProcess:
    path = tmp_path / "s.toml"
    path.write_text(text)
    return subprocess.run(
        [*torchrun, "--standalone", "--nproc-per-node", str(nproc), "-m", "hkvsim.lab",
         str(path), "--log-dir", str(tmp_path / "logs"), *extra],
        capture_output=True, text=True, cwd=tmp_path, timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def _rank0_exit(stderr: str) -> int | None:
    """Global rank 0's exit status, from torchrun's failure summary (torchrun exits 1)."""
    found = re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s*\n\s*exitcode\s*:\s*(-?\d+)", stderr)
    return int(found.group(1)) if found else None


@pytest.mark.timeout(300)
def test_torchrun_runs_pull_and_push_byte_exact_and_a_too_large_variant_fails_alone(
        torchrun, tmp_path) -> None:
    out = _torchrun(torchrun, tmp_path, KIMI_SWEEP, "--json", "--requests")
    # two variants (D TP4: 5 ranks) cannot be placed on 3 workers: rank 0 exits 2 (torchrun
    # says so, and exits 1 itself), the others ran
    assert out.returncode == 1 and _rank0_exit(out.stderr) == 2, out.stderr[-3000:]
    data = json.loads(out.stdout)
    ran = {(d["sweep_point"]["connector.mode"], d["sweep_point"]["decode.tp"]): d
           for d in data["scenarios"]}
    assert set(ran) == {("pull", 2), ("push", 2)}
    for d in ran.values():
        assert d["backend"] == "nixl" and d["outcome"] == "ok" and d["expectation_met"]
        assert d["verified"] is True and d["requests"]["byte_exact"] == 3
        assert d["requests"]["corrupted"] == 0 and d["requests"]["mismatched_bytes"] == 0
        # every transfer's telemetry names the UCX transport its (torchrun worker) rank used
        telemetry = [t for r in d["request_details"] for t in r["telemetry"]]
        assert telemetry and all(any("/" in hop for hop in t["path"]) for t in telemetry)
    # the same bytes the simulator moves for the same variants
    sim = json.loads(subprocess.run(
        [sys.executable, "-m", "hkvsim.cli", "run", str(tmp_path / "s.toml"), "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=120).stdout)
    for s in sim["scenarios"]:
        key = (s["sweep_point"]["connector.mode"], s["sweep_point"]["decode.tp"])
        if key in ran:
            assert ran[key]["requests"]["bytes"] == s["requests"]["bytes"] > 0
    assert len(data["not_run"]) == 2 and data["variants"] == 4
    assert {d["sweep_index"] for d in data["scenarios"]} | {
        n["variant"] for n in data["not_run"]} == {0, 1, 2, 3}
    for skipped in data["not_run"]:
        assert skipped["error"] == ("the variant needs 5 rank process(es); torchrun started 3 "
                                    "(--nnodes x --nproc-per-node must be at least 5)")
    assert data["expectation_met"] is False
    assert "needs 5 rank process(es)" in out.stderr
    # every rank was a torchrun worker with its own log, per round (one round per variant run)
    logs = sorted(p.relative_to(tmp_path / "logs").as_posix()
                  for p in (tmp_path / "logs").rglob("*.log"))
    assert logs == [f"round{r:03d}/{name}.log" for r in range(2)
                    for name in ("decode0.0", "decode0.1", "prefill0.0")]


@pytest.mark.timeout(300)
def test_a_rank_killed_mid_run_fails_torchrun_and_hkvsim_names_it(torchrun, tmp_path) -> None:
    out = _torchrun(torchrun, tmp_path, KILL, "--json")
    assert out.returncode != 0
    assert out.stdout.strip() == ""  # no result is claimed for a run that was cut short
    # torchrun's agent: the worker that died, and how
    assert "ChildFailedError" in out.stderr and "hkvsim.lab FAILED" in out.stderr
    assert re.search(r"rank\s*:\s*2 \(local_rank: 2\)\s*\n\s*exitcode\s*:\s*-9", out.stderr)
    # hkvsim's coordinator: which rank of the scenario that was
    assert re.search(r"hkvsim\.lab: error: torchrun stopped the run \(signal 15\) during a "
                     r"decode rank dies under torchrun: decode0 rank 1 \(pid \d+\) died: "
                     r"closed its side channel \(torchrun global rank 2, node 0, local rank 2\)",
                     out.stderr), out.stderr[-3000:]


@pytest.mark.timeout(300)
def test_a_vram_run_without_gpus_fails_each_variant_before_placing(torchrun, tmp_path) -> None:
    """The GPU count is checked before ranks are placed: on this CPU box every worker reports
    0 CUDA devices, so each variant fails with one line and nothing starts."""
    out = _torchrun(torchrun, tmp_path, KIMI_SWEEP.replace('"decode.tp" = [2, 4]',
                                                           '"decode.tp" = [2]'), "--device",
                    "cuda", "--json")
    assert out.returncode == 1 and _rank0_exit(out.stderr) == 2, out.stderr[-3000:]
    data = json.loads(out.stdout)
    assert data["scenarios"] == [] and len(data["not_run"]) == 2
    for n in data["not_run"]:
        assert n["error"] == ("the variant needs 3 GPU(s), one per rank; 0 worker(s) have one "
                              "(node 0: 3 worker(s), 0 GPU(s))")
    assert not (tmp_path / "logs").exists() or not list((tmp_path / "logs").rglob("*.log"))


@pytest.mark.timeout(120)
def test_expandable_segments_is_refused_in_one_line(torchrun, tmp_path) -> None:
    out = _torchrun(torchrun, tmp_path, KILL, "--device", "cuda", nproc=1,
                    env={"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64,expandable_segments:True"})
    assert out.returncode != 0
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("hkvsim.lab: error:")]
    assert lines == ["hkvsim.lab: error: PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True: "
                     "VMM-backed VRAM may not export over cuda_ipc; unset it or set "
                     "expandable_segments:False"]


@pytest.mark.timeout(120)
def test_a_rank_that_fails_setup_fails_the_start_at_once(torchrun, tmp_path) -> None:
    """A VRAM run on this CPU box: every rank refuses at setup. The driver says so as soon as
    the first one does, not after its 60 s startup deadline (one failed variant of a lab sweep
    costs seconds)."""
    import time

    import torch

    from hkvsim.drivers.nixl import NixlRunError, NixlRunOptions, run_scenario_nixl
    from hkvsim.scenario import parse_scenarios

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    (scenario,) = parse_scenarios(KILL.split("[[faults]]")[0])
    start = time.monotonic()
    with pytest.raises(NixlRunError) as exc:
        run_scenario_nixl(scenario, options=NixlRunOptions(
            device="cuda", startup_timeout=60.0, log_dir=str(tmp_path)))
    assert time.monotonic() - start < 40
    assert str(exc.value).startswith("rank setup failed: ")
    assert "RuntimeError: VRAM requested but torch sees no CUDA device" in str(exc.value)


@pytest.mark.timeout(300)
def test_gpu_check_steps_run_on_cpu(torchrun, tmp_path) -> None:
    """hardware/gpu-check's torchrun steps, on DRAM (--device cpu skips VRAM registration):
    the two-rank pull and push is checked byte by byte and written to the report folder, and
    the calibration table puts measured and simulated medians side by side."""
    from hkvsim.lab_check import byte_problems, calibration_rows

    out_dir = tmp_path / "gpu"
    out = subprocess.run([sys.executable, str(ROOT / "hardware" / "gpu-check"), "--device",
                          "cpu", "--skip-calibration", "--skip-sweep", "--skip-tp-pairs", "--out",
                          str(out_dir)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["device"] == "cpu" and summary["progress_thread"] is False
    # no warnings on DRAM: UCX cma copies inside the post (no transfer in progress during an
    # oracle step) and moves no GPU memory
    assert summary["steps"] == {"tiny-kimi-linear pull and push, 2 ranks": {
        "ok": True, "problems": [], "warnings": []},
        "progress probe (DRAM)": {"ok": True, "problems": []}}
    text = (out_dir / "summary.md").read_text()
    assert "- **tiny-kimi-linear pull and push, 2 ranks**: passed" in text
    assert "- NIXL progress thread: off" in text and "## Progress probe" in text
    # the probe's finding, on DRAM with the thread off: a notified transfer waits for its busy
    # target, one without a notification does not
    probe = json.loads((out_dir / "progress-probe.json").read_text())
    waits = {(c["notification"], c["op"]): c["waits_for_target"] for c in probe["cells"]
             if c["target"] == "cpu-busy"}
    assert waits == {(True, "READ"): True, (True, "WRITE"): True, (False, "READ"): False,
                     (False, "WRITE"): False}
    data = json.loads((out_dir / "pull-push.json").read_text())
    assert byte_problems(data, 2) == []
    assert {d["sweep_point"]["connector.mode"] for d in data["scenarios"]} == {"pull", "push"}
    # a result that is not byte-exact is a failed step, whatever else it says
    bad = json.loads(json.dumps(data))
    bad["scenarios"][1]["requests"]["byte_exact"] = 2
    assert byte_problems(bad, 2) == [
        f"{bad['scenarios'][1]['scenario']}: outcome ok, verified True, byte-exact 2/3, "
        f"corrupted 0"]
    assert byte_problems(None, 2) == ["no result JSON (see the rank logs)"]
    rows = calibration_rows(data, ROOT / "hardware" / "scenarios" / "gpu-pull-push.toml")
    assert [r["point"] for r in rows] == [{"connector.mode": "pull"}, {"connector.mode": "push"}]
    for r, d in zip(rows, data["scenarios"]):
        assert r["measured_p50_s"] == d["time"]["transfer_seconds"]["p50"] > 0
        assert r["simulated_p50_s"] > 0 and r["bytes"] == d["requests"]["bytes"]
        assert r["error"] == pytest.approx(
            (r["simulated_p50_s"] - r["measured_p50_s"]) / r["measured_p50_s"])


@pytest.mark.timeout(300)
def test_two_torchrun_nodes_on_loopback_put_prefill_and_decode_apart(torchrun, tmp_path) -> None:
    """The multi-node path: two torchrun agents (--nnodes 2, c10d rendezvous on 127.0.0.1),
    two workers each, so P TP2 runs on one node and D TP2 on the other; byte-exact, and only
    global rank 0's node prints the result."""
    import socket

    path = tmp_path / "s.toml"
    path.write_text(KILL.split("[[faults]]")[0].replace("tp = 1", "tp = 2"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(
        [*torchrun, "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "lab-test", "--node-rank", str(n),
         "-m", "hkvsim.lab", str(path), "--json", "--bind", "127.0.0.1", "--log-dir",
         str(tmp_path / f"node{n}")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        cwd=tmp_path, env=env) for n in range(2)]
    try:
        outs = [a.communicate(timeout=240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.kill()
    assert [a.returncode for a in agents] == [0, 0], [e[-2000:] for _, e in outs]
    printed = [o for o, _ in outs if o.strip()]
    assert len(printed) == 1
    data = json.loads(printed[0])
    assert data["outcome"] == "ok" and data["verified"] and data["requests"]["byte_exact"] == 3
    logs = {n: sorted(p.name for p in (tmp_path / f"node{n}").rglob("*.log")) for n in range(2)}
    assert sorted(logs.values()) == [["decode0.0.log", "decode0.1.log"],
                                     ["prefill0.0.log", "prefill0.1.log"]]


@pytest.mark.timeout(120)
def test_a_gpu_check_step_that_hangs_fails_and_leaves_no_process(torchrun, tmp_path) -> None:
    """On the first H200 run the scenario calibration step outran its timeout, and gpu-check
    died with a traceback and wrote no summary. A step past its timeout now fails with a line
    saying so, and torchrun's workers and ranks are killed with it."""
    import time

    from hkvsim.lab_check import TIMED_OUT, torchrun_json

    logs = tmp_path / "hung-step-logs"
    start = time.monotonic()
    rc, data, err = torchrun_json(ROOT / "hardware" / "scenarios" / "gpu-pull-push.toml",
                                  nproc=2, device="cpu", log_dir=logs, timeout=2.0)
    assert time.monotonic() - start < 30
    assert (rc, data) == (TIMED_OUT, None)
    assert err.endswith("hardware/gpu-check: gpu-pull-push.toml did not finish within 2 s "
                        "(--timeout); torchrun and its workers were killed")
    time.sleep(1.0)
    left = subprocess.run(["pgrep", "-f", str(logs)], capture_output=True, text=True)
    assert left.stdout == "", f"processes left behind: {left.stdout}"
