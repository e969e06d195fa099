"""`castspec serve-ray`: `castspec serve` as a Ray Serve application of several engine replicas.

Ray is imported only when the command runs (castspec.serving.ray_serve), so the plain install never needs it.
"""
from __future__ import annotations

import json
import os
import signal
import threading

from .common import UserError, add_model_args, load_engine
from .serve import add_limit_args, add_scheduler_args, serving_configs

# Ray's switch for its single-node mode (named for the platforms where that mode is the default). Off while Ray is
# imported and a cluster starts, the node's address is 127.0.0.1 and every Ray process of it (GCS, raylet, workers,
# agents) listens on loopback only; on (Ray's default on Linux), they listen on every interface so that other nodes
# can join. A cluster that serve-ray starts is its own, never joined: it needs the mode off.
RAY_CLUSTER_MODE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def cmd_serve_ray(args) -> int:
    sched, server_cfg = serving_configs(args)
    local = not (args.ray_address or os.environ.get("RAY_ADDRESS"))
    if local:  # before Ray is imported: it reads the switch then, and its processes inherit it
        os.environ[RAY_CLUSTER_MODE] = "0"
    try:
        from ..serving import ray_serve
    except ImportError as e:
        raise UserError(f"serve-ray needs Ray Serve ({e.name} is missing): pip install 'castspec[ray]'") from None
    try:
        scale = ray_serve.ScaleConfig(
            replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests, upscale_delay_s=args.upscale_delay,
            downscale_delay_s=args.downscale_delay, cpus_per_replica=args.cpus_per_replica,
            gpus_per_replica=args.gpus_per_replica, attempts=args.attempts,
            router_queue=args.max_queue if args.router_queue is None else args.router_queue, routing=args.routing)
        options = ray_serve.ReplicaOptions(target=args.target, drafter=args.drafter, device=args.device,
                                           dtype=args.dtype, method=args.method, scheduler=sched, server=server_cfg,
                                           threads=max(1, int(args.cpus_per_replica)))
        ray_serve.engine_options(options, scale)  # the device and GPU checks, before any model loads
    except ValueError as e:
        raise UserError(str(e)) from None
    if local:  # the replicas will read the same files: fail here, with `castspec serve`'s message, not in N replicas
        engine = load_engine(args)
        if args.method != "ar" and engine.drafter is None:
            raise UserError(f"method {args.method!r} needs a drafter: pass --drafter (or --method ar)")
        del engine
    started = ray_serve.connect(args.ray_address, num_cpus=args.local_cpus, object_store_mb=args.object_store_mb)
    try:
        try:
            url = ray_serve.deploy(options, scale, args.host, args.port)
        except Exception as e:  # noqa: BLE001 - e.g. replicas that cannot load their model on the cluster's nodes
            raise UserError(f"the application did not start: {str(e).strip().splitlines()[0]}") from None
        print(json.dumps({"url": url, "replicas": scale.replicas if not scale.autoscaling
                          else [scale.min_replicas, scale.max_replicas], "local_cluster": started}), flush=True)
        _wait_for_signal()
    finally:
        ray_serve.shutdown(started)
    return 0


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM (Ctrl-C, or a process manager stopping the command)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def register(sub) -> None:
    p = sub.add_parser("serve-ray", help="castspec serve on Ray Serve: N engine replicas behind one ingress",
                       description="The routes of `castspec serve` (same validation, errors and SSE) relayed to "
                                   "engine replicas, each with its own continuous-batching scheduler. Connects to "
                                   "--ray-address (or RAY_ADDRESS), else starts a local Ray cluster that listens on "
                                   "loopback only. docs/scale-out.md")
    add_model_args(p)
    add_scheduler_args(p)
    add_limit_args(p)  # each replica's app applies them, as `castspec serve` does
    p.add_argument("--host", default="127.0.0.1", help="where Serve's HTTP proxy listens")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default="castspec", help="the id reported by /v1/models")
    p.add_argument("--default-max-tokens", type=int, default=256, help="when a request gives no max_tokens")
    p.add_argument("--replicas", type=int, default=1, help="engine replicas (without autoscaling)")
    p.add_argument("--min-replicas", type=int, default=None, help="autoscaling: at least this many replicas")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscaling: at most this many replicas")
    p.add_argument("--target-ongoing-requests", type=float, default=4.0,
                   help="autoscaling: ongoing requests per replica Serve scales to keep")
    p.add_argument("--upscale-delay", type=float, default=None,
                   help="autoscaling: seconds the load must call for more replicas before one starts (Serve: 30)")
    p.add_argument("--downscale-delay", type=float, default=None,
                   help="autoscaling: seconds the load must call for fewer replicas before one stops (Serve: 600)")
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs each replica reserves (torch threads)")
    p.add_argument("--gpus-per-replica", type=float, default=None,
                   help="GPUs each replica reserves (default 1 with --device cuda, 0 on the CPU)")
    p.add_argument("--attempts", type=int, default=4,
                   help="replicas a request may be tried on when one dies before it streamed a token")
    p.add_argument("--router-queue", type=int, default=None,
                   help="requests Serve's router holds while every replica is full, then 429 (default --max-queue)")
    p.add_argument("--routing", default="balance", help="balance: Serve's power of two choices; prefix: a request "
                   "goes to the replica that served the longest start of its prompt (whose prefix cache holds it) "
                   "unless loads differ by more than a batch")
    p.add_argument("--ray-address", default=None, help="a running cluster (default RAY_ADDRESS, else a local one)")
    p.add_argument("--local-cpus", type=int, default=None, help="CPUs of a local cluster (default all)")
    p.add_argument("--object-store-mb", type=int, default=None, help="object store of a local cluster (MiB)")
    p.set_defaults(func=cmd_serve_ray)
