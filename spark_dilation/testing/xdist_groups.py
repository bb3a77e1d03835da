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
"""

from __future__ import annotations

import pytest


def _loadgroup(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "loadgroup", False))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not _loadgroup(config):
        return
    for item in items:
        mark = item.get_closest_marker("xdist_group")
        if mark is None or "@" in item.nodeid.rsplit("::", 1)[-1]:
            continue
        item._id = type(item._id).parse(f"{item.nodeid}@{mark.args[0]}")  # type: ignore[attr-defined]


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
