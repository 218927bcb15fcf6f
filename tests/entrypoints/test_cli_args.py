"""Bad command-line values are usage errors naming the flag, found when the flags are read
(an adversarial session found some that failed only after a model loaded or a whole benchmark
ran, with a traceback, and some that started hours-long jobs)."""

from __future__ import annotations

import re

import pytest

from pagedllm.entrypoints.cli import main


@pytest.mark.parametrize("argv, message", [
    (["serve", "--port", "99999"], "argument --port: a TCP port is 0 to 65535"),
    (["bench", "serve", "--num-prompts", "-1"], "argument --num-prompts: must be at least 1"),
    (["bench", "serve", "--request-rate", "-1"], "argument --request-rate: must be above 0"),
    (["bench", "serve", "--goodput", "foo"], "argument --goodput: expected ttft:MS"),
    (["bench", "serve", "--save-result", "/no/such/dir/x.json"], "argument --save-result: cannot write"),
    (["train-draft-head", "--output", "/tmp", "--lr", "-1"], "argument --lr: must be above 0"),
    (["train-draft-head", "--output", __file__], "argument --output: .* is not a directory"),
    # A sixth adversarial session: accepted, then wrong (nan/negative: SIGTERM aborted at once;
    # every request got 413) or a traceback after the whole benchmark ran.
    (["serve", "--graceful-shutdown-timeout", "nan"], "argument --graceful-shutdown-timeout: must be at least 0"),
    (["serve", "--max-request-body-bytes", "-5"], "argument --max-request-body-bytes: must be at least 1"),
    (["serve", "--log-stats-interval", "-1"], "argument --log-stats-interval: must be at least 0"),
    (["bench", "prefix-cache", "--save-result", "/no/such/dir/x.json"], "argument --save-result: cannot write"),
    (["bench", "structured", "--save-result", "/no/such/dir/x.json"], "argument --save-result: cannot write"),
    (["bench", "kv-cache-dtype", "--save-result", "/no/such/dir/x.json"], "argument --save-result: cannot write"),
    (["bench", "weight-quant", "--output", "/no/such/dir/x.json"], "argument --output: cannot write"),
    (["bench", "latency", "--num-iters", "0"], "argument --num-iters: must be at least 1"),
    (["bench", "prefix-cache", "--system-tokens", "-5"], "argument --system-tokens: must be at least 1"),
    # A twelfth adversarial session: accepted, then an error only at use (a 500 for every
    # request, a traceback at SIGTERM, a head of NaNs written with exit 0).
    (["disagg-proxy", "--prefill", "http://a", "--decode", "http://b", "--prefill-timeout", "nan"], "argument --prefill-timeout: must be above 0"),
    (["disagg-proxy", "--prefill", "http://a", "--decode", "http://b", "--port", "70000"], "argument --port: a TCP port is 0 to 65535"),
    (["serve", "--graceful-shutdown-timeout", "inf"], "argument --graceful-shutdown-timeout: must be finite"),
    (["serve", "--served-model-name", ""], "--served-model-name: a model name cannot be empty"),
    (["train-draft-head", "--output", "/tmp", "--lr", "inf"], "argument --lr: must be finite"),
    # vLLM flags that would size or change something here are refused with what to use instead.
    (["serve", "--gpu-memory-utilization", "0.9"], "--gpu-memory-utilization is vLLM's .* kv_cache_space"),
    (["serve", "--tokenizer", "x"], "--tokenizer is vLLM's .* read from the model"),
    (["serve", "--tokenizer-mode", "slow"], "--tokenizer-mode slow is not available here"),
    (["serve", "--no-enable-chunked-prefill"], "--no-enable-chunked-prefill is not available here: prefill is always chunked"),
    (["serve", "--max-logprobs", "50"], "--max-logprobs is vLLM's .* up to 20 logprobs"),
    (["serve", "--revision", "main"], "--revision is vLLM's .*no downloads"),
    (["serve", "--chat-template", "t.jinja"], "--chat-template is vLLM's .* --trust-request-chat-template"),
    # An unknown flag is named in the subcommand's usage (the top level's said nothing useful).
    (["serve", "--no-such-flag"], r"usage: pagedllm serve [\s\S]*pagedllm serve: error: unrecognized arguments: --no-such-flag"),
    (["bench", "latency", "--no-such-flag"], r"pagedllm bench latency: error: unrecognized arguments: --no-such-flag"),
    (["serve", "a.gguf", "--model", "b.gguf"], "the model is given twice: a.gguf and --model b.gguf"),
    # nargs="+" takes a model path after --served-model-name for a name: said, not served by default.
    (["serve", "--served-model-name", "tiny", __file__], "--served-model-name took .* put the model before"),
])  # fmt: skip
def test_bad_flag_values_are_usage_errors(argv, message, capsys, monkeypatch):
    # A check that regressed would start a real server and hang the test: fail it instead.
    import uvicorn

    from pagedllm.entrypoints.openai import api_server

    monkeypatch.setattr(api_server, "run_server", lambda args, config: pytest.fail(f"{argv} was accepted"))
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: pytest.fail(f"{argv} was accepted"))
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(message, err), err


def test_serve_takes_the_model_as_vllm_serve_does(monkeypatch, tiny_llama):
    """``pagedllm serve MODEL`` as ``vllm serve MODEL``; the harmless vLLM flags are accepted."""
    from pagedllm.entrypoints.openai import api_server

    seen = {}
    monkeypatch.setattr(api_server, "run_server", lambda args, config: seen.update(args=args, config=config) or 0)
    assert main(["serve", str(tiny_llama), "--enforce-eager", "--trust-remote-code", "--disable-log-requests",
                 "--enable-chunked-prefill", "--tokenizer-mode", "auto", "--distributed-executor-backend", "mp"]) == 0
    assert seen["config"].model == str(tiny_llama) and seen["args"].model == str(tiny_llama)
    assert main(["serve", "--model", str(tiny_llama)]) == 0 and seen["config"].model == str(tiny_llama)
    assert main(["serve", str(tiny_llama), "--model", str(tiny_llama)]) == 0


def _busy_port():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


@pytest.mark.parametrize("argv, message", [
    (["--api-key", ""], "--api-key is empty"),
    (["--host", "no.such.host.invalid"], "--host 'no.such.host.invalid'"),
    (["--port", "BUSY"], r"cannot listen on 127.0.0.1:\d+ \(--host, --port\)"),
])  # fmt: skip
def test_serve_refuses_where_it_cannot_listen_before_loading_the_model(argv, message, capsys, monkeypatch):
    """Found by an adversarial session: the whole engine loaded (and the log said "serving on")
    before the bind failed."""
    from pagedllm.entrypoints.openai import api_server

    monkeypatch.setattr(api_server, "make_async_llm", lambda *a, **k: pytest.fail("the model loaded first"))
    with _busy_port() as busy:
        argv = [str(busy.getsockname()[1]) if a == "BUSY" else a for a in argv]
        assert main(["serve", "--num-kv-blocks", "16", *argv]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_environment_switches_read_every_spelling_and_refuse_the_rest(monkeypatch):
    from pagedllm.envs import env_flag, env_seconds

    for value, want in [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("off", False), ("No", False), ("", None)]:
        monkeypatch.setenv("PAGEDLLM_X", value)
        assert env_flag("PAGEDLLM_X", None) is want, value  # (empty: the default)
    monkeypatch.setenv("PAGEDLLM_X", "maybe")
    with pytest.raises(ValueError, match="PAGEDLLM_X must be one of 1/true/yes/on or 0/false/no/off, got 'maybe'"):
        env_flag("PAGEDLLM_X", True)
    monkeypatch.delenv("PAGEDLLM_X")
    assert env_seconds("PAGEDLLM_X", 7.0) == 7.0
    for bad in ("abc", "-5", "0", "inf", "nan"):
        monkeypatch.setenv("PAGEDLLM_X", bad)
        with pytest.raises(ValueError, match="PAGEDLLM_X must be a"):
            env_seconds("PAGEDLLM_X", 7.0)


def test_a_bad_logging_level_names_the_variable(monkeypatch):
    import logging

    from pagedllm.logger import configure_logging

    root = logging.getLogger("pagedllm")
    monkeypatch.setattr(root, "_pagedllm_configured", False, raising=False)
    handlers = list(root.handlers)
    monkeypatch.setenv("PAGEDLLM_LOGGING_LEVEL", "bogus")
    with pytest.raises(ValueError, match="PAGEDLLM_LOGGING_LEVEL must be one of .* got 'BOGUS'"):
        configure_logging()
    assert root.handlers == handlers  # nothing half-configured


def test_demo_on_a_model_without_a_chat_template_says_so(tiny_llama, capsys):
    assert main(["demo", "--model", str(tiny_llama), "--num-kv-blocks", "16"]) == 2
    assert "chat needs a tokenizer; this model has none" in capsys.readouterr().err
