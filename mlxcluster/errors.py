"""The one kind of error a user can act on.

Every module of the controller raises a subclass of `UserError` for what the user can fix (a bad
option, a cluster that is not provisioned, a failed run), with a message that says what to do.
`tasks.py` turns it into invoke's `Exit` in one place; anything else is a bug and keeps its
traceback.
"""

from __future__ import annotations


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
    its escapes (a newline in a path would otherwise split the message)."""
    text = str(value)
    return text if text.isprintable() and len(text) <= 300 else repr(text[:300])
