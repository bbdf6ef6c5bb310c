"""Architecture hyper-parameters, read from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from kvstrata.errors import KvstrataError

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "phi3")
SUPPORTED_ARCHITECTURES = (*LLAMA_FAMILY, "opt")
# generation_config.json's sampling settings, which stand for those a request leaves unset (as vLLM's
# --generation-config auto takes them)
SAMPLING_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling; `None` on the config means plain RoPE."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LongRope:
    """LongRoPE (Phi-3's 128k-context models, Phi-3.5): factors that divide RoPE's frequencies, one set for contexts
    up to the pretrained length and one beyond it, and a factor on both q's and k's rotation."""

    short_factors: tuple[float, ...]
    long_factors: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # each RoPE frequency divided by its own (Llama 3.1 GGUFs)
    long_rope: LongRope | None = None  # its factors become rope_freq_factors by the context served (for_context)
    rotary_dim: int | None = None  # channels of a head RoPE turns, where not all (Phi-4-mini: 3/4; rotary.py)
    attention_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head's queries and keys before RoPE (Qwen3)
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    # OPT only
    activation: str = "silu"
    norm_before: bool = True
    word_embed_proj_dim: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # the model maker's sampling settings (generation_config.json's SAMPLING_DEFAULT_FIELDS), as (name, value)
    sampling_defaults: tuple[tuple[str, float], ...] = ()

    def for_context(self, tokens: int) -> ModelConfig:
        """This config for contexts of up to `tokens` tokens: LongRoPE's long factors where that passes the
        pretrained length, else its short ones (llama.cpp chooses by its context size too; transformers by each
        forward's length, which a cache kept across forwards cannot follow). Without LongRoPE, itself."""
        if self.long_rope is None:
            return self
        rope = self.long_rope
        long = tokens > rope.original_max_position_embeddings
        return dataclasses.replace(self, rope_freq_factors=rope.long_factors if long else rope.short_factors)

    @property
    def query_scale(self) -> float:
        """What the turned channels' share of every attention logit is multiplied by: LongRoPE's factor on q's and
        on k's rotation, squared (the model puts it on q's weights alone, so that keys stay plain rotations)."""
        return 1.0 if self.long_rope is None else self.long_rope.attention_factor**2

    @property
    def eos_token_ids(self) -> list[int]:
        """The end-of-text tokens: eos_token_id as a list (a config names one, several or none)."""
        return _token_ids(self.eos_token_id)

    @classmethod
    def from_checkpoint(cls, directory: Path) -> ModelConfig:
        """The directory's config.json, with the end-of-text tokens of its generation_config.json added where it has
        one (instruct models often end turns with a token config.json does not name, as transformers' generate
        knows from that file) and that file's sampling settings."""
        config = cls.from_hf_dict(_read_json(directory / "config.json"))
        generation_file = directory / "generation_config.json"
        if not generation_file.is_file():
            return config
        generation = _read_json(generation_file)
        ends = [*config.eos_token_ids, *_token_ids(generation.get("eos_token_id"))]
        return dataclasses.replace(config, eos_token_id=list(dict.fromkeys(ends)) or None,
                                   sampling_defaults=_sampling_defaults(generation, generation_file))

    @classmethod
    def from_hf_dict(cls, raw: dict) -> ModelConfig:
        arch = raw.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise KvstrataError(
                f"model_type {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == "opt":
            return _opt_config(raw)
        return _llama_family_config(arch, raw)


def _read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KvstrataError(f"cannot read model config {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise KvstrataError(f"model config {path} is not a JSON object")
    return raw


def _frequency_factors(raw: dict, head_dim: int) -> tuple[float, ...] | None:
    """A converted GGUF file's RoPE frequency factors (gguf_convert.py), one per frequency."""
    factors = raw.get("kvstrata_rope_freq_factors")
    if factors is None:
        return None
    if not (isinstance(factors, list) and len(factors) == head_dim // 2
            and all(isinstance(f, int | float) and f > 0 for f in factors)):
        raise KvstrataError(f"kvstrata_rope_freq_factors must be {head_dim // 2} positive numbers, one per RoPE "
                            f"frequency")
    return tuple(float(f) for f in factors)


def _rotary_dim(share, head_dim: int) -> int:
    """The channels of a head RoPE turns (transformers' int(head_dim * partial_rotary_factor)): an even number,
    2 to head_dim."""
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
        raise KvstrataError(f"partial_rotary_factor {share!r} must be a number in (0, 1]")
    rotary_dim = int(head_dim * share)
    if rotary_dim < 2 or rotary_dim % 2:
        raise KvstrataError(f"partial_rotary_factor {share!r} turns {rotary_dim} of a head's {head_dim} channels; RoPE "
                            f"turns them in pairs, so it must be an even number, at least 2")
    return rotary_dim


def _long_rope(rope: dict, raw: dict, rotary_dim: int) -> LongRope:
    """LongRoPE's settings as transformers reads them: the attention factor given, else from the ratio of the
    context to the pretrained one, sqrt(1 + ln(ratio) / ln(pretrained)) (1 where the ratio is not above 1); a factor
    per frequency RoPE turns."""
    original = rope.get("original_max_position_embeddings", raw.get("original_max_position_embeddings"))
    if not isinstance(original, int) or original < 1:
        raise KvstrataError(f"LongRoPE's original_max_position_embeddings {original!r} must be a positive integer")
    factors = {}
    for name in ("short_factor", "long_factor"):
        values = rope.get(name)
        if not (isinstance(values, list) and len(values) == rotary_dim // 2
                and all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values)):
            raise KvstrataError(f"LongRoPE's {name} must be {rotary_dim // 2} positive numbers, one per RoPE frequency")
        factors[name] = tuple(float(v) for v in values)
    ratio = rope.get("factor") or raw.get("max_position_embeddings", original) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 else 1.0
    return LongRope(factors["short_factor"], factors["long_factor"], original, float(attention))


def _sampling_defaults(generation: dict, path: Path) -> tuple[tuple[str, float], ...]:
    defaults = []
    for name in SAMPLING_DEFAULT_FIELDS:
        value = generation.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise KvstrataError(f"{path}: {name} must be a number, got {value!r}")
        if name == "top_k":  # -1 means "off", as 0 does here; a file may write a whole number as 20.0
            value = max(int(value), 0)
        defaults.append((name, value))
    return tuple(defaults)


def _token_ids(value) -> list[int]:
    """A config's token id field (a number, a list of them, or null) as a list."""
    return value if isinstance(value, list) else [] if value is None else [value]


def _llama_family_config(arch: str, raw: dict) -> ModelConfig:
    hidden = raw["hidden_size"]
    heads = raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3", "longrope", "su"):  # "su": LongRoPE's first name in Phi-3's configs
        raise KvstrataError(f"rope type {rope_type!r} is not supported; supported: default, llama3, longrope")
    head_dim = raw.get("head_dim") or hidden // heads
    rotary_dim = _rotary_dim(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)), head_dim)
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=rope["factor"],
            low_freq_factor=rope["low_freq_factor"],
            high_freq_factor=rope["high_freq_factor"],
            original_max_position_embeddings=rope["original_max_position_embeddings"],
        )
    # Mistral's and Phi-3's configs name a window they use; Qwen2's names one it leaves off (use_sliding_window)
    uses_window = raw.get("use_sliding_window", arch in ("mistral", "phi3"))
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        intermediate_size=raw["intermediate_size"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=rope.get("rope_theta", raw.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        rope_freq_factors=_frequency_factors(raw, head_dim),
        long_rope=_long_rope(rope, raw, rotary_dim) if rope_type in ("longrope", "su") else None,
        rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        # Qwen2 always has q/k/v biases; Llama and Mistral say so in the config.
        attention_bias=arch == "qwen2" or raw.get("attention_bias", False),
        qk_norm=arch == "qwen3",
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        sliding_window=raw.get("sliding_window") if uses_window else None,
        activation=raw.get("hidden_act", "silu"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
    )


def _opt_config(raw: dict) -> ModelConfig:
    hidden = raw["hidden_size"]
    heads = raw["num_attention_heads"]
    proj_dim = raw.get("word_embed_proj_dim", hidden)
    return ModelConfig(
        architecture="opt",
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hidden // heads,
        intermediate_size=raw["ffn_dim"],
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        norm_eps=1e-5,
        attention_bias=raw.get("enable_bias", True),
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        activation=raw.get("activation_function", "relu"),
        norm_before=raw.get("do_layer_norm_before", True),
        word_embed_proj_dim=proj_dim if proj_dim != hidden else None,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
    )
