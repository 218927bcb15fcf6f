"""Errors the engine raises to its callers, each meaning one thing to a client."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine hit a fault it could not pin on one request and stopped; nothing more will run.

    Servers answer 503 and exit non-zero so a supervisor restarts them.
    """


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (``max_waiting_requests``); the client should retry later (503)."""


def check_queue_room(waiting: int, adding: int, cap: int | None, where: str = "") -> None:
    """Room for ``adding`` requests in a queue of at most ``cap`` waiting ones (None: no cap).

    Both sides count what the waiting gauge counts: one per sample (n, or best_of, of each
    prompt; ``ProcessedRequest.queue_entries``). More than ``cap`` at once is the request's
    fault (a ValueError: retrying never helps); more than the room left now is overload (the
    client may retry).
    """
    if cap is None:
        return
    if adding > cap:
        raise ValueError(f"the request makes {adding} requests to queue (one per prompt and sample, n or best_of); "
                         f"the server queues at most {cap} (max_waiting_requests)")  # fmt: skip
    if waiting + adding > cap:
        raise EngineOverloadedError(
            f"the server is overloaded: {waiting} requests are waiting{where} (max_waiting_requests={cap}); retry later"
        )
