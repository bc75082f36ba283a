"""When the vLLM harness tells hkvsim's coordinator that a push request's transfers can no longer
write into decode's blocks (VllmConnectorWorker.take_released), and which engines a rank is
connected to. Runs in the ordinary suite: the worker's bookkeeping over a stand-in agent, no vLLM
needed."""

from __future__ import annotations

from types import SimpleNamespace

from hkvsim.connector.worker import RequestOutcome
from hkvsim.implementations.vllm.worker import VllmConnectorWorker, _Flight


class _Agent:
    """Which transfer handles vLLM still holds live (posted, not released)."""

    def __init__(self, live: set[int]) -> None:
        self.live = live

    def is_live(self, handle: int) -> bool:
        return handle in self.live


def _worker(push: bool, flights: dict[str, list[int]], live: set[int]) -> VllmConnectorWorker:
    worker = VllmConnectorWorker.__new__(VllmConnectorWorker)  # no vLLM rank behind it
    worker.push = push
    worker.vllm = SimpleNamespace(agent=_Agent(live))
    worker._in_flight = {rid: _Flight(outcome=RequestOutcome(request_id=rid, ok=False),
                                      handles=list(handles))
                         for rid, handles in flights.items()}
    worker._zombies = {}
    worker._spent = set()
    return worker


def test_a_push_request_vllm_never_reported_is_released_once_its_writes_are() -> None:
    # vLLM 0.30.0 releases every finished WRITE but never lists the request as sent: once none
    # of a request's WRITEs is live, nothing of it can write into decode's blocks
    worker = _worker(True, {"a": [1, 2], "b": [3]}, live={1, 2, 3})
    assert worker.take_released() == []  # all still live
    worker.vllm.agent.live = {2, 3}
    assert worker.take_released() == []  # request a: WRITE 2 still live
    worker.vllm.agent.live = {3}
    assert worker.take_released() == ["a"]
    assert worker.take_released() == []  # told once
    assert worker.in_flight() == 2  # still in vLLM's flight: a later "sent" still ends it
    worker.vllm.agent.live = set()
    assert worker.take_released() == ["b"]


def test_a_pull_request_in_flight_is_never_released_early() -> None:
    # decode's READs: the request is in flight until vLLM reports it, whatever its handles
    worker = _worker(False, {"a": [1]}, live=set())
    assert worker.take_released() == []
    worker._zombies = {"z": [2]}  # an ended READ vLLM has since released: that one only
    assert worker.take_released() == ["z"]


def test_a_request_that_ended_with_live_transfers_is_released_when_vllm_releases_them() -> None:
    worker = _worker(True, {}, live={7})
    worker._zombies = {"z": [7]}
    assert worker.take_released() == []
    worker.vllm.agent.live = set()
    assert worker.take_released() == ["z"]
    assert worker.pending_releases() == 0


def test_a_fresh_rank_is_connected_to_no_one_and_counts_no_failed_notification() -> None:
    # is_connected is what the coordinator asks before it runs vLLM's handshake: only an
    # engine vLLM's worker holds as a remote agent is connected (and none before registration)
    from hkvsim.connector.worker import ConnectorSettings

    worker = VllmConnectorWorker(harness=None, engine_id="d0", role="decode", tp_rank=0,
                                 layout=SimpleNamespace(model=None), transport=None,
                                 settings=ConnectorSettings(mode="pull"))
    assert not worker.is_connected("p0")  # no vLLM rank yet
    # vLLM's worker handles its own notifications' failures: the harness reports none of them
    assert worker.notification_failures == 0 and worker.in_flight() == 0
    worker.vllm = SimpleNamespace(worker=SimpleNamespace(_remote_agents={"p0": {0: "agent"}}))
    assert worker.is_connected("p0") and not worker.is_connected("p1")


def test_only_a_pull_prefill_rank_gates_its_notifications_behind_take_messages() -> None:
    # a pull prefill rank hands vLLM a notification only once take_messages has registered its
    # request with vLLM; decode ranks and push ranks read theirs as they come
    from hkvsim.connector.worker import ConnectorSettings

    def registered(role: str, mode: str) -> bool:
        agent = SimpleNamespace(gate_notifs=False)
        harness = SimpleNamespace(add_rank=lambda *args: SimpleNamespace(agent=agent))
        transport = SimpleNamespace(allocate=lambda nbytes, mem_type, device_id: "memory")
        worker = VllmConnectorWorker(harness=harness, engine_id="e0", role=role, tp_rank=0,
                                     layout=SimpleNamespace(model=None, total_bytes=4096),
                                     transport=transport, settings=ConnectorSettings(mode=mode))
        assert worker.register() == "memory"
        return agent.gate_notifs

    assert registered("prefill", "pull")
    assert not registered("decode", "pull")
    assert not registered("prefill", "push") and not registered("decode", "push")
