"""Exactly once for a stream, by batch id: the ledger rule under seeded interleavings.

A sending query writes micro-batches (task attempts that fail and retry,
partitions that arrive twice or late) and commits each only when the
receiving side answers **have**; a receiving query reads offsets and commits
them. Either side crashes at any point and restarts from what it persisted
(the receiving side's ledger, each query's commit log), and the link between
them loses, repeats and reorders messages. At the end the receiving query has
every row of every batch exactly once, in offsets that never went back.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from spark_dilation.transfer.rules.ledger import ReceiverLedger, SinkLedger
from spark_dilation.transfer.rules.pairing import PairingError
from spark_dilation.transfer.rules.states import Batch

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
    disk: str = field(default_factory=lambda: ReceiverLedger().to_json())
    ledger: ReceiverLedger = field(default_factory=ReceiverLedger)
    offset: int = 0  # the receiving query's checkpointed committed offset
    output: dict[int, list[str]] = field(default_factory=dict)  # an idempotent sink, by seq
    offsets: list[int] = field(default_factory=list)
    restart_between_log_and_commit: bool = False

    def persist(self) -> None:
        self.disk = self.ledger.to_json()

    def restart(self) -> None:
        self.ledger = ReceiverLedger.from_json(self.disk)


def play(seed: int) -> tuple[Sender, Receiver]:
    rng = random.Random(seed)
    s, r = Sender(), Receiver()
    link: list[tuple] = []  # messages in flight, either way; lost, repeated, reordered

    for _ in range(20_000):
        if s.logged >= BATCHES and r.offset >= BATCHES and not r.ledger.kept:
            return s, r
        roll = rng.random()
        if roll < 0.01:
            s.restart()
        elif roll < 0.02:
            r.restart()
        elif roll < 0.05 and link:
            link.pop(rng.randrange(len(link)))  # lost
        elif roll < 0.35 and link:
            msg = link[rng.randrange(len(link))] if rng.random() < 0.2 else link.pop(0)
            deliver(msg, s, r, link)
        elif roll < 0.55:
            write_some(rng, s, link)
        elif roll < 0.65:
            # A new pair (a reconnect or a restart of either side): deliver it all again.
            keys, manifests = s.ledger.to_deliver()
            link += [("part", k) for k in keys]
            link += [("manifest", b, a) for b, a in manifests.items()]
        else:
            r.restart_between_log_and_commit = rng.random() < 0.05
            read_some(r)
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
        if r.ledger.arrived(*msg[1]):
            r.persist()  # the partition's file is kept before the ledger says so
    elif msg[0] == "manifest":
        answer = r.ledger.manifest(QUERY, msg[1], msg[2], rows=2 * len(msg[2]))
        r.persist()
        if answer.have:
            link.append(("have", msg[1]))
    elif msg[0] == "have":
        batch = msg[1]
        if s.running == batch:  # the sink's commit(batch) returns; Spark logs it
            s.ledger.have(batch)
            s.logged, s.running = batch + 1, None


def read_some(r: Receiver) -> None:
    """The receiving query: one micro-batch from its checkpointed offset to the latest."""
    # Every offset Spark starts a batch from is committed: what lies below it is freed
    # (a restart between Spark's commit log and the source's commit left it).
    if r.ledger.commit(r.offset):
        r.persist()
    end = r.ledger.next_seq
    r.offsets.append(end)
    if end <= r.offset:
        return
    for staged in r.ledger.between(r.offset, end):
        r.output[staged.seq] = [  # type: ignore[index]
            row for p in sorted(staged.attempts) for row in rows(staged.batch, p)
        ]
    r.offset = end  # Spark's commit log first: a crash before it reads the range again
    if r.restart_between_log_and_commit:
        r.restart()  # then the next commit frees what this one would have
        return
    r.ledger.commit(end)  # then the source's commit(end)
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
    assert all(b.state is Batch.FREED for b in r.ledger.batches.values())


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


def test_another_sending_query_is_refused() -> None:
    ledger = ReceiverLedger()
    ledger.manifest(QUERY, 0, {})
    with pytest.raises(PairingError, match="belongs to sending query q-5f1c, not q-other"):
        ledger.manifest("q-other", 0, {})


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
