"""This machine's side of our helper processes: start one, wait until it is ready,
know when to end, and the small files they leave each other.

A helper (the sender host, the registry host, a lane host) outlives the
short-lived Spark worker that starts it (:func:`spawn`), in a session of its
own; the starter waits until it is ready or has failed (:func:`wait_ready`).
Its *owner* is the Spark application's driver JVM, the nearest ``java``
ancestor at the time it starts. When the owner ends (the application
finished, crashed or was killed), the helper does its last duty (tell the
peers, close the links) and exits, within :data:`POLL` seconds (:func:`watch`).
Files a process reads while another writes them are written whole
(:func:`atomic_write`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ..errors import TransferError

POLL = 0.5
T = TypeVar("T")


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        if Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z"):
            return False
    return True


def owner_pid() -> int | None:
    """The driver JVM above this process, else its parent (None if that is init)."""
    jvm = driver_jvm_pid()
    if jvm is not None:
        return jvm
    parent = os.getppid()
    return parent if parent > 1 else None


def watch(pid: int | None, on_end: Callable[[], None], stop: threading.Event) -> None:
    """Call ``on_end`` (in a daemon thread) once ``pid`` has ended, unless ``stop`` is set."""
    if pid is None:
        return

    def run() -> None:
        while not stop.wait(POLL):
            if not alive(pid):
                on_end()
                return

    threading.Thread(target=run, name=f"watch-{pid}", daemon=True).start()


def try_lock(path: Path) -> int | None:
    """An exclusive ``flock`` on ``path`` (created), held by the returned descriptor,
    or None if another process holds it. Elects one helper per machine: the lane
    host of a lane, the sender host of a transfer."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


PROC_LOCKS = Path("/proc/locks")


def lock_held(path: Path) -> bool:
    """Whether a process holds a :func:`try_lock` lock on ``path``, without taking it.

    Taking the lock to see (and dropping it) makes the prober the holder for an
    instant, and a helper starting in that instant takes the lock for held and
    leaves. On Linux ``/proc/locks`` lists every ``flock`` by device and inode
    (``FLOCK ADVISORY WRITE PID MAJ:MIN:INODE ...``, major and minor in hex), so
    nothing is taken; elsewhere (no such file) the lock is tried and dropped.
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        return False
    try:
        table = PROC_LOCKS.read_text()
    except OSError:
        fd = try_lock(path)
        if fd is None:
            return True
        os.close(fd)
        return False
    return held_in(table, st.st_dev, st.st_ino)


def held_in(table: str, dev: int, ino: int) -> bool:
    """Whether ``/proc/locks``' text ``table`` lists an ``flock`` on (``dev``, ``ino``)."""
    want = f"{os.major(dev):02x}:{os.minor(dev):02x}:{ino}"
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF"; a waiter has "->" after "1:".
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want:
            return True
    return False


def sync_folder(folder: str | Path) -> None:
    """fsync ``folder``: the renames and creations in it are on disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(
    path: str | Path, data: bytes | str, mode: int = 0o666, durable: bool = False
) -> None:
    """``data`` (a str as UTF-8) into the file ``path``, all at once: a reader finds
    the old file or none, or the whole new one, never a part.

    Written to a new file beside it, then renamed over ``path``. ``mode`` is the
    new file's permissions before the umask (``0o600``: this user's alone).
    ``durable``: on disk before this returns, the rename included (fsync of the
    file, then of its folder), so a machine that loses power keeps it.
    """
    path = Path(path)
    body = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            sync_folder(path.parent)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_private(directory: Path, obj: Any) -> Path:
    """``obj`` pickled into a new file only this user can read (it may hold the secret).

    The helper that gets its path reads it and removes it at once.
    """
    path = Path(directory) / f".start-{uuid.uuid4().hex}.pkl"
    atomic_write(path, pickle.dumps(obj), mode=0o600)
    return path


def read_private(path: str | Path) -> Any:
    """What :func:`write_private` wrote; the file is removed."""
    with open(path, "rb") as f:
        obj = pickle.load(f)
    os.unlink(path)
    return obj


def spawn(module: str, args: Sequence[str], log: Path) -> subprocess.Popen:
    """Start ``python -m module args`` as a helper: its own session (it outlives the
    Spark worker that starts it, and Spark's kills of that worker's group), no stdin,
    its output appended to ``log``."""
    with open(log, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
            close_fds=True,
        )


def wait_ready(
    proc: subprocess.Popen | None,
    ready: Callable[[], T | None],
    failed: Callable[[], BaseException | None],
    deadline: float,
    what: str,
    option: str = "",
    *,
    log: Path | None = None,
    every: float = 0.02,
) -> T:
    """Wait until a helper just started is ready: the first value ``ready()`` gives
    that is not None.

    ``failed()`` says why it never will be (the error it left, its exit), else
    None: that error is raised, unless ``ready()``, looked at once more, gives a
    value (the helper got ready and then ended between the two looks). Past
    ``deadline`` (``time.monotonic()``) ``proc``, if any, is killed and a
    TransferError names ``what`` was waited for (``"the X to do Y"``), the
    ``option`` that bounds it and the helper's ``log``.
    """
    limit = deadline - time.monotonic()
    while True:
        value = ready()
        if value is not None:
            return value
        error = failed()
        if error is not None:
            value = ready()
            if value is not None:
                return value
            raise error
        if time.monotonic() > deadline:
            if proc is not None:
                proc.kill()
            raise TransferError(
                f"gave up after {round(max(limit, 0), 1):g} s waiting for {what}"
                + (f" (option {option})" if option else "")
                + (f"; see {log}" if log is not None else "")
            )
        time.sleep(every)


def private_dir(directory: Path) -> Path:
    """``directory`` (and its parents), the last one readable by this user alone."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory


def os_cause(e: BaseException) -> str:
    """``[Errno 28] No space left on device``: an OS error without its file name."""
    if isinstance(e, OSError) and e.errno:  # pyarrow's OSErrors carry it too, wordier
        return f"[Errno {e.errno}] {os.strerror(e.errno)}"
    return str(e)


def existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def space_refusal(nbytes: int | None, places: list[Path]) -> str | None:
    """Why ``nbytes`` (the offer's estimate) clearly cannot fit in ``places``, or None.

    Each place needs the whole estimate (staged, then written out); places on
    one file system add up. An unknown size (None) is never refused.
    """
    if not nbytes:
        return None
    need: dict[int, int] = {}
    free: dict[int, int] = {}
    where: dict[int, Path] = {}
    for place in places:
        probe = existing(place)
        try:
            dev = os.stat(probe).st_dev
            st = os.statvfs(probe)
        except OSError:
            continue  # the write itself will say what is wrong
        need[dev] = need.get(dev, 0) + nbytes
        free[dev] = st.f_bavail * st.f_frsize
        where.setdefault(dev, place)
    for dev, needed in need.items():
        if free[dev] < needed:
            return (
                f"the receiving machine has not enough free space for the dataset: it is "
                f"about {_mb(nbytes)} and {where[dev]} has {_mb(free[dev])} free (about "
                f"{_mb(needed)} needed there)"
            )
    return None


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


MACHINE_ENV = "SPARK_DILATION_MACHINE"  # a name for this machine in messages (else hostname)


def machine_name() -> str:
    return os.environ.get(MACHINE_ENV) or socket.gethostname()


_MAX_DEPTH = 8


def _parent_and_comm(pid: int) -> tuple[int, str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), comm


def driver_jvm_pid(pid: int | None = None) -> int | None:
    """The pid of the nearest ancestor JVM of ``pid`` (default: this process), if any."""
    pid = os.getpid() if pid is None else pid
    for _ in range(_MAX_DEPTH):
        info = _parent_and_comm(pid)
        if info is None:
            return None
        parent, comm = info
        if comm == "java":
            return pid
        if parent <= 1:
            return None
        pid = parent
    return None
