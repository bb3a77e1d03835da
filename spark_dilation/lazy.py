"""Package names that load their module on first use (PEP 562).

Spark starts many short-lived Python workers; each skips every module it
does not touch (Twisted, ``pyarrow.dataset``), so packages export lazily.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


def exports(
    package: str, table: Mapping[str, str], before: Callable[[str], None] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__``: ``table`` maps each name to its (relative) module.

    ``before(module)`` runs before a module is imported (a check that names a
    missing dependency in one line).
    """

    def __getattr__(name: str) -> Any:
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if before is not None:
            before(module)
        return getattr(import_module(module, package), name)

    return __getattr__
