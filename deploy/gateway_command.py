"""`splitserve gateway`: the OpenAI gateway alone, one of N replicas, finding the workers through the named
controller that `splitserve head` runs (not through a parent process), or routing to a fixed list of worker
processes without Ray.

    splitserve gateway --ray-address head:6379 --start-ray "ray start --address=head:6379 --num-cpus=0" \\
        --host 0.0.0.0 --port 8000
    splitserve gateway --prefill 10.0.0.1:50051 --decode 10.0.0.2:50051 --port 8000     # no Ray: see below

    [--start-ray: this pod's own Ray node, no CPUs] ──▶ join --ray-address ──▶ the controller, by name (waits for
    the head) ──▶ its config: model, block size, context length, mode, prefix index ──▶ the router app, its
    workers from controller.list_workers() every second ──▶ "splitserve: serving <model> on http://..."

The model, the engine's block size and context length, the mode (disaggregated or colocated) and the prefix
index's Redis come from the controller's config, so a gateway always matches the workers it routes to. Scaling
through the admin API (`--admin-token`) goes to the same controller: any replica may take it. A gateway that
restarts finds the same controller and the same workers. It exits 1 when the controller or its Ray node goes (the
pod restarts and waits for the next head), 0 on SIGTERM / SIGINT after draining. Why a gateway starts a Ray node
of its own: deploy/ray_node.py. Flags may come from the environment (SPLITSERVE_PORT, ...: deploy/env_defaults.py).

With a fixed list (`--prefill HOST:PORT --decode HOST:PORT`, repeatable, or `--colocated HOST:PORT`, SGLang's
router PD mode) instead of --ray-address, nothing imports Ray: the workers are plain processes (`python -m
prefill_worker`, `python -m decode_worker`) that it waits for (--worker-wait-timeout) and takes the model, block
size, context length and mode from (deploy/static_workers.py); their cluster secret is --cluster-secret or
$SPLITSERVE_CLUSTER_SECRET, their prefix index --redis-url (none: routing by load). The pools cannot be scaled
(the admin API's scale answers 503). It exits 0 on SIGTERM / SIGINT after draining; a worker that dies stays
listed, routed nothing until it answers again.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING

from deploy.env_defaults import apply_env_defaults
from deploy.serve_args import add_gateway_args, add_ray_args, gateway_config_from_args
from deploy.static_workers import WorkerList, add_worker_list_args, worker_list_from_args
from protos.cluster_auth import add_cluster_auth_args

if TYPE_CHECKING:
    from router.config import GatewayConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("gateway", help="run the OpenAI gateway alone, routing to the head's workers or to a "
                                              "fixed list of worker processes",
                              description=__doc__.split("\n\n")[0])
    add_ray_args(p, node_help="start this Ray node first, as a child that lives and dies with this command, e.g. "
                              "\"ray start --address=head:6379 --num-cpus=0\" (--block is added); needed where "
                              "this host runs no Ray node (a Ray driver needs a raylet on its host)",
                 address=None)
    p.add_argument("--controller-wait-timeout", type=float, default=900.0,
                   help="seconds to wait for the head's controller to exist")
    add_worker_list_args(p)
    add_cluster_auth_args(p.add_argument_group("cluster links of a fixed worker list (with --ray-address: the "
                                               "controller's)"))
    add_gateway_args(p)
    p.set_defaults(func=run)
    apply_env_defaults(p)


def run(args: argparse.Namespace) -> int:
    config = gateway_config_from_args(args)
    workers = worker_list_from_args(args)
    if workers is not None:
        return run_static(args, workers, config)
    for flag in ("ray_join_timeout", "controller_wait_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    import ray

    from deploy import named_controller
    from deploy.gateway_app import listen, reload_keys_on_sighup
    from deploy.lifecycle import Check, ShutdownSignals, run_until_signalled
    from deploy.ray_node import RayNode
    from deploy.worker_directory import WorkerDirectory, build_cluster_gateway_app

    node = RayNode(args.start_ray) if args.start_ray else None
    signals = ShutdownSignals()
    signals.install()
    server = None
    try:
        if node is not None:
            node.start()
        named_controller.connect(args.ray_address, timeout_s=args.ray_join_timeout, node=node, stop=signals.requested)
        signals.install()  # ray.init installs its own SIGTERM handler; ours goes back on top
        controller = named_controller.find(name=args.controller_name, namespace=args.controller_namespace,
                                           timeout_s=args.controller_wait_timeout, stop=signals.requested)
        if controller is None:
            return 0
        c = ray.get(controller.config.remote())
        directory = WorkerDirectory()
        directory.attach(controller, ray.get(controller.list_workers.remote()))
        app, access = build_cluster_gateway_app(config, c, directory, c.redis_url)
        reload_keys_on_sighup(access, config)
        server = listen(app, config)
        server.start(timeout_s=60.0)
        print(f"splitserve: serving {c.engine.model} on {server.url} (gateway; controller "
              f"{args.controller_namespace}/{args.controller_name} at {args.ray_address}); Ctrl-C to stop", flush=True)
        checks: list[Check] = [lambda: "the cluster controller is gone" if directory.lost else None]
        if node is not None:
            checks.append(lambda: None if node.alive() else
                          f"this gateway's Ray node exited (status {node.returncode})")
        return run_until_signalled(signals.requested, *checks)
    except (RuntimeError, TimeoutError) as exc:  # could not join Ray, find the controller, or serve
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()  # stop taking requests first; in-flight ones get the router's grace period
        if ray.is_initialized():
            ray.shutdown()
        if node is not None:
            node.stop()
        signals.restore()


def run_static(args: argparse.Namespace, workers: WorkerList, config: GatewayConfig) -> int:
    """The gateway over a fixed worker list: no Ray (see the module docstring)."""
    from deploy.gateway_app import build_gateway_app, listen, reload_keys_on_sighup
    from deploy.lifecycle import ShutdownSignals, describe_pools, run_until_signalled
    from deploy.redis_server import check_redis
    from deploy.static_workers import StaticWorkers
    from protos.cluster_auth import cluster_auth_from_args

    auth = cluster_auth_from_args(args, os.environ)
    if args.redis_url is not None:
        check_redis(args.redis_url)  # unreachable, or a password it refuses: exit 2, before waiting on workers
    directory = StaticWorkers(workers, auth=auth)
    signals = ShutdownSignals()
    signals.install()
    server = None
    try:
        served = directory.discover(timeout_s=args.worker_wait_timeout, stop=signals.requested)
        if served is None:
            return 0
        app, access = build_gateway_app(config, served, directory, auth=auth, redis_url=args.redis_url)
        reload_keys_on_sighup(access, config)
        server = listen(app, config)
        server.start(timeout_s=60.0)
        print(f"splitserve: serving {served.model} on {server.url} (gateway; {describe_pools(directory())}, a "
              "fixed list); Ctrl-C to stop", flush=True)
        return run_until_signalled(signals.requested)
    except (RuntimeError, TimeoutError) as exc:  # workers that never answered or refuse the secret; cannot serve
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if server is not None:
            server.stop()  # stop taking requests first; in-flight ones get the router's grace period
        directory.close()
        signals.restore()
