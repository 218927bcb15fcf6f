"""The ``pagedllm`` command: ``serve`` (OpenAI-compatible server), ``demo``, ``estimate``, ``bench``."""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
from dataclasses import fields
from pathlib import Path

from pagedllm.config import ACTIVATION_DTYPES, DEFAULT_DTYPE, KV_CACHE_DTYPES, EngineConfig

_DEMO_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for learning a new language.",
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, with vLLM's names."""
    defaults = {f.name: f.default for f in fields(EngineConfig)}
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or Hugging Face model directory (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=DEFAULT_DTYPE, choices=["auto", "bfloat16", "float32"], help="weights, activations and KV-cache dtype; auto = float32, the exact mode; bfloat16 is opt-in (default: %(default)s)")
    g.add_argument("--block-size", type=int, default=defaults["block_size"], help="tokens per KV-cache block (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"], help="most requests running at once (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=defaults["max_num_batched_tokens"], help="token budget of one step (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's context)")
    g.add_argument("--kv-cache-space", type=float, default=None, help="KV-cache memory in GiB (default: 4)")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV blocks (overrides --kv-cache-space)")
    g.add_argument("--seed", type=int, default=defaults["seed"], help="seed of the engine's sampler (default: %(default)s)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help="reuse the KV blocks of shared prompt prefixes (default: on)")
    g.add_argument("--long-prefill-token-threshold", type=int, default=0, help="cap on one request's prefill chunk per step; 0 = none (default: %(default)s)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"], help="fcfs, or priority (lower request priority first) (default: %(default)s)")
    g.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"], help="what preemption does with the victim's KV blocks (default: %(default)s)")
    g.add_argument("--swap-space", type=float, default=4.0, help="GiB of secondary KV pool for --preemption-mode swap (default: %(default)s)")
    g.add_argument("--swap-path", default=None, help="memory-mapped file backing the swap pool (default: RAM)")
    g.add_argument("--attention-backend", default=defaults["attention_backend"], choices=["auto", "cpu_native", "torch_sdpa", "reference"], help="paged-attention implementation; auto = the native CPU kernel when it builds (fp32 or bf16 model on CPU; any KV cache dtype), else torch_sdpa (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", default=defaults["kv_cache_dtype"], choices=list(KV_CACHE_DTYPES), help="KV-cache storage; auto = the model's dtype (exact); int8 / fp8_e4m3 keep a scale per token and head and hold ~3.8x the tokens of float32 in the same space (default: %(default)s)")
    g.add_argument("--activation-dtype", default=defaults["activation_dtype"], choices=list(ACTIVATION_DTYPES), help="what the linears multiply: float32 = fp32 activations x the exact dequantized weights; int8 = fast mode for GGUF Q4_0/Q4_1/Q8_0 weights, activations quantized per 32-wide block and integer dot products (llama.cpp's scheme; not exact, see docs/quantization.md); int16 = the same with 16-bit activation quants (two int8 halves: slower than int8, near-fp32 accuracy) (default: %(default)s)")
    g.add_argument("--packed-weights", action=argparse.BooleanOptionalAction, default=True, help="GGUF float32 models: run small batches straight from the quantized blocks with the native kernel (default: on)")
    g.add_argument("--dense-weights", default=defaults["dense_weights"], choices=["auto", "yes", "no"], help="quantized models: also keep an fp32 copy of the weights for big steps; auto = when it takes at most a third of the available memory, else every step runs from the GGUF blocks (default: %(default)s)")
    g.add_argument("--speculative-config", default=None, help='speculative decoding as JSON, vLLM\'s shape, e.g. \'{"method": "ngram", "num_speculative_tokens": 3}\' (keys: method = ngram | draft_model | eagle | medusa, model, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, disable_by_batch_size, auto_length) (default: off)')
    g.add_argument("--kv-transfer-config", default=None, help='KV connector as JSON, vLLM\'s shape, e.g. \'{"kv_connector": "disk", "kv_role": "kv_both", "path": "/var/cache/pagedllm-kv"}\': a prefix cache that survives restarts and is shared by replicas, or disaggregated prefill (kv_producer) / decode (kv_consumer) (keys: kv_connector, kv_role, path, max_bytes, wait_for_save; docs/kv_connector.md) (default: off)')
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format) over the base model, many in one batch (docs/lora.md)")
    g.add_argument("--max-loras", type=int, default=defaults["max_loras"], help="most distinct LoRA adapters in one step, one preallocated slot each (default: %(default)s)")
    g.add_argument("--max-lora-rank", type=int, default=defaults["max_lora_rank"], help="highest adapter rank the slots hold; a higher-rank adapter is refused (default: %(default)s)")
    g.add_argument("--max-cpu-loras", type=int, default=None, help="LoRA adapters kept loaded (an LRU; default: --max-loras)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="tensor parallel ranks: attention heads (by KV group), MLP width and vocabulary split over this many worker processes, one all-reduce per attention and per MLP (docs/parallelism.md) (default: %(default)s)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages: the layers split over this many worker processes, hidden states passed on point-to-point (default: %(default)s)")
    g.add_argument("--nnodes", type=int, default=1, help="nodes the tensor x pipeline ranks are spread over (default: %(default)s)")
    g.add_argument("--node-rank", type=int, default=0, help="this node's index; nodes >= 1 run with --headless (default: %(default)s)")
    g.add_argument("--master-addr", default="127.0.0.1", help="node 0's address: torch.distributed rendezvous and the engine's control channel (default: %(default)s)")
    g.add_argument("--master-port", type=int, default=None, help="rendezvous port on --master-addr; the control channel uses the next one (default: a free port; required with --nnodes > 1)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=defaults["data_parallel_size"], help="engine replicas, one process each (own model copy and KV pool: --kv-cache-space is per replica), behind one server that routes by load and prefix affinity; each gets its share of the cores (docs/parallelism.md) (default: %(default)s)")
    g.add_argument("--generation-config", default=defaults["generation_config"], help="the model's generation_config.json, as vLLM: auto = its sampling values are the defaults of requests that leave them out (its max_new_tokens caps max_tokens) and its eos_token_id ends replies; vllm = only its eos ids, no sampling defaults (as vLLM); or a directory holding one (default: %(default)s)")
    g.add_argument("--quantization", "-q", default=None, choices=["int8", "int4"], help="Hugging Face checkpoints: quantize the linear weights at load, int8 (Q8_0 groups of 32) or int4 (Q4_1 groups of 32) (default: none)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in fields(EngineConfig)}
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names})


def _serve(args: argparse.Namespace) -> int:
    if args.headless:  # a worker node: its ranks only, no engine, no HTTP server
        from pagedllm.executor.multiproc import run_headless
        from pagedllm.logger import configure_logging

        configure_logging()
        return run_headless(engine_config_from_args(args))
    from pagedllm.entrypoints.openai.api_server import run_server

    config = engine_config_from_args(args)
    if config.node_rank != 0:
        raise ValueError("node_rank >= 1 runs workers only: add --headless")
    return run_server(args, config)


def _demo(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    config = engine_config_from_args(args)
    llm = LLM(**{k: v for k, v in config.to_dict().items()})
    # (LLM.chat renders each question, or says why it cannot: no tokenizer, no chat template)
    conversations = [[{"role": "user", "content": q}] for q in _DEMO_QUESTIONS]
    outputs = llm.chat(conversations, SamplingParams(temperature=0, max_tokens=args.max_tokens))
    for question, out in zip(_DEMO_QUESTIONS, outputs):
        print(f"\n>>> {question}\n{out.outputs[0].text}")
    return 0


def _estimate(args: argparse.Namespace) -> int:
    """Capacity planning from the model's headers: no weights are loaded (engine/capacity.py)."""
    import json

    from pagedllm.engine.capacity import estimate

    report = estimate(engine_config_from_args(args), context_len=args.context_len)
    print(json.dumps(report.to_dict(), indent=2) if args.json else "\n".join(report.lines()))
    return 0


# The benchmarks that build an engine: subcommand -> (module in pagedllm.bench, help). Each module
# has add_args(parser) and run(args, engine_config_dict).
ENGINE_BENCHES = {
    "throughput": ("throughput", "offline throughput on a standard workload"),
    "latency": ("latency", "single-stream TTFT and ms per output token (W2)"),
    "prefix-cache": ("prefix_cache", "TTFT with and without a cached 2,000-token system prompt"),
    "structured": ("structured", "structured outputs: validity of constrained outputs, and their cost per step"),
    "weight-quant": ("weight_quant", "perplexity and greedy agreement of --quantization int8/int4 against the checkpoint"),
    "kv-cache-dtype": ("kv_cache_dtype", "KV cache dtypes: decode-attention speed, accuracy against fp32, W1"),
    "lora": ("lora", "multi-LoRA: W1 on the base model, on one adapter and spread over N adapters (throughput ratios)"),
    "activation-dtype": ("activation_dtype", "--activation-dtype int8: greedy agreement and perplexity against fp32 (per layer choice), W1 speed"),
}


# The engine benchmarks that run with --data-parallel-size > 1 (the others read one engine's state).
DATA_PARALLEL_BENCHES = {"throughput"}


def _run_engine_bench(module, args: argparse.Namespace) -> int:
    if args.data_parallel_size > 1 and args.bench not in DATA_PARALLEL_BENCHES:
        raise ValueError(f"bench {args.bench} runs one engine; --data-parallel-size works with: {', '.join(sorted(DATA_PARALLEL_BENCHES))} "
                         "(and `pagedllm bench serve` against `pagedllm serve --data-parallel-size N`)")  # fmt: skip
    module.run(args, engine_config_from_args(args).to_dict())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: paged-attention LLM inference, CPU first")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    # ``vllm serve MODEL``: the model as a positional argument too.
    serve.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model, as --model")
    add_engine_args(serve)
    from pagedllm.entrypoints.vllm_args import add_serve_args as add_vllm_args

    add_vllm_args(serve)
    from pagedllm.entrypoints.openai.api_server import add_server_args

    add_server_args(serve)
    serve.set_defaults(func=_serve)

    proxy = sub.add_parser("disagg-proxy", help="disaggregated prefill/decode: a proxy in front of a prefill and a decode server")
    from pagedllm.entrypoints.disagg_proxy import add_proxy_args, run_proxy

    add_proxy_args(proxy)
    proxy.set_defaults(func=run_proxy)

    demo = sub.add_parser("demo", help="offline generation demo over a few chat prompts")
    add_engine_args(demo)
    demo.add_argument("--max-tokens", type=int, default=64, help="tokens per demo answer (default: %(default)s)")
    demo.set_defaults(func=_demo)

    est = sub.add_parser("estimate", help="weight memory, KV pool and concurrency of a configuration, without loading weights")
    add_engine_args(est)
    est.add_argument("--context-len", type=int, default=None, help="prompt + output tokens per request for the concurrency figure (default: max_model_len)")
    est.add_argument("--json", action="store_true", help="print the numbers as JSON")
    est.set_defaults(func=_estimate)

    from pagedllm.entrypoints import train_draft_head

    train = sub.add_parser("train-draft-head", help="train speculative-decoding heads (Medusa, EAGLE) for a model, on this CPU")
    train_draft_head.add_args(train)
    train.set_defaults(func=train_draft_head.run)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    for name, (module_name, help_text) in ENGINE_BENCHES.items():
        module = importlib.import_module(f"pagedllm.bench.{module_name}")
        p = bench.add_parser(name, help=help_text)
        add_engine_args(p)
        module.add_args(p)
        p.set_defaults(func=functools.partial(_run_engine_bench, module))
    sv = bench.add_parser("serve", help="drive a running OpenAI-compatible server (ours or any other)")
    from pagedllm.bench import serve as bench_serve

    bench_serve.add_args(sv)
    sv.set_defaults(func=lambda a: bench_serve.run(a) and 0)
    kvb = bench.add_parser("kv-connector", help="KV connector: TTFT across a server restart (restart); single instance vs prefill/decode pair (pd)")
    from pagedllm.bench import kv_connector as bench_kv

    bench_kv.add_args(kvb)
    kvb.set_defaults(func=lambda a: bench_kv.run(a) and 0)
    for p in _all_parsers(parser):
        p.set_defaults(_parser=p)
    args, unknown = parser.parse_known_args(argv)
    command_parser = vars(args).pop("_parser", parser)
    if unknown:  # the subcommand's usage, not the top level's
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    model_tag = vars(args).pop("model_tag", None)
    names = getattr(args, "served_model_name", None) or []
    if any(not n.strip() for n in names):
        command_parser.error("--served-model-name: a model name cannot be empty")
    if model_tag is None and args.command == "serve" and args.model is None and any(Path(n).exists() for n in names):
        # (``serve --served-model-name NAME /path/model``: nargs="+" took the path as a name)
        command_parser.error(f"--served-model-name took {' '.join(names)}, a path among them: put the model "
                             "before --served-model-name (pagedllm serve MODEL --served-model-name NAME)")
    if model_tag is not None:
        if args.model is not None and args.model != model_tag:
            command_parser.error(f"the model is given twice: {model_tag} and --model {args.model}")
        args.model = model_tag
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2


def _all_parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """``parser`` and every subcommand's parser under it."""
    out = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in dict.fromkeys(action.choices.values()):
                out += _all_parsers(child)
    return out


if __name__ == "__main__":
    sys.exit(main())
