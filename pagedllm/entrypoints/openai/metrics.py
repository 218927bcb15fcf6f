"""Prometheus metrics with vLLM's names and meanings under the ``pagedllm:`` prefix (where a
meaning differs, docs/vllm_compat.md says how: ``iteration_tokens_total``, echo without tokens).

Fed from engine stats (per step) and from request outputs (per token and at the end), both
delivered in the engine thread; gauges read the engine state when scraped. Each server has
its own registry, so two engines in one process do not collide.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedllm.engine.startup import kv_cache_sizes
from pagedllm.engine.stats import StepStats
from pagedllm.kv_connector.base import KVConnectorStats
from pagedllm.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedllm.engine.async_llm import AsyncLLM

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's for request_params_n


def _1_2_5_buckets(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's buckets for max_tokens)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class KVConnectorMetrics:
    """The KV connector's counters (kv_connector/base.py KVConnectorStats). The store hit rate
    is ``kv_connector_hit_blocks / kv_connector_queried_blocks`` (as vLLM's prefix-cache
    metrics: two counters, so any window's rate can be computed)."""

    def __init__(self, r: CollectorRegistry, labels: dict[str, str]):
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"pagedllm:kv_connector_{name}", doc, ["model_name"], registry=r).labels(**labels)

        self.queried = counter("queried_blocks", "Blocks looked up in the KV store, beyond the local prefix cache.")
        self.hits = counter("hit_blocks", "Blocks found in the KV store and verified.")
        self.rejected = counter("rejected_blocks", "Block files found but torn, corrupt or another model's: ignored, recomputed.")
        self.loaded = counter("loaded_blocks", "Blocks loaded from the KV store into the KV cache.")
        self.loaded_bytes = counter("loaded_bytes", "Bytes loaded from the KV store.")
        self.saved = counter("saved_blocks", "Blocks written to the KV store.")
        self.saved_bytes = counter("saved_bytes", "Bytes written to the KV store.")
        self.dropped = counter("dropped_saves", "Blocks not saved: the saver's backlog was full, or the write failed (e.g. a full disk).")
        self.load_latency = Histogram("pagedllm:kv_connector_load_seconds", "Per request: reading, verifying and loading its blocks from the KV store.",
                                      ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)  # fmt: skip
        self.queried_total = self.hits_total = 0  # since the start, for the hit-rate gauge
        Gauge("pagedllm:kv_connector_hit_rate", "Blocks found in the KV store / blocks looked up, since the start (0..1).",
              ["model_name"], registry=r).labels(**labels).set_function(
                  lambda: self.hits_total / self.queried_total if self.queried_total else 0.0)  # fmt: skip

    def record(self, s: KVConnectorStats) -> None:
        self.queried_total += s.num_queried_blocks
        self.hits_total += s.num_hit_blocks
        self.queried.inc(s.num_queried_blocks)
        self.hits.inc(s.num_hit_blocks)
        self.rejected.inc(s.num_rejected_blocks)
        self.loaded.inc(s.num_loaded_blocks)
        self.loaded_bytes.inc(s.num_loaded_bytes)
        self.saved.inc(s.num_saved_blocks)
        self.saved_bytes.inc(s.num_saved_bytes)
        self.dropped.inc(s.num_dropped_saves)
        for seconds in s.load_seconds:
            self.load_latency.observe(seconds)


class ServerMetrics:
    def __init__(self, async_llm: "AsyncLLM", model_name: str):
        self.registry = CollectorRegistry()
        engine = async_llm.engine
        labels = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str, fn) -> None:
            Gauge(f"pagedllm:{name}", doc, ["model_name"], registry=r).labels(**labels).set_function(fn)

        # With data parallelism: sums over the replicas (usage: their mean), as of their last step.
        gauge("num_requests_running", "Requests in the running batch.", async_llm.num_running)
        gauge("num_requests_waiting", "Requests waiting to be scheduled.", async_llm.num_waiting)
        gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", async_llm.kv_cache_usage)
        if async_llm.data_parallel_size > 1:  # each replica's load, as the balancer sees it
            per_replica = [("dp_replica_num_requests", "Requests routed to a data-parallel replica and not finished.", 0),
                           ("dp_replica_kv_cache_usage_perc", "A data-parallel replica's KV-cache usage (0..1).", 1)]  # fmt: skip
            for name, doc, k in per_replica:
                g = Gauge(f"pagedllm:{name}", doc, ["model_name", "engine"], registry=r)
                for i in range(async_llm.data_parallel_size):
                    g.labels(engine=str(i), **labels).set_function(lambda i=i, k=k: async_llm.replica_loads()[i][k])
        self.prompt_tokens = Counter("pagedllm:prompt_tokens", "Prompt tokens processed (prefix-cache hits included, as usage counts them).",
                                     ["model_name"], registry=r).labels(**labels)  # fmt: skip
        self.generation_tokens = Counter("pagedllm:generation_tokens", "Tokens generated.", ["model_name"], registry=r).labels(**labels)
        self.prefix_queries = Counter("pagedllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", ["model_name"], registry=r).labels(**labels)
        self.prefix_hits = Counter("pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", ["model_name"], registry=r).labels(**labels)
        self.prefix_uncacheable = Counter(
            "pagedllm:prefix_cache_uncacheable_tokens",
            "Prompt tokens past the last cacheable full block (never cached; short shared prefixes live here).",
            ["model_name"],
            registry=r,
        ).labels(**labels)
        self.preemptions = Counter("pagedllm:num_preemptions", "Preemptions.", ["model_name"], registry=r).labels(**labels)
        self.request_success = Counter(
            "pagedllm:request_success", "Finished requests by finish reason.", ["model_name", "finished_reason"], registry=r
        )
        for reason in ("stop", "length", "abort", "error"):  # every series from the start, as vLLM (dashboards see 0s)
            self.request_success.labels(finished_reason=reason, **labels)
        self.labels = labels
        self.rejected = Counter(
            "pagedllm:num_requests_rejected",
            "Requests refused before reaching the engine, by reason (overloaded: the waiting queue was full; engine_dead).",
            ["model_name", "reason"],
            registry=r,
        )
        self.ttft = Histogram("pagedllm:time_to_first_token_seconds", "Time to first token.", ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram("pagedllm:inter_token_latency_seconds", "Time between output tokens.", ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("pagedllm:e2e_request_latency_seconds", "Arrival to finish.", ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        self.queue_time = Histogram("pagedllm:request_queue_time_seconds", "Arrival to first scheduling.", ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)
        # A finished request's phases (vLLM's names): prefill = first scheduled to first token,
        # decode = first token to finish, inference = both; and its mean time per output token.
        self.prefill_time = Histogram("pagedllm:request_prefill_time_seconds", "First scheduled to first token, per finished request.",
                                      ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)  # fmt: skip
        self.decode_time = Histogram("pagedllm:request_decode_time_seconds", "First token to finish, per finished request.",
                                     ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)  # fmt: skip
        self.inference_time = Histogram("pagedllm:request_inference_time_seconds", "First scheduled to finish (running, preemptions included), per finished request.",
                                        ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)  # fmt: skip
        self.tpot = Histogram("pagedllm:request_time_per_output_token_seconds", "Decode time / (output tokens - 1) of each finished request with 2 or more tokens per sequence.",
                              ["model_name"], buckets=_LATENCY_BUCKETS, registry=r).labels(**labels)  # fmt: skip
        self.iteration_tokens = Histogram("pagedllm:iteration_tokens_total", "Tokens per engine step.", ["model_name"], buckets=_TOKEN_BUCKETS, registry=r).labels(**labels)
        self.request_prompt_tokens = Histogram("pagedllm:request_prompt_tokens", "Prompt tokens per finished request.", ["model_name"],
                                               buckets=_TOKEN_BUCKETS, registry=r).labels(**labels)  # fmt: skip
        max_len = engine.max_model_len
        self.request_max_generation_tokens = Histogram(
            "pagedllm:request_max_num_generation_tokens", "Output tokens of a finished request's longest sample (its sequence length).",
            ["model_name"], buckets=_1_2_5_buckets(max_len), registry=r,
        ).labels(**labels)  # fmt: skip
        # A request's parameters, observed when it is accepted (vLLM observes at the finish;
        # accepted and finished differ only by the requests still running).
        self.params_n = Histogram("pagedllm:request_params_n", "The n parameter of each request.", ["model_name"],
                                  buckets=_N_BUCKETS, registry=r).labels(**labels)  # fmt: skip
        self.params_max_tokens = Histogram("pagedllm:request_params_max_tokens", "The max_tokens parameter of each request (as resolved).",
                                           ["model_name"], buckets=_1_2_5_buckets(max_len), registry=r).labels(**labels)  # fmt: skip
        # vLLM's cache_config_info: the pool's shape as labels (per replica with data parallelism;
        # "gpu" is the KV pool, "cpu" the swap pool of preemption_mode="swap").
        config, sizes = engine.config, kv_cache_sizes(engine.config, engine.arch)
        Gauge("pagedllm:cache_config_info", "The KV cache's configuration (labels); the value is 1.",
              ["block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks", "num_cpu_blocks"], registry=r).labels(
                  block_size=str(config.block_size), cache_dtype=str(config.kv_cache_dtype),
                  enable_prefix_caching=str(config.enable_prefix_caching), num_gpu_blocks=str(sizes.num_blocks),
                  num_cpu_blocks=str(sizes.num_swap_blocks)).set(1)  # fmt: skip
        self.request_generation_tokens = Histogram("pagedllm:request_generation_tokens", "Output tokens per finished request (all its samples, as usage counts them).",
                                                   ["model_name"], buckets=_TOKEN_BUCKETS, registry=r).labels(**labels)  # fmt: skip
        # Speculative decoding (vLLM's spec_decode counters); per_pos: accepted at draft position j.
        self.spec_drafts = Counter("pagedllm:spec_decode_num_drafts", "Draft sequences verified.", ["model_name"], registry=r).labels(**labels)
        self.spec_draft_tokens = Counter("pagedllm:spec_decode_num_draft_tokens", "Draft tokens verified.", ["model_name"], registry=r).labels(**labels)
        self.spec_accepted = Counter("pagedllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", ["model_name"], registry=r).labels(**labels)
        self.spec_per_pos = Counter(
            "pagedllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by draft position.",
            ["model_name", "position"], registry=r,
        )  # fmt: skip
        self.kv_connector = KVConnectorMetrics(r, labels) if engine.config.kv_transfer_config is not None else None
        if engine.kv_connector is not None:  # one engine (data-parallel replicas each have their own store view)
            connector = engine.kv_connector
            gauge("kv_connector_store_bytes", "Bytes of block files in the KV store (as this server knows them).",
                  lambda: getattr(connector.store, "total_bytes", 0))  # fmt: skip
        # LoRA (vLLM's lora_requests_info): the adapters with running / waiting requests as
        # labels, the value the time of the update; and the requests per adapter and state.
        self.max_lora = str(engine.config.max_loras) if engine.config.enable_lora else None
        if self.max_lora is not None:
            self.lora_info = Gauge(
                "pagedllm:lora_requests_info", "Running and waiting LoRA adapters (names, comma-separated).",
                ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=r,
            )  # fmt: skip
            self.lora_requests = Gauge("pagedllm:lora_requests", "Requests per LoRA adapter, running or waiting.",
                                       ["model_name", "lora_name", "state"], registry=r)  # fmt: skip
            self.lora_info.labels(max_lora=self.max_lora, running_lora_adapters="", waiting_lora_adapters="").set(time.time())
            self._lora_last: tuple | None = None
        self._last_token_time: dict[str, float] = {}
        self._output_tokens: dict[str, dict[int, int]] = {}  # request id -> sample index -> output tokens so far
        self._params: dict[str, Any] = {}  # request id -> SamplingParams, until it finishes
        async_llm.add_stat_logger(self)
        async_llm.output_hooks.append(self.on_output)
        async_llm.request_hooks.append(self.on_request)

    def on_request(self, request_id: str, req: Any) -> None:
        """An accepted request (a ProcessedRequest): its sampling parameters, observed when it
        finishes (as vLLM does), unless the engine then rejects it (``on_output``)."""
        self._params[request_id] = req.sampling_params

    def record(self, stats: StepStats) -> None:
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generation_tokens)
        self.preemptions.inc(stats.num_preemptions)
        self.prefix_queries.inc(stats.num_prefix_queries)
        self.prefix_hits.inc(stats.num_prefix_hits)
        self.prefix_uncacheable.inc(stats.num_uncacheable_tokens)
        if stats.num_scheduled_tokens:
            self.iteration_tokens.observe(stats.num_scheduled_tokens)
        if stats.lora is not None and self.max_lora is not None:
            self._record_lora(*stats.lora)
        if stats.spec is not None:
            self.spec_drafts.inc(stats.spec.num_drafts)
            self.spec_draft_tokens.inc(stats.spec.num_draft_tokens)
            self.spec_accepted.inc(stats.spec.num_accepted_tokens)
            for j, n in enumerate(stats.spec.accepted_per_pos):
                self.spec_per_pos.labels(position=str(j), **self.labels).inc(n)
        if stats.kv_connector is not None and self.kv_connector is not None:
            self.kv_connector.record(stats.kv_connector)

    def _record_lora(self, running: dict[str, int], waiting: dict[str, int]) -> None:
        key = (tuple(sorted(running.items())), tuple(sorted(waiting.items())))
        if key == self._lora_last:  # nothing changed: keep the labels (and their time)
            return
        self._lora_last = key
        self.lora_info.clear()
        self.lora_info.labels(max_lora=self.max_lora, running_lora_adapters=",".join(sorted(running)),
                              waiting_lora_adapters=",".join(sorted(waiting))).set(time.time())  # fmt: skip
        self.lora_requests.clear()
        for state, counts in (("running", running), ("waiting", waiting)):
            for name, n in counts.items():
                self.lora_requests.labels(lora_name=name, state=state, **self.labels).set(n)

    def on_output(self, out: RequestOutput) -> None:
        if out.rejected:  # refused after admission (a constraint that admits no output): the client got a 400,
            self._params.pop(out.request_id, None)  # as for requests refused before the engine, no metric moves
            self._output_tokens.pop(out.request_id, None)
            self._last_token_time.pop(out.request_id, None)
            return
        now = time.monotonic()
        # Tokens per sequence: the n samples (or beams) of a request advance together, so a
        # step that gives each its token is one inter-token gap, not n.
        new_tokens = max((len(c.token_ids) for c in out.outputs), default=0)
        m = out.metrics
        if new_tokens and m is not None:
            last = self._last_token_time.get(out.request_id)
            if last is None:
                # The engine's own first-token time: an output that comes only at the end (best_of,
                # beam search) holds every token, and its first came long before the hook.
                first = m.first_token_time if m.first_token_time is not None else now
                self.ttft.observe(first - m.arrival_time)
                if new_tokens > 1:  # the rest of those tokens, evenly over the time since the first
                    end = m.finished_time if out.finished and m.finished_time is not None else now
                    gap = (end - first) / (new_tokens - 1)
                    for _ in range(new_tokens - 1):
                        self.itl.observe(gap)
            else:
                gap = (now - last) / new_tokens
                for _ in range(new_tokens):
                    self.itl.observe(gap)
            self._last_token_time[out.request_id] = now
        # Output tokens per sample (delta outputs hold only the samples still running).
        per_sample = self._output_tokens.pop(out.request_id, {})
        for c in out.outputs:
            per_sample[c.index] = per_sample.get(c.index, 0) + len(c.token_ids)
        output_tokens = sum(per_sample.values())
        if not out.finished:
            self._output_tokens[out.request_id] = per_sample
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            params = self._params.pop(out.request_id, None)
            if params is not None:
                self.params_n.observe(params.n)
                if params.max_tokens is not None:
                    self.params_max_tokens.observe(params.max_tokens)
            self.request_prompt_tokens.observe(len(out.prompt_token_ids))
            self.request_generation_tokens.observe(output_tokens)
            self.request_max_generation_tokens.observe(max(per_sample.values(), default=0))
            reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
            self.request_success.labels(finished_reason=reason, **self.labels).inc()
            if m is not None:
                self.e2e.observe(now - m.arrival_time)
                self._record_phases(m, now, max(per_sample.values(), default=0))  # the longest sample's tokens

    def _record_phases(self, m, now: float, tokens_per_sequence: int) -> None:
        end = m.finished_time if m.finished_time is not None else now
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
            self.inference_time.observe(end - m.first_scheduled_time)
            if m.first_token_time is not None:
                self.prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        if m.first_token_time is not None:
            self.decode_time.observe(end - m.first_token_time)
            if tokens_per_sequence > 1:
                self.tpot.observe((end - m.first_token_time) / (tokens_per_sequence - 1))

    def render(self) -> bytes:
        # (The KV connector's saves that finish between steps arrive with the engine's next
        # step or its state report, about once a second while idle: one drain, on one thread.)
        return generate_latest(self.registry)
