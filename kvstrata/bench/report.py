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
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


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
