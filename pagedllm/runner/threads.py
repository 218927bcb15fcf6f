"""CPU thread settings for the model step.

Intra-op threads = usable cores (``PAGEDLLM_NUM_THREADS`` overrides), one inter-op thread:
the step is a chain of dependent ops, and extra pools only contend for the same cores.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("pagedllm.runner")


def configure_threads() -> int:
    env = os.environ.get("PAGEDLLM_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError as e:
            raise ValueError(f"PAGEDLLM_NUM_THREADS must be an integer, got {env!r}") from e
    else:
        n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n < 1:
        raise ValueError(f"PAGEDLLM_NUM_THREADS must be at least 1, got {n}")
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first parallel op of the process
        pass
    return n
