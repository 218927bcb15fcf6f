"""Type checks shared by the configs and the sampling parameters, which validate their fields
by hand: bools are ints to Python, and NaN is a float, and neither is a valid count or weight."""

from __future__ import annotations

import math
from typing import Any


def is_int(x: Any) -> bool:
    """An integer that is not a bool (True would pass isinstance(x, int) as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """A finite real number (NaN and infinities are refused everywhere)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def check_bools(obj: Any, names: tuple[str, ...], prefix: str = "", optional: bool = False) -> None:
    """ValueError naming the first of ``obj``'s fields ``names`` that is not a bool ("yes", 1 or
    None would read as one); ``optional``: None is allowed too."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool) and not (optional and value is None):
            raise ValueError(f"{prefix}{name} must be true or false, got {value!r}")
