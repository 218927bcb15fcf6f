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
])  # fmt: skip
def test_bad_flag_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(message, err), err
