"""The model's own sampling defaults, as vLLM takes them (`--generation-config`, default "auto").

    generation_config.json (HF)  ──▶  GenerationDefaults: the sampling fields it sets to other than HF's
                                      defaults (repetition_penalty, temperature, top_k, top_p, min_p), and
                                      max_new_tokens
    a request's unset field      ──▶  the model's value (router/protocol.py's `to_sampling_params`)
    max_new_tokens               ──▶  a cap on every request's max_tokens (the default too, when it sets none)

`--generation-config auto` reads the file in the model's directory (a GGUF file or a dummy shape has none: nothing
changes), `vllm` reads none, and a folder's path reads that folder's file, which must be there. As vLLM does, a
value equal to HF's own default is no override (a file's `"top_k": 50` leaves top-k off).
`--override-generation-config '{"temperature": 0.5, "max_new_tokens": 512}'` sets those keys over whatever the
file gave (over nothing with `vllm`), each one as given. A file or an override that does not parse, or a value of
the wrong kind, is a clear error at start-up. Torch-free: the gateway reads it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

logger = logging.getLogger(__name__)

FILE = "generation_config.json"
AUTO, VLLM = "auto", "vllm"
# transformers' GenerationConfig defaults of the fields vLLM takes: a file's value equal to these overrides nothing.
HF_DEFAULTS: Mapping[str, float | int | None] = MappingProxyType(
    {"repetition_penalty": 1.0, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": None})


@dataclass(frozen=True)
class GenerationDefaults:
    """`sampling`: SamplingParams field -> the model's value, for requests that leave the field unset;
    `max_new_tokens`: at most this many tokens a request (None: no cap)."""

    sampling: Mapping[str, float | int] = field(default_factory=lambda: MappingProxyType({}))
    max_new_tokens: int | None = None


NONE = GenerationDefaults()


def load_generation_defaults(setting: str, model_path: str | os.PathLike[str] | None,
                             override: str | Mapping[str, object] | None = None) -> GenerationDefaults:
    """`--generation-config`'s defaults: `setting` "auto" (the file in `model_path`, when it is a directory holding
    one), "vllm" (none) or a folder's path (its file); `override`: --override-generation-config's JSON object (its
    text, or parsed: `LLM(override_generation_config={...})`), over them. ValueError naming the flag for a folder
    without the file, a file or an override that does not parse, or a value of the wrong kind."""
    sampling: dict[str, float | int] = {}
    max_new_tokens = None
    path = _file(setting, model_path)
    if path is not None:
        try:
            with open(path, encoding="utf-8") as file:
                raw = json.load(file)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"--generation-config: cannot read {path}: {exc}") from None
        sampling, max_new_tokens = _values(raw, f"--generation-config: {path}", keep_defaults=False)
    if override is not None:
        raw = parse_override(override) if isinstance(override, str) else dict(override)
        unknown = sorted(set(raw) - {*HF_DEFAULTS, "max_new_tokens"})
        if unknown:
            raise ValueError(f"--override-generation-config: unknown keys {', '.join(unknown)} (it takes "
                             f"{', '.join([*HF_DEFAULTS, 'max_new_tokens'])})")
        more, cap = _values(raw, "--override-generation-config", keep_defaults=True)
        sampling.update(more)
        max_new_tokens = cap if cap is not None else max_new_tokens
    defaults = GenerationDefaults(MappingProxyType(sampling), max_new_tokens)
    if defaults != NONE:
        logger.info("the model's %s overrides the default sampling parameters: %s%s (--generation-config vllm: "
                    "not)", FILE, sampling, f", max_new_tokens {max_new_tokens}" if max_new_tokens else "")
    return defaults


def parse_override(text: str) -> dict[str, object]:
    """--override-generation-config's text: a JSON object, else ValueError naming the flag."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--override-generation-config: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError("--override-generation-config holds no JSON object")
    return raw


def _file(setting: str, model_path: str | os.PathLike[str] | None) -> str | None:
    """The generation_config.json `setting` names (None: none to read)."""
    if setting == VLLM:
        return None
    folder = model_path if setting == AUTO else setting
    if folder is None or not os.path.isdir(folder):
        if setting == AUTO:
            return None
        raise ValueError(f"--generation-config {setting}: no such folder (or 'auto', 'vllm')")
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        if setting == AUTO:
            return None
        raise ValueError(f"--generation-config {setting}: no {FILE} there")
    return path


def _values(raw: object, where: str, *, keep_defaults: bool) -> tuple[dict[str, float | int], int | None]:
    """The sampling values and max_new_tokens of one JSON object, checked; those equal to HF's defaults dropped
    unless `keep_defaults`."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where} holds no JSON object")
    sampling: dict[str, float | int] = {}
    for name, default in HF_DEFAULTS.items():
        value = raw.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or (name == "top_k" and
                                                                             not isinstance(value, int)):
            raise ValueError(f"{where}: {name} must be a number, got {value!r}")
        if keep_defaults or value != default:
            sampling[name] = value
    max_new_tokens = raw.get("max_new_tokens")
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                       or max_new_tokens < 1):
        raise ValueError(f"{where}: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    return sampling, max_new_tokens
