"""What every command of this project shares: a mistake the user can fix ends in one line.

`fail(message)` stops a command with `error: MESSAGE` on stderr and exit status 1, no
traceback; the parser's own errors (a missing or mistyped option) end the same way, without
argparse's usage dump; `check_at_least` names a count given below the values it can take;
`quiet` leaves a tool's result as the one thing it prints.
"""

import argparse
from typing import NoReturn


def fail(message: str) -> NoReturn:
    raise SystemExit(f"error: {message}")


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        fail(f"{message} (see --help)")


def check_at_least(args: argparse.Namespace, **lowest: int) -> None:
    """Each option named (as its attribute) is absent, unset or at least its lowest value."""
    for name, low in lowest.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            fail(f"--{name.replace('_', '-')} must be at least {low}, got {value}")


def quiet() -> None:
    """Only warnings and errors from fairseq's loggers and Python's warnings: the result is one line."""
    import logging
    import warnings

    logging.getLogger().setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")
