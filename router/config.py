"""The gateway's settings, declared once: each field states its default and its range (router/config_checks.py).

    GatewayConfig   what the operator chooses: the router's flags (`serve`, `gateway`: deploy/serve_args.py, each
                    flag named after the field it sets and defaulting to it) and the settings no flag exposes
    ServedEngine    what the workers' engine fixes: the model, its context length and block size, the mode
    RouterConfig    a GatewayConfig and the served model's facts, resolved (build_router_app: router/server.py)

Built once from the flags and passed whole, down to the component that reads a setting (the dispatcher, the
admission queue): a new setting is a field here and, when the operator sets it, a flag. Frozen, no I/O.
"""

from __future__ import annotations

import dataclasses
import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.request.generation_config import NONE as NO_GENERATION_DEFAULTS
from engine.request.generation_config import GenerationDefaults
from engine.request.sampling_params import DEFAULT_MAX_LOGPROBS, SCHEDULING_POLICIES
from router.config_checks import (
    AT_LEAST_ONE,
    AT_LEAST_ZERO,
    POSITIVE,
    FieldValueError,
    check_fields,
    checked,
    one_of,
    within,
)
from router.rate_limit import RateLimits
from router.routing import POLICIES as ROUTING_POLICIES

if TYPE_CHECKING:
    from router.autoscaler import AutoscalerConfig

MODES = ("disaggregated", "colocated")


@dataclass(frozen=True, kw_only=True)
class GatewayTls:
    """HTTPS at the gateway, with vLLM's flag names: `--ssl-keyfile`, `--ssl-certfile`, and `--ssl-ca-certs`,
    which here also requires every client to present a certificate that CA signed (vLLM asks for that with a
    separate `--ssl-cert-reqs 2`; a CA given for nothing else would be a surprise)."""

    keyfile: str
    certfile: str
    ca_certs: str | None = None

    def uvicorn_options(self) -> dict[str, object]:
        options: dict[str, object] = {"ssl_keyfile": self.keyfile, "ssl_certfile": self.certfile}
        if self.ca_certs is not None:
            options.update(ssl_ca_certs=self.ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """The gateway's own settings, whatever model it serves; the defaults are the commands' (README's tables)."""

    # The names a request's `model` may carry, as vLLM's --served-model-name: the first is the one /v1/models lists
    # first; empty: the --model it serves, as given.
    served_model_names: tuple[str, ...] = ()
    # vLLM's --chat-template: a Jinja chat template, or a file holding one, over the model's own (None: the model's)
    chat_template: str | None = None
    # vLLM's --generation-config: the model's sampling defaults from its generation_config.json ("auto"), none
    # ("vllm"), or a folder's (engine/request/generation_config.py)
    generation_config: str = "auto"
    override_generation_config: str | None = None  # a JSON object of the same keys, over what generation_config gave
    host: str = "127.0.0.1"  # the router's HTTP address
    port: int = checked(within(0, 65535), default=8000)  # 0: any free port (the ready line names it)
    request_timeout_s: float = checked(POSITIVE, default=600.0)  # one request, end to end, the gateway's queue too
    # deadline of the belt-and-braces Abort sent after a cancellation
    abort_timeout_s: float = checked(POSITIVE, default=2.0)
    # Attempts per request when the chosen worker is unreachable before it sent anything (UNAVAILABLE):
    # the next attempt goes to another worker.
    max_dispatch_attempts: int = checked(AT_LEAST_ONE, default=2)
    # Migrations per request when its decode worker goes away mid-stream (router/migration.py): the request
    # resumes on another worker from the tokens already streamed; after this many, the client gets an error event.
    max_migrations: int = checked(AT_LEAST_ZERO, default=3)
    # /v1/completions without max_tokens, as in OpenAI and vLLM
    default_completion_max_tokens: int = checked(AT_LEAST_ONE, default=16)
    # A request body over this is a 413 before it is parsed (router/body_limit.py). vLLM's server sets no limit
    # and SGLang's gateway 512 MiB, for base64 images; this gateway takes text only. 32 MiB holds a 1M-token
    # prompt (~4M characters) even were every character a 6-byte JSON \u escape, and bounds the memory and the
    # parsing one request can cost.
    max_request_body_bytes: int = checked(POSITIVE, default=32 * 1024 * 1024)
    # Admission control (router/admission.py): off dispatches everything at once (the engines queue it, as in
    # vLLM); requests held while the pool is full, None: as many as the pool runs at once; and how long one may
    # wait there before a 503.
    admission_control: bool = True
    max_queued_requests: int | None = checked(AT_LEAST_ZERO, default=None)
    queue_timeout_s: float = checked(POSITIVE, default=30.0)
    # Routing (router/routing.py): the policy, and conditional disaggregation: a prompt of which the chosen
    # decode worker lacks at most this many tokens is prefilled there, with no KV handoff (0: never;
    # docs/benchmarks.md, "Conditional disaggregation", says how the default was chosen).
    routing_policy: str = checked(one_of(ROUTING_POLICIES), default="prefix-aware")
    disagg_prefill_threshold_tokens: int = checked(AT_LEAST_ZERO, default=32)
    # Peer fetch (router/peer_fetch.py, worker/peer_fetch.py): with a prefix index, whatever the policy, the worker
    # that runs a prompt fetches its cached head from the worker holding it when that is priced cheaper than
    # computing it.
    kv_peer_fetch: bool = True
    # The autoscaling signals' sliding window (router/pool_signals.py): TTFT and TPOT percentiles cover the
    # requests measured in the last this many seconds.
    signal_window_s: float = checked(POSITIVE, default=60.0)
    autoscaler: AutoscalerConfig | None = None  # the built-in autoscaler (`serve --autoscale`); None: sizes stay
    # Security (docs/security.md): the admin API's bearer token (None: no admin API), API keys (none: /v1/* open)
    # and where they come from, per-key rate limits, HTTPS at the gateway. The cluster secret and gRPC TLS are the
    # workers' (the controller's config, or `gateway --cluster-secret`).
    admin_token: str | None = field(default=None, repr=False)
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    api_key_file: str | None = None
    metrics_require_key: bool = False
    rate_limits: RateLimits = field(default_factory=RateLimits)
    tls: GatewayTls | None = None
    # CORS, as vLLM's flags and defaults: which origins (web pages) a browser lets call the API, with which methods
    # and headers, and whether with credentials (cookies); no origin: no CORS headers at all. The API key still
    # applies to every call from any origin (docs/security.md).
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # vLLM's --enable-request-id-headers: every response carries X-Request-Id (router/request_ids.py)
    enable_request_id_headers: bool = False
    # vLLM's --return-tokens-as-token-ids: logprobs name tokens "token_id:<id>", unless a request says otherwise
    return_tokens_as_token_ids: bool = False
    # vLLM's --enable-log-requests: one INFO line per accepted request (router/request_log.py), its prompt cut to
    # max_log_len characters and token ids (None: whole)
    enable_log_requests: bool = False
    max_log_len: int | None = checked(AT_LEAST_ZERO, default=None)
    uvicorn_log_level: str = checked(one_of(UVICORN_LOG_LEVELS), default="warning")  # vLLM's --uvicorn-log-level
    # vLLM's --trust-request-chat-template: a chat request's own `chat_template` is rendered (else it is a 400)
    trust_request_chat_template: bool = False
    # vLLM's --root-path: the path prefix a path-routing proxy serves the API under (FastAPI's root_path; None: none)
    root_path: str | None = None

    def __post_init__(self) -> None:
        check_served_model_names(self.served_model_names, allow_none=True)
        check_fields(self)


def check_served_model_names(names: tuple[str, ...], *, allow_none: bool = False) -> None:
    """Names, none blank, none twice; `allow_none`: or no name at all."""
    if (not names and not allow_none) or any(not name.strip() for name in names):
        raise FieldValueError("served_model_names", f"must be non-empty names, got {names!r}")
    if len(set(names)) != len(names):
        raise FieldValueError("served_model_names", f"names a model twice: {names!r}")


@dataclass(frozen=True, kw_only=True)
class ServedEngine:
    """What the gateway must know of the workers' engine to serve it: from the controller's engine config, or
    from the workers' own Health answers (deploy/static_workers.py)."""

    model: str  # --model: a registered name, a path, or (load_format "dummy") a dummy shape
    load_format: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None  # None: the checkpoint's context length
    mode: str = "disaggregated"  # or "colocated"
    scheduling_policy: str = "fcfs"  # --scheduling-policy: "priority" orders the gateway's queue too
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # --max-logprobs: the gateway refuses more, as a worker would


@dataclass(frozen=True, kw_only=True)
class RouterConfig(GatewayConfig):
    """A GatewayConfig and what the router knows of the model it serves, resolved.

    `served_model_names`: the names a request's `model` may carry; the first is the one /v1/models lists first
    and responses echo back the name the request used. `max_model_len` bounds prompt + generated tokens.
    `block_size` is the workers' KV block size in tokens, used to estimate how many blocks a request needs.
    """

    served_model_names: tuple[str, ...]
    max_model_len: int = checked(POSITIVE)
    # what `generation_config` found: a request's unset sampling fields and its max_tokens cap
    generation_defaults: GenerationDefaults = NO_GENERATION_DEFAULTS
    # "disaggregated": prefill + decode pools; "colocated": one pool runs both
    mode: str = checked(one_of(MODES), default="disaggregated")
    block_size: int = checked(POSITIVE, default=16)
    # the workers' --scheduling-policy: "priority" admits the gateway's queue by request priority; "fcfs" takes only 0
    scheduling_policy: str = checked(one_of(SCHEDULING_POLICIES), default="fcfs")
    # the workers' --max-logprobs (-1: their vocabulary's size, which they check)
    max_logprobs: int = checked(within(-1, 2**31 - 1), default=DEFAULT_MAX_LOGPROBS)

    def __post_init__(self) -> None:
        check_served_model_names(self.served_model_names)
        check_fields(self)

    @classmethod
    def serving(cls, gateway: GatewayConfig, *, served_model_names: tuple[str, ...], max_model_len: int,
                mode: str, block_size: int, scheduling_policy: str = "fcfs",
                max_logprobs: int = DEFAULT_MAX_LOGPROBS,
                generation_defaults: GenerationDefaults = NO_GENERATION_DEFAULTS) -> RouterConfig:
        """`gateway`'s settings, every one of them, for the model these name (the gateway's own names, if it has
        any, over `served_model_names`)."""
        settings = {f.name: getattr(gateway, f.name) for f in dataclasses.fields(GatewayConfig)}
        served_model_names = settings.pop("served_model_names") or served_model_names
        return cls(**settings, served_model_names=served_model_names, max_model_len=max_model_len, mode=mode,
                   block_size=block_size, scheduling_policy=scheduling_policy, max_logprobs=max_logprobs,
                   generation_defaults=generation_defaults)

    @property
    def target_role(self) -> str:
        """The pool Generate calls go to, whose room admission counts."""
        return "decode" if self.mode == "disaggregated" else "colocated"

    @property
    def roles_needed(self) -> tuple[str, ...]:
        """The worker roles a request needs one healthy worker of each."""
        return ("prefill", "decode") if self.mode == "disaggregated" else ("colocated",)
