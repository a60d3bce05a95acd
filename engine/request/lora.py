"""What names a LoRA adapter, for a request and on the command line: vLLM's `LoRARequest` (the offline API's handle)
and its `--lora-modules` entries, and the rule for an adapter's name (what a request's `model` says). No torch: the
router reads these too."""

from __future__ import annotations

import json
from dataclasses import dataclass


class LoRAError(ValueError):
    """An adapter that cannot be loaded or served, or a request naming one this engine does not hold, with why."""


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's offline handle on an adapter (`LLM.generate(..., lora_request=LoRARequest("name", 1, path))`): loaded
    from `lora_path` the first time its name is asked for. The id is vLLM's; names identify adapters here."""

    lora_name: str
    lora_int_id: int
    lora_path: str


@dataclass(frozen=True)
class LoRAModule:
    """One --lora-modules entry: `name=path`, or vLLM's JSON form {"name": ..., "path": ...}."""

    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        text = text.strip()
        if text.startswith("{"):
            try:
                values = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--lora-modules entry is not JSON: {exc}") from None
            if not isinstance(values, dict) or not isinstance(values.get("name"), str) or not isinstance(
                    values.get("path"), str):
                raise ValueError(f'a JSON --lora-modules entry needs "name" and "path" strings, got {text!r}')
            name, path = values["name"], values["path"]
        else:
            name, sep, path = text.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules entries are NAME=PATH, got {text!r}")
        return cls(check_lora_name(name), path.strip())


def check_lora_name(name: str) -> str:
    """A served adapter's name (what a request's `model` says): non-empty, printable, no surrounding spaces."""
    if not name or name != name.strip() or not name.isprintable() or len(name) > 256:
        raise ValueError(f"a LoRA adapter's name must be 1-256 printable characters without surrounding spaces, "
                         f"got {name!r}")
    return name
