"""When to try connecting again, and when to give up (sans-IO).

The reference (magic-wormhole 0.24) dials each hint once per generation. If
every attempt of a generation fails (the relay is restarting, a load balancer
drops the port for a few seconds), nothing ever dials again and the
application waits forever. :class:`RedialPolicy` closes that hole; the
manager feeds it connection events with the current time and performs what
it returns:

* :class:`Retry`: the current generation has no attempt left (all failed),
  or none succeeded within ``attempt_timeout``. After a capped exponential
  backoff with jitter the side that can act tries again: a Leader starts a
  new generation (``reconnect``; every Follower, the reference's included,
  dials again on it), a Follower redials the peer's current hints and its
  own relays.
* :class:`GiveUp`: no connection for ``give_up_after`` seconds since the
  connection was lost (or since the first generation started). The manager
  fails every subchannel and waiter with
  :class:`~.manager.DilationReconnectFailed`.

States::

    UP --disconnected--> WAITING --attempting--> TRYING --attempts_failed--> BACKOFF
     ^                     |  ^                    |  ^                       |
     |                     |  +-- (peer's turn) ---+  +----- Retry (timer) ---+
     +------connected------+-----------------------+--------------------------+
    any state but UP: timer at give-up deadline --GiveUp--> GAVE_UP (final)

``WAITING`` is "nothing of ours is in flight and nothing for us to do": a
Follower waiting for the Leader's ``reconnect``, a Leader waiting for the
``reconnecting`` answer (both need the mailbox). Only the give-up deadline
runs there. No reactor, no clock: the caller passes ``now`` and calls
:meth:`RedialPolicy.timer_fired` at :meth:`RedialPolicy.next_deadline`.
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_GIVE_UP_AFTER = 300.0  # minutes, not seconds: a relay restart is routine
DEFAULT_FIRST_DELAY = 0.5
DEFAULT_MAX_DELAY = 5.0  # back within a few seconds of the path's return
DEFAULT_ATTEMPT_TIMEOUT = 30.0  # a generation whose attempts hang (no RST, no answer)


@dataclass(frozen=True, slots=True)
class Retry:
    """Try again now (Leader: new generation; Follower: redial). ``attempt`` counts from 1."""

    attempt: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    """No connection for ``give_up_after`` seconds: fail everything."""

    down_since: float
    retries: int


RedialAction = Retry | GiveUp


class RedialPolicy:
    """Capped exponential backoff with jitter, bounded by a give-up deadline."""

    def __init__(
        self,
        *,
        give_up_after: float = DEFAULT_GIVE_UP_AFTER,
        first_delay: float = DEFAULT_FIRST_DELAY,
        max_delay: float = DEFAULT_MAX_DELAY,
        attempt_timeout: float = DEFAULT_ATTEMPT_TIMEOUT,
        random: Callable[[], float] = _random.random,
    ) -> None:
        if not give_up_after > 0:
            raise ValueError(f"give_up_after must be > 0 seconds, not {give_up_after!r}")
        if not 0 < first_delay <= max_delay:
            raise ValueError(f"need 0 < first_delay <= max_delay, not {first_delay}, {max_delay}")
        if not attempt_timeout > 0:
            raise ValueError(f"attempt_timeout must be > 0 seconds, not {attempt_timeout!r}")
        self.give_up_after = give_up_after
        self.first_delay = first_delay
        self.max_delay = max_delay
        self.attempt_timeout = attempt_timeout
        self._random = random
        self.state = "UP"
        self.down_since: float | None = None
        self.retries = 0  # Retry actions since the connection was lost
        self._retry_at: float | None = None  # BACKOFF: when to Retry
        self._attempt_deadline: float | None = None  # TRYING: the attempt bound

    # --- events -------------------------------------------------------------------

    def disconnected(self, now: float) -> list[RedialAction]:
        """No connection (lost, or the first generation is about to start)."""
        if self.state == "UP":
            self.state = "WAITING"
            self.down_since = now
        return []

    def attempting(self, now: float) -> list[RedialAction]:
        """Attempts of ours are in flight (a generation started, a dial began)."""
        if self.state in ("WAITING", "BACKOFF"):
            self.state = "TRYING"
            self._retry_at = None
            self._attempt_deadline = now + self.attempt_timeout
        return []

    def attempts_failed(self, now: float) -> list[RedialAction]:
        """Every attempt in flight has failed and none is scheduled."""
        if self.state in ("TRYING", "WAITING"):
            self.state = "BACKOFF"
            self._attempt_deadline = None
            self._retry_at = now + self.delay(self.retries)
        return []

    def waiting_for_peer(self, now: float) -> list[RedialAction]:
        """Nothing of ours to try: the next move is the peer's (through the mailbox)."""
        if self.state in ("TRYING", "BACKOFF"):
            self.state = "WAITING"
            self._retry_at = self._attempt_deadline = None
        return []

    def connected(self, now: float) -> list[RedialAction]:
        if self.state != "GAVE_UP":
            self.state = "UP"
            self.down_since = None
            self.retries = 0
            self._retry_at = self._attempt_deadline = None
        return []

    def timer_fired(self, now: float) -> list[RedialAction]:
        if self.state in ("UP", "GAVE_UP"):
            return []
        assert self.down_since is not None
        if now >= self.down_since + self.give_up_after:
            self.state = "GAVE_UP"
            self._retry_at = self._attempt_deadline = None
            return [GiveUp(self.down_since, self.retries)]
        due = self._retry_at if self.state == "BACKOFF" else self._attempt_deadline
        if self.state == "WAITING" or due is None or now < due:
            return []
        self.retries += 1
        # Our retry starts new attempts: bound them like any generation's.
        self.state = "TRYING"
        self._retry_at = None
        self._attempt_deadline = now + self.attempt_timeout
        return [Retry(self.retries)]

    # --- queries ------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When :meth:`timer_fired` must be called next; None while up or given up."""
        if self.state in ("UP", "GAVE_UP"):
            return None
        assert self.down_since is not None
        deadlines = [self.down_since + self.give_up_after]
        if self.state == "BACKOFF" and self._retry_at is not None:
            deadlines.append(self._retry_at)
        if self.state == "TRYING" and self._attempt_deadline is not None:
            deadlines.append(self._attempt_deadline)
        return min(deadlines)

    def delay(self, retries: int) -> float:
        """Backoff before retry number ``retries + 1``: doubling, capped, jittered.

        The jitter takes up to half off, so two sides that lost the path at
        the same moment do not keep retrying in lockstep.
        """
        base = min(self.max_delay, self.first_delay * 2.0 ** min(retries, 32))
        return base * (1.0 - 0.5 * self._random())


def give_up_message(
    *,
    give_up_after: float,
    down_for: float,
    retries: int,
    generations: int,
    tried: dict[str, tuple[int, str]],
    relays: list[str],
    mailbox_connected: bool,
    first_connection: bool,
) -> str:
    """The give-up error's text: what was tried, since when, and what to check."""
    what = (
        "could not connect to the other side"
        if first_connection
        else ("lost the connection to the other side and could not re-establish it")
    )
    parts = [f"Dilation {what} within {give_up_after:g} s (reconnect_timeout)"]
    if tried:
        attempts = sum(n for n, _ in tried.values())
        listed = "; ".join(f"{desc} x{n} (last: {why})" for desc, (n, why) in sorted(tried.items()))
        parts.append(f"{attempts} failed connection attempts: {listed}")
    elif retries == 0 and mailbox_connected:
        parts.append(
            "the other side never started a new connection through the mailbox "
            "(its process may have ended)"
        )
    parts.append(
        f"{_count(retries, 'retry', 'retries')} and "
        f"{_count(generations, 'new generation', 'new generations')} in {down_for:.0f} s"
    )
    if not mailbox_connected:
        parts.append(
            "the mailbox server is unreachable right now, so the two sides cannot "
            "exchange new connection hints"
        )
    check = "check that the transit relay"
    check += f" ({', '.join(relays)})" if relays else " (none configured: pass relay_url)"
    check += (
        " and the mailbox server are reachable from both machines and that the other "
        "side is still running; raise reconnect_timeout to wait longer"
    )
    parts.append(check)
    return ". ".join(p[0].upper() + p[1:] for p in parts) + "."


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"
