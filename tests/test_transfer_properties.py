"""Property tests: random valid deployments are byte-exact; random invalid ones are refused at
handshake with the specific rule; random faults on valid deployments never leave a request
reported successful with wrong bytes, a request that never ends, or a leak."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hkvsim.cluster import run_scenario
from hkvsim.scenario import REQUEST_ONLY_FAULTS, parse_scenarios

TPS = st.sampled_from([1, 2, 4, 8])


def _scenario(*, preset: str, p_tp: int, d_tp: int, mode: str, order: str, prompts: list[int],
              extra_prefill: str = "", extra_decode: str = "", extra_connector: str = "",
              seed: int = 0) -> str:
    return f"""
[scenario]
name = "property"
seed = {seed}
[model]
preset = "{preset}"
[prefill]
tp = {p_tp}
{extra_prefill}
[decode]
tp = {d_tp}
{extra_decode}
[connector]
mode = "{mode}"
registration_order = "{order}"
{extra_connector}
[workload]
requests = {len(prompts)}
prompt_tokens = {prompts}
"""


@st.composite
def valid_deployments(draw: st.DrawFn) -> str:
    preset = draw(st.sampled_from(["tiny-kimi-linear", "tiny-qwen3-next", "tiny-deepseek",
                                   "tiny-llama"]))
    p_tp, d_tp = draw(TPS), draw(TPS)
    mode = draw(st.sampled_from(["pull", "push"]))
    extra_p = extra_d = ""
    if preset == "tiny-deepseek" and draw(st.booleans()):  # MLA: a block size ratio is allowed
        ratio = draw(st.sampled_from([1, 2, 4]))
        extra_p = 'attention_backend = "triton-mla"\nblock_size = 16'
        extra_d = f'attention_backend = "triton-mla"\nblock_size = {16 * ratio}'
    elif preset in ("tiny-llama", "tiny-qwen3-next") and (
            (mode == "pull" and p_tp <= d_tp) or p_tp == d_tp):
        ratio = draw(st.sampled_from([1, 2, 4]))
        extra_p, extra_d = "block_size = 16", f"block_size = {16 * ratio}"
    # prompts anywhere, and on either side of a block boundary (N-1 or N filling whole blocks:
    # where decode's list and prefill's can differ by one block)
    on_a_boundary = st.builds(lambda k, block, off: max(2, k * block + off), st.integers(1, 40),
                              st.sampled_from([16, 64, 80, 192]), st.sampled_from([-1, 0, 1]))
    prompts = draw(st.lists(st.one_of(st.integers(2, 1500), on_a_boundary), min_size=1,
                            max_size=3))
    hybrid = preset in ("tiny-kimi-linear", "tiny-qwen3-next")
    hits = None
    # prefix caching on both sides where it is allowed (a hybrid needs equal ppl: rule V4),
    # with hits anywhere up to N-1, including all of it
    if (not hybrid or (p_tp == d_tp and extra_p == extra_d)) and draw(st.booleans()):
        hits = [draw(st.sampled_from([0, n - 1, (n - 1) // 2])) for n in prompts]
        caching = "prefix_caching = true"
        extra_p, extra_d = f"{extra_p}\n{caching}", f"{extra_d}\n{caching}"
    text = _scenario(preset=preset, p_tp=p_tp, d_tp=d_tp, mode=mode,
                     order=draw(st.sampled_from(["state-first", "attention-first", "sorted"])),
                     prompts=prompts, extra_prefill=extra_p, extra_decode=extra_d,
                     seed=draw(st.integers(0, 1000)))
    return text if hits is None else f"{text}prefix_hit_tokens = {hits}\n"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_deployments())
def test_random_valid_deployments_are_byte_exact(text: str) -> None:
    (scenario,) = parse_scenarios(text)
    result = run_scenario(scenario)
    assert result.outcome == "ok", (result.handshake_errors,
                                    [r.mismatches[:1] or r.reason for r in result.records])
    assert result.mismatched_bytes == 0
    assert all(r.mismatched_words == 0 and r.status == "ok" for r in result.records)
    assert {"prefill_blocks", "decode_blocks", "open_handles", "after_shutdown"} <= set(result.leaks)
    assert not any(result.leaks.values()), result.leaks


@st.composite
def invalid_deployments(draw: st.DrawFn) -> tuple[str, str]:
    """(scenario text, the rule that must refuse it)."""
    kind = draw(st.sampled_from(["V1", "V2", "V5", "V6", "V4", "hash"]))
    mode = draw(st.sampled_from(["pull", "push"]))
    order = draw(st.sampled_from(["state-first", "attention-first"]))
    prompts = draw(st.lists(st.integers(2, 900), min_size=1, max_size=2))
    if kind == "V1":
        p_tp, d_tp = draw(st.sampled_from([(3, 2), (2, 3), (3, 4), (6, 4), (4, 6)]))
        return _scenario(preset="tiny-deepseek", p_tp=p_tp, d_tp=d_tp, mode=mode, order=order,
                         prompts=prompts), "V1"
    if kind == "V2":
        big = draw(st.sampled_from([32, 64]))
        small = draw(st.sampled_from([b for b in (16, 32) if b < big]))
        return _scenario(preset="tiny-llama", p_tp=1, d_tp=1, mode=mode, order=order,
                         prompts=prompts, extra_prefill=f"block_size = {big}",
                         extra_decode=f"block_size = {small}"), "V2"
    if kind == "V5":
        tp = draw(TPS)
        return _scenario(preset="tiny-llama", p_tp=tp, d_tp=tp, mode=mode, order=order,
                         prompts=prompts, extra_prefill='kv_cache_layout = "NHD"'), "V5"
    if kind == "V6":
        p_tp, d_tp = draw(TPS), draw(TPS)
        return _scenario(preset="tiny-kimi-linear", p_tp=p_tp, d_tp=d_tp, mode=mode, order=order,
                         prompts=prompts, extra_prefill='cache_dtype = "fp8"',
                         extra_connector="enforce_handshake_compat = false"), "V6"
    if kind == "V4":
        p_tp, d_tp = draw(st.sampled_from([(1, 2), (2, 1), (1, 4), (4, 8), (8, 2)]))
        caching = "prefix_caching = true"
        return _scenario(preset="tiny-kimi-linear", p_tp=p_tp, d_tp=d_tp, mode=mode, order=order,
                         prompts=prompts, extra_prefill=caching, extra_decode=caching), "V4"
    tp = draw(TPS)
    return _scenario(preset="tiny-kimi-linear", p_tp=tp, d_tp=tp, mode=mode, order=order,
                     prompts=prompts, extra_decode='cache_dtype = "fp8"'), "hash"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(invalid_deployments())
def test_random_invalid_deployments_are_refused_with_the_rule(case: tuple[str, str]) -> None:
    text, rule = case
    (scenario,) = parse_scenarios(text)
    result = run_scenario(scenario)
    assert result.outcome == "handshake-error"
    assert result.handshake_errors
    marker = "compatibility hash mismatch" if rule == "hash" else f"{rule}: "
    assert all(marker in e for e in result.handshake_errors), result.handshake_errors
    assert all(r.status == "failed" and r.failure_class == "handshake_failed"
               for r in result.records)
    assert result.mismatched_bytes == 0


FAULT_KINDS = ["drop-notification", "delay-notification", "fail-transfer", "stall-transfer",
               "disconnect-peer", "slow-link", "expire-lease-early", "abort-request"]
PHASES = {"fail-transfer": ["completion", "setup", "poll"],
          "abort-request": ["on-prefill", "before-scheduling", "during-handshake",
                            "mid-transfer", "after-completion"]}
#: every fault kind, and every phase of the kinds that have them
FAULT_CASES = [(kind, phase) for kind in FAULT_KINDS for phase in PHASES.get(kind, [None])]


def _fault(kind: str, phase: str | None, target: str) -> str:
    return (f'[[faults]]\nkind = "{kind}"\n{target}\n'
            + (f'phase = "{phase}"\n' if phase else ""))


@st.composite
def faulty_deployments(draw: st.DrawFn, kind: str, phase: str | None) -> str:
    """A valid deployment (valid_deployments) with the fault ``kind`` at ``phase`` and up to
    two random others, and short leases and watchdogs, so that every failure path can be
    reached."""
    text = draw(valid_deployments())
    requests = int(text.split("requests = ")[1].split("\n")[0])
    lease = draw(st.sampled_from([0.5, 5.0]))
    timeout = draw(st.sampled_from([0.05, 60.0]))
    policy = draw(st.sampled_from(["fail", "recompute"]))
    text = text.replace("[connector]\n", f'[connector]\nlease_seconds = {lease}\n'
                        f'transfer_timeout_seconds = {timeout}\n'
                        f'kv_load_failure_policy = "{policy}"\n')
    request = f"request = {draw(st.integers(0, requests - 1))}"

    def target(of: str) -> str:  # a rank target only for the kinds that act on ranks
        return draw(st.sampled_from([request, "probability = 0.5"] + (
            [] if of in REQUEST_ONLY_FAULTS else ["rank = 0\nprobability = 1.0"])))

    text += _fault(kind, phase, target(kind))
    for other, other_phase in draw(st.lists(st.sampled_from(FAULT_CASES), max_size=2)):
        text += _fault(other, other_phase, target(other))
    return text


@pytest.mark.parametrize("kind,phase", FAULT_CASES)
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_faults_never_leave_a_corrupted_success_a_hang_or_a_leak(
        kind: str, phase: str | None, data: st.DataObject) -> None:
    """Whatever fails: every request ends (ok, failed or aborted), none reported successful
    holds a wrong byte, and nothing is left allocated or registered."""
    (scenario,) = parse_scenarios(data.draw(faulty_deployments(kind, phase)))
    result = run_scenario(scenario)
    assert result.hung == 0
    assert {r.status for r in result.records} <= {"ok", "failed", "aborted"}
    assert not [r.index for r in result.records if r.status == "ok" and r.mismatched_words]
    assert not any(result.leaks.values()), result.leaks
