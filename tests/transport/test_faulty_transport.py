"""The fault-injecting wrapper the real NIXL ranks use (hkvsim/transport/faulty.py): a transfer
whose poll raises sends its notification only once its sender has seen the exception and the
rank has reported it (``send_withheld``, called by the rank after its report), so the peer never
hears of the data before the coordinator hears of the sender's failure (the simulator's order
too); without that, push runs of `scenarios/faults/fail-setup-and-poll.toml` raced on real NIXL
(decode completed the request on the notification before prefill's failure reached the
coordinator)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from hkvsim.faults import PostFault
from hkvsim.transport.base import DONE, PROC, TransportError
from hkvsim.transport.faulty import FaultInjectingTransport


class _Inner:
    """A transport that records what reaches it; transfers are DONE once posted."""

    name = "prefill0.0"

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.state = PROC

    def prep_xfer_dlist(self, agent: str, descs: Any, **kwargs: Any) -> int:
        self.calls.append(("prep", agent))
        return 10 + len(self.calls)

    def make_prepped_xfer(self, op: str, local: int, lids: Any, remote: int, rids: Any,
                          notif: bytes = b"") -> int:
        self.calls.append(("make_prepped", notif))
        return 1

    def make_xfer(self, op: str, local: Any, agent: str, remote: Any, notif: bytes = b"") -> int:
        self.calls.append(("make", agent, notif))
        return 2

    def transfer(self, handle: int) -> str:
        return PROC

    def check_xfer_state(self, handle: int) -> str:
        return self.state

    def send_notif(self, agent: str, message: bytes) -> None:
        self.calls.append(("send_notif", agent, message))

    def release_xfer_handle(self, handle: int) -> None:
        self.calls.append(("release", handle))


class _Plan:
    def __init__(self, kind: str | None) -> None:
        self.kind = kind

    def on_post(self, **_: Any) -> PostFault | None:
        return None if self.kind is None else PostFault(self.kind)

    def on_message(self, **_: Any) -> None:
        return None


def _posted(kind: str | None, prepped: bool) -> tuple[FaultInjectingTransport, _Inner, int]:
    inner = _Inner()
    t = FaultInjectingTransport(inner, _Plan(kind), clock=lambda: 0.0)
    ids = np.arange(2)
    if prepped:
        local = t.prep_xfer_dlist("", np.zeros((2, 3)))
        remote = t.prep_xfer_dlist("decode0.0", np.zeros((2, 3)))
        handle = t.make_prepped_xfer("WRITE", local, ids, remote, ids, notif=b"req-2")
    else:
        handle = t.make_xfer("WRITE", np.zeros((2, 3)), "decode0.0", np.zeros((2, 3)),
                             notif=b"req-2")
    t.transfer(handle)
    return t, inner, handle


@pytest.mark.parametrize("prepped", [True, False])
def test_a_poll_fault_sends_the_notification_after_the_sender_sees_the_exception(prepped):
    t, inner, handle = _posted("fail-poll", prepped)
    made = [c for c in inner.calls if c[0].startswith("make")]
    assert made[0][-1] == b""  # not attached to the transfer itself
    assert t.check_xfer_state(handle) == PROC  # still moving: nothing sent, nothing raised
    assert not [c for c in inner.calls if c[0] == "send_notif"]
    inner.state = DONE
    with pytest.raises(TransportError) as err:
        t.check_xfer_state(handle)
    assert err.value.kind == "transfer_exception"
    # not while the rank is still in its poll: it has not reported the failure yet
    assert not [c for c in inner.calls if c[0] == "send_notif"]
    assert t.check_xfer_state(handle) == DONE  # raises once
    # the data moved, so the peer is told, once the rank has reported the failure
    assert t.send_withheld() == 1
    assert [c for c in inner.calls if c[0] == "send_notif"] == [
        ("send_notif", "decode0.0", b"req-2")]
    assert t.send_withheld() == 0  # nothing sent twice
    assert len([c for c in inner.calls if c[0] == "send_notif"]) == 1


def test_other_transfers_keep_their_notification_on_the_transfer():
    t, inner, handle = _posted(None, prepped=True)
    assert [c for c in inner.calls if c[0] == "make_prepped"] == [("make_prepped", b"req-2")]
    inner.state = DONE
    assert t.check_xfer_state(handle) == DONE
    assert not [c for c in inner.calls if c[0] == "send_notif"]


def test_a_released_poll_fault_never_sends_its_notification():
    t, inner, handle = _posted("fail-poll", prepped=True)
    t.release_xfer_handle(handle)
    inner.state = DONE
    assert t.check_xfer_state(handle) == DONE  # the handle's fault went with it
    assert t.send_withheld() == 0
    assert not [c for c in inner.calls if c[0] == "send_notif"]


def test_the_rank_sends_withheld_notifications_after_reporting_its_poll():
    from hkvsim.backends.rank import RankProcess

    class _Stop(Exception):
        pass

    order: list[str] = []

    class _Chan:
        polls = 0

        def poll(self, _timeout: float) -> list[Any]:
            self.polls += 1
            if self.polls > 2:
                raise _Stop
            return []

    class _Executor:
        def busy(self) -> bool:
            return True

        def poll(self) -> list[Any]:
            order.append("poll")
            return ["what the poll found"]

    proc = RankProcess(_Chan(), credential="x", engine="prefill0", rank=0, log_path="/dev/null")
    proc.executor = _Executor()  # type: ignore[assignment]
    proc._report = lambda events: order.append(f"report {events}")  # type: ignore[method-assign]
    proc._send_withheld = lambda: order.append("send withheld") or 0
    with pytest.raises(_Stop):
        proc._loop()
    assert order == ["poll", "report ['what the poll found']", "send withheld"] * 2


def test_a_dropped_notification_never_reaches_the_transport_and_others_do():
    # drop-notification on the real backend: the plan answers inf for the message it drops
    class _Dropping(_Plan):
        def on_message(self, *, now: float, src: str, dst: str, message: bytes):
            assert (now, src) == (0.0, "prefill0.0")
            return float("inf") if message.startswith(b"req-1:") else None

    inner = _Inner()
    t = FaultInjectingTransport(inner, _Dropping(None), clock=lambda: 0.0)
    t.send_notif("decode0.0", b"req-1:2")
    t.send_notif("decode0.1", b"req-2:2")
    assert [c for c in inner.calls if c[0] == "send_notif"] == [
        ("send_notif", "decode0.1", b"req-2:2")]
