"""When a lane that ends the transfer stops waiting (rules/endwait.py), on a fake clock."""

from __future__ import annotations

import pytest

from spark_dilation.transfer.rules.endwait import OTHER_WAY_GRACE, EndWait

# (name, EndWait arguments, events as (time, what), expected end time, outcome, linger)
CASES = [
    ("no connection, no directory", {}, [(0.0, "done")], 0.0, "", True),
    ("no connection; the directory answers", {"other_way": True},
     [(0.0, "done"), (0.4, "heard")], 0.4, "confirmed", False),
    ("no connection; the directory stays silent", {"other_way": True},
     [(0.0, "done")], OTHER_WAY_GRACE, "", True),
    ("an answer on a connection", {}, [(0.1, "sent"), (0.9, "confirmed")], 0.9, "confirmed", True),
    ("sent, never answered", {}, [(0.1, "sent")], 5.0, "sent", True),
    ("sent, never answered, about to exit", {"flush": 0.5},
     [(0.1, "sent"), (0.3, "sent")], 0.6, "sent", True),
    ("the directory first, with data queued", {"other_way": True},
     [(0.1, "sent"), (0.3, "heard"), (2.0, "confirmed")], 0.3, "confirmed", False),
    ("every connection failed after A; the directory answers late", {"other_way": True},
     [(0.1, "sent"), (2.0, "done"), (2.5, "heard")], 2.5, "confirmed", False),
    ("every connection failed after A; the directory too late", {"other_way": True},
     [(0.1, "sent"), (2.0, "done"), (3.5, "heard")], 2.0 + OTHER_WAY_GRACE, "sent", True),
]  # fmt: skip


@pytest.mark.parametrize(("name", "args", "events", "ends", "outcome", "linger"), CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_the_wait_ends_when_the_rule_says(name, args, events, ends, outcome, linger) -> None:
    wait = EndWait(deadline=5.0, **args)
    pending = sorted(events)
    now = 0.0
    while not wait.over(now):
        while pending and pending[0][0] <= now:
            _, what = pending.pop(0)
            if what == "sent":
                wait.on_sent(now)
            elif what == "confirmed":
                wait.on_confirmed()
            elif what == "heard":
                wait.on_heard()
            else:
                wait.on_tellers_done(now)
        if wait.over(now):
            break
        now = round(now + 0.05, 2)
    assert now == pytest.approx(ends)
    assert (wait.outcome, wait.linger) == (outcome, linger)
