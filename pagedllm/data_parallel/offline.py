"""``LLM(data_parallel_size=N).generate``: the offline API over N replica processes.

All prompts are validated first (one bad prompt raises ValueError and queues nothing, as with one
engine), then each is routed on its own by the balancer and runs to completion in its replica;
the final outputs come back in input order.
"""

from __future__ import annotations

import asyncio
import operator
from collections.abc import Sequence

from pagedllm.data_parallel.client import DPAsyncLLM
from pagedllm.engine.input_processor import ProcessedRequest, PromptType
from pagedllm.engine.output_processor import RequestOutputKind
from pagedllm.engine.progress import ProgressBar
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


def generate(
    dp: DPAsyncLLM,
    prompts: Sequence[PromptType],
    params: Sequence[SamplingParams],
    priorities: Sequence[int],
    loras: Sequence[LoRARequest | None],
    use_tqdm: bool,
) -> list[RequestOutput]:
    processor = dp.engine.processor
    processed = [processor.process(p, sp, prio) for p, sp, prio in zip(prompts, params, priorities)]
    return asyncio.run(_run(dp, processed, list(loras), use_tqdm))


async def _run(dp: DPAsyncLLM, processed: list[ProcessedRequest], loras: list[LoRARequest | None],
               use_tqdm: bool) -> list[RequestOutput]:  # fmt: skip
    ids = [dp.new_request_id("offline") for _ in processed]
    streams = []
    try:
        for rid, req, lora in zip(ids, processed, loras):
            (stream,) = await dp.add_requests([req], req.sampling_params, [rid], req.priority, lora,
                                              output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
            streams.append(stream)
    except BaseException:
        for rid in ids[: len(streams)]:
            dp.abort(rid)
        raise
    bar = ProgressBar(len(streams), use_tqdm)

    async def final(stream) -> RequestOutput:
        last = None
        async for out in stream:
            last = out
        bar.finished(last)
        return last

    try:
        return list(await asyncio.gather(*(final(s) for s in streams)))
    finally:
        bar.close()


def reset_prefix_cache(dp: DPAsyncLLM) -> None:
    asyncio.run(dp.call_in_all_engines(operator.methodcaller("reset_prefix_cache")))
