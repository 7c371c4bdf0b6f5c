"""The subcommands' own options: argparse whose errors are nbsim's one-line errors (exit status 2), and that
tells a user who gave nanoBragg flags among them to put those after `--`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from ..errors import NbsimError
from ..nanobragg.flags import TABLE

NANOBRAGG_FLAGS = frozenset(name for flag in TABLE for name in flag.names)


class CommandParser(argparse.ArgumentParser):
    """argparse for `nbsim COMMAND`: an error raises NbsimError('COMMAND: message' + `advice`) instead of
    exiting; for a command that takes nanoBragg flags after `--` (`takes_flags`), unrecognized arguments
    that hold one name the fix, since argparse alone reads `nbsim fit IMAGE -cell ...` as unknown options
    and says no more."""

    def __init__(self, command: str, advice: str = "", takes_flags: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.command, self.advice, self.takes_flags = command, advice, takes_flags

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """The options; unrecognized arguments are an error (naming `--` where they hold a nanoBragg flag)."""
        options, unknown = self.parse_known_args(args, namespace)
        if unknown:
            flags = [token for token in unknown if token in NANOBRAGG_FLAGS and self.takes_flags]
            fix = f"; nanoBragg flags go after --: {self.prog} [options] -- {flags[0]} ..." if flags else ""
            self.error(f"unrecognized arguments: {' '.join(unknown)}{fix}")
        return options

    def error(self, message: str) -> NoReturn:
        """nbsim's one-line error, exit status 2, in place of argparse's usage and exit."""
        raise NbsimError(f"{self.command}: {message}{self.advice}")


def split_model_flags(argv: list[str]) -> tuple[list[str], list[str]]:
    """A command's own options and the nanoBragg flags after its `--` (none without one)."""
    if "--" not in argv:
        return list(argv), []
    split = argv.index("--")
    return argv[:split], argv[split + 1:]
