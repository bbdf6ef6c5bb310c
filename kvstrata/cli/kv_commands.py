"""`kvstrata kv save | inspect | store` and `kvstrata calibrate cachegen`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from kvstrata.cachegen.context import DEFAULT_CHUNK_TOKENS
from kvstrata.cachegen.levels import ALL_LEVELS, CACHEGEN_LEVELS
from kvstrata.cli.arg_types import output_file, positive_int
from kvstrata.cli.calibrate_infinigen import add_infinigen_calibrate_command, run_infinigen_calibrate
from kvstrata.cli.calibrate_oaken import add_oaken_calibrate_command, run_oaken_calibrate
from kvstrata.cli.engine_args import add_engine_arguments, engine_config_from_args
from kvstrata.cli.kv_store_commands import add_kv_store_commands, run_kv_store
from kvstrata.errors import KvstrataError


def add_kv_commands(commands) -> None:
    kv = commands.add_parser("kv", help="save and inspect KV caches of contexts (CacheGen); inspect or clear a KV store").add_subparsers(
        dest="kv", required=True
    )
    save = kv.add_parser(
        "save", help="prefill a text once and save its KV cache as CacheGen chunks",
        description="Prefill --text and write its KV cache, cut into chunks, each encoded at every --levels level. "
                    "Resume from it with `kvstrata generate PROMPT --context PATH`.",
    )
    save.add_argument("--text", type=Path, required=True, help="UTF-8 context text")
    save.add_argument("--out", type=output_file, required=True, help="the KV file to write")
    save.add_argument("--levels", default=",".join(CACHEGEN_LEVELS),
                      help=f"comma-separated levels among {', '.join(ALL_LEVELS)} (default: the CacheGen levels)")
    save.add_argument("--chunk-tokens", type=positive_int, default=DEFAULT_CHUNK_TOKENS,
                      help=f"tokens per independently decodable chunk (default: {DEFAULT_CHUNK_TOKENS})")
    save.add_argument("--max-context-tokens", type=positive_int, default=None, help="keep only the text's first N tokens")
    save.add_argument("--profile", type=Path, default=None, help="offline profile for profiled levels")
    add_engine_arguments(save)

    inspect = kv.add_parser("inspect", help="levels, sizes and bits per value of a KV file")
    inspect.add_argument("path", type=Path)
    inspect.add_argument("--json", action="store_true", help="print exactly one JSON document")
    add_kv_store_commands(kv)


def add_calibrate_commands(commands) -> None:
    calibrate = commands.add_parser("calibrate", help="offline profiles").add_subparsers(
        dest="calibrate", required=True
    )
    cachegen = calibrate.add_parser(
        "cachegen", help="profile CacheGen's coder models for a model",
        description="Run windows of --text through the model, fit each (layer, channel)'s anchor differences and "
                    "measure how much an error in each costs the tokens after it. Runs the model with fp32 weights "
                    "unless a float --weights is given (the measure takes gradients, which the int4/int8 kernels lack); "
                    "the profile is keyed by the checkpoint, so it serves every weight form.",
    )
    cachegen.add_argument("--text", type=Path, required=True, help="UTF-8 calibration text")
    cachegen.add_argument("--out", type=output_file, required=True, help="the profile file to write")
    cachegen.add_argument("--windows", type=positive_int, default=100, help="windows of text (default: 100)")
    cachegen.add_argument("--window-tokens", type=positive_int, default=512, help="tokens per window (default: 512)")
    cachegen.add_argument("--sensitivity-windows", type=positive_int, default=16,
                          help="windows of 1,024 context and 256 scored tokens for the sensitivity (default: 16)")
    add_engine_arguments(cachegen)
    add_oaken_calibrate_command(calibrate)
    add_infinigen_calibrate_command(calibrate)


def run_kv(args: argparse.Namespace) -> None:
    if args.kv == "inspect":
        return inspect_kv_file(args.path, args.json)
    if args.kv == "store":
        return run_kv_store(args)
    from kvstrata.bench.workload import read_text
    from kvstrata.cachegen.profile import CodecProfile
    from kvstrata.llm import LLM

    llm = LLM(**vars(engine_config_from_args(args)))
    token_ids = llm.engine.tokenize(read_text(args.text))[: args.max_context_tokens]
    args.out.parent.mkdir(parents=True, exist_ok=True)  # as the calibrate commands make their file's directories
    profile = CodecProfile.load(args.profile, llm.engine.model_fingerprint) if args.profile else None
    levels = [level.strip() for level in args.levels.split(",") if level.strip()]
    report = llm.save_context(token_ids, args.out, levels, args.chunk_tokens, profile)
    plural = "s" if len(levels) != 1 else ""
    print(f"saved {report.num_tokens} tokens at {len(levels)} level{plural} to {report.path}: {report.bytes} bytes "
          f"(prefill {report.prefill_seconds:.2f} s, encode {report.encode_seconds:.2f} s)")


def inspect_kv_file(path: Path, as_json: bool) -> None:
    from kvstrata.cachegen.bitstream import KVFile

    kv_file = KVFile.open(path)
    header = kv_file.header
    model = header.model
    values_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim
    levels: dict[str, dict] = {}
    for record in header.records:
        start, end = header.chunk_bounds[record.chunk]
        entry = levels.setdefault(record.level, {"bytes": 0, "tokens": 0, "chunks": 0, "settings": record.settings.to_json()})
        entry["bytes"] += record.length
        entry["tokens"] += end - start
        entry["chunks"] += 1
    for entry in levels.values():
        entry["bits_per_value"] = 8 * entry["bytes"] / (entry["tokens"] * values_per_token)
        entry["bytes_per_token"] = entry["bytes"] / entry["tokens"]
    report = {
        "path": str(path), "file_bytes": len(kv_file.data), "model": vars(model),
        "num_tokens": len(header.token_ids), "chunks": [list(b) for b in header.chunk_bounds],
        "profile": header.profile, "levels": levels,
    }
    if as_json:
        print(json.dumps(report, indent=2))
        return
    print(f"{path}: {report['num_tokens']} tokens in {len(header.chunk_bounds)} chunks, {report['file_bytes']} bytes, "
          f"model {model.fingerprint} ({model.num_layers} layers x {model.num_kv_heads} KV heads x {model.head_dim})")
    print(f"{'level':<16}{'bytes':>12}{'bytes/token':>14}{'bits/value':>12}")
    for name, entry in levels.items():
        print(f"{name:<16}{entry['bytes']:>12}{entry['bytes_per_token']:>14.1f}{entry['bits_per_value']:>12.3f}")


def run_calibrate(args: argparse.Namespace) -> None:
    if args.calibrate == "oaken":
        return run_oaken_calibrate(args)
    if args.calibrate == "infinigen":
        return run_infinigen_calibrate(args)
    from kvstrata.bench.workload import read_text
    from kvstrata.cachegen.profile import calibrate
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.model.weight_format import FLOAT_FORMATS

    config = engine_config_from_args(args)
    if config.weights not in FLOAT_FORMATS:  # the sensitivity's gradients need float weights
        config = dataclasses.replace(config, weights="fp32")
    engine = LLMEngine(config)
    if engine.tokenizer is None:
        raise KvstrataError("calibration needs a model with a tokenizer")
    profile = calibrate(engine, engine.tokenize(read_text(args.text)), args.windows, args.window_tokens,
                        sensitivity_windows=args.sensitivity_windows)
    profile.save(args.out)
    print(f"wrote the CacheGen profile of model {profile.fingerprint} ({profile.num_windows} windows) to {args.out}")
