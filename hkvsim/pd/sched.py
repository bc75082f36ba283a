"""A tiny cooperative scheduler for the coordinator's request flows. No clock, no I/O.

Each request's lifecycle reads as sequential code: a generator that yields :class:`Signal`
objects and resumes with their value. Time is only what the driver says it is: ``advance(now)``
fires the timers that are due, ``next_timer()`` tells the driver when to call again. A signal's
waiters resume in the order they started waiting; a task resumed by the replies it was waiting
for (``urgent``) runs before tasks already queued, so a call answered at once (an in-process
rank) continues its flow exactly as a direct call would.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Generator, Iterable
from itertools import count
from typing import Any

__all__ = ["Signal", "Timer", "Task", "Scheduler", "Flow"]

Flow = Generator["Signal", Any, Any]


class Signal:
    """A one-shot event: waiters resume with its value once it is triggered."""

    __slots__ = ("triggered", "value", "_waiters", "_sched", "urgent")

    def __init__(self, sched: Scheduler, *, urgent: bool = False) -> None:
        self.triggered = False
        self.value: Any = None
        self._waiters: list[Callable[[Signal], None]] = []
        self._sched = sched
        self.urgent = urgent

    def succeed(self, value: Any = None) -> None:
        if self.triggered:
            return
        self.triggered, self.value = True, value
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter(self)

    def on(self, callback: Callable[[Signal], None]) -> None:
        """Call ``callback(self)`` when triggered (at once if it already is)."""
        if self.triggered:
            callback(self)
        else:
            self._waiters.append(callback)


class Timer(Signal):
    """A signal the scheduler triggers at ``deadline``; ``cancel`` keeps it from firing."""

    __slots__ = ("deadline", "cancelled")

    def __init__(self, sched: Scheduler, deadline: float) -> None:
        super().__init__(sched)
        self.deadline = deadline
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Task:
    __slots__ = ("gen", "done", "name")

    def __init__(self, gen: Flow, done: Signal, name: str) -> None:
        self.gen, self.done, self.name = gen, done, name


class Scheduler:
    def __init__(self) -> None:
        self.now = 0.0
        self._ready: deque[tuple[Task, Any]] = deque()
        self._timers: list[tuple[float, int, Timer]] = []
        self._seq = count()
        self.tasks = 0  # alive
        # timers created so far: while it is unchanged, the earliest deadline can only have
        # moved later (timers are only ever fired or cancelled), which a driver's timer uses
        self.timers_made = 0

    # ---- signals ------------------------------------------------------------------------------
    def signal(self, *, urgent: bool = False) -> Signal:
        return Signal(self, urgent=urgent)

    def timeout(self, delay: float) -> Timer:
        return self.at(self.now + max(0.0, delay))

    def at(self, deadline: float) -> Timer:
        timer = Timer(self, deadline)
        heapq.heappush(self._timers, (deadline, next(self._seq), timer))
        self.timers_made += 1
        return timer

    def any_of(self, signals: Iterable[Signal]) -> Signal:
        """Triggered by the first of ``signals`` to trigger; its value is that signal. Timers
        among the others are cancelled then (a lease released early leaves no timer behind)."""
        items = list(signals)
        out = self.signal()

        def first(s: Signal) -> None:
            if out.triggered:
                return
            out.succeed(s)
            for other in items:
                if other is not s and isinstance(other, Timer) and not other.triggered:
                    other.cancel()

        for s in items:
            s.on(first)
        return out

    def all_of(self, signals: Iterable[Signal], *, urgent: bool = False) -> Signal:
        """Triggered once every one of ``signals`` is; its value is their values, in order."""
        items = list(signals)
        out = self.signal(urgent=urgent)
        left = [len(items)]
        if not items:
            out.succeed([])
            return out

        def one(_: Signal) -> None:
            left[0] -= 1
            if left[0] == 0:
                out.succeed([s.value for s in items])

        for s in items:
            s.on(one)
        return out

    # ---- tasks --------------------------------------------------------------------------------
    def spawn(self, gen: Flow, name: str = "") -> Signal:
        """Start a flow (it runs at the next ``run``); returns the signal of its return value."""
        done = self.signal()
        self.tasks += 1
        self._ready.append((Task(gen, done, name), None))
        return done

    def _resume_on(self, task: Task, sig: Signal) -> None:
        def wake(s: Signal) -> None:
            if s.urgent:
                self._ready.appendleft((task, s.value))
            else:
                self._ready.append((task, s.value))

        sig.on(wake)

    def run(self, until_blocked: Callable[[], bool] | None = None) -> None:
        """Run ready tasks until none is left, or until ``until_blocked()`` says the driver must
        act first (calls are waiting to be carried out)."""
        while self._ready:
            if until_blocked is not None and until_blocked():
                return
            task, value = self._ready.popleft()
            try:
                sig = task.gen.send(value)
            except StopIteration as stop:
                self.tasks -= 1
                task.done.succeed(stop.value)
                continue
            if not isinstance(sig, Signal):  # a flow bug: fail loudly
                raise TypeError(f"flow {task.name!r} yielded {sig!r}, not a Signal")
            self._resume_on(task, sig)

    # ---- time ---------------------------------------------------------------------------------
    def next_timer(self) -> float | None:
        while self._timers and self._timers[0][2].cancelled:
            heapq.heappop(self._timers)
        return self._timers[0][0] if self._timers else None

    def advance(self, now: float) -> None:
        """Set the time to ``now`` and fire every timer that is due, in deadline order."""
        if now < self.now:
            raise ValueError(f"time went backwards: {now} < {self.now}")
        self.now = float(now)
        while self._timers and self._timers[0][0] <= now:
            _, _, timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.succeed(timer)

    def idle(self) -> bool:
        return not self._ready
