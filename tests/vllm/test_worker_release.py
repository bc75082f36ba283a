"""When the vLLM harness tells hkvsim's coordinator that a push request's transfers can no longer
write into decode's blocks (VllmConnectorWorker.take_released). Runs in the ordinary suite: the
worker's bookkeeping over a stand-in agent, no vLLM needed."""

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
