"""Who may talk to a host engine over TCP: peers of the same application, proven by a secret.

A host engine of a multi-host query listens on a TCP port (bound to its host's address, never
a wildcard) besides its Unix socket, so executors and the driver on other hosts reach it. Every
TCP connection starts with a challenge before any frame is read: the engine sends
:data:`MAGIC` and a fresh 16-byte nonce, the peer answers with
``HMAC-SHA256(secret, MAGIC + nonce)`` (32 bytes). A wrong answer, a short one, or none
within the timeout closes the connection (the engine logs it and serves the others): the
secret itself never crosses the network, and an answer cannot be replayed on another
connection. The Unix socket needs no challenge: only processes of the host's user reach it.

The secret is per application: the driver makes one (or takes Spark's own
``spark.authenticate.secret``) and hands it to each engine on its standard input and to the
executors as the data source's ``secret`` option (Spark redacts options so named in its UI
and logs). The JVM shim (``ReceiverClient.scala``) answers the same challenge.

Examples
--------
>>> import socket
>>> from spark_stretch.protocol.auth import answer, challenge, verify
>>> a, b = socket.socketpair()
>>> with a.makefile("rwb") as fa, b.makefile("rwb") as fb:
...     nonce = challenge(fa)
...     answer(fb, b"s3cret")
...     verify(fa, b"s3cret", nonce)
True
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

__all__ = ["MAGIC", "NONCE_BYTES", "MAC_BYTES", "new_secret", "challenge", "answer", "verify",
           "AuthError"]

MAGIC = b"STRETCH-AUTH-1\n"
NONCE_BYTES = 16
MAC_BYTES = 32


class AuthError(ConnectionError):
    """A TCP peer that did not prove it knows the application's secret (or the engine's
    challenge did not come: not a stretch engine)."""


def new_secret() -> bytes:
    """A fresh application secret (32 random bytes, as hex text: it travels in options)."""
    return secrets.token_hex(32).encode()


def _mac(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, MAGIC + nonce, hashlib.sha256).digest()


def challenge(f) -> bytes:
    """Server side: send the challenge on binary file ``f``; the nonce to :func:`verify` with."""
    nonce = os.urandom(NONCE_BYTES)
    f.write(MAGIC + nonce)
    f.flush()
    return nonce


def verify(f, secret: bytes, nonce: bytes) -> bool:
    """Server side: whether the peer's answer on ``f`` proves ``secret`` (reads 32 bytes at
    most; the caller's socket timeout bounds the wait)."""
    got = f.read(MAC_BYTES)
    return len(got) == MAC_BYTES and hmac.compare_digest(got, _mac(secret, nonce))


def answer(f, secret: bytes) -> None:
    """Client side: read the engine's challenge on ``f`` and answer it with ``secret``."""
    head = f.read(len(MAGIC) + NONCE_BYTES)
    if len(head) < len(MAGIC) + NONCE_BYTES or not head.startswith(MAGIC):
        raise AuthError("the peer sent no stretch challenge (not a stretch engine, or it "
                        "closed the connection)")
    f.write(_mac(secret, head[len(MAGIC):]))
    f.flush()
