"""Per-request sampling parameters, named and defaulted as in vLLM's `SamplingParams`, and their field table.

Torch-free. `validate()` runs when a request is added, so bad values fail fast with a message that names the
parameter, before any KV block is allocated.

The field table is the class itself: each field is declared once, with its default and, through `param()`, the
other places it comes from. Everything that reads or writes the parameters field by field reads the table:

    its protobuf form     protos/serving.proto's SamplingParams has a field of the same name; how it travels
                          (optional, repeated, map, message) is that declaration's (engine/request/wire.py, both ways)
    a command-line flag   `flag`: the `splitserve generate` flag that sets it (engine/generate_command.py)
    the OpenAI body       `body`: the router copies the request body's field of the same name, which means the
                          same (None there: this default); the other fields it derives (router/protocol.py)

A new sampling parameter is one line here, its proto field, its check in `validate()`, and the sampler stage that
reads it (plus its OpenAI body field, if it has one).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from engine.request.grammar_spec import GrammarSpec

# OpenAI's and vLLM's bound on a logit bias; and on how many choices one request may ask for (vLLM sets none: a
# cap keeps one request from taking a whole decode worker's batch).
MAX_LOGIT_BIAS = 100.0
MAX_NUM_CHOICES = 128


def param(default: Any = MISSING, *, factory: Any = MISSING, flag: str | None = None, help: str | None = None,
          body: bool = False) -> Any:
    """A field of the table: its default (or default `factory`), its `splitserve generate` `flag` (with `help`),
    and whether OpenAI's request `body` carries it under its own name (see the module docstring)."""
    metadata: dict[str, object] = {"body": body}
    if flag is not None:
        metadata.update(flag=flag, help=help)
    return field(default=default, default_factory=factory, metadata=metadata)


@dataclass(kw_only=True)
class SamplingParams:
    # choices: the prompt is prefilled once, its blocks shared by every choice (engine/core/fork.py)
    n: int = param(1, body=True)
    best_of: int | None = param(None)  # generate this many (>= n), return the n of highest cumulative logprob; None: n
    temperature: float = param(1.0, flag="--temperature", body=True)  # 0 means greedy
    top_p: float = param(1.0, flag="--top-p", body=True)  # in (0, 1]
    top_k: int = param(0, flag="--top-k", body=True)  # 0 (or -1) disables
    min_p: float = param(0.0, flag="--min-p", body=True)  # in [0, 1]
    # > 0; 1 disables; applies to prompt and output tokens
    repetition_penalty: float = param(1.0, flag="--repetition-penalty", body=True)
    presence_penalty: float = param(0.0, flag="--presence-penalty", body=True)  # in [-2, 2]
    frequency_penalty: float = param(0.0, flag="--frequency-penalty", body=True)  # in [-2, 2]
    # same seed -> same output, whatever else is in the batch
    seed: int | None = param(None, flag="--request-seed", help="per-request sampling seed", body=True)
    max_tokens: int | None = param(16, flag="--max-tokens")  # None: up to max_model_len
    min_tokens: int = param(0, body=True)  # EOS and stop token ids are masked until this many tokens are out
    stop: list[str] = param(factory=list, flag="--stop", help="a stop string; repeatable", body=True)
    stop_token_ids: list[int] = param(factory=list, body=True)
    ignore_eos: bool = param(False, flag="--ignore-eos", body=True)
    include_stop_str_in_output: bool = param(False, body=True)
    # number of top logprobs to return with each token (the sampled one is extra)
    logprobs: int | None = param(None, flag="--logprobs")
    skip_special_tokens: bool = param(True, body=True)
    logit_bias: dict[int, float] = param(factory=dict)  # token id -> added to its logit, every step
    # vLLM's: logprobs of the prompt's tokens (the first has none), top-k each
    prompt_logprobs: int | None = param(None)
    structured_outputs: GrammarSpec | None = param(None)  # the grammar every sampled token must follow
    # vLLM's: only these tokens may be sampled (empty: any); a hard mask, unlike logit_bias
    allowed_token_ids: list[int] = param(factory=list, body=True)
    # vLLM's: words the output must not contain (engine/request/bad_words.py); the engine tokenizes them
    bad_words: list[str] = param(factory=list, body=True)
    # Not the sampler's but the scheduler's (vLLM passes it beside the params; it travels with them here): with
    # --scheduling-policy priority, lower values are admitted first and preempted last; fcfs takes only 0.
    priority: int = param(0, body=True)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_sequences(self) -> int:
        """How many sequences the engine generates: `best_of`, or `n`."""
        return self.best_of if self.best_of is not None else self.n

    def validate(self) -> None:
        """Raise ValueError naming the first bad parameter."""
        if not 1 <= self.n <= MAX_NUM_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_NUM_CHOICES}], got {self.n}")
        if self.best_of is not None and not self.n <= self.best_of <= MAX_NUM_CHOICES:
            raise ValueError(f"best_of must be in [n={self.n}, {MAX_NUM_CHOICES}], got {self.best_of}")
        if not self.temperature >= 0.0:  # also catches NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):  # the cap is the engine's --max-logprobs (check_engine_rules)
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}")
        for token_id, bias in self.logit_bias.items():
            if token_id < 0:
                raise ValueError(f"logit_bias token ids must be non-negative, got {token_id}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # also catches NaN
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token_id}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative, got {self.stop_token_ids}")
        if any(t < 0 for t in self.allowed_token_ids):
            raise ValueError(f"allowed_token_ids must be non-negative, got {self.allowed_token_ids[:5]}")
        if self.allowed_token_ids and self.structured_outputs is not None:
            raise ValueError("allowed_token_ids cannot be combined with structured outputs (a grammar): together "
                             "they may leave no token to sample")
        if any(not word.strip() for word in self.bad_words):
            raise ValueError("bad_words entries must hold more than whitespace")
        if self.bad_words and self.structured_outputs is not None:
            raise ValueError("bad_words cannot be combined with structured outputs (a grammar): the grammar may "
                             "need a token they ban, and then nothing is left to sample")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")
        if not -(2**31) <= self.priority < 2**31:
            raise ValueError(f"priority must be in [-2**31, 2**31), got {self.priority}")
        if self.structured_outputs is not None:
            self.structured_outputs.validate()


# vLLM's --scheduling-policy: "fcfs" admits in arrival order; "priority" by each request's priority (lower first),
# then arrival, and preempts the lowest first (engine/core/scheduler.py).
SCHEDULING_POLICIES = ("fcfs", "priority")


# vLLM's --max-logprobs default: the most top logprobs a request may ask for, per token and per prompt token.
DEFAULT_MAX_LOGPROBS = 20


def check_engine_rules(params: SamplingParams, *, scheduling_policy: str, max_logprobs: int) -> None:
    """ValueError unless validated `params` may run on an engine of `scheduling_policy` (vLLM's rule: only
    "priority" takes a priority other than 0) and `max_logprobs` (--max-logprobs; -1: no cap here, the engine
    caps at its vocabulary's size)."""
    if params.priority != 0 and scheduling_policy != "priority":
        raise ValueError(f"priority {params.priority} needs --scheduling-policy priority; this engine schedules "
                         f"{scheduling_policy} (arrival order), where every request's priority is 0")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and 0 <= max_logprobs < value:
            raise ValueError(f"{name} must be in [0, {max_logprobs}] (the engine's --max-logprobs), got {value}")


# The table's columns: the fields the OpenAI body carries under their own names; and each flag's field.
BODY_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams) if f.metadata["body"])
FLAG_FIELDS: dict[str, str] = {f.metadata["flag"]: f.name for f in fields(SamplingParams) if "flag" in f.metadata}
