"""Wormhole codes: validation, normalization and creation.

A code is a numeric nameplate and words joined by hyphens, like
``7-guitarist-revenge``. The rules match magic-wormhole 0.24
(``wormhole._code.validate_code`` and ``wormhole._nameplate.validate_nameplate``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from spark_dilation.errors import CodeFormatError
from spark_dilation.wormhole.wordlist import choose_words

__all__ = ["EXAMPLE_CODE", "make_code", "normalize_code", "validate_code", "validate_nameplate"]

EXAMPLE_CODE = "7-guitarist-revenge"

# Exactly the reference's test (re.search with ^ and $).
_NAMEPLATE_RE = re.compile(r"^\d+$")


def validate_nameplate(nameplate: str) -> None:
    """Raise CodeFormatError unless ``nameplate`` is all digits (like the 7 of a code)."""
    if not _NAMEPLATE_RE.search(nameplate):
        raise CodeFormatError(
            f"the code number {nameplate!r} must be numeric, with no spaces: "
            f"it is the 7 in a code like {EXAMPLE_CODE}"
        )


def validate_code(code: str) -> str:
    """Check a whole code the way the reference does, and return its nameplate.

    Raises CodeFormatError with a message for the user when ``code`` is empty,
    contains spaces or does not start with a numeric nameplate.
    """
    if not code:
        raise CodeFormatError(
            f"the code is empty: type the code the sender shows, like {EXAMPLE_CODE}"
        )
    if " " in code:
        raise CodeFormatError(
            f"the code {code!r} contains spaces: join the number and the words with "
            f"hyphens, like {EXAMPLE_CODE}"
        )
    nameplate = code.split("-", 1)[0]
    if not _NAMEPLATE_RE.search(nameplate):
        raise CodeFormatError(
            f"the code {code!r} must start with a number and a hyphen, like {EXAMPLE_CODE}"
        )
    return nameplate


def make_code(nameplate: str, length: int = 2, randbyte: Callable[[], int] | None = None) -> str:
    """Return a new code: ``nameplate`` plus ``length`` random PGP words.

    ``randbyte`` is passed to :func:`choose_words` (for deterministic tests).
    """
    validate_nameplate(nameplate)
    if length < 1:
        raise ValueError(f"a code needs at least one word, not length={length}")
    return f"{nameplate}-{choose_words(length, randbyte)}"


def normalize_code(code: str) -> str:
    """Strip surrounding whitespace from a typed code (NFC is the core's job)."""
    return code.strip()
