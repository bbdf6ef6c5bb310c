"""`kvstrata serve`: run the OpenAI-compatible server with uvicorn."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal

import uvicorn

from kvstrata.cli.engine_args import add_engine_arguments, engine_config_from_args


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: the model file's or directory's name)")
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="requests allowed to wait for a slot; beyond it the server answers 503 (default: 256)")
    parser.add_argument("--shutdown-grace", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGTERM (default: 30)")
    add_engine_arguments(parser)


class GracefulServer(uvicorn.Server):
    """On SIGTERM or SIGINT: stop accepting, give open requests the grace period, let the app's
    shutdown abort what is left, and exit 0. (uvicorn itself re-raises the signal once shut down,
    which makes the exit status -15 instead of the 0 a supervisor expects.)"""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def run_serve(args: argparse.Namespace) -> None:
    from kvstrata.engine.llm_engine import LLMEngine
    from kvstrata.errors import KvstrataError
    from kvstrata.server.app import build_app

    if args.max_waiting < 1:
        raise KvstrataError(f"--max-waiting must be at least 1, got {args.max_waiting}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = LLMEngine(engine_config_from_args(args))
    app = build_app(engine, args.served_model_name or engine.loaded.name, args.max_waiting)
    config = uvicorn.Config(app, host=args.host, port=args.port, timeout_graceful_shutdown=args.shutdown_grace,
                            log_level="info")
    GracefulServer(config).run()
