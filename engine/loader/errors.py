"""The errors a checkpoint loader raises.

Every failure to turn a file on disk into weights surfaces as a `ModelLoadError` (or a subclass) whose message
names the file and the problem, so an operator can act on it without reading a numpy or struct traceback.
An architecture the engine does not implement is the exception: it raises
`engine.model.config.UnsupportedArchitectureError`, which callers may want to tell apart.
"""

from __future__ import annotations


class ModelLoadError(RuntimeError):
    """A checkpoint could not be read: missing, truncated, corrupt, or inconsistent with its own metadata."""


class UnknownModelError(ModelLoadError):
    """A model name is neither a registered model nor an existing path."""

    def __init__(self, name: str, known_names: tuple[str, ...]) -> None:
        super().__init__(
            f"unknown model {name!r}: not a registered model name and not an existing path; "
            f"known names: {', '.join(known_names)}"
        )
        self.name = name
        self.known_names = known_names


class UnsupportedQuantizationError(ModelLoadError):
    """A tensor is stored in a GGML type this engine cannot dequantize."""
