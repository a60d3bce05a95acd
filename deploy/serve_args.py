"""The flags of `serve`, in groups that `head` (the pools) and `gateway` (the router) share, how `head` and
`gateway` join Ray and name the controller, and their validation: flags -> the router's `GatewayConfig` and the
pools' `ControllerConfig`, with a ValueError naming any bad flag. No I/O."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from deploy.autoscale_args import autoscaler_from_args
from deploy.config_flags import ConfigFlag, add_config_flags, config_from_flags, json_string_list
from engine.engine_args import engine_config_from_args
from kv_transfer.layout import KV_CACHE_DTYPES as HANDOFF_KV_CACHE_DTYPES
from kv_transfer.registry import TRANSPORTS
from protos.cluster_auth import CLUSTER_SECRET_ENV, add_cluster_auth_args, cluster_auth_from_args
from router.config import UVICORN_LOG_LEVELS, GatewayConfig, GatewayTls
from router.rate_limit import RateLimits
from router.routing import POLICIES as ROUTING_POLICIES

if TYPE_CHECKING:
    from deploy.controller import ControllerConfig
    from router.autoscaler import AutoscalerConfig

API_KEY_ENV = "SPLITSERVE_API_KEY"  # router.api_keys.API_KEY_ENV (not imported here: it pulls FastAPI in)

# The router's flags: each sets the GatewayConfig field it names (router/config.py), whose default it takes.
GATEWAY_FLAGS = (
    ConfigFlag("--served-model-name", "served_model_names",
               "the model's name(s) in the API, as vLLM's: a request's `model` must be one of them, and /v1/models "
               "lists them, the first first (default: --model as given)", nargs="+"),
    ConfigFlag("--host", "host", "the router's address (0.0.0.0: every interface)"),
    ConfigFlag("--port", "port", "the router's port; 0 picks a free one", type=int),
    ConfigFlag("--chat-template", "chat_template",
               "the chat template /v1/chat/completions renders, over the model's own: a Jinja file's path, or the "
               "template itself (vLLM's flag)"),
    ConfigFlag("--generation-config", "generation_config",
               "the model's sampling defaults for what a request leaves unset (vLLM's flag): auto (its "
               "generation_config.json, if any), vllm (none), or a folder holding one"),
    ConfigFlag("--override-generation-config", "override_generation_config",
               "a JSON object of temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens over what "
               "--generation-config gives (vLLM's flag), e.g. '{\"temperature\": 0.5}'"),
    ConfigFlag("--request-timeout", "request_timeout_s",
               "seconds one request may take end to end, the gateway's queue included", type=float),
    ConfigFlag("--admission-control", "admission_control",
               "hold requests at the gateway while the pool is full, refuse (429) beyond the queue; "
               "--no-admission-control sends every request to the workers at once, as vLLM does",
               action=argparse.BooleanOptionalAction),
    ConfigFlag("--max-queued-requests", "max_queued_requests",
               "requests the gateway holds while the pool is full; beyond it answers 429 (default: as many as the "
               "pool runs at once, sum of max_num_seqs; queued KV blocks are bounded by the pool's KV cache too)",
               type=int),
    ConfigFlag("--queue-timeout", "queue_timeout_s",
               "seconds a request may wait in the gateway's queue before it gets 503", type=float),
    ConfigFlag("--max-migrations", "max_migrations",
               "times one request may resume on another decode worker when its own goes away mid-stream (0: "
               "never; the client then gets an error event)", type=int),
    ConfigFlag("--admin-token", "admin_token",
               "bearer token of the gateway's admin API (POST /admin/scale, GET /admin/pools; `splitserve "
               "scale`); default: $SPLITSERVE_ADMIN_TOKEN; neither: the admin API is off"),
    ConfigFlag("--routing-policy", "routing_policy",
               "how the gateway picks workers: by cached prefix and load, by load, or in turn",
               choices=ROUTING_POLICIES),
    ConfigFlag("--disagg-prefill-threshold", "disagg_prefill_threshold_tokens",
               "tokens: a prompt of which the chosen decode worker lacks at most this many is prefilled there, "
               "with no KV handoff (0: always disaggregate)", type=int),
    ConfigFlag("--enable-request-id-headers", "enable_request_id_headers",
               "every response carries X-Request-Id: the request's own, or a fresh one (vLLM's flag)",
               action="store_true"),
    ConfigFlag("--return-tokens-as-token-ids", "return_tokens_as_token_ids",
               "logprobs name each token \"token_id:<id>\" instead of its text, unless a request's "
               "return_tokens_as_token_ids says otherwise (vLLM's flag)", action="store_true"),
    ConfigFlag("--enable-log-requests", "enable_log_requests",
               "log each request the gateway accepts: its id, prompt and sampling params, one INFO line (vLLM's "
               "flag; off by default: prompts are the users' data)", action="store_true"),
    ConfigFlag("--max-log-len", "max_log_len",
               "with --enable-log-requests: the prompt characters and token ids logged (default: all)", type=int),
    ConfigFlag("--uvicorn-log-level", "uvicorn_log_level",
               "uvicorn's log level (info: one access line per HTTP request)", choices=UVICORN_LOG_LEVELS),
    ConfigFlag("--trust-request-chat-template", "trust_request_chat_template",
               "render the chat template a chat request brings in its `chat_template` field instead of the model's "
               "(vLLM's flag; off: such a request is a 400, since a template is code the gateway runs)",
               action="store_true"),
    ConfigFlag("--root-path", "root_path",
               "the path prefix a path-routing proxy serves the API under, e.g. /llm (vLLM's flag; FastAPI's "
               "root_path: /openapi.json names it, and paths with or without it are served)"),
    ConfigFlag("--kv-peer-fetch", "kv_peer_fetch",
               "with a prefix index: the worker running a prompt fetches the prompt's cached head from the worker "
               "holding it when the measured link and prefill rates price that below computing it, whatever the "
               "routing policy; --no-kv-peer-fetch: always compute",
               action=argparse.BooleanOptionalAction),
)
# Security's flags of one field each; --api-key, --rate-limit-*, --ssl-* make a field of several (or of the
# environment) in gateway_config_from_args.
SECURITY_FLAGS = (
    ConfigFlag("--api-key-file", "api_key_file", "a file of API keys, one per line (# comments); re-read on SIGHUP"),
    ConfigFlag("--metrics-require-key", "metrics_require_key", "/metrics needs an API key too", action="store_true"),
    ConfigFlag("--allowed-origins", "allowed_origins",
               'CORS: the origins a browser may call the API from, a JSON list as vLLM\'s (default ["*"]; "[]": no '
               "CORS headers)", type=json_string_list),
    ConfigFlag("--allowed-methods", "allowed_methods", "CORS: the methods allowed, a JSON list (default [\"*\"])",
               type=json_string_list),
    ConfigFlag("--allowed-headers", "allowed_headers", "CORS: the request headers allowed, a JSON list (default "
               "[\"*\"])", type=json_string_list),
    ConfigFlag("--allow-credentials", "allow_credentials", "CORS: allow credentials (cookies)", action="store_true"),
)


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    """The router's flags (`serve`, `gateway`)."""
    add_config_flags(p, GatewayConfig, GATEWAY_FLAGS)
    compat = p.add_argument_group("vLLM command lines")
    compat.add_argument("--disable-log-requests", action="store_true",
                        help="vLLM's older flag: requests are not logged, which is the default here")
    compat.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="vLLM's flag: tool_choice \"auto\" is always served here (tools are parsed from the "
                             "output as --tool-call-parser reads them)")
    compat.add_argument("--tool-call-parser", choices=("hermes",), default="hermes",
                        help="the tool-call format parsed from the output: hermes (<tool_call>{...}</tool_call>), the "
                             "one served here (router/tools.py)")
    security = p.add_argument_group("security (docs/security.md)")
    security.add_argument("--api-key", action="append", default=None,
                          help=f"an API key /v1/* accepts as `Authorization: Bearer <key>`; repeatable (default: "
                               f"${API_KEY_ENV}); no key at all: /v1/* is open")
    add_config_flags(security, GatewayConfig, SECURITY_FLAGS)
    security.add_argument("--rate-limit-requests-per-minute", type=float, default=None,
                          help="per API key: requests per minute (429 with Retry-After beyond)")
    security.add_argument("--rate-limit-tokens-per-minute", type=float, default=None,
                          help="per API key: prompt + generated tokens per minute (429 with Retry-After beyond)")
    security.add_argument("--ssl-keyfile", default=None, help="HTTPS at the gateway: the private key (PEM)")
    security.add_argument("--ssl-certfile", default=None, help="HTTPS at the gateway: the certificate (PEM)")
    security.add_argument("--ssl-ca-certs", default=None,
                          help="HTTPS at the gateway: require client certificates signed by this CA (PEM)")


def add_pool_args(p: argparse.ArgumentParser) -> None:
    """The worker pools' flags (`serve`, `head`): sizes, KV transport, liveness checks."""
    p.add_argument("--prefill-workers", type=int, default=None, help="prefill pool size (default 1)")
    p.add_argument("--decode-workers", type=int, default=None, help="decode pool size (default 1)")
    p.add_argument("--colocated", action="store_true", help="no disaggregation: each worker runs both phases")
    p.add_argument("--colocated-workers", type=int, default=None, help="colocated pool size (default 1)")
    p.add_argument("--kv-transport", default="grpc", choices=TRANSPORTS, help="how KV blocks go prefill→decode")
    p.add_argument("--prefill-tensor-parallel-size", type=int, default=None,
                   help="ranks of each prefill worker (default: --tensor-parallel-size); the KV handoff sends each "
                        "decode rank its own KV heads")
    p.add_argument("--decode-tensor-parallel-size", type=int, default=None,
                   help="ranks of each decode worker (default: --tensor-parallel-size)")
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0, help="seconds before a KV handoff fails")
    p.add_argument("--health-check-interval", type=float, default=2.0, help="seconds between liveness checks")
    p.add_argument("--health-check-timeout", type=float, default=2.0, help="seconds a worker has to answer one")
    p.add_argument("--health-check-failure-threshold", type=int, default=3,
                   help="failed liveness checks in a row before a worker is restarted")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="seconds a worker removed by a scale-down may take to finish its requests (it takes no new "
                        "ones); what is left then resumes on another decode worker (0: at once)")
    p.add_argument("--worker-host", default=None,
                   help="the address workers bind; 0.0.0.0 makes each advertise its node's IP (default: 127.0.0.1 "
                        "on the local cluster, 0.0.0.0 with --ray-address)")
    # The secret every gRPC link of the cluster carries (the gateway takes the controller's: `gateway`).
    add_cluster_auth_args(p.add_argument_group("cluster links (docs/security.md)"))


def add_index_args(p: argparse.ArgumentParser) -> None:
    """The prefix index's flags (`serve`, `head`)."""
    p.add_argument("--redis-url", default=None,
                   help="the prefix index's Redis (default: start an embedded redis-server on a free loopback port)")
    p.add_argument("--prefix-index", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the cluster-wide prefix index in Redis and route by it; --no-prefix-index: no Redis")


DEFAULT_RAY_ADDRESS = "127.0.0.1:6379"
# The controller's actor name (deploy/named_controller.py); here so that building the CLI imports no Ray.
CONTROLLER_NAME = "splitserve-controller"
CONTROLLER_NAMESPACE = "splitserve"


def add_ray_args(p: argparse.ArgumentParser, *, node_help: str, address: str | None = DEFAULT_RAY_ADDRESS) -> None:
    """How a driver command (`head`, `gateway`) joins Ray and names the controller; `address`: --ray-address's
    default."""
    p.add_argument("--ray-address", default=address, help="the Ray cluster's GCS, host:port" +
                   (f" (default {address})" if address else ""))
    p.add_argument("--start-ray", default=None, metavar="COMMAND", help=node_help)
    p.add_argument("--ray-join-timeout", type=float, default=300.0,
                   help="seconds to wait for the Ray cluster (and the node --start-ray starts) to take us")
    p.add_argument("--controller-name", default=CONTROLLER_NAME, help="the controller actor's name")
    p.add_argument("--controller-namespace", default=CONTROLLER_NAMESPACE, help="its Ray namespace")


def gateway_config_from_args(args: argparse.Namespace, *, flags: Iterable[ConfigFlag] = (),
                              **fields: Any) -> GatewayConfig:
    """The gateway's config from `add_gateway_args`' flags, `flags` (a command's own, of GatewayConfig fields) and
    `fields` (set by the command otherwise), checked: a ValueError names the bad flag."""
    if args.disable_log_requests and args.enable_log_requests:
        raise ValueError("--disable-log-requests and --enable-log-requests say opposite things: give one")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
    if args.ssl_ca_certs is not None and args.ssl_keyfile is None:
        raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
    api_keys = tuple(args.api_key or ([os.environ[API_KEY_ENV]] if os.environ.get(API_KEY_ENV) else []))
    rate_limits = RateLimits(requests_per_minute=args.rate_limit_requests_per_minute,
                             tokens_per_minute=args.rate_limit_tokens_per_minute)
    if (rate_limits.enabled or args.metrics_require_key) and not (api_keys or args.api_key_file):
        raise ValueError("rate limits and --metrics-require-key are per API key: give --api-key or --api-key-file")
    tls = (GatewayTls(keyfile=args.ssl_keyfile, certfile=args.ssl_certfile, ca_certs=args.ssl_ca_certs)
           if args.ssl_keyfile is not None else None)
    return config_from_flags(
        GatewayConfig, (*GATEWAY_FLAGS, *SECURITY_FLAGS, *flags), args,
        admin_token=args.admin_token or os.environ.get("SPLITSERVE_ADMIN_TOKEN") or None, api_keys=api_keys,
        rate_limits=rate_limits, tls=tls, **fields)


def controller_config_from_args(args: argparse.Namespace) -> ControllerConfig:
    """The pools' config from `add_pool_args`' and `add_index_args`' flags and the engine flags, validated
    (ValueError naming the flag). The prefix index's URL is left to the caller (`redis_url` is None here)."""
    return pools_from_args(args, autoscale=False)[0]


def pools_from_args(args: argparse.Namespace, *,
                     autoscale: bool) -> tuple[ControllerConfig, AutoscalerConfig | None]:
    """The pools' config, and with `autoscale` (`serve`'s autoscaling flags) the built-in autoscaler's."""
    from deploy.controller import ControllerConfig

    colocated = args.colocated or args.colocated_workers is not None
    if colocated:
        if args.prefill_workers is not None or args.decode_workers is not None:
            raise ValueError("--colocated runs no prefill or decode workers: drop --prefill-workers/--decode-workers")
        num_prefill, num_decode, num_colocated = 0, 0, 1 if args.colocated_workers is None else args.colocated_workers
        if num_colocated < 1:
            raise ValueError(f"--colocated-workers must be at least 1, got {num_colocated}")
    else:
        num_prefill = 1 if args.prefill_workers is None else args.prefill_workers
        num_decode = 1 if args.decode_workers is None else args.decode_workers
        num_colocated = 0
        for flag, n in (("--prefill-workers", num_prefill), ("--decode-workers", num_decode)):
            if n < 1:
                raise ValueError(f"{flag} must be at least 1, got {n} (or use --colocated)")
    for flag in ("kv_transfer_timeout", "health_check_interval", "health_check_timeout"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.health_check_failure_threshold < 1:
        raise ValueError("--health-check-failure-threshold must be at least 1, got "
                         f"{args.health_check_failure_threshold}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    if args.redis_url is not None and not args.prefix_index:
        raise ValueError("--redis-url names the prefix index's Redis; it cannot go with --no-prefix-index")
    if args.kv_transport == "ipc" and args.ray_address is not None:
        raise ValueError("--kv-transport ipc needs every worker on one host (it hands blocks over through memory "
                         "they share); with --ray-address they may run on other nodes: use grpc or torch")
    autoscaler = None
    if autoscale:
        autoscaler, num_prefill, num_decode = autoscaler_from_args(args, num_prefill, num_decode, colocated)
    # Every gRPC link of this cluster carries this secret: the one given, else a fresh random one (the workers get
    # it in their config, never on a command line).
    auth = cluster_auth_from_args(args, os.environ, generate=True)

    engine = engine_config_from_args(args)  # raises ValueError on a bad engine flag
    # Every transport (grpc, torch gloo/NCCL, ipc, inproc) carries int8 blocks with their scales and fp8 blocks as bytes
    # (kv_transfer/wire_block.py): all of the engine's cache dtypes. This guards one added to the engine only.
    if engine.kv_cache_dtype not in HANDOFF_KV_CACHE_DTYPES and num_prefill + num_decode > 0:
        raise ValueError(f"--kv-cache-dtype {engine.kv_cache_dtype}: KV handoffs carry "
                         f"{' or '.join(HANDOFF_KV_CACHE_DTYPES)} blocks only; serve it with colocated workers "
                         "(--colocated)")
    pool_tp = {role: getattr(args, f"{role}_tensor_parallel_size") for role in ("prefill", "decode")}
    for role, size in pool_tp.items():
        if size is None:
            continue
        if colocated:
            raise ValueError(f"--{role}-tensor-parallel-size sizes a {role} pool; --colocated runs none (use "
                             "--tensor-parallel-size)")
        check_tp_size_flag(f"--{role}-tensor-parallel-size", size)
    tp = {role: size or engine.tensor_parallel_size for role, size in pool_tp.items()}
    # The cores are split between worker processes, every rank of a tensor-parallel worker one (all workers share
    # one under --kv-transport inproc), so that they do not oversubscribe them, at the largest pools the autoscaler
    # may make; --num-threads overrides.
    num_processes = (num_prefill * tp["prefill"] + num_decode * tp["decode"]
                     + num_colocated * engine.tensor_parallel_size)
    if autoscaler is not None:
        num_processes = (autoscaler.policy.prefill.max_workers * tp["prefill"]
                         + autoscaler.policy.decode.max_workers * tp["decode"])
    if args.kv_transport == "inproc":
        num_processes = max(tp.values()) if num_prefill + num_decode else engine.tensor_parallel_size
    num_threads = engine.num_threads or max(1, len(os.sched_getaffinity(0)) // num_processes)
    engine = dataclasses.replace(engine, num_threads=num_threads)
    if args.gpu_memory_utilization is None and args.ray_address is None and _on_gpu(engine.device):
        # On one machine every worker's engine shares its GPU: each takes an equal part of the default share, so
        # that the last one to start still finds its part free (a given --gpu-memory-utilization is each one's).
        num_engines = num_prefill + num_decode + num_colocated
        if autoscaler is not None:
            num_engines = autoscaler.policy.prefill.max_workers + autoscaler.policy.decode.max_workers
        engine = dataclasses.replace(
            engine, gpu_memory_utilization=round(engine.gpu_memory_utilization / max(1, num_engines), 4))
    worker_env = {
        "OMP_NUM_THREADS": str(num_threads),
        "MKL_NUM_THREADS": str(num_threads),
        "TOKENIZERS_PARALLELISM": "false",
        # our own settings reach the workers even when Ray runs them in an environment of its own (not the
        # secrets: the workers need none of the gateway's, and get the cluster secret in their config)
        **{name: value for name, value in os.environ.items()
           if name.startswith("SPLITSERVE_") and name not in SECRET_ENVS},
    }
    return ControllerConfig(
        engine=engine,
        prefill_tensor_parallel_size=pool_tp["prefill"],
        decode_tensor_parallel_size=pool_tp["decode"],
        num_prefill_workers=num_prefill,
        num_decode_workers=num_decode,
        num_colocated_workers=num_colocated,
        kv_transport=args.kv_transport,
        kv_transfer_timeout_s=args.kv_transfer_timeout,
        worker_env=worker_env,
        health_interval_s=args.health_check_interval,
        health_timeout_s=args.health_check_timeout,
        num_failed_checks_to_restart=args.health_check_failure_threshold,
        auth=auth,
        drain_timeout_s=args.drain_timeout,
        worker_host=args.worker_host or ("0.0.0.0" if args.ray_address else "127.0.0.1"),
        reserve_devices=args.ray_address is not None,
    ), autoscaler


def _on_gpu(device: str) -> bool:
    """Whether workers of `device` run on a GPU of this machine ("auto": when it has one; asked torch-free)."""
    if device == "auto":
        from deploy.cuda_probe import cuda_device_count

        return cuda_device_count() > 0
    return device.startswith("cuda")


SECRET_ENVS = frozenset({CLUSTER_SECRET_ENV, API_KEY_ENV, "SPLITSERVE_ADMIN_TOKEN"})


def check_tp_size_flag(flag: str, size: int) -> None:
    """ValueError naming `flag` unless `size` is a tensor-parallel size at all (whether the model's heads take it is
    checked where the model is known: the worker, at start-up)."""
    if size < 1:
        raise ValueError(f"{flag} must be at least 1, got {size}")
