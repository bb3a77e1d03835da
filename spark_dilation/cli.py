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
import contextlib
import importlib
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

from twisted.internet import defer, threads

from . import __version__, cleanup, cli_signals
from .cli_progress import Reporter, pick_mode
from .errors import DilationError, Interrupted, TransferError
from .transfer.rules.options import DEFAULT_RELAY_URL, TransferOptionError, resolve_relay
from .transit import filetransfer, offers
from .transit.connector import TransitConnector
from .wormhole import DEFAULT_MAILBOX_URL, Wormhole
from .wormhole.blocking import ensure_reactor, run_and_wait
from .wormhole.wordlist import code_completions

log = logging.getLogger("spark_dilation.cli")

MAILBOX_ENV = "SPARK_DILATION_MAILBOX"
RELAY_ENV = "SPARK_DILATION_RELAY"
EXIT_ERROR = 1
EXIT_USAGE = 2
WAIT_FOREVER = 7 * 24 * 3600.0  # "no --timeout" for the dataset API's deadlines
# serve's mailbox database: on disk, so a restarted server strands no meeting (issue 42).
SERVE_DB = "mailbox.sqlite"


class _Parser(argparse.ArgumentParser):
    """Fills the shared options' defaults after parsing.

    The shared options (:func:`_shared_options`) are accepted before and after
    the subcommand; both copies default to SUPPRESS so that one given before
    is not overwritten by the subcommand's default.
    """

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extra = super().parse_known_args(args, namespace)
        for name, value in _shared_defaults().items():
            if not hasattr(parsed, name):
                setattr(parsed, name, value)
        return parsed, extra


def _shared_defaults() -> dict[str, Any]:
    return {
        "mailbox": os.environ.get(MAILBOX_ENV) or DEFAULT_MAILBOX_URL,
        "appid": offers.APPID,
        "verbose": 0,
        "relay": os.environ.get(RELAY_ENV) or DEFAULT_RELAY_URL,
        "no_listen": False,
    }


def _shared_options(transit: bool) -> argparse.ArgumentParser:
    """Options taken before or after the subcommand: ``--mailbox X send`` = ``send --mailbox X``."""
    shared = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    defaults = _shared_defaults()
    shared.add_argument(
        "--mailbox",
        metavar="URL",
        help=f"mailbox server WebSocket URL (env {MAILBOX_ENV}; default {defaults['mailbox']})",
    )
    shared.add_argument("--appid", help="application id (default: the wormhole CLI's)")
    shared.add_argument("-v", "--verbose", action="count", help="log more (-vv for debug)")
    if transit:
        shared.add_argument(
            "--relay",
            metavar="tcp:HOST:PORT",
            help=f"transit relay, for peers with no direct route; 'none' for no relay "
            f"(env {RELAY_ENV}; default {defaults['relay']})",
        )
        shared.add_argument(
            "--no-listen",
            action="store_true",
            help="offer no direct connection (reach the peer only through relays)",
        )
    return shared


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="spark-dilation",
        description="Move data peer to peer with a Magic Wormhole code.",
        parents=[_shared_options(transit=True)],
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    shared = [_shared_options(transit=True)]
    # Plain parsers below: only the top level fills the shared defaults.
    sub = parser.add_subparsers(
        dest="command", metavar="COMMAND", parser_class=argparse.ArgumentParser
    )
    sub.required = True

    send = sub.add_parser(
        "send",
        help="send a dataset (Parquet/CSV/JSON-lines/Arrow files or folders), a file or a text",
        parents=shared,
    )
    send.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="files or folders of one format (.parquet, .csv, .json/.jsonl, .arrow/.feather)",
    )
    send.add_argument(
        "--text", metavar="MESSAGE", help="send this text instead ('-': read it from stdin)"
    )
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
        default="auto",
        metavar="auto|none|lz4|zstd|parquet",
        help="datasets: Arrow IPC body compression, or parquet (the fewest bytes); auto "
        "picks per partition from this machine's compression speed and the link's rate "
        "(default %(default)s)",
    )
    _add_timeout(send)
    _add_progress_options(send)

    receive = sub.add_parser(
        "receive", help="receive a dataset, a file, a directory or a text", parents=shared
    )
    receive.add_argument("code", nargs="?", help="the code (asked for if omitted)")
    receive.add_argument(
        "--accept-file",
        "-y",
        "--yes",
        action="store_true",
        help="accept a file or directory without asking (-y/--yes, as croc)",
    )
    receive.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing -o: a dataset folder (swapped in only once complete) or a file",
    )
    receive.add_argument(
        "-o",
        "--output-file",
        metavar="PATH",
        help="datasets: the folder to write (default dataset-NAMEPLATE, or dataset-NAMEPLATE-2 "
        "and so on if that exists); files: save under "
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
    _add_progress_options(receive)

    verbosity = [_verbosity()]
    serve = sub.add_parser(
        "serve",
        help="run a mailbox server and transit relay in the foreground",
        parents=verbosity,
    )
    serve.add_argument(
        "--interface", default="127.0.0.1", help="address to listen on (default %(default)s)"
    )
    serve.add_argument(
        "--mailbox-port",
        type=int,
        default=4000,
        metavar="PORT",
        help="mailbox server port (default %(default)s; 0: any free port)",
    )
    serve.add_argument(
        "--relay-port",
        type=int,
        default=4001,
        metavar="PORT",
        help="transit relay port (default %(default)s; 0: any free port)",
    )
    serve.add_argument("--motd", help="message of the day shown to clients")
    serve.add_argument("--disallow-list", action="store_true", help="refuse to list nameplates")
    serve.add_argument(
        "--channel-db",
        default=SERVE_DB,
        metavar="PATH",
        help="the mailbox server's database (default %(default)s in the current folder): a "
        "restarted server keeps its nameplates and mailboxes, so transfers meeting at the "
        "time go on; ':memory:' keeps nothing",
    )

    demo = sub.add_parser(
        "demo",
        help="start embedded servers and run transfers, Spark to Spark, end to end",
        parents=verbosity,
    )
    demo.add_argument("--no-spark", action="store_true", help="skip the Spark part")
    # Hidden: the test suite runs the demo with fewer rows.
    demo.add_argument("--rows", type=int, default=None, help=argparse.SUPPRESS)
    revoke = sub.add_parser(
        "revoke",
        help="revoke a stream's pairing: neither side can resume it, the other side's query ends",
        parents=verbosity,
    )
    revoke.add_argument("pairing", metavar="PAIRING", help="the pairing folder or its pairing.json")
    revoke.add_argument("--reason", help="told to the other side")
    _add_timeout(revoke)
    cleanup.add_parser(sub)
    return parser


def _verbosity() -> argparse.ArgumentParser:
    shared = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    shared.add_argument("-v", "--verbose", action="count", help="log more (-vv for debug)")
    return shared


def _add_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="give up if the other side has not used the code by then (default: wait)",
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
            channel_db=args.channel_db,
        )
    if args.command == "cleanup":
        return cleanup.run(args)
    if args.command == "revoke":
        return _revoke(args)
    if args.command == "demo":
        from .demo import run

        if not args.no_spark and not _importable("pyspark"):
            return _usage_error(
                "demo",
                "its Spark part needs the spark extra: pip install "
                "'spark-dilation[spark,server]' (or run demo --no-spark)",
            )
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


def _revoke(args: argparse.Namespace) -> int:
    from .transfer.api import revoke_stream
    from .transfer.api.streams import record_path
    from .transfer.meet.record import load_record

    try:
        record = load_record(record_path(args.pairing))
        if record is None:
            return _usage_error("revoke", f"no pairing record at {record_path(args.pairing)}")
        confirmed = revoke_stream(args.pairing, args.reason or "", args.timeout or 30.0)
    except DilationError as e:
        print(f"spark-dilation: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    print(
        f"revoked stream {record.stream} (this side: the {record.role}); neither side can "
        "resume it: pair again with a new code"
    )
    if not confirmed:
        print(
            f"spark-dilation: the mailbox server {record.mailbox} did not confirm in time: the "
            f"{record.peer_role} learns it when it next reaches the server",
            file=sys.stderr,
        )
    return 0


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


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
    cli_signals.install()  # Ctrl-C, SIGTERM: Interrupted, handled below
    try:
        command(args, reporter)
        return 0
    except DilationError as e:
        _fail(reporter, str(e))
        return EXIT_USAGE if isinstance(e, TransferOptionError) else EXIT_ERROR
    except ValueError as e:  # e.g. a malformed --mailbox URL
        _fail(reporter, str(e))
        return EXIT_USAGE
    except KeyboardInterrupt as e:
        # The transfer already told the other side and cleaned up; str(e) says so.
        message = str(e) if isinstance(e, Interrupted) else "cancelled (Ctrl-C)"
        with contextlib.suppress(OSError):  # SIGHUP: the terminal may be gone
            reporter.close()
            reporter.emit("cancelled", message=message)
            if _prompting.is_set():
                print(file=sys.stderr)  # off the prompt's line
            print(f"spark-dilation: {message}", file=sys.stderr)
        _quiet_from_now()
        cli_signals.restore_terminal()
        cli_signals.exit_soon(cli_signals.exit_code())
        return cli_signals.exit_code()


def _quiet_from_now() -> None:
    """The line just printed is the last: no teardown chatter after it (unless -v)."""
    if logging.getLogger().level >= logging.WARNING:
        logging.disable(logging.WARNING)


def _fail(reporter: Reporter, message: str) -> None:
    reporter.close()
    reporter.emit("error", message=message)
    print(f"spark-dilation: error: {message}", file=sys.stderr)
    _quiet_from_now()


def _on_reactor(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(reactor, *args)`` (returns a Deferred) on the reactor; block for the result."""
    from twisted.internet import reactor

    forever = 10 * 365 * 86400.0  # the command's own options bound its waits
    return run_and_wait(
        fn, reactor, *args, timeout=forever, on_timeout=lambda: TimeoutError("no end in ten years")
    )


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
    w = Wormhole(
        args.appid,
        args.mailbox,
        reactor,
        timeout=args.timeout,
        timeout_option="--timeout",
        app_versions=app_versions,
    )
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
        reactor, is_sender=is_sender, relay_url=resolve_relay(args.relay), no_listen=args.no_listen
    )


def _transfer_options(args: argparse.Namespace, **extra: Any) -> Any:
    from .transfer.rules.options import TransferOptions

    return TransferOptions(
        mailbox=args.mailbox,
        relay=args.relay,  # "none" included: TransferOptions.relay_url resolves it
        no_listen=args.no_listen,
        peer_timeout=args.timeout if args.timeout else WAIT_FOREVER,
        lane_start_timeout=WAIT_FOREVER,
        surface="cli",
        **extra,
    )


def _receive_hints(args: argparse.Namespace, code: str) -> tuple[str, str, str]:
    """The receiver's commands for ``code``: ours, Spark's and the wormhole CLI's.

    A mailbox other than the default is named in each, or the receiver would
    look for the code on the public server.
    """
    mailbox = "" if args.mailbox == DEFAULT_MAILBOX_URL else args.mailbox
    ours = f"spark-dilation receive {'--mailbox ' + mailbox + ' ' if mailbox else ''}{code}"
    spark = f'spark.read.format("dilation").option("code", "{code}")'
    if mailbox:
        spark += f'.option("mailbox", "{mailbox}")'
    ref = f"wormhole {'--relay-url ' + mailbox + ' ' if mailbox else ''}receive {code}"
    return ours, spark + ".load()", ref


def _code_banner(code: str, err: TextIO, how: str) -> None:
    print(f"Wormhole code is: {code}", file=err)
    print(f"On the other computer, please run:\n\n{how}\n", file=err)
    err.flush()


# --- send -----------------------------------------------------------------------------


def send(args: argparse.Namespace, reporter: Reporter) -> None:
    from .transfer.rules.options import COMPRESSION_OPTIONS

    if args.compression not in COMPRESSION_OPTIONS:  # CLI wording, before the code is used
        raise ValueError(
            f"--compression {args.compression}: choose {', '.join(COMPRESSION_OPTIONS)}"
        )
    if args.text == "-":  # as `wormhole send --text -` does
        print("Reading text message from stdin..", file=sys.stderr)
        args.text = sys.stdin.read()
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
    ours, spark, _ = _receive_hints(args, code)
    _code_banner(code, sys.stderr, f"{ours}\n   (or in Spark: {spark})")
    reporter.emit("code", code=code)
    # Said inside wait(): a signal that lands while the line is written ends as one in the wait.
    report = sender.wait(
        reporter.progress, on_waiting=lambda: reporter.say("waiting for the receiver..")
    )
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
        ours, _, ref = _receive_hints(args, code)
        _code_banner(code, err, f"{ours}\n   (or: {ref})")
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
    from .transfer.rules.options import RECEIVE_FORMATS

    if args.format not in RECEIVE_FORMATS:
        raise ValueError(f"--format {args.format}: choose {', '.join(RECEIVE_FORMATS)}")
    if args.lanes < 1:
        raise ValueError(f"--lanes {args.lanes}: must be at least 1")
    agreed = _on_reactor(receive_session_or_classic, args, sys.stdout, sys.stderr, reporter)
    if agreed is None:
        return  # a text or a file: done
    spec, dest = agreed
    from .transfer.api import receive_agreed

    staged = spec.options.staging_root / spec.transfer_id
    cli_signals.also_on_exit_now(lambda: shutil.rmtree(staged, ignore_errors=True))
    reporter.say(f"Receiving a dataset ({len(spec.schema)} columns) into {dest}/")
    got = receive_agreed(
        spec, dest, format=args.format, on_progress=reporter.progress, overwrite=args.overwrite
    )
    reporter.close()
    reporter.emit("done", **_report_fields(got.report), files=[str(f) for f in got.files])
    if reporter.mode != "json":
        print(f"Dataset received: {got.report.summary()}", file=sys.stderr)
        print(
            f"Written to: {dest}/ ({len(got.files)} {args.format} file(s))",
            file=sys.stderr,
        )


def _dataset_dest(args: argparse.Namespace, code: str) -> Path:
    """``-o``, else ``dataset-NAMEPLATE``, else ``-2``, ``-3``... (nameplates are reused)."""
    if args.output_file:
        return Path(args.output_file)
    base = f"dataset-{code.split('-', 1)[0]}"
    dest, n = Path(base), 1
    while dest.exists():
        n += 1
        dest = Path(f"{base}-{n}")
    return dest


def _dest_refusal(dest: Path, overwrite: bool = False) -> str | None:
    if overwrite:
        return None  # replaced at the end, once the new data is complete
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
    problem = dest_problem(dest, must_be_empty=not (args.accept_file or args.overwrite))
    if problem is not None:
        full = dest.is_dir() and any(dest.iterdir())
        hint = (
            " (--overwrite replaces it with the dataset; --accept-file saves a file inside it)"
            if full
            else ""
        )
        raise TransferOptionError(
            f"{problem}{hint}; the code was not used, so run receive again with another -o"
        )


@defer.inlineCallbacks
def receive_session_or_classic(
    reactor: Any, args: argparse.Namespace, out: TextIO, err: TextIO, reporter: Reporter
) -> Any:
    """Open the code: agree on a dataset (returns (spec, dest)), or take a text or file (None)."""
    from .transfer.rules.protocol import PROTOCOL, SESSION_RECEIVER, session_versions

    w = yield _open(reactor, args, err, app_versions=session_versions(SESSION_RECEIVER))

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
        return _prompt("ok? (Y/n): ", at_end="n").lower() in ("", "y", "yes")

    @defer.inlineCallbacks
    def exchange() -> Any:
        code = args.code
        if not code:
            code = yield _in_daemon_thread(reactor, _ask_for_code, reactor, w, err)
        _check_dest_before_code(args, code)
        w.set_code(code)
        yield w.get_verifier()
        versions = yield w.get_versions()
        if PROTOCOL in versions:
            # pyarrow's dataset layer takes most of a second to import: after the prompt.
            from .transfer.api import format_refusal
            from .transfer.meet.session import accept_offer

            dest = _dataset_dest(args, code)

            def check(schema: Any) -> str | None:
                return format_refusal(schema, args.format) or _dest_refusal(dest, args.overwrite)

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
                overwrite=args.overwrite,
                on_status=status,
                progress=lambda n: meter(n) if meter is not None else None,
            )
        )
        reporter.close()
        if isinstance(result, filetransfer.ReceivedText):
            if reporter.mode == "json":
                reporter.emit("text", message=result.message)
            else:
                # The reference sends `--text -` with stdin's trailing newline;
                # end the line once, not twice.
                text = result.message
                out.write(text if text.endswith("\n") else text + "\n")
                out.flush()
        else:
            reporter.emit(
                "done", kind=result.kind, path=str(result.path), bytes=result.size,
                sha256=result.sha256,
            )  # fmt: skip
            print(f"Received {result.kind} written to: {result.path}", file=err)
        return None

    return (yield _finish(w, exchange()))


def _in_daemon_thread(reactor: Any, fn: Callable[..., Any], *args: Any) -> defer.Deferred:
    """``fn(*args)`` in a daemon thread: a prompt blocked in input() must not keep a
    cancelled command from exiting (the reactor's thread pool would wait for it)."""
    d: defer.Deferred = defer.Deferred()

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as e:
            error = e
            reactor.callFromThread(lambda: d.called or d.errback(error))
        else:
            reactor.callFromThread(lambda: d.called or d.callback(result))

    threading.Thread(target=run, name="code-prompt", daemon=True).start()
    return d


_prompting = threading.Event()  # a prompt waits for a line: Ctrl-C starts a new one


def _prompt(text: str, at_end: str | None = None) -> str:
    """A line typed at the prompt; at end of input (Ctrl-D) ``at_end``, or for a code
    prompt (``at_end`` None) the error that no code was given."""
    _prompting.set()
    try:
        return input(text).strip()
    except EOFError:
        print(file=sys.stderr)  # off the prompt's line
        if at_end is None:
            raise DilationError("no code given (end of input at the prompt)") from None
        return at_end
    finally:
        _prompting.clear()


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
        return _prompt("Enter receive wormhole code: ")

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
    return _prompt("Enter receive wormhole code: ")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
