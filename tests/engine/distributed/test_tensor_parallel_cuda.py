"""A tensor-parallel engine's CUDA code path (issue 33): where each rank runs, and TP 2 against TP 1 on a GPU.

The GPU machines lent here have one device and NCCL refuses two ranks on one GPU, so the gpu-marked tests run TP 2
over gloo (`SPLITSERVE_TP_CUDA_BACKEND=gloo`: every rank on cuda:0, each collective through the host): the ranks'
weights, KV shards, step messages and forwards on CUDA, the collectives' arithmetic the same as NCCL's would be up to
summation order, every step eager (gloo's collectives go through the host: no CUDA graph). With two GPUs or more the
NCCL case runs TP 2 for real, each rank replaying its decode step's CUDA graphs, the collectives inside; with one it
checks the refusal. The placement rule itself is pure and tested without a GPU.

Quantized shards on CUDA (`--quantization` composes with tensor parallelism, issue 34): int8 at TP 2 gives int8 at
TP 1's tokens, every logits row within 1e-3 (weight-only: each row-parallel shard's partial product is the same
arithmetic on its columns); fp8 quantizes each shard's activations per token over its own columns, so TP 2 is held to
fp8's bound against the float32 engine (tests/engine/test_gpu_quantization.py's: max |Δ logprob| < 1.0, mean < 0.3)
rather than to TP 1.
"""

from __future__ import annotations

import pytest
import torch

from engine.distributed.group import CUDA_BACKEND_ENV, cuda_backend, rank_devices
from tests.engine.distributed.test_tensor_parallel import ENGINE, Pair, prompt_ids
from tests.engine.tiny_model import PROMPTS, greedy

CUDA = dict(ENGINE, device="cuda", dtype="float32")


def test_each_rank_gets_its_own_gpu_under_nccl_and_rank_0s_under_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CUDA_BACKEND_ENV, raising=False)
    assert cuda_backend() == "nccl"
    assert rank_devices(torch.device("cpu"), 3) == [torch.device("cpu")] * 3
    assert rank_devices(torch.device("cuda"), 2, num_cuda_devices=2) == [torch.device("cuda", 0),
                                                                         torch.device("cuda", 1)]
    assert rank_devices(torch.device("cuda", 2), 2, num_cuda_devices=4) == [torch.device("cuda", 2),
                                                                            torch.device("cuda", 3)]
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 on cuda:0 needs cuda:0..cuda:1, but 1 CUDA"):
        rank_devices(torch.device("cuda"), 2, num_cuda_devices=1)
    with pytest.raises(ValueError, match=r"needs cuda:3..cuda:4, but 4 CUDA device"):
        rank_devices(torch.device("cuda", 3), 2, num_cuda_devices=4)
    monkeypatch.setenv(CUDA_BACKEND_ENV, "GLOO")
    assert rank_devices(torch.device("cuda", 1), 4, num_cuda_devices=2) == [torch.device("cuda", 1)] * 4
    monkeypatch.setenv(CUDA_BACKEND_ENV, "mpi")
    with pytest.raises(ValueError, match="SPLITSERVE_TP_CUDA_BACKEND='mpi': expected nccl or gloo"):
        cuda_backend()


def test_tp_on_cuda_with_too_few_gpus_is_refused_before_anything_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU needed: the builder's check runs on the config, before a checkpoint is opened."""
    from engine import engine_builder
    from engine.config import EngineConfig

    monkeypatch.delenv(CUDA_BACKEND_ENV, raising=False)
    monkeypatch.setattr(engine_builder, "resolve_engine_config", lambda config: config)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    config = EngineConfig(model="/nonexistent/model", device="cuda", dtype="bfloat16", tensor_parallel_size=2,
                          num_kv_blocks=64)
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        engine_builder.build_engine_parts(config)


def test_graphs_at_tp2_are_captured_under_nccl_and_off_under_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU needed: the builder's decision, on the config (the capture itself: on CPU,
    tests/engine/kernels/test_tp_decode_graphs.py; over NCCL, the test below with two GPUs)."""
    from types import SimpleNamespace

    from engine import engine_builder
    from engine.config import EngineConfig

    captures: list[dict[str, object]] = []

    class Runner:
        def capture_cuda_graphs(self, **kwargs: object) -> float:
            captures.append(kwargs)
            return 0.5

    config = EngineConfig(model="/nonexistent/model", device="cuda", tensor_parallel_size=2, num_kv_blocks=64,
                          cuda_graph_sizes=[1, 2])
    triton = SimpleNamespace(name="triton")
    monkeypatch.setenv(CUDA_BACKEND_ENV, "gloo")
    assert engine_builder._capture_cuda_graphs(Runner(), config, triton, torch.device("cuda"), 128) is None
    assert captures == []
    monkeypatch.delenv(CUDA_BACKEND_ENV)
    assert engine_builder._capture_cuda_graphs(Runner(), config, triton, torch.device("cuda"), 128) == 0.5
    assert captures == [{"max_seq_len": 128, "sizes": [1, 2]}]


def _check_tp2_matches_tp1(tiny_checkpoint, *, graphs: bool) -> None:  # noqa: ANN001
    """`graphs`: the decode steps replay CUDA graphs on every rank (NCCL), or run eagerly (gloo: not capturable)."""
    pair = Pair(tiny_checkpoint, 2, **CUDA)
    try:
        model = pair.tpn.runner.model
        assert model.local.device.type == "cuda"
        assert (pair.tpn.runner.graphs is not None) == graphs
        first = pair.check({f"r{i}": (p, greedy(6)) for i, p in enumerate(PROMPTS)})  # chunked prefill: 6 a step
        assert all(first.values())
        if graphs:
            assert pair.tpn.runner.graphs.num_replays > 0
        before = pair.tpn.scheduler.num_preemptions
        longer = {f"long{i}": (p, greedy(24)) for i, p in enumerate(PROMPTS)}
        pair.check(longer)
        assert pair.tpn.scheduler.num_preemptions > before  # 20 blocks of 4 tokens: the batch preempts itself
        assert max(len(ids) for ids in prompt_ids(pair.tpn, longer).values()) > ENGINE["max_num_batched_tokens"]
    finally:
        pair.close()
    assert not model.ranks.processes[0].is_alive()


@pytest.mark.gpu
def test_tp2_over_gloo_on_one_gpu_gives_tp1s_tokens(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv(CUDA_BACKEND_ENV, "gloo")  # the child ranks are spawned with this environment
    _check_tp2_matches_tp1(tiny_checkpoint, graphs=False)


@pytest.mark.gpu
def test_tp2_over_nccl_runs_with_two_gpus_and_is_refused_with_one(tiny_checkpoint,  # noqa: ANN001
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CUDA_BACKEND_ENV, raising=False)
    if torch.cuda.device_count() >= 2:
        _check_tp2_matches_tp1(tiny_checkpoint, graphs=True)  # NCCL inside every rank's graphs
        return
    with pytest.raises(ValueError, match="but 1 CUDA device"):
        Pair(tiny_checkpoint, 2, **CUDA)


@pytest.mark.gpu
def test_int8_shards_on_cuda_at_tp2_give_int8_tp1s_tokens(tiny_checkpoint,  # noqa: ANN001
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kernels.quantized_weight import QuantizedWeight

    monkeypatch.setenv(CUDA_BACKEND_ENV, "gloo")
    pair = Pair(tiny_checkpoint, 2, **CUDA, quantization="int8")
    try:
        down = pair.tpn.runner.model.local.layers[0].down
        assert isinstance(down.quantized, QuantizedWeight) and down.on_cuda and down.quantized.data.is_cuda
        pair.check({f"r{i}": (p, greedy(6)) for i, p in enumerate(PROMPTS)})
    finally:
        pair.close()


@pytest.mark.gpu
def test_fp8_shards_on_cuda_at_tp2_within_fp8s_bound(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from tests.engine.test_gpu_quantization import _logprob_diffs
    from tests.engine.tiny_model import make_engine

    monkeypatch.setenv(CUDA_BACKEND_ENV, "gloo")
    reference = make_engine(tiny_checkpoint)  # float32 on the CPU
    engine = make_engine(tiny_checkpoint, **{**CUDA, "dtype": "bfloat16"}, quantization="fp8", tensor_parallel_size=2)
    try:
        assert engine.runner.model.local.layers[0].o.on_cuda
        diffs = _logprob_diffs(reference, engine)
    finally:
        engine.close()
    assert 0 < diffs.max().item() < 1.0 and diffs.mean().item() < 0.3, diffs


@pytest.mark.gpu
@pytest.mark.parametrize(("sender_tp", "receiver_tp", "transport"), [
    (2, 1, "grpc"), (1, 2, "grpc"), (2, 2, "inproc"), (2, 1, "ipc"),
])
def test_handoffs_between_tp_sizes_on_cuda_give_tp1s_tokens(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                                            sender_tp: int, receiver_tp: int, transport: str) -> None:
    """A prompt prefilled at one size on the GPU and decoded at another (each child rank's KV cache reached by rank
    0's worker over CUDA IPC) gives the colocated TP 1 engine's greedy tokens; every block comes back."""
    from kv_transfer.reservation import ReservationSink, ReservationState
    from tests.engine.distributed.test_tp_handoff import ENGINE as HANDOFF_ENGINE
    from tests.engine.distributed.test_tp_handoff import PARAMS, PROMPT
    from tests.engine.kv_harness import hand_off_prompt, steps_until_finished, transfer_link
    from tests.engine.tiny_model import assert_no_blocks_held, drain, make_engine

    monkeypatch.setenv(CUDA_BACKEND_ENV, "gloo")
    config = dict(HANDOFF_ENGINE, device="cuda", dtype="float32")
    reference = make_engine(tiny_checkpoint, **config)
    reference.add_request("ref", PROMPT, PARAMS)
    expected = steps_until_finished(reference, "ref")
    prefill = make_engine(tiny_checkpoint, tensor_parallel_size=sender_tp, **config)
    decode = make_engine(tiny_checkpoint, tensor_parallel_size=receiver_tp, **config)
    try:
        for engine in (prefill, decode):
            assert all(cache.is_cuda for cache, _ in engine.kv_blocks.ranks)
        sink = ReservationSink(decode.kv_blocks.layout, torch.device("cuda"))
        with transfer_link(transport, sink, torch.device("cuda")) as (sender, endpoint):
            reservation, first_token = hand_off_prompt(prefill, decode, sender, sink, endpoint, "r", PROMPT, PARAMS)
        assert reservation.state is ReservationState.COMMITTED
        decode.commit_remote("r", first_token, None)
        assert steps_until_finished(decode, "r") == expected
        for engine in (prefill, decode):
            drain(engine)
            assert_no_blocks_held(engine)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.gpu
@pytest.mark.parametrize(("sender_tp", "receiver_tp", "transport"), [(2, 2, "grpc"), (2, 1, "grpc"), (1, 2, "ipc")])
def test_lanes_on_cuda_give_tp1s_tokens(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
                                        sender_tp: int, receiver_tp: int, transport: str) -> None:
    """A handoff as lanes on the GPU (kv_transfer/rank_lanes.py): each child rank sends its heads from its own cuda
    cache (staged through its own pinned memory) and takes its own into it, no cache mapped into rank 0 on the way;
    the decode engine's tokens are the colocated TP 1 engine's and every block comes back. (torch's NCCL pairs need
    two GPUs: not here.)"""
    from kv_transfer.rank_lanes import send_lanes
    from kv_transfer.reservation import ReservationState
    from tests.engine.distributed.test_tp_lanes import PARAMS, PROMPT, Side, reserve, settle
    from tests.engine.distributed.test_tp_lanes import ENGINE as LANES_ENGINE
    from tests.engine.kv_harness import steps_until_finished
    from tests.engine.tiny_model import assert_no_blocks_held, drain, make_engine

    monkeypatch.setenv(CUDA_BACKEND_ENV, "gloo")
    cuda = torch.device("cuda")
    config = dict(LANES_ENGINE, device="cuda", dtype="float32")
    reference = make_engine(tiny_checkpoint, **config)
    reference.add_request("ref", PROMPT, PARAMS)
    expected = steps_until_finished(reference, "ref")
    prefill = Side(make_engine(tiny_checkpoint, tensor_parallel_size=sender_tp, **config), transport, cuda)
    decode = Side(make_engine(tiny_checkpoint, tensor_parallel_size=receiver_tp, **config), transport, cuda)
    try:
        reservation, handoff, block_ids = reserve(prefill, decode, "r")
        try:
            send_lanes(handoff, own=prefill.own, block_ids=block_ids, endpoints=decode.endpoints,
                       sender=prefill.sender, ranks=prefill.lanes, timeout_s=60)
            assert reservation.done.wait(10) and reservation.state is ReservationState.COMMITTED, reservation.error
        finally:
            settle(prefill, decode, "r", reservation)
        decode.engine.commit_remote("r", expected[0], None)
        assert steps_until_finished(decode.engine, "r") == expected
        for side in (prefill, decode):
            drain(side.engine)
            assert_no_blocks_held(side.engine)
    finally:
        prefill.close()
        decode.close()


@pytest.mark.gpu
@pytest.mark.parametrize("tier", ["disk", "host"])
def test_a_returning_turn_at_tp2_on_cuda_loads_every_ranks_heads_from_a_tier(tiny_checkpoint, tmp_path,  # noqa: ANN001
                                                                            monkeypatch: pytest.MonkeyPatch,
                                                                            tier: str) -> None:
    """Issue 35 at TP > 1 on a GPU: an evicted block goes down with every head, rank 0 reading the child's over CUDA
    IPC, and comes back into every rank's device cache (kv_transfer/whole_blocks.py synchronizing its writes before
    the next step): the returning turn answers as the TP 1 engine does without a tier, its history bit for bit."""
    from tests.engine.distributed.test_tp_kv_tier import check_returning_turn_loads_every_ranks_heads
    from tests.engine.test_kv_tier import TIER, _engine, _returning_chat

    monkeypatch.setenv(CUDA_BACKEND_ENV, "gloo")
    on_gpu = dict(device="cuda", dtype="float32")
    expected = _returning_chat(_engine(tiny_checkpoint, **on_gpu))
    where = dict(tier_dir=tmp_path) if tier == "disk" else dict(kv_offload_memory_bytes=TIER["kv_offload_size_bytes"])
    engine = _engine(tiny_checkpoint, **where, **on_gpu, tensor_parallel_size=2)
    assert all(cache.is_cuda for cache, _ in engine.kv_blocks.ranks)
    check_returning_turn_loads_every_ranks_heads(engine, expected, tier)
