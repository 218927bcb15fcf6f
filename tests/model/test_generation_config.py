"""A checkpoint's generation_config.json, read as vLLM reads it (``generation_config="auto"``):
its sampling values are the defaults of requests that leave them out, its max_new_tokens caps
max_tokens, its eos ids end replies; ``"vllm"`` keeps only the eos ids (a vLLM-compatibility
sweep found the file was never read)."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.model.generation_config import read_generation_config


def with_generation_config(src, dst, **values):
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(values))
    return dst


def test_the_file_gives_sampling_defaults_and_eos_ids(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 64,
         "do_sample": True, "eos_token_id": [2, 7], "bos_token_id": 1}))  # fmt: skip
    d = read_generation_config("auto", tmp_path)
    assert d.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 64}
    assert d.eos_token_ids == [2, 7]
    assert read_generation_config(str(tmp_path), tmp_path / "elsewhere").sampling == d.sampling  # a directory
    assert read_generation_config("vllm", tmp_path).sampling == {}  # no sampling defaults...
    assert read_generation_config("vllm", tmp_path).eos_token_ids == [2, 7]  # ...but its eos ids, as vLLM
    assert read_generation_config("auto", tmp_path / "none").sampling == {}  # no file: nothing
    with pytest.raises(ValueError, match="no generation_config.json in"):
        read_generation_config(str(tmp_path / "none"), tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="generation_config: .*temperature"):
        read_generation_config("auto", tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match="eos_token_id"):
        read_generation_config("auto", tmp_path)


def test_server_requests_take_the_defaults_they_leave_out():
    # Beam search takes only the max_tokens cap (a repetition_penalty default refused every search).
    beam = CompletionRequest(prompt="hi", use_beam_search=True, n=2, max_tokens=20).to_sampling_params(
        {"repetition_penalty": 1.05, "temperature": 0.7, "max_tokens": 7})
    assert (beam.repetition_penalty, beam.temperature, beam.max_tokens) == (1.0, 0.0, 7)
    defaults = {"temperature": 0.3, "top_k": 5, "max_tokens": 7}
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    p = chat.to_sampling_params(defaults)
    assert (p.temperature, p.top_k, p.top_p, p.max_tokens) == (0.3, 5, 1.0, 7)
    p = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=1.0, max_tokens=20).to_sampling_params(defaults)
    assert (p.temperature, p.max_tokens) == (1.0, 7)  # the request's value; max_new_tokens caps max_tokens
    p = CompletionRequest(prompt="hi", top_k=2).to_sampling_params(defaults)
    assert (p.temperature, p.top_k, p.max_tokens) == (0.3, 2, 7)
    p = CompletionRequest(prompt="hi").to_sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, 0, 16)  # no file: the API's own defaults


def test_offline_defaults_and_eos_ids_from_the_file(tiny_llama, tmp_path):
    prompt = {"prompt_token_ids": [5, 9, 11, 3]}
    plain = LLM(str(tiny_llama), generation_config="vllm", num_kv_blocks=32, log_stats_interval=1e9)
    greedy = plain.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    tokens = greedy.outputs[0].token_ids
    assert plain.get_default_sampling_params().temperature == 1.0
    # The second greedy token as an extra EOS id, greedy sampling and 6 tokens as the defaults.
    path = with_generation_config(tiny_llama, tmp_path / "m", temperature=0.0, max_new_tokens=6, eos_token_id=[2, tokens[1]])
    llm = LLM(str(path), num_kv_blocks=32, log_stats_interval=1e9)
    assert llm.get_default_sampling_params().temperature == 0.0 and llm.get_default_sampling_params().max_tokens == 6
    out = llm.generate([prompt], use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(tokens[1]) + 1] and out.finish_reason == "stop"
    assert out.stop_reason == tokens[1]  # a stop id of the request, as vLLM (the model's own EOS gives None)
    # ignore_eos still runs past it; "vllm" ignores the file.
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens
    # "vllm": no sampling defaults, but the file's eos ids still end replies (as vLLM).
    kept = LLM(str(path), generation_config="vllm", num_kv_blocks=32, log_stats_interval=1e9)
    assert kept.get_default_sampling_params() == SamplingParams()
    out = kept.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: tokens.index(tokens[1]) + 1] and (out.finish_reason, out.stop_reason) == ("stop", tokens[1])
