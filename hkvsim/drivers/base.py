"""What every driver does with the coordinator: feed it one input at a time, carry out its
effects until it has none left, then arm its next timer."""

from __future__ import annotations

from collections.abc import Callable

from ..pd.coordinator import Coordinator, Effect

__all__ = ["CoordinatorLoop"]


class CoordinatorLoop:
    """Feeds inputs to the coordinator without ever running it re-entrantly.

    ``carry_out(effects)`` is the driver's part: start calls on ranks (answering at once, or
    later), apply faults. Inputs that arrive while effects are being carried out (a rank dying
    inside a post) wait their turn. ``after()`` runs once the coordinator is idle again (arm the
    next timer, report progress)."""

    def __init__(self, coord: Coordinator, carry_out: Callable[[list[Effect]], None],
                 after: Callable[[], None]) -> None:
        self.coord = coord
        self._carry_out = carry_out
        self._after = after
        self._busy = False
        self._inbox: list[Callable[[], None]] = []

    def deliver(self, feed: Callable[[], None]) -> None:
        if self._busy:
            self._inbox.append(feed)
            return
        self._busy = True
        try:
            feed()
            self._pump()
            while self._inbox:
                self._inbox.pop(0)()
                self._pump()
        finally:
            self._busy = False
        self._after()

    def later(self, feed: Callable[[], None]) -> None:
        """Feed this input once the current one is done (or now, when idle)."""
        self.deliver(feed)

    def _pump(self) -> None:
        while True:
            self.coord.run_ready()
            effects = self.coord.take_effects()
            if not effects:
                return
            self._carry_out(effects)
