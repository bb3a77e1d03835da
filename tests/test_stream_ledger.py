"""Exactly once for a stream, by batch id: the ledger rule under seeded interleavings.

A sending query writes micro-batches (task attempts that fail and retry) and
commits each only when the receiving side answers **have**; a receiving query
goes through Spark's phases for each micro-batch: its offset log entry, the
planning of the range (the source's ``partitions``, which is the ledger's
``between``), the batch, its commit log entry, then the source's
``commit(end)``. Either side crashes between any two of those steps and
restarts from what the code persists (the receiving side's ledger, on
**have** and on commit; each query's logs). A restarted receiving query on
PySpark 4.0/4.1 plans ``(L, L)`` for its last logged offset before it plans
the batch again. A pair's subchannel is ordered and reliable (Dilation); a
new pair loses what was in flight and the sender delivers everything again.
At the end the receiving query has every row of every batch exactly once, in
offsets that never went back, and the ledger holds nothing of the history.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from spark_dilation.transfer.receive.streamstage import StreamStage
from spark_dilation.transfer.rules.ledger import ReceiverLedger, SinkLedger, StreamResetError
from spark_dilation.transfer.rules.pairing import PairingError

BATCHES, PARTITIONS = 6, 3
QUERY = "q-5f1c"


def rows(batch: int, partition: int) -> list[str]:
    return [f"{batch}/{partition}/{i}" for i in range(2)]


@dataclass
class Sender:
    """The sending query and its sink (a restart loses all but the commit log)."""

    logged: int = 0  # Spark's commit log: batches below this are committed
    ledger: SinkLedger = field(default_factory=lambda: SinkLedger(QUERY))
    attempts: int = 0
    running: int | None = None  # the batch being written

    def restart(self) -> None:
        self.ledger, self.running = SinkLedger(QUERY), None


@dataclass
class Receiver:
    old_pyspark: bool  # 4.0/4.1: a restart plans (L, L) before the batch again
    disk: str = field(default_factory=lambda: ReceiverLedger().to_json())
    ledger: ReceiverLedger = field(default_factory=ReceiverLedger)
    offset: int = 0  # Spark's commit log: the end of the last committed micro-batch
    planned: tuple[int, int] | None = None  # its offset log entry, not yet committed
    output: dict[int, list[str]] = field(default_factory=dict)  # an idempotent sink, by seq
    offsets: list[int] = field(default_factory=list)

    def persist(self) -> None:
        self.disk = self.ledger.to_json()

    def restart(self) -> None:
        self.ledger = ReceiverLedger.from_json(self.disk)
        if self.planned is not None and self.old_pyspark:
            last = self.planned[1]
            assert self.ledger.between(last, last) == []


def play(seed: int) -> tuple[Sender, Receiver]:
    rng = random.Random(seed)
    s, r = Sender(), Receiver(old_pyspark=seed % 2 == 0)
    link: list[tuple] = []  # the pair's subchannel, both ways, in order

    def new_pair() -> None:  # what was in flight is lost; the sender delivers again
        link.clear()
        keys, manifests = s.ledger.to_deliver()
        link.extend(("part", k) for k in keys)
        link.extend(("manifest", b, a) for b, a in manifests.items())

    for _ in range(20_000):
        if s.logged >= BATCHES and r.offset >= BATCHES:
            # Spark commits the source's last range when it plans the next micro-batch
            # (a restart after the commit log left it staged until then).
            r.ledger.commit(r.offset)
            return s, r
        roll = rng.random()
        if roll < 0.01:
            s.restart()
            new_pair()
        elif roll < 0.02:
            r.restart()
            new_pair()
        elif roll < 0.04:
            new_pair()  # a reconnect
        elif roll < 0.35 and link:
            deliver(link.pop(0), s, r, link)
        elif roll < 0.55:
            write_some(rng, s, link)
        else:
            read_some(rng, r)
        for staged in r.ledger.by_seq.values():  # what is staged and not freed is kept
            assert all((staged.batch, p, a) in r.ledger.kept for p, a in staged.attempts.items())
    raise AssertionError(f"seed {seed}: not done: sender {s.logged}, receiver {r.offset}")


def write_some(rng: random.Random, s: Sender, link: list[tuple]) -> None:
    """The sending query: run the next batch's tasks (some fail), then commit it; the
    commit waits for "have" (a restart runs the first batch not in its log again)."""
    if s.logged >= BATCHES or s.running is not None:
        return
    batch, won = s.logged, {}
    s.running = batch
    for p in range(PARTITIONS):
        while True:
            s.attempts += 1
            attempt = f"a{s.attempts}"
            key = (batch, p, attempt)
            if rng.random() < 0.3:  # a task attempt that fails: its data may have gone out
                if rng.random() < 0.5:
                    link.append(("part", key))
                continue
            s.ledger.wrote(key, rows(batch, p))
            link.append(("part", key))
            won[p] = attempt
            break
    s.ledger.committed(batch, won)
    link.append(("manifest", batch, won))


def deliver(msg: tuple, s: Sender, r: Receiver, link: list[tuple]) -> None:
    if msg[0] == "part":
        r.ledger.arrived(*msg[1])  # kept on disk; the ledger is written on have
    elif msg[0] == "manifest":
        answer = r.ledger.manifest(QUERY, msg[1], msg[2], rows=2 * len(msg[2]))
        if answer.have:
            r.persist()
            link.append(("have", msg[1]))
        else:
            link.append(("missing", msg[1], answer.missing))
    elif msg[0] == "missing":  # the sender sends those partitions again, then the manifest
        batch, attempts = msg[1], s.ledger.manifests.get(msg[1])
        if attempts is not None:
            link.extend(("part", (batch, p, attempts[p])) for p in msg[2])
            link.append(("manifest", batch, attempts))
    elif msg[0] == "have":
        batch = msg[1]
        if s.running == batch:  # the sink's commit(batch) returns; Spark logs it
            s.ledger.have(batch)
            s.logged, s.running = batch + 1, None


def read_some(rng: random.Random, r: Receiver) -> None:
    """The receiving query, one phase of its next micro-batch; it may crash after any."""
    if r.planned is None:
        end = r.ledger.end_within(r.offset, max_rows=rng.choice([None, 2, 6]))
        if end <= r.offset:
            return
        r.planned = (r.offset, end)  # the offset log entry
        r.offsets.append(end)
        if rng.random() < 0.1:
            return r.restart()
    start, end = r.planned
    for staged in r.ledger.between(start, end):  # planning: the source's partitions()
        r.output[staged.seq] = [  # type: ignore[index]
            row for p in sorted(staged.attempts) for row in rows(staged.batch, p)
        ]
    if rng.random() < 0.1:
        return r.restart()  # after the batch, before its commit log: it runs again
    r.offset, r.planned = end, None  # the commit log entry
    if rng.random() < 0.1:
        return r.restart()  # before the source's commit: the next commit frees it
    r.ledger.commit(end)  # the source's commit(end)
    r.persist()


@pytest.mark.parametrize("seed", range(150))
def test_every_row_exactly_once_whatever_crashes_and_the_link_do(seed: int) -> None:
    _, r = play(seed)
    got = [row for seq in sorted(r.output) for row in r.output[seq]]
    want = [row for b in range(BATCHES) for p in range(PARTITIONS) for row in rows(b, p)]
    assert sorted(got) == sorted(want) and len(got) == len(want)
    assert r.offsets == sorted(r.offsets), "an offset went back"
    assert sorted(r.output) == list(range(BATCHES))  # one sequence number per batch
    assert not r.ledger.kept  # everything consumed was freed
    assert not r.ledger.batches and not r.ledger.by_seq  # and forgotten
    assert r.ledger.top == BATCHES - 1


def test_planning_an_empty_range_or_a_range_again_frees_nothing() -> None:
    """PySpark 4.0/4.1 on restart: partitions(L, L), then the batch's range again."""
    ledger = staged_ledger([5, 5, 5])
    ledger.commit(1)
    assert ledger.between(3, 3) == [] and ledger.between(1, 1) == []
    assert [b.batch for b in ledger.between(1, 3)] == [1, 2]
    assert [b.batch for b in ledger.between(1, 3)] == [1, 2]  # planned again: the same
    assert ledger.freed_below == 1 and len(ledger.batches) == 2


def test_a_rerun_of_a_staged_batch_is_dropped_whole() -> None:
    ledger = ReceiverLedger()
    assert ledger.arrived(0, 0, "a1") and ledger.manifest(QUERY, 0, {0: "a1"}).have
    assert not ledger.arrived(0, 0, "a7")  # the sending query restarted and ran batch 0 again
    answer = ledger.manifest(QUERY, 0, {0: "a7"})
    assert answer.have and answer.seq == 0 and ledger.next_seq == 1
    assert ledger.batches[0].attempts == {0: "a1"}


def test_a_manifest_waits_for_the_attempts_it_names_and_drops_the_others() -> None:
    ledger = ReceiverLedger()
    ledger.arrived(3, 0, "a1")
    ledger.arrived(3, 0, "a2")
    answer = ledger.manifest(QUERY, 3, {0: "a2", 1: "a3"})
    assert not answer.have and answer.missing == (1,)
    ledger.arrived(3, 1, "a3")
    assert ledger.manifest(QUERY, 3, {0: "a2", 1: "a3"}).have
    assert ledger.kept == {(3, 0, "a2"), (3, 1, "a3")}
    assert ledger.commit(1) == [(3, 0, "a2"), (3, 1, "a3")] and not ledger.kept


def test_a_reset_sending_checkpoint_is_refused_never_taken_for_a_rerun() -> None:
    ledger = ReceiverLedger()
    for batch in range(3):
        ledger.manifest(QUERY, batch, {})
    ledger.commit(3)
    # The checkpoint deleted and made again: Spark gives the query a new id.
    with pytest.raises(StreamResetError, match=r"checkpoint at /ck/s was reset.*q-other.*q-5f1c"):
        ledger.manifest("q-other", 0, {}, checkpoint="/ck/s")
    # The same query's batch ids gone back (a checkpoint restored from a copy).
    with pytest.raises(StreamResetError, match="micro-batch 1 after micro-batch 2"):
        ledger.manifest(QUERY, 1, {})
    # Its last batch again is a re-run: have, with its sequence number, nothing staged.
    assert ledger.manifest(QUERY, 2, {0: "9"}) == ledger.manifest(QUERY, 2, {})
    assert ledger.manifest(QUERY, 2, {}).seq == 2 and ledger.next_seq == 3
    assert not ledger.arrived(1, 0, "a9") and not ledger.arrived(2, 0, "a9")


def test_the_ledger_does_not_grow_with_the_history(tmp_path: Path) -> None:
    """Its file and the time of its durable write after 10,000 batches, as after 100."""

    def run(batches: int) -> tuple[int, float]:
        ledger = ReceiverLedger()
        for batch in range(batches):
            for p in range(200):
                ledger.arrived(batch, p, "0")
            ledger.manifest(QUERY, batch, {p: "0" for p in range(200)}, 400, 4)
            ledger.commit(ledger.next_seq)  # the receiving query keeps up
        stage = StreamStage(tmp_path / str(batches))
        stage.ledger = ledger
        t0 = time.perf_counter()
        stage._persist()  # what each batch's have and commit write
        return (stage.dir / "ledger.json").stat().st_size, time.perf_counter() - t0

    small, _ = run(100)
    large, _ = run(10_000)
    assert large <= small + 8, (small, large)  # only the numbers' digits grow


def test_offsets_the_ledger_freed_or_never_staged_are_refused() -> None:
    ledger = ReceiverLedger()
    ledger.manifest(QUERY, 0, {})
    ledger.commit(1)
    with pytest.raises(PairingError, match="committed by the receiving query and freed"):
        ledger.between(0, 1)
    with pytest.raises(PairingError, match="never staged"):
        ledger.between(1, 3)


def staged_ledger(sizes: list[int]) -> ReceiverLedger:
    ledger = ReceiverLedger()
    for batch, rows_ in enumerate(sizes):
        ledger.manifest(QUERY, batch, {}, rows=rows_, nbytes=10 * rows_)
    return ledger


def test_admission_control_reads_whole_batches_and_always_moves() -> None:
    ledger = staged_ledger([100, 100, 500, 100])
    assert ledger.end_within(0) == 4  # no limit: everything staged
    assert ledger.end_within(0, max_rows=250) == 2
    assert ledger.end_within(2, max_rows=250) == 3  # one batch over the limit still moves
    assert ledger.end_within(0, max_bytes=1000) == 1
    assert ledger.end_within(1, max_rows=10_000, max_bytes=6000) == 3
    assert ledger.end_within(4, max_rows=1) == 4  # nothing staged: nothing to read
    assert ledger.lag(1) == {"batches": 3, "rows": 700, "bytes": 7000}
    assert ReceiverLedger.from_json(ledger.to_json()).lag(1) == ledger.lag(1)
