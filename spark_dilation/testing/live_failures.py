"""A pytest plugin that prints each failure the moment it happens.

pytest's own report comes at the end of the run, which a cut-short run (a CI
limit, a hung test killed by its timeout) never reaches. This prints one line
per failed or erroring test as soon as its report arrives, in the controller
under pytest-xdist too. Enable with ``-p spark_dilation.testing.live_failures``.
"""

from __future__ import annotations

import pytest

_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config


def _message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    lines = text.strip().splitlines()
    return (lines[0] if crash is not None else lines[-1]) if lines else ""


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed or _config is None or hasattr(_config, "workerinput"):
        return
    reporter = _config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    what = "FAILED" if report.when == "call" else f"ERROR at {report.when} of"
    reporter.write("\n")  # the progress line may be mid-way
    reporter.write_line(
        f"{what} {report.nodeid} ({report.duration:.1f} s) - {_message(report)}",
        red=True,
        bold=True,
    )
