"""LoRA with ``--data-parallel-size 2``: adapters from --lora-modules and loaded at run time are
in every replica (concurrent requests, spread over both, give the same greedy text); unloading
removes them from all."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
import torch

from tests.entrypoints.server_utils import ServerProcess
from tests.lora.adapters import make_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_llama_tok, tmp_path_factory):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_tok), dtype=torch.float32).eval()
    d = tmp_path_factory.mktemp("dp-adapters")
    return {"a": make_peft_adapter(hf, d / "a", 4, ALL, seed=1, b_std=0.5),
            "c": make_peft_adapter(hf, d / "c", 2, ["o_proj", "up_proj"], seed=3, b_std=0.5)}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_llama_tok, adapters):
    proc = ServerProcess(
        ["--model", str(tiny_llama_tok), "--served-model-name", "tiny", "--num-kv-blocks", "128", "--enable-lora",
         "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a={adapters['a']}", "--data-parallel-size", "2"],
        env={"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0


def _texts(server, model: str, n: int = 6) -> list[str]:
    """n concurrent greedy requests: the balancer spreads them over both replicas."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    def one(_: int) -> str:
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_adapters_in_every_replica(server, adapters):
    base, a = _texts(server, "tiny"), _texts(server, "a")
    assert len(set(base)) == 1 and len(set(a)) == 1 and base[0] != a[0]
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])}, timeout=60)
    assert r.status_code == 200, r.text
    c = _texts(server, "c")
    assert len(set(c)) == 1 and c[0] not in (base[0], a[0])
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=60).status_code == 200
    body = {"model": "c", "prompt": "x", "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 404
    bad = {"lora_name": "d", "lora_path": "/no/such/adapter"}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=bad, timeout=60).status_code == 400
