"""Every error of a dataset transfer, and the one way they cross between processes.

A helper process (a sender host, a lane host, the registry host) reports an
error as a small JSON record (:func:`error_record`); the process that reads it
raises the same class with the same message (:func:`rebuild_error`). Keeping
the classes in one module keeps that lookup to one place.
"""

from __future__ import annotations

import contextlib

from ...errors import TransferError
from .options import TransferOptions


class ProtocolError(TransferError):
    """The peer sent something this protocol does not allow."""


class SchemaMismatchError(TransferError):
    """Data arrived whose schema is not the one agreed in the session."""


class LaneNotStartedError(TransferError, TimeoutError):
    def __init__(
        self,
        lane: int,
        lanes: int,
        timeout: float,
        what: str = "a partition",
        options: TransferOptions | None = None,
    ) -> None:
        text = f"lane {lane} of {lanes} did not start within {timeout:g} s (waited to send {what})"
        raise_it = options.spelled("lane_start_timeout") if options else "lane_start_timeout"
        if options is None or options.surface == "spark":
            text += (
                ". The reader runs its lanes when an action (count(), show(), write) runs, "
                "and all lanes must run at once: set option lanes to at most the reader's "
                f"task slots, start the reader's action sooner, or raise {raise_it}"
            )
        else:  # the Python API and the CLI run every lane at once: no Spark advice
            text += f". Check that the receiver is still running, or raise {raise_it}"
        super().__init__(text)


class LaneLostError(TransferError):
    """The lane went away before it confirmed the partition; a retry sends it again."""


class LaneRefusedError(TransferError):
    """The lane refused the partition (schema mismatch, aborted transfer, ...)."""


class ReceiverFailedError(LaneRefusedError):
    """The receiver could not keep the data (its disk, its output): its own words.

    Not transient: sending the partition again would fail the same way.
    """


class InjectedFailure(TransferError):
    """A test-only failure requested with option ``test_fail``."""


class TransferAbortedError(TransferError):
    """The other side ended the whole transfer (its ``A`` message); ``str()`` says who and why."""


class CannotHealError(TransferError):
    """Partitions were confirmed to a lane incarnation whose data is gone."""


class LaneIdleError(TransferError, TimeoutError):
    pass


class StagingError(TransferError):
    """The lane could not write what it received to its staging folder (disk full, ...)."""


class LinkError(TransferError):
    """The other process closed, went silent or sent a frame that does not open."""


class OutputError(TransferError):
    """The receiver could not write the data where it was asked (disk full, no permission)."""


class SessionTimeout(TransferError, TimeoutError):
    pass


def error_record(e: BaseException) -> dict[str, str]:
    """How the host reports an error: enough to raise the same class with the same message."""
    return {"type": type(e).__qualname__, "module": type(e).__module__, "message": str(e)}


def rebuild_error(record: dict[str, str]) -> BaseException:
    """The host's error (:func:`error_record`) as the same class with the same message.

    Only our own exception classes are rebuilt; anything else (a bug in the
    host) becomes a :class:`TransferError` that names it.
    """
    name, module, message = record["type"], record.get("module", ""), record["message"]
    cls: type | None = None
    if module.startswith("spark_dilation.") and "." not in name:
        import importlib

        with contextlib.suppress(ImportError):
            found = getattr(importlib.import_module(module), name, None)
            if isinstance(found, type) and issubclass(found, Exception):
                cls = found
    if cls is None:
        return TransferError(f"{message} ({name} in a spark-dilation helper process)")
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    return error
