"""Typed errors shared by every layer.

Each error's ``str()`` is the sentence we show the user: what happened and
what to do about it. The CLI prints it as one line; API callers catch the type.
"""

from __future__ import annotations


class DilationError(Exception):
    """Base class of every error spark-dilation raises on purpose."""


# --- wormhole (mailbox, code, PAKE) ---------------------------------------


class WormholeError(DilationError):
    """Something went wrong while setting up or using the wormhole."""


class ServerConnectionError(WormholeError):
    """The mailbox server could not be reached (or is not a mailbox server)."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        super().__init__(
            f"could not connect to the mailbox server at {url}: {reason}. "
            "Check the --mailbox URL, or start a local one with `spark-dilation serve`."
        )


class WelcomeError(WormholeError):
    """The mailbox server refused to serve us (its welcome carried an error)."""

    def __init__(self, server_message: str) -> None:
        self.server_message = server_message
        super().__init__(f"the mailbox server refused the connection: {server_message}")


class ServerError(WormholeError):
    """The mailbox server rejected one of our requests."""

    def __init__(self, error: str, orig: dict | None = None, hint: str | None = None) -> None:
        self.error = error
        self.orig = orig or {}
        text = f"the mailbox server reported an error: {error}"
        if hint:
            text += f". {hint}"
        super().__init__(text)


class CrowdedError(ServerError):
    """A third client tried to use a nameplate or mailbox that two already hold."""

    def __init__(self, orig: dict | None = None) -> None:
        nameplate = (orig or {}).get("nameplate")
        where = f"code number {nameplate}" if nameplate else "this wormhole"
        super().__init__(
            "crowded",
            orig,
            hint=(
                f"Two other clients are already using {where}; a code works for exactly "
                "two parties. Ask the sender for a new code."
            ),
        )


class WrongCodeError(WormholeError):
    """Key confirmation failed: the two sides do not share the same code."""

    def __init__(self) -> None:
        super().__init__(
            "key confirmation failed: the code was mistyped on one side, or someone "
            "tried to interfere. Nothing was exchanged. Start again with a new code."
        )


# The reference library's name for the same condition.
WrongPasswordError = WrongCodeError


class LonelyError(WormholeError):
    """The wormhole was closed before the other side showed up."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or "the wormhole was closed before the other side connected")


class PeerTimeoutError(LonelyError):
    """Nobody used the code within the allowed time."""

    def __init__(self, code: str | None, timeout: float, option: str = "the timeout") -> None:
        self.code = code
        self.timeout = timeout
        self.option = option  # how the caller's API spells the timeout: "--timeout", ...
        shown = f"the code {code}" if code else "the code"
        super().__init__(
            f"nobody used {shown} within {timeout:g} seconds. Check that the other side "
            f"typed it and uses the same mailbox server, or raise {option}."
        )


class CodeFormatError(WormholeError, ValueError):
    """A code that cannot be a wormhole code (like '7-guitarist-revenge')."""


class OnlyOneCodeError(WormholeError):
    """allocate_code()/set_code() may be called only once per wormhole."""

    def __init__(self) -> None:
        super().__init__("this wormhole already has a code; create a new wormhole for another")


class NoKeyError(WormholeError):
    """derive_key() was called before the key was confirmed."""

    def __init__(self) -> None:
        super().__init__("no confirmed key yet: wait for get_verifier() before derive_key()")


class WormholeClosedError(WormholeError):
    """The wormhole closed before the requested result was available."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or "the wormhole is closed")


# --- application level ------------------------------------------------------


class TransferError(DilationError):
    """The peer and we disagree about the transfer itself."""


class PeerRejectedError(TransferError):
    """The peer sent an explicit error message and abandoned the transfer."""

    def __init__(self, peer_message: str) -> None:
        self.peer_message = peer_message
        super().__init__(f"the other side abandoned the transfer: {peer_message}")


class TransferCancelledError(TransferError):
    """The transfer was cancelled on this side (``handle.cancel()``)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or SIGTERM, which the CLI turns into this) stopped a transfer on this side.

    A ``KeyboardInterrupt``, so it ends a program as Ctrl-C does. ``cause``
    names the signal (``"Ctrl-C"``, ``"SIGTERM"``); ``outcome``, once the
    transfer has cleaned up, says whether the other side was told. ``str()``
    is the line the CLI prints.
    """

    def __init__(self, cause: str = "Ctrl-C", outcome: str = "") -> None:
        self.cause = cause
        self.outcome = outcome
        super().__init__(cause, outcome)

    def __str__(self) -> str:
        return f"cancelled ({self.cause})" + (f"; {self.outcome}" if self.outcome else "")


def interrupt_cause(error: BaseException) -> str:
    """What stopped us: the :class:`Interrupted` cause, else ``"Ctrl-C"`` (a plain one)."""
    return error.cause if isinstance(error, Interrupted) else "Ctrl-C"
