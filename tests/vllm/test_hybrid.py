"""Hybrid models (attention + recurrent state over the same tensors) under vLLM's own pull worker,
and the #49762 KimiLinear scenarios, per vLLM release."""

from __future__ import annotations

from pathlib import Path

import pytest

from hkvsim.cluster import run_scenario
from hkvsim.scenario import load_scenarios

from release_expect import (
    ASSERTS_BEFORE_49762,
    PUSH_GEOMETRY_REFUSED,
    RELEASES,
    assert_push_refused_by_034,
    completed_as_released,
    push_refused,
    without_unreported_push,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM = ROOT / "scenarios" / "vllm"
PR49762 = VLLM / "pr49762-kimi-linear-pull.toml"
# vLLM 0.26.0's assert: with MLA and prefill TP > decode TP it allows one READ, but the KDA state
# is sharded over every prefill rank, so a hybrid needs one per rank
ASSERT_026 = "pull_worker.py:167: assert len(read_specs) == 1"


def _byte_exact(result) -> bool:
    """Every request completed byte-exact (release_expect.completed_as_released)."""
    return completed_as_released(result)


@pytest.mark.timeout(600)
def test_pr49762_kimi_linear_pull_per_release(vllm_required: str) -> None:
    scenarios = load_scenarios(PR49762)
    assert len(scenarios) == 6
    tps = {(s.prefill.tp, s.decode.tp) for s in scenarios}
    assert {(2, 1), (1, 2), (4, 1), (1, 4)} <= tps  # heterogeneous TP both ways
    _check_per_release(scenarios, vllm_required)


@pytest.mark.timeout(600)
def test_kimi_linear_tp_matrix_per_release(vllm_required: str) -> None:
    scenarios = load_scenarios(VLLM / "tp-matrix-tiny-kimi-linear.toml")
    assert len(scenarios) == 32
    pairs = {(s.prefill.tp, s.decode.tp, s.connector.registration_order) for s in scenarios}
    assert len(pairs) == 32  # every pair of 1/2/4/8, both ways, two registration orders
    _check_per_release(scenarios, vllm_required)


@pytest.mark.timeout(300)
def test_kimi_linear_pull_with_n_minus_1_on_kernel_block_boundaries_per_release(
        vllm_required: str) -> None:
    # 0.34.0 pairs blocks of different logical sizes by remote_num_tokens: the harness must
    # forward N-1 for a model with state (N pairs these prompts a kernel block apart)
    scenarios = load_scenarios(VLLM / "hybrid-pull-block-boundary.toml")
    assert all(s.prefill.tp != s.decode.tp for s in scenarios)
    assert [(n - 1) % 64 for n in scenarios[0].workload.prompt_tokens] == [0, 0, 0, 59]
    _check_per_release(scenarios, vllm_required)


PUSH_ASSERT_026 = "push_worker.py:518: assert len(plan.all_source_ranks) == 1"


@pytest.mark.timeout(600)
def test_pr49762_kimi_linear_push_per_release(vllm_required: str) -> None:
    scenarios = load_scenarios(VLLM / "pr49762-kimi-linear-push.toml")
    assert len(scenarios) == 6 and all(s.connector.mode == "push" for s in scenarios)
    tps = {(s.prefill.tp, s.decode.tp) for s in scenarios}
    assert {(2, 1), (1, 2), (4, 1), (1, 4)} <= tps
    # 0.26.0 push: prefill TP < decode TP fails at vLLM's single-target assert
    _check_per_release(scenarios, vllm_required, fails_026=lambda p, d: p < d,
                       assert_026=PUSH_ASSERT_026)


@pytest.mark.timeout(600)
def test_kimi_linear_push_tp_matrix_per_release(vllm_required: str) -> None:
    scenarios = load_scenarios(VLLM / "push-tp-matrix-tiny-kimi-linear.toml")
    assert all(s.connector.mode == "push" and s.model.preset == "tiny-kimi-linear"
               for s in scenarios)
    pairs = {(s.prefill.tp, s.decode.tp, s.connector.registration_order) for s in scenarios}
    assert len(scenarios) == len(pairs) == 32  # every pair of 1/2/4/8, both ways, both orders
    # 0.26.0 push: prefill TP < decode TP fails at vLLM's single-target assert
    _check_per_release(scenarios, vllm_required, fails_026=lambda p, d: p < d,
                       assert_026=PUSH_ASSERT_026)


@pytest.mark.timeout(600)
def test_push_tp_matrix_tiny_deepseek_per_release(vllm_required: str) -> None:
    scenarios = load_scenarios(VLLM / "push-tp-matrix-tiny-deepseek.toml")
    assert len({(s.prefill.tp, s.decode.tp) for s in scenarios}) == 16
    assert all(s.model.preset == "tiny-deepseek" for s in scenarios)
    # pure MLA: 0.26.0's single-target assert holds (its mapping collapses MLA to one rank)
    _check_per_release(scenarios, vllm_required, fails_026=lambda p, d: False)


def _agrees_with_the_core(s, result, vllm_required: str) -> None:
    """hkvsim's core, moving what this release moves (``like_vllm``: its transfer extent),
    takes the same transfers with the same descriptor and byte counts per rank pair, and the
    same verdicts, as vLLM (compare_results: no difference)."""
    from hkvsim.implementations.diff import compare_results, with_implementation

    core = run_scenario(with_implementation(s, "hkvsim", like_vllm=vllm_required))
    found = without_unreported_push(result, compare_results(s.scenario.name, core, result))
    assert found == [], [str(d) for d in found]


def _check_per_release(scenarios, vllm_required: str, *, fails_026=lambda p, d: p > d,
                       assert_026: str = ASSERT_026) -> None:
    for s in scenarios:
        result = run_scenario(s)
        name = s.scenario.name
        assert result.implementation == {"name": "vllm", "version": vllm_required}
        if vllm_required not in RELEASES:
            pytest.fail(f"no expectation recorded for vLLM {vllm_required} (add it here)")
        if vllm_required in PUSH_GEOMETRY_REFUSED:
            # push between engines of different block geometry (a hybrid's logical block
            # follows its TP) is refused at the handshake; every other pair is byte-exact,
            # and moves what hkvsim's core moves with transfer_extent "needed"
            if push_refused(s, vllm_required):
                assert_push_refused_by_034(result, name)
            else:
                assert _byte_exact(result), (name, result.outcome)
                _agrees_with_the_core(s, result, vllm_required)
        elif vllm_required in ASSERTS_BEFORE_49762 and fails_026(s.prefill.tp, s.decode.tp):
            # fails loudly, vLLM's own assert named
            assert result.outcome == "request-failure", (name, result.outcome)
            assert all(r.status == "failed" and r.failure_class == "vllm_failure"
                       and assert_026 in (r.reason or "") for r in result.records), name
            assert result.corrupted == 0
        else:  # (0.26.0: decode TP > prefill TP, one source rank per decode rank) byte-exact
            assert _byte_exact(result), (name, result.outcome)
            _agrees_with_the_core(s, result, vllm_required)


@pytest.mark.timeout(300)
def test_gdn_hybrid_with_homogeneous_tp_is_byte_exact(vllm_required: str) -> None:
    for s in load_scenarios(VLLM / "gdn-nhd-tiny-qwen3-next.toml"):
        result = run_scenario(s)
        assert _byte_exact(result), (s.scenario.name, result.outcome)


@pytest.mark.timeout(300)
def test_gdn_hybrid_push_with_homogeneous_tp_is_byte_exact(vllm_required: str) -> None:
    scenarios = load_scenarios(VLLM / "push-gdn-nhd-tiny-qwen3-next.toml")
    assert all(s.connector.mode == "push" for s in scenarios)
    for s in scenarios:
        result = run_scenario(s)
        assert _byte_exact(result), (s.scenario.name, result.outcome)


@pytest.mark.timeout(300)
def test_replicated_heads_into_nhd_decode_corrupts_under_vllm(vllm_required: str) -> None:
    # the finding of docs/vllm.md: hkvsim's core refuses the pair; vLLM reports every request
    # successful and the oracle finds the attention K/V scrambled
    from hkvsim.implementations.diff import with_implementation

    (s,) = load_scenarios(VLLM / "finding-gdn-nhd-replicated-heads.toml")
    core = run_scenario(with_implementation(s, "hkvsim"))
    assert core.handshake_errors and "V5" in core.handshake_errors[0]
    result = run_scenario(s)
    assert result.outcome == "corruption"
    assert all(r.status == "ok" for r in result.records)  # vLLM said: success
    assert result.corrupted == len(result.records)
    assert any("(K/V)" in m for r in result.records for m in r.mismatches)


@pytest.mark.timeout(300)
def test_state_bytes_are_checked_planted_half_recurrent_state(vllm_required: str,
                                                              monkeypatch) -> None:
    # planted harness bug: both engines tell vLLM the recurrent state has half its heads, so
    # vLLM moves every attention byte and conv state but only half of each recurrent state;
    # only hkvsim's oracle, checking the state pages, can tell
    from hkvsim.implementations.vllm import engine

    real = engine.VllmHarness.mamba_spec

    def half(self, layout):
        spec = real(self, layout)
        conv, ssm = spec.shapes
        return type(spec)(**{**{f: getattr(spec, f) for f in spec.__dataclass_fields__},
                             "shapes": (conv, (ssm[0] // 2, *ssm[1:]))})

    monkeypatch.setattr(engine.VllmHarness, "mamba_spec", half)
    s = next(s for s in load_scenarios(PR49762) if (s.prefill.tp, s.decode.tp) == (1, 2))
    result = run_scenario(s)
    assert result.outcome == "corruption"
    text = " ".join(m for r in result.records for m in r.mismatches)
    assert "recurrent state" in text and "(MLA)" not in text


def test_state_kinds_vllm_cannot_split_are_one_line_refusals() -> None:
    # needs no vLLM: the harness hands vLLM KDA and GDN state only (vLLM's connector splits conv
    # state for Mamba1, Mamba2 and GDN; hkvsim's Mamba2 page is not mapped yet)
    import dataclasses

    from hkvsim.geometry.presets import preset
    from hkvsim.geometry.specs import mamba2_state
    from hkvsim.implementations.vllm.engine import unsupported

    kimi = preset("tiny-kimi-linear")
    assert unsupported(kimi, "pull", "0.33.0") is None
    assert unsupported(preset("tiny-qwen3-next"), "pull", "0.26.0") is None
    m2 = dataclasses.replace(kimi, state=mamba2_state(
        intermediate_size=256, n_groups=1, d_state=16, num_heads=8, head_dim=32, conv_kernel=4))
    why = unsupported(m2, "pull", "0.33.0")
    assert why is not None and "state kind 'mamba2'" in why and "allowed: gdn, kda" in why
    assert "\n" not in why


@pytest.mark.timeout(300)
def test_hybrid_runs_reproduce(vllm_required: str, tmp_path: Path, capsys) -> None:
    from hkvsim.cli import main

    text = PR49762.read_text()
    head = text.split("[sweep]")[0]
    path = tmp_path / "k.toml"
    path.write_text(head.replace("[prefill]\n", "[prefill]\ntp = 2\n")
                    .replace("[decode]\n", "[decode]\ntp = 4\n")
                    + '[expect]\noutcome = "ok"\n')
    outs = []
    for _ in range(2):
        assert main(["run", str(path), "--json", "--requests"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1]  # same bytes, same simulated times


@pytest.mark.timeout(300)
def test_a_misrouted_push_write_is_caught_by_the_oracle(vllm_required: str,
                                                        monkeypatch) -> None:
    # planted bug: the harness hands vLLM's push worker decode's block ids in reverse order;
    # vLLM's WRITEs all complete into the request's own blocks, only the oracle can tell
    from hkvsim.implementations.vllm import engine

    real = engine.VllmHarness.start_push

    def reversed_remote(self, rank, p_rid, decode, d_rid, local, remote):
        return real(self, rank, p_rid, decode, d_rid, local,
                    tuple(list(reversed(g)) for g in remote))

    monkeypatch.setattr(engine.VllmHarness, "start_push", reversed_remote)
    # 0.34.0 refuses KimiLinear push across TPs (different kernel blocks per logical block):
    # the same requests between equal TPs there
    path, tps = ((VLLM / "push-tp-matrix-tiny-kimi-linear.toml", (2, 2))
                 if vllm_required in PUSH_GEOMETRY_REFUSED
                 else (VLLM / "pr49762-kimi-linear-push.toml", (2, 1)))
    s = next(s for s in load_scenarios(path) if (s.prefill.tp, s.decode.tp) == tps)
    assert tuple(s.workload.prompt_tokens) == (700, 1500, 300)
    result = run_scenario(s)
    assert result.outcome == "corruption"
    # requests 0 and 1 span several logical blocks; request 2 (300 tokens) fits in one, which
    # reversing leaves in place
    assert result.corrupted == 2
    assert all(r.status == "ok" for r in result.records)  # vLLM said: success


@pytest.mark.timeout(300)
def test_gqa_push_to_decode_tp_over_kv_heads_corrupts_under_vllm(vllm_required: str) -> None:
    # vLLM finding (0.26.0, 0.27.0, 0.33.0): tiny-qwen3-next (2 KV heads), NHD caches, push
    # prefill TP 1/2 -> decode TP 4. The reverse handshake skips the contiguous-heads check
    # because decode's KV is replicated; success is reported, but the second replica of each
    # head receives nothing and (prefill TP 1) the first gets head slices of NHD pages.
    # hkvsim's core refuses the pair (rule V5); homogeneous TP 4 is byte-exact. 0.34.0 refuses
    # both pairs at its block geometry check (the hybrid's ppl differs between these TPs).
    from hkvsim.implementations.diff import with_implementation

    scenarios = load_scenarios(VLLM / "gqa-push-decode-tp-over-kv-heads.toml")
    assert [(s.prefill.tp, s.decode.tp) for s in scenarios] == [(4, 4), (1, 4), (2, 4)]
    assert all(s.connector.mode == "push" and s.decode.tp > 2 for s in scenarios)
    homogeneous, *hetero = scenarios
    assert _byte_exact(run_scenario(homogeneous))
    for s in hetero:
        result = run_scenario(s)
        assert result.implementation == {"name": "vllm", "version": vllm_required}
        if vllm_required in PUSH_GEOMETRY_REFUSED:
            assert push_refused(s, vllm_required), s.scenario.name
            assert_push_refused_by_034(result, s.scenario.name)
        else:
            assert result.outcome == "corruption", (s.scenario.name, result.outcome)
            assert all(r.status == "ok" and r.mismatched_words > 0 for r in result.records)
        core = run_scenario(with_implementation(s, "hkvsim"))
        assert core.outcome == "handshake-error", core.outcome
        assert all(r.status == "failed" and r.failure_class == "handshake_failed"
                   for r in core.records)
