"""The glue half of a pure core's ``next_deadline()`` / ``timer_fired(now)``.

The keepalive, the Leader's selection and the redial policy each say when
they must be woken next; a :class:`DeadlineTimer` keeps exactly one reactor
call for that moment and hands the core the reactor's time when it fires.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class DeadlineTimer:
    def __init__(self, reactor: Any, fire: Callable[[float], None]) -> None:
        self._reactor = reactor
        self._fire = fire
        self._call: Any = None

    def arm(self, deadline: float | None) -> None:
        """Wake at ``deadline`` (reactor time; None: not at all), replacing any earlier call."""
        self.cancel()
        if deadline is not None:
            delay = max(0.0, deadline - self._reactor.seconds())
            self._call = self._reactor.callLater(delay, self._fired)

    def cancel(self) -> None:
        if self._call is not None and self._call.active():
            self._call.cancel()
        self._call = None

    def _fired(self) -> None:
        self._call = None
        self._fire(self._reactor.seconds())
