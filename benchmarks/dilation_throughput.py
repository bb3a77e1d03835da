"""Dilation throughput: ours <-> ours against reference <-> reference, same run.

Usage (see benchmarks/README.md)::

    python benchmarks/dilation_throughput.py                      # every case, 256 MiB
    python benchmarks/dilation_throughput.py --size-mib 64 --cases ours-1sub,ref-1sub
    python benchmarks/dilation_throughput.py --repeat 3 --profile /tmp/prof

Every case starts two fresh peer processes (this script with ``peer``): a
receiver that allocates a wormhole code and listens, and a sender that uses
the code, dilates, opens 1 or 4 subchannels and pushes ``--size-mib`` in
total through them as ``--message-kib`` messages, obeying the subchannel's
back-pressure (a registered push producer). Each process measures its own
CPU time (``time.process_time``) over the transfer; the wall time runs from
the sender's first write to the receiver's last byte (``time.monotonic``,
which is system-wide on Linux). Both run against the real mailbox server and
transit relay, started locally with :func:`spark_dilation.testing.running_servers`;
the data path is the direct TCP connection on this host.

One JSON object per case is printed on stdout (the median run when
``--repeat`` > 1); MB means 10**6 bytes. ``ratio_to_reference`` is ours MB/s
divided by the reference's MB/s for the same subchannel count.

This is not part of the test suite (tests/ is; benchmarks/ is not collected).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

APPID = "spark-dilation.example/benchmark"
SUBPROTOCOL = "bench"
DEFAULT_CASES = ("ours-1sub", "ref-1sub", "ours-4sub", "ref-4sub")
# Optional: ours through the blocking facade (dilation/blocking.py) on both
# ends, one thread per subchannel, as Spark tasks use it.
ALL_CASES = (*DEFAULT_CASES, "oursblocking-1sub", "oursblocking-4sub")
PEER_TIMEOUT = 600.0
MB = 1_000_000


# --- the peer processes ------------------------------------------------------------


_PROFILE: tuple[Any, str] | None = None  # (cProfile.Profile, where to dump it)


def _peer_main(args: argparse.Namespace) -> None:
    global _PROFILE
    import logging

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    from twisted.internet import defer, task

    if args.profile:
        import cProfile

        _PROFILE = (cProfile.Profile(), args.profile)
        _PROFILE[0].enable()
    if args.impl == "oursblocking":
        _blocking_peer(args)
    else:
        task.react(lambda reactor: defer.ensureDeferred(_peer(reactor, args)))


def _exit(code: int) -> None:
    """Leave at once (no polite mailbox close), saving the profile if there is one."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _PROFILE is not None:
        _PROFILE[0].disable()
        _PROFILE[0].dump_stats(_PROFILE[1])
    os._exit(code)


def _make_wormhole(impl: str, reactor: Any, mailbox: str) -> Any:
    if impl == "ours":
        from spark_dilation.wormhole import Wormhole

        return Wormhole(APPID, mailbox, reactor, dilation=True)
    import wormhole as ref

    return ref.create(APPID, mailbox, reactor, dilation=True)


def _dilate(impl: str, w: Any, relay: str) -> Any:
    if impl == "ours":
        from spark_dilation.dilation import dilate

        return dilate(w, relay_url=relay, listen_addresses=["127.0.0.1"])
    return w.dilate(transit_relay_location=relay)


def _emit(tag: str, obj: Any) -> None:
    sys.stdout.write(f"{tag} {json.dumps(obj)}\n")
    sys.stdout.flush()


async def _peer(reactor: Any, args: argparse.Namespace) -> None:
    from twisted.internet import defer, protocol

    message_size = args.message_kib * 1024
    per_sub = args.size_mib * 1024 * 1024 // args.subs
    # The same pseudo-random block in both processes, so the receiver can check it.
    block = (random.Random(1).randbytes(4096) * (message_size // 4096 + 1))[:message_size]
    # A peer that hangs must not hang the driver.
    reactor.callLater(PEER_TIMEOUT, _die, "timed out")

    w = _make_wormhole(args.impl, reactor, args.mailbox)
    if args.role == "receiver":
        w.allocate_code()
        code = await w.get_code()
        _emit("CODE", code)
    else:
        w.set_code(args.code)
    dw = _dilate(args.impl, w, args.relay)
    await dw.when_dilated()
    done: defer.Deferred = defer.Deferred()

    if args.role == "receiver":
        state: dict[str, Any] = {"open": 0, "finished": 0, "lost": 0, "bytes": 0}

        class Receiver(protocol.Protocol):
            def connectionMade(self) -> None:
                if state["open"] == 0:
                    state["cpu0"] = time.process_time()
                    state["ru0"] = _rusage()
                state["open"] += 1
                self.got = 0

            def dataReceived(self, data: bytes) -> None:
                n = len(data)
                if n != message_size and self.got + n != per_sub:
                    _die(f"a message of {n} bytes arrived (each was {message_size})")
                if data[:16] != block[:16] or data[-16:] != block[n - 16 : n]:
                    _die("a message arrived corrupted")
                self.got += n
                if self.got == per_sub:
                    state["finished"] += 1
                    state["bytes"] += self.got
                    if state["finished"] == args.subs:
                        state["t_end"] = time.monotonic()
                        state["cpu1"] = time.process_time()
                        state["ru1"] = _rusage()
                    self.transport.write(b"done %d" % self.got)

            def connectionLost(self, reason: Any = None) -> None:
                state["lost"] += 1
                if state["lost"] == args.subs and not done.called:
                    done.callback(None)

        await dw.listener_for(SUBPROTOCOL).listen(protocol.Factory.forProtocol(Receiver))
        await done
        _emit(
            "RESULT",
            {
                "bytes": state["bytes"],
                "t_end": state["t_end"],
                "cpu_s": state["cpu1"] - state["cpu0"],
                "rusage": _rusage_delta(state["ru0"], state["ru1"]),
            },
        )
    else:
        senders: list[Any] = []

        class Sender(protocol.Protocol):
            def connectionMade(self) -> None:
                self.left = per_sub
                self.started = False
                self.paused = False
                self.replied = False
                # registerProducer pauses us at once if the connection is full.
                self.registered = True
                self.transport.registerProducer(self, True)
                senders.append(self)

            def start(self) -> None:
                self.started = True
                self._pump()

            def _pump(self) -> None:
                write = self.transport.write
                while self.started and not self.paused and self.left > 0:
                    if self.left >= message_size:
                        write(block)
                        self.left -= message_size
                    else:
                        write(block[: self.left])
                        self.left = 0
                if self.left == 0 and self.registered:
                    self.registered = False
                    self.transport.unregisterProducer()

            def pauseProducing(self) -> None:
                self.paused = True

            def resumeProducing(self) -> None:
                self.paused = False
                self._pump()

            def stopProducing(self) -> None:
                self.left = 0

            def dataReceived(self, data: bytes) -> None:
                if data != b"done %d" % per_sub:
                    _die(f"unexpected reply {data[:40]!r}")
                self.replied = True
                if all(s.replied for s in senders) and not done.called:
                    done.callback(None)

        factory = protocol.Factory.forProtocol(Sender)
        for _ in range(args.subs):
            await dw.connector_for(SUBPROTOCOL).connect(factory)
        cpu0 = time.process_time()
        ru0 = _rusage()
        t_start = time.monotonic()
        for s in senders:
            s.start()
        await done
        cpu1 = time.process_time()
        ru1 = _rusage()
        for s in senders:
            s.transport.loseConnection()
        _emit(
            "RESULT",
            {"t_start": t_start, "cpu_s": cpu1 - cpu0, "rusage": _rusage_delta(ru0, ru1)},
        )
        # Give the CLOSEs a moment to travel; then leave without a polite mailbox close.
        await _sleep(reactor, 0.5)
    _exit(0)


def _blocking_peer(args: argparse.Namespace) -> None:
    """The same transfer through BlockingDilation, one thread per subchannel."""
    import threading

    from spark_dilation.dilation.blocking import BlockingDilation

    message_size = args.message_kib * 1024
    per_sub = args.size_mib * 1024 * 1024 // args.subs
    block = (random.Random(1).randbytes(4096) * (message_size // 4096 + 1))[:message_size]
    timer = threading.Timer(PEER_TIMEOUT, _die, ("timed out",))
    timer.daemon = True
    timer.start()
    options: dict[str, Any] = {"relay_url": args.relay, "listen_addresses": ["127.0.0.1"]}
    threads: list[threading.Thread] = []
    if args.role == "receiver":
        d = BlockingDilation.create(APPID, args.mailbox, listen=[SUBPROTOCOL], **options)
        _emit("CODE", d.code)
        channels = [d.accept(SUBPROTOCOL) for _ in range(args.subs)]
        cpu0, ru0 = time.process_time(), _rusage()
        total = [0]
        lock = threading.Lock()

        def receive(ch: Any) -> None:
            got = 0
            while got < per_sub:
                data = ch.receive()
                if data is None or data[:16] != block[:16]:
                    _die("a message arrived corrupted (or EOF came early)")
                got += len(data)
            with lock:
                total[0] += got

        threads = [threading.Thread(target=receive, args=(ch,)) for ch in channels]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_end, cpu1, ru1 = time.monotonic(), time.process_time(), _rusage()
        for ch in channels:
            ch.send(b"done %d" % per_sub)
        for ch in channels:
            ch.receive()  # EOF: the sender closes after our answer
        _emit(
            "RESULT",
            {
                "bytes": total[0],
                "t_end": t_end,
                "cpu_s": cpu1 - cpu0,
                "rusage": _rusage_delta(ru0, ru1),
            },
        )
    else:
        d = BlockingDilation.create(APPID, args.mailbox, code=args.code, **options)
        channels = [d.open(SUBPROTOCOL) for _ in range(args.subs)]

        def send(ch: Any) -> None:
            left = per_sub
            while left > 0:
                ch.send(block if left >= message_size else block[:left])
                left -= message_size
            if ch.receive() != b"done %d" % per_sub:
                _die("unexpected reply")

        threads = [threading.Thread(target=send, args=(ch,)) for ch in channels]
        cpu0, ru0 = time.process_time(), _rusage()
        t_start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        cpu1, ru1 = time.process_time(), _rusage()
        for ch in channels:
            ch.close()
        _emit(
            "RESULT",
            {"t_start": t_start, "cpu_s": cpu1 - cpu0, "rusage": _rusage_delta(ru0, ru1)},
        )
        time.sleep(0.5)
    _exit(0)


def _rusage() -> Any:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF)


def _rusage_delta(a: Any, b: Any) -> dict[str, float]:
    """User/system CPU seconds and minor page faults between two getrusage() calls."""
    return {
        "user_s": round(b.ru_utime - a.ru_utime, 3),
        "sys_s": round(b.ru_stime - a.ru_stime, 3),
        "minflt": b.ru_minflt - a.ru_minflt,
        "maxrss_mib": round(b.ru_maxrss / 1024, 1),
    }


def _die(why: str) -> None:
    sys.stderr.write(f"benchmark peer: {why}\n")
    _exit(2)


def _sleep(reactor: Any, seconds: float) -> Any:
    from twisted.internet import task

    return task.deferLater(reactor, seconds, lambda: None)


# --- the driver ----------------------------------------------------------------


def _spawn(args: argparse.Namespace, extra: list[str]) -> subprocess.Popen[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "peer", *extra]
    cmd += ["--size-mib", str(args.size_mib), "--message-kib", str(args.message_kib)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def _read_tagged(proc: subprocess.Popen[str], tag: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(tag + " "):
            return line[len(tag) + 1 :].strip()
    raise RuntimeError(f"peer {proc.args} exited (code {proc.wait()}) without a {tag} line")


def run_case(args: argparse.Namespace, servers: Any, case: str, run: int) -> dict[str, Any]:
    impl, subs = case.split("-")
    nsubs = int(subs.removesuffix("sub"))
    common = ["--impl", impl, "--subs", str(nsubs)]
    common += ["--mailbox", servers.mailbox_url, "--relay", servers.relay_url]
    prof = {}
    if args.profile and impl != "ref":
        os.makedirs(args.profile, exist_ok=True)
        for role in ("sender", "receiver"):
            prof[role] = ["--profile", os.path.join(args.profile, f"{case}-{run}-{role}.prof")]
    receiver = _spawn(args, ["--role", "receiver", *common, *prof.get("receiver", [])])
    sender = None
    try:
        code = json.loads(_read_tagged(receiver, "CODE"))
        sender = _spawn(
            args, ["--role", "sender", "--code", code, *common, *prof.get("sender", [])]
        )
        s = json.loads(_read_tagged(sender, "RESULT"))
        r = json.loads(_read_tagged(receiver, "RESULT"))
        sender.wait(PEER_TIMEOUT)
        receiver.wait(PEER_TIMEOUT)
    finally:
        for p in (receiver, sender):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    seconds = r["t_end"] - s["t_start"]
    mb = r["bytes"] / MB
    print(f"# {case}: sender {s['rusage']}, receiver {r['rusage']}", file=sys.stderr)
    return {
        "case": case,
        "bytes": r["bytes"],
        "seconds": round(seconds, 4),
        "mb_per_s": round(mb / seconds, 1),
        "cpu_ms_per_mb_sender": round(s["cpu_s"] * 1000 / mb, 3),
        "cpu_ms_per_mb_receiver": round(r["cpu_s"] * 1000 / mb, 3),
    }


def _driver(args: argparse.Namespace) -> None:
    from spark_dilation.testing import running_servers

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    for case in cases:
        if case not in ALL_CASES:
            raise SystemExit(f"unknown case {case!r}; choose from {', '.join(ALL_CASES)}")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
    with running_servers() as servers:
        for i in range(args.repeat):
            for case in cases:
                result = run_case(args, servers, case, i)
                print(f"# run {i + 1}/{args.repeat}: {json.dumps(result)}", file=sys.stderr)
                runs[case].append(result)
    best = {c: _median(rs) for c, rs in runs.items()}
    for case in cases:
        row = dict(best[case])
        subs = case.split("-")[1]
        ref = best.get(f"ref-{subs}")
        row["ratio_to_reference"] = (
            round(row["mb_per_s"] / ref["mb_per_s"], 2) if ref is not None else None
        )
        if args.repeat > 1:
            row["repeat"] = args.repeat
        print(json.dumps(row), flush=True)


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median wall time (a real run, not a blend of several)."""
    ordered = sorted(rows, key=lambda r: r["seconds"])
    return ordered[(len(ordered) - 1) // 2]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["peer"]:
        p = argparse.ArgumentParser(prog="dilation_throughput.py peer")
        p.add_argument("--role", choices=("sender", "receiver"), required=True)
        p.add_argument("--impl", choices=("ours", "ref", "oursblocking"), required=True)
        p.add_argument("--subs", type=int, required=True)
        p.add_argument("--mailbox", required=True)
        p.add_argument("--relay", required=True)
        p.add_argument("--code")
        p.add_argument("--size-mib", type=int, required=True)
        p.add_argument("--message-kib", type=int, required=True)
        p.add_argument("--profile")
        _peer_main(p.parse_args(argv[1:]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mib", type=int, default=256, help="total MiB per case (default 256)")
    p.add_argument(
        "--cases",
        default=",".join(DEFAULT_CASES),
        help=f"comma-separated, from {','.join(ALL_CASES)} (default: the first four)",
    )
    p.add_argument("--repeat", type=int, default=1, help="runs per case; the median is printed")
    p.add_argument(
        "--message-kib",
        type=int,
        default=1024,
        help="size of each subchannel write (default 1024: our partition stream's ~1 MiB)",
    )
    p.add_argument("--profile", help="directory for cProfile dumps of our peer processes")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.size_mib < 1:
        raise SystemExit("--repeat and --size-mib must be at least 1")
    _driver(args)


if __name__ == "__main__":
    main()
