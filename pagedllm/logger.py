"""Readable logs: one handler on the "pagedllm" logger, level from PAGEDLLM_LOGGING_LEVEL."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def configure_logging(tag: str = "") -> None:
    """``tag``: put in front of every message (a worker process's "[rank 1] ")."""
    root = logging.getLogger("pagedllm")
    if getattr(root, "_pagedllm_configured", False):
        return
    level = os.environ.get("PAGEDLLM_LOGGING_LEVEL", "INFO").upper()
    if level not in logging.getLevelNamesMapping():
        raise ValueError(f"PAGEDLLM_LOGGING_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, got {level!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT.replace("%(message)s", tag + "%(message)s"), datefmt="%m-%d %H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False
    root._pagedllm_configured = True  # type: ignore[attr-defined]
