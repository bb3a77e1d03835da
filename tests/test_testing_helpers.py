"""spark_dilation.testing: real servers in a subprocess, and the misbehaving TcpProxy."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

import pytest

from spark_dilation.testing import ServerProcess, TcpProxy, running_servers
from spark_dilation.testing.waiting import wait_until

WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
TIMEOUT = 10.0


# --- helpers ------------------------------------------------------------------


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def read_welcome(url: str) -> dict:
    """Open a WebSocket by hand and return the first (server-sent, unmasked) message."""
    parts = urlsplit(url)
    assert parts.scheme == "ws" and parts.hostname and parts.port
    key = base64.b64encode(os.urandom(16))
    request = (
        f"GET {parts.path} HTTP/1.1\r\n"
        f"Host: {parts.hostname}:{parts.port}\r\n"
        "Upgrade: websocket\r\n"
        "Connection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key.decode()}\r\n"
        "Sec-WebSocket-Version: 13\r\n"
        "\r\n"
    ).encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT) as sock:
        sock.sendall(request)
        head = bytearray()
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(1)
            if not chunk:
                raise EOFError(f"connection closed during the handshake: {bytes(head)!r}")
            head += chunk
        status, *header_lines = head.decode("latin-1").split("\r\n")
        assert " 101 " in status, status
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in header_lines if line)
        }
        expected = base64.b64encode(hashlib.sha1(key + WS_GUID).digest()).decode()
        assert headers["sec-websocket-accept"] == expected

        b0, b1 = recv_exact(sock, 2)
        assert b0 & 0x0F == 0x1, "expected a text frame"
        assert b0 & 0x80, "expected a final (unfragmented) frame"
        assert not b1 & 0x80, "frames from the server must not be masked"
        length = b1 & 0x7F
        if length == 126:
            (length,) = struct.unpack("!H", recv_exact(sock, 2))
        elif length == 127:
            (length,) = struct.unpack("!Q", recv_exact(sock, 8))
        return json.loads(recv_exact(sock, length))


def assert_refused(port: int) -> None:
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT).close()
    except OSError:
        return False
    return True


def assert_closed_by_peer(sock: socket.socket) -> None:
    """The peer reset or closed the connection (reading gives EOF or ECONNRESET)."""
    sock.settimeout(TIMEOUT)
    try:
        data = sock.recv(1024)
    except ConnectionError:
        return
    assert data == b""


def busy_port() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


class EchoServer:
    """A threaded TCP echo server that records how each connection ended."""

    def __init__(self) -> None:
        self._listener = busy_port()
        self.port: int = self._listener.getsockname()[1]
        self.endings: list[str] = []
        self._threads: list[threading.Thread] = []
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True)
        self._accepter.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            t = threading.Thread(target=self._echo, args=(conn,), daemon=True)
            self._threads.append(t)
            t.start()

    def _echo(self, conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(256 * 1024):
                    conn.sendall(data)
            except ConnectionError:
                self.endings.append("reset")
                return
            self.endings.append("eof")
            # The proxy may already be gone (closed at teardown).
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def echo_server() -> Iterator[EchoServer]:
    server = EchoServer()
    yield server
    server.close()


@pytest.fixture
def echo_proxy(echo_server: EchoServer, tcp_proxy: Callable[[str, int], TcpProxy]) -> TcpProxy:
    return tcp_proxy("127.0.0.1", echo_server.port)


def connect(proxy: TcpProxy) -> socket.socket:
    return socket.create_connection((proxy.host, proxy.port), timeout=TIMEOUT)


def echo_once(sock: socket.socket, payload: bytes = b"hello") -> None:
    sock.sendall(payload)
    assert recv_exact(sock, len(payload)) == payload


# --- running_servers ----------------------------------------------------------


def test_running_servers_urls_point_at_listening_ports(wormhole_servers: ServerProcess) -> None:
    s = wormhole_servers
    assert s.mailbox_url == f"ws://127.0.0.1:{s.mailbox_port}/v1"
    assert s.relay_url == f"tcp:127.0.0.1:{s.relay_port}"
    assert s.is_running()
    assert accepts(s.mailbox_port)
    assert accepts(s.relay_port)


def test_url_fixtures_come_from_the_session_servers(
    mailbox_url: str, relay_url: str, wormhole_servers: ServerProcess
) -> None:
    assert mailbox_url == wormhole_servers.mailbox_url
    assert relay_url == wormhole_servers.relay_url


def test_mailbox_sends_welcome(mailbox_url: str) -> None:
    message = read_welcome(mailbox_url)
    assert message["type"] == "welcome"
    assert "motd" not in message["welcome"]
    assert "error" not in message["welcome"]


@pytest.mark.parametrize("fresh_servers", [{"motd": "Tests are running"}], indirect=True)
def test_motd_shows_in_welcome(fresh_servers: ServerProcess) -> None:
    message = read_welcome(fresh_servers.mailbox_url)
    assert message["welcome"]["motd"] == "Tests are running"


@pytest.mark.integration  # starts processes of its own
def test_signal_error_shows_in_welcome() -> None:
    with running_servers(signal_error="closed for maintenance") as servers:
        message = read_welcome(servers.mailbox_url)
    assert message["welcome"]["error"] == "closed for maintenance"


def test_relay_pairs_two_clients(wormhole_servers: ServerProcess) -> None:
    token = os.urandom(32).hex()
    sides = [os.urandom(8).hex(), os.urandom(8).hex()]
    a, b = (
        socket.create_connection(("127.0.0.1", wormhole_servers.relay_port), timeout=TIMEOUT)
        for _ in sides
    )
    with a, b:
        for sock, side in zip((a, b), sides, strict=True):
            sock.sendall(f"please relay {token} for side {side}\n".encode())
        assert recv_exact(a, 3) == b"ok\n"
        assert recv_exact(b, 3) == b"ok\n"
        a.sendall(b"from a")
        assert recv_exact(b, 6) == b"from a"
        b.sendall(b"from b")
        assert recv_exact(a, 6) == b"from b"


def test_kill_makes_ports_refuse_connections(fresh_servers: ServerProcess) -> None:
    assert fresh_servers.kill() == -signal.SIGKILL
    assert not fresh_servers.is_running()
    assert_refused(fresh_servers.mailbox_port)
    assert_refused(fresh_servers.relay_port)


def test_stop_is_a_clean_exit(fresh_servers: ServerProcess) -> None:
    assert fresh_servers.stop() == 0
    assert_refused(fresh_servers.mailbox_port)


def test_sigint_is_a_clean_exit(fresh_servers: ServerProcess) -> None:
    os.killpg(fresh_servers.pid, signal.SIGINT)
    assert fresh_servers.process.wait(TIMEOUT) == 0


def test_servers_can_restart_on_the_same_ports(fresh_servers: ServerProcess) -> None:
    read_welcome(fresh_servers.mailbox_url)  # leave a connection behind in TIME_WAIT
    fresh_servers.kill()
    with running_servers(
        mailbox_port=fresh_servers.mailbox_port, relay_port=fresh_servers.relay_port
    ) as again:
        assert again.mailbox_url == fresh_servers.mailbox_url
        assert read_welcome(again.mailbox_url)["type"] == "welcome"
        assert accepts(again.relay_port)


@pytest.mark.integration  # starts processes of its own
def test_context_exit_stops_the_servers() -> None:
    with running_servers() as servers:
        pass
    assert servers.returncode == 0
    assert_refused(servers.mailbox_port)


@pytest.mark.integration  # starts processes of its own
def test_running_servers_reports_startup_failure_with_stderr() -> None:
    with busy_port() as blocker:
        port = blocker.getsockname()[1]
        with pytest.raises(RuntimeError, match="already in use") as excinfo:
            with running_servers(mailbox_port=port):
                pass
    assert "exited with code 2" in str(excinfo.value)


@pytest.mark.integration  # starts processes of its own
@pytest.mark.parametrize(
    ("which", "what"), [("--mailbox-port", "mailbox server"), ("--relay-port", "transit relay")]
)
def test_busy_port_exits_2_with_one_line_error(which: str, what: str) -> None:
    with busy_port() as blocker:
        port = blocker.getsockname()[1]
        ports = {"--mailbox-port": "0", "--relay-port": "0", which: str(port)}
        result = subprocess.run(
            [sys.executable, "-m", "spark_dilation.servers", *sum(ports.items(), ())],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert what in lines[0]
    assert f"127.0.0.1:{port}" in lines[0]
    assert "already in use" in lines[0]


@pytest.mark.integration  # starts processes of its own
def test_missing_server_extra_is_a_clear_error() -> None:
    script = (
        "import sys\n"
        "sys.modules['wormhole_mailbox_server'] = None\n"
        "from spark_dilation.servers import main, start_servers\n"
        "try:\n"
        "    start_servers(None)\n"
        "except RuntimeError as e:\n"
        "    print(e)\n"
        "sys.exit(main(['--mailbox-port', '0', '--relay-port', '0']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    message = "pip install 'spark-dilation[server]'"
    assert result.returncode == 1
    assert message in result.stdout
    assert message in result.stderr
    assert "Traceback" not in result.stderr


EMBEDDED_SCRIPT = r"""
import json, socket
from twisted.internet import task, threads
from spark_dilation.servers import ListenError, start_servers

def hold_open(port):
    return socket.create_connection(("127.0.0.1", port), timeout=10)

def closed_by_peer(sock):
    try:
        return sock.recv(1) == b""
    except ConnectionError:
        return True

def refused(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    except ConnectionRefusedError:
        return True
    return False

async def main(reactor):
    report = {}
    s = await start_servers(reactor)
    report["urls"] = [s.mailbox_url, s.relay_url, s.mailbox_port, s.relay_port, s.interface]
    socks = [await threads.deferToThread(hold_open, p) for p in (s.mailbox_port, s.relay_port)]
    await s.stop()
    await s.stop()
    report["closed"] = [await threads.deferToThread(closed_by_peer, c) for c in socks]
    report["refused"] = [
        await threads.deferToThread(refused, p) for p in (s.mailbox_port, s.relay_port)
    ]
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    busy = blocker.getsockname()[1]
    try:
        await start_servers(reactor, mailbox_port=0, relay_port=busy)
    except ListenError as e:
        report["error"] = [e.what, e.port, str(e)]
    print(json.dumps(report))

task.react(main)
"""


@pytest.mark.integration  # starts processes of its own
def test_start_servers_in_process_stop_closes_everything() -> None:
    result = subprocess.run(
        [sys.executable, "-c", EMBEDDED_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    mailbox_url, relay_url, mailbox_port, relay_port, interface = report["urls"]
    assert mailbox_url == f"ws://127.0.0.1:{mailbox_port}/v1"
    assert relay_url == f"tcp:127.0.0.1:{relay_port}"
    assert interface == "127.0.0.1"
    assert report["closed"] == [True, True]
    assert report["refused"] == [True, True]
    what, port, message = report["error"]
    assert what == "transit relay"
    assert f":{port}" in message
    assert "already in use" in message


# --- TcpProxy -----------------------------------------------------------------


def test_proxy_addresses(echo_proxy: TcpProxy) -> None:
    assert echo_proxy.url() == f"ws://127.0.0.1:{echo_proxy.port}/v1"
    assert echo_proxy.url("/other") == f"ws://127.0.0.1:{echo_proxy.port}/other"
    assert echo_proxy.hint() == f"tcp:127.0.0.1:{echo_proxy.port}"


def test_proxy_forwards_both_ways(echo_proxy: TcpProxy) -> None:
    with connect(echo_proxy) as sock:
        echo_once(sock, b"hello")
        echo_once(sock, b"world" * 1000)
        assert echo_proxy.connection_count == 1
        assert echo_proxy.total_connections == 1
    wait_until(
        "the proxy to forget the connection",
        lambda: echo_proxy.connection_count == 0,
        TIMEOUT,
        interval=0.01,
    )


def test_proxy_carries_bulk_data_intact(echo_proxy: TcpProxy) -> None:
    payload = os.urandom(24 * 1024 * 1024)
    with connect(echo_proxy) as sock:
        sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
        sender.start()
        received = recv_exact(sock, len(payload))
        sender.join(TIMEOUT)
    assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()


def test_limit_rate_paces_bulk_data_and_lifts(echo_proxy: TcpProxy) -> None:
    # 2 MB out and back is 4 MB read by the proxy: at 4 MB/s it cannot take less
    # than about a second (a lower bound only: a limiter that leaks fails it).
    payload = os.urandom(2 * 1024 * 1024)
    echo_proxy.limit_rate(4e6)
    with connect(echo_proxy) as sock:
        started = time.monotonic()
        sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
        sender.start()
        received = recv_exact(sock, len(payload))
        sender.join(TIMEOUT)
        paced = time.monotonic() - started
        assert received == payload
        assert paced >= 0.8, paced
        echo_proxy.limit_rate(None)
        echo_once(sock, b"unlimited again" * 1000)
    with pytest.raises(ValueError, match="positive"):
        echo_proxy.limit_rate(0)


def test_proxy_forwards_half_close(echo_proxy: TcpProxy, echo_server: EchoServer) -> None:
    with connect(echo_proxy) as sock:
        sock.sendall(b"last words")
        sock.shutdown(socket.SHUT_WR)
        assert recv_exact(sock, 10) == b"last words"
        assert sock.recv(1) == b""
    wait_until(
        "the echo server to see EOF", lambda: echo_server.endings == ["eof"], TIMEOUT, interval=0.01
    )
    wait_until(
        "the proxy to forget the connection",
        lambda: echo_proxy.connection_count == 0,
        TIMEOUT,
        interval=0.01,
    )


def test_drop_connections_resets_both_sides_and_keeps_accepting(
    echo_proxy: TcpProxy, echo_server: EchoServer
) -> None:
    with connect(echo_proxy) as first:
        echo_once(first)
        assert echo_proxy.drop_connections() == 1
        assert echo_proxy.connection_count == 0
        assert_closed_by_peer(first)
    wait_until(
        "the echo server to see a reset",
        lambda: echo_server.endings == ["reset"],
        TIMEOUT,
        interval=0.01,
    )

    with connect(echo_proxy) as second:
        echo_once(second)
        assert echo_proxy.connection_count == 1
    assert echo_proxy.total_connections == 2


def test_freeze_stalls_silently_and_thaw_delivers(echo_proxy: TcpProxy) -> None:
    with connect(echo_proxy) as sock:
        echo_once(sock)
        echo_proxy.freeze()
        assert echo_proxy.frozen
        sock.sendall(b"are you there?")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1024)
        assert echo_proxy.connection_count == 1

        echo_proxy.thaw()
        sock.settimeout(TIMEOUT)
        assert recv_exact(sock, 14) == b"are you there?"
        echo_once(sock, b"still here")


def test_freeze_also_stalls_new_connections(echo_proxy: TcpProxy) -> None:
    echo_proxy.freeze()
    with connect(echo_proxy) as sock:
        sock.sendall(b"early")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1024)
        echo_proxy.thaw()
        sock.settimeout(TIMEOUT)
        assert recv_exact(sock, 5) == b"early"


def test_stall_existing_stalls_only_open_connections(echo_proxy: TcpProxy) -> None:
    with connect(echo_proxy) as stalled:
        echo_once(stalled)
        assert echo_proxy.stall_existing() == 1
        assert not echo_proxy.frozen
        stalled.sendall(b"are you there?")
        stalled.settimeout(0.3)
        with pytest.raises(TimeoutError):
            stalled.recv(1024)  # silent: no bytes, no FIN, no RST

        with connect(echo_proxy) as fresh:  # new connections flow normally
            echo_once(fresh, b"new path")
            assert echo_proxy.connection_count == 2
        with pytest.raises(TimeoutError):
            stalled.recv(1024)  # still stalled

        echo_proxy.release()
        stalled.settimeout(TIMEOUT)
        assert recv_exact(stalled, 14) == b"are you there?"
        echo_once(stalled, b"still here")
    assert echo_proxy.total_connections == 2


def test_stall_existing_then_release_while_frozen(echo_proxy: TcpProxy) -> None:
    with connect(echo_proxy) as sock:
        echo_once(sock)
        assert echo_proxy.stall_existing() == 1
        echo_proxy.freeze()
        echo_proxy.thaw()  # thaw does not release a stalled connection
        sock.sendall(b"held")
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1024)
        echo_proxy.freeze()
        echo_proxy.release()  # still frozen: nothing moves yet
        with pytest.raises(TimeoutError):
            sock.recv(1024)
        echo_proxy.thaw()
        sock.settimeout(TIMEOUT)
        assert recv_exact(sock, 4) == b"held"


def test_drop_connections_resets_stalled_connections(echo_proxy: TcpProxy) -> None:
    with connect(echo_proxy) as sock:
        echo_once(sock)
        assert echo_proxy.stall_existing() == 1
        assert echo_proxy.drop_connections() == 1
        assert_closed_by_peer(sock)
    echo_proxy.release()  # nothing left to release
    with connect(echo_proxy) as sock:
        echo_once(sock)


def test_drop_connections_while_frozen(echo_proxy: TcpProxy) -> None:
    with connect(echo_proxy) as sock:
        echo_once(sock)
        echo_proxy.freeze()
        sock.sendall(b"lost")
        echo_proxy.drop_connections()
        assert_closed_by_peer(sock)
    echo_proxy.thaw()
    with connect(echo_proxy) as sock:
        echo_once(sock)


def test_refuse_new_closes_new_connections(echo_proxy: TcpProxy) -> None:
    with connect(echo_proxy) as existing:
        echo_once(existing)
        echo_proxy.refuse_new(True)
        with connect(echo_proxy) as refused:
            assert_closed_by_peer(refused)
        assert echo_proxy.refused_connections == 1
        echo_once(existing)  # connections already made are left alone

        echo_proxy.refuse_new(False)
        with connect(echo_proxy) as accepted:
            echo_once(accepted)
    assert echo_proxy.total_connections == 3


def test_proxy_resets_client_when_target_is_down(
    tcp_proxy: Callable[[str, int], TcpProxy],
) -> None:
    with busy_port() as placeholder:
        dead_port = placeholder.getsockname()[1]
    proxy = tcp_proxy("127.0.0.1", dead_port)
    try:
        sock = connect(proxy)
    except ConnectionError:
        pass  # the reset raced connect() itself: the client saw it all the same
    else:
        with sock:
            assert_closed_by_peer(sock)
    wait_until(
        "the proxy to forget the connection",
        lambda: proxy.connection_count == 0,
        TIMEOUT,
        interval=0.01,
    )


def test_close_resets_connections_and_stops_listening(echo_server: EchoServer) -> None:
    with TcpProxy("127.0.0.1", echo_server.port) as proxy:
        sock = connect(proxy)
        echo_once(sock)
    with sock:
        assert_closed_by_peer(sock)
    assert_refused(proxy.port)
    proxy.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        proxy.freeze()


def test_proxy_carries_a_mailbox_websocket(
    wormhole_servers: ServerProcess, tcp_proxy: Callable[[str, int], TcpProxy]
) -> None:
    proxy = tcp_proxy("127.0.0.1", wormhole_servers.mailbox_port)
    assert read_welcome(proxy.url())["type"] == "welcome"
    assert proxy.total_connections == 1
