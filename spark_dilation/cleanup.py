"""``spark-dilation cleanup``: remove what ended transfers left in the staging roots.

A staging root (``<tempdir>/spark-dilation`` unless ``--staging-root``)
holds one directory per transfer and helper: ``<transfer>/lane-<n>/`` (a
lane's partitions, ``manifest.json``, ``error.json``, ``host.pid``,
``host.log``, ``.lock``), ``send-<transfer>/`` (a sender host: ``host.sock``,
``host.pid``, ``host.log``, ``.lock``), ``start-<id>/`` (a sender host
agreeing on a code) and ``registry-<transfer>-<id>/`` (a reader's lane
registry). Normally their owners remove them; a killed process leaves them.

An entry is live, and kept, while its owner runs: a ``.lock`` under it is
held (``lifetime.try_lock``: the lane lock, the sender host lock), a
``host.pid`` under it names a running process, or a process has a file
under it open (a helper's ``host.log``). Anything else is removed.
``receive-*`` folders (files taken with ``receive_file()``, which a later
``option("staged_path", ...)`` may still read) are never removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from .cli_progress import size_text
from .transfer.machine import alive, lock_held

KEEP_PREFIXES = ("receive-",)  # received files a user may still read


@dataclass(frozen=True)
class Entry:
    path: Path
    size: int  # bytes of its files
    live: str | None  # why it is kept (None: stale)


def default_root() -> Path:
    return Path(tempfile.gettempdir()) / "spark-dilation"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``cleanup`` subcommand (the CLI calls :func:`run` with its arguments)."""
    p = sub.add_parser(
        "cleanup",
        help="remove what ended transfers left in the staging root (partitions, host files)",
    )
    p.add_argument(
        "--staging-root",
        metavar="DIR",
        action="append",
        type=Path,
        help=f"a staging root to clean (repeatable; default {default_root()})",
    )
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed and kept")


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Clean ``--staging-root`` (or the default root); print one line per entry."""
    roots = args.staging_root or [default_root()]
    for line in cleanup(roots, dry_run=args.dry_run):
        print(line, file=out or sys.stdout)
    return 0


def cleanup(roots: Iterable[Path], *, dry_run: bool = False) -> list[str]:
    """Remove the stale entries of each root; one line per entry, then a summary each."""
    lines: list[str] = []
    open_paths = _open_paths()
    for root in roots:
        root = Path(root)
        if not root.is_dir():
            lines.append(f"{root}: no such directory, nothing to clean")
            continue
        removed = kept = 0
        freed = 0
        for entry in scan(root, open_paths):
            if entry.live is not None:
                kept += 1
                lines.append(f"kept {entry.path}: {entry.live} ({size_text(entry.size)})")
                continue
            if not dry_run:
                shutil.rmtree(entry.path, ignore_errors=True)
                if entry.path.exists():
                    lines.append(f"could not remove {entry.path} (permissions?)")
                    continue
            removed += 1
            freed += entry.size
            verb = "would remove" if dry_run else "removed"
            lines.append(f"{verb} {entry.path} ({size_text(entry.size)})")
        verb = "would remove" if dry_run else "removed"
        lines.append(
            f"{root}: {verb} {removed} stale transfer dir(s), "
            f"{size_text(freed)} {'to free' if dry_run else 'freed'}; kept {kept} in use"
        )
    return lines


def scan(root: Path, open_paths: Sequence[str] | None = None) -> list[Entry]:
    """Each directory directly under ``root``, with its size and whether it is live."""
    opened = _open_paths() if open_paths is None else open_paths
    entries = []
    for path in sorted(root.iterdir()):
        if not path.is_dir() or path.is_symlink():
            continue
        if path.name.startswith(KEEP_PREFIXES):
            why: str | None = "received files (remove by hand when no longer read)"
        else:
            why = _live(path, opened)
        entries.append(Entry(path, _du(path), why))
    return entries


def _live(directory: Path, open_paths: Sequence[str]) -> str | None:
    """Why ``directory`` is in use, or None if its owners are gone."""
    for lock in directory.rglob(".lock"):
        if lock_held(lock):  # probed without taking it: a helper may be starting
            return f"locked by a running process ({lock.relative_to(directory)})"
    for pid_file in directory.rglob("host.pid"):
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if pid != os.getpid() and alive(pid):
            return f"its process {pid} runs"
    prefix = str(directory.resolve()) + os.sep
    for name in open_paths:
        if name.startswith(prefix):
            return f"open by a running process ({name[len(prefix) :]})"
    return None


def _open_paths() -> list[str]:
    """Every file path some process of this machine has open (those we may look at)."""
    paths = []
    proc = Path("/proc")
    if not proc.is_dir():
        return paths
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            fds = list((pid_dir / "fd").iterdir())
        except OSError:  # another user's process, or gone
            continue
        for fd in fds:
            try:
                paths.append(os.readlink(fd))
            except OSError:
                continue
    return paths


def _du(directory: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total
