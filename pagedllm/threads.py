"""CPU thread settings for the model step.

Intra-op threads = usable cores (``PAGEDLLM_NUM_THREADS`` overrides), one inter-op thread:
the step is a chain of dependent ops, and extra pools only contend for the same cores.

Only the thread that steps the model may run OpenMP teams. OpenMP (torch's libgomp, which the
native kernels share) keeps its workers spinning between parallel regions only while it manages
no more threads than there are cores; a second team - made by any other thread running one
parallel torch op, once - makes it put every worker to sleep after each region and wake it at
the next, for the rest of the process. Measured on 2 cores: a served W2 step went from 5.6 to
12-13 ms per token after one structured-output request compiled its grammar on a helper thread.
So helper threads (``single_thread``) and, in the server, the event loop's thread run torch ops
on one thread, which makes no team.
"""

from __future__ import annotations

import os

import torch


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
    torch.get_num_threads()  # torch's lazy per-thread setup happens now, with n (not a helper's 1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # only settable before the first parallel op of the process
        pass
    return n


def single_thread() -> None:
    """Make the calling (helper) thread run torch ops without an OpenMP team; for a thread
    pool's ``initializer``. The model step's thread calls ``configure_threads`` instead."""
    torch.set_num_threads(1)
    torch.get_num_threads()  # torch's lazy per-thread setup happens now, with this value
