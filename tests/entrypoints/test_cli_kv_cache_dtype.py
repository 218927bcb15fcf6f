"""The server/CLI flag ``--kv-cache-dtype`` (vLLM's name) reaches EngineConfig."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.cli import add_engine_args, engine_config_from_args


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("value", ["auto", "bfloat16", "float16", "int8", "fp8_e4m3"])
def test_the_flag_parses_into_the_config(value):
    assert engine_config_from_args(_parse("--kv-cache-dtype", value)).kv_cache_dtype == value


def test_the_default_is_auto_and_unknown_values_are_refused(capsys):
    assert engine_config_from_args(_parse()).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        _parse("--kv-cache-dtype", "int4")
    assert "kv-cache-dtype" in capsys.readouterr().err
