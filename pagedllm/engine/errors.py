"""Errors the engine raises to its callers, each meaning one thing to a client."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine hit a fault it could not pin on one request and stopped; nothing more will run.

    Servers answer 503 and exit non-zero so a supervisor restarts them.
    """


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (``max_waiting_requests``); the client should retry later (503)."""
