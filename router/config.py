"""RouterConfig: what the gateway needs to know about the model it serves and how to dispatch. No I/O."""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("disaggregated", "colocated")


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Frozen; entry points build it from flags.

    `served_model_names`: the names a request's `model` may carry; the first is the one /v1/models lists first
    and responses echo back the name the request used. `max_model_len` bounds prompt + generated tokens.
    `block_size` is the workers' KV block size in tokens, used to estimate how many blocks a request needs.
    """

    served_model_names: tuple[str, ...]
    max_model_len: int
    mode: str = "disaggregated"  # "disaggregated": prefill + decode pools; "colocated": one pool runs both
    block_size: int = 16
    request_timeout_s: float = 600.0  # deadline of one Generate call, queueing included
    abort_timeout_s: float = 2.0  # deadline of the belt-and-braces Abort sent after a cancellation
    # Attempts per request when the chosen worker is unreachable before it sent anything (UNAVAILABLE):
    # the next attempt goes to another worker.
    max_dispatch_attempts: int = 2
    default_completion_max_tokens: int = 16  # /v1/completions without max_tokens, as in OpenAI and vLLM

    def __post_init__(self) -> None:
        if not self.served_model_names or any(not name for name in self.served_model_names):
            raise ValueError(f"served_model_names must be non-empty names, got {self.served_model_names!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        for name in ("request_timeout_s", "abort_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_dispatch_attempts < 1:
            raise ValueError(f"max_dispatch_attempts must be at least 1, got {self.max_dispatch_attempts}")
        if self.default_completion_max_tokens < 1:
            raise ValueError(
                f"default_completion_max_tokens must be at least 1, got {self.default_completion_max_tokens}"
            )

    @property
    def roles_needed(self) -> tuple[str, ...]:
        """The worker roles a request needs one healthy worker of each."""
        return ("prefill", "decode") if self.mode == "disaggregated" else ("colocated",)
