"""`splitserve head`: the Ray head and the cluster controller, for a multi-node cluster (the Helm chart's head pod).

    splitserve head --start-ray "ray start --head --port=6379 --num-cpus=0" --ray-address 127.0.0.1:6379 \\
        --redis-url redis://redis:6379/0 --prefill-workers 2 --decode-workers 4 --model smollm2-135m

    [--start-ray: `ray start --head ... --block` as a child] ──▶ join --ray-address ──▶ the named, detached
    controller (deploy/named_controller.py; created, or found when it runs already) ──▶ pools started once
    ──▶ "splitserve: head ready: ..." and the --ready-file ──▶ until SIGTERM / SIGINT

With `--start-ray` this process owns the Ray head: it stays in the foreground, exits 1 if its Ray node or the
controller dies (the pod restarts: a new cluster), and on a signal stops the controller, its workers and the node.
Without it, it joins a running cluster (`ray start --head` done by you, or KubeRay's head), makes sure the
controller exists and its pools started, and exits 0, leaving the controller running (detached): running it again
changes nothing. Gateways (`splitserve gateway`) find the controller by name; pool nodes are plain
`ray start --address=HEAD:6379 --resources='{"splitserve_prefill": N}' --block` (or `splitserve_decode`).

Every flag may come from the environment: `--prefill-workers` from SPLITSERVE_PREFILL_WORKERS, and so on
(deploy/env_defaults.py). The pool and engine flags are `serve`'s. Exit status as `serve`'s: 0 clean, 1 the
cluster failed, 2 bad flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from deploy.env_defaults import apply_env_defaults
from deploy.serve_args import add_index_args, add_pool_args, add_ray_args, controller_config_from_args
from engine.engine_args import add_engine_args

if TYPE_CHECKING:
    from deploy.controller import ControllerConfig
    from deploy.ray_node import RayNode

def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("head", help="run the Ray head and the cluster controller (multi-node, Kubernetes)",
                              description=__doc__.split("\n\n")[0])
    add_ray_args(p, node_help="start this Ray head first, as a child that lives and dies with this command, e.g. "
                              "\"ray start --head --port=6379 --num-cpus=0\" (--block is added); without it, join "
                              "a running cluster, make sure the controller runs, and exit")
    p.add_argument("--ready-file", default=None,
                   help="a file written once the pools serve, removed on exit (a readiness probe's test)")
    add_pool_args(p)
    add_index_args(p)
    add_engine_args(p)
    p.set_defaults(func=run)
    apply_env_defaults(p)


def run(args: argparse.Namespace) -> int:
    config = controller_config_from_args(args)
    if args.prefix_index and args.redis_url is None:
        raise ValueError("the head's workers publish to a Redis every node reaches: pass --redis-url "
                         "(or --no-prefix-index)")
    if args.ray_join_timeout <= 0:
        raise ValueError(f"--ray-join-timeout must be positive, got {args.ray_join_timeout}")
    # The pools' workers go only to nodes of their pool (deploy/placement.py), which may join after the head.
    config = dataclasses.replace(config, redis_url=args.redis_url if args.prefix_index else None, place_by_pool=True)
    from deploy.ray_node import RayNode
    from engine.loader.model_registry import resolve_model

    node = RayNode(args.start_ray) if args.start_ray else None  # a bad command fails here (exit 2)
    resolve_model(config.engine.model)  # a bad --model fails before Ray starts
    # No kernel build here (`serve` builds ahead for its own machine): the workers run on the pool nodes, whose
    # image has every variant built (`build-kernels --all-variants`) or whose engines build them before they serve.
    return _run_head(args, config, node)


def _run_head(args: argparse.Namespace, config: ControllerConfig, node: RayNode | None) -> int:
    import ray

    from deploy import named_controller
    from deploy.lifecycle import (
        ShutdownSignals,
        StartFailed,
        describe_pools,
        every,
        run_until_signalled,
        stop_controller,
        wait_for,
    )

    signals = ShutdownSignals()
    signals.install()
    ready_file = Path(args.ready_file) if args.ready_file else None
    controller = None
    try:
        if node is not None:
            node.start()
        named_controller.connect(args.ray_address, timeout_s=args.ray_join_timeout, node=node, stop=signals.requested)
        if signals.requested.is_set():
            return 0
        signals.install()  # ray.init installs its own SIGTERM handler; ours goes back on top
        controller = named_controller.get_or_create(config, name=args.controller_name,
                                                    namespace=args.controller_namespace)
        workers = wait_for(controller.ensure_started.remote(), signals.requested)
        if workers is None:
            return 0  # asked to stop while starting
        if ready_file is not None:
            ready_file.parent.mkdir(parents=True, exist_ok=True)
            ready_file.write_text(f"{os.getpid()}\n")
        print(f"splitserve: head ready: controller {args.controller_namespace}/{args.controller_name} at "
              f"{args.ray_address} ({describe_pools(workers)})", flush=True)
        if node is None:
            controller = None  # joined a cluster we do not own: the controller lives on, detached
            return 0
        return run_until_signalled(
            signals.requested,
            lambda: None if node.alive() else f"the Ray head exited (status {node.returncode})",
            every(20, lambda: None if named_controller.is_alive(controller) else "the cluster controller died"),
        )
    except StartFailed as exc:
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:  # could not join Ray
        print(f"splitserve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        if controller is not None and node is not None:
            stop_controller(controller)
        if ray.is_initialized():
            ray.shutdown()
        if node is not None:
            node.stop()
        signals.restore()
