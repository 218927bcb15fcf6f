"""vLLM's engine arguments that mean nothing on this engine, for ``LLM(...)`` and ``pagedllm
serve`` alike: a harmless one is accepted and does nothing; one that would size or change
something is refused with what to use instead. A bare "unknown argument" left vLLM users
guessing, and silently ignoring a sizing argument would mislead them.
"""

from __future__ import annotations

import argparse
from typing import Any

# name -> why any value has no effect here (accepted)
NO_EFFECT = {
    "enforce_eager": "there are no CUDA graphs on a CPU",
    "trust_remote_code": "pagedllm runs its own model code, never a checkpoint's",
    "disable_log_requests": "pagedllm does not log requests",
    "distributed_executor_backend": "the workers of tensor / pipeline parallelism are processes",
}
# name -> (the values that change nothing here, what holds otherwise)
ONLY = {
    "enable_chunked_prefill": ((True,), "prefill is always chunked here: max_num_batched_tokens bounds a step"),
    "tokenizer_mode": (("auto",), "the tokenizer is the model's own (transformers' fast tokenizer)"),
}
# name -> what to use instead (refused, any value)
INSTEAD = {
    "gpu_memory_utilization": "the KV pool is kv_cache_space GiB (or num_kv_blocks); `pagedllm estimate` prints what fits",
    "cpu_offload_gb": "weights and KV cache are in RAM already; preemption_mode swap keeps preempted blocks in a second pool",
    "tokenizer": "the tokenizer is read from the model (GGUF metadata or the checkpoint's directory)",
    "revision": "models are local files here (no downloads): pass the checkpoint's directory or GGUF file",
    "download_dir": "models are local files here (no downloads): pass the checkpoint's directory or GGUF file",
    "max_logprobs": "every request may ask for up to 20 logprobs per token",
}
# serve only: LLM.chat takes its own chat_template argument
SERVE_INSTEAD = {"chat_template": "the chat template is the model's; requests may send chat_template with --trust-request-chat-template"}


def check_llm_args(engine_args: dict[str, Any]) -> dict[str, Any]:
    """``LLM(**engine_args)`` without vLLM's harmless arguments; ValueError for the others."""
    for name, value in engine_args.items():
        if name in INSTEAD:
            raise ValueError(f"{name} is vLLM's and has no meaning here: {INSTEAD[name]}")
        if name in ONLY and value not in ONLY[name][0]:
            raise ValueError(f"{name}={value!r} is not available here: {ONLY[name][1]}")
    return {k: v for k, v in engine_args.items() if k not in NO_EFFECT and k not in ONLY}


class _Checked(argparse.Action):
    """A refused flag (``instead``), or one whose harmless values (``only``) are accepted."""

    def __init__(self, option_strings, dest, instead: str, only: tuple = (), nargs: int = 1, **kwargs):
        self.instead, self.only = instead, only
        super().__init__(option_strings, dest, nargs=nargs, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        if not values:  # a switch (``--no-enable-chunked-prefill``)
            parser.error(f"{option_string} is not available here: {self.instead}")
        if values[0] in self.only:
            return
        if self.only:
            parser.error(f"{option_string} {values[0]} is not available here: {self.instead}")
        parser.error(f"{option_string} is vLLM's and has no meaning here: {self.instead}")


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """The same arguments as ``serve`` flags: the accepted ones listed in --help, the refused
    ones hidden."""
    g = parser.add_argument_group("vLLM flags without effect here")
    for name, why in {**NO_EFFECT, "enable_chunked_prefill": ONLY["enable_chunked_prefill"][1]}.items():
        flag = "--" + name.replace("_", "-")
        if name == "distributed_executor_backend":
            g.add_argument(flag, default=None, help=f"accepted, no effect: {why}")
        else:
            g.add_argument(flag, action="store_true", help=f"accepted, no effect: {why}")
    g.add_argument("--no-enable-chunked-prefill", action=_Checked, nargs=0, instead=ONLY["enable_chunked_prefill"][1])
    g.add_argument("--tokenizer-mode", action=_Checked, only=ONLY["tokenizer_mode"][0], instead=ONLY["tokenizer_mode"][1])
    for name, instead in {**INSTEAD, **SERVE_INSTEAD}.items():
        flags = ["--" + name.replace("_", "-")] + (["--kv-offloading-size"] if name == "cpu_offload_gb" else [])
        g.add_argument(*flags, action=_Checked, instead=instead)
