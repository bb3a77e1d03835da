"""Rendezvous: how a sender process and a lane find each other through the mailbox.

Every lane keeps one open *lobby*: a wormhole on slot ``k`` of its lane,
whose nameplate and password are derived from the transfer secret
(:func:`~.protocol.slot_code`). A sender process that needs the lane claims
slots from 0 upward; the mailbox server lets two sides into a nameplate and
answers ``crowded`` to a third, so a claim is atomic. Both sides keep their
claim for as long as the pairing lives (``keep_nameplate``), so a used slot
stays crowded and newcomers move past it. After a pairing the lane opens its
lobby on the next slot.

:class:`SlotPolicy` is the rule, pure; :func:`pair` is the blocking glue on
the crochet reactor. Outcomes of one probe and what each role does:

==================  ===========================  ================================
outcome             sender                       lane
==================  ===========================  ================================
crowded             next slot                    retry the slot a few times (a
                                                 sender collision clears in ms),
                                                 then next slot
peer of other role  paired                       paired; lobby on the next slot
peer of same role   both leave cleanly; restart  burn the slot (keep the claim),
                    from slot 0 after a jitter   next slot
alone for T_pair    leave cleanly; restart from  stay: this is the lobby
                    slot 0 after a backoff
peer key, no        burn the slot (its peer      burn the slot, next slot
versions in T_pair  died there), next slot
the lane it probes  burn the slot; the lane is   burn the slot, next slot
(same incarnation)  alive: stop probing
==================  ===========================  ================================

The last row serves a sender whose connection to a lane has been down for a
while (:class:`~.sender.ConnectionPool`): it *probes* the lane's lobby naming
the incarnation it is connected to. The same incarnation means the lane lives
and only the path is down (wait for Dilation's reconnect); another one means
the lane was replaced (its process or machine was lost), so the sender pairs
with the new one at once instead of waiting ``reconnect_timeout``.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import crochet
from twisted.internet import defer

from ..errors import CrowdedError, DilationError, ServerConnectionError
from ..wormhole.blocking import ensure_reactor, run_and_wait
from .protocol import (
    RENDEZVOUS_APPID,
    ROLE_LANE,
    ROLE_SENDER,
    peer_incarnation,
    peer_role,
    rendezvous_versions,
    same_incarnation,
    slot_code,
)

log = logging.getLogger(__name__)

DEFAULT_PAIR_TIMEOUT = 3.0  # T_pair: a live peer confirms the key within milliseconds
LANE_CROWDED_RETRIES = 3
# How long a cancelled pairing waits for the mailbox to confirm its close (the
# wormhole's own close timeout is longer; a stop must not hang on a dead server).
CLOSE_WAIT = 5.0


# --- the pure rule ------------------------------------------------------------------


CROWDED = "crowded"
PAIRED = "paired"
SAME_ROLE = "same-role"
ALONE = "alone"
HALF_DEAD = "half-dead"
SAME_INCARNATION = "same-incarnation"


@dataclass(frozen=True)
class Step:
    """What to do after a probe: ``slot`` to probe next after ``delay`` seconds."""

    action: str  # "probe", "done"
    slot: int
    delay: float = 0.0
    release: bool = True  # leave the slot cleanly (False: keep the claim, burn it)


class SlotPolicy:
    """The rendezvous rule for one role (see the module docstring). No I/O, no clock."""

    def __init__(self, role: str, rng: random.Random | None = None) -> None:
        if role not in (ROLE_SENDER, ROLE_LANE):
            raise ValueError(role)
        self.role = role
        self._rng = rng or random.Random()
        self._crowded_retries = 0
        self._polls = 0

    def first(self, start: int = 0) -> Step:
        return Step("probe", start)

    def after(self, slot: int, outcome: str) -> Step:
        lane = self.role == ROLE_LANE
        if outcome == PAIRED:
            self._crowded_retries = 0
            self._polls = 0
            return Step("done", slot + 1)
        if outcome == CROWDED:
            if lane and self._crowded_retries < LANE_CROWDED_RETRIES:
                self._crowded_retries += 1
                return Step("probe", slot, delay=0.1 * 2**self._crowded_retries)
            self._crowded_retries = 0
            return Step("probe", slot + 1)
        self._crowded_retries = 0
        if outcome == HALF_DEAD:
            return Step("probe", slot + 1, release=False)
        if outcome == SAME_INCARNATION:
            return (
                Step("probe", slot + 1, release=False)
                if lane
                else Step("alive", slot, release=False)
            )
        if outcome == SAME_ROLE:
            if lane:
                return Step("probe", slot + 1, release=False)
            return Step("probe", 0, delay=self._rng.uniform(0.05, 0.5))
        if outcome == ALONE:
            if lane:  # never reported: the lane waits in its lobby
                return Step("probe", slot)
            self._polls += 1
            return Step("probe", 0, delay=min(2.0, 0.1 * self._polls) * self._rng.uniform(0.5, 1.0))
        raise ValueError(outcome)


# --- one probe on the reactor -----------------------------------------------------------


@dataclass
class _Probe:
    wormhole: Any
    outcome: str = ""
    peer_incarnation: str = ""


def _probe_slot(
    reactor: Any,
    mailbox_url: str,
    secret: bytes,
    transfer_id: str,
    lane: int,
    slot: int,
    role: str,
    pair_timeout: float,
    wait_alone: bool,
    versions: dict[str, Any],
    closing: list[defer.Deferred] | None = None,
) -> defer.Deferred:
    """Claim one slot; fires with a :class:`_Probe` whose outcome is one of the constants.

    The wormhole stays open when paired; otherwise it is already closed
    (released) or abandoned (burnt), as the policy wants. Cancelling the
    Deferred closes the wormhole cleanly; the close's Deferred is appended
    to ``closing`` so the caller can wait for it.
    """
    from ..wormhole.client import Wormhole

    w = Wormhole(
        RENDEZVOUS_APPID,
        mailbox_url,
        reactor,
        app_versions=versions,
        dilation=True,
        keep_nameplate=True,
    )
    probe = _Probe(w)
    timers: dict[str, Any] = {}
    result: defer.Deferred

    def cancel_timers() -> None:
        for t in timers.values():
            if t.active():
                t.cancel()
        timers.clear()

    def finish(outcome: str) -> None:
        cancel_timers()
        if result.called:
            return
        probe.outcome = outcome
        result.callback(probe)

    def fail(error: BaseException) -> None:
        cancel_timers()
        if not result.called:
            result.errback(error)

    def cancelled(_: defer.Deferred) -> None:
        cancel_timers()
        closed = w.close().addErrback(lambda _: None)
        if closing is not None:
            closing.append(closed)

    result = defer.Deferred(canceller=cancelled)

    def on_versions(app_versions: dict[str, Any]) -> None:
        other = peer_role(app_versions, transfer_id, lane)
        probe.peer_incarnation = peer_incarnation(app_versions)
        if other is not None and other != role and same_incarnation(versions, app_versions):
            finish(SAME_INCARNATION)
        elif other is not None and other != role:
            finish(PAIRED)
        else:
            log.debug("slot %d of lane %d: peer role %r, ours %r", slot, lane, other, role)
            finish(SAME_ROLE)

    def on_error(failure: Any) -> None:
        if result.called:
            return
        if failure.check(CrowdedError):
            finish(CROWDED)
        elif failure.check(ServerConnectionError):
            fail(failure.value)
        elif failure.check(defer.CancelledError):
            return
        else:  # wrong key, closed under us: nothing to pair with here
            log.info("rendezvous slot %d of lane %d: %s", slot, lane, failure.value)
            finish(HALF_DEAD)

    def on_key(_: Any) -> None:
        alone = timers.pop("alone", None)
        if alone is not None and alone.active():
            alone.cancel()
        if not result.called:
            timers["key"] = reactor.callLater(pair_timeout, finish, HALF_DEAD)

    if not wait_alone:
        timers["alone"] = reactor.callLater(pair_timeout, finish, ALONE)
    w.get_versions().addCallbacks(on_versions, on_error)
    w.get_unverified_key().addCallbacks(on_key, lambda f: None)
    w.when_closed().addCallback(lambda error: on_error(_failure(error)) if error else None)
    w.set_code(slot_code(secret, lane, slot))
    return result


def _failure(error: BaseException) -> Any:
    from twisted.python.failure import Failure

    return Failure(error)


def _leave(probe: _Probe, release: bool) -> None:
    if release:
        probe.wormhole.close().addErrback(lambda _: None)
    else:
        probe.wormhole.abandon()


# --- blocking pairing ---------------------------------------------------------------------


class RendezvousTimeout(DilationError, TimeoutError):
    """No peer showed up on the lane's slots within the deadline."""


class RendezvousCancelled(DilationError):
    """The pairing was cancelled (the lane finished, or the caller gave up)."""


class LaneAlive(DilationError):
    """A probe met the lane incarnation it named: the lane lives (see the module docstring)."""


@dataclass
class Paired:
    """A paired rendezvous wormhole, not yet dilated; the lane's incarnation if it named one."""

    wormhole: Any
    slot: int
    incarnation: str = ""


def pair(
    *,
    mailbox_url: str,
    secret: bytes,
    transfer_id: str,
    lane: int,
    role: str,
    start_slot: int = 0,
    deadline: float | None = None,
    pair_timeout: float = DEFAULT_PAIR_TIMEOUT,
    cancel: threading.Event | None = None,
    what: str = "",
    incarnation: str = "",
    probe: str = "",
) -> Paired:
    """Pair with a peer of the other role on ``lane`` (blocking; not in the reactor).

    ``deadline`` is a ``time.monotonic()`` value (None: wait forever, for a
    lane's lobby). Raises :class:`RendezvousTimeout` when it passes,
    :class:`RendezvousCancelled` when ``cancel`` is set, and the mailbox's
    own errors (server unreachable) as they are. A lane names its
    ``incarnation``; a sender that ``probe``s for a replacement of that lane
    incarnation gets :class:`LaneAlive` if it is still the one in the lobby.
    """
    from twisted.internet import reactor

    ensure_reactor()
    versions = rendezvous_versions(transfer_id, role, lane, incarnation=incarnation, probe=probe)
    policy = SlotPolicy(role)
    step = policy.first(start_slot)
    while True:
        if step.delay:
            _sleep(step.delay, deadline, cancel)
        _check(deadline, cancel, what)
        slot = step.slot
        closing: list[defer.Deferred] = []
        waiter = crochet.run_in_reactor(_probe_slot)(
            reactor,
            mailbox_url,
            secret,
            transfer_id,
            lane,
            slot,
            role,
            pair_timeout,
            role == ROLE_LANE,
            versions,
            closing,
        )
        while True:
            try:
                probe: _Probe = waiter.wait(0.25)
                break
            except crochet.TimeoutError:
                if (cancel is not None and cancel.is_set()) or _expired(deadline):
                    waiter.cancel()
                    with contextlib.suppress(Exception):
                        waiter.wait(1)  # consume the CancelledError (crochet logs it otherwise)
                    # Wait for the mailbox to confirm the close: a process that
                    # exits right after (a CLI after its transfer) would drop the
                    # connection mid-close and log a lost connection.
                    if closing:
                        with contextlib.suppress(Exception):
                            crochet.run_in_reactor(lambda d: d)(closing[0]).wait(CLOSE_WAIT)
                    _check(deadline, cancel, what)
        step = policy.after(slot, probe.outcome)
        if probe.outcome == PAIRED:
            log.debug("lane %d: paired as %s on slot %d", lane, role, slot)
            return Paired(probe.wormhole, slot, probe.peer_incarnation)
        if probe.outcome != CROWDED:
            run_and_wait(
                _leave,
                probe,
                step.release,
                timeout=10,
                on_timeout=lambda slot=slot: RendezvousTimeout(f"leaving slot {slot} took 10 s"),
            )
        if step.action == "alive":
            raise LaneAlive(f"{what or f'lane {lane}'} is alive on slot {slot}")


def _expired(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline


def _check(deadline: float | None, cancel: threading.Event | None, what: str) -> None:
    if cancel is not None and cancel.is_set():
        raise RendezvousCancelled(f"stopped waiting for {what or 'the peer'}")
    if _expired(deadline):
        raise RendezvousTimeout(what or "no peer came to the rendezvous in time")


def _sleep(seconds: float, deadline: float | None, cancel: threading.Event | None) -> None:
    if deadline is not None:
        seconds = min(seconds, max(0.0, deadline - time.monotonic()))
    if cancel is not None:
        cancel.wait(seconds)
    else:
        time.sleep(seconds)


def dilate_paired(
    paired: Paired,
    *,
    relay_url: str | None,
    no_listen: bool,
    listen: Iterable[str],
    peer_timeout: float,
    timeout: float,
    no_path_timeout: float,
    receive_buffer: int | None = None,
) -> Any:
    """Dilate a paired wormhole and wrap it in the blocking facade.

    ``peer_timeout`` (the transfer's ``reconnect_timeout``) is also the
    Dilation ``reconnect_timeout``, so its give-up error, which says what was
    tried and names the option's value, is the one raised.
    """
    from ..dilation.api import dilate
    from ..dilation.blocking import BlockingDilation, DilationTimeout

    names = tuple(listen)
    w = paired.wormhole

    def start() -> Any:
        return dilate(
            w,
            relay_url=relay_url,
            no_listen=no_listen,
            expected_subprotocols=names,
            reconnect_timeout=peer_timeout,
            no_path_timeout=no_path_timeout,
        )

    dw = run_and_wait(
        start, timeout=timeout, on_timeout=lambda: DilationTimeout("starting Dilation", timeout)
    )
    extra = {} if receive_buffer is None else {"receive_buffer": receive_buffer}
    return BlockingDilation(
        dw, listen=names, wormhole=w, peer_timeout=peer_timeout, timeout=timeout, **extra
    )


__all__ = [
    "ALONE",
    "CROWDED",
    "HALF_DEAD",
    "PAIRED",
    "SAME_INCARNATION",
    "SAME_ROLE",
    "LaneAlive",
    "Paired",
    "RendezvousCancelled",
    "RendezvousTimeout",
    "SlotPolicy",
    "Step",
    "dilate_paired",
    "pair",
]
