"""The default model (SmolLM2-135M) under every kind of constraint: every output must fit.

A smaller run of `pagedllm bench structured` (50 requests per task there; see
docs/structured_outputs.md for its figures).
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams
from pagedllm.bench.structured import TASKS, _chat_prompts

pytestmark = pytest.mark.slow
NUM = 6


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_num_seqs=16, log_stats_interval=1e9)


@pytest.mark.parametrize("task", TASKS, ids=[t.name for t in TASKS])
def test_real_model_outputs_all_validate(llm, task):
    prompts = _chat_prompts(llm, [task.prompt(i) for i in range(NUM)])
    so = StructuredOutputsParams(**task.constraint)
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, seed=0, max_tokens=task.max_tokens, structured_outputs=so)
        texts = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
        assert all(task.check(t) for t in texts), [t for t in texts if not task.check(t)]
    if task.name == "json_schema":  # left alone, the model does not produce this schema
        free = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=task.max_tokens), use_tqdm=False)
        assert not all(task.check(o.outputs[0].text) for o in free)
