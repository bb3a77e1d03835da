"""Starting a stream's sending host (send/streamclient.py): a launch that finds the error
the last host left raises it and leaves nothing behind in the temp folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spark_dilation.errors import TransferError
from spark_dilation.transfer.rules.errors import error_record
from spark_dilation.transfer.send import streamclient


def test_a_launch_that_finds_the_hosts_error_raises_it_and_leaves_no_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host ended (the pairing was revoked) and removed its folder; a second driver
    process of the same application then asks for the host: it raises the host's error
    and removes the folder and lock file it made again (a busy run found them left)."""
    monkeypatch.setattr(streamclient.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    pairing = tmp_path / "pairing"
    pairing.mkdir()
    left = TransferError("the receiver revoked this stream's pairing: rotating keys")
    (pairing / streamclient.HOST_ERROR).write_text(json.dumps(error_record(left)))
    with pytest.raises(TransferError, match="revoked this stream's pairing"):
        streamclient.ensure_host(pairing, {})
    assert not streamclient.stream_host_path(pairing).exists()
    assert not (pairing / streamclient.HOST_ERROR).exists()  # taken: the next start is afresh
