"""Test-only fault injection, so the engine's fault handling is exercised end to end.

``PAGEDLLM_FAULT_INJECTION`` holds comma-separated rules (unset in production: every check is
then one ``if`` on an empty tuple):

- ``request_token=T``: the model step raises whenever a scheduled request's prompt contains
  token id T, like a kernel fault triggered by one request's data. The engine must pin it on
  that request and fail only that one.
- ``engine_token=T``: the engine raises outside any request's work (right after scheduling)
  when such a request is scheduled: a fault it cannot attribute, which ends the engine.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

logger = logging.getLogger("pagedllm.engine")


class InjectedFault(RuntimeError):
    pass


class FaultInjector:
    def __init__(self, spec: str | None = None):
        spec = os.environ.get("PAGEDLLM_FAULT_INJECTION", "") if spec is None else spec
        self.request_tokens: tuple[int, ...] = ()
        self.engine_tokens: tuple[int, ...] = ()
        for rule in filter(None, (r.strip() for r in spec.split(","))):
            kind, _, value = rule.partition("=")
            if kind == "request_token":
                self.request_tokens += (int(value),)
            elif kind == "engine_token":
                self.engine_tokens += (int(value),)
            else:
                raise ValueError(f"PAGEDLLM_FAULT_INJECTION: unknown rule {rule!r}")
        if self.request_tokens or self.engine_tokens:
            logger.warning("fault injection is ON (%s): for tests only", spec)

    @staticmethod
    def _hit(tokens: tuple[int, ...], prompts: Iterable[list[int]]) -> int | None:
        for ids in prompts:
            for t in tokens:
                if t in ids:
                    return t
        return None

    def before_model_step(self, prompts: Iterable[list[int]]) -> None:
        if self.request_tokens and (t := self._hit(self.request_tokens, prompts)) is not None:
            raise InjectedFault(f"injected model-step fault (request_token={t})")

    def after_schedule(self, prompts: Iterable[list[int]]) -> None:
        if self.engine_tokens and (t := self._hit(self.engine_tokens, prompts)) is not None:
            raise InjectedFault(f"injected engine fault (engine_token={t})")
