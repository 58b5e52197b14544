"""The one kind of error a user can act on.

Every module of the controller raises a subclass of `UserError` for what the user can fix (a bad
option, a cluster that is not provisioned, a failed run), with a message that says what to do.
`tasks.py` turns it into invoke's `Exit` in one place; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations

import json
import reprlib

# A container in a message: a few items of a few levels (one whose YAML aliases nest, a "billion
# laughs", would otherwise be expanded for ever).
_CONTAINER = reprlib.Repr()
_CONTAINER.maxlevel, _CONTAINER.maxdict, _CONTAINER.maxlist, _CONTAINER.maxtuple = 3, 4, 4, 4
_CONTAINER.maxset, _CONTAINER.maxstring, _CONTAINER.maxother = 4, 60, 60


class UserError(Exception):
    """Something the user can fix; the message says what. `code` is the exit status to end with."""

    def __init__(self, message: str = "", code: int = 1):
        super().__init__(message)
        self.code = code


class Interrupted(UserError):
    """Ctrl-C, after whatever was running was stopped everywhere."""

    def __init__(self, message: str):
        super().__init__(message, code=130)


def shown(value: object) -> str:
    """A value as a one-line message shows it: as it is when it prints plainly, else quoted with
    its escapes (a newline in a path would otherwise split the message); a container in short."""
    text = _CONTAINER.repr(value) if isinstance(value, (dict, list, tuple, set)) else str(value)
    return text if text.isprintable() and len(text) <= 300 else repr(text[:300])


def reason(error: BaseException) -> str:
    """Why a file could not be read, in a user's words rather than Python's: an OS error by its
    description, a JSON one by where it breaks, anything else in one short line."""
    if isinstance(error, json.JSONDecodeError):
        return f"not valid JSON: {error.msg.lower()} at line {error.lineno}, column {error.colno}"
    if isinstance(error, UnicodeDecodeError):
        return "not UTF-8 text"
    if isinstance(error, RecursionError):
        return "nested too deeply"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror.lower()
    return " ".join(str(error).split())[:200] or type(error).__name__
