"""With NIXL's progress thread off (hkvsim's ranks' default), a transfer that carries a
notification completes only once its *remote* calls into NIXL. Measured here on UCX cma (DRAM)
and on one H200 with cuda_ipc (reports/gpu/README.md). A run must say when its transfers waited
for a remote busy with its own work, and the progress probe must show the rule itself."""

from __future__ import annotations

import pytest

from hkvsim.drivers.nixl import NixlRunOptions, run_scenario_nixl
from hkvsim.results import result_json
from hkvsim.scenario import parse_scenarios

pytestmark = [pytest.mark.usefixtures("nixl_required")]

# request 0 is small; request 1 is large, so prefill fills its oracle pattern (hundreds of ms
# without a NIXL call) while decode reads request 0
HOLD = """
[scenario]
name = "a busy remote"
seed = 3
[model]
preset = "llama-3.1-8b"
[prefill]
tp = 1
[decode]
tp = 1
[connector]
mode = "pull"
[workload]
trace = "trace.csv"
"""


def _run(tmp_path, progress_thread: bool) -> dict:
    (tmp_path / "trace.csv").write_text("arrival_s,prompt_tokens,prefix_hit_tokens\n"
                                        "0,64,0\n0,8192,0\n")
    (tmp_path / "s.toml").write_text(HOLD)
    (scenario,) = parse_scenarios(HOLD, source=str(tmp_path / "s.toml"), base_dir=tmp_path)
    result = run_scenario_nixl(scenario, options=NixlRunOptions(
        log_dir=str(tmp_path / "logs"), progress_thread=progress_thread))
    return result_json(result, requests=True)


def _held(data: dict) -> list[str]:
    return [w for w in data["warnings"] if "remote rank ran" in w]


@pytest.mark.timeout(180)
def test_a_remote_busy_with_its_oracle_holds_a_notified_transfer(tmp_path) -> None:
    data = _run(tmp_path, progress_thread=False)
    assert data["verification"] == "verified" and data["requests"]["byte_exact"] == 2
    first = data["request_details"][0]
    assert [t["peer"] for t in first["telemetry"]] == ["prefill0.0"]  # the remote, by name
    (text,) = _held(data)
    assert text.startswith("1 of 2 transfers were in progress while their remote rank ran "
                           "OracleWrite for 0.05 s or more without calling into NIXL")


@pytest.mark.timeout(180)
def test_with_the_progress_thread_on_a_run_is_byte_exact_and_warns_of_no_hold(tmp_path) -> None:
    data = _run(tmp_path, progress_thread=True)
    assert data["verification"] == "verified" and data["requests"]["byte_exact"] == 2
    assert _held(data) == []


def _cells(result: dict) -> dict[tuple[str, bool, str, str], dict]:
    return {(c["target"], c["notification"], c["op"], c["initiator"]): c
            for c in result["cells"]}


@pytest.mark.timeout(120)
def test_the_probe_shows_a_notified_transfer_waiting_for_its_busy_target() -> None:
    from hkvsim.backends.progress_probe import run_probe, table

    result = run_probe(memory="DRAM", size=65536, count=4, reps=3, busy_reps=3, busy_ms=150.0,
                       target_poll_ms=1.0)
    cells = _cells(result)
    assert set(cells) == {(t, n, op, i) for t in ("polls", "cpu-busy") for n in (False, True)
                          for op in ("READ", "WRITE")
                          for i in (("spin", "check-100us") if t == "polls" else ("spin",))}
    for op in ("READ", "WRITE"):
        waited, free = cells[("cpu-busy", True, op, "spin")], cells[("cpu-busy", False, op, "spin")]
        assert waited["waits_for_target"] and waited["post_to_done_ms"] >= 100
        assert waited["busy_end_to_done_ms"] >= 0
        assert not free["waits_for_target"] and free["busy_end_to_done_ms"] < -50
    assert "| cpu-busy | yes | READ | spin |" in table(result)
    assert result["transports"] == ["cma/memory"]

    threaded = _cells(run_probe(memory="DRAM", size=65536, count=4, reps=3, busy_reps=3,
                                busy_ms=150.0, targets=("cpu-busy",), progress_thread=True))
    for op in ("READ", "WRITE"):
        assert not threaded[("cpu-busy", True, op, "spin")]["waits_for_target"]


@pytest.mark.parametrize("kwargs, text", [
    ({"memory": "HBM"}, "memory must be DRAM or VRAM, got 'HBM'"),
    ({"targets": ("gpu-busy",)}, "gpu-busy with VRAM only"),
    ({"targets": ("idle",)}, "allowed ['polls', 'cpu-busy', 'gpu-busy']"),
    ({"busy_ms": 0}, "must be positive"),
])
def test_the_probe_refuses_bad_settings_before_starting(kwargs: dict, text: str) -> None:
    from hkvsim.backends.progress_probe import run_probe

    with pytest.raises(ValueError) as exc:
        run_probe(**kwargs)
    assert text in str(exc.value)


@pytest.mark.timeout(120)
def test_the_probe_command_writes_its_json_and_table_and_refuses_clearly(tmp_path) -> None:
    import json
    import subprocess
    import sys

    probe = [sys.executable, "-m", "hkvsim.backends.progress_probe"]
    out = subprocess.run([*probe, "--size", "65536", "--count", "4", "--busy-reps", "2",
                          "--busy-ms", "120", "--targets", "cpu-busy", "--out",
                          str(tmp_path / "p.json")], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads((tmp_path / "p.json").read_text())
    assert data["memory"] == "DRAM" and data["progress_thread"] is False
    assert [(c["notification"], c["waits_for_target"]) for c in data["cells"]] == [
        (False, False), (False, False), (True, True), (True, True)]
    assert "| cpu-busy | yes | WRITE | spin |" in out.stdout
    bad = subprocess.run([*probe, "--targets", "gpu-busy"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip().startswith("progress probe: target modes ['gpu-busy']: allowed")
