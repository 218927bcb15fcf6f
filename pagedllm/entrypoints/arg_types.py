"""argparse ``type=`` checks for the command line: a bad value is a usage error naming the flag,
reported when the flags are read, before a model loads or a long job starts."""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable


def _number(cast: Callable[[str], float], low: float, strict: bool, what: str, allow_inf: bool = False) -> Callable[[str], float]:
    def check(value: str):
        try:
            x = cast(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {what}: {value!r}") from None
        if isinstance(x, float) and math.isnan(x) or (x <= low if strict else x < low):
            raise argparse.ArgumentTypeError(f"must be {'above' if strict else 'at least'} {low:g}, got {value}")
        if isinstance(x, float) and math.isinf(x) and not allow_inf:
            raise argparse.ArgumentTypeError(f"must be finite, got {value}")
        return x

    return check


positive_int = _number(int, 1, False, "an integer")
non_negative_int = _number(int, 0, False, "an integer")
positive_float = _number(float, 0, True, "a number")
non_negative_float = _number(float, 0, False, "a number")
# Where infinity means something ("never", "all at once"): a request rate, a log interval.
positive_float_or_inf = _number(float, 0, True, "a number", allow_inf=True)
non_negative_float_or_inf = _number(float, 0, False, "a number", allow_inf=True)


def tcp_port(value: str) -> int:
    port = non_negative_int(value)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0 to 65535, got {port}")
    return port


def output_dir(value: str) -> str:
    """A directory to write into: it may not exist yet, but it is no file."""
    if os.path.exists(value) and not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} exists and is not a directory")
    return value


def result_path(value: str) -> str:
    """A file to write a result to: its directory must exist before the run, not after it."""
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"cannot write {value!r}: no such directory {parent!r}")
    if os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"{value!r} is a directory")
    return value


def comma_list(*choices: str) -> Callable[[str], str]:
    """A comma-separated list of ``choices`` (a typo would otherwise select nothing and the run
    would end having done nothing); returns the text as given."""

    def check(value: str) -> str:
        names = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [n for n in names if n not in choices]
        if not names or unknown:
            raise argparse.ArgumentTypeError(f"choose from {', '.join(choices)} (comma-separated), got {value!r}")
        return value

    return check


def positive_int_list(value: str) -> str:
    """A comma-separated list of positive integers (may be empty); returns the text as given."""
    for item in (v for v in value.split(",") if v.strip()):
        positive_int(item)
    return value


def existing_dir(value: str) -> str:
    if not os.path.isdir(value):
        raise argparse.ArgumentTypeError(f"no such directory: {value!r}")
    return value
