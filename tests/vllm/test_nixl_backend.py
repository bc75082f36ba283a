"""vLLM's own connector on ``--backend nixl``: real NIXL agents, one OS process per rank (each
imports vLLM and runs vLLM's worker over its NIXL agent through the nixl_agent adapter), DRAM
caches, vLLM's handshake payloads carried by hkvsim's coordinator, every byte checked by the
oracle in the rank processes. Needs vLLM and NIXL: ``scripts/with-vllm 0.33.0 python -m pytest
-q tests/vllm`` (with-vllm installs both). The tests that plant something start the rank
processes themselves (the driver's launcher hooks) with ``_rank_launcher.py``."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hkvsim.scenario import load_scenarios
from release_expect import (
    ASSERTS_BEFORE_49762,
    RELEASES,
    assert_push_refused_by_034,
    completed_as_released,
    push_refused,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM = ROOT / "scenarios" / "vllm"
LAUNCHER = Path(__file__).resolve().parent / "_rank_launcher.py"
PULL_ASSERT_026 = "pull_worker.py:167: assert len(read_specs) == 1"
PUSH_ASSERT_026 = "push_worker.py:518: assert len(plan.all_source_ranks) == 1"


def _variant(path: Path, prefill_tp: int, decode_tp: int, order: str | None = None):
    return next(s for s in load_scenarios(path) if (s.prefill.tp, s.decode.tp) == (
        prefill_tp, decode_tp) and order in (None, s.connector.registration_order))


def _run(scenario, tmp_path: Path, plant: str | None = None):
    """The scenario on the NIXL backend; with ``plant``, every rank process is started by this
    test through ``_rank_launcher.py`` with that change planted."""
    from hkvsim.drivers.nixl import NixlRunOptions, run_scenario_nixl

    if plant is None:
        return run_scenario_nixl(scenario, options=NixlRunOptions(
            log_dir=str(tmp_path), startup_timeout=180.0))
    procs: list[subprocess.Popen] = []
    lock = threading.Lock()

    def announce(host: str, port: int, credentials: dict[tuple[str, int], str]) -> None:
        with lock:
            for (engine, rank), credential in sorted(credentials.items()):
                log = tmp_path / f"{engine}.{rank}.log"
                procs.append(subprocess.Popen(
                    [sys.executable, str(LAUNCHER), plant, host, str(port), credential, engine,
                     str(rank), str(log)], stdin=subprocess.DEVNULL))

    try:
        return run_scenario_nixl(scenario, options=NixlRunOptions(
            spawn_ranks=frozenset(), announce=announce, log_dir=str(tmp_path),
            startup_timeout=180.0))
    finally:
        for p in procs:  # they exit on the coordinator's shutdown (or when it goes away)
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _byte_exact(result) -> bool:
    """On real NIXL agents, every request completed byte-exact
    (release_expect.completed_as_released)."""
    return result.backend == "nixl" and completed_as_released(result)


def _check(result, scenario, version: str, *, fails_026: bool, assert_026: str) -> None:
    assert result.implementation == {"name": "vllm", "version": version}
    assert result.leaks["after_shutdown"] == 0 and result.leaks["open_handles"] == 0
    if push_refused(scenario, version):  # refused at the handshake, in the rank processes too
        assert_push_refused_by_034(result, scenario.scenario.name)
    elif version in RELEASES and not (version in ASSERTS_BEFORE_49762 and fails_026):
        assert _byte_exact(result), (result.outcome, [(r.status, r.reason)
                                                      for r in result.records])
    elif version in ASSERTS_BEFORE_49762:  # fails loudly at vLLM's own assert, no byte corrupted
        assert result.outcome == "request-failure", result.outcome
        assert all(r.status == "failed" and r.failure_class == "vllm_failure"
                   and assert_026 in (r.reason or "") for r in result.records), [
            (r.status, r.failure_class, r.reason) for r in result.records]
        assert result.corrupted == 0
    else:
        pytest.fail(f"no expectation recorded for vLLM {version} (add it here)")


@pytest.mark.timeout(300)
def test_kimi_linear_pull_prefill_tp2_to_decode_tp1_on_nixl(vllm_required: str, nixl_available,
                                                            tmp_path: Path) -> None:
    s = _variant(VLLM / "pr49762-kimi-linear-pull.toml", 2, 1, "state-first")
    _check(_run(s, tmp_path), s, vllm_required, fails_026=True, assert_026=PULL_ASSERT_026)


@pytest.mark.timeout(300)
def test_kimi_linear_push_prefill_tp1_to_decode_tp2_on_nixl(vllm_required: str, nixl_available,
                                                            tmp_path: Path) -> None:
    s = _variant(VLLM / "pr49762-kimi-linear-push.toml", 1, 2)
    assert s.connector.mode == "push"
    _check(_run(s, tmp_path), s, vllm_required, fails_026=True, assert_026=PUSH_ASSERT_026)


@pytest.mark.timeout(300)
def test_deepseek_pull_heterogeneous_tp_on_nixl(vllm_required: str, nixl_available,
                                                tmp_path: Path) -> None:
    s = _variant(VLLM / "tp-matrix-tiny-deepseek.toml", 1, 2, "sorted")
    _check(_run(s, tmp_path), s, vllm_required, fails_026=False, assert_026="")


@pytest.mark.timeout(300)
def test_misrouted_remote_descriptors_on_nixl_are_caught_by_the_oracle(
        vllm_required: str, nixl_available, tmp_path: Path) -> None:
    # planted in every rank process: the adapter rotates the addresses of the remote
    # descriptors (same lengths, all inside prefill's registered memory). vLLM's READs all
    # complete and it reports success; only the oracle in the decode process can tell
    s = _variant(VLLM / "tp-matrix-tiny-deepseek.toml", 1, 1, "sorted")
    result = _run(s, tmp_path, plant="misroute-remote")
    assert result.implementation == {"name": "vllm", "version": vllm_required}
    assert result.outcome == "corruption", result.outcome
    assert all(r.status == "ok" for r in result.records)  # vLLM said: success
    assert result.corrupted == len(result.records) > 0
    assert all(r.mismatched_words > 0 for r in result.records)


@pytest.mark.timeout(180)
def test_a_rank_without_vllm_fails_setup_with_one_line(nixl_available, tmp_path: Path) -> None:
    # needs NIXL only: the rank processes (started here) cannot import vLLM, whatever this
    # process can
    from hkvsim.pd.records import RankSetupError

    s = _variant(VLLM / "tp-matrix-tiny-deepseek.toml", 1, 1, "sorted")
    with pytest.raises(RankSetupError) as err:
        _run(s, tmp_path, plant="no-vllm")
    text = str(err.value)
    assert "rank setup failed" in text and "\n" not in text
    assert "connector.implementation" in text
    assert "needs vLLM, which is not importable here" in text
    assert "scripts/with-vllm 0.34.0 hkvsim run FILE" in text


@pytest.mark.timeout(600)
def test_diff_on_real_nixl_gqa_hetero_tp(vllm_required: str, nixl_available: None,
                                         tmp_path: Path) -> None:
    # `hkvsim diff --backend nixl`: both implementations on real NIXL agents, one process per
    # rank; tiny-llama HND pull, prefill TP 2 -> decode TP 1 (decode reads both prefill ranks'
    # head slabs into one block): the same outcome, transfers, descriptors and bytes, byte-exact
    from hkvsim.implementations.diff import diff_scenario

    scenario = _variant(VLLM / "tp-matrix-tiny-llama.toml", 2, 1)
    found, core, vllm = diff_scenario(scenario, backend="nixl")
    assert found == []
    assert core.backend == vllm.backend == "nixl"
    assert core.implementation.get("name", "hkvsim") == "hkvsim"
    assert vllm.implementation == {"name": "vllm", "version": vllm_required}
    assert _byte_exact(core) and _byte_exact(vllm)
    assert [r.transfers for r in vllm.records] == [r.transfers for r in core.records]
    assert all(r.transfers == 2 for r in vllm.records)  # one READ per prefill rank


def test_diff_cli_passes_the_backend(monkeypatch, capsys) -> None:
    import hkvsim.implementations.diff as diff
    from hkvsim.cli import main

    seen = []

    def fake(scenario, backend="sim"):
        seen.append(backend)
        raise SystemExit(0)  # stop after the call: only the wiring is checked here

    monkeypatch.setattr(diff, "diff_scenario", fake)
    with pytest.raises(SystemExit):
        main(["diff", str(VLLM / "tp-matrix-tiny-llama.toml"), "--backend", "nixl"])
    assert seen == ["nixl"]
    with pytest.raises(SystemExit):
        main(["diff", str(VLLM / "tp-matrix-tiny-llama.toml")])
    assert seen == ["nixl", "sim"]
