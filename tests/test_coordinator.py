"""The sans-I/O coordinator on its own: a fake clock, fake ranks, events fed by hand.

No simpy, no transport: every call the coordinator makes is answered here, and time only moves
when a test says so. These pin the lifecycle rules themselves (leases, heartbeats, push matching
in either order, the watchdog, quarantine) independently of any driver.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from hkvsim.connector.push import PushRegistration
from hkvsim.connector.worker import RequestOutcome
from hkvsim.pd.coordinator import Call, Coordinator
from hkvsim.pd.deployment import build_deployment
from hkvsim.pd.ops import (
    Abort,
    Connect,
    ConnectNotifyOnly,
    Message,
    Outcome,
    Released,
    Reply,
    SendNotif,
    StartRead,
    StartWrite,
    Verify,
)
from hkvsim.pd.state import Phase
from hkvsim.scenario import parse_scenarios

TEXT = """
[scenario]
name = "coordinator unit"
[model]
preset = "{preset}"
[prefill]
tp = {p_tp}
[decode]
tp = {d_tp}
[connector]
mode = "{mode}"
lease_seconds = 30.0
transfer_timeout_seconds = {timeout}
[workload]
requests = {requests}
prompt_tokens = 700
"""


@dataclass
class Harness:
    """Answers every call at once with a neutral value, except the ones a test holds back."""

    coord: Coordinator
    now: float = 0.0
    calls: list[Call] = field(default_factory=list)
    held: list[Call] = field(default_factory=list)
    hold: tuple[type, ...] = ()
    answers: dict[type, Any] = field(default_factory=dict)

    def pump(self) -> None:
        while True:
            self.coord.run_ready()
            effects = [e for e in self.coord.take_effects() if isinstance(e, Call)]
            if not effects:
                return
            replies = []
            for call in effects:
                self.calls.append(call)
                if isinstance(call.op, self.hold):
                    self.held.append(call)
                    continue
                replies.append(Reply(call.call_id, value=self._value(call)))
            if replies:
                self.coord.on_replies(replies, self.now)

    def _value(self, call: Call) -> Any:
        op = call.op
        if type(op) in self.answers:
            return self.answers[type(op)](call)
        if isinstance(op, Verify):
            return (0, [])
        if isinstance(op, SendNotif):
            return []
        return None  # connect ok, reads/writes posted, ...

    def start(self) -> None:
        self.coord.start(self.now)
        self.pump()

    def advance(self, to: float) -> None:
        """Move the fake clock, firing every timer that falls due on the way, in order."""
        while True:
            deadline = self.coord.next_timer()
            if deadline is None or deadline > to:
                break
            self.now = max(self.now, deadline)
            self.coord.on_timer(self.now)
            self.pump()
        self.now = to

    def event(self, *events: Any) -> None:
        self.coord.on_events(list(events), self.now)
        self.pump()

    def answer_held(self, kind: type, value: Any = None) -> None:
        mine = [c for c in self.held if isinstance(c.op, kind)]
        self.held = [c for c in self.held if c not in mine]
        self.coord.on_replies([Reply(c.call_id, value=value) for c in mine], self.now)
        self.pump()

    def of(self, kind: type) -> list[Call]:
        return [c for c in self.calls if isinstance(c.op, kind)]


def _harness(mode: str = "pull", *, preset: str = "tiny-llama", p_tp: int = 1, d_tp: int = 1,
             requests: int = 1, timeout: float = 2.0, **kw: Any) -> Harness:
    (scenario,) = parse_scenarios(TEXT.format(mode=mode, preset=preset, p_tp=p_tp, d_tp=d_tp,
                                              requests=requests, timeout=timeout))
    dep = build_deployment(scenario)
    coord = Coordinator(dep, verify=True)
    for spec in dep.all_engines():
        for r in range(spec.tp):
            coord.set_rank_info((spec.engine_id, r), payload=b"payload", agent=f"{spec.engine_id}.{r}",
                                agent_metadata=f"{spec.engine_id}.{r}".encode())
    return Harness(coord=coord, **kw)


def _ok(rid: str) -> RequestOutcome:
    return RequestOutcome(request_id=rid, ok=True, transfers=1)


def test_lease_expires_when_no_notification_arrives() -> None:
    h = _harness()
    h.start()
    (read,) = h.of(StartRead)
    rid = read.op.read.request_id
    h.event(Outcome(("decode0", 0), _ok(rid)))  # decode has its bytes; prefill hears nothing
    rec = h.coord.records[0]
    assert rec.status == "ok"
    prefill = h.coord.engine("prefill0")
    assert prefill.pool.used > 0 and h.coord.holds()
    h.advance(29.9)
    assert h.coord.holds() and not rec.freed_by_lease
    h.advance(30.1)
    assert not h.coord.holds() and prefill.pool.used == 0
    assert rec.freed_by_lease and h.coord.counters["lease_expiries"] == 1
    assert rec.times["lease_expired"] == pytest.approx(30.0)


def test_notifications_free_prefill_before_its_lease() -> None:
    h = _harness(p_tp=2, d_tp=1)
    h.start()
    read = h.of(StartRead)[0].op.read
    h.event(Outcome(("decode0", 0), _ok(read.request_id)))
    # one notification per prefill rank frees the hold (P_TP > D_TP: count 1 each)
    h.event(Message(("prefill0", 0), f"{read.prefill_request_id}:1".encode()))
    assert h.coord.holds()
    h.event(Message(("prefill0", 1), f"{read.prefill_request_id}:1".encode()))
    assert not h.coord.holds() and h.coord.engine("prefill0").pool.used == 0
    assert not h.coord.records[0].freed_by_lease
    assert h.coord.counters["notifications"] == 2
    assert h.coord.counters["late_notifications"] == 0


def test_heartbeats_extend_the_lease_while_decode_loads() -> None:
    h = _harness(timeout=60.0)
    h.start()
    read = h.of(StartRead)[0].op.read
    # decode is still loading: every lease/6 s it sends "HB:<prefill request id>"
    h.advance(15.01)
    beats = [c for c in h.of(SendNotif) if c.op.message.startswith(b"HB:")]
    assert len(beats) == 3 and beats[-1].op.message == f"HB:{read.prefill_request_id}".encode()
    h.event(Message(("prefill0", 0), beats[-1].op.message))  # it reaches prefill at t=15.01
    h.event(Outcome(("decode0", 0), _ok(read.request_id)))  # the READ completes
    h.advance(30.5)  # past the original deadline: the heartbeat moved it to 15.01 + 20
    assert h.coord.holds()
    h.advance(35.1)
    assert not h.coord.holds() and h.coord.records[0].freed_by_lease
    assert h.coord.records[0].times["lease_expired"] == pytest.approx(35.01)


def test_the_lease_expires_if_heartbeats_do_not_arrive() -> None:
    h = _harness(timeout=60.0)
    h.start()
    read = h.of(StartRead)[0].op.read
    h.advance(15.01)  # heartbeats are sent but never delivered
    assert [c for c in h.of(SendNotif) if c.op.message.startswith(b"HB:")]
    h.event(Outcome(("decode0", 0), _ok(read.request_id)))
    h.advance(30.1)
    assert not h.coord.holds()


@pytest.mark.parametrize("registration_first", [False, True])
def test_push_registration_matches_in_either_order(registration_first: bool) -> None:
    """Prefill matches decode's registration to its finished request whether the registration
    arrives before prefill publishes it (deferred inbox) or after."""
    from hkvsim.pd.ops import OracleWrite

    # holding prefill's compute lets decode's registration overtake it
    h = _harness("push", hold=(OracleWrite,) if registration_first else ())
    h.start()
    if registration_first:
        # forge decode's registration for request 0 before prefill finished computing
        rec = h.coord.records[0]
        registration = PushRegistration(
            decode_request_id=rec.request_id, decode_engine="decode0", decode_tp=1,
            prefill_engine="prefill0", blocks={0: np.arange(3)}, hit_blocks=0)
        h.event(Message(("prefill0", 0), registration.encode()))
        assert not h.of(StartWrite)  # nothing to write yet: the registration waits
        h.answer_held(OracleWrite)  # prefill finishes and publishes
        writes = h.of(StartWrite)
        assert len(writes) == 1
        assert writes[0].op.write.registration.encode() == registration.encode()
        return
    (send,) = [c for c in h.of(SendNotif) if c.op.message.startswith(b"PUSH_REG:")]
    h.event(Message(("prefill0", 0), send.op.message))
    (write,) = h.of(StartWrite)
    assert write.op.write.registration.decode_request_id == h.coord.records[0].request_id
    h.event(Outcome(("prefill0", 0), _ok(write.op.write.prefill_request_id)))
    h.event(Message(("decode0", 0), f"{h.coord.records[0].request_id}:1".encode()))
    assert h.coord.records[0].status == "ok"
    assert not h.coord.holds()  # every WRITE DONE: prefill freed without waiting
    assert h.coord.counters["notifications"] == 1  # decode's one rank counted prefill's


@pytest.mark.parametrize("preset, hybrid", [("tiny-llama", False), ("tiny-kimi-linear", True)])
def test_decode_verifies_what_it_loaded_then_computes_the_last_prompt_token(
        preset: str, hybrid: bool) -> None:
    """Every decode rank checks tokens [0, load) (with the state after them, for a model with
    state) and then writes token N itself: the KV of prompt token N-1 (0-based) and the state
    after N tokens, as decode's forward pass of the last prompt token does."""
    h = _harness(preset=preset, d_tp=2)
    h.start()
    for read in h.of(StartRead):
        h.event(Outcome(read.rank, _ok(read.op.read.request_id)))
    verifies = h.of(Verify)
    assert sorted(c.rank for c in verifies) == [("decode0", 0), ("decode0", 1)]
    rec = h.coord.records[0]
    assert rec.prompt_tokens == 700
    load = h.coord.dep.decode_load_tokens(700)
    assert load == (699 if hybrid else 700)
    for call in verifies:
        op = call.op
        assert op.tokens == (0, load)
        assert op.state_step == (load if hybrid else None)
        assert op.compute == (699, 700)
        assert op.compute_step == (700 if hybrid else None)
    assert rec.status == "ok"


def test_watchdog_on_a_slow_transfer_never_frees_blocks_under_it() -> None:
    h = _harness(answers={Abort: lambda call: RequestOutcome(
        request_id=call.op.request_id, ok=False, reason="watchdog", failure_class="stall",
        unreleased=1)})
    h.start()
    read = h.of(StartRead)[0].op.read
    decode = h.coord.engine("decode0")
    used = decode.pool.used
    h.advance(2.01)  # the transfer is slow, not stuck: the watchdog fires first
    rec = h.coord.records[0]
    assert rec.status == "failed" and rec.failure_class == "stall"
    assert h.of(Abort)
    assert decode.pool.used == used  # quarantined: the READ may still land
    assert h.coord.leaks()["quarantined_blocks"] == used
    h.event(Released(("decode0", 0), read.request_id))  # the READ ended, its handle released
    assert decode.pool.used == 0 and h.coord.leaks()["quarantined_blocks"] == 0
    assert h.coord.requests_in(Phase.DONE) == 1


def test_a_request_moving_bytes_with_a_rank_that_dies_fails_at_once() -> None:
    from hkvsim.pd.ops import Died

    h = _harness()
    h.start()
    h.event(Died(("prefill0", 0), "prefill0 rank 0 died: killed by signal 9"))
    rec = h.coord.records[0]
    assert rec.status == "failed" and rec.failure_class == "remote_disconnect"
    assert rec.reason == "prefill0 rank 0 died: killed by signal 9"


def test_calls_the_dead_rank_never_answers_fail() -> None:
    from hkvsim.pd.ops import Died

    h = _harness(hold=(Connect,))
    h.start()
    assert h.held  # decode's handshake is in flight
    h.event(Died(("decode0", 0), "exited with status 1"))
    rec = h.coord.records[0]
    assert rec.status == "failed" and "exited with status 1" in rec.reason


def test_illegal_phase_moves_are_refused() -> None:
    from hkvsim.pd.state import IllegalTransition, check_transition

    check_transition("r", Phase.TRANSFERRING, Phase.FINISHING)
    with pytest.raises(IllegalTransition, match="transferring -> queued"):
        check_transition("r", Phase.TRANSFERRING, Phase.QUEUED)
    with pytest.raises(IllegalTransition):
        check_transition("r", Phase.DONE, Phase.RELEASING)


def test_notify_only_handshake_failure_fails_the_push_request() -> None:
    h = _harness("push", hold=(ConnectNotifyOnly,))
    h.start()
    (call,) = [c for c in h.held if isinstance(c.op, ConnectNotifyOnly)]
    from hkvsim.pd.ops import RankError

    h.coord.on_replies([Reply(call.call_id, error=RankError("remote_disconnect", "gone"))], h.now)
    h.pump()
    rec = h.coord.records[0]
    assert rec.status == "failed" and rec.failure_class == "handshake_failed"


@pytest.mark.parametrize("max_inflight", [1, 2, 3])
def test_no_more_requests_are_served_at_once_than_max_inflight(max_inflight: int) -> None:
    # Poisson arrivals: some find a free slot (released with nobody waiting), some queue; at
    # no instant may more requests than max_inflight be between their start and their end
    from hkvsim.cluster import run_scenario

    (s,) = parse_scenarios(f"""
[scenario]
name = "slots"
seed = 11
[model]
preset = "tiny-llama"
[prefill]
tp = 1
[decode]
tp = 2
[workload]
requests = 40
prompt_tokens = {{ min = 100, max = 3000 }}
arrival = "poisson"
rate = 20.0
max_inflight = {max_inflight}
""")
    result = run_scenario(s)
    assert [r.status for r in result.records] == ["ok"] * 40
    events = sorted([(r.times["start"], 1) for r in result.records]
                    + [(r.times["done"], -1) for r in result.records])  # ends sort first
    running, peak = 0, 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert peak == max_inflight
    # some request found its slot free without waiting, after another had ended
    assert any(r.times["start"] == r.arrival and r.arrival > min(q.times["done"]
                                                                   for q in result.records)
               for r in result.records)
