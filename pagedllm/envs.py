"""PAGEDLLM_* environment variables read one way everywhere: a switch accepts 1/true/yes/on and
0/false/no/off (any case), a number must parse; anything else is a ValueError naming the
variable, never a silent default."""

from __future__ import annotations

import math
import os

_ON, _OFF = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name`` (unset or empty: ``default``)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise ValueError(f"{name} must be one of {'/'.join(_ON)} or {'/'.join(_OFF)}, got {os.environ[name]!r}")


def env_seconds(name: str, default: float) -> float:
    """A positive, finite number of seconds in ``name`` (unset or empty: ``default``)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name} must be a positive, finite number of seconds, got {value!r}")
    return seconds
