"""`--speculative-config` / `LLM(speculative_config=...)`: which proposer, how many drafts, which policy. No I/O.

Keys as vLLM names them:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "draft_model", "model": NAME_OR_PATH, "num_speculative_tokens": 4}
    {"method": "layer_skip", "num_layers": K, "num_speculative_tokens": 4}

plus `"policy"`: "dynamic" (the default: k chosen per request and step, up to num_speculative_tokens) or "fixed"
(always num_speculative_tokens, as far as the budget and the proposer allow).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "layer_skip")
POLICIES = ("dynamic", "fixed")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4  # the most drafts per request and step
    policy: str = "dynamic"
    prompt_lookup_min: int = 2  # ngram: the shortest suffix looked up
    prompt_lookup_max: int = 5  # ngram: the longest
    model: str | None = None  # draft_model: a name or path our loaders load, with the target's vocabulary
    num_layers: int | None = None  # layer_skip: the target's first K layers draft

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"speculative policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be a positive integer, got {self.num_speculative_tokens!r}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                f"{self.prompt_lookup_max}"
            )
        if self.method == "draft_model" and not self.model:
            raise ValueError('draft_model needs "model": a name or path of the draft model')
        if self.method == "layer_skip" and (not isinstance(self.num_layers, int) or self.num_layers < 1):
            raise ValueError(f'layer_skip needs "num_layers": a positive integer, got {self.num_layers!r}')

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM-style keys; unknown keys are an error (a typo must not silently disable something)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "method" not in values:
            raise ValueError(f'speculative_config needs "method", one of {", ".join(METHODS)}')
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(values, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {text!r}")
        return cls.from_dict(values)
