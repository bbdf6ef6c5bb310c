"""Prometheus metrics of the server, named like vLLM's so existing dashboards carry over."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily

from kvstrata.engine.kv_store_link import KVStoreLink
from kvstrata.engine.llm_engine import LLMEngine, StepStats
from kvstrata.engine.outputs import RequestOutput

disable_created_metrics()  # the *_created series only add noise for scrapers
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    def __init__(self, model_name: str, engine: LLMEngine | None = None):
        self.registry = CollectorRegistry()
        if engine is not None:
            self.registry.register(PrefixCacheCollector(engine, model_name))
        kernel = getattr(engine.kv_cache, "decode_kernel", None) if engine is not None else None
        if kernel is not None and engine.config.cascade_min_tokens:
            self.registry.register(CascadeCollector(kernel, model_name))
        if engine is not None and engine.kv_store is not None:
            self.registry.register(KVStoreCollector(engine, model_name))
        labels = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(name, doc, list(labels), registry=self.registry).labels(**labels)

        def counter(name, doc):
            return Counter(name, doc, list(labels), registry=self.registry).labels(**labels)

        def histogram(name, doc):
            return Histogram(name, doc, list(labels), buckets=LATENCY_BUCKETS, registry=self.registry).labels(**labels)

        self.running = gauge("kvstrata:num_requests_running", "Requests in the running batch")
        self.waiting = gauge("kvstrata:num_requests_waiting", "Requests waiting to be scheduled")
        self.loading = gauge("kvstrata:num_requests_loading_kv", "Requests whose KV is being fetched from the KV store")
        self.kv_usage = gauge("kvstrata:kv_cache_usage_perc", "Fraction of KV blocks held by live requests")
        self.prefix_hit_rate = gauge("kvstrata:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache")
        self.prompt_tokens = counter("kvstrata:prompt_tokens", "Prompt tokens of requests that got a first token")
        self.generation_tokens = counter("kvstrata:generation_tokens", "Tokens generated")
        self.preemptions = counter("kvstrata:num_preemptions", "Requests preempted for lack of KV blocks")
        self.draft_tokens = counter("kvstrata:spec_decode_num_draft_tokens", "Speculative decoding: drafts verified")
        self.accepted_tokens = counter("kvstrata:spec_decode_num_accepted_tokens",
                                       "Speculative decoding: drafts accepted")
        self.ttft = histogram("kvstrata:time_to_first_token_seconds", "Arrival to first token")
        self.itl = histogram("kvstrata:inter_token_latency_seconds", "Time between consecutive outputs")
        self.e2e = histogram("kvstrata:e2e_request_latency_seconds", "Arrival to the last token")
        self.finished = Counter(
            "kvstrata:request_success", "Requests finished, by reason", ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # vLLM's: one series whose labels name the LoRA adapters of running and waiting requests (comma-separated)
        # and whose value is when they were read; max_lora, the most adapters a step may hold: every one loaded
        self.lora_info = None
        self._lora_labels: dict[str, str] | None = None
        if engine is not None and engine.lora is not None:
            self.lora_info = Gauge("kvstrata:lora_requests_info", "LoRA adapters of running and waiting requests",
                                   ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                                   registry=self.registry)
            self._observe_lora(engine)
        self.model_name = model_name
        self._last_token_time: dict[str, float] = {}
        self._counted_step: StepStats | None = None  # the step whose counts the counters hold

    def observe_output(self, output: RequestOutput) -> None:
        """Called in the engine thread for every output a step produced."""
        now = time.perf_counter()
        if output.new_token_ids:
            self.generation_tokens.inc(len(output.new_token_ids))
            last = self._last_token_time.get(output.request_id)
            if last is None:
                self.prompt_tokens.inc(len(output.prompt_token_ids))
                if output.metrics.ttft is not None:
                    self.ttft.observe(output.metrics.ttft)
            else:
                self.itl.observe(now - last)
            self._last_token_time[output.request_id] = now
        elif output.embedding is not None:  # an embedding request: its prompt, and the time to its embedding
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            self.ttft.observe(output.metrics.ttft)
        if output.finished:
            self.observe_finished(output)

    def observe_finished(self, output: RequestOutput) -> None:
        self._last_token_time.pop(output.request_id, None)
        self.finished.labels(model_name=self.model_name, finished_reason=output.finish_reason).inc()
        if output.metrics.e2e is not None:
            self.e2e.observe(output.metrics.e2e)

    def observe_step(self, engine: LLMEngine) -> None:
        self.running.set(engine.num_running)
        self.waiting.set(engine.num_waiting)
        self.loading.set(engine.num_loading)
        self.kv_usage.set(engine.kv_manager.usage)
        self.prefix_hit_rate.set(engine.kv_manager.prefix_stats.hit_rate)
        if self.lora_info is not None:
            self._observe_lora(engine)
        # counted once: gauges are also refreshed between steps (after aborts), when the last step is the same one
        if engine.step_stats and engine.step_stats[-1] is not self._counted_step:
            last = self._counted_step = engine.step_stats[-1]
            self.preemptions.inc(last.num_preempted)
            self.draft_tokens.inc(last.num_draft_tokens)
            self.accepted_tokens.inc(last.num_accepted_tokens)

    def _observe_lora(self, engine: LLMEngine) -> None:
        """The new series set before the old one goes, so that a scrape in between never finds none."""
        running, waiting = (",".join(sorted({seq.lora.name for seq in seqs if seq.lora is not None}))
                            for seqs in (engine.scheduler.running, engine.scheduler.waiting))
        labels = {"max_lora": str(len(engine.lora.adapters)), "waiting_lora_adapters": waiting,
                  "running_lora_adapters": running}
        self.lora_info.labels(**labels).set(time.time())
        if self._lora_labels not in (None, labels):
            self.lora_info.remove(*self._lora_labels.values())
        self._lora_labels = labels

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PrefixCacheCollector:
    """Prompt tokens looked up in the device pool's prefix cache and found there, as counters (vLLM's
    names): unlike the hit-rate gauge, these add up across replicas and over any time window."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.stats = engine.kv_manager.prefix_stats
        self.model_name = model_name

    def collect(self):
        for name, value, doc in (
            ("queries", self.stats.queried_tokens, "Prompt tokens looked up in the prefix cache"),
            ("hits", self.stats.hit_tokens, "Prompt tokens found in the prefix cache"),
        ):
            family = CounterMetricFamily(f"kvstrata:prefix_cache_{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class CascadeCollector:
    """Prefixes the compiled decode kernels read once for all the decodes sharing them (cascade attention,
    `--cascade-min-tokens`; one per group of sequences, layer and step), as a counter: whether shared prefixes are
    read that way under the server's traffic. The kernels count for their process, which serves one engine."""

    def __init__(self, kernel, model_name: str):
        self.kernel = kernel
        self.model_name = model_name

    def collect(self):
        family = CounterMetricFamily("kvstrata:cascade_prefix_reads", "Shared prefixes read once for all the decodes "
                                     "sharing them (one per group, layer and step)", labels=["model_name"])
        family.add_metric([self.model_name], self.kernel.shared_prefix_reads())
        yield family


# Per-tier counters of the KV store below the paged cache: (name, TierStats field, help).
TIER_COUNTERS = (
    ("hit_tokens", "hit_tokens", "Prompt tokens whose KV this tier supplied"),
    ("miss_tokens", "miss_tokens", "Prompt tokens asked of this tier that it did not hold"),
    ("chunk_hits", "chunk_hits", "Chunks a load used that this tier supplied"),
    ("chunk_misses", "chunk_misses", "Chunks a load used that a tier below this one supplied"),
    ("chunks_refused", "chunks_refused", "Chunks this tier's eviction policy did not store (worth less than any it held)"),
    ("read_bytes", "bytes_read", "Bytes read from this tier"),
    ("written_bytes", "bytes_written", "Bytes written to this tier"),
    ("fetch_seconds", "fetch_seconds", "Time spent fetching from this tier"),
    ("errors", "errors", "Failures of this tier: unreachable, timed out, full, or an object that failed its check"),
)


class KVStoreCollector:
    """Reads the counters of the engine's KV store link when /metrics is scraped (plain numbers, safe to read from
    the server's thread while the engine thread updates them): the link in use then (use_kv_store_link may have
    changed it; with none, nothing)."""

    def __init__(self, engine: LLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        link = self.engine.kv_store  # once: the scrape reads one link throughout
        if link is None:
            return
        for name, field, doc in TIER_COUNTERS:
            family = CounterMetricFamily(f"kvstrata:kv_store_{name}", doc, labels=["model_name", "tier"])
            for tier in link.store.tiers:
                family.add_metric([self.model_name, tier.name], getattr(tier.stats, field))
            yield family
        store, stats = link.store.stats, link.stats
        for name, value, doc in (
            ("decode_seconds", store.decode_seconds,
             "Time spent checking and decoding fetched chunks (summed over the decoder threads)"),
            ("encode_seconds", store.encode_seconds, "Time spent encoding chunks to write"),
            ("corrupt_objects", store.corrupt_objects, "Stored chunks that failed their check (dropped, recomputed)"),
            ("load_failures", stats.load_failures, "Loads cut short by a tier failure (the rest was recomputed)"),
            ("writes_skipped", stats.writes_skipped, "Chunks not written (write backlog full or unreadable)"),
        ):
            yield self._counter(f"kvstrata:kv_store_{name}", doc, value)
        family = CounterMetricFamily("kvstrata:kv_store_streamed_chunks", "Chunks stored at several levels, by the "
                                     "level their last layers were read at (text: recomputed)",
                                     labels=["model_name", "level"])
        for level, count in sorted(stats.chunks_by_option.copy().items()):  # copy: atomic
            family.add_metric([self.model_name, level], count)
        yield family
        yield self._counter("kvstrata:kv_store_chunks_below_allowed", "Streamed chunks read below the level the "
                            "throughput of their own read allowed", stats.chunks_below_allowed)
        yield self._counter("kvstrata:kv_store_chunks_switched", "Streamed chunks finished at another level after "
                            "the link slowed during their read", stats.chunks_switched)
        if link.important is not None:
            yield from self._important_loads(link)

    def _counter(self, name: str, doc: str, value: float, **labels: str) -> CounterMetricFamily:
        """One counter of this model, with `labels` beside the model's name."""
        family = CounterMetricFamily(name, doc, labels=["model_name", *labels])
        family.add_metric([self.model_name, *labels.values()], value)
        return family

    def _important_loads(self, link: KVStoreLink):
        """`--prefix-loading impress|h2o-keys`: what the loads by importance read and chose."""
        stats = link.important_stats
        for name, value, doc in (
            ("loads", stats.loads, "Requests whose stored prefix was loaded by importance"),
            ("layers", stats.layers, "Layer choices those loads made"),
            ("fallbacks", stats.fallbacks, "Layers that read their whole prefix (the probe heads disagreed)"),
            ("read_bytes", stats.bytes_read, "Bytes those loads read (probe keys, K, V)"),
            ("chunk_reads", stats.chunk_reads, "(chunk, layer) pairs whose K or V those loads read"),
            ("offered_tokens", stats.tokens_offered, "Prefix tokens times layers of those loads"),
            ("chosen_tokens", stats.tokens_chosen, "Prefix tokens times layers that those loads' rule chose"),
            ("attended_tokens", stats.tokens_read,
             "Prefix tokens times layers that those loads read and attend to (the chosen ones' chunk-mates too)"),
        ):
            yield self._counter(f"kvstrata:prefix_loading_{name}", doc, value, method=link.important.method)
