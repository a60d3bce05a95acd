"""Llama-3 RoPE scaling as per-frequency divisors, and recovering its parameters from them.

HF configs state the parameters (`RopeScaling`); llama.cpp's converter instead stores the resulting divisors
as a `rope_freqs.weight` tensor, one per rotary frequency. With wavelength w = 2π / inv_freq:

    w < original / high_freq_factor   ->  1                      (high frequencies untouched)
    w > original / low_freq_factor    ->  factor                 (low frequencies slowed down)
    otherwise                          ->  1 / ((1 - s) / factor + s),
                                           s = (original / w - low_freq_factor) / (high_freq_factor - low_freq_factor)

Only the ratios original/low_freq_factor and original/high_freq_factor matter, so the divisors determine the
parameters only up to a common scale of (original, low, high); `infer_llama3_scaling` takes `original` as given
and solves for the rest, then checks that its answer reproduces the divisors.
"""

from __future__ import annotations

import math

import numpy as np

from engine.model.config import RopeScaling

# Llama 3's pretraining context: the `original` used when a GGUF does not record one. Any value gives the same
# frequencies (see above); this one gives Llama 3.1's familiar low/high factors of 1 and 4.
DEFAULT_ORIGINAL_CONTEXT = 8192

_MATCH_RTOL = 1e-4  # float32 storage, a least-squares fit and 6-digit rounding all fit well inside this


def base_inv_freq(rope_theta: float, rotary_dim: int) -> np.ndarray:
    """Unscaled RoPE inverse frequencies, float64 [rotary_dim // 2]."""
    return 1.0 / (rope_theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


def llama3_divisors(scaling: RopeScaling, rope_theta: float, rotary_dim: int) -> np.ndarray:
    """What each inverse frequency is divided by under `scaling`, float64 [rotary_dim // 2]."""
    wavelen = 2 * math.pi / base_inv_freq(rope_theta, rotary_dim)
    original = scaling.original_max_position_embeddings
    low, high = scaling.low_freq_factor, scaling.high_freq_factor
    smooth = (original / wavelen - low) / (high - low)
    medium = 1.0 / ((1.0 - smooth) / scaling.factor + smooth)
    divisors = np.where(wavelen > original / low, scaling.factor, medium)
    return np.where(wavelen < original / high, 1.0, divisors)


def _round6(value: float) -> float:
    return float(f"{value:.6g}")


def infer_llama3_scaling(
    divisors: np.ndarray, rope_theta: float, rotary_dim: int, original_context: int = DEFAULT_ORIGINAL_CONTEXT
) -> RopeScaling | None:
    """The `RopeScaling` whose divisors match `divisors` (None when they are all 1).

    Raises `ValueError` when no Llama-3 scaling reproduces them: better to refuse a model than to run it with
    subtly wrong positions.
    """
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if divisors.shape[0] != rotary_dim // 2:
        raise ValueError(f"{divisors.shape[0]} rope frequency factors for a rotary dimension of {rotary_dim}")
    if np.allclose(divisors, 1.0, rtol=0, atol=1e-6):
        return None
    # Parameters are rounded to 6 significant digits: the divisors carry float32 noise (8.000001 for 8), and
    # configs state round numbers; the check at the end guards the rounding.
    factor = _round6(divisors.max())
    if factor <= 1.0 or divisors.min() < 1.0 - 1e-6:
        raise ValueError("rope frequency factors outside [1, factor] are not Llama-3 scaling")

    inv_wavelen = base_inv_freq(rope_theta, rotary_dim) / (2 * math.pi)
    medium = (divisors > 1.0 + 1e-6) & (divisors < factor * (1.0 - 1e-6))
    if medium.sum() >= 2:
        # In the medium band s is linear in 1/w: s = original/(high - low) * (1/w) - low/(high - low).
        s = (1.0 / divisors[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(inv_wavelen[medium], s, 1)
        span = original_context / slope  # high - low
        low = -intercept * span
        low, high = _round6(low), _round6(low + span)
    else:
        # Too few points to fit; try Llama 3.1's published values and let the check below decide.
        low, high = 1.0, 4.0
    scaling = RopeScaling(
        factor=factor, low_freq_factor=low, high_freq_factor=high, original_max_position_embeddings=original_context
    )
    if not (0 < low < high) or not np.allclose(
        llama3_divisors(scaling, rope_theta, rotary_dim), divisors, rtol=_MATCH_RTOL, atol=0
    ):
        raise ValueError("rope frequency factors do not match any Llama-3 scaling")
    return scaling
