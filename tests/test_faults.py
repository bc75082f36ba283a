"""Lifecycle and faults: invariants under injected faults, heartbeats, late notifications,
determinism, and hostile push registrations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hkvsim.cluster import run_scenario
from hkvsim.connector.push import PUSH_PREFIX, PushRegistration, base_request_id
from hkvsim.faults import FaultPlan
from hkvsim.results import result_json
from hkvsim.scenario import Fault, load_scenarios, parse_scenarios

ROOT = Path(__file__).resolve().parents[1]
KNOWN_CLASSES = {"handshake_failed", "transfer_setup_failed", "transfer_failed",
                 "transfer_exception", "remote_disconnect", "stall", "freed_while_reading"}


def _one(text: str):
    (scenario,) = parse_scenarios(text)
    return run_scenario(scenario)


def test_soak_invariants_hold_and_are_deterministic() -> None:
    (scenario,) = load_scenarios(ROOT / "scenarios/soak/mixed-faults.toml")
    first = run_scenario(scenario)
    data = result_json(first)
    assert data["requests"]["hung"] == 0
    assert first.corrupted == 0 and data["requests"]["mismatched_bytes"] == 0
    assert set(data["leaks"]) >= {"prefill_blocks", "decode_blocks", "open_handles",
                                  "quarantined_blocks", "after_shutdown"}
    assert not any(data["leaks"].values()), data["leaks"]
    assert data["counters"]["late_landings"] == 0
    assert data["counters"]["faults_injected"] > 20
    assert 0 < data["requests"]["failed"] < data["requests"]["total"]
    assert {f["class"] for f in data["failures"]} <= KNOWN_CLASSES
    again = result_json(run_scenario(scenario))
    assert json.dumps(again, sort_keys=True) == json.dumps(data, sort_keys=True)


BASE = """
[scenario]
name = "lease"
[model]
preset = "tiny-kimi-linear"
[prefill]
tp = 1
[decode]
tp = 2
[connector]
mode = "{mode}"
lease_seconds = {lease}
transfer_timeout_seconds = 30.0
[workload]
requests = 1
prompt_tokens = 900
"""


def test_heartbeats_keep_a_slow_transfer_alive() -> None:
    # the transfer takes ~3 s on a link slowed 10^6 x; the lease is 1 s, but decode's heartbeats
    # (every lease/6) keep moving prefill's deadline to now + 2/3 lease
    slow = '[[faults]]\nkind = "slow-link"\nengine = "decode0"\nfactor = 1000000.0\n'
    result = _one(BASE.format(mode="pull", lease=1.0) + slow)
    (rec,) = result.records
    assert rec.times["transfer_done"] - rec.times["transfer_start"] > 2.0
    assert result.outcome == "ok", result.records[0].reason
    assert not rec.freed_by_lease and result.counters["lease_expiries"] == 0


def test_lease_shorter_than_transfer_is_a_failure_never_a_success() -> None:
    early = '[[faults]]\nkind = "expire-lease-early"\nrequest = 0\nduration_seconds = 0.5\n'
    slow = '[[faults]]\nkind = "slow-link"\nengine = "decode0"\nfactor = 1000000.0\n'
    for mode in ("pull", "push"):
        result = _one(BASE.format(mode=mode, lease=30.0) + early + slow)
        (rec,) = result.records
        assert rec.status == "failed" and rec.failure_class == "freed_while_reading", mode
        assert {"prefill_blocks", "decode_blocks", "open_handles", "after_shutdown"} <= set(result.leaks)
        assert not any(result.leaks.values()), result.leaks


def test_late_notification_after_lease_expiry_is_ignored() -> None:
    late = '[[faults]]\nkind = "delay-notification"\nrequest = 0\nduration_seconds = 6.0\n'
    result = _one(BASE.format(mode="pull", lease=5.0) + late)
    (rec,) = result.records
    assert rec.status == "ok" and rec.mismatched_words == 0
    assert rec.freed_by_lease
    assert result.counters["late_notifications"] >= 1
    assert result.leaks["prefill_blocks"] == 0


def test_failures_on_several_ranks_are_reported_once() -> None:
    # request 0 fails on both decode ranks (two transfers, two polls): one failure record
    fail = '[[faults]]\nkind = "fail-transfer"\nrequest = 0\n'
    result = _one(BASE.format(mode="pull", lease=5.0) + fail)
    (rec,) = result.records
    assert rec.status == "failed" and rec.failure_class == "transfer_failed"
    assert len(result_json(result)["failures"]) == 1
    assert rec.transfers == 2  # both ranks did post


def test_recompute_policy_recovers_byte_exact() -> None:
    text = BASE.format(mode="pull", lease=5.0).replace(
        "transfer_timeout_seconds = 30.0",
        'transfer_timeout_seconds = 30.0\nkv_load_failure_policy = "recompute"')
    result = _one(text + '[[faults]]\nkind = "fail-transfer"\nrequest = 0\n')
    (rec,) = result.records
    assert rec.status == "ok" and rec.recovered_from == "transfer_failed"
    assert rec.mismatched_words == 0


def test_push_registration_round_trip_and_base_ids() -> None:
    reg = PushRegistration(decode_request_id="req-3-0a0b", decode_engine="decode0", decode_tp=4,
                           prefill_engine="prefill1", blocks={0: np.array([5, 6]),
                                                              2: np.array([9])}, hit_blocks=1)
    back = PushRegistration.decode(reg.encode())
    assert back is not None and back.decode_request_id == "req-3-0a0b"
    assert {g: ids.tolist() for g, ids in back.blocks.items()} == {0: [5, 6], 2: [9]}
    assert base_request_id("req-3-0a0b") == "req-3" == base_request_id("req-3-ffff")
    assert base_request_id("plain") == "plain"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_hostile_push_registrations_are_dropped_never_raised(payload: bytes) -> None:
    result = PushRegistration.decode(PUSH_PREFIX + payload)
    if result is not None:  # only a structurally valid registration is accepted
        assert isinstance(result.decode_request_id, str) and result.decode_tp >= 1
        assert all(ids.dtype == np.int64 and (ids >= 0).all() for ids in result.blocks.values())


def test_idle_engines_are_evicted_at_the_next_handshake_and_reconnected() -> None:
    text = """
[scenario]
name = "eviction"
seed = 5
[model]
preset = "tiny-kimi-linear"
[prefill]
instances = 2
[decode]
tp = 2
[connector]
engine_ttl_seconds = 0.5
[workload]
requests = 6
prompt_tokens = 700
arrival = "poisson"
rate = 0.5
"""
    result = _one(text)
    assert result.outcome == "ok"
    assert all(r.mismatched_words == 0 for r in result.records)
    # requests alternate between the two prefill engines, seconds apart: every new handshake
    # finds the other engine idle past the TTL, evicts it, and the next request reconnects
    assert result.counters["evictions"] >= 2
    assert result.counters["handshakes"] == 2 + result.counters["evictions"]
    assert result.leaks["after_shutdown"] == 0


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-5, 5), st.text(max_size=5),
                    st.lists(st.integers(-2, 3), max_size=3),
                    st.dictionaries(st.integers(-1, 3), st.lists(st.integers(-1, 9), max_size=3),
                                    max_size=2))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["decode_request_id", "decode_engine", "decode_tp",
                                        "prefill_engine", "blocks", "hit_blocks", "extra"]),
                       _VALUES, max_size=7))
def test_structured_hostile_registrations_are_dropped_or_well_typed(body: dict) -> None:
    import msgpack

    result = PushRegistration.decode(PUSH_PREFIX + msgpack.packb(body, use_bin_type=True))
    if result is None:
        return
    # accepted only with exactly the right keys and types
    assert set(body) == {"decode_request_id", "decode_engine", "decode_tp", "prefill_engine",
                         "blocks", "hit_blocks"}
    assert isinstance(body["decode_tp"], int) and not isinstance(body["decode_tp"], bool)
    assert result.decode_tp >= 1 and result.hit_blocks >= 0
    assert all((ids >= 0).all() for ids in result.blocks.values())


PROBABLE_ABORTS = """
[scenario]
name = "aborts by chance"
seed = 21
[model]
preset = "tiny-kimi-linear"
[decode]
tp = 2
[workload]
requests = 24
prompt_tokens = 300
max_inflight = 2
[[faults]]
kind = "abort-request"
phase = "before-scheduling"
probability = {p}
"""


def test_a_fault_hits_each_event_with_its_probability_reproducibly() -> None:
    # probability 1: every request aborted; 0: none; 0.5: some of the 24, the same ones on
    # every run of the seed (and nothing else fails, nothing leaks)
    def aborted(p: float) -> list[str]:
        result = _one(PROBABLE_ABORTS.format(p=p))
        assert result.failed == 0 and result.corrupted == 0 and not any(result.leaks.values())
        return [r.request_id for r in result.records if r.status == "aborted"]

    assert len(aborted(1.0)) == 24
    assert aborted(0.0) == []
    half = aborted(0.5)
    assert 4 <= len(half) <= 20 and aborted(0.5) == half


def test_a_notification_to_a_dead_never_read_rank_is_counted_and_its_blocks_freed_by_lease(
) -> None:
    # pure MLA, P TP2 -> D TP1: decode reads prefill rank 0 and sends rank 1 a notification-only
    # message per request. Rank 1 dies at once: each of those messages fails (counted, not
    # raised), the reads still land byte-exact, and rank 1's blocks are freed by its lease
    text = """
[scenario]
name = "notification-only message to a dead prefill rank"
seed = 3
[model]
preset = "tiny-deepseek"
[prefill]
tp = 2
[decode]
tp = 1
[connector]
transfer_timeout_seconds = 1.0
lease_seconds = 5.0
[workload]
requests = 4
prompt_tokens = 600
max_inflight = 1
[[faults]]
kind = "disconnect-peer"
engine = "prefill0"
rank = 1
at_seconds = 0.0001
"""
    result = _one(text)
    assert [r.status for r in result.records] == ["ok"] * 4
    assert all(r.mismatched_words == 0 for r in result.records)
    assert result.counters["notification_failures"] == 4
    assert result.counters["lease_expiries"] == 4
    assert result.leaks["prefill_blocks"] == 0
    assert result_json(result)["counters"]["notification_failures"] == 4
    # alive, the same run sends every notification
    result = _one(text.replace("at_seconds = 0.0001", "at_seconds = 1000.0"))
    assert result.counters["notification_failures"] == 0
    assert result.counters["lease_expiries"] == 0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_an_abort_before_scheduling_with_a_block_size_ratio(mode: str) -> None:
    """Decode never allocated the aborted request's blocks, so there is no sub-block tail to
    fill with an earlier tenant's bytes (that fill crashed the run on an empty block list);
    the next request moves byte-exact through the same ratio."""
    result = _one(f"""
[scenario]
name = "abort before scheduling, bsr 4"
[model]
preset = "tiny-llama"
[prefill]
block_size = 16
[decode]
block_size = 64
[connector]
mode = "{mode}"
[workload]
requests = 2
prompt_tokens = [150, 150]
max_inflight = 1
[[faults]]
kind = "abort-request"
request = 0
phase = "before-scheduling"
""")
    aborted, done = result.records
    assert aborted.status == "aborted" and done.status == "ok", (aborted, done)
    assert done.mismatched_words == 0 and result.mismatched_bytes == 0
    assert not any(result.leaks.values()), result.leaks


def test_a_push_registration_over_one_mib_is_dropped() -> None:
    """The size cap is checked before decoding: a registration just over 1 MiB is dropped
    (None), one just under it decodes."""
    def registration(n: int) -> bytes:
        return PushRegistration(decode_request_id="r", decode_engine="decode0", decode_tp=1,
                                prefill_engine="prefill0", blocks={0: np.full(n, 1 << 20)},
                                hit_blocks=0).encode()

    under, over = registration(209_000), registration(210_000)  # 5 B per id (uint32)
    assert len(under) <= 1 << 20 < len(over)
    got = PushRegistration.decode(under)
    assert got is not None and got.blocks[0].size == 209_000
    assert PushRegistration.decode(over) is None


@pytest.mark.parametrize("decode_tp,hit_blocks,ok", [(1, 0, True), (0, 0, False), (1, -1, False),
                                                     (0, 3, False)])
def test_a_push_registration_needs_a_decode_tp_and_no_negative_hit(decode_tp: int,
                                                                   hit_blocks: int,
                                                                   ok: bool) -> None:
    message = PushRegistration(decode_request_id="r", decode_engine="decode0",
                               decode_tp=decode_tp, prefill_engine="prefill0",
                               blocks={0: np.arange(3)}, hit_blocks=hit_blocks).encode()
    assert (PushRegistration.decode(message) is not None) is ok


@pytest.mark.parametrize("implementation,mode,phase,warned", [
    ("vllm", "push", "before-scheduling", True), ("vllm", "push", "during-handshake", True),
    ("vllm", "push", "mid-transfer", False), ("vllm", "pull", "before-scheduling", False),
    ("hkvsim", "push", "before-scheduling", False)])
def test_an_abort_vllms_push_path_does_not_drive_is_said_in_the_warnings(
        implementation: str, mode: str, phase: str, warned: bool) -> None:
    # decode aborting before scheduling or during the handshake in vLLM's push: vLLM's own
    # decode path for it is not driven (hkvsim's coordinator registers the request with no
    # blocks, which vLLM's prefill refuses), so the run must say so (docs/vllm.md)
    from hkvsim.implementations.vllm.run import undriven_abort_warnings

    (scenario,) = parse_scenarios(f"""
[scenario]
name = "a"
[model]
preset = "tiny-llama"
[connector]
implementation = "{implementation}"
mode = "{mode}"
[workload]
requests = 2
prompt_tokens = 100
[[faults]]
kind = "abort-request"
request = 0
phase = "{phase}"
""")
    found = undriven_abort_warnings(scenario)
    assert len(found) == warned
    if warned:
        assert phase.replace("-", " ") in found[0] and "lease" in found[0]


def _plan(**fault: object) -> FaultPlan:
    return FaultPlan([Fault(**fault)], seed=0, transfer_timeout=1.0)


def test_a_fault_aimed_at_an_engine_hits_only_that_engines_transfers() -> None:
    """An engine target (no rank) matches every rank of that engine, on either side of the
    post, and nothing else."""
    plan = _plan(kind="fail-transfer", engine="prefill0")
    hit = plan.on_post(now=0.0, initiator="decode0.0", remote="prefill0.1", notif=b"")
    assert hit is not None and hit.kind == "fail"
    assert plan.on_post(now=0.0, initiator="prefill0.0", remote="decode0.0", notif=b"")
    assert plan.on_post(now=0.0, initiator="decode0.0", remote="prefill1.0", notif=b"") is None
    assert plan.on_post(now=0.0, initiator="decode1.1", remote="prefill10.0", notif=b"") is None
    ranked = _plan(kind="fail-transfer", rank=1)
    assert ranked.on_post(now=0.0, initiator="decode0.0", remote="prefill0.1", notif=b"")
    assert ranked.on_post(now=0.0, initiator="decode0.0", remote="prefill0.0", notif=b"") is None
    assert plan.injected == {"fail-transfer": 2} and ranked.injected == {"fail-transfer": 1}


def test_a_timed_fault_hits_in_its_window_only() -> None:
    """``at_seconds`` starts the window (inclusive), ``window_seconds`` ends it (exclusive);
    without a length the window never closes."""
    def slowed(plan: FaultPlan, now: float) -> bool:
        fault = plan.on_post(now=now, initiator="decode0.0", remote="prefill0.0", notif=b"")
        return fault is not None and fault.kind == "slow" and fault.factor == 4.0

    windowed = _plan(kind="slow-link", at_seconds=2.0, window_seconds=1.0, factor=4.0)
    assert [slowed(windowed, t) for t in (1.999, 2.0, 2.5, 2.999, 3.0, 10.0)] == [
        False, True, True, True, False, False]
    open_ended = _plan(kind="slow-link", at_seconds=2.0, factor=4.0)
    assert [slowed(open_ended, t) for t in (1.999, 2.0, 1e6)] == [False, True, True]


def test_a_timed_delay_keeps_its_window_and_its_delay_apart() -> None:
    """With ``at_seconds``, ``window_seconds`` bounds when notifications are hit and
    ``duration_seconds`` is how late each one arrives: one number must not serve as both."""
    plan = _plan(kind="delay-notification", at_seconds=1.0, window_seconds=0.5,
                 duration_seconds=3.0)
    delays = [plan.on_message(now=t, src="prefill0.0", dst="decode0.0", message=b"req-0-x:1")
              for t in (0.999, 1.0, 1.499, 1.5, 3.9)]
    assert delays == [None, 3.0, 3.0, None, None]
    open_ended = _plan(kind="delay-notification", at_seconds=1.0, duration_seconds=3.0)
    assert open_ended.on_message(now=3.9, src="prefill0.0", dst="decode0.0",
                                 message=b"req-0-x:1") == 3.0


def test_faults_aimed_at_ranks_that_exist_are_accepted() -> None:
    """The deployment check refuses only engines and ranks that do not exist: the last rank of
    the last instance, and a rank that only the larger engine has, both parse."""
    text = ('[scenario]\nname = "n"\n[model]\npreset = "tiny-llama"\n[decode]\ntp = 2\n'
            'instances = 2\n[workload]\nrequests = 2\nprompt_tokens = 100\n'
            '[[faults]]\nkind = "slow-link"\nengine = "decode1"\nrank = 1\n'
            '[[faults]]\nkind = "kill-rank"\nrank = 1\nat_seconds = 0.5\n')
    (scenario,) = parse_scenarios(text, source="ok.toml")
    assert [(f.engine, f.rank) for f in scenario.faults] == [("decode1", 1), (None, 1)]


_KILLED_DECODE = """
[scenario]
name = "decode rank 0 dies as prefill writes request 0 (push, recompute policy)"
seed = 3
[model]
preset = "tiny-deepseek"
[prefill]
tp = 2
[decode]
tp = 1
[connector]
mode = "push"
lease_seconds = 0.5
kv_load_failure_policy = "recompute"
[workload]
requests = 1
prompt_tokens = [1432]
[[faults]]
kind = "{kind}"
request = 0
"""


def test_a_killed_decode_rank_cannot_recompute_but_one_whose_agent_died_can() -> None:
    """kill-rank kills the rank's process: the load failure stands (remote_disconnect), nothing
    is recomputed, as on real NIXL. Its Died event reaches the coordinator behind the failed
    WRITE's reply, so the recompute call must itself find the process gone (found by hkvsim
    fuzz: the simulator recomputed on the dead rank and reported the request ok).
    disconnect-peer kills only the NIXL agent: the rank's process recomputes the request."""
    killed = _one(_KILLED_DECODE.format(kind="kill-rank"))
    (rec,) = killed.records
    assert (rec.status, rec.failure_class, rec.recovered_from) == (
        "failed", "remote_disconnect", None)
    assert killed.counters["recomputed"] == 0 and not any(killed.leaks.values())
    # the death is counted, once, under its own kind
    assert result_json(killed)["counters"]["fault:kill-rank"] == 1
    disconnected = _one(_KILLED_DECODE.format(kind="disconnect-peer"))
    (rec,) = disconnected.records
    assert (rec.status, rec.recovered_from) == ("ok", "remote_disconnect")
    assert rec.mismatched_words == 0 and disconnected.counters["recomputed"] == 1
    assert result_json(disconnected)["counters"]["fault:disconnect-peer"] == 1


def test_a_decode_rank_whose_agent_died_recomputes_whenever_the_coordinator_heard_of_it(
) -> None:
    """Only the rank's NIXL agent dies: its process still computes, so the recompute policy
    recovers the request whether the death reached the coordinator after the failed transfer
    (above) or before the request started (here, a death at 0 s that fails decode's
    handshake; pull and push). Found by
    hkvsim fuzz against vLLM (seed 30, scenario 81): whether a disconnected decode recomputed
    depended on which of the failed WRITE's reply and the death's report came first. A killed
    process never recomputes, whatever the order."""
    for mode in ("pull", "push"):
        for kind, status in (("disconnect-peer", "ok"), ("kill-rank", "failed")):
            text = _KILLED_DECODE.format(kind=kind).replace(
                'request = 0', 'engine = "decode0"\nrank = 0\nat_seconds = 0.0').replace(
                'mode = "push"', f'mode = "{mode}"')
            for verify in (True, False):  # timing-only: no recompute call to find it gone
                run_text = text if verify else text.replace(
                    "requests = 1\n", "requests = 1\nverify = false\n")
                result = _one(run_text)
                (rec,) = result.records
                assert (rec.status, rec.failure_class if status == "failed"
                        else rec.recovered_from) == (status, "handshake_failed"), (mode, kind)
                assert rec.mismatched_words == 0, (mode, kind)
                assert result.counters["recomputed"] == (status == "ok"), (mode, kind, verify)


def test_a_request_meeting_a_decode_rank_already_disconnected_recomputes_or_fails(
) -> None:
    """Request 0's WRITE kills decode0.0's agent; request 1 then finds the rank dead before it
    connects. With only the agent dead the rank recomputes it; with its process dead it fails.
    Found by hkvsim fuzz against vLLM 0.26.0 (seed 31, scenarios 27 and 50): the coordinator
    moved the request from decode-fill to recovering, which its state table refused (a
    crash)."""
    for kind, status, recomputed in (("disconnect-peer", "ok", 2), ("kill-rank", "failed", 0)):
        text = _KILLED_DECODE.format(kind=kind).replace(
            "requests = 1\nprompt_tokens = [1432]", "requests = 2\nprompt_tokens = [1432, 700]"
        ).replace("[workload]", "[workload]\nmax_inflight = 1")
        result = _one(text)
        first, second = result.records
        assert (second.status, second.failure_class or second.recovered_from) == (
            status, "remote_disconnect"), kind
        assert result.counters["recomputed"] == recomputed, kind
        assert second.mismatched_words == 0 and not any(result.leaks.values()), kind


def test_a_timed_kill_rank_is_counted_as_kill_rank_and_its_rank_answers_nothing() -> None:
    text = _KILLED_DECODE.format(kind="kill-rank").replace(
        'request = 0', 'engine = "decode0"\nrank = 0\nat_seconds = 0.0')
    result = _one(text)
    assert result_json(result)["counters"].get("fault:kill-rank") == 1
    assert "fault:disconnect-peer" not in result_json(result)["counters"]
    (rec,) = result.records
    assert rec.status == "failed" and rec.recovered_from is None


def test_only_kill_rank_kills_the_process_and_a_death_is_counted_once() -> None:
    from hkvsim.drivers.sim import SimDriver

    timed = _KILLED_DECODE.replace('request = 0', 'engine = "decode0"\nrank = 0\n'
                                                  'at_seconds = 0.0')
    for kind, dead in (("kill-rank", {"decode0.0"}), ("disconnect-peer", set())):
        (scenario,) = parse_scenarios(timed.format(kind=kind))
        driver = SimDriver(scenario)
        driver.run()
        assert driver.world.killed_processes == dead, kind
    # both decode ranks read prefill0.0 at the same instant: the second READ meets the agent
    # the first one's post killed, and its death is still one injection
    text = """
[scenario]
name = "prefill0.0's agent dies at the first post to it"
[model]
preset = "tiny-llama"
[decode]
tp = 2
[workload]
requests = 3
prompt_tokens = 300
max_inflight = 1
[[faults]]
kind = "disconnect-peer"
engine = "prefill0"
rank = 0
probability = 1.0
"""
    result = _one(text)
    assert [r.failure_class for r in result.records] == ["remote_disconnect"] * 3
    assert result_json(result)["counters"]["fault:disconnect-peer"] == 1
