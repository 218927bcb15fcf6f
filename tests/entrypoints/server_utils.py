"""Start a real ``pagedllm serve`` process on 127.0.0.1 for tests (bench/common.py's launcher)."""

from __future__ import annotations

import httpx

from pagedllm.bench.common import CliProcess, free_port

__all__ = ["ServerProcess", "free_port"]


class ServerProcess(CliProcess):
    def __init__(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 180):
        super().__init__(["serve", *args], env, timeout)

    def metric(self, name: str) -> float:
        """Sum of a metric's samples (all label sets) from /metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        total, found = 0.0, False
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"{name} not in /metrics"
        return total

    def stop(self, timeout: float = 60) -> int:
        return super().stop(timeout)
