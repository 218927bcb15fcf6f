"""Scheduling policies: the order of the waiting queue and the choice of preemption victim.

``fcfs``: arrival order; preempted requests return to the front; the victim is the most
recently admitted running request. ``priority``: lower ``priority`` value first, ties by
arrival; the victim is the running request with the largest (priority, arrival); a waiting
request may preempt running requests of lower priority to get in.
"""

from __future__ import annotations

import bisect
from collections import deque
from typing import Iterator

from pagedllm.request import Request

POLICIES = ("fcfs", "priority")


def _key(r: Request) -> tuple[int, float]:
    return (r.priority, r.arrival_time)


class WaitingQueue:
    """The waiting requests, kept in the policy's order."""

    def __init__(self, policy: str):
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self._items: deque[Request] | list[Request] = deque() if policy == "fcfs" else []

    def add(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._items.append(req)
        else:
            bisect.insort(self._items, req, key=_key)

    def add_preempted(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._items.appendleft(req)  # type: ignore[union-attr]
        else:
            self.add(req)

    def prepend(self, reqs: list[Request]) -> None:
        """Put back requests popped in this order (skipped by one step), ahead of the rest."""
        if self.policy == "fcfs":
            self._items.extendleft(reversed(reqs))  # type: ignore[union-attr]
        else:
            for req in reqs:
                self.add(req)

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        return self._items.popleft() if self.policy == "fcfs" else self._items.pop(0)  # type: ignore[union-attr]

    def remove(self, req: Request) -> None:
        self._items.remove(req)

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __contains__(self, req: object) -> bool:
        return req in self._items


def pick_victim(running: list[Request], policy: str) -> Request:
    """The running request to preempt when blocks run out."""
    if policy == "fcfs":
        return running[-1]
    return max(running, key=_key)


def check_priority(priority: int, policy: str) -> None:
    """A non-zero priority only means something under the priority policy: refused otherwise
    (as vLLM), rather than silently ignored."""
    if priority != 0 and policy != "priority":
        raise ValueError(f"priority is not supported with the '{policy}' scheduling policy (start the engine with "
                         "scheduling_policy='priority', or the server with --scheduling-policy priority)")  # fmt: skip


def outranks(waiting: Request, running: Request) -> bool:
    """Under the priority policy, may ``waiting`` preempt ``running`` to get in?"""
    return _key(waiting) < _key(running)
