"""The ``spark-dilation`` command: send | receive | serve | demo.

``send PATH...`` sends Parquet, CSV, JSON-lines or Arrow IPC files (or
folders of them) as a dataset that ``receive`` or a Spark reader
(``spark.read.format("dilation")``) loads in parallel. ``send --classic``
and ``send --text`` speak the standard file-transfer v1 offers, so they work
with the reference ``wormhole`` CLI in both directions; ``receive`` takes a
dataset, a file, a directory or a text from the same code. Errors end the
command with one readable line on stderr and exit code 1 (2 for usage
errors).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import crochet
from twisted.internet import defer, threads

from . import __version__
from .cli_progress import Reporter, pick_mode
from .errors import DilationError, TransferError
from .transfer.options import TransferOptionError
from .transit import filetransfer, offers
from .transit.connector import TransitConnector
from .wormhole import DEFAULT_MAILBOX_URL, Wormhole
from .wormhole.blocking import ensure_reactor
from .wormhole.wordlist import code_completions

log = logging.getLogger("spark_dilation.cli")

MAILBOX_ENV = "SPARK_DILATION_MAILBOX"
RELAY_ENV = "SPARK_DILATION_RELAY"
DEFAULT_RELAY_URL = "tcp:transit.magic-wormhole.io:4001"
EXIT_ERROR = 1
EXIT_USAGE = 2
WAIT_FOREVER = 7 * 24 * 3600.0  # "no --timeout" for the dataset API's deadlines


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

    send = sub.add_parser(
        "send",
        help="send a dataset (Parquet/CSV/JSON-lines/Arrow files or folders), a file or a text",
    )
    send.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="files or folders of one format (.parquet, .csv, .json/.jsonl, .arrow/.feather)",
    )
    send.add_argument("--text", metavar="MESSAGE", help="send this text instead")
    send.add_argument(
        "--classic",
        action="store_true",
        help="send one file or directory as is, over classic Transit (what `wormhole "
        "receive` takes)",
    )
    send.add_argument("--code", help="use this code instead of asking the server for one")
    send.add_argument(
        "--code-length", type=int, default=2, metavar="WORDS", help="words in a new code"
    )
    send.add_argument(
        "--compression",
        default="none",
        metavar="none|lz4|zstd",
        help="datasets: Arrow IPC body compression (pays on slow links; default %(default)s)",
    )
    _add_timeout(send)
    _add_transit_options(send)
    _add_progress_options(send)

    receive = sub.add_parser("receive", help="receive a dataset, a file, a directory or a text")
    receive.add_argument("code", nargs="?", help="the code (asked for if omitted)")
    receive.add_argument(
        "--accept-file", action="store_true", help="accept a file or directory without asking"
    )
    receive.add_argument(
        "-o",
        "--output-file",
        metavar="PATH",
        help="datasets: the folder to write (default dataset-NAMEPLATE); files: save under "
        "this name, or inside this existing directory",
    )
    receive.add_argument(
        "--format",
        default="parquet",
        metavar="parquet|arrow|csv",
        help="datasets: the files to write (default %(default)s; csv for flat schemas)",
    )
    receive.add_argument(
        "--lanes", type=int, default=2, metavar="N", help="datasets: parallel lanes (default 2)"
    )
    _add_timeout(receive)
    _add_transit_options(receive)
    _add_progress_options(receive)

    serve = sub.add_parser("serve", help="run a mailbox server and transit relay in the foreground")
    serve.add_argument("--interface", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--mailbox-port", type=int, default=4000)
    serve.add_argument("--relay-port", type=int, default=4001)
    serve.add_argument("--motd", help="message of the day shown to clients")
    serve.add_argument("--disallow-list", action="store_true", help="refuse to list nameplates")

    demo = sub.add_parser(
        "demo", help="start embedded servers and run transfers, Spark to Spark, end to end"
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
        help=f"transit relay (env {RELAY_ENV}; default %(default)s)",
    )
    p.add_argument(
        "--no-listen",
        action="store_true",
        help="offer no direct connection (reach the peer only through relays)",
    )


def _add_progress_options(p: argparse.ArgumentParser) -> None:
    shown = p.add_mutually_exclusive_group()
    shown.add_argument(
        "-q", "--quiet", action="store_true", help="no progress: only the code, result and errors"
    )
    shown.add_argument(
        "--json",
        action="store_true",
        help="one JSON status object per line on stdout, for scripts",
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
    if args.command == "send":
        if bool(args.paths) == (args.text is not None):
            return _usage_error("send", "give the PATH(s) to send, or --text MESSAGE")
        if args.classic and len(args.paths) != 1:
            return _usage_error("send", "--classic sends exactly one file or directory")
    reporter = Reporter(pick_mode(args.quiet, args.json, sys.stderr))
    command = {"send": send, "receive": receive}[args.command]
    return run_command(command, args, reporter)


def _usage_error(command: str, message: str) -> int:
    """One line, like argparse's own errors, and exit code 2."""
    print(f"spark-dilation {command}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def setup_logging(verbosity: int) -> None:
    """Standard logging to stderr, with Twisted's log bridged into it."""
    from twisted.logger import STDLibLogObserver, globalLogBeginner

    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbosity, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    globalLogBeginner.beginLoggingTo([STDLibLogObserver()], redirectStandardIO=False)
    if verbosity < 2:
        # autobahn/twisted chatter is debug-level detail for us.
        logging.getLogger("twisted").setLevel(logging.ERROR)


def run_command(
    command: Callable[[argparse.Namespace, Reporter], None],
    args: argparse.Namespace,
    reporter: Reporter,
) -> int:
    """Run a blocking command (the reactor runs in a crochet thread); errors to exit codes."""
    ensure_reactor()
    try:
        command(args, reporter)
        return 0
    except DilationError as e:
        _fail(reporter, str(e))
        return EXIT_USAGE if isinstance(e, TransferOptionError) else EXIT_ERROR
    except ValueError as e:  # e.g. a malformed --mailbox URL
        _fail(reporter, str(e))
        return EXIT_USAGE
    except KeyboardInterrupt:
        reporter.close()
        return 130


def _fail(reporter: Reporter, message: str) -> None:
    reporter.close()
    reporter.emit("error", message=message)
    print(f"spark-dilation: error: {message}", file=sys.stderr)


def _on_reactor(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(reactor, *args)`` (returns a Deferred) on the reactor; block for the result."""
    from twisted.internet import reactor

    result = crochet.run_in_reactor(fn)(reactor, *args)
    try:
        return result.wait(timeout=10 * 365 * 86400)
    except KeyboardInterrupt:
        result.cancel()
        raise


def _show_welcome(welcome: dict[str, Any], url: str, err: TextIO) -> None:
    if "motd" in welcome:
        print(f"Server (at {url}) says:\n {welcome['motd']}", file=err)


@defer.inlineCallbacks
def _open(
    reactor: Any,
    args: argparse.Namespace,
    err: TextIO,
    app_versions: dict[str, Any] | None = None,
) -> Any:
    w = Wormhole(args.appid, args.mailbox, reactor, timeout=args.timeout, app_versions=app_versions)
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


def _transfer_options(args: argparse.Namespace, **extra: Any) -> Any:
    from .transfer.options import TransferOptions

    return TransferOptions(
        mailbox=args.mailbox,
        relay=args.relay or None,
        no_listen=args.no_listen,
        peer_timeout=args.timeout if args.timeout else WAIT_FOREVER,
        lane_start_timeout=WAIT_FOREVER,
        **extra,
    )


def _code_banner(code: str, err: TextIO, how: str) -> None:
    print(f"Wormhole code is: {code}", file=err)
    print(f"On the other computer, please run:\n\n{how}\n", file=err)
    err.flush()


# --- send -----------------------------------------------------------------------------


def send(args: argparse.Namespace, reporter: Reporter) -> None:
    if args.paths and not args.classic:
        send_dataset_command(args, reporter)
    else:
        _on_reactor(send_classic, args, sys.stdout, sys.stderr, reporter)


def send_dataset_command(args: argparse.Namespace, reporter: Reporter) -> None:
    """Send files or folders as a dataset (blocking)."""
    from .transfer.api import DatasetSender

    options = _transfer_options(args, compression=args.compression)
    try:
        sender = DatasetSender(
            args.paths, code=args.code, options=options, code_length=args.code_length
        )
    except TransferError as e:
        if str(e).startswith("cannot tell the format"):
            raise TransferError(f"{e}; or send it as a plain file with --classic") from None
        raise
    code = sender.code
    _code_banner(
        code,
        sys.stderr,
        f"spark-dilation receive {code}\n"
        f'   (or in Spark: spark.read.format("dilation").option("code", "{code}").load())',
    )
    reporter.emit("code", code=code)
    reporter.say("waiting for the receiver..")
    report = sender.wait(reporter.progress)
    reporter.close()
    reporter.emit("done", **_report_fields(report))
    if reporter.mode != "json":
        print(f"Dataset sent: {report.summary()}", file=sys.stderr)


def _report_fields(report: Any) -> dict[str, Any]:
    return json.loads(report.to_json())


@defer.inlineCallbacks
def send_classic(
    reactor: Any, args: argparse.Namespace, out: TextIO, err: TextIO, reporter: Reporter
) -> Any:
    path = args.paths[0] if args.paths else None
    if path is not None and not os.path.exists(path):
        raise TransferError(f"cannot send {path!r}: no such file or directory")
    w = yield _open(reactor, args, err)

    @defer.inlineCallbacks
    def exchange() -> Any:
        if args.code:
            w.set_code(args.code)
        else:
            w.allocate_code(args.code_length)
        code = yield w.get_code()
        _code_banner(code, err, f"spark-dilation receive {code}\n   (or: wormhole receive {code})")
        reporter.emit("code", code=code)
        if path is not None:
            size = Path(path).stat().st_size if Path(path).is_file() else 0
            meter = reporter.file_meter("send", size)
            digest = yield defer.ensureDeferred(
                filetransfer.send_path(
                    w,
                    Path(path),
                    _connector(reactor, args, True),
                    on_status=meter.status,
                    progress=meter if size else None,
                )
            )
            reporter.close()
            reporter.emit("done", kind="file", path=path, sha256=digest)
            print(f"File sent and confirmed (sha256 {digest[:16]}...)", file=err)
            return
        yield w.get_verifier()
        w.send_message(offers.text_offer(args.text))
        while True:
            reply = offers.parse((yield w.get_message()))
            if isinstance(reply, offers.Answer):
                if not reply.text_acknowledged:
                    raise TransferError(f"the other side did not accept the text: {reply.fields}")
                reporter.emit("done", kind="text")
                print("text message sent", file=err)
                return
            log.info("ignoring %r while waiting for the answer", reply)

    yield _finish(w, exchange())


# --- receive --------------------------------------------------------------------------


def receive(args: argparse.Namespace, reporter: Reporter) -> None:
    from .transfer.api import RECEIVE_FORMATS

    if args.format not in RECEIVE_FORMATS:
        raise ValueError(f"--format {args.format}: choose {', '.join(RECEIVE_FORMATS)}")
    if args.lanes < 1:
        raise ValueError(f"--lanes {args.lanes}: must be at least 1")
    agreed = _on_reactor(receive_session_or_classic, args, sys.stdout, sys.stderr, reporter)
    if agreed is None:
        return  # a text or a file: done
    spec, dest = agreed
    from .transfer.api import receive_agreed

    reporter.say(f"Receiving a dataset ({len(spec.schema)} columns) into {dest}/")
    got = receive_agreed(spec, dest, format=args.format, on_progress=reporter.progress)
    reporter.close()
    reporter.emit("done", **_report_fields(got.report), files=[str(f) for f in got.files])
    if reporter.mode != "json":
        print(f"Dataset received: {got.report.summary()}", file=sys.stderr)
        print(
            f"Written to: {dest}/ ({len(got.files)} {args.format} file(s))",
            file=sys.stderr,
        )


def _dataset_dest(args: argparse.Namespace, code: str) -> Path:
    return Path(args.output_file or f"dataset-{code.split('-', 1)[0]}")


def _dest_refusal(dest: Path) -> str | None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        return f"refusing to write the dataset into {str(dest)!r}: it exists and is not empty"
    return None


def _check_dest_before_code(args: argparse.Namespace, code: str) -> None:
    """Refuse an unusable dataset folder before the code is claimed, so it stays usable.

    Only for ``-o`` naming no existing file (without it a text needs no
    folder; the offer's check still refuses a non-empty default folder or an
    existing file, and tells the sender). With ``--accept-file`` a
    non-empty ``-o`` folder may be meant for a file (saved inside it): that
    refusal then waits for the offer, as before.
    """
    from .transfer.api import dest_problem

    if not args.output_file:
        return
    dest = _dataset_dest(args, code)
    if dest.exists() and not dest.is_dir():
        return  # an existing file: both offers refuse it (never overwritten), telling the sender
    problem = dest_problem(dest, must_be_empty=not args.accept_file)
    if problem is not None:
        full = dest.is_dir() and any(dest.iterdir())
        hint = " (add --accept-file to save a file inside it)" if full else ""
        raise TransferOptionError(
            f"{problem}{hint}; the code was not used, so run receive again with another -o"
        )


@defer.inlineCallbacks
def receive_session_or_classic(
    reactor: Any, args: argparse.Namespace, out: TextIO, err: TextIO, reporter: Reporter
) -> Any:
    """Open the code: agree on a dataset (returns (spec, dest)), or take a text or file (None)."""
    from .transfer.api import format_refusal
    from .transfer.protocol import PROTOCOL, SESSION_APP_VERSIONS
    from .transfer.session import accept_offer

    w = yield _open(reactor, args, err, app_versions=SESSION_APP_VERSIONS)

    def accept(offer: filetransfer.Offer) -> bool:
        what = f"{offer.kind} {offer.name!r} ({offer.size} bytes"
        what += f", {offer.numfiles} files)" if offer.kind == "directory" else ")"
        print(f"Receiving {what}", file=err)
        if args.accept_file:
            return True
        if not sys.stdin.isatty():
            # Like `wormhole receive`: the answer may come on a pipe ("y", "yes" or empty).
            line = sys.stdin.readline()
            if not line:
                raise TransferError("no answer on stdin: pass --accept-file to accept the file")
            print(f"ok? (Y/n): {line.strip()}", file=err)
            return line.strip().lower() in ("", "y", "yes")
        return input("ok? (Y/n): ").strip().lower() in ("", "y", "yes")

    @defer.inlineCallbacks
    def exchange() -> Any:
        code = args.code
        if not code:
            code = yield threads.deferToThread(_ask_for_code, reactor, w, err)
        _check_dest_before_code(args, code)
        w.set_code(code)
        yield w.get_verifier()
        versions = yield w.get_versions()
        if PROTOCOL in versions:
            dest = _dataset_dest(args, code)

            def check(schema: Any) -> str | None:
                return format_refusal(schema, args.format) or _dest_refusal(dest)

            options = _transfer_options(args, lanes=args.lanes)
            room = [options.staging_root, dest]
            spec = yield defer.ensureDeferred(accept_offer(w, options, check, room=room))
            return spec, dest
        # -o NAME renames; -o EXISTING_DIR saves inside it under the offered name.
        output = Path(args.output_file) if args.output_file else None
        if output is not None and output.is_dir():
            dest_dir, name = output, None
        else:
            dest_dir = output.parent if output else Path.cwd()
            name = output.name if output else None
        meter: Any = None

        def status(text: str) -> None:
            if meter is not None:
                meter.status(text)

        def accept_and_meter(offer: filetransfer.Offer) -> bool:
            nonlocal meter
            ok = accept(offer)
            meter = reporter.file_meter("receive", offer.size)
            return ok

        result = yield defer.ensureDeferred(
            filetransfer.receive(
                w,
                dest_dir,
                _connector(reactor, args, False),
                accept=accept_and_meter,
                output_name=name,
                on_status=status,
                progress=lambda n: meter(n) if meter is not None else None,
            )
        )
        reporter.close()
        if isinstance(result, filetransfer.ReceivedText):
            if reporter.mode == "json":
                reporter.emit("text", message=result.message)
            else:
                out.write(result.message + "\n")
                out.flush()
        else:
            reporter.emit(
                "done", kind=result.kind, path=str(result.path), bytes=result.size,
                sha256=result.sha256,
            )  # fmt: skip
            print(f"Received {result.kind} written to: {result.path}", file=err)
        return None

    return (yield _finish(w, exchange()))


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
