"""Start a real ``pagedllm serve`` process on 127.0.0.1 for tests (bench/common.py's launcher)."""

from __future__ import annotations

import httpx

from pagedllm.bench.common import CliProcess, free_port

__all__ = ["ServerProcess", "free_port"]


class ServerProcess(CliProcess):
    def __init__(self, args: list[str], env: dict[str, str] | None = None, timeout: float = 180):
        super().__init__(["serve", *args], env, timeout)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples from /metrics: all label sets, or those with ``labels``."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        total, found = 0.0, False
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                if not all(w in line.rsplit(" ", 1)[0] for w in wanted):
                    continue
                total += float(line.rsplit(" ", 1)[1])
                found = True
        assert found, f"{name} not in /metrics"
        return total

    def stop(self, timeout: float = 60) -> int:
        return super().stop(timeout)
