"""`castspec serve-ray`: `castspec serve` as a Ray Serve application of several engine replicas.

Ray is imported only when the command runs (castspec.ray_serve), so the plain install never needs it.
"""
from __future__ import annotations

import json
import signal
import threading


def cmd_serve_ray(args) -> int:
    from .common import UserError, load_engine
    from .serve import serving_configs

    sched, server_cfg = serving_configs(args)
    try:
        from ..serving import ray_serve
    except ImportError as e:
        raise UserError(f"serve-ray needs Ray Serve ({e.name} is missing): pip install 'castspec[ray]'") from None
    try:
        scale = ray_serve.ScaleConfig(replicas=args.replicas, min_replicas=args.min_replicas,
                                      max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
                                      cpus_per_replica=args.cpus_per_replica, gpus_per_replica=args.gpus_per_replica,
                                      attempts=args.attempts,
                                      router_queue=args.max_queue if args.router_queue is None else args.router_queue)
    except ValueError as e:
        raise UserError(str(e)) from None
    options = ray_serve.ReplicaOptions(target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype,
                                       method=args.method, scheduler=sched, server=server_cfg,
                                       threads=max(1, int(args.cpus_per_replica)))
    local = not (args.ray_address or _ray_address_in_env())
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


def _ray_address_in_env() -> bool:
    import os

    return bool(os.environ.get("RAY_ADDRESS"))


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM (Ctrl-C, or a process manager stopping the command)."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def register(sub) -> None:
    from .common import add_model_args
    from .serve import add_limit_args, add_scheduler_args

    p = sub.add_parser("serve-ray", help="castspec serve on Ray Serve: N engine replicas behind one ingress",
                       description="The routes of `castspec serve` (same validation, errors and SSE) relayed to "
                                   "engine replicas, each with its own continuous-batching scheduler. Connects to "
                                   "--ray-address (or RAY_ADDRESS), else starts a local Ray cluster. docs/scale-out.md")
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
    p.add_argument("--cpus-per-replica", type=float, default=1.0, help="CPUs each replica reserves (torch threads)")
    p.add_argument("--gpus-per-replica", type=float, default=0.0, help="GPUs each replica reserves (--device cuda)")
    p.add_argument("--attempts", type=int, default=4,
                   help="replicas a request may be tried on when one dies before it streamed a token")
    p.add_argument("--router-queue", type=int, default=None,
                   help="requests Serve's router holds while every replica is full, then 429 (default --max-queue)")
    p.add_argument("--ray-address", default=None, help="a running cluster (default RAY_ADDRESS, else a local one)")
    p.add_argument("--local-cpus", type=int, default=None, help="CPUs of a local cluster (default all)")
    p.add_argument("--object-store-mb", type=int, default=None, help="object store of a local cluster (MiB)")
    p.set_defaults(func=cmd_serve_ray)
