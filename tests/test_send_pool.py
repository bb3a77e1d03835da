"""The sender pool's meetings against the directory's news (no processes, no server:
``rendezvous.meet`` is replaced by one that waits for its cancel, as the real one
does)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from spark_dilation.errors import TransferError
from spark_dilation.transfer.meet import rendezvous, views
from spark_dilation.transfer.meet.rendezvous import DoorSpoiled, RendezvousCancelled
from spark_dilation.transfer.meet.views import SenderView
from spark_dilation.transfer.rules.options import TransferOptions
from spark_dilation.transfer.rules.spec import TransferSpec
from spark_dilation.transfer.send.pool import ConnectionPool


@contextmanager
def _lane_0_hosted(transfer_id: str) -> Iterator[tuple[TransferSpec, SenderView]]:
    """A transfer whose lane 0 is hosted at epoch 0, in this process's registered view;
    afterwards the view ends (a meeting still waiting gives its claim up) and goes."""
    spec = TransferSpec(transfer_id, b"p" * 32, 1, b"", "none", TransferOptions())
    view = SenderView(spec.transfer_id, sender=0)
    view.update({"lanes": {"0": 0}})
    views.register_view(view)
    try:
        yield spec, view
    finally:
        view.update({"end": "test over"})
        views.forget(spec.transfer_id)


def _wait_for_cancel(cancelled: Callable[[], bool], what: str) -> None:
    """A meeting no host comes to: it polls its cancel as the real meet() does."""
    while not cancelled():
        time.sleep(0.05)
    raise RendezvousCancelled(f"stopped waiting for {what}")


def _stuck_meeting(monkeypatch: pytest.MonkeyPatch, news: dict[str, Any], expected: str) -> None:
    """A meeting waits at lane 0's door (epoch 0) for a host that never comes; ``news``
    reaches this process's view; the caller must fail at once, naming ``expected``."""
    waiting = threading.Event()

    def meet(*args: Any, cancelled: Any, what: str, **kwargs: Any) -> Any:
        waiting.set()
        _wait_for_cancel(cancelled, what)

    monkeypatch.setattr(rendezvous, "meet", meet)
    outcome: dict[str, Any] = {}

    def get() -> None:
        try:
            ConnectionPool().get(spec, 0, deadline=time.monotonic() + 3600)  # never, here
        except BaseException as e:
            outcome["error"] = e

    with _lane_0_hosted("ef" * 16) as (spec, view):
        caller = threading.Thread(target=get, daemon=True)
        caller.start()
        assert waiting.wait(10), "the meeting never reached its door"
        view.update(news)
        caller.join(30)  # a guard: before the fix it waited for its hour
        assert not caller.is_alive(), "the caller still waits at the door"
        error = outcome["error"]
        assert isinstance(error, TransferError), error
        assert expected in str(error), error


def test_a_meeting_at_a_lane_that_ended_for_good_fails_with_the_lanes_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reading end says lane 0 ended for good at epoch 0 (the registry failed it: no
    new host will come): the meeting at its door gives its claim up and the caller fails
    with the lane's error, not at ``lane_start_timeout`` with "never hosted"."""
    news = {
        "lanes": {"0": 0},
        "lanes_ended": {"0": {"epoch": 0, "error": "lane 0: its staging disk is full"}},
    }
    _stuck_meeting(monkeypatch, news, "lane 0 ended on the receiver, with no new host: lane 0:")


def test_a_stuck_meeting_ends_with_the_writing_ends_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A meeting waits at its door for a lane host that never comes; the writing end's
    end reaches this process's view (its hub went away). The meeting gives its claim up
    and the caller fails with that end, not at ``lane_start_timeout`` with "never
    hosted": a reused Spark worker keeps no claim for its whole life."""
    end = "the writing application's sender host went away"
    _stuck_meeting(monkeypatch, {"end": end}, end)


def test_a_spoiled_door_costs_one_attempt_and_the_deadline_names_the_stranger(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stranger spoils door attempt 0 (``meet`` raises DoorSpoiled): the meeting moves
    to attempt 1 at once, as the lane does (no error, no new meeting). When the lane's
    host does not come there either, the caller fails at its deadline naming the
    stranger, not "never hosted"."""
    attempts: list[int] = []

    def meet(spec: Any, code: str, role: str, door: Any, *, cancelled: Any, what: str, **_: Any):
        attempts.append(door.attempt)
        if door.attempt == 0:
            raise DoorSpoiled(f"a stranger was on the door to {what} (crowded)")
        _wait_for_cancel(cancelled, what)

    monkeypatch.setattr(rendezvous, "meet", meet)
    with _lane_0_hosted("ab" * 16) as (spec, _):
        with pytest.raises(TransferError, match="a stranger was on the door to lane 0") as info:
            ConnectionPool().get(spec, 0, deadline=time.monotonic() + 2)
        assert "lane_start_timeout" in str(info.value)
        assert attempts == [0, 1]


def test_a_meeting_stranded_by_a_server_that_lost_its_state_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The door's wormhole saw the mailbox server lose its state (``server_lost_state``:
    a restart without its database, see core.py) and the lane never came: the caller
    fails at its deadline with that cause, not "did not start"."""
    from types import SimpleNamespace

    def meet(*args: Any, cancelled: Any, what: str, started: Any, **kwargs: Any) -> Any:
        started(SimpleNamespace(server_lost_state=True, connection_problem=None))
        _wait_for_cancel(cancelled, what)

    monkeypatch.setattr(rendezvous, "meet", meet)
    with _lane_0_hosted("cd" * 16) as (spec, _):
        with pytest.raises(TransferError, match="lost its state meanwhile"):
            ConnectionPool().get(spec, 0, deadline=time.monotonic() + 1)


def test_a_meeting_stopped_by_the_transfers_failure_claims_no_other_door(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This process's transfer fails (``ConnectionPool.fail``) while a meeting waits at
    its door: the caller fails with that error, and the meeting ends without claiming
    another door (a stopped claim is the sender meeting table's STOP, not a re-host)."""
    attempts: list[int] = []
    waiting = threading.Event()

    def meet(spec: Any, code: str, role: str, door: Any, *, cancelled: Any, what: str, **_: Any):
        attempts.append(door.attempt)
        waiting.set()
        _wait_for_cancel(cancelled, what)

    monkeypatch.setattr(rendezvous, "meet", meet)
    outcome: dict[str, Any] = {}
    pool = ConnectionPool()
    with _lane_0_hosted("12" * 16) as (spec, _):

        def get() -> None:
            try:
                pool.get(spec, 0, deadline=time.monotonic() + 3600)
            except BaseException as e:
                outcome["error"] = e

        caller = threading.Thread(target=get, daemon=True)
        caller.start()
        assert waiting.wait(10), "the meeting never reached its door"
        pool.fail(spec.transfer_id, TransferError("the receiver aborted"))
        caller.join(30)
        assert not caller.is_alive()
        assert "the receiver aborted" in str(outcome["error"])
        meeting = pool._meetings[(spec.transfer_id, 0)]
        assert meeting.done.wait(10)
        assert isinstance(meeting.error, RendezvousCancelled), meeting.error
        assert attempts == [0]


def test_a_directory_link_stranded_by_a_server_that_lost_its_state_is_named() -> None:
    """The directory link never met (the server restarted without its database while it
    met, see core.py): no lane's epoch ever comes, so no door is claimed. The caller fails
    at its deadline naming the lost state (the writing end's view asks its link), not
    "did not start"."""
    from spark_dilation.transfer.meet.rendezvous import lost_state

    spec = TransferSpec("34" * 16, b"p" * 32, 1, b"", "none", TransferOptions())
    view = SenderView(spec.transfer_id, sender=0)  # no lane hosted: nothing heard
    view.link_lost_state = lambda: lost_state(type("W", (), {"server_lost_state": True})())
    views.register_view(view)
    try:
        with pytest.raises(TransferError, match="lost its state meanwhile") as info:
            ConnectionPool().get(spec, 0, deadline=time.monotonic() + 1)
        assert "lane_start_timeout" in str(info.value)
    finally:
        view.update({"end": "test over"})
        views.forget(spec.transfer_id)
