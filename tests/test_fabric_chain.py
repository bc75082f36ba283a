"""The plain-path transfer as a callback chain (hkvsim.fabric.links.Fabric._plain_transfer) sees
the same times, in the same order, as a simpy process that queues for its poster (a Resource),
posts, moves its flow and waits the latency -- including every tie at equal simulated times,
which decide the order in which simultaneous completions reach their callers."""

from __future__ import annotations

import random
from collections.abc import Generator, Hashable
from typing import Any

import pytest
import simpy

from hkvsim.fabric import Endpoint, Fabric, TransferTiming
from test_fabric import grid, make_profile


class _Wire:
    """The process model's flow token: the fabric calls ``arrived`` when its bytes are off
    the wire; the waiting process is resumed through an event, as before the chain."""

    def __init__(self, env: simpy.Environment) -> None:
        self.event = env.event()

    def arrived(self, now: float) -> None:
        self.event.succeed()


class ProcessFabric(Fabric):
    """The reference: the plain path as one simpy process per transfer (the model the chain
    replaced), on the same links, flows and completion timer."""

    def transfer(self, *, initiator: Hashable, src: Hashable, dst: Hashable, nbytes: int,
                 descriptors: int, **_: Any) -> simpy.Event:
        assert self.profile.host_cores is None
        links, latency = self._route(src, dst)
        return self.env.process(self._process(self.endpoint(initiator), links, latency,
                                              nbytes, descriptors))

    def _process(self, poster: Endpoint, links: Any, latency: float, nbytes: int,
                 descriptors: int) -> Generator[simpy.Event, Any, TransferTiming]:
        env = self.env
        submitted = env.now
        with self._poster(poster).request() as req:
            yield req
            post_start = env.now
            yield env.timeout(self.profile.post_time(descriptors))
            post_end = env.now
        if nbytes > 0:
            wire = _Wire(env)
            self._start_flow(links, nbytes, wire)  # type: ignore[arg-type]
            yield wire.event
        wire_end = env.now
        yield env.timeout(latency)
        return TransferTiming(submitted=submitted, post_start=post_start, post_end=post_end,
                              wire_start=post_end, wire_end=wire_end, done=env.now,
                              nbytes=nbytes, descriptors=descriptors,
                              path=tuple(link.name for link in links))


def _trace(fabric_class: type[Fabric], seed: int) -> list[tuple[Any, ...]]:
    """Random transfers on a grid of 2 nodes x 4 GPUs, many at equal times (a coarse time grid,
    equal sizes, equal descriptor counts, zero-byte transfers), some posted from completion
    callbacks at the completion's instant, some from other events at the same instant; the
    trace is every completion in order, with its time and timing."""
    rng = random.Random(seed)
    env = simpy.Environment()
    fabric = fabric_class(env, make_profile(), grid())
    keys = list(grid())
    trace: list[tuple[Any, ...]] = []
    count = [0]

    def post(origin: str) -> None:
        i = count[0]
        count[0] += 1
        initiator = rng.choice(keys)
        src, dst = rng.choice([(rng.choice(keys), initiator), (initiator, rng.choice(keys))])
        nbytes = rng.choice([0, 1_000_000, 1_000_000, 4_000_000, 25_000_000])
        d = rng.choice([1, 100, 100]) if nbytes else rng.choice([0, 1])
        ev = fabric.transfer(initiator=initiator, src=src, dst=dst, nbytes=nbytes, descriptors=d)

        def done(e: simpy.Event) -> None:
            trace.append((i, origin, env.now, e.value))
            if count[0] < 400 and rng.random() < 0.5:
                for _ in range(rng.choice([1, 2])):
                    post("completion")
            if count[0] < 400 and rng.random() < 0.2:  # something else at the same instant
                env.timeout(0).callbacks.append(lambda _e: post("zero-delay"))

        ev.callbacks.append(done)

    for _ in range(120):
        at = rng.choice([0.0, 1e-5, 2e-5, 3e-5, 1e-4, 2e-4, 1e-3])
        env.timeout(at).callbacks.append(lambda _e: post("timer"))
    env.run()
    return trace


@pytest.mark.parametrize("seed", range(12))
def test_chain_matches_the_process_model_tie_for_tie(seed: int) -> None:
    want = _trace(ProcessFabric, seed)
    got = _trace(Fabric, seed)
    assert len(want) > 150
    assert got == want


def _events_processed(env: simpy.Environment) -> list[int]:
    count = [0]
    step = env.step

    def counting_step() -> None:
        step()  # raises EmptySchedule at the end: not an event
        count[0] += 1

    env.step = counting_step  # type: ignore[method-assign]
    return count


def test_a_plain_transfer_costs_two_events_and_simultaneous_starts_share_one_timer() -> None:
    """8 transfers posted together on 8 disjoint paths: 8 post ends (their flows start at one
    instant: the completion timer is armed once, after the last), one timer (they finish
    together) and 8 completions -- 17 events."""
    env = simpy.Environment()
    fabric = Fabric(env, make_profile(), grid())
    count = _events_processed(env)
    done = [fabric.transfer(initiator=(1, g), src=(0, g), dst=(1, g), nbytes=8_000_000,
                            descriptors=10) for g in range(4)]
    done += [fabric.transfer(initiator=(0, g), src=(1, g), dst=(0, g), nbytes=8_000_000,
                             descriptors=10) for g in range(4)]
    env.run()
    assert all(ev.processed and ev.ok for ev in done)
    assert len({ev.value.done for ev in done}) == 1
    assert count[0] == 2 * 8 + 1
