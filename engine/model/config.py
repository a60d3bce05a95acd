"""The architecture description every loader produces and every model consumes.

Loaders (GGUF, HF safetensors directories) translate their own metadata into one `ModelConfig`; the model code
reads nothing else. No torch here: the control plane and the router may import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Architectures the Llama-family model implements, by the names HF (`config.json` "model_type") and GGUF
# ("general.architecture") use. Anything else is refused by name.
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "smollm")


class UnsupportedArchitectureError(ValueError):
    """The checkpoint names an architecture this engine does not implement."""

    def __init__(self, architecture: str) -> None:
        super().__init__(
            f"unsupported model architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
        self.architecture = architecture


@dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling ("rope_type": "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A Llama-family decoder: the shapes and constants the forward pass needs."""

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    name: str  # human-readable; also namespaces block hashes
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedArchitectureError(self.architecture)
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads ({self.num_kv_heads})")
