"""The envelope every benchmark and evaluation prints: machine, model, configuration, figures."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys

import torch

from kvstrata.engine.llm_engine import LLMEngine


def machine_info() -> dict:
    """What a figure was measured on. The CPU's model and the instructions that choose the kernels' paths (AVX-512
    VNNI: the weights' dot products; bfloat16 and AMX: the dense widening's dtype) are part of it, since the same
    benchmark can cross its target on one x86-64 CPU and not on another."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_features": [name for name, held in (("vnni", torch.cpu._is_vnni_supported()),
                                                 ("avx512_bf16", torch.cpu._is_avx512_bf16_supported()),
                                                 ("amx_tile", torch.cpu._is_amx_tile_supported())) if held],
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _cpu_model() -> str | None:
    """The CPU's model name as Linux reports it; None where /proc/cpuinfo does not say."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), None)
    except OSError:
        return None


def engine_info(engine: LLMEngine) -> dict:
    """The model and every engine option of a run."""
    return {"model": engine.loaded.name, "config": dataclasses.asdict(engine.config),
            "weights": engine.loaded.weights_summary()}


def sig(value: float, digits: int = 4) -> float:
    """`value` to `digits` significant digits: readable at every scale, from a tiny test model up."""
    return float(f"{value:.{digits}g}")


def emit(report: dict, as_json: bool) -> None:
    """With --json, stdout holds exactly the document; otherwise a readable listing."""
    if as_json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if isinstance(value, dict | list) and len(json.dumps(value)) > 100:
            value = json.dumps(value)[:100] + " ..."
        print(f"{key:>28}: {value}", file=sys.stdout)
