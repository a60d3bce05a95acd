"""splitserve's engine: the shared core of prefill and decode workers.

Light on import: the torch-free control plane (`engine.core`) loads anywhere; `LLM` and friends, which need
torch, are exported lazily.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.request.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams"]

_LAZY = {"LLM": "engine.llm", "LLMEngine": "engine.llm_engine", "EngineConfig": "engine.config"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
