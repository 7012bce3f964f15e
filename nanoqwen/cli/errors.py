"""The `nanoqwen` command's own error types; every failure prints as one line
`nanoqwen: error: ...` (cli/__init__.py) with errors.exit_code's status."""

from __future__ import annotations

from nanoqwen.errors import EngineError


class CLIError(EngineError):
    """A failure while running, reported as one line `nanoqwen: error: ...`; exit status 1."""

    code = 1


class UsageError(CLIError):
    """Bad input on the command line; exit status 2, argparse's convention."""

    code = 2


class ArgumentError(UsageError):
    """argparse's complaint about the command line."""
