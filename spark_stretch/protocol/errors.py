"""Error codes of the stretch protocol, and the exceptions each side raises for them.

A failed request is answered with ``{"ok": false, "code": <ErrorCode>, "error": <message>}``.
The process that fails raises a :class:`StretchError` subclass (its class names the code); the
process that asked gets a :class:`RemoteError` with the same code and message, so it can tell
rows the engine refused from a dead instance or a bug without parsing text.

Examples
--------
>>> from spark_stretch.protocol.errors import ErrorCode, InputRejected, error_reply
>>> error_reply(InputRejected("keys column 'k' has 1 null keys"))["code"]
'INPUT_REJECTED'
>>> error_reply(ZeroDivisionError("division by zero"))["error"]
'ZeroDivisionError: division by zero'
"""

from __future__ import annotations

import traceback
from enum import Enum

__all__ = ["ErrorCode", "StretchError", "BadRequest", "UnknownQuery", "NotOffered",
           "InputRejected", "UserFunctionError", "InstanceDiedError", "StateError",
           "InjectedFault", "RemoteError", "error_reply"]


class ErrorCode(str, Enum):
    """Why a request failed."""

    BAD_REQUEST = "BAD_REQUEST"        # not a frame, unknown op, wrong fields, other version
    UNKNOWN_QUERY = "UNKNOWN_QUERY"    # the query is not open on this engine
    NOT_OFFERED = "NOT_OFFERED"        # nothing is offered on the stream read
    INPUT_REJECTED = "INPUT_REJECTED"  # rows the engine cannot take (a null key, ...)
    USER_FUNCTION = "USER_FUNCTION"    # the drop-in's function raised
    INSTANCE_DIED = "INSTANCE_DIED"    # an instance process of the drop-in died
    STATE = "STATE"                    # the state cannot be had: checkpoint, log, replay
    FAULT = "FAULT"                    # injected by a test
    INTERNAL = "INTERNAL"              # anything else (a bug): the message names its type


class StretchError(RuntimeError):
    """An error with a protocol code, raised where it happens."""

    code = ErrorCode.INTERNAL


class BadRequest(StretchError, ValueError):
    """The request is not one this side understands (refused; the connection is closed)."""

    code = ErrorCode.BAD_REQUEST


class UnknownQuery(StretchError, KeyError):
    """The request names a query that is not open here."""

    code = ErrorCode.UNKNOWN_QUERY

    def __str__(self) -> str:  # (KeyError would quote it)
        return str(self.args[0]) if self.args else ""


class NotOffered(StretchError, KeyError):
    """A read of a stream nothing is offered on."""

    code = ErrorCode.NOT_OFFERED

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class InputRejected(StretchError, ValueError):
    """Rows the engine cannot take; the message names the column and the batch."""

    code = ErrorCode.INPUT_REJECTED


class UserFunctionError(StretchError):
    """The user's function (or the conversion of what it returned) raised in an instance."""

    code = ErrorCode.USER_FUNCTION


class InstanceDiedError(StretchError):
    """An instance process died while it ran a batch."""

    code = ErrorCode.INSTANCE_DIED


class StateError(StretchError):
    """The state a request needs cannot be had (a checkpoint missing or of an unknown format, a
    batch neither pending nor logged, a state left unusable by an earlier failure)."""

    code = ErrorCode.STATE


class InjectedFault(StretchError):
    """A failure caused on purpose by a test."""

    code = ErrorCode.FAULT


class RemoteError(RuntimeError):
    """A request failed on the other side: ``code`` says why, the message is the other side's.

    Parameters
    ----------
    code : ErrorCode
    message : str
    """

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


def error_reply(e: BaseException) -> dict:
    """The failed reply for ``e``: its code, and its message (with the exception's type and
    where it was raised, where the code does not say what happened)."""
    if isinstance(e, StretchError):
        return {"ok": False, "code": e.code.value, "error": str(e)}
    where = traceback.extract_tb(e.__traceback__)[-1:] if e.__traceback__ else []
    at = "".join(f" (at {f.filename.rsplit('/', 1)[-1]}:{f.lineno} in {f.name})" for f in where)
    return {"ok": False, "code": ErrorCode.INTERNAL.value,
            "error": f"{type(e).__name__}: {e}{at}"}


def raise_for(reply: dict) -> None:
    """Raise the :class:`RemoteError` of a failed reply (an unknown code counts as INTERNAL)."""
    if reply.get("ok"):
        return
    try:
        code = ErrorCode(reply.get("code"))
    except ValueError:
        code = ErrorCode.INTERNAL
    raise RemoteError(code, str(reply.get("error", "unknown error")))
