"""conf/options.md documents every option, where it applies, and its default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from spark_dilation.spark.datasource import WRITE_OPTIONS
from spark_dilation.spark.options import KNOWN_OPTIONS
from spark_dilation.transfer.rules.options import TransferOptions

CONF = Path(__file__).resolve().parent.parent / "conf"
NAME = re.compile(r"^`(\w+)`$")
COLUMNS = ("name", "read", "write", "python", "default", "meaning")


def documented() -> dict[str, dict[str, str]]:
    rows = {}
    for line in (CONF / "options.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(COLUMNS) or not NAME.match(cells[0]):
            continue
        row = dict(zip(COLUMNS, cells, strict=True))
        row["name"] = NAME.match(cells[0])[1].lower()  # Spark lower-cases option keys
        assert row["name"] not in rows, f"{row['name']} is documented twice"
        assert {row["read"], row["write"], row["python"]} <= {"yes", "no"}, line
        rows[row["name"]] = row
    return rows


def where(column: str) -> set[str]:
    return {name for name, row in documented().items() if row[column] == "yes"}


def test_every_option_is_documented_where_it_applies():
    python = {*TransferOptions.names(), "code"}
    assert set(documented()) == {*KNOWN_OPTIONS, *WRITE_OPTIONS, *python}
    assert where("read") == set(KNOWN_OPTIONS)
    assert where("write") == set(WRITE_OPTIONS)
    assert where("python") == python


STREAM_COLUMNS = ("name", "readStream", "writeStream", "default", "meaning")


def test_every_stream_option_is_documented_where_it_applies():
    from spark_dilation.spark.stream import STREAM_WRITE_OPTIONS, TRANSFER_STREAM_OPTIONS

    text = (CONF / "options.md").read_text().split("## Streams", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(STREAM_COLUMNS) and NAME.match(cells[0]):
            rows[NAME.match(cells[0])[1].lower()] = dict(zip(STREAM_COLUMNS, cells, strict=True))
    read = {n for n, r in rows.items() if r["readStream"] == "yes"}
    write = {n for n, r in rows.items() if r["writeStream"] == "yes"}
    from spark_dilation.spark.options import STREAM_READ_OPTIONS

    assert read == {"code", "path", *STREAM_READ_OPTIONS, *TRANSFER_STREAM_OPTIONS}
    assert write == {*STREAM_WRITE_OPTIONS, *TRANSFER_STREAM_OPTIONS}
    for name in TRANSFER_STREAM_OPTIONS:
        default = getattr(TransferOptions(), name)
        if default is not None:
            assert rows[name]["default"] == f"`{default}`", name


def test_the_documented_defaults_are_the_code_defaults():
    rows = documented()
    for field in dataclasses.fields(TransferOptions):
        if field.default is None or field.metadata.get("internal"):
            continue  # mailbox, relay, staging_dir: described, not a literal
        expected = '`""`' if field.default == "" else f"`{field.default}`"
        assert rows[field.name]["default"].strip() == expected, field.name


def test_the_spark_defaults_example_names_real_settings():
    text = (CONF / "spark-defaults.conf.example").read_text()
    settings = [line.split()[0] for line in text.splitlines() if line and line[0] != "#"]
    assert "spark.sql.session.timeZone" in settings
    assert all(s.startswith("spark.") for s in settings)
    assert "PYSPARK_PYTHON" in text and "SPARK_DILATION_MAILBOX" in text


# --- the command line -----------------------------------------------------------------------

CLI_COLUMNS = ("flag", "commands", "default", "meaning")
FLAG = re.compile(r"^`(--[\w-]+)`$")


def documented_flags() -> dict[str, dict[str, str]]:
    text = (CONF / "options.md").read_text().split("## Command line", 1)[1]
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != len(CLI_COLUMNS) or not FLAG.match(cells[0]):
            continue
        row = dict(zip(CLI_COLUMNS, cells, strict=True))
        assert FLAG.match(cells[0])[1] not in rows, line
        rows[FLAG.match(cells[0])[1]] = row
    return rows


def parser_flags() -> dict[str, dict[str, object]]:
    """{--flag: {command: its default}} for every visible option of every command."""
    import argparse

    from spark_dilation import cli

    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    flags: dict[str, dict[str, object]] = {}
    for command, subparser in sub.choices.items():
        positional = ["PAIRING"] if command == "revoke" else []  # its one required argument
        parsed = vars(parser.parse_args([command, *positional]))
        for action in subparser._actions:
            longs = [o for o in action.option_strings if o.startswith("--")]
            if not longs or action.help == argparse.SUPPRESS or longs[0] == "--help":
                continue
            flags.setdefault(longs[0], {})[command] = parsed[action.dest]
    return flags


def test_every_cli_flag_is_documented_with_the_parser_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from spark_dilation.cli import DEFAULT_RELAY_URL, MAILBOX_ENV, RELAY_ENV
    from spark_dilation.wormhole import DEFAULT_MAILBOX_URL

    monkeypatch.delenv(MAILBOX_ENV, raising=False)
    monkeypatch.delenv(RELAY_ENV, raising=False)
    rows = documented_flags()
    flags = parser_flags()
    assert set(rows) == set(flags)
    env_defaults = {
        "--mailbox": (MAILBOX_ENV, DEFAULT_MAILBOX_URL),
        "--relay": (RELAY_ENV, DEFAULT_RELAY_URL),
    }
    for flag, by_command in flags.items():
        row = rows[flag]
        commands = {c.strip() for c in row["commands"].split(",")}
        if commands == {"all"}:
            commands = set(by_command)
        assert commands <= set(by_command), (flag, commands)
        defaults = {by_command[c] for c in commands}
        assert len(defaults) == 1, (flag, defaults)
        default = defaults.pop()
        if flag in env_defaults:
            env, url = env_defaults[flag]
            expected = f"`${env}`, else `{url}`"
        elif default is False:
            expected = "off"
        elif default is None:
            continue  # described (a computed folder name, "wait"), not a literal
        else:
            expected = f"`{default}`"
        assert row["default"] == expected, flag


def test_cli_dataset_transfers_use_the_documented_option_defaults() -> None:
    from spark_dilation import cli

    rows = documented()
    for argv in (["send", "f"], ["receive"]):
        opts = cli._transfer_options(cli.build_parser().parse_args(argv))
        for field in dataclasses.fields(TransferOptions):
            if field.metadata.get("internal"):
                continue  # not an option: how errors spell option names
            if field.name in ("peer_timeout", "lane_start_timeout", "mailbox", "relay"):
                continue  # --timeout (default: wait), --mailbox and --relay
            value = getattr(opts, field.name)
            if field.default is None:
                assert value is None, field.name
                continue
            expected = '`""`' if value == "" else f"`{value}`"
            assert rows[field.name]["default"] == expected, field.name


def test_transfer_connections_give_up_after_the_options_reconnect_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lanes and senders dilate with reconnect_timeout, not Dilation's own default (300 s)."""
    import spark_dilation.dilation.api as dilation_api
    from spark_dilation.transfer.meet.rendezvous import Paired, dilate_paired
    from spark_dilation.transfer.rules.directory import Door
    from spark_dilation.wormhole.blocking import ensure_reactor

    ensure_reactor()
    seen: dict[str, object] = {}

    def fake_dilate(wormhole: object, **kwargs: object) -> object:
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(dilation_api, "dilate", fake_dilate)
    timeout = TransferOptions().reconnect_timeout
    with pytest.raises(RuntimeError, match="stop here"):
        dilate_paired(
            Paired(object(), Door(0, 0, 0, 0)),
            relay_url=None,
            no_listen=True,
            listen=(),
            peer_timeout=timeout,
            timeout=10,
            no_path_timeout=TransferOptions().no_path_timeout,
        )
    assert seen["reconnect_timeout"] == timeout == 120.0
