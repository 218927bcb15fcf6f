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
])  # fmt: skip
def test_bad_flag_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and re.search(message, err), err
