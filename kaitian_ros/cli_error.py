"""The error of a ``kaitian`` command that the user caused: the command prints it as one line."""

from __future__ import annotations


class CliError(Exception):
    """A user error: printed as one line, exit code 2 (or the code given)."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code
