"""Embedded Magic Wormhole mailbox server and transit relay.

These are the real servers (``magic-wormhole-mailbox-server`` and
``magic-wormhole-transit-relay``, from the ``[server]`` extra), wired up on
one reactor without twistd so that ``spark-dilation serve``, the demo and
:mod:`spark_dilation.testing` can run them on ephemeral ports.

Run ``python -m spark_dilation.servers --help`` for the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from twisted.internet import defer, endpoints, task
from twisted.internet.defer import Deferred
from twisted.internet.error import CannotListenError
from twisted.internet.protocol import Factory, ServerFactory
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.python.failure import Failure

from spark_dilation.errors import DilationError

__all__ = [
    "SERVER_EXTRA_MESSAGE",
    "EmbeddedServers",
    "ListenError",
    "ServerExtraMissing",
    "main",
    "run_foreground",
    "start_servers",
]

log = logging.getLogger(__name__)

SERVER_EXTRA_MESSAGE = (
    "the mailbox server and transit relay need the server extra: "
    "pip install 'spark-dilation[server]'"
)


class ServerExtraMissing(DilationError, RuntimeError):
    """The ``[server]`` extra is not installed (a RuntimeError, as before it had a class)."""

    def __init__(self) -> None:
        super().__init__(SERVER_EXTRA_MESSAGE)


# Same values as the mailbox server's twistd plugin (server_tap.py): without
# pruning, abandoned nameplates and mailboxes would pile up forever.
CHANNEL_EXPIRATION_TIME = 11 * 60.0
EXPIRATION_CHECK_PERIOD = 5 * 60.0

# How long stop() lets live connections close politely before aborting them.
STOP_GRACE_SECONDS = 2.0

_WILDCARD_INTERFACES = {"", "0.0.0.0", "::"}

_PENDING = object()


def _fire(d: Deferred[None], result: object) -> Deferred[None]:
    if isinstance(result, Failure):
        d.errback(result)
    else:
        d.callback(None)
    return d


class ListenError(DilationError):
    """One of the servers could not listen on its port (busy, or not permitted)."""

    def __init__(self, what: str, interface: str, port: int, reason: str) -> None:
        self.what = what
        self.interface = interface
        self.port = port
        self.reason = reason
        super().__init__(
            f"the {what} cannot listen on {_format_host(interface)}:{port}: {reason}. "
            "Choose another port, or stop whatever is using it."
        )


def _load_server_modules() -> SimpleNamespace:
    try:
        from wormhole_mailbox_server.database import create_or_upgrade_channel_db
        from wormhole_mailbox_server.server import make_server
        from wormhole_mailbox_server.web import make_web_server
        from wormhole_transit_relay import transit_server
        from wormhole_transit_relay.usage import create_usage_tracker
    except ImportError as e:
        raise ServerExtraMissing() from e
    return SimpleNamespace(
        create_or_upgrade_channel_db=create_or_upgrade_channel_db,
        make_server=make_server,
        make_web_server=make_web_server,
        transit_server=transit_server,
        create_usage_tracker=create_usage_tracker,
    )


def _format_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _dial_host(interface: str) -> str:
    """A host a local client can dial to reach a server bound to ``interface``."""
    if interface in _WILDCARD_INTERFACES:
        return "127.0.0.1"
    return _format_host(interface)


class _ConnectionTracker(WrappingFactory):
    """Remembers live connections so stop() can close them.

    A wrapper (rather than hooking the protocols) is needed because the
    WebSocket resource swaps the HTTP protocol for a WebSocket one mid-stream;
    autobahn knows to re-point a ProtocolWrapper.
    """

    protocol = ProtocolWrapper

    def __init__(self, wrapped: Factory) -> None:
        super().__init__(wrapped)
        self._idle_waiters: list[Deferred[None]] = []

    def unregisterProtocol(self, p: ProtocolWrapper) -> None:
        super().unregisterProtocol(p)
        if not self.protocols:
            waiters, self._idle_waiters = self._idle_waiters, []
            for d in waiters:
                d.callback(None)

    def close_all(self, clock: Any, grace: float) -> Deferred[None]:
        """Close every live connection; abort the ones still open after ``grace``."""
        if not self.protocols:
            return defer.succeed(None)
        idle: Deferred[None] = Deferred()
        self._idle_waiters.append(idle)
        for p in list(self.protocols):
            p.transport.loseConnection()

        def abort_leftovers() -> None:
            for p in list(self.protocols):
                p.transport.abortConnection()

        timer = clock.callLater(grace, abort_leftovers)

        def cancel_timer(result: object) -> object:
            if timer.active():
                timer.cancel()
            return result

        idle.addBoth(cancel_timer)
        return idle


@dataclass
class EmbeddedServers:
    """A running mailbox server and transit relay; see :func:`start_servers`."""

    mailbox_url: str
    relay_url: str
    mailbox_port: int
    relay_port: int
    interface: str
    _reactor: Any = field(repr=False, compare=False)
    _mailbox_server: Any = field(repr=False, compare=False)
    _listeners: list[Any] = field(repr=False, compare=False)
    _trackers: list[_ConnectionTracker] = field(repr=False, compare=False)
    _pruner: task.LoopingCall | None = field(repr=False, compare=False)
    _stop_waiters: list[Deferred[None]] = field(default_factory=list, repr=False, compare=False)
    _stop_outcome: object = field(default=_PENDING, repr=False, compare=False)

    def stop(self) -> Deferred[None]:
        """Stop listening, stop the mailbox service and close live connections.

        Safe to call more than once; every call's Deferred fires when shutdown
        has finished.
        """
        if self._stop_outcome is not _PENDING:
            return _fire(Deferred(), self._stop_outcome)
        waiter: Deferred[None] = Deferred()
        self._stop_waiters.append(waiter)
        if len(self._stop_waiters) == 1:
            defer.ensureDeferred(self._stop()).addBoth(self._stopped)
        return waiter

    def _stopped(self, result: object) -> None:
        self._stop_outcome = result
        waiters, self._stop_waiters = self._stop_waiters, []
        for waiter in waiters:
            _fire(waiter, result)

    async def _stop(self) -> None:
        if self._pruner is not None and self._pruner.running:
            self._pruner.stop()
        await defer.gatherResults(
            [defer.maybeDeferred(listener.stopListening) for listener in self._listeners],
            consumeErrors=True,
        )
        await defer.maybeDeferred(self._mailbox_server.stopService)
        await defer.gatherResults(
            [t.close_all(self._reactor, STOP_GRACE_SECONDS) for t in self._trackers],
            consumeErrors=True,
        )
        log.info("mailbox server and transit relay stopped")


def _server_endpoint(reactor: Any, port: int, interface: str) -> Any:
    if ":" in interface:
        return endpoints.TCP6ServerEndpoint(reactor, port, interface=interface)
    return endpoints.TCP4ServerEndpoint(reactor, port, interface=interface or "0.0.0.0")


async def _listen(reactor: Any, what: str, port: int, interface: str, factory: Any) -> Any:
    try:
        return await _server_endpoint(reactor, port, interface).listen(factory)
    except CannotListenError as e:
        err = e.socketError
        reason = getattr(err, "strerror", None) or str(err)
        raise ListenError(what, interface, port, reason.lower()) from e


def start_servers(
    reactor: Any,
    *,
    interface: str = "127.0.0.1",
    mailbox_port: int = 0,
    relay_port: int = 0,
    motd: str | None = None,
    signal_error: str | None = None,
    allow_list: bool = True,
    channel_db: str = ":memory:",
) -> Deferred[EmbeddedServers]:
    """Start a mailbox server and a transit relay on ``reactor``.

    Port 0 picks a free ephemeral port; the result carries the bound ports.
    Fails with :class:`ListenError` when a port cannot be bound (nothing is
    left listening then), and raises ``RuntimeError`` at once when the
    ``[server]`` extra is not installed.
    """
    mods = _load_server_modules()
    return defer.ensureDeferred(
        _start_servers(
            reactor,
            mods,
            interface=interface,
            mailbox_port=mailbox_port,
            relay_port=relay_port,
            motd=motd,
            signal_error=signal_error,
            allow_list=allow_list,
            channel_db=channel_db,
        )
    )


async def _start_servers(
    reactor: Any,
    mods: SimpleNamespace,
    *,
    interface: str,
    mailbox_port: int,
    relay_port: int,
    motd: str | None,
    signal_error: str | None,
    allow_list: bool,
    channel_db: str,
) -> EmbeddedServers:
    mailbox_server = mods.make_server(
        mods.create_or_upgrade_channel_db(channel_db),
        allow_list=allow_list,
        signal_error=signal_error,
        welcome_motd=motd,
    )
    site = mods.make_web_server(mailbox_server, log_requests=False)
    mailbox_tracker = _ConnectionTracker(site)

    relay_factory = ServerFactory()
    relay_factory.protocol = mods.transit_server.TransitConnection
    relay_factory.log_requests = False
    relay_factory.transit = mods.transit_server.Transit(
        mods.create_usage_tracker(blur_usage=None, log_file=None, usage_db=None),
        reactor.seconds,
    )
    relay_tracker = _ConnectionTracker(relay_factory)

    mailbox_server.startService()
    listeners: list[Any] = []
    try:
        listeners.append(
            await _listen(reactor, "mailbox server", mailbox_port, interface, mailbox_tracker)
        )
        listeners.append(
            await _listen(reactor, "transit relay", relay_port, interface, relay_tracker)
        )
    except BaseException:
        for listener in listeners:
            await defer.maybeDeferred(listener.stopListening)
        await defer.maybeDeferred(mailbox_server.stopService)
        raise

    rebooted = time.time()

    def prune() -> None:
        now = time.time()
        try:
            mailbox_server.prune_all_apps(now, now - CHANNEL_EXPIRATION_TIME)
            mailbox_server.dump_stats(now, rebooted=rebooted)
        except Exception:
            # One bad prune must not kill the loop (mailbox server issue #13).
            log.exception("error while pruning old mailbox channels")

    pruner = task.LoopingCall(prune)
    pruner.clock = reactor
    pruner.start(EXPIRATION_CHECK_PERIOD, now=False)

    host = _dial_host(interface)
    mailbox_bound = listeners[0].getHost().port
    relay_bound = listeners[1].getHost().port
    servers = EmbeddedServers(
        mailbox_url=f"ws://{host}:{mailbox_bound}/v1",
        relay_url=f"tcp:{host}:{relay_bound}",
        mailbox_port=mailbox_bound,
        relay_port=relay_bound,
        interface=interface,
        _reactor=reactor,
        _mailbox_server=mailbox_server,
        _listeners=listeners,
        _trackers=[mailbox_tracker, relay_tracker],
        _pruner=pruner,
    )
    log.info(
        "mailbox server on %s, transit relay on %s (interface %s)",
        servers.mailbox_url,
        servers.relay_url,
        interface,
    )
    return servers


def run_foreground(
    *,
    interface: str = "127.0.0.1",
    mailbox_port: int = 4000,
    relay_port: int = 4001,
    motd: str | None = None,
    signal_error: str | None = None,
    allow_list: bool = True,
    ready_json: bool = False,
    channel_db: str = ":memory:",
) -> int:
    """Run both servers on the global reactor until SIGINT/SIGTERM.

    Prints the two URLs to stderr once both listen and, with ``ready_json``,
    one JSON line to stdout. Returns the process exit code: 0 after a clean
    stop, 1 without the ``[server]`` extra, 2 when a port cannot be bound.
    The reactor cannot be restarted, so call this at most once per process.
    """
    try:
        _load_server_modules()
    except ServerExtraMissing as e:
        print(f"spark-dilation serve: {e}", file=sys.stderr, flush=True)
        return 1

    from twisted.internet import reactor
    from twisted.logger import STDLibLogObserver, globalLogPublisher

    observer = STDLibLogObserver(name="twisted")
    globalLogPublisher.addObserver(observer)
    state: dict[str, Any] = {"exit_code": 0, "servers": None}

    def on_ready(servers: EmbeddedServers) -> None:
        state["servers"] = servers
        where = "" if interface not in _WILDCARD_INTERFACES else f" (listening on {interface})"
        print(f"mailbox server: {servers.mailbox_url}{where}", file=sys.stderr)
        print(f"transit relay: {servers.relay_url}{where}", file=sys.stderr, flush=True)
        if ready_json:
            line = json.dumps(
                {
                    "mailbox_url": servers.mailbox_url,
                    "relay_url": servers.relay_url,
                    "mailbox_port": servers.mailbox_port,
                    "relay_port": servers.relay_port,
                }
            )
            print(line, file=sys.stdout, flush=True)

    def on_failure(failure: Any) -> None:
        state["exit_code"] = 2 if failure.check(ListenError) else 1
        if failure.check(ListenError):
            print(f"spark-dilation: {failure.value}", file=sys.stderr, flush=True)
        else:
            log.error(
                "could not start the servers",
                exc_info=(failure.type, failure.value, failure.getTracebackObject()),
            )
        if reactor.running:
            reactor.stop()

    def start() -> None:
        d = start_servers(
            reactor,
            interface=interface,
            mailbox_port=mailbox_port,
            relay_port=relay_port,
            motd=motd,
            signal_error=signal_error,
            allow_list=allow_list,
            channel_db=channel_db,
        )
        d.addCallbacks(on_ready, on_failure)

    def before_shutdown() -> Deferred[None] | None:
        servers: EmbeddedServers | None = state["servers"]
        return servers.stop() if servers is not None else None

    reactor.callWhenRunning(start)
    reactor.addSystemEventTrigger("before", "shutdown", before_shutdown)
    try:
        # reactor.run() installs SIGINT/SIGTERM handlers that stop it cleanly.
        reactor.run()
    finally:
        globalLogPublisher.removeObserver(observer)
    return int(state["exit_code"])


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m spark_dilation.servers",
        description="Run a Magic Wormhole mailbox server and transit relay.",
    )
    parser.add_argument("--interface", default="127.0.0.1", help="address to listen on")
    parser.add_argument(
        "--mailbox-port", type=int, default=4000, help="mailbox server port (0: any free port)"
    )
    parser.add_argument(
        "--relay-port", type=int, default=4001, help="transit relay port (0: any free port)"
    )
    parser.add_argument("--motd", default=None, help="message of the day sent in the welcome")
    parser.add_argument(
        "--signal-error", default=None, help="make every client fail with this message"
    )
    parser.add_argument(
        "--disallow-list",
        action="store_true",
        help="refuse to list allocated nameplates",
    )
    parser.add_argument(
        "--channel-db",
        default=":memory:",
        metavar="PATH",
        help="mailbox database file (default: in memory); a restarted server that "
        "reuses it keeps its mailboxes",
    )
    parser.add_argument(
        "--ready-json",
        action="store_true",
        help="print one JSON line with the URLs and ports on stdout once listening",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    args = _build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s"
    )
    return run_foreground(
        interface=args.interface,
        mailbox_port=args.mailbox_port,
        relay_port=args.relay_port,
        motd=args.motd,
        signal_error=args.signal_error,
        allow_list=not args.disallow_list,
        ready_json=args.ready_json,
        channel_db=args.channel_db,
    )


if __name__ == "__main__":
    sys.exit(main())
