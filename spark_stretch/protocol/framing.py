"""A frame on a stretch socket, and one request to a host engine (Unix socket or TCP).

One request per connection: a 4-byte big-endian length and a UTF-8 JSON object (the header, see
:mod:`.messages`), then, for a ``write``, an Arrow IPC stream. The reply is a framed header
(``{"ok": true, ...}`` or a failed reply of :mod:`.errors`), then, for ``read``/``schema``, an
Arrow IPC stream. The JVM shim (``ReceiverClient.scala``) speaks the same frames.

A header longer than :data:`MAX_HEADER`, or one that is not a JSON object, is refused as a
:class:`~.errors.BadRequest` before anything else is read: garbage on the socket cannot make the
reader allocate or wait for it.

Examples
--------
>>> import io
>>> from spark_stretch.protocol.framing import read_header, write_header
>>> buf = io.BytesIO()
>>> write_header(buf, {"op": "ping"})
>>> _ = buf.seek(0)
>>> read_header(buf)
{'op': 'ping'}
"""

from __future__ import annotations

import json
import select
import socket
import struct
from typing import Callable, Optional

from .auth import answer
from .errors import BadRequest, raise_for

__all__ = ["MAX_HEADER", "read_header", "write_header", "call", "connect", "tcp_address"]

MAX_HEADER = 1 << 24  # 16 MiB: a spec with a pickled operator is a few KB
_LEN = struct.Struct(">i")


def read_header(f) -> dict:
    """Read one framed header from a binary file object.

    Raises
    ------
    ConnectionError
        The peer closed before a whole header arrived.
    BadRequest
        The length is out of range, or the bytes are not a JSON object.
    """
    head = f.read(4)
    if len(head) < 4:
        raise ConnectionError("peer closed before sending a header")
    (n,) = _LEN.unpack(head)
    if not 0 < n <= MAX_HEADER:
        raise BadRequest(f"a header of {n} bytes: not a stretch frame (at most {MAX_HEADER})")
    body = f.read(n)
    if len(body) < n:
        raise ConnectionError(f"peer closed after {len(body)} of a {n}-byte header")
    try:
        header = json.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise BadRequest("the header is not UTF-8 JSON: not a stretch frame") from None
    if not isinstance(header, dict):
        raise BadRequest(f"the header is a JSON {type(header).__name__}, not an object")
    return header


def write_header(f, obj: dict) -> None:
    """Write one framed header (and flush)."""
    body = json.dumps(obj).encode()
    f.write(_LEN.pack(len(body)) + body)
    f.flush()


def tcp_address(endpoint: str):
    """``(host, port)`` of a ``tcp://host:port`` endpoint, or None (a Unix socket path)."""
    if not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[6:].rpartition(":")
    return host, int(port)


def connect(endpoint: str, timeout: float, secret: bytes = None) -> socket.socket:
    """A connected socket to ``endpoint`` (a Unix socket path, or ``tcp://host:port``: then the
    engine's challenge answered with ``secret``, :mod:`.auth`)."""
    addr = tcp_address(endpoint)
    if addr is None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    else:
        if secret is None:
            raise ValueError(f"'{endpoint}' is a TCP endpoint: a secret is needed to reach it")
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.settimeout(timeout)
        s.connect(endpoint if addr is None else addr)
        if addr is not None:
            with s.makefile("rwb") as f:
                answer(f, secret)
    except BaseException:
        s.close()
        raise
    return s


def call(endpoint: str, header: dict, timeout: Optional[float] = 120.0, secret: bytes = None,
         alive: Optional[Callable[[], bool]] = None, poll: float = 10.0) -> dict:
    """Send one request to the server on ``endpoint`` (a Unix socket path, or
    ``tcp://host:port`` with the application's ``secret``); return its reply header.

    ``timeout`` bounds the connection and the wait for the reply. ``None``: the reply is
    waited for as long as ``alive()`` says the server is up, asked every ``poll`` seconds (a
    micro-batch's step takes as long as its work does; a server that died is found at the next
    poll, if not at once by its closed socket).

    Raises
    ------
    ConnectionError
        The server is gone (its process died or was stopped) or did not answer in time.
    spark_stretch.protocol.errors.RemoteError
        The server answered with a failed reply (its code and message).
    """
    if secret is None and tcp_address(endpoint) is not None:
        raise ValueError(f"'{endpoint}' is a TCP endpoint: a secret is needed to reach it")
    if timeout is None and alive is None:
        raise ValueError("timeout=None needs alive(): a reply waited for without a bound")
    try:
        with connect(endpoint, poll if timeout is None else timeout, secret) as s, \
                s.makefile("rwb") as f:
            write_header(f, header)
            if timeout is None:
                # (nothing read yet: the file's buffer is empty, so the socket tells)
                while not select.select([s], [], [], poll)[0]:
                    if not alive():
                        raise ConnectionError(f"the server was found down while its reply "
                                              f"was awaited (checked every {poll:g} s)")
                # (the reply has begun: the rest follows within the connection's poll timeout)
            reply = read_header(f)
    except (OSError, ConnectionError, ValueError) as e:
        raise ConnectionError(f"stretch engine at '{endpoint}' is unreachable or did not answer "
                              f"'{header.get('op')}' ({type(e).__name__}: {e})") from e
    raise_for(reply)
    return reply
