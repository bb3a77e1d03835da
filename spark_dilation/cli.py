"""The ``spark-dilation`` command: send | receive | serve | demo.

``send --text`` and ``receive`` speak the standard file-transfer v1 text
offer, so they work with the reference ``wormhole`` CLI in both directions.
Errors end the command with one readable line on stderr and exit code 1
(2 for usage errors).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from twisted.internet import defer, task, threads

from . import __version__
from .errors import DilationError, TransferError
from .transit import filetransfer, offers
from .transit.connector import TransitConnector
from .wormhole import DEFAULT_MAILBOX_URL, Wormhole
from .wormhole.wordlist import code_completions

log = logging.getLogger("spark_dilation.cli")

MAILBOX_ENV = "SPARK_DILATION_MAILBOX"
RELAY_ENV = "SPARK_DILATION_RELAY"
DEFAULT_RELAY_URL = "tcp:transit.magic-wormhole.io:4001"
EXIT_ERROR = 1
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spark-dilation",
        description="Move data peer to peer with a Magic Wormhole code.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--mailbox",
        metavar="URL",
        default=os.environ.get(MAILBOX_ENV, DEFAULT_MAILBOX_URL),
        help=f"mailbox server WebSocket URL (env {MAILBOX_ENV}; default %(default)s)",
    )
    parser.add_argument(
        "--appid", default=offers.APPID, help="application id (default: the wormhole CLI's)"
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="log more (-vv for debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    send = sub.add_parser("send", help="send a text, a file or a directory")
    what = send.add_mutually_exclusive_group(required=True)
    what.add_argument("--text", metavar="MESSAGE", help="the text to send")
    what.add_argument("path", nargs="?", help="a file or directory to send")
    send.add_argument(
        "--classic",
        action="store_true",
        help="use classic Transit (what `wormhole receive` speaks; the default for files)",
    )
    send.add_argument("--code", help="use this code instead of asking the server for one")
    send.add_argument(
        "--code-length", type=int, default=2, metavar="WORDS", help="words in a new code"
    )
    _add_timeout(send)
    _add_transit_options(send)

    receive = sub.add_parser("receive", help="receive a text, a file or a directory")
    receive.add_argument("code", nargs="?", help="the code (asked for if omitted)")
    receive.add_argument(
        "--accept-file", action="store_true", help="accept a file or directory without asking"
    )
    receive.add_argument(
        "-o", "--output-file", metavar="PATH", help="save the file or directory under this name"
    )
    _add_timeout(receive)
    _add_transit_options(receive)

    serve = sub.add_parser("serve", help="run a mailbox server and transit relay in the foreground")
    serve.add_argument("--interface", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--mailbox-port", type=int, default=4000)
    serve.add_argument("--relay-port", type=int, default=4001)
    serve.add_argument("--motd", help="message of the day shown to clients")
    serve.add_argument("--disallow-list", action="store_true", help="refuse to list nameplates")

    demo = sub.add_parser(
        "demo", help="start embedded servers and run a transfer into Spark end to end"
    )
    demo.add_argument("--no-spark", action="store_true", help="skip the Spark part")
    # Hidden: the test suite runs the demo with fewer rows.
    demo.add_argument("--rows", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def _add_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give up if the other side has not used the code by then (default: wait)",
    )


def _add_transit_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--relay",
        metavar="tcp:HOST:PORT",
        default=os.environ.get(RELAY_ENV, DEFAULT_RELAY_URL),
        help=f"transit relay for files (env {RELAY_ENV}; default %(default)s)",
    )
    p.add_argument(
        "--no-listen",
        action="store_true",
        help="offer no direct connection (reach the peer only through relays)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.verbose)
    if args.command == "serve":
        from .servers import run_foreground

        return run_foreground(
            interface=args.interface,
            mailbox_port=args.mailbox_port,
            relay_port=args.relay_port,
            motd=args.motd,
            allow_list=not args.disallow_list,
        )
    if args.command == "demo":
        from .demo import run

        try:
            rows = {} if args.rows is None else {"rows": args.rows}
            return run(sys.stdout, spark=not args.no_spark, **rows)
        except DilationError as e:
            print(f"spark-dilation: error: {e}", file=sys.stderr)
            return EXIT_ERROR
    command: Callable[..., Any] = {"send": send, "receive": receive}[args.command]
    return run_reactor(command, args)


def setup_logging(verbosity: int) -> None:
    """Standard logging to stderr, with Twisted's log bridged into it."""
    from twisted.logger import STDLibLogObserver, globalLogBeginner

    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbosity, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    globalLogBeginner.beginLoggingTo([STDLibLogObserver()], redirectStandardIO=False)
    if verbosity < 2:
        # autobahn/twisted chatter is debug-level detail for us.
        logging.getLogger("twisted").setLevel(logging.ERROR)


def run_reactor(command: Callable[..., Any], args: argparse.Namespace) -> int:
    """Run one Deferred-returning command on the reactor; map errors to exit codes."""
    outcome: dict[str, int] = {}

    @defer.inlineCallbacks
    def runner(reactor: Any) -> Any:
        try:
            yield command(reactor, args, sys.stdout, sys.stderr)
            outcome["code"] = 0
        except DilationError as e:
            print(f"spark-dilation: error: {e}", file=sys.stderr)
            outcome["code"] = EXIT_ERROR
        except ValueError as e:  # e.g. a malformed --mailbox URL
            print(f"spark-dilation: error: {e}", file=sys.stderr)
            outcome["code"] = EXIT_USAGE

    try:
        task.react(runner)
    except SystemExit as e:
        if e.code not in (0, None):
            return int(e.code) if isinstance(e.code, int) else EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    return outcome.get("code", EXIT_ERROR)


def _show_welcome(welcome: dict[str, Any], url: str, err: TextIO) -> None:
    if "motd" in welcome:
        print(f"Server (at {url}) says:\n {welcome['motd']}", file=err)


@defer.inlineCallbacks
def _open(reactor: Any, args: argparse.Namespace, err: TextIO) -> Any:
    w = Wormhole(args.appid, args.mailbox, reactor, timeout=args.timeout)
    try:
        _show_welcome((yield w.get_welcome()), args.mailbox, err)
    except DilationError:
        yield _close_quietly(w)
        raise
    return w


@defer.inlineCallbacks
def _close_quietly(w: Wormhole) -> Any:
    try:
        yield w.close()
    except DilationError:
        pass


@defer.inlineCallbacks
def _finish(w: Wormhole, work: Any) -> Any:
    """Wait for ``work``; close the wormhole either way; the first error wins."""
    try:
        result = yield work
    except BaseException:
        yield _close_quietly(w)
        raise
    yield w.close()
    return result


def _connector(reactor: Any, args: argparse.Namespace, is_sender: bool) -> TransitConnector:
    return TransitConnector(
        reactor, is_sender=is_sender, relay_url=args.relay or None, no_listen=args.no_listen
    )


@defer.inlineCallbacks
def send(reactor: Any, args: argparse.Namespace, out: TextIO, err: TextIO) -> Any:
    if args.path is not None and not os.path.exists(args.path):
        raise TransferError(f"cannot send {args.path!r}: no such file or directory")
    w = yield _open(reactor, args, err)

    @defer.inlineCallbacks
    def exchange() -> Any:
        if args.code:
            w.set_code(args.code)
        else:
            w.allocate_code(args.code_length)
        code = yield w.get_code()
        print(f"Wormhole code is: {code}", file=err)
        print(
            f"On the other computer, please run:\n\nspark-dilation receive {code}\n"
            f"   (or: wormhole receive {code})\n",
            file=err,
        )
        err.flush()
        if args.path is not None:
            digest = yield defer.ensureDeferred(
                filetransfer.send_path(
                    w,
                    Path(args.path),
                    _connector(reactor, args, True),
                    on_status=lambda s: print(s.capitalize() + "..", file=err),
                )
            )
            print(f"File sent and confirmed (sha256 {digest[:16]}...)", file=err)
            return
        yield w.get_verifier()
        w.send_message(offers.text_offer(args.text))
        while True:
            reply = offers.parse((yield w.get_message()))
            if isinstance(reply, offers.Answer):
                if not reply.text_acknowledged:
                    raise TransferError(f"the other side did not accept the text: {reply.fields}")
                print("text message sent", file=err)
                return
            log.info("ignoring %r while waiting for the answer", reply)

    yield _finish(w, exchange())


@defer.inlineCallbacks
def receive(reactor: Any, args: argparse.Namespace, out: TextIO, err: TextIO) -> Any:
    w = yield _open(reactor, args, err)

    def accept(offer: filetransfer.Offer) -> bool:
        what = f"{offer.kind} {offer.name!r} ({offer.size} bytes"
        what += f", {offer.numfiles} files)" if offer.kind == "directory" else ")"
        print(f"Receiving {what}", file=err)
        if args.accept_file:
            return True
        if not sys.stdin.isatty():
            raise TransferError("pass --accept-file to accept a file without a prompt")
        return input("ok? (Y/n): ").strip().lower() in ("", "y", "yes")

    @defer.inlineCallbacks
    def exchange() -> Any:
        code = args.code
        if not code:
            code = yield threads.deferToThread(_ask_for_code, reactor, w, err)
        w.set_code(code)
        # -o NAME renames; -o EXISTING_DIR saves inside it under the offered name.
        output = Path(args.output_file) if args.output_file else None
        if output is not None and output.is_dir():
            dest_dir, name = output, None
        else:
            dest_dir = output.parent if output else Path.cwd()
            name = output.name if output else None
        result = yield defer.ensureDeferred(
            filetransfer.receive(
                w,
                dest_dir,
                _connector(reactor, args, False),
                accept=accept,
                output_name=name,
                on_status=lambda s: print(s.capitalize() + "..", file=err),
            )
        )
        if isinstance(result, filetransfer.ReceivedText):
            out.write(result.message + "\n")
            out.flush()
        else:
            print(f"Received {result.kind} written to: {result.path}", file=err)

    yield _finish(w, exchange())


def _ask_for_code(reactor: Any, w: Wormhole, err: TextIO) -> str:
    """Prompt for a code (runs in a thread); Tab completes from the wordlist."""
    if not sys.stdin.isatty():
        line = sys.stdin.readline().strip()
        if not line:
            raise DilationError("no code given: pass it as an argument or on stdin")
        return line
    try:
        import readline
    except ImportError:  # pragma: no cover - platform without readline
        return input("Enter receive wormhole code: ").strip()

    nameplates: list[str] = []

    def completer(text: str, state: int) -> str | None:
        if state == 0 and "-" not in text:
            try:
                found = threads.blockingCallFromThread(reactor, w.list_nameplates)
                nameplates[:] = found
            except Exception:  # completion must never break the prompt
                pass
        matches = code_completions(text, nameplates)
        return matches[state] if state < len(matches) else None

    readline.set_completer_delims(" \t\n")
    readline.set_completer(completer)
    readline.parse_and_bind("tab: complete")
    print(" (Tab completes the words)", file=err)
    return input("Enter receive wormhole code: ").strip()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
