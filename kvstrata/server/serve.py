"""`kvstrata serve`: run the OpenAI-compatible server with uvicorn."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import os
import signal
import threading

import uvicorn
from fastapi import FastAPI

from kvstrata.cli.engine_args import add_engine_arguments, engine_config_from_args
from kvstrata.cluster.routing import POLICIES
from kvstrata.errors import KvstrataError
from kvstrata.server.api_key import API_KEY_VARIABLE
from kvstrata.server.options import DEFAULT_MAX_REQUEST_BYTES, ServerOptions
from kvstrata.server.reasoning import REASONING_PARSERS
from kvstrata.server.tool_call_parsers import PARSERS

# After the grace period, requests still running get their error responses; uvicorn's own cancellation
# (a plain-text 500) comes this much later, only if a response could not be finished meanwhile.
FINISH_RESPONSES_SECONDS = 10.0


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default: 127.0.0.1, this machine only; 0.0.0.0 exposes it)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the model file's or directory's name)")
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="requests allowed to wait for a slot; beyond it the server answers 503 (default: 256)")
    parser.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM; then they end with an error "
                             "response (default: 30)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"largest request body accepted, checked before parsing; larger ones get 413 "
                             f"(default: {DEFAULT_MAX_REQUEST_BYTES})")
    parser.add_argument("--max-tokens-limit", type=int, default=None,
                        help="largest max_tokens a request may ask for (default: the model's context)")
    parser.add_argument("--read-timeout", type=float, default=30.0,
                        help="seconds a client gets to send a request's headers, and then its body (default: 30)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_VARIABLE) or None,
                        help=f"API requests must send 'Authorization: Bearer KEY' (/health, /metrics and "
                             f"/openapi.json stay open); the {API_KEY_VARIABLE} environment variable keeps it off the "
                             "command line (default: that variable if set and not empty, else no key)")
    parser.add_argument("--special-tokens-in-chat", action="store_true",
                        help="parse special-token text (<|im_end|>, ...) in chat message content as special tokens; "
                             "only for trusted clients, since it lets them forge role boundaries (default: plain text)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="render a chat request's own chat_template in place of the server's (default: such "
                             "requests are refused; a template is code, rendered in jinja's sandbox)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="take chat requests with tools and tool_choice auto (the default where tools are "
                             "given): the model answers in text or calls them, as --tool-call-parser reads them")
    parser.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                        help="the format of the model's own tool calls: hermes, <tool_call>{\"name\": ..., "
                             "\"arguments\": ...}</tool_call> (Qwen2.5, Qwen3, Hermes 2 and 3); llama3_json, "
                             "{\"name\": ..., \"parameters\": ...} as the whole output (Llama 3.1, 3.2, 3.3); "
                             "pythonic, [name(argument=value), ...] as the whole output (Llama 3.2 and 4 with their "
                             "pythonic templates); mistral, [TOOL_CALLS] and a JSON list of calls, or "
                             "[TOOL_CALLS]name[ARGS]{...} per call (Mistral's models)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="hand a reasoning model's thinking back as reasoning_content, apart from its answer: "
                             "qwen3 (<think>...</think> where the output begins with it) or deepseek_r1 (thinking "
                             "until </think>, the prompt having opened it)")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help="with --enable-lora: POST /v1/load_lora_adapter {\"lora_name\", \"lora_path\"} loads an "
                             "adapter from a directory on this machine and /v1/unload_lora_adapter {\"lora_name\"} "
                             "forgets one (vLLM's endpoints; only for trusted clients: they name paths to read)")
    cluster = parser.add_argument_group("replicas (Ray Serve; pip install 'kvstrata[cluster]')")
    cluster.add_argument("--replicas", type=int, default=None,
                         help="run this many engine replicas on Ray Serve behind one endpoint (default: one process, "
                              "no Ray)")
    cluster.add_argument("--ray-address", default=None,
                         help="with --replicas: join this Ray cluster (e.g. auto, or ray://HEAD:10001) instead of "
                              "starting a local one")
    cluster.add_argument("--routing", default="prefix", choices=POLICIES,
                         help="with --replicas: how a request picks its replica: prefix (where prompts starting alike "
                              "went before), kv-aware (the replica whose prefix cache reports holding the longest "
                              "prefix of the prompt), round-robin or least-loaded (default: prefix)")
    cluster.add_argument("--routing-prefix-tokens", type=int, default=256,
                         help="with --replicas --routing prefix or kv-aware: prompt tokens the consistent-hashing "
                              "key of a prompt nobody holds covers (default: 256)")
    cluster.add_argument("--fronts", type=int, default=1,
                         help="with --replicas: routers in front of the replicas, each taking a share of the requests "
                              "with routing state of its own (default: 1)")
    add_engine_arguments(parser)


def _check_cluster_flags(args: argparse.Namespace) -> None:
    if args.replicas is None:
        for flag, value, default in (("--ray-address", args.ray_address, None), ("--routing", args.routing, "prefix"),
                                     ("--routing-prefix-tokens", args.routing_prefix_tokens, 256),
                                     ("--fronts", args.fronts, 1)):
            if value != default:
                raise KvstrataError(f"{flag} applies to replicated serving only; add --replicas N")
        return
    if args.replicas < 1:
        raise KvstrataError(f"--replicas must be at least 1, got {args.replicas}")
    if args.allow_runtime_lora_updating:  # a load request would reach one replica of the N
        raise KvstrataError("--allow-runtime-lora-updating serves one process; with --replicas give every adapter in "
                            "--lora-modules")
    if args.routing_prefix_tokens < 1:
        raise KvstrataError(f"--routing-prefix-tokens must be at least 1, got {args.routing_prefix_tokens}")
    if args.fronts < 1:
        raise KvstrataError(f"--fronts must be at least 1, got {args.fronts}")
    if args.routing == "kv-aware" and (not args.enable_prefix_caching or args.kv_offload == "h2o"):
        raise KvstrataError("--routing kv-aware follows what the replicas' prefix caches hold; it needs prefix "
                            "caching, which --no-enable-prefix-caching and --kv-offload h2o turn off")


def server_options_from_args(args: argparse.Namespace) -> ServerOptions:
    return ServerOptions(max_waiting=args.max_waiting, max_request_bytes=args.max_request_bytes,
                         max_tokens_limit=args.max_tokens_limit, read_timeout=args.read_timeout,
                         special_tokens_in_chat=args.special_tokens_in_chat, shutdown_grace=args.shutdown_grace,
                         trust_request_chat_template=args.trust_request_chat_template,
                         api_key=args.api_key, enable_auto_tool_choice=args.enable_auto_tool_choice,
                         tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                         allow_runtime_lora_updating=args.allow_runtime_lora_updating)


class GracefulServer(uvicorn.Server):
    """On SIGTERM or SIGINT: stop accepting, give open requests the grace period, then end the ones still
    running with an error response (JSON, or a stream's error event and [DONE]), and exit 0. (uvicorn itself
    would cut them with a plain-text 500 and re-raise the signal, making the exit status -15.)"""

    def __init__(self, config: uvicorn.Config, app: FastAPI, grace: float):
        super().__init__(config)
        self.app = app
        self.grace = grace

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets=None) -> None:
        from kvstrata.server.async_engine import ShuttingDownError

        error = ShuttingDownError(f"the server shut down before the request finished (--shutdown-grace {self.grace:g} s)")
        timer = asyncio.get_running_loop().call_later(self.grace, self.app.state.async_engine.end_all, error)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def make_server(app: FastAPI, host: str, port: int, options: ServerOptions, log_level: str = "info") -> GracefulServer:
    from kvstrata.server.connection_timeout import HeaderTimeoutH11Protocol

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        http=functools.partial(HeaderTimeoutH11Protocol, header_timeout=options.read_timeout),
        timeout_graceful_shutdown=options.shutdown_grace + FINISH_RESPONSES_SECONDS,
    )
    return GracefulServer(config, app, options.shutdown_grace)


def run_serve(args: argparse.Namespace) -> None:
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.server.app import build_app

    _check_cluster_flags(args)
    options = server_options_from_args(args)
    if args.replicas is not None:
        from kvstrata.cluster.launch import run_replicated

        run_replicated(args, engine_config_from_args(args), options)
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLMEngine(engine_config_from_args(args))
    app = build_app(engine, args.served_model_name or engine.loaded.name, options)
    make_server(app, args.host, args.port, options).run()
