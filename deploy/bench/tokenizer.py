"""The served model's tokenizer where AIPerf finds it with no model hub: AIPerf builds its synthetic prompts and
counts tokens with a Hugging Face tokenizer, and a model splitserve serves (a registered name such as
smollm2-135m, or a local checkpoint) has none on the hub under that name.

    <cache>/bench-tokenizer/hf/hub/models--local--<name>/snapshots/000...0/   tokenizer files
    AIPerf then runs with --tokenizer local/<name>, HF_HOME=<cache>/bench-tokenizer/hf, HF_HUB_OFFLINE=1

(<cache>: $SPLITSERVE_CACHE, else ~/.cache/splitserve.) Saving needs transformers (splitserve's `test` extra);
a model splitserve cannot resolve is passed to AIPerf by its name, for AIPerf to fetch from the hub.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.loader.errors import UnknownModelError
from engine.loader.model_registry import KNOWN_MODELS, cache_dir, resolve_model

_REVISION = "0" * 40


def tokenizer_dir() -> Path:
    return cache_dir() / "bench-tokenizer"


def aiperf_tokenizer(model: str, explicit: str | None = None) -> tuple[str, dict[str, str]]:
    """AIPerf's --tokenizer value for `model` and the environment it needs. `explicit` (--tokenizer) is used as
    given; a model splitserve resolves gets its tokenizer saved (once) as local/<name>; any other model is
    AIPerf's to fetch by name. ValueError when saving needs transformers and it is missing."""
    if explicit:
        return explicit, {}
    local = Path(model).expanduser()
    if model not in KNOWN_MODELS and not local.exists():
        return model, {}
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", model if model in KNOWN_MODELS else local.name)
    hf_home = tokenizer_dir() / "hf"
    snapshot = hf_home / "hub" / f"models--local--{name}" / "snapshots" / _REVISION
    if not (snapshot / "tokenizer_config.json").exists():
        _save(model, snapshot)
        refs = snapshot.parent.parent / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        (refs / "main").write_text(_REVISION)
    return f"local/{name}", {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}


def _save(model: str, snapshot: Path) -> None:
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(f"saving {model}'s tokenizer for AIPerf needs transformers (pip install transformers), "
                         "or pass --tokenizer (a Hugging Face id, a path AIPerf reads, or builtin)") from None
    try:
        path = resolve_model(model)
    except UnknownModelError:
        raise ValueError(f"{model}: not a model splitserve knows; pass --tokenizer") from None
    if path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    snapshot.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(snapshot))
