"""The PGP word list, code completion and code validation, against magic-wormhole 0.24."""

from __future__ import annotations

import itertools

import pytest
from wormhole import _wordlist as ref_wordlist
from wormhole._code import validate_code as ref_validate_code
from wormhole.errors import KeyFormatError

from spark_dilation.errors import CodeFormatError
from spark_dilation.wormhole.codes import (
    make_code,
    normalize_code,
    validate_code,
    validate_nameplate,
)
from spark_dilation.wormhole.wordlist import (
    EVEN_WORDS,
    ODD_WORDS,
    choose_words,
    code_completions,
    word_completions,
)


def counting_randbyte(start: int = 0):
    """A deterministic randbyte: start, start+1, ... (mod 256)."""
    counter = itertools.count(start)
    return lambda: next(counter) % 256


# --- the tables -------------------------------------------------------------


def test_tables_have_256_unique_lowercase_words() -> None:
    for table in (EVEN_WORDS, ODD_WORDS):
        assert isinstance(table, tuple)
        assert len(table) == 256
        assert len(set(table)) == 256
        assert all(word == word.lower() and word.isalpha() for word in table)


def test_tables_are_disjoint() -> None:
    assert not set(EVEN_WORDS) & set(ODD_WORDS)


def test_tables_match_reference() -> None:
    for value in range(256):
        even, odd = ref_wordlist.raw_words[f"{value:02X}"]
        assert EVEN_WORDS[value] == even.lower()
        assert ODD_WORDS[value] == odd.lower()
    assert len(ref_wordlist.raw_words) == 256


def test_known_words() -> None:
    assert (EVEN_WORDS[0], ODD_WORDS[0]) == ("aardvark", "adroitness")
    assert (EVEN_WORDS[255], ODD_WORDS[255]) == ("zulu", "yucatan")


# --- choose_words -------------------------------------------------------------


def test_choose_words_alternates_starting_with_odd() -> None:
    words = choose_words(5, counting_randbyte(0)).split("-")
    assert words == [ODD_WORDS[0], EVEN_WORDS[1], ODD_WORDS[2], EVEN_WORDS[3], ODD_WORDS[4]]


def test_choose_words_is_deterministic_with_fixed_randbyte() -> None:
    assert choose_words(2, counting_randbyte(7)) == choose_words(2, counting_randbyte(7))
    assert choose_words(2, lambda: 0) == "adroitness-aardvark"
    assert choose_words(3, lambda: 255) == "yucatan-zulu-yucatan"


def test_choose_words_default_is_random_and_well_formed() -> None:
    for length in (1, 2, 3, 4):
        words = choose_words(length).split("-")
        assert len(words) == length
        for i, word in enumerate(words):
            assert word in (ODD_WORDS if i % 2 == 0 else EVEN_WORDS)
    assert len({choose_words(4) for _ in range(20)}) > 1


def test_choose_words_zero_length_is_empty_like_reference() -> None:
    assert choose_words(0) == ref_wordlist.PGPWordList().choose_words(0) == ""


def test_choose_words_rejects_non_byte() -> None:
    with pytest.raises(ValueError):
        choose_words(1, lambda: 256)
    with pytest.raises(ValueError):
        choose_words(1, lambda: -1)


# --- completions --------------------------------------------------------------

PREFIXES_2 = [
    "",
    "a",
    "aard",
    "aardvark",
    "absurd",
    "absurd-",
    "absurd-ad",
    "absurd-aardvark",
    "adroitness-",
    "adroitness-a",
    "adroitness-aardvark-",
    "guitarist-rev",
    "z",
    "y",
    "nosuchword",
    "absurd-zzz",
]
PREFIXES_3 = [
    *PREFIXES_2,
    "adroitness-aardvark-",
    "adroitness-aardvark-a",
    "adroitness-aardvark-adroitness",
    "guitarist-revenge-s",
]


@pytest.mark.parametrize("prefix", PREFIXES_2)
def test_word_completions_match_reference(prefix: str) -> None:
    assert word_completions(prefix) == ref_wordlist.PGPWordList().get_completions(prefix)


@pytest.mark.parametrize("prefix", PREFIXES_3)
def test_word_completions_three_words_match_reference(prefix: str) -> None:
    expected = ref_wordlist.PGPWordList().get_completions(prefix, num_words=3)
    assert word_completions(prefix, num_words=3) == expected


def test_word_completions_examples() -> None:
    assert word_completions("aard") == set()  # aardvark is an even word, not first
    assert word_completions("adroit") == {"adroitness-"}
    assert word_completions("absurd-aard") == {"absurd-aardvark"}
    assert word_completions("a", num_words=1) == {w for w in ODD_WORDS if w.startswith("a")}
    assert len(word_completions("")) == 256
    assert all(c.endswith("-") for c in word_completions(""))


def test_code_completions_nameplates() -> None:
    nameplates = ["7", "12", "123", "4"]
    assert code_completions("", nameplates) == ["12-", "123-", "4-", "7-"]
    assert code_completions("1", nameplates) == ["12-", "123-"]
    assert code_completions("123", nameplates) == ["123-"]
    assert code_completions("9", nameplates) == []
    assert code_completions("") == []


def test_code_completions_words() -> None:
    assert code_completions("7-guitarist-rev") == ["7-guitarist-revenge"]
    assert code_completions("7-adroit", ["7"]) == ["7-adroitness-"]
    assert code_completions("7-adroit", num_words=1) == ["7-adroitness"]
    expected = sorted("7-" + c for c in ref_wordlist.PGPWordList().get_completions("a"))
    assert code_completions("7-a") == expected
    assert code_completions("7-") == sorted(f"7-{w}-" for w in ODD_WORDS)


def test_code_completions_three_words() -> None:
    assert code_completions("7-guitarist-revenge-s", num_words=3) == sorted(
        f"7-guitarist-revenge-{w}" for w in ODD_WORDS if w.startswith("s")
    )
    assert code_completions("7-guitarist-revenge-s", num_words=2) == []


def test_code_completions_stop_after_num_words() -> None:
    assert code_completions("7-guitarist-revenge-") == []
    assert code_completions("7-guitarist-revenge-a") == []
    assert code_completions("7-a-b-c-", num_words=3) == []


# --- validation -----------------------------------------------------------------


@pytest.mark.parametrize("code", ["", "abc-def", "7 guitarist revenge", "-foo", "x7-foo"])
def test_validate_code_rejects(code: str) -> None:
    with pytest.raises(CodeFormatError) as info:
        validate_code(code)
    assert "7-guitarist-revenge" in str(info.value)
    assert isinstance(info.value, ValueError)


def test_validate_code_messages_say_what_is_wrong() -> None:
    with pytest.raises(CodeFormatError, match="empty"):
        validate_code("")
    with pytest.raises(CodeFormatError, match="spaces"):
        validate_code("7 guitarist revenge")
    with pytest.raises(CodeFormatError, match="must start with a number"):
        validate_code("abc-def")


@pytest.mark.parametrize(
    ("code", "nameplate"),
    [("7-guitarist-revenge", "7"), ("123-a-b-c", "123"), ("7-", "7"), ("7", "7"), ("0-x", "0")],
)
def test_validate_code_accepts_and_returns_nameplate(code: str, nameplate: str) -> None:
    assert validate_code(code) == nameplate


CODES = [
    "",
    " ",
    "7",
    "7-",
    "7-guitarist-revenge",
    "07-guitarist",
    "abc-def",
    "7 guitarist revenge",
    "7-guitarist revenge",
    "-foo",
    "x7-foo",
    "7x-foo",
    "7.5-foo",
    "+7-foo",
    "7--foo",
    "7\t-foo",
    "7\n-foo",  # accepted: the reference's "$" matches before a final newline
    "\u0667-foo",  # ARABIC-INDIC DIGIT SEVEN: \d matches it, as in the reference
]


@pytest.mark.parametrize("code", CODES)
def test_validate_code_agrees_with_reference(code: str) -> None:
    try:
        ref_validate_code(code)
    except KeyFormatError:
        with pytest.raises(CodeFormatError):
            validate_code(code)
    else:
        assert validate_code(code) == code.split("-", 1)[0]


def test_validate_nameplate() -> None:
    validate_nameplate("7")
    validate_nameplate("1234")
    for bad in ("", "abc", "7a", " 7", "7 ", "-7", "7-"):
        with pytest.raises(CodeFormatError, match="7-guitarist-revenge"):
            validate_nameplate(bad)


# --- make_code / normalize_code ---------------------------------------------------


def test_make_code() -> None:
    assert make_code("7", randbyte=lambda: 0) == "7-adroitness-aardvark"
    assert make_code("42", 3, counting_randbyte(0)) == "42-adroitness-absurd-aftermath"
    code = make_code("5")
    assert validate_code(code) == "5"
    assert len(code.split("-")) == 3


def test_make_code_rejects_bad_input() -> None:
    with pytest.raises(CodeFormatError):
        make_code("abc")
    with pytest.raises(ValueError):
        make_code("7", 0)


def test_normalize_code() -> None:
    assert normalize_code("  7-guitarist-revenge\n") == "7-guitarist-revenge"
    assert normalize_code("7-guitarist-revenge") == "7-guitarist-revenge"
    assert normalize_code("7 guitarist") == "7 guitarist"
