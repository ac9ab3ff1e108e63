"""User errors that name their argument, shared by the Python API and the command line.

The API raises :class:`ArgumentError` (a ValueError) naming the parameter, ``max_model_len: ...``;
``flashdsa.cli`` prints the same error as one line naming the flag, ``argument --max-model-len:
...``, and exits 2.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class ArgumentError(ValueError):
    """``argument`` (a parameter such as ``model``, a flag such as ``--port``, or a positional such
    as ``DIR``) cannot be used; ``message`` says why and what to pass instead."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument, self.message = argument, message

    @property
    def flag(self) -> str:
        """The command-line spelling: ``max_model_len`` -> ``--max-model-len``; flags and
        upper-case positionals (``DIR``) as they are."""
        if self.argument.startswith("-") or self.argument.isupper():
            return self.argument
        return "--" + self.argument.replace("_", "-")


@contextmanager
def blame(argument: str, errors: tuple[type[BaseException], ...] = (ValueError, OSError)) -> Iterator[None]:
    """Re-raise ``errors`` from the block as an :class:`ArgumentError` of ``argument`` (an
    ArgumentError raised inside keeps the argument it names)."""
    try:
        yield
    except ArgumentError:
        raise
    except errors as exc:
        raise ArgumentError(argument, str(exc)) from exc
