"""The cuda path of `--quantization` on CPU: `cuda_quantized_linear` (the Triton GEMMs under the interpreter,
torch._scaled_mm's CPU implementation for fp8), the fp8 quantize / dequantize arithmetic, and the tiny model
with every linear layer routed through that path (`Linear.on_cuda`, which the engine sets where a weight is on a
GPU), against the CPU path and the float model.

fp8 bounds (engine/kernels/fp8_linear.py): an e4m3 value is within 2^-4 of its input relative (half a step of
3 mantissa bits), or 2^-10 · scale absolute below e4m3's normal range (2^-6 · 448 · scale = 7 · scale); so

    |Ŵ·s_w - W| ≤ 2^-4 |W| + 2^-10 s_w                       per weight
    |y - x @ W.T| ≤ (2^-3 + 2^-8) (|x| @ |W|ᵀ) + subnormal terms + the output's rounding   per output
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from engine.kernels.cuda_quantized_linear import cuda_quantized_linear  # noqa: E402
from engine.kernels.fp8_linear import (  # noqa: E402
    FP8_MAX,
    check_fp8_device,
    fp8_linear,
    fp8_linear_emulated,
    quantize_activations_fp8,
)
from engine.kernels.quantized_weight import QuantFormat, QuantizedWeight  # noqa: E402
from engine.model.quantization import check_quantization, quantize_head  # noqa: E402
from tests.engine.kernels.quantized_cases import assert_within, gguf_weight  # noqa: E402
from tests.engine.tiny_model import PROMPTS, make_engine  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 10.0 ** torch.randint(-3, 1, (rows, 1), generator=g)
    w[1] = 0.0
    return w


# -- fp8: the arithmetic ---------------------------------------------------------------------------------------------
def test_fp8_weights_are_per_channel_e4m3_within_half_a_step() -> None:
    w = _matrix(48, 64, seed=0)
    q = QuantizedWeight.quantize_fp8(w)
    assert q.format is QuantFormat.FP8 and q.data.dtype == torch.float8_e4m3fn and q.data.shape == (48, 64)
    amax = w.abs().amax(dim=1)
    torch.testing.assert_close(q.scales, torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)), rtol=0, atol=0)
    assert float(q.data[1].float().abs().max()) == 0.0 and float(q.scales[1]) == 1.0  # the zero row
    assert bool((q.data.float().abs().amax(dim=1)[amax > 0] == FP8_MAX).all())  # each row's largest is e4m3's max
    err = (q.dequantize() - w).abs()
    assert bool((err <= 2.0**-4 * w.abs() + 2.0**-10 * q.scales[:, None]).all())
    assert float(err.max()) > 0  # it really rounded
    # nbytes: one byte a weight and a float32 scale a row
    assert q.nbytes == 48 * 64 + 48 * 4


def test_fp8_refuses_non_finite_and_keeps_scales_with_its_rows() -> None:
    bad = torch.ones(4, 32)
    bad[2, 5] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        QuantizedWeight.quantize_fp8(bad)
    q = QuantizedWeight.quantize_fp8(_matrix(32, 64, seed=1))
    torch.testing.assert_close(q.rows(8, 24).dequantize(), q.dequantize()[8:24], rtol=0, atol=0)
    torch.testing.assert_close(q.columns(16, 48).dequantize(), q.dequantize()[:, 16:48], rtol=0, atol=0)
    head = quantize_head(_matrix(64, 32, seed=2), QuantFormat.FP8)
    assert head.format is QuantFormat.FP8


def test_fp8_activations_per_token() -> None:
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)) * torch.tensor([[1e-3], [1.0], [30.0], [0.0],
                                                                                         [2.0]])
    q, scale = quantize_activations_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
    assert float(q[3].float().abs().max()) == 0.0  # an all-zero token: no division by zero
    err = (q.float() * scale - x).abs()
    assert bool((err <= 2.0**-4 * x.abs() + 2.0**-10 * scale).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [1, 7])
def test_fp8_linear_is_the_emulated_scaled_gemm(device, dtype: torch.dtype, tokens: int) -> None:
    """torch._scaled_mm (its CPU implementation here, the fp8 tensor cores on a GPU) computes the float32
    emulation of the same e4m3 values, and both are within the module docstring's bound of the float product."""
    w = _matrix(48, 64, seed=4)
    weight = QuantizedWeight.quantize_fp8(w.to(device))
    x = (torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)) * 3).to(dtype).to(device)
    got = fp8_linear(x, weight)
    assert got.dtype == dtype and got.shape == (tokens, 48)
    emulated = fp8_linear_emulated(x, weight).cpu()
    x_q, x_scale = quantize_activations_fp8(x)
    products = (x_q.float().abs() * x_scale).cpu() @ weight.dequantize().abs().cpu().T  # Σ_k |x̂ s_x| |Ŵ s_w|
    got, x, w = got.cpu(), x.cpu(), w.cpu()
    # _scaled_mm's row-wise output is bfloat16 (2^-8 |y|); its accumulation: float32 on the CPU, on Hopper's fp8
    # tensor cores ~14 bits between promotions to float32 (2^-10 of the products' magnitudes is far above both,
    # and far below a wrong scale or layout)
    assert bool(((got.float() - emulated).abs() <= 2.0**-8 * emulated.abs() + 2.0**-10 * products + 1e-30).all())
    x32 = x.float()
    bound = (2.0**-3 + 2.0**-8) * (x32.abs() @ w.abs().T) + 2.0**-8 * (x32 @ w.T).abs() + 1e-6
    assert bool(((got.float() - x32 @ w.T).abs() <= bound).all())


def test_fp8_shapes_scaled_mm_does_not_take_run_emulated(device) -> None:
    weight = QuantizedWeight.quantize_fp8(_matrix(40, 24, seed=5).to(device))  # neither a multiple of 16
    x = torch.randn(3, 24, generator=torch.Generator().manual_seed(5)).to(device)
    torch.testing.assert_close(fp8_linear(x, weight), fp8_linear_emulated(x, weight))


def test_fp8_needs_compute_capability_8_9(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="fp8 needs cuda"):
        check_quantization("fp8", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8.9 or later .*A100 is 8.0"):
        check_fp8_device(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_quantization("fp8", "cuda:0")  # an H100: no error
    for method in ("int8", "gguf", "none"):  # the Triton kernels: any GPU
        check_quantization(method, "cuda")


# -- the dispatch ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [QuantFormat.Q4_1, QuantFormat.INT8, QuantFormat.FP8], ids=lambda f: f.label)
def test_dispatch_keeps_leading_dims(device, fmt: QuantFormat) -> None:
    if fmt.is_gguf:
        weight = gguf_weight(fmt, 32, 64, seed=0)
    elif fmt is QuantFormat.INT8:
        weight = QuantizedWeight.quantize_int8(_matrix(32, 64, seed=0))
    else:
        weight = QuantizedWeight.quantize_fp8(_matrix(32, 64, seed=0))
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0)).to(device)
    y = cuda_quantized_linear(x, weight.to(device))
    assert y.shape == (2, 3, 32) and y.dtype == x.dtype
    flat = cuda_quantized_linear(x.reshape(6, 64), weight.to(device)).reshape(2, 3, 32)
    torch.testing.assert_close(y, flat, rtol=0, atol=0)
    if fmt is not QuantFormat.FP8:
        assert_within(y.reshape(6, 32), x.reshape(6, 64), weight.dequantize())
    with pytest.raises(ValueError, match="does not end in"):
        cuda_quantized_linear(x[..., :32], weight.to(device))


# -- the tiny model through the cuda path ----------------------------------------------------------------------------
# On the CPU, through the interpreter and torch's CPU _scaled_mm; on a CUDA machine tests/engine/test_gpu_quantization.py
# runs the same engine on the GPU instead (compiled Triton kernels take no CPU tensors).
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="tests/engine/test_gpu_quantization.py on a GPU")


def _linears(model):  # noqa: ANN001, ANN202
    for layer in model.layers:
        yield from (layer.qkv, layer.o, layer.gate_up, layer.down)
    yield model.lm_head


def _route_to_cuda_path(model) -> None:  # noqa: ANN001
    """What the engine does with weights on a GPU, on the CPU: each quantized Linear calls cuda_quantized_linear."""
    for linear in _linears(model):
        assert linear.quantized is not None
        linear.on_cuda = True


def _prompt_logprobs(engine, prompt: str) -> torch.Tensor:  # noqa: ANN001
    """log p(t_j | t_<j) at every position of `prompt`, through the engine's model and KV cache."""
    from engine.request.sampling_params import SamplingParams
    from tests.engine.tiny_model import drain, finals

    ids = engine.tokenizer.encode(prompt)
    engine.add_request("p", ids, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0))
    out = finals(drain(engine))["p"]
    assert engine.block_pool.num_used_blocks == 0
    return torch.tensor([entry.logprob for entry in out.prompt_logprobs])


def _round_trip(checkpoint, quantized_weights: dict, head_format: QuantFormat):  # noqa: ANN001, ANN202
    """The checkpoint with each quantized weight (and the head as the model would quantize it) dequantized."""
    weights = {n: w.dequantize() if isinstance(w, QuantizedWeight) else w for n, w in quantized_weights.items()}
    weights["lm_head.weight"] = quantize_head(weights["lm_head.weight"], head_format).dequantize()
    return dataclasses.replace(checkpoint, weights=weights)


@cpu_only
@pytest.mark.parametrize("method", ["int8", "gguf"])
def test_tiny_model_through_the_triton_kernels_is_its_dequantized_weights(tiny_checkpoint, method: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear layer and the head through the Triton GEMMs: the logits of the float model over the
    dequantized weights (the Triton kernels take float activations), to float32 summation order; the CPU kernels'
    (Q8 activations for gguf) within their own rounding of it."""
    from engine.model.quantization import is_linear_weight, quantize_int8

    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    if method == "int8":
        weights, head_format = quantize_int8(tiny_checkpoint.weights), QuantFormat.INT8
    else:
        weights = {n: QuantizedWeight.from_gguf(quantize(w.numpy(), T.Q4_1), T.Q4_1, tuple(w.shape))
                   if is_linear_weight(n) else w for n, w in tiny_checkpoint.weights.items()}
        head_format = QuantFormat.Q8_0
    quantized = dataclasses.replace(tiny_checkpoint, weights=weights)
    engine = make_engine(quantized, quantization=method)
    cpu_path = _prompt_logprobs(engine, PROMPTS[1])
    _route_to_cuda_path(engine.runner.model)
    from engine.model import linear as linear_module

    calls = []
    monkeypatch.setattr(linear_module, "cuda_quantized_linear",
                        lambda x, w: calls.append(w.format) or cuda_quantized_linear(x, w))
    triton_path = _prompt_logprobs(engine, PROMPTS[1])
    assert len(calls) >= 4 * tiny_checkpoint.config.num_layers + 1  # every layer's four GEMMs and the head
    assert set(calls) == ({QuantFormat.INT8} if method == "int8" else {QuantFormat.Q4_1, QuantFormat.Q8_0})
    reference = _prompt_logprobs(make_engine(_round_trip(tiny_checkpoint, weights, head_format)), PROMPTS[1])
    torch.testing.assert_close(triton_path, reference, rtol=0, atol=1e-4)
    torch.testing.assert_close(cpu_path, reference, rtol=0, atol=0.05 if method == "gguf" else 1e-4)
    if method == "gguf":  # the CPU kernels' Q8 activations: another computation, which the Triton one is not
        assert (cpu_path - reference).abs().max() > 1e-4


@cpu_only
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_model_in_fp8_against_float32(tiny_checkpoint, dtype: str) -> None:
    """Every linear layer and the head in e4m3 through fp8_linear (torch._scaled_mm on the CPU here), activations
    in `dtype`: the prompt logprobs of every test prompt within the bound tests/engine/test_gpu_quantization.py
    states for the GPU (max < 1.0, mean < 0.3; measured here: float32 max 0.34 mean 0.11, bfloat16 max 0.47 mean
    0.14), and not equal to the float32 model's."""
    reference = make_engine(tiny_checkpoint)
    engine = make_engine(tiny_checkpoint, dtype=dtype)
    for linear in _linears(engine.runner.model):
        linear.quantized = QuantizedWeight.quantize_fp8(linear.dense_weight())
        linear.weight = linear.packed = None
    _route_to_cuda_path(engine.runner.model)
    diffs = torch.cat([(_prompt_logprobs(engine, p) - _prompt_logprobs(reference, p)).abs() for p in PROMPTS])
    assert 0 < diffs.max().item() < 1.0 and diffs.mean().item() < 0.3, diffs


# -- the Triton activation quantizer ---------------------------------------------------------------------------------
def _on_grid(tokens: int, in_features: int, seed: int) -> torch.Tensor:
    """Rows of e4m3 values times a power of two, each row's largest ±448: x / s is exact, so no conversion rounds
    (the interpreter's float8 rounding is wrong at binade boundaries; the gpu test below takes random rows)."""
    g = torch.Generator().manual_seed(seed)
    grid = (torch.randn(tokens, in_features, generator=g) * 100).to(torch.float8_e4m3fn).float()
    grid[:, 0] = 448.0 * torch.where(torch.rand(tokens, generator=g) < 0.5, 1.0, -1.0)
    return grid * 2.0 ** torch.randint(-12, 4, (tokens, 1), generator=g).float()


@pytest.mark.parametrize(("in_features", "block"), [(64, None), (200, 64), (96, 32)])  # one chunk; ragged; several
def test_triton_fp8_quantize_is_the_torch_expression(device, in_features: int, block: int | None) -> None:
    from engine.kernels.triton.fp8_quantize import quantize_fp8

    x = _on_grid(5, in_features, seed=in_features)
    x[3] = 0.0  # an all-zero token
    q, scale = quantize_fp8(x.to(device), block=block)
    want_q, want_scale = quantize_activations_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (5, 1) and scale.dtype == torch.float32
    assert torch.equal(scale.cpu(), want_scale)
    assert torch.equal(q.cpu().view(torch.uint8), want_q.view(torch.uint8))
    bf16 = x.to(torch.bfloat16)  # bf16 rows: the same values (e4m3 x 2^k is exact in bf16)
    assert torch.equal(quantize_fp8(bf16.to(device), block=block)[0].cpu().view(torch.uint8),
                       want_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("in_features", [64, 2048, 8192])
def test_triton_fp8_quantize_random_rows_bit_for_bit_gpu(in_features: int) -> None:
    from engine.kernels.triton.fp8_quantize import quantize_fp8

    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(0)) * 10.0 ** torch.randint(
        -3, 3, (300, 1), generator=torch.Generator().manual_seed(1))
    for dtype in (torch.bfloat16, torch.float32):
        xd = x.to(dtype).cuda()
        q, scale = quantize_fp8(xd)
        want_q, want_scale = quantize_activations_fp8(xd)
        assert torch.equal(scale, want_scale)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


def test_fp8_quantizes_the_checkpoints_linear_layers_at_load(tiny_checkpoint) -> None:  # noqa: ANN001
    """What an fp8 engine's build does to the checkpoint (on cuda; here the same code on the CPU tensors): every
    linear layer in e4m3 per channel, the rest and the shared checkpoint untouched."""
    from engine import engine_builder
    from engine.model.quantization import is_linear_weight

    fp8 = engine_builder._quantized(tiny_checkpoint, "fp8")
    for name, weight in fp8.weights.items():
        if is_linear_weight(name):
            assert isinstance(weight, QuantizedWeight) and weight.format is QuantFormat.FP8, name
            original = tiny_checkpoint.weights[name]
            assert bool(((weight.dequantize() - original).abs() <= 2.0**-4 * original.abs()
                         + 2.0**-10 * weight.scales[:, None]).all())
        else:
            assert weight is tiny_checkpoint.weights[name]
    assert all(isinstance(t, torch.Tensor) for t in tiny_checkpoint.weights.values())
