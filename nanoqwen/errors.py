"""InvalidInputError: the one error type for bad input at every boundary of nanoqwen."""

from __future__ import annotations


class InvalidInputError(ValueError):
    """Bad input: a checkpoint file, an engine argument, a sampling parameter, a prompt or a
    command-line flag. The message is one line that names the file or parameter, the value
    and what is allowed, so a front end can show it as it is: the CLI prints it and exits 2,
    the HTTP server answers 400 with it. `param` is the parameter's API name, when one is to
    blame, so a front end can respell it (the CLI says --block-size for block_size).

    A subclass of ValueError, so `except ValueError` keeps working."""

    def __init__(self, message: str, param: str | None = None) -> None:
        message = " ".join(str(message).split())  # one line, whatever went into it
        super().__init__(message)
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return self.message
