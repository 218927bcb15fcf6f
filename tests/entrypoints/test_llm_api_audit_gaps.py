"""The offline LLM API's argument handling, and the vLLM-compatible CLI flags and argument
types: what a mutation audit (2026-12) found the other tests did not pin down."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.lora.request import LoRARequest
from tests.entrypoints.test_llm import NUM_BLOCKS, tok

GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
USER = {"role": "user", "content": "hi"}
# Shows every argument chat() passes on to the template in the rendered text.
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
            "{% if add_generation_prompt %}[GEN]{% endif %}{% if tools %}[TOOLS:{{ tools | length }}]{% endif %}"
            "{% if flavour %}[{{ flavour }}]{% endif %}")  # fmt: skip
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
TOOL2 = {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def llm(tiny_llama_tok) -> LLM:
    return LLM(str(tiny_llama_tok), dtype="float32", num_kv_blocks=NUM_BLOCKS, max_model_len=256,
               scheduling_policy="priority", log_stats_interval=1e9)  # fmt: skip


def text_of(llm, out) -> str:
    return llm.get_tokenizer().decode(out.prompt_token_ids)


# ---------------------------------------------------------------- constructor

def test_log_stats_arguments(tiny_llama):
    every_step = LLM(str(tiny_llama), num_kv_blocks=16, log_stats_interval=0)  # 0: a line every step
    assert every_step.llm_engine.stats.interval == 0
    for kwargs, match in [(dict(log_stats_interval=True), "log_stats_interval must be a number"),
                          (dict(log_stats_interval=-1), "log_stats_interval must be a number"),
                          (dict(disable_log_stats="yes"), "disable_log_stats must be a bool")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            LLM(str(tiny_llama), num_kv_blocks=16, **kwargs)
    # vLLM's harmless arguments, each accepted on its own
    quiet = LLM(str(tiny_llama), num_kv_blocks=16, disable_log_requests=True, log_stats_interval=1e9)
    assert quiet.llm_engine.stats.interval == 1e9
    for name, value in [("cpu_offload_gb", 4), ("download_dir", "/tmp"), ("tokenizer", "x"), ("max_logprobs", 50)]:
        with pytest.raises(ValueError, match=f"{name} is vLLM's and has no meaning here"):
            LLM(str(tiny_llama), **{name: value})
    with pytest.raises(ValueError, match="tokenizer_mode='slow' is not available here"):
        LLM(str(tiny_llama), tokenizer_mode="slow")


# ---------------------------------------------------------------- chat

def test_chat_passes_every_template_argument_on(llm):
    (out,) = llm.chat([USER], GREEDY, use_tqdm=False, chat_template=TEMPLATE)
    assert text_of(llm, out) == "<user>hi[GEN]"
    (out,) = llm.chat([USER, {"role": "assistant", "content": "yo"}], GREEDY, use_tqdm=False, chat_template=TEMPLATE,
                      add_generation_prompt=False, continue_final_message=True, chat_template_kwargs={"flavour": "x"},
                      tools=[TOOL])  # fmt: skip
    assert text_of(llm, out) == "<user>hi<assistant>yo"  # continued: nothing after the last message
    (out,) = llm.chat([USER], GREEDY, use_tqdm=False, chat_template=TEMPLATE, add_generation_prompt=False,
                      chat_template_kwargs={"flavour": "x"}, tools=[TOOL, TOOL2])  # fmt: skip
    assert text_of(llm, out) == "<user>hi[TOOLS:2][x]"


def test_chat_takes_a_list_of_conversations_and_per_conversation_params(llm):
    convs = [[USER], [{"role": "user", "content": "bye"}]]
    params = [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)]
    outs = llm.chat(convs, params, use_tqdm=False, chat_template=TEMPLATE)
    assert [text_of(llm, o) for o in outs] == ["<user>hi[GEN]", "<user>bye[GEN]"]
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="lora_request needs .*enable_lora"):  # the adapter is passed on
        llm.chat([USER], GREEDY, False, LoRARequest("a", 1, "/nowhere"), TEMPLATE)
    assert_all_blocks_free_here(llm)


# ---------------------------------------------------------------- generate

def assert_all_blocks_free_here(llm: LLM) -> None:
    kv = llm.llm_engine.kv_cache_manager
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and not llm.llm_engine.has_unfinished_requests()


def test_per_prompt_arguments_must_match_the_prompts(llm):
    prompts = [tok([5, 6]), tok([7, 8])]
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        llm.generate(prompts, GREEDY, use_tqdm=False, priority=[0])
    with pytest.raises(ValueError, match="got 3 lora_requests for 2 prompts"):
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=[None, None, None])
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=(None, None))  # a tuple is a list too
    assert len(outs) == 2
    with pytest.raises(ValueError, match="lora_request needs .*enable_lora"):  # a tuple's adapter is seen
        llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=(None, LoRARequest("a", 1, "/nowhere")))
    assert llm.generate([], GREEDY, use_tqdm=False) == []  # no prompts: no outputs (not one empty prompt)
    with pytest.raises(ValueError, match="prompt must be"):  # bools are no token ids
        llm.generate([True, False], GREEDY, use_tqdm=False)
    assert_all_blocks_free_here(llm)


def test_priorities_reach_the_scheduler(llm, monkeypatch):
    seen = []
    add = llm.llm_engine.add_request
    monkeypatch.setattr(llm.llm_engine, "add_request", lambda *a, **k: seen.append(k["priority"]) or add(*a, **k))
    llm.generate([tok([5, 6]), tok([7, 8])], GREEDY, use_tqdm=False, priority=[3, -1])
    assert seen == [3, -1]


def test_the_progress_bar_counts_every_finished_prompt(llm):
    bars = []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.n, self.closed = kw, 0, False
            bars.append(self)

        def update(self, k):
            self.n += k

        def set_postfix_str(self, *a, **k):
            pass

        def close(self):
            self.closed = True

    llm.generate([tok([5, 6]), tok([7]), tok([8, 9])], GREEDY, use_tqdm=Bar)
    llm.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=2), use_tqdm=Bar)
    assert [(b.kw["total"], b.n, b.closed) for b in bars] == [(3, 3, True), (1, 1, True)]


def test_an_interrupted_run_aborts_its_requests(llm, monkeypatch):
    engine = llm.llm_engine
    step = engine.step
    calls = []

    def interrupted():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([tok([5, 6]), tok([7, 8])], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert_all_blocks_free_here(llm)


def test_generation_config_sets_the_default_sampling_params(tiny_llama, tmp_path):
    model = shutil.copytree(tiny_llama, tmp_path / "m")
    (model / "generation_config.json").write_text(json.dumps({"max_new_tokens": 4, "temperature": 0.0}))
    llm = LLM(str(model), num_kv_blocks=16, log_stats_interval=1e9)
    (out,) = llm.generate(tok([5, 6, 7]), use_tqdm=False)  # (ignore_eos off: at most 4)
    assert 1 <= len(out.outputs[0].token_ids) <= 4
    (again,) = llm.generate(tok([5, 6, 7]), use_tqdm=False)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids  # greedy, from the file


# ---------------------------------------------------------------- CLI flags and argument types

def test_serve_flags_vllm_users_pass(monkeypatch, tiny_llama, capsys):
    from pagedllm.entrypoints.cli import main
    from pagedllm.entrypoints.openai import api_server

    seen = {}
    monkeypatch.setattr(api_server, "run_server", lambda args, config: seen.update(args=args) or 0)
    assert main(["serve", str(tiny_llama), "--distributed-executor-backend", "ray", "--tokenizer-mode", "auto"]) == 0
    for argv, message in [(["--kv-offloading-size", "4"], "--kv-offloading-size is vLLM's"),
                          (["--cpu-offload-gb", "4"], "--cpu-offload-gb is vLLM's"),
                          (["--download-dir", "/tmp"], "--download-dir is vLLM's")]:  # fmt: skip
        with pytest.raises(SystemExit):
            main(["serve", str(tiny_llama), *argv])
        assert message in capsys.readouterr().err


def test_argument_types_bounds():
    from pagedllm.entrypoints import arg_types as t

    assert t.non_negative_int("0") == 0 and t.non_negative_float("0") == 0.0 and t.tcp_port("0") == 0
    assert t.tcp_port("65535") == 65535 and t.positive_int("1") == 1
    assert t.positive_float_or_inf("inf") == float("inf") and t.non_negative_float_or_inf("inf") == float("inf")
    for check, value in [(t.positive_int, "0"), (t.positive_float, "0"), (t.positive_float_or_inf, "0"),
                         (t.non_negative_float, "nan"), (t.positive_float, "-inf"), (t.positive_int, "x"),
                         (t.non_negative_float, "1e9999"), (t.tcp_port, "65536")]:  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError):
            check(value)
    parts = t.comma_list("a", "b")
    assert parts(" a, b ,") == " a, b ,"  # spaces and a trailing comma are fine; the text comes back
    for bad in ("", ",", "a,c"):
        with pytest.raises(argparse.ArgumentTypeError, match="choose from a, b"):
            parts(bad)
    assert t.positive_int_list("") == "" and t.positive_int_list("1, 4") == "1, 4"
    with pytest.raises(argparse.ArgumentTypeError):
        t.positive_int_list("1,0")


def test_path_argument_types(tmp_path):
    from pagedllm.entrypoints import arg_types as t

    assert t.existing_dir(str(tmp_path)) == str(tmp_path)
    with pytest.raises(argparse.ArgumentTypeError, match="no such directory"):
        t.existing_dir(str(tmp_path / "nope"))
    assert t.result_path(str(tmp_path / "r.json")) == str(tmp_path / "r.json")
    with pytest.raises(argparse.ArgumentTypeError, match="is a directory"):
        t.result_path(str(tmp_path))
    assert t.output_dir(str(tmp_path / "new")) == str(tmp_path / "new")
