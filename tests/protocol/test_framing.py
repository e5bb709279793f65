"""One request's wait for its reply (protocol/framing.call): bounded, or as long as the server lives."""

import socket
import threading
import time

import pytest

from spark_stretch.protocol.framing import call, read_header, write_header


def _server(path, delay: float, answer: bool = True):
    """A Unix socket server answering one request after ``delay`` s (or never)."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        try:
            with conn, conn.makefile("rwb") as f:
                req = read_header(f)
                time.sleep(delay)
                if answer:
                    write_header(f, {"ok": True, "echo": req["op"]})
                else:
                    time.sleep(30)
        except OSError:
            pass  # (the client gave up first)

    threading.Thread(target=serve, daemon=True).start()
    return srv


def test_a_reply_slower_than_any_bound_arrives_while_the_server_lives(tmp_path):
    srv = _server(tmp_path / "s.sock", delay=1.5)
    try:
        polls = []
        t0 = time.monotonic()
        got = call(str(tmp_path / "s.sock"), {"op": "step"}, timeout=None,
                   alive=lambda: polls.append(1) or True, poll=0.2)
        assert got["echo"] == "step"
        assert time.monotonic() - t0 >= 1.4 and len(polls) >= 5  # it waited, asking
    finally:
        srv.close()


def test_a_bounded_wait_fails_at_its_bound(tmp_path):
    srv = _server(tmp_path / "s.sock", delay=3.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="did not answer 'step'"):
            call(str(tmp_path / "s.sock"), {"op": "step"}, timeout=0.5)
        assert time.monotonic() - t0 < 2.5
    finally:
        srv.close()


def test_an_unbounded_wait_ends_when_the_server_is_gone(tmp_path):
    srv = _server(tmp_path / "s.sock", delay=0.0, answer=False)
    up = {"n": 3}

    def alive():
        up["n"] -= 1
        return up["n"] > 0

    try:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="found down while its reply"):
            call(str(tmp_path / "s.sock"), {"op": "step"}, timeout=None, alive=alive, poll=0.2)
        assert time.monotonic() - t0 < 5
    finally:
        srv.close()


def test_an_unbounded_wait_needs_a_liveness_check(tmp_path):
    with pytest.raises(ValueError, match="alive"):
        call(str(tmp_path / "none.sock"), {"op": "step"}, timeout=None)
