"""User-facing errors: one line, no traceback, non-zero exit."""

from __future__ import annotations

from collections.abc import Iterable


class NbsimError(Exception):
    """A problem with the user's input that the CLI reports as one line and exit status 2.

    Control characters in the message (say, from a quoted argument) are escaped so it stays one line.
    """

    def __init__(self, message: str):
        super().__init__("".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message)))


class InputFileError(NbsimError):
    """A malformed or missing input file; the message names the file and, where known, the line."""

    def __init__(self, path: str, message: str, line_number: int | None = None):
        where = f"{path}:{line_number}" if line_number is not None else str(path)
        super().__init__(f"{where}: {message}")
        self.path = path
        self.line_number = line_number


def signal_name(signum: int) -> str:
    """A signal's name for a message (SIGKILL), or its number where the enumeration names none (a real-time
    signal: `signal.Signals` raises for those)."""
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' (did you mean X?)' for the known name closest to a misspelt one (difflib), else ''."""
    from difflib import get_close_matches

    close = get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""
