"""A deterministic harness: ``WormholeCore`` clients against the real mailbox server code.

What is real:

* the server: ``wormhole_mailbox_server`` 0.8's ``Server`` (``make_server``)
  on an in-memory channel database (``database.create_channel_db(":memory:")``),
  and one real ``server_websocket.WebSocketServer`` protocol object per client
  connection, whose ``onOpen`` / ``onMessage(payload, False)`` / ``onClose``
  run unchanged (bind, claim, crowded tests, release, open, add, close...);
* the clients: ``spark_dilation.wormhole.core.WormholeCore``, fed exactly as
  the Twisted adapter feeds it.

What is faked:

* the network. No sockets, no reactor, no autobahn handshake: each protocol
  object gets a stand-in factory (``_server`` and ``reactor``), a fixed peer
  address, and a ``sendMessage`` that queues the frame for its client. Frames
  wait in two FIFO queues per client (client->server, server->client), so
  each direction keeps WebSocket order; the *router* decides which queue
  delivers next (``step``): FIFO over all queues (``run_until_quiet``) or a
  seeded ``random.Random`` (``run_random``). ``hold(client)`` keeps both of a
  client's queues from delivering until ``release(client)``.
* time. The server reads ``time.time()`` for its timestamps (``server_rx``
  orders the messages replayed on ``open``; mailbox ``updated`` drives
  pruning). While the harness calls into the server, the ``time`` module the
  websocket code sees is replaced by ``Harness.clock`` (a
  ``twisted.internet.task.Clock``), which advances by ``tick`` seconds per
  delivered frame: timestamps are deterministic and strictly increasing.
* randomness on the server: nameplate allocation uses ``Harness.rng`` (seeded)
  and mailbox ids are ``mb1``, ``mb2``, ... The PAKE itself stays random; it
  does not change which frames flow.

Faults (``Harness(faults=Faults(...))``, seeded): after any delivered frame
the router may drop a random live connection (frames in flight are lost, at
whatever point of the exchange: before the claim lands, between claim and
PAKE, after it); a dropped client connects again as a router action of its
own (the Twisted adapter's reconnect), and each try may be refused (the
next N, or with a probability); the server may restart at a given step,
with or without its database. ``Faults.log`` names each fault injected.

A ``StopConnection`` from a core closes that client's connection (server
``onClose``), as the Twisted adapter does. An exception raised by the server
code propagates out of ``step`` (autobahn would log it and drop the
connection; a test wants to see it).
"""

from __future__ import annotations

import itertools
import json
import random
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twisted.internet import task
from wormhole_mailbox_server import database, server, server_websocket

from spark_dilation.wormhole import core
from spark_dilation.wormhole.messages import encode_client_message

APPID = "spark-dilation.test/harness"

UP = "up"  # client -> server
DOWN = "down"  # server -> client
CONNECT = "connect"  # a dropped client's next connection try (with Faults)


@dataclass
class Faults:
    """Seeded faults the router injects (see the module docstring)."""

    seed: int = 0
    drop: float = 0.0  # after each delivered frame, the chance one live connection drops
    refuse: float = 0.0  # the chance each connection try is refused
    refuse_next: int = 0  # the next N connection tries are refused
    restart_at: int | None = None  # the server restarts after this many delivered frames
    keep_db: bool = True  # ... with its database (False: an empty one, as ``:memory:``)
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)


class Client:
    """One ``WormholeCore`` and its (fake) WebSocket to the harness's server.

    ``events`` records every event the core returned except ``SendFrame``;
    ``sent`` / ``received`` record the frames (decoded) once delivered.
    App calls go through ``call`` (or the shortcuts) so their frames are queued.
    A *raw* client (``core`` None, see ``Harness.raw_client``) has no core:
    the test writes its frames with ``send_raw`` and reads ``received``.
    """

    def __init__(self, harness: Harness, name: str, core_: core.WormholeCore | None) -> None:
        self.harness = harness
        self.name = name
        self.core = core_
        self.events: list[core.Event] = []
        self.sent: list[dict[str, Any]] = []  # client -> server, as delivered
        self.received: list[dict[str, Any]] = []  # server -> client, as delivered
        self.up: deque[tuple[int, bytes]] = deque()  # (sequence number, payload)
        self.down: deque[tuple[int, bytes]] = deque()
        self.proto: server_websocket.WebSocketServer | None = None
        self.connections = 0
        self.lost_at = 0  # the sequence number when its connection was last lost

    def __repr__(self) -> str:
        return f"<Client {self.name}>"

    @property
    def connected(self) -> bool:
        return self.proto is not None

    # --- app calls -------------------------------------------------------------

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[core.Event]:
        """Call ``core.<method>(*args, **kwargs)`` and route what it returns."""
        events = getattr(self.core, method)(*args, **kwargs)
        self.feed(events)
        return events

    def set_code(self, code: str) -> None:
        self.call("set_code", code)

    def allocate_code(self, length: int = 2) -> None:
        self.call("allocate_code", length)

    def send_message(self, plaintext: bytes) -> None:
        self.call("send_message", plaintext)

    def close(self) -> None:
        self.call("close")

    # --- connection --------------------------------------------------------------

    def connect(self) -> None:
        """Open a new connection: a fresh server protocol, its welcome, ``connection_made``."""
        assert self.proto is None, f"{self} is already connected"
        proto = server_websocket.WebSocketServer()
        proto.factory = types.SimpleNamespace(
            _server=self.harness.server, reactor=self.harness.clock
        )
        proto._reactor = self.harness.clock
        self.connections += 1
        proto._peer_addr_port = ("ipv4", "127.0.0.1", 40000 + self.connections)

        def send_message(payload: bytes, is_binary: bool = False) -> None:
            if self.proto is proto:  # a closed connection's frames go nowhere
                self.down.append((next(self.harness._seq), payload))

        proto.sendMessage = send_message
        self.proto = proto
        self.harness._in_server(proto.onOpen)
        if self.core is not None:
            self.feed(self.core.connection_made())

    def disconnect(self) -> None:
        """Drop the connection: frames in flight both ways are lost, both ends are told."""
        proto, self.proto = self.proto, None
        self.up.clear()
        self.down.clear()
        self.lost_at = next(self.harness._seq)
        if proto is not None:
            self.harness._in_server(proto.onClose, False, 1006, "dropped by the harness")
        if self.core is not None:
            self.feed(self.core.connection_lost())

    def reconnect(self) -> None:
        self.disconnect()
        self.connect()

    # --- plumbing ------------------------------------------------------------------

    def send_raw(self, mtype: str, **fields: Any) -> None:
        """Queue a hand-built frame (``{"type": mtype, **fields}`` plus an ``id``)."""
        assert self.proto is not None, f"{self} is not connected"
        self.up.append((next(self.harness._seq), encode_client_message(mtype, **fields)))

    def feed(self, events: list[core.Event]) -> None:
        stop = False
        for e in events:
            if isinstance(e, core.SendFrame):
                assert self.proto is not None, f"{self} sent a frame while disconnected"
                self.up.append((next(self.harness._seq), e.payload))
            else:
                self.events.append(e)
                stop = stop or isinstance(e, core.StopConnection)
        if stop and self.proto is not None:
            self.disconnect()

    def got(self, kind: type) -> list:
        """The recorded events of one type, e.g. ``client.got(core.GotVersions)``."""
        return [e for e in self.events if isinstance(e, kind)]

    def sent_types(self) -> list[str]:
        return [m["type"] for m in self.sent]

    def queued(self, direction: str) -> list[dict[str, Any]]:
        """The frames waiting in one direction (``UP`` or ``DOWN``), decoded."""
        queue = self.up if direction == UP else self.down
        return [json.loads(payload) for _, payload in queue]

    @property
    def closed_result(self) -> Any:
        """The ``Closed`` event's error (None after a happy close); raises if not closed."""
        (closed,) = self.got(core.Closed)
        return closed.error


class Harness:
    """The real server, a fake clock, and a frame router between clients."""

    def __init__(
        self,
        *,
        appid: str = APPID,
        seed: int = 0,
        tick: float = 0.001,
        motd: str | None = None,
        faults: Faults | None = None,
    ) -> None:
        self.appid = appid
        self.clock = task.Clock()
        self.clock.advance(1_000_000)  # a plausible epoch; only differences matter
        self.tick = tick
        self.rng = random.Random(seed)  # the server's nameplate allocation
        self.motd = motd
        self.db = database.create_channel_db(":memory:")
        self.server = server.make_server(self.db, welcome_motd=motd, blur_usage=60)
        self.restarts = 0
        self.faults = faults
        self.refused = 0
        self.clients: list[Client] = []
        self.held: set[Client] = set()
        self.steps = 0
        self._seq = itertools.count()
        self._mailbox_ids = (f"mb{i}" for i in itertools.count(1))
        self._fake_time = types.SimpleNamespace(time=self.clock.seconds)

    def _in_server(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run server code with the fake clock and the seeded randomness."""
        saved = server_websocket.time, server.random, server.generate_mailbox_id
        server_websocket.time = self._fake_time
        server.random = self.rng
        server.generate_mailbox_id = lambda: next(self._mailbox_ids)
        try:
            return fn(*args)
        finally:
            server_websocket.time, server.random, server.generate_mailbox_id = saved

    # --- clients -------------------------------------------------------------------

    def client(
        self, name: str, *, side: str | None = None, connect: bool = True, **core_kwargs: Any
    ) -> Client:
        """A new client; ``side`` defaults to the name padded to 10 characters.

        ``core_kwargs`` go to ``WormholeCore`` (``appid``, ``versions``, ``keep_nameplate``).
        """
        appid = core_kwargs.pop("appid", self.appid)
        side = side or name.ljust(10, "0")[:10]
        c = Client(self, name, core.WormholeCore(appid, side=side, **core_kwargs))
        self.clients.append(c)
        if connect:
            c.connect()
        return c

    def raw_client(self, name: str, *, connect: bool = True) -> Client:
        """A client without a core, for hand-built frames (it must ``bind`` itself)."""
        c = Client(self, name, None)
        self.clients.append(c)
        if connect:
            c.connect()
        return c

    def hold(self, *clients: Client) -> None:
        """Frames to and from these clients stay queued until ``release``."""
        self.held.update(clients)

    def release(self, *clients: Client) -> None:
        self.held.difference_update(clients)

    def restart(self, *, keep_db: bool) -> None:
        """The server process dies and starts again: every connection drops at once (no
        ``onClose`` runs on the dead server), frames in flight are lost, and the new
        server has the old channel database (``keep_db``) or an empty one (the default
        of a server on ``:memory:``). Clients stay disconnected until they ``connect``."""
        for c in self.clients:
            proto, c.proto = c.proto, None
            c.up.clear()
            c.down.clear()
            c.lost_at = next(self._seq)
            if proto is not None and c.core is not None:
                c.feed(c.core.connection_lost())
        if not keep_db:
            self.db = database.create_channel_db(":memory:")
        self.server = server.make_server(self.db, welcome_motd=self.motd, blur_usage=60)
        self.restarts += 1

    # --- the router ----------------------------------------------------------------

    def deliverable(self) -> list[tuple[Client, str]]:
        """(client, direction) pairs whose queue may deliver now, oldest head first."""
        ready = []
        for c in self.clients:
            if c in self.held:
                continue
            if not c.connected:
                if self.faults is not None and c.core is not None and not c.core.closed:
                    ready.append((c.lost_at, c, CONNECT))  # the adapter reconnects
                continue
            for direction, queue in ((UP, c.up), (DOWN, c.down)):
                if queue:
                    ready.append((queue[0][0], c, direction))
        return [(c, d) for _, c, d in sorted(ready, key=lambda r: r[0])]

    def step(self, choice: tuple[Client, str] | None = None) -> bool:
        """Deliver one frame: ``choice`` or else the oldest deliverable. False if none."""
        if choice is None:
            ready = self.deliverable()
            if not ready:
                return False
            choice = ready[0]
        c, direction = choice
        self.steps += 1
        self.clock.advance(self.tick)
        if direction == CONNECT:
            self._try_connect(c)
            return True
        if direction == UP:
            _, payload = c.up.popleft()
            c.sent.append(json.loads(payload))
            self._in_server(c.proto.onMessage, payload, False)
        else:
            _, payload = c.down.popleft()
            c.received.append(json.loads(payload))
            if c.core is not None:
                c.feed(c.core.frame_received(payload))
        if self.faults is not None:
            self._inject(self.faults)
        return True

    def _try_connect(self, c: Client) -> None:
        f = self.faults
        assert f is not None
        if f.refuse_next > 0 or f.rng.random() < f.refuse:
            f.refuse_next = max(0, f.refuse_next - 1)
            self.refused += 1
            f.log.append(f"step {self.steps}: refused a connection of {c.name}")
            c.lost_at = next(self._seq)  # tried again after the others moved
            return
        c.connect()

    def _inject(self, f: Faults) -> None:
        """After a delivered frame: a restart at its step, else maybe a dropped connection."""
        if f.restart_at is not None and self.steps >= f.restart_at:
            f.restart_at = None
            f.log.append(f"step {self.steps}: server restart, keep_db={f.keep_db}")
            self.restart(keep_db=f.keep_db)
            return
        live = [c for c in self.clients if c.connected and c.core is not None]
        if live and f.rng.random() < f.drop:
            victim = f.rng.choice(live)
            f.log.append(f"step {self.steps}: dropped the connection of {victim.name}")
            victim.disconnect()

    def deliver_through(self, client: Client, direction: str, mtype: str) -> dict[str, Any]:
        """Deliver ``client``'s frames in one direction (held or not) through the first
        frame of type ``mtype``; returns that frame. Other queues do not move."""
        queue = client.up if direction == UP else client.down
        log = client.sent if direction == UP else client.received
        while queue:
            self.step((client, direction))
            if log[-1]["type"] == mtype:
                return log[-1]
        raise AssertionError(f"no {mtype!r} frame queued {direction} for {client}")

    def run_until_quiet(
        self, max_steps: int = 10_000, check: Callable[[], None] | None = None
    ) -> int:
        """FIFO delivery until nothing deliverable is left; ``check()`` after each step."""
        return self._run(lambda ready: ready[0], max_steps, check)

    def run_random(
        self, seed: int, max_steps: int = 10_000, check: Callable[[], None] | None = None
    ) -> int:
        """Deliver in an order chosen by ``random.Random(seed)`` until quiet."""
        rng = random.Random(seed)
        return self._run(rng.choice, max_steps, check)

    def _run(self, pick: Callable, max_steps: int, check: Callable[[], None] | None) -> int:
        for n in range(max_steps):
            ready = self.deliverable()
            if not ready:
                return n
            self.step(pick(ready))
            if check is not None:
                check()
        raise AssertionError(f"still delivering after {max_steps} steps")

    # --- what the server holds -------------------------------------------------------

    def sides_per_nameplate(self, appid: str | None = None) -> dict[str, int]:
        """Nameplate name -> rows in ``nameplate_sides`` (every side that ever claimed it)."""
        rows = self.db.execute(
            "SELECT n.name AS name, COUNT(s.side) AS sides FROM nameplates n"
            " LEFT JOIN nameplate_sides s ON s.nameplates_id = n.id"
            " WHERE n.app_id = ? GROUP BY n.id",
            (appid or self.appid,),
        ).fetchall()
        return {r["name"]: r["sides"] for r in rows}

    def sides_per_mailbox(self, appid: str | None = None) -> dict[str, int]:
        """Mailbox id -> rows in ``mailbox_sides`` (every side that ever opened it)."""
        rows = self.db.execute(
            "SELECT m.id AS id, COUNT(s.side) AS sides FROM mailboxes m"
            " LEFT JOIN mailbox_sides s ON s.mailbox_id = m.id"
            " WHERE m.app_id = ? GROUP BY m.id",
            (appid or self.appid,),
        ).fetchall()
        return {r["id"]: r["sides"] for r in rows}

    def mailbox_sides(self, mailbox_id: str) -> list[str]:
        """Every side with a ``mailbox_sides`` row (opened or closed) for this mailbox."""
        rows = self.db.execute(
            "SELECT side FROM mailbox_sides WHERE mailbox_id = ?", (mailbox_id,)
        ).fetchall()
        return sorted(r["side"] for r in rows)

    def open_sides(self, mailbox_id: str) -> list[str]:
        """The sides whose ``mailbox_sides`` row is still ``opened``."""
        rows = self.db.execute(
            "SELECT side FROM mailbox_sides WHERE mailbox_id = ? AND opened", (mailbox_id,)
        ).fetchall()
        return sorted(r["side"] for r in rows)

    def check_at_most_two_sides(self) -> None:
        """The invariant: no nameplate and no mailbox has more than two sides."""
        for kind, counts in (
            ("nameplate", self.sides_per_nameplate()),
            ("mailbox", self.sides_per_mailbox()),
        ):
            crowded = {k: v for k, v in counts.items() if v > 2}
            assert not crowded, f"{kind}s with more than two sides: {crowded}"

    def empty(self) -> bool:
        """Nothing left on the server: no nameplate, mailbox or message rows, any app."""
        return not any(
            self.db.execute(f"SELECT 1 FROM {table} LIMIT 1").fetchone()
            for table in ("nameplates", "nameplate_sides", "mailboxes", "mailbox_sides", "messages")
        )
