"""The package's layering, read from its imports: lower layers never import higher ones.

A request flows API -> engine -> scheduler -> KV cache manager -> runner -> model -> kernels;
each unit below may only import units of lower layers (or itself). This keeps the scheduler
free of the runner, the runner free of the scheduler's Request objects, and the kernels free
of everything else, so a runner can move to another process and a kernel can be tested alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "pagedllm"

# Unit -> layer. A unit is a subpackage or a top-level module of pagedllm.
LAYERS = {
    "envs": -1,  # reading PAGEDLLM_* variables: imports nothing of pagedllm
    "kernels": 0,
    "checks": 0.5,  # type checks the configs and sampling parameters share
    "version": 1, "config": 1, "logger": 1, "threads": 1, "memory": 1, "sampling_params": 1, "outputs": 1, "lora": 1, "inputs": 1,
    "request": 2,
    "kv_cache": 3, "kv_connector": 3, "attention": 3, "sampler": 3, "quantization": 3,
    "scheduler": 4, "model": 4, "spec_decode": 4,
    "runner": 5, "tokenizer": 5, "structured_output": 5, "distributed": 5,
    "executor": 6,
    "engine": 7,
    "data_parallel": 7.5,  # replicas of the engine in processes, behind a load balancer
    "entrypoints": 8,
    "bench": 9,
    "cli": 10, "__init__": 10,
}  # fmt: skip
# What ``from pagedllm import X`` resolves to (the package root re-exports these).
ROOT_EXPORTS = {"LLM": "entrypoints", "TextPrompt": "inputs", "TokensPrompt": "inputs", "LoRARequest": "lora", "SamplingParams": "sampling_params", "StructuredOutputsParams": "sampling_params", "RequestOutput": "outputs",
                "CompletionOutput": "outputs", "__version__": "version"}  # fmt: skip


def unit_of_path(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel.parts[:2] == ("entrypoints", "cli.py"):
        return "cli"
    return rel.parts[0].removesuffix(".py")


def unit_of_module(module: str) -> str:
    parts = module.split(".")
    if parts[:3] == ["pagedllm", "entrypoints", "cli"]:
        return "cli"
    return parts[1] if len(parts) > 1 else "__init__"


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, unit) for every pagedllm import of a file, deferred imports included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "pagedllm":
            if node.module == "pagedllm":
                out += [(node.lineno, ROOT_EXPORTS[a.name]) for a in node.names]
            else:
                out.append((node.lineno, unit_of_module(node.module)))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, unit_of_module(a.name)) for a in node.names if a.name.split(".")[0] == "pagedllm"]
    return out


FILES = sorted(ROOT.rglob("*.py"))


def test_every_unit_has_a_layer():
    assert {unit_of_path(p) for p in FILES} <= set(LAYERS)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_only_go_down(path):
    src = unit_of_path(path)
    bad = [f"line {line}: {src} (layer {LAYERS[src]}) imports {dst} (layer {LAYERS[dst]})"
           for line, dst in imports(path) if dst != src and LAYERS[dst] >= LAYERS[src]]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_kernels_import_nothing_else():
    for path in (ROOT / "kernels").rglob("*.py"):
        assert {dst for _, dst in imports(path)} <= {"kernels", "envs"}, path
    assert imports(ROOT / "envs.py") == []


def test_the_runner_never_touches_requests():
    """The runner works from the step's plain data, never the scheduler's Request objects."""
    for path in (ROOT / "runner").rglob("*.py"):
        assert "request" not in {dst for _, dst in imports(path)}, path
        text = path.read_text()
        assert ".request." not in text and "all_token_ids" not in text, path
