"""Slow and idle sockets, the connection cap, log floods and the engine watchdog, on a real
ServeServer over real sockets, no model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import free_port
from fakes.stub_backend import StubBackend

from butter.http.access import AccessPolicy
from butter.http.protocol import ThrottleFilter
from butter.http.server import ServeServer, raise_open_files_limit

HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


class Running:
    """A ServeServer on its own event loop in a thread; ``result`` is run_forever's."""

    def __init__(self, server: ServeServer) -> None:
        self.server = server
        self.result: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.result = asyncio.run(self.server.run_forever())


@contextlib.contextmanager
def serving(backend: StubBackend | None = None, **options) -> Iterator[Running]:
    options = {"header_timeout": 0.5, "body_timeout": 1.5, "keep_alive": 0.5, **options}
    server = ServeServer(host="127.0.0.1", port=free_port(), backend=backend or StubBackend(),
                         **options)
    running = Running(server)
    running.thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert running.thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield running
    finally:
        server.stop()
        running.thread.join(10)


def connect(running: Running) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", running.server.port), timeout=5)
    return sock


def read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    start = time.monotonic()
    sock.settimeout(limit)
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data, time.monotonic() - start


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    """One response with a Content-Length, leaving the connection open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next(int(line.split(":", 1)[1]) for line in lines
                  if line.lower().startswith("content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(lines[0].split()[1]), body


def health_status(running: Running) -> int:
    with connect(running) as sock:
        sock.sendall(HEALTH)
        return read_response(sock)[0]


def test_slowloris_head_is_answered_408_and_closed_despite_trickling_bytes():
    with serving() as running, connect(running) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        sock.settimeout(0.2)
        start, data = time.monotonic(), b""
        while time.monotonic() - start < 3:
            try:
                sock.sendall(b"a")
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            data += chunk
            if not chunk:
                break
        elapsed = time.monotonic() - start
        assert data.startswith(b"HTTP/1.1 408"), data
        assert elapsed < 0.5 + 1
        assert health_status(running) == 200


def test_a_connection_that_sends_nothing_is_closed_silently():
    with serving() as running, connect(running) as sock:
        data, elapsed = read_until_closed(sock, 3)
        assert data == b""
        assert 0.3 < elapsed < 0.5 + 1


def test_an_idle_keep_alive_connection_is_closed_after_its_response():
    with serving(header_timeout=5) as running, connect(running) as sock:
        sock.sendall(HEALTH)
        assert read_response(sock) == (200, b"ok")
        data, elapsed = read_until_closed(sock, 3)
        assert data == b""
        assert elapsed < 0.5 + 1


def test_a_kept_alive_connection_gets_a_fresh_head_deadline_per_request():
    with serving(header_timeout=0.8, keep_alive=3) as running, connect(running) as sock:
        time.sleep(0.5)
        sock.sendall(HEALTH)
        assert read_response(sock) == (200, b"ok")
        time.sleep(0.5)  # past the first head's deadline, inside keep-alive
        sock.sendall(HEALTH[:20])
        data, elapsed = read_until_closed(sock, 3)
        assert data.startswith(b"HTTP/1.1 408")
        assert 0.5 < elapsed < 0.8 + 1


def test_connections_past_the_cap_get_503_and_the_server_recovers():
    with serving(header_timeout=5, max_connections=3) as running:
        held = [connect(running) for _ in range(3)]
        time.sleep(0.2)  # let the server accept them
        with connect(running) as extra:
            data, elapsed = read_until_closed(extra, 3)
        assert data.startswith(b"HTTP/1.1 503"), data
        assert b"too many open connections" in data
        assert elapsed < 0.5
        for sock in held:
            sock.close()
        time.sleep(0.2)
        assert health_status(running) == 200


def test_a_stalled_body_is_closed_after_body_timeout_and_serving_goes_on():
    logged = Collect()
    logging.getLogger("butter").addHandler(logged)
    with serving() as running, connect(running) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                     b'{"messages"')
        data, elapsed = read_until_closed(sock, 4)
        assert b"200 OK" not in data
        # Past the head's deadline (0.5 s), which no longer applies once the head is in.
        assert 1.2 < elapsed < 1.5 + 1
        assert health_status(running) == 200
    logging.getLogger("butter").removeHandler(logged)
    # One line for the client that went away, never a traceback of an "unexpected error".
    texts = [record.getMessage() for record in logged.records]
    assert any("went away before its body arrived" in text for text in texts), texts
    assert not any(record.exc_info for record in logged.records)


def test_a_head_growing_past_64_kib_is_refused_without_waiting_for_its_end():
    with serving(header_timeout=5) as running, connect(running) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000)
        data, elapsed = read_until_closed(sock, 3)
        assert data.startswith(b"HTTP/1.1 400")
        assert elapsed < 1


def test_throttle_filter_passes_one_accept_error_per_window_and_counts_the_rest():
    throttle = ThrottleFilter("socket.accept() out of system resource", interval=0.3)

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

    emfile = "socket.accept() out of system resource\nexception: [Errno 24] Too many open files"
    assert throttle.filter(record(emfile))
    assert not throttle.filter(record(emfile))
    assert not throttle.filter(record(emfile))
    assert throttle.filter(record("Task was destroyed but it is pending!"))
    time.sleep(0.35)
    later = record(emfile)
    assert throttle.filter(later)
    assert "2 similar messages suppressed" in later.getMessage()


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.records.append(record)


def test_the_server_throttles_asyncio_accept_errors_while_it_runs():
    message = "socket.accept() out of system resource\nexception: [Errno 24] Too many open files"
    asyncio_log, collect = logging.getLogger("asyncio"), Collect()
    asyncio_log.addHandler(collect)
    try:
        with serving():
            for _ in range(50):
                asyncio_log.error(message)
        asyncio_log.error(message)  # the filter leaves with the server
    finally:
        asyncio_log.removeHandler(collect)
    assert collect.messages == [message, message]


def test_the_server_stops_with_exit_code_1_when_the_engine_dies():
    backend = StubBackend()
    with serving(backend) as running:
        backend.healthy = False
        running.thread.join(3)
        assert not running.thread.is_alive()
    assert running.result == 1 and running.server.exit_code == 1


def test_a_server_stopped_normally_returns_0():
    with serving() as running:
        pass
    assert running.result == 0 and running.server.exit_code == 0


def test_the_access_policy_is_passed_through_or_defaults_to_loopback_only():
    with serving(access=AccessPolicy(api_key="sekret")) as running, connect(running) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock)[0] == 401
    with serving() as running, connect(running) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: attacker.example\r\n\r\n")
        assert read_response(sock)[0] == 403


@pytest.mark.skipif(resource.getrlimit(resource.RLIMIT_NOFILE)[1] == resource.RLIM_INFINITY,
                    reason="no finite hard limit to raise to")
def test_the_open_files_soft_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        assert raise_open_files_limit() == hard
        assert resource.getrlimit(resource.RLIMIT_NOFILE) == (hard, hard)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
