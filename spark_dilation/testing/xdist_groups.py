"""A pytest plugin: ``--dist loadgroup`` keeps each ``xdist_group`` on one worker.

pytest-xdist (3.8) names a test's group by rewriting ``item._nodeid``, which
pytest 9.2 no longer reads (``nodeid`` is ``str(item._id)``), so every group
was silently spread over the workers (two sets of namespace clusters at once,
two Connect servers on one port). Until xdist follows, the worker appends
``@group`` here; a fixed xdist has done it already.

Then, at the end of collection, every grouped test must end with its
``@group``, the one thing xdist schedules by: a pytest or xdist that changed
how a node id is made (the pins in ``conf/test-constraints.txt``) fails each
such test at its setup, saying why, instead of running two groups at once. (A
worker that raised at collection would only show xdist's own crash.)

It also orders the work units (a group, or a test of none) as xdist would,
largest first, except that units with a test marked ``liveness`` (whose
assertions bound a time: docs/transfer.md's "Liveness") wait until
``HOLD_PER_WORKER`` units per worker were handed out: the first units start
every worker's Spark applications at once, and that burst is no place for a
bound. xdist's own reordering is turned off so it keeps this order.
"""

from __future__ import annotations

import pytest

HOLD_PER_WORKER = 2
LIVENESS = "liveness"


def _loadgroup(config: pytest.Config) -> bool:
    # A worker has option.loadgroup; the controller, the --dist it was given.
    dist = getattr(config.option, "dist", "no")
    return bool(getattr(config.option, "loadgroup", False)) or dist == "loadgroup"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{LIVENESS}: asserts a time bound; not among the first units under loadgroup"
    )
    if _loadgroup(config) and not hasattr(config, "workerinput"):
        config.option.loadscopereorder = False  # the controller keeps the workers' order


def order_units(units: list[tuple[str, int, bool]], hold: int) -> list[str]:
    """Unit names in hand-out order: ``units`` is (name, tests, liveness) in collection
    order; largest first (stable), the liveness units not among the first ``hold``."""
    ranked = sorted(units, key=lambda unit: -unit[1])
    free = [name for name, _, bound in ranked if not bound]
    bound = [name for name, _, held in ranked if held]
    return free[:hold] + bound + free[hold:]


@pytest.hookimpl(trylast=True)  # after -m and -k deselected: the units that run
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _loadgroup(config):
        return
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is not None and "@" not in item.nodeid.rsplit("::", 1)[-1]:
            item._id = type(item._id).parse(f"{item.nodeid}@{mark.args[0]}")  # type: ignore[attr-defined]
        units.setdefault(f"@{mark.args[0]}" if mark else item.nodeid, []).append(item)
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    order = order_units(
        [
            (name, len(tests), any(t.get_closest_marker(LIVENESS) for t in tests))
            for name, tests in units.items()
        ],
        HOLD_PER_WORKER * workers,
    )
    items[:] = [item for name in order for item in units[name]]


def lost_groups(items: list[pytest.Item]) -> list[str]:
    """The grouped tests whose node id does not end with their ``@group``."""
    return [
        item.nodeid
        for item in items
        if (mark := item.get_closest_marker("xdist_group")) is not None
        and not item.nodeid.endswith(f"@{mark.args[0]}")
    ]


_LOST = pytest.StashKey[frozenset[str]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if _loadgroup(session.config):
        session.config.stash[_LOST] = frozenset(lost_groups(session.items))


def pytest_runtest_setup(item: pytest.Item) -> None:
    lost = item.config.stash.get(_LOST, frozenset())
    if item.nodeid in lost:
        pytest.fail(
            f"{len(lost)} grouped test(s) lost their xdist group, this one too: xdist "
            "would run the group on several workers at once "
            "(spark_dilation.testing.xdist_groups; the pins are in conf/test-constraints.txt)",
            pytrace=False,
        )
