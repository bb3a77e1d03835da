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
* No path at all: the connection was never up, and ``no_path_timeout``
  seconds have passed since the first round of our attempts ended without
  one (every hint refused or timed out, or none answered within
  ``attempt_timeout``). Retries go on within that window (a peer's late
  hint, a relay coming up), then :class:`GiveUp` with ``no_path``: a
  transfer with no path fails in seconds, not after ``give_up_after``.
  Bound: the first round ends within the dial timeout (10 s) or
  ``attempt_timeout``, so a side with no path ends within
  ``attempt_timeout + no_path_timeout`` of its first attempt.

States::

    UP --disconnected--> WAITING --attempting--> TRYING --attempts_failed--> BACKOFF
     ^                     |  ^                    |  ^                       |
     |                     |  +-- (peer's turn) ---+  +----- Retry (timer) ---+
     +------connected------+-----------------------+--------------------------+
    any state but UP: timer at give-up deadline --GiveUp--> GAVE_UP (final)
    never UP: timer at first failure + no_path_timeout --GiveUp--> GAVE_UP

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
# Never connected and every hint failed: a few backoff rounds (0.5+1+2+4+5 s)
# for a late hint or a relay that is just starting, then fail.
DEFAULT_NO_PATH_TIMEOUT = 15.0


@dataclass(frozen=True, slots=True)
class Retry:
    """Try again now (Leader: new generation; Follower: redial). ``attempt`` counts from 1."""

    attempt: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    """No connection for ``give_up_after`` seconds: fail everything."""

    down_since: float
    retries: int
    no_path: bool = False  # never up, every hint failed (no_path_timeout), not a lost connection


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
        no_path_timeout: float = DEFAULT_NO_PATH_TIMEOUT,
        random: Callable[[], float] = _random.random,
    ) -> None:
        if not give_up_after > 0:
            raise ValueError(f"give_up_after must be > 0 seconds, not {give_up_after!r}")
        if not 0 < first_delay <= max_delay:
            raise ValueError(f"need 0 < first_delay <= max_delay, not {first_delay}, {max_delay}")
        if not attempt_timeout > 0:
            raise ValueError(f"attempt_timeout must be > 0 seconds, not {attempt_timeout!r}")
        if not no_path_timeout > 0:
            raise ValueError(f"no_path_timeout must be > 0 seconds, not {no_path_timeout!r}")
        self.give_up_after = give_up_after
        self.no_path_timeout = no_path_timeout
        self.ever_up = False
        self.first_failed: float | None = None  # never up: when our first round ended
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
        self._first_failure(now)
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
            self.ever_up = True
            self.down_since = None
            self.retries = 0
            self._retry_at = self._attempt_deadline = None
        return []

    def timer_fired(self, now: float) -> list[RedialAction]:
        if self.state in ("UP", "GAVE_UP"):
            return []
        assert self.down_since is not None
        no_path_at = self._no_path_deadline()
        no_path = no_path_at is not None and now >= no_path_at
        if no_path or now >= self.down_since + self.give_up_after:
            self.state = "GAVE_UP"
            self._retry_at = self._attempt_deadline = None
            return [GiveUp(self.down_since, self.retries, no_path=no_path)]
        due = self._retry_at if self.state == "BACKOFF" else self._attempt_deadline
        if self.state == "WAITING" or due is None or now < due:
            return []
        if self.state == "TRYING":  # the attempts hung past attempt_timeout: a failed round
            self._first_failure(now)
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
        no_path = self._no_path_deadline()
        if no_path is not None:
            deadlines.append(no_path)
        if self.state == "BACKOFF" and self._retry_at is not None:
            deadlines.append(self._retry_at)
        if self.state == "TRYING" and self._attempt_deadline is not None:
            deadlines.append(self._attempt_deadline)
        return min(deadlines)

    def _first_failure(self, now: float) -> None:
        if not self.ever_up and self.first_failed is None:
            self.first_failed = now

    def _no_path_deadline(self) -> float | None:
        """Never up and a round failed: when to stop trying (None: not due)."""
        if self.ever_up or self.first_failed is None:
            return None
        return self.first_failed + self.no_path_timeout

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
    no_path: bool = False,
    no_path_timeout: float = DEFAULT_NO_PATH_TIMEOUT,
) -> str:
    """The give-up error's text: what was tried, since when, and what to check."""
    if no_path:
        return no_path_message(
            down_for=down_for,
            no_path_timeout=no_path_timeout,
            tried=tried,
            relays=relays,
            mailbox_connected=mailbox_connected,
        )
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


def no_path_message(
    *,
    down_for: float,
    no_path_timeout: float,
    tried: dict[str, tuple[int, str]],
    relays: list[str],
    mailbox_connected: bool,
) -> str:
    """One line for "never connected, every hint failed": each hint and why, what to check."""
    if tried:
        # Relays first: with no_listen they are the only path.
        order = sorted(tried.items(), key=lambda kv: (not kv[0].startswith("relay"), kv[0]))
        listed = ", ".join(
            f"{desc} {why}" + (f" (x{n})" if n > 1 else "") for desc, (n, why) in order
        )
    elif relays:
        listed = f"relay {', '.join(relays)} never answered"
    else:
        listed = "no relay configured and no direct hint from either side"
    text = (
        f"could not reach the other side: {listed}; no connection within {down_for:.0f} s "
        f"(gave up {no_path_timeout:g} s after every attempt had failed)"
    )
    if not mailbox_connected:
        text += "; the mailbox server is unreachable too"
    check = (
        f"check that the transit relay {', '.join(relays)} is running and reachable from both "
        "machines, or that the machines can reach each other directly"
        if relays
        else "check that the machines can reach each other directly, or configure a transit "
        "relay both can reach"
    )
    return f"{text}. {check[0].upper()}{check[1:]}."


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"
