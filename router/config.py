"""RouterConfig: what the gateway needs to know about the model it serves and how to dispatch. No I/O."""

from __future__ import annotations

from dataclasses import dataclass

from router.config_checks import AT_LEAST_ONE, AT_LEAST_ZERO, POSITIVE, check_fields, checked, one_of
from router.routing import POLICIES as ROUTING_POLICIES

MODES = ("disaggregated", "colocated")


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Frozen; entry points build it from flags.

    `served_model_names`: the names a request's `model` may carry; the first is the one /v1/models lists first
    and responses echo back the name the request used. `max_model_len` bounds prompt + generated tokens.
    `block_size` is the workers' KV block size in tokens, used to estimate how many blocks a request needs.
    """

    served_model_names: tuple[str, ...]
    max_model_len: int = checked(POSITIVE)
    # "disaggregated": prefill + decode pools; "colocated": one pool runs both
    mode: str = checked(one_of(MODES), default="disaggregated")
    block_size: int = checked(POSITIVE, default=16)
    request_timeout_s: float = checked(POSITIVE, default=600.0)  # deadline of one Generate call, queueing included
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
    # decode worker lacks at most this many tokens is prefilled there, with no KV handoff (0: never).
    routing_policy: str = checked(one_of(ROUTING_POLICIES), default="prefix-aware")
    disagg_prefill_threshold_tokens: int = checked(AT_LEAST_ZERO, default=0)
    # The autoscaling signals' sliding window (router/pool_signals.py): TTFT and TPOT percentiles cover the
    # requests measured in the last this many seconds.
    signal_window_s: float = checked(POSITIVE, default=60.0)

    def __post_init__(self) -> None:
        if not self.served_model_names or any(not name for name in self.served_model_names):
            raise ValueError(f"served_model_names must be non-empty names, got {self.served_model_names!r}")
        check_fields(self)

    @property
    def target_role(self) -> str:
        """The pool Generate calls go to, whose room admission counts."""
        return "decode" if self.mode == "disaggregated" else "colocated"

    @property
    def roles_needed(self) -> tuple[str, ...]:
        """The worker roles a request needs one healthy worker of each."""
        return ("prefill", "decode") if self.mode == "disaggregated" else ("colocated",)
