"""Generated JSON schemas for the structured-output tests: nested objects, enums, arrays, bounded numbers, required
fields; bounded so that a small model's greedy output ends within a modest max_tokens."""

from __future__ import annotations

import random
from typing import Any

_WORDS = ["name", "city", "color", "size", "score", "level", "tags", "owner", "status", "count", "price", "kind"]


def generated_schema(seed: int, *, depth: int = 2) -> dict[str, Any]:
    """A JSON schema object, the same for the same seed."""
    rng = random.Random(seed)
    return _object(rng, depth)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(_WORDS, rng.randint(2, 3))
    properties = {name: _value(rng, depth - 1) for name in names}
    required = [name for name in names if rng.random() < 0.7] or names[:1]
    return {"type": "object", "properties": properties, "required": required}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    kinds = ["enum", "integer", "number", "boolean", "string", "array"] + (["object"] * 2 if depth > 0 else [])
    kind = rng.choice(kinds)
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "on", "off"], 3)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "string":
        return {"type": "string", "maxLength": 12}
    if kind == "array":
        item = rng.choice([{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["a", "b", "c"]}])
        return {"type": "array", "items": item, "minItems": 1, "maxItems": 3}
    return _object(rng, depth)
