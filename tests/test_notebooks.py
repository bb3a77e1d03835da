"""The example notebooks run: a sender kernel and a receiver kernel at the same time."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import nbformat
import pyarrow.parquet as pq
import pytest
from nbclient import NotebookClient

from spark_dilation.notebook import make_up_code

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def with_cell(name: str, source: str) -> nbformat.NotebookNode:
    """The notebook as shipped, plus one cell of the test's own at the end."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(source))
    return nb


def outputs_text(nb: nbformat.NotebookNode) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text", ""))
            for value in out.get("data", {}).values():
                parts.append(value if isinstance(value, str) else "")
    return "\n".join(parts)


def test_the_sender_and_receiver_notebooks_move_a_dataframe(
    tmp_path, monkeypatch, mailbox_url, relay_url
):
    code = make_up_code()
    # The kernels inherit this environment: the embedded servers and one code for both.
    monkeypatch.setenv("SPARK_DILATION_MAILBOX", mailbox_url)
    monkeypatch.setenv("SPARK_DILATION_RELAY", relay_url)
    monkeypatch.setenv("SPARK_DILATION_CODE", code)
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    monkeypatch.delenv("SPARK_MASTER", raising=False)
    sent, received = tmp_path / "sent.parquet", tmp_path / "received.parquet"
    sender = with_cell(
        "send_a_dataset.ipynb",
        f"import pyarrow.parquet as pq\npq.write_table(df.toArrow(), {str(sent)!r})",
    )
    receiver = with_cell(
        "receive_a_dataset.ipynb",
        f"import pyarrow.parquet as pq\npq.write_table(table, {str(received)!r})",
    )
    errors: dict[str, BaseException] = {}

    def run(name: str, nb: nbformat.NotebookNode) -> None:
        try:
            NotebookClient(
                nb, timeout=400, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
            ).execute()
        except BaseException as e:
            errors[name] = e

    threads = [
        threading.Thread(target=run, args=("sender", sender)),
        threading.Thread(target=run, args=("receiver", receiver)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors

    expected, got = pq.read_table(sent), pq.read_table(received)
    assert got.num_rows == expected.num_rows == 50_000
    assert got.schema.names == ["id", "shop", "amount", "customer"]
    key = [("id", "ascending")]
    assert got.sort_by(key).to_pylist() == expected.sort_by(key).to_pylist()
    # What the notebooks show: the code and the handle's progress, the received rows.
    shown = outputs_text(sender)
    assert f"tell the receiver: {code}" in shown
    assert f"<code>{code}</code>" in shown
    assert "done" in shown
    assert "50,000 rows" in outputs_text(receiver)


@pytest.mark.timeout(600)
@pytest.mark.alone  # after the suite: see "alone" in pyproject.toml
def test_the_stream_notebook_streams_restarts_and_revokes(
    tmp_path, monkeypatch, mailbox_url, relay_url
):
    monkeypatch.setenv("SPARK_DILATION_MAILBOX", mailbox_url)
    monkeypatch.setenv("SPARK_DILATION_RELAY", relay_url)
    monkeypatch.setenv("PYSPARK_PYTHON", sys.executable)
    monkeypatch.setenv("SPARK_LOCAL_IP", "127.0.0.1")
    monkeypatch.delenv("SPARK_MASTER", raising=False)
    monkeypatch.setenv("SPARK_DILATION_CODE", make_up_code())
    monkeypatch.setenv("STREAM_DEMO_DIR", str(tmp_path / "demo"))
    nb = with_cell(
        "stream_between_clusters.ipynb",
        # Every sent micro-batch once, none lost: the rate source's ids, 0 to the last.
        "ids = df.agg({'id': 'min'}).first()[0], df.agg({'id': 'max'}).first()[0]\n"
        "assert ids[0] == 0 and ids[1] + 1 == df.count() == df.select('id').distinct().count()\n"
        "assert df.count() >= 10000\n"
        "from spark_dilation.transfer.meet.record import load_record\n"
        "r = load_record(f'{work}/receiver-pairing/pairing.json')\n"
        "print('receiver runs:', r.incarnation, 'revoked:', r.revoked)",
    )
    NotebookClient(
        nb, timeout=400, kernel_name="python3", resources={"metadata": {"path": tmp_path}}
    ).execute()
    shown = outputs_text(nb)
    assert "tell the receiver:" in shown
    assert "rows received after the restart" in shown
    assert "receiver runs: 2 revoked: demo over" in shown
    assert "confirmed by the mailbox server: True" in shown
