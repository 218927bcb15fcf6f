"""LoRA over the HTTP server: adapters named in ``--lora-modules`` are listed by /v1/models
(``parent`` = the base) and chosen by a request's ``model``; with
PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1 adapters load and unload at run time while others
serve traffic, and a bad or over-rank adapter is a 400 that changes nothing."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import torch

from tests.entrypoints.server_utils import ServerProcess
from tests.lora.adapters import make_peft_adapter

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapter_dirs(tiny_llama_tok, tmp_path_factory):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_llama_tok), dtype=torch.float32).eval()
    d = tmp_path_factory.mktemp("server-adapters")
    return {
        "a": make_peft_adapter(hf, d / "a", 4, ALL, seed=1, b_std=0.5),
        "b": make_peft_adapter(hf, d / "b", 8, ["q_proj", "v_proj", "down_proj"], seed=2, b_std=0.5),
        "c": make_peft_adapter(hf, d / "c", 2, ["o_proj", "up_proj"], seed=3, b_std=0.5),
        "big": make_peft_adapter(hf, d / "big", 32, ["q_proj"], seed=4),
    }


@pytest.fixture(scope="module")
def server(tiny_llama_tok, adapter_dirs):
    proc = ServerProcess(
        ["--model", str(tiny_llama_tok), "--served-model-name", "tiny", "--num-kv-blocks", "256", "--enable-lora",
         "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a={adapter_dirs['a']}",
         json.dumps({"name": "b", "path": str(adapter_dirs["b"])}), "--trust-request-chat-template"],
        env={"PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")


def _complete(client, model: str, max_tokens: int = 12) -> str:
    out = client.completions.create(model=model, prompt="The capital of France is", max_tokens=max_tokens, temperature=0)
    assert out.model == model
    return out.choices[0].text


def test_models_lists_adapters_with_their_parent(client, adapter_dirs):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a", "b"}
    assert models["a"].parent == "tiny" and models["a"].root == str(adapter_dirs["a"])
    assert models["tiny"].parent is None
    assert client.models.retrieve("a").parent == "tiny"


def test_the_model_field_selects_the_adapter(client):
    base, a, b = (_complete(client, m) for m in ("tiny", "a", "b"))
    assert len({base, a, b}) == 3
    assert _complete(client, "a") == a  # greedy: the same again
    chat = client.chat.completions.create(model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0)
    assert chat.model == "b" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError):
        _complete(client, "no-such-adapter")


def _models(server) -> set[str]:
    return {m["id"] for m in httpx.get(f"{server.url}/v1/models").json()["data"]}


def test_bad_or_over_rank_adapters_are_400_and_change_nothing(server, adapter_dirs, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(adapter_dirs["c"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    cases = [
        ({"lora_name": "x", "lora_path": str(tmp_path / "missing")}, "no such adapter directory"),
        ({"lora_name": "x", "lora_path": str(adapter_dirs["big"])}, "rank 32 exceeds max_lora_rank 8"),
        ({"lora_name": "x", "lora_path": str(broken)}, "cannot be read"),
        ({"lora_name": "a", "lora_path": str(adapter_dirs["c"])}, "already been loaded"),
        ({"lora_name": "tiny", "lora_path": str(adapter_dirs["c"])}, "already been loaded"),
    ]
    for body, message in cases:
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert message in r.json()["error"]["message"]
        assert _models(server) == {"tiny", "a", "b"}
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "nope"}, timeout=30)
    assert r.status_code == 404


def test_load_and_unload_while_other_adapters_serve(server, client, adapter_dirs):
    before = _complete(client, "a", 40)
    results: dict[str, str] = {}

    def stream_a() -> None:  # a long streamed request with adapter a, across the reload below
        parts = client.completions.create(model="a", prompt="The capital of France is", max_tokens=40, temperature=0,
                                          stream=True)  # fmt: skip
        results["a"] = "".join(p.choices[0].text for p in parts)

    t = threading.Thread(target=stream_a)
    t.start()
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapter_dirs["c"])}, timeout=30)
    assert r.status_code == 200, r.text
    assert "c" in _models(server)
    c_text = _complete(client, "c")
    assert c_text != _complete(client, "tiny")
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "c"}, timeout=30)
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        _complete(client, "c")
    t.join(timeout=120)
    assert results["a"] == before
    # Loaded again under the same name: a new id (never another's KV blocks), same answers.
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapter_dirs["c"])}, timeout=30)
    assert r.status_code == 200 and _complete(client, "c") == c_text


def test_a_request_unloaded_under_while_rendered_never_runs_on_the_base(server, adapter_dirs, tmp_path):
    """Found by an adversarial session: a chat request looked its adapter up after rendering its
    template, so an unload in between made it run on the base model, answered under the
    adapter's name. It now takes the adapter its model named on arrival; unloaded before the
    request reached the engine, with its files gone, that is a 400 naming the adapter."""
    shutil.copytree(adapter_dirs["c"], tmp_path / "late")
    load = {"lora_name": "late", "lora_path": str(tmp_path / "late")}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=30).status_code == 200
    slow = "{% for i in range(60000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}Tell me a story"  # ~4 s

    def chat(model: str) -> httpx.Response:
        body = {"model": model, "messages": [{"role": "user", "content": "x"}], "chat_template": slow, "max_tokens": 6,
                "temperature": 0}  # fmt: skip
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)

    adapted, base = (chat(m).json()["choices"][0]["message"]["content"] for m in ("late", "tiny"))
    assert adapted != base
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(chat, "late")
        time.sleep(0.5)  # (the template renders for ~4 s)
        assert not pending.done()  # the unload comes while the request is being rendered
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "late"}, timeout=30).status_code == 200
        shutil.rmtree(tmp_path / "late")  # its files may go once unloaded
        r = pending.result()
    if r.status_code == 200:
        assert r.json()["model"] == "late" and r.json()["choices"][0]["message"]["content"] == adapted
    else:  # unloaded before it reached the engine: its files are gone, a clean error naming it
        assert r.status_code == 400 and "'late'" in r.json()["error"]["message"], r.text


def test_concurrent_loads_of_one_name_load_it_once(server, adapter_dirs):
    """Loads of one name at once: the first wins, the others are 400s (all used to succeed,
    the last one silently replacing the rest; found by an adversarial session)."""
    body = {"lora_name": "race", "lora_path": str(adapter_dirs["c"])}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60), range(4)))
    assert sorted(r.status_code for r in replies) == [200, 400, 400, 400], [r.text for r in replies]
    assert all("already been loaded" in r.text or "is being loaded" in r.text for r in replies if r.status_code == 400)
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "race"}, timeout=30).status_code == 200
    assert "race" not in _models(server)


def test_lora_metrics(server, client):
    _complete(client, "b")
    text = httpx.get(f"{server.url}/metrics").text
    assert 'pagedllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in text


def test_lora_gauges_forget_an_aborted_request(server):
    """A LoRA request whose client goes away mid-stream is aborted: the LoRA gauges drop it then,
    not at the next step (an idle engine may not step again for hours)."""
    body = {"model": "a", "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        chunks = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(4):
            next(chunks)
        text = httpx.get(f"{server.url}/metrics").text
        assert 'running_lora_adapters="a"' in text  # it was running
    idle = 'pagedllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
    deadline = time.monotonic() + 30
    while idle not in (text := httpx.get(f"{server.url}/metrics").text) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert idle in text and 'lora_name="a"' not in text


def test_runtime_updating_needs_the_env_flag_and_modules_need_enable_lora(tiny_llama_tok, adapter_dirs):
    proc = ServerProcess(["--model", str(tiny_llama_tok), "--num-kv-blocks", "64", "--enable-lora",
                          "--lora-modules", f"a={adapter_dirs['a']}"])  # fmt: skip
    try:
        r = httpx.post(f"{proc.url}/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapter_dirs["c"])})
        assert r.status_code == 404
    finally:
        assert proc.stop() == 0
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--model", str(tiny_llama_tok),
           "--lora-modules", f"a={adapter_dirs['a']}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--lora-modules needs --enable-lora" in done.stderr
