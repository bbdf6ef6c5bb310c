"""The `kvstrata` command: generate, chat, serve, bench, eval, kv, calibrate."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from kvstrata.cli.bench_commands import add_bench_commands, run_bench
from kvstrata.cli.engine_args import add_engine_arguments, engine_config_from_args
from kvstrata.cli.eval_commands import add_eval_commands, run_eval
from kvstrata.cli.kv_commands import add_calibrate_commands, add_kv_commands, run_calibrate, run_kv
from kvstrata.errors import KvstrataError
from kvstrata.server.serve import add_serve_arguments, run_serve


def _add_sampling_arguments(parser: argparse.ArgumentParser, temperature: float) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default: 256)")
    group.add_argument(
        "--temperature", type=float, default=temperature,
        help=f"sampling temperature; 0 is greedy (default: {temperature})",
    )
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1.0)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0 = all (default: 0)")
    group.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens less likely than this share of the likeliest one, in [0, 1] (default: 0)")
    group.add_argument("--min-tokens", type=int, default=0,
                       help="tokens generated before EOS or a stop string may end the output (default: 0)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="tokens of the prompt or output: logits divided by it where positive, multiplied "
                            "where negative, in [0.01, 100]; 1 = off (default: 1)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="subtracted from the logits of tokens the output holds, in [-2, 2] (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="subtracted once per time the output holds a token, in [-2, 2] (default: 0)")
    group.add_argument("--lora", metavar="NAME",
                       help="run on the LoRA adapter that --lora-modules loads under NAME (default: the base model)")
    structured = parser.add_argument_group("structured output (one of these; the output ends when it is complete)")
    constraint = structured.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", type=Path, metavar="FILE", help="JSON that follows the schema in FILE")
    constraint.add_argument("--json-object", action="store_true", help="any JSON object")
    constraint.add_argument("--regex", help="text the regular expression matches whole")
    constraint.add_argument("--choice", action="append", help="one of these strings (repeatable)")
    constraint.add_argument("--grammar", type=Path, metavar="FILE", help="text of the Lark or GBNF grammar in FILE")
    structured.add_argument("--compact-json", action="store_true",
                            help="with --json-schema or --json-object: no whitespace between JSON's tokens")


def _sampling_params(args: argparse.Namespace):
    from kvstrata.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, seed=args.seed, stop=args.stop, min_p=args.min_p, min_tokens=args.min_tokens,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, structured_output=_structured_output(args), lora_name=args.lora,
    )


def _structured_output(args: argparse.Namespace):
    from kvstrata.engine.structured_output import StructuredOutput

    files = {"json": args.json_schema, "grammar": args.grammar}
    if all(value is None for value in (*files.values(), args.regex, args.choice)) and not args.json_object:
        if args.compact_json:
            raise KvstrataError("--compact-json shapes JSON output: give it with --json-schema or --json-object")
        return None
    texts = {}
    for kind, path in files.items():
        if path is not None:
            try:
                texts[kind] = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise KvstrataError(f"cannot read the {kind} file {path}: {exc}") from exc
    return StructuredOutput(json_object=args.json_object, regex=args.regex, choice=args.choice,
                            any_whitespace=not args.compact_json, **texts)


def _json_object(text: str) -> dict:
    """--chat-template-kwargs: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"needs a JSON object, e.g. '{{\"enable_thinking\": false}}', not {text!r}")
    return value


def _add_chat_template_kwargs_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                        help="further variables the chat template reads, as a JSON object, e.g. "
                             "'{\"enable_thinking\": false}' for Qwen3")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstrata", description="KV-cache-centric LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser(
        "generate", help="stream a completion of a prompt to the terminal",
        description="Stream a completion of PROMPT to the terminal.",
    )
    generate.add_argument("prompt", help="the prompt text")
    generate.add_argument(
        "--chat", action="store_true",
        help="wrap the prompt as a user message in the model's chat template",
    )
    generate.add_argument("--context", type=Path, default=None,
                          help="a saved context (kvstrata kv save): the prompt continues it, without its prefill")
    generate.add_argument("--context-level", default=None,
                          help="the saved context's level to decode (default: the best one stored)")
    _add_chat_template_kwargs_argument(generate)
    _add_sampling_arguments(generate, temperature=0.0)
    beams = generate.add_argument_group("beam search (the likeliest continuations, as transformers' "
                                        "generate(num_beams=...) finds them; no sampling setting applies)")
    beams.add_argument("--beam-width", type=int, default=None,
                       help="search this many beams and print each, best first, with its score")
    beams.add_argument("--length-penalty", type=float, default=1.0,
                       help="a finished beam ranks by its log-likelihood over its length to this power (default: 1)")
    beams.add_argument("--early-stopping", choices=("true", "false", "never"), default="false",
                       help="when the search ends, as transformers takes it (default: false)")
    add_engine_arguments(generate)

    chat = commands.add_parser(
        "chat", help="interactive chat with the model",
        description="Interactive chat. Type a message and press Enter; /reset clears the history, /exit quits.",
    )
    chat.add_argument("--system", default=None, help="system message for the conversation")
    _add_chat_template_kwargs_argument(chat)
    _add_sampling_arguments(chat, temperature=0.7)
    add_engine_arguments(chat)

    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics.",
    )
    add_serve_arguments(serve)

    add_kv_commands(commands)
    add_calibrate_commands(commands)
    add_bench_commands(commands)
    add_eval_commands(commands)
    return parser


def _stream_to_terminal(llm, prompt, params, **context) -> str:
    text = ""
    for output in llm.stream(prompt, params, **context):
        sys.stdout.write(output.new_text)
        sys.stdout.flush()
        text = output.text
    sys.stdout.write("\n")
    if output.finish_reason == "error":
        raise KvstrataError(f"generation failed: {output.error}")
    return text


def run_generate(args: argparse.Namespace) -> None:
    from kvstrata.llm import LLM

    if args.chat_template_kwargs is not None and not args.chat:
        raise KvstrataError("--chat-template-kwargs are the chat template's: give them with --chat")
    if args.context_level is not None and args.context is None:
        raise KvstrataError(f"--context-level {args.context_level} picks a level of a saved context: give it with "
                            f"--context")
    beam_shaping = [flag for flag, given in (("--length-penalty", args.length_penalty != 1.0),
                                             ("--early-stopping", args.early_stopping != "false")) if given]
    if beam_shaping and args.beam_width is None:
        raise KvstrataError(f"{' and '.join(beam_shaping)} shape beam search: give them with --beam-width")
    params = _sampling_params(args)
    llm = LLM(**vars(engine_config_from_args(args)))
    message = [{"role": "user", "content": args.prompt}]
    prompt = llm.chat_prompt(message, chat_template_kwargs=args.chat_template_kwargs) if args.chat else args.prompt
    if args.beam_width is None:
        _stream_to_terminal(llm, prompt, params, context=args.context, context_level=args.context_level)
    else:
        _print_beams(llm, prompt, args)


def _print_beams(llm, prompt, args: argparse.Namespace) -> None:
    from kvstrata.engine.beam_search import BeamSearchParams, refuse_sampling_settings

    refuse_sampling_settings(args, "--beam-width")
    if args.context is not None or _structured_output(args) is not None:
        raise KvstrataError("--beam-width cannot be combined with --context or a structured-output flag")
    early_stopping = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens,
                              length_penalty=args.length_penalty, early_stopping=early_stopping, lora_name=args.lora)
    result = llm.beam_search(prompt, params)[0]
    if result.error is not None:
        raise KvstrataError(f"beam search failed: {result.error}")
    for rank, (beam, text) in enumerate(zip(result.sequences, result.texts), start=1):
        print(f"[{rank}] score {beam.score:.4f} ({beam.finish_reason}, {len(beam.token_ids)} tokens)")
        print(text)


def run_chat(args: argparse.Namespace) -> None:
    from kvstrata.llm import LLM

    params = _sampling_params(args)
    llm = LLM(**vars(engine_config_from_args(args)))
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    print("kvstrata chat: /reset clears the history, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            print()
            return
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            history = []
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        try:
            prompt = llm.chat_prompt(system + history, chat_template_kwargs=args.chat_template_kwargs)
            reply = _stream_to_terminal(llm, prompt, params)
        except KvstrataError as exc:  # e.g. the conversation outgrew the context: keep the session
            history.pop()
            print(f"error: {exc}", file=sys.stderr)
            continue
        history.append({"role": "assistant", "content": reply})


def spelled_as_flags(message: str, args: argparse.Namespace) -> str:
    """An error's option names as the command line spells them: the engine and the sampling parameters name their
    fields (max_tokens, kv_host_memory), which a command's flags are (--max-tokens, --kv-host-memory)."""
    names = sorted((name for name in vars(args) if "_" in name), key=len, reverse=True)
    if not names:
        return message
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(map(re.escape, names)) + r")(?![\w/-])")  # not in paths
    return pattern.sub(lambda match: "--" + match.group(1).replace("_", "-"), message)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        commands = {
            "generate": run_generate, "chat": run_chat, "serve": run_serve, "bench": run_bench, "eval": run_eval,
            "kv": run_kv, "calibrate": run_calibrate,
        }
        commands[args.command](args)
    except KvstrataError as exc:
        print(f"error: {spelled_as_flags(str(exc), args)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
