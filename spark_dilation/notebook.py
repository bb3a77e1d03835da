"""The notebook API: ``spark_dilation.send(...)`` and ``spark_dilation.receive(...)``.

::

    import spark_dilation

    handle = spark_dilation.send(df)        # returns at once; the send runs in a thread
    handle.code                             # '48213-guitarist-revenge': tell the receiver
    handle                                  # in Jupyter: the code and a live progress bar
    handle.wait()                           # the report, or the transfer's error

    # the other side, in another notebook
    df = spark_dilation.receive(spark, "48213-guitarist-revenge")   # a Spark DataFrame
    table = spark_dilation.receive(None, "48213-guitarist-revenge") # a pyarrow.Table

What ``send`` takes:

- a Spark DataFrame, from a classic session or a Spark Connect one. The
  data source's writer needs the code up front, so without ``code=`` one is
  made up here (see :func:`make_up_code`), then the background thread runs
  ``df.write.format("dilation").option("code", code)...save()`` after
  :func:`~spark_dilation.register`. Nothing here touches ``SparkContext``
  or the notebook's disk: on Spark Connect the notebook stays a thin client
  and the cluster sends. The report is logged by the Spark driver; here
  :meth:`SendHandle.wait` returns ``None`` and :attr:`SendHandle.progress`
  only knows the state.
- a ``pyarrow.Table``, a ``pyarrow.dataset.Dataset``, or paths of Parquet,
  CSV, JSON-lines or Arrow files: sent from this process by
  :class:`~spark_dilation.transfer.api.DatasetSender`, which asks the
  mailbox for a code; progress counts rows and bytes.

``options`` are the transfer options (``mailbox=``, ``relay=``,
``compression=``, ``peer_timeout=``, ...; see ``conf/options.md``). For Spark,
``mailbox`` and ``relay`` default to ``$SPARK_DILATION_MAILBOX`` and
``$SPARK_DILATION_RELAY`` of *this* process, because the data source runs in
Spark's own processes, which may not share the notebook's environment.
"""

from __future__ import annotations

import html
import os
import secrets
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from .errors import TransferCancelledError

__all__ = [
    "SendHandle",
    "SendProgress",
    "StreamHandle",
    "make_up_code",
    "receive",
    "receive_stream",
    "revoke_stream",
    "send",
    "stream",
]

MAILBOX_ENV = "SPARK_DILATION_MAILBOX"
RELAY_ENV = "SPARK_DILATION_RELAY"

# Nameplates of made-up codes. The mailbox hands out small numbers (1, 2, ...)
# when it allocates; a wide range far from them keeps collisions rare.
NAMEPLATE_RANGE = (1000, 999_999)

WAITING = "waiting for the receiver"
SENDING = "sending"
RUNNING = "running in Spark"
DONE = "done"
FAILED = "failed"
CANCELLED = "cancelled"


def make_up_code(words: int = 2) -> str:
    """A code made up here, without asking the mailbox: ``NNNNN-word-word``.

    The nameplate is random in 1000-999999 and the words come from the PGP
    word list, like ``wormhole send --code``. Collision risk: only a code
    whose *nameplate* is in use on the same mailbox at the same moment
    collides (with k nameplates open, about k in a million). Nothing leaks
    then: a third party is refused as "crowded", or the two senders fail key
    confirmation (different words); send again with a new code.
    """
    from .wormhole.codes import make_code

    low, high = NAMEPLATE_RANGE
    return make_code(str(low + secrets.randbelow(high - low + 1)), words)


@dataclass(frozen=True)
class SendProgress:
    """A snapshot of a send: its state and, when observable here, rows and bytes.

    ``rows``/``bytes`` are ``None`` for a Spark DataFrame (its tasks run in
    Spark, out of sight of the notebook); ``total_rows`` is known for tables
    and Parquet/Arrow files.
    """

    state: str
    rows: int | None = None
    bytes: int | None = None
    total_rows: int | None = None
    seconds: float = 0.0
    path: str | None = None

    @property
    def fraction(self) -> float | None:
        """Share of the rows sent, when the total is known."""
        if self.state == DONE:
            return 1.0
        if self.rows is None or not self.total_rows:
            return None
        return min(1.0, self.rows / self.total_rows)

    def text(self) -> str:
        parts = [self.state]
        if self.rows is not None:
            total = f" of {self.total_rows:,}" if self.total_rows is not None else ""
            parts.append(f"{self.rows:,}{total} rows")
        if self.bytes is not None:
            parts.append(f"{self.bytes / 1e6:,.1f} MB")
        if self.path and self.path != "unknown":
            parts.append(self.path)
        return ", ".join(parts)


def _is_spark_dataframe(obj: Any) -> bool:
    # Classic (pyspark.sql.classic.dataframe) and Connect (pyspark.sql.connect.dataframe)
    # DataFrames, recognised without importing pyspark for other sources.
    module = type(obj).__module__ or ""
    return (
        module.startswith("pyspark.sql") and hasattr(obj, "write") and hasattr(obj, "sparkSession")
    )


def _option_text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _spark_options(options: dict[str, Any]) -> dict[str, str]:
    """String options for the data source; mailbox/relay from this process' environment."""
    opts: dict[str, str] = {}
    for key, env in (("mailbox", MAILBOX_ENV), ("relay", RELAY_ENV)):
        if os.environ.get(env):
            opts[key] = os.environ[env]
    opts.update({k: _option_text(v) for k, v in options.items() if v is not None})
    return opts


class SendHandle:
    """A send under way in a background thread. Made by :func:`send`."""

    def __init__(self, code: str, kind: str) -> None:
        self.code: str = code
        self.kind = kind  # "python" or "spark"
        self._state = WAITING if kind == "python" else RUNNING
        self._started = time.monotonic()
        self._last: Any = None  # the latest transfer Progress (python sends)
        self._total_rows: int | None = None
        self._report: Any = None
        self._error: BaseException | None = None
        self._cancelled = threading.Event()
        self._finished = threading.Event()
        self._cancel_hook: Any = None
        self._thread: threading.Thread | None = None

    # -- running ------------------------------------------------------------------------

    def _start(self, work: Any) -> None:
        def run() -> None:
            try:
                self._report = work()
                self._state = DONE
            except BaseException as e:
                if self._cancelled.is_set() and not isinstance(e, TransferCancelledError):
                    cancelled = TransferCancelledError(
                        f"the send with code {self.code} was cancelled"
                    )
                    cancelled.__cause__ = e
                    e = cancelled
                self._error = e
                self._state = CANCELLED if self._cancelled.is_set() else FAILED
            finally:
                self._finished.set()

        self._thread = threading.Thread(target=run, name=f"send {self.code}", daemon=True)
        self._thread.start()

    def _on_progress(self, progress: Any) -> None:
        self._last = progress
        if self._state == WAITING:
            self._state = SENDING

    # -- the public surface -------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once the send finished, failed or was cancelled."""
        return self._finished.is_set()

    @property
    def progress(self) -> SendProgress:
        """What is known now: the state, and rows/bytes for sends from this process."""
        p = self._last
        seconds = time.monotonic() - self._started
        if self.kind == "spark":
            return SendProgress(self._state, seconds=seconds)
        if self._state == DONE and self._report is not None:
            r = self._report
            return SendProgress(DONE, r.rows, r.bytes, r.rows, r.seconds, r.path)
        if p is None:
            return SendProgress(self._state, 0, 0, self._total_rows, seconds)
        return SendProgress(self._state, p.rows, p.bytes, p.total_rows, p.seconds, p.path)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the send ends; its report (``None`` for Spark), or raise its error.

        ``timeout`` (seconds): raise :class:`TimeoutError` if the send is still
        running then (it keeps running; :meth:`cancel` stops it).
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(
                f"the send with code {self.code} is still {self._state} after {timeout:g} s; "
                "handle.cancel() stops it"
            )
        if self._error is not None:
            raise self._error
        return self._report

    def cancel(self) -> None:
        """Stop the send; :meth:`wait` then raises ``TransferCancelledError``.

        From this process: the wait for the receiver ends, or the partitions
        stop at their next batch and the receiver is told. From Spark: a writer
        still waiting for its receiver is refused over its own code (see
        :func:`_refuse_own_code`), and Spark jobs already running are
        interrupted (``SparkSession.interruptTag``).
        """
        if self.done:
            return
        self._cancelled.set()
        if self._cancel_hook is not None:
            self._cancel_hook()

    def __repr__(self) -> str:
        return f"<spark_dilation send {self.code}: {self.progress.text()}>"

    def _repr_html_(self) -> str:
        p = self.progress
        fraction = p.fraction
        if fraction is not None:
            bar = f'<progress value="{fraction:.4f}" max="1" style="width:20em"></progress>'
        elif p.state in (SENDING, RUNNING, WAITING):
            bar = '<progress style="width:20em"></progress>'  # indeterminate
        else:
            bar = ""
        return (
            '<div class="spark-dilation-send">'
            f"<b>wormhole code:</b> <code>{html.escape(self.code)}</code><br>"
            f"{bar} {html.escape(p.text())}</div>"
        )

    def _ipython_display_(self) -> None:
        """In Jupyter: the code and a progress bar that follows the send until it ends."""
        from IPython.display import HTML, display

        shown = display(HTML(self._repr_html_()), display_id=True)
        if shown is None or self.done:
            return

        def follow() -> None:
            while not self._finished.wait(0.5):
                shown.update(HTML(self._repr_html_()))
            shown.update(HTML(self._repr_html_()))

        threading.Thread(target=follow, name=f"show {self.code}", daemon=True).start()


def send(source: Any, code: str | None = None, **options: Any) -> SendHandle:
    """Start sending ``source``; returns a :class:`SendHandle` at once, ``.code`` known.

    ``source``: a Spark DataFrame (classic or Spark Connect), a
    ``pyarrow.Table``, a ``pyarrow.dataset.Dataset``, or paths of Parquet,
    CSV, JSON-lines or Arrow files. ``code``: use this code; without it the
    mailbox allocates one (Python sources) or one is made up here (Spark
    DataFrames, see :func:`make_up_code`). ``options``: transfer options
    (``mailbox``, ``relay``, ``compression``, ``peer_timeout``, ...).
    """
    if _is_spark_dataframe(source):
        return _send_spark(source, code, options)
    return _send_python(source, code, options)


def _send_python(source: Any, code: str | None, options: dict[str, Any]) -> SendHandle:
    from .transfer.api import DatasetSender, merge_options

    sender = DatasetSender(source, code=code, options=merge_options(None, options))
    handle = SendHandle(sender.code, "python")
    handle._total_rows = sender.total_rows
    handle._cancel_hook = sender.cancel
    handle._start(lambda: sender.wait(handle._on_progress))
    return handle


def _send_spark(df: Any, code: str | None, options: dict[str, Any]) -> SendHandle:
    from .spark.register import register

    spark = df.sparkSession
    register(spark)
    code = code or make_up_code()
    writer = (
        df.write.format("dilation")
        .option("code", code)
        .options(**_spark_options(options))
        .mode("append")
    )
    handle = SendHandle(code, "spark")
    tag = f"spark-dilation-send-{uuid.uuid4().hex[:12]}"
    can_tag = hasattr(spark, "addTag") and hasattr(spark, "interruptTag")

    classic = not type(spark).__module__.startswith("pyspark.sql.connect")

    def work() -> None:
        if classic:
            # save() looks the data source up in the JVM thread's *active*
            # session, and this thread's JVM twin has none yet: createDataFrame
            # (public API, no job) makes ``spark`` active there. A Connect
            # session lives on the server and needs nothing.
            spark.createDataFrame([(0,)], "x INT")
        # Tags belong to the thread that starts the operation (classic and Connect).
        if can_tag:
            spark.addTag(tag)
        try:
            writer.save()
        finally:
            if can_tag:
                spark.removeTag(tag)

    mailbox = _spark_options(options).get("mailbox")

    def cancel() -> None:
        # A writer still waiting for its receiver (or still starting: wait for it).
        _refuse_own_code(code, mailbox, handle._finished)
        if can_tag:
            spark.interruptTag(tag)  # Spark jobs already running

    handle._cancel_hook = cancel
    handle._start(work)
    return handle


CANCEL_REASON = "the sender cancelled the send"


def _refuse_own_code(code: str, mailbox: str | None, ended: threading.Event) -> None:
    """Open our own code as a receiver and refuse the offer, in the background.

    A Spark writer waits for its receiver inside Spark's planning, where
    ``interruptTag`` does not reach (no job runs yet); this makes it fail at
    once with ``the other side abandoned the transfer: the sender cancelled
    the send``. If the real receiver is already there, the mailbox refuses
    this third party (crowded) and nothing changes. It waits for the writer
    until the send has ended (``ended``): a writer whose planning is slow to
    start (a loaded machine) would otherwise find the code free and wait for
    a receiver until its own ``peer_timeout``.
    """
    import contextlib

    from twisted.internet import defer, threads

    from .errors import DilationError
    from .transfer.meet.session import SESSION_APPID, accept_offer
    from .transfer.rules.options import TransferOptions
    from .transfer.rules.protocol import SESSION_RECEIVER, session_versions
    from .wormhole.blocking import call_soon
    from .wormhole.client import Wormhole

    options = TransferOptions(mailbox=mailbox)

    async def run() -> None:
        from twisted.internet import reactor

        w = Wormhole(
            SESSION_APPID,
            options.mailbox_url,
            reactor,
            app_versions=session_versions(SESSION_RECEIVER),
        )
        # The send ended some other way: stop waiting (close() fails the wait below).
        watch = threads.deferToThread(ended.wait)
        watch.addCallback(lambda _: defer.ensureDeferred(w.close()))
        watch.addErrback(lambda _: None)
        try:
            w.set_code(code)
            await w.get_verifier()
            await accept_offer(w, options, check=lambda schema: CANCEL_REASON)
        except DilationError:
            pass  # refused as planned, crowded, or nobody there
        finally:
            with contextlib.suppress(DilationError):
                await w.close()

    call_soon(lambda: defer.ensureDeferred(run()))


def receive(spark: Any, code: str, **options: Any) -> Any:
    """Receive the dataset sent with ``code``.

    With a SparkSession (classic or Spark Connect): registers the data source
    and returns ``spark.read.format("dilation").option("code", code)...load()``,
    a DataFrame (``load()`` waits for the sender and agrees on the transfer;
    the rows move when the first action runs). With ``None``: receives here
    and returns a ``pyarrow.Table``. ``options`` as for :func:`send`.
    """
    if spark is None:
        from .transfer.api import receive_table

        return receive_table(code, **options)
    from .spark.register import register

    register(spark)
    return (
        spark.read.format("dilation").option("code", code).options(**_spark_options(options)).load()
    )


# --- streams (docs/transfer.md section 7) ------------------------------------------------------


@dataclass
class StreamHandle:
    """A sending stream: its code (tell the receiver) and its Spark ``StreamingQuery``."""

    code: str
    query: Any

    def stop(self) -> None:
        """Stop the sending query; the pairing stays, and the same call resumes it."""
        self.query.stop()

    def __repr__(self) -> str:
        status = self.query.status.get("message", "") if self.query.isActive else "stopped"
        return f"<stream {self.code}: {status}>"

    def _repr_html_(self) -> str:
        return f"<b>stream</b> <code>{html.escape(self.code)}</code>: {html.escape(repr(self))}"


def stream(
    df: Any, code: str | None = None, checkpoint: str | None = None, **options: Any
) -> StreamHandle:
    """Send a streaming DataFrame: ``df.writeStream.format("dilation")...start()``.

    ``code``: made up when omitted (the handle has it; tell the receiver).
    ``checkpoint``: the query's ``checkpointLocation``, where its pairing
    record lives too; run the same call again after a restart and it resumes
    with no new code. ``options``: see ``conf/options.md``, "Streams"
    (``trigger=`` goes to ``DataStreamWriter.trigger(**trigger)``).
    """
    from .spark.register import register

    register(df.sparkSession)
    code = code or make_up_code()
    trigger = options.pop("trigger", None)
    writer = df.writeStream.format("dilation").option("code", code)
    writer = writer.options(**_spark_options(options))
    if checkpoint is not None:
        writer = writer.option("checkpointLocation", checkpoint)
    if trigger:
        writer = writer.trigger(**trigger)
    return StreamHandle(code, writer.start())


def receive_stream(spark: Any, code: str, **options: Any) -> Any:
    """The streaming DataFrame of the stream sent with ``code``:
    ``spark.readStream.format("dilation").option("code", code)...load()``.

    ``load()`` pairs with the sending query (the first time) and returns with
    the sender's schema; write it anywhere with ``writeStream``.
    """
    from .spark.register import register

    register(spark)
    warn_driver_state(spark, options)
    reader = spark.readStream.format("dilation").option("code", code)
    return reader.options(**_spark_options(options)).load()


def warn_driver_state(spark: Any, options: dict[str, Any]) -> str | None:
    """On a cluster (a master that is not ``local``), a receiving stream with no
    ``state_dir`` keeps its record and stage on the driver's disk, which a cluster
    restart loses: say so once, in one line, with where to put it. The line, or None."""
    if any(k.lower() in ("state_dir", "pairing_dir") for k in options):
        return None
    try:
        master = str(spark.conf.get("spark.master", "local"))
    except Exception:  # a Connect server that hides it: nothing to say
        return None
    if master.startswith("local"):
        return None
    import warnings

    from .spark.stream import driver_state_warning

    line = driver_state_warning(master)
    warnings.warn(line, stacklevel=3)
    return line


def revoke_stream(pairing: str, reason: str = "", timeout: float = 30.0) -> bool:
    """Revoke a stream's pairing (``pairing``: the folder or its ``pairing.json``).

    Neither side can resume afterwards; the other side's running query ends
    saying so. Returns whether the mailbox server confirmed it within
    ``timeout`` (if not, this side is revoked and the other learns it when it
    next reaches the server).
    """
    from .transfer.api import revoke_stream as revoke

    return revoke(pairing, reason, timeout)
