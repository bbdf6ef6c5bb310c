"""`kvstrata serve --replicas N`: N engine replicas and the front that routes to them, on Ray Serve.

Each replica is a deployment of its own (one Ray actor), so the front can choose the replica for every
request; Ray Serve restarts a replica whose process died. Ray is an optional extra: `pip install
kvstrata[cluster]`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading

from kvstrata.cluster.replica import EngineReplica, replica_config
from kvstrata.config import EngineConfig
from kvstrata.errors import KvstrataError
from kvstrata.server.options import ServerOptions

APP_NAME = "kvstrata"
HEALTH_CHECK_SECONDS = 2.0  # how soon Ray Serve notices a replica that stopped answering
# Serve's controller kills an HTTP proxy that is not ready within 5 s three times over, and `serve.start` then
# fails: on a busy 2-core machine the proxy's start-up alone can take longer. The allowance matches the 60 s
# that `serve.start` itself waits for the proxy.
PROXY_READY_VARIABLE = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
PROXY_READY_SECONDS = 60


def _ray():
    try:
        import ray
        from ray import serve
    except ImportError:
        raise KvstrataError("--replicas needs Ray Serve: pip install 'kvstrata[cluster]'") from None
    return ray, serve


def connect_ray(address: str | None) -> None:
    """Start a local Ray instance (address None) or join a cluster, unless this process already did. The replicas
    see this process's KVSTRATA_* settings, and Serve's controller waits PROXY_READY_SECONDS for its HTTP proxy
    unless RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S says otherwise. A local instance runs its workers, the replicas
    among them, at the priority of the machine's other processes: at Ray's default niceness of 15 any busy
    process starves them (beside two busy loops, a proxy that had not started after a minute)."""
    ray, _ = _ray()
    if not ray.is_initialized():
        env = {k: v for k, v in os.environ.items() if k.startswith("KVSTRATA_")}
        env[PROXY_READY_VARIABLE] = os.environ.get(PROXY_READY_VARIABLE, str(PROXY_READY_SECONDS))
        ray.init(address=address, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env},
                 _system_config=None if address else {"worker_niceness": 0})


def deploy(config: EngineConfig, options: ServerOptions, replicas: int, routing: str, host: str, port: int,
           model_name: str | None = None, ray_address: str | None = None,
           routing_prefix_tokens: int = 256, fronts: int = 1) -> str:
    """Start (or join, with `ray_address`) Ray, run the replicas and the front; returns the endpoint's URL.
    Serve keeps the host and port it first started with for as long as its Ray instance lives. With `fronts`
    above 1 the front deployment has that many replicas, among which Serve's proxy spreads the requests; each
    keeps its own routing state (its loads, and under prefix routing its memory; the replicas' KV events are
    every kv-aware front's)."""
    from kvstrata.model.loader import resolve_checkpoint

    if replicas < 1:
        raise KvstrataError(f"--replicas must be at least 1, got {replicas}")
    if fronts < 1:
        raise KvstrataError(f"--fronts must be at least 1, got {fronts}")
    _, serve = _ray()
    from kvstrata.cluster.frontend import Frontend, FrontOptions  # imports Ray

    checkpoint, name = resolve_checkpoint(config.model)  # converts a GGUF file once, here, for every replica
    model_name = model_name or name
    connect_ray(ray_address)
    serve.start(http_options={"host": host, "port": port})
    # Ray Serve's default of 5 requests per replica would queue requests the engine could batch.
    most_in_flight = options.max_waiting + config.max_num_seqs
    bound = [
        serve.deployment(EngineReplica, name=f"kvstrata-replica-{i}", num_replicas=1,
                         ray_actor_options={"num_cpus": 0}, max_ongoing_requests=most_in_flight,
                         health_check_period_s=HEALTH_CHECK_SECONDS, graceful_shutdown_timeout_s=options.shutdown_grace)
        .bind(replica_config(config, i, replicas), model_name, options, kv_events=routing == "kv-aware")
        for i in range(replicas)
    ]
    front = FrontOptions(checkpoint=str(checkpoint), routing=routing,
                         block_size=config.block_size, routing_prefix_tokens=routing_prefix_tokens,
                         max_request_bytes=options.max_request_bytes, api_key=options.api_key,
                         chat_template=config.chat_template,
                         lora_names=tuple(name for name, _ in config.lora_module_paths()))
    app = serve.deployment(Frontend, name="kvstrata-front", num_replicas=fronts, ray_actor_options={"num_cpus": 0},
                           max_ongoing_requests=replicas * most_in_flight,
                           # outlives the replicas' grace, so their streams' closing error events get through
                           graceful_shutdown_timeout_s=options.shutdown_grace + 10).bind(front, *bound)
    handle = serve.run(app, name=APP_NAME, route_prefix="/")
    try:
        handle.check_replicas.remote().result()
    except Exception as exc:
        serve.delete(APP_NAME)
        raise KvstrataError(f"the replicas could not be checked: {exc}") from exc
    return f"http://{host}:{port}"


def undeploy(stop_ray: bool) -> None:
    ray, serve = _ray()
    serve.delete(APP_NAME)
    if stop_ray:
        serve.shutdown()
        ray.shutdown()


def run_replicated(args: argparse.Namespace, config: EngineConfig, options: ServerOptions) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # This server stops on SIGTERM and SIGINT by itself, cleanly, with status 0. Ray's core would install
    # a handler that dumps a stack on SIGTERM, and ray.init replaces ours with one that exits with status
    # 15: ours goes back as soon as Ray is up (a signal during ray.init still meets Ray's).
    os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"  # read when ray is first imported, below
    connect_ray(args.ray_address)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    url = deploy(config, options, args.replicas, args.routing, args.host, args.port, args.served_model_name,
                 args.ray_address, args.routing_prefix_tokens, args.fronts)
    logging.getLogger("kvstrata.cluster").info("%d replicas behind %s (routing: %s, %d front%s)", args.replicas, url,
                                               args.routing, args.fronts, "" if args.fronts == 1 else "s")
    stop.wait()
    undeploy(stop_ray=args.ray_address is None)  # an existing cluster keeps running
