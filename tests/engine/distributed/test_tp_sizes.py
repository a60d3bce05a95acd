"""Which tensor-parallel sizes a model takes and what each rank holds: pure arithmetic
(engine/distributed/tp_sizes.py), and the KV layout that carries it."""

from __future__ import annotations

import pytest

from engine.distributed.tp_sizes import TensorParallelSizeError, check_tp_size, valid_tp_sizes

SMOLLM2 = dict(num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152, model_name="smollm2-135m")
LLAMA_1B = dict(num_heads=32, num_kv_heads=8, intermediate_size=8192, vocab_size=128256, model_name="llama-3.2-1b")


def test_smollm2_splits_three_ways() -> None:
    shape = check_tp_size(tp_size=3, **SMOLLM2)
    assert [shape.head_range(r) for r in range(3)] == [range(0, 3), range(3, 6), range(6, 9)]
    assert [shape.kv_head_range(r) for r in range(3)] == [range(0, 1), range(1, 2), range(2, 3)]
    assert [shape.intermediate_range(r) for r in range(3)] == [range(0, 512), range(512, 1024), range(1024, 1536)]
    assert [shape.vocab_range(r) for r in range(3)] == [range(0, 16384), range(16384, 32768), range(32768, 49152)]
    assert valid_tp_sizes(9, 3, 1536) == [1, 3]  # 9 does not divide the intermediate size 1536


@pytest.mark.parametrize(("tp", "kv_ranges"), [
    (2, [range(0, 4), range(4, 8)]),
    (4, [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]),
    (16, [range(r // 2, r // 2 + 1) for r in range(16)]),  # each KV head on two ranks
])
def test_llama_1b_kv_heads_split_or_replicate(tp: int, kv_ranges: list[range]) -> None:
    shape = check_tp_size(tp_size=tp, **LLAMA_1B)
    assert [shape.kv_head_range(r) for r in range(tp)] == kv_ranges
    assert shape.kv_replicated == (tp > 8)
    # Every rank's query heads read only its own KV heads (GQA groups of 4 query heads).
    for rank in range(tp):
        groups = {h // 4 for h in shape.head_range(rank)}
        assert groups <= set(shape.kv_head_range(rank))


def test_a_padded_vocabulary_slice() -> None:
    shape = check_tp_size(tp_size=4, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=702)
    assert shape.vocab_shard_size == 176
    assert [shape.vocab_range(r) for r in range(4)] == [range(0, 176), range(176, 352), range(352, 528),
                                                         range(528, 702)]


@pytest.mark.parametrize(("tp", "match"), [
    (2, "does not divide the query heads: smollm2-135m has 9 query heads and 3 KV heads; sizes it takes: 1, 3"),
    (9, "does not divide the MLP's intermediate size 1536"),
])
def test_smollm2_refuses_sizes_naming_its_heads(tp: int, match: str) -> None:
    with pytest.raises(TensorParallelSizeError, match=match):
        check_tp_size(tp_size=tp, **SMOLLM2)


def test_kv_heads_neither_divisible_nor_dividing_are_refused() -> None:
    with pytest.raises(TensorParallelSizeError, match="neither divides the KV heads nor is a multiple of them: "
                                                      "m has 12 query heads and 4 KV heads"):
        check_tp_size(tp_size=6, num_heads=12, num_kv_heads=4, intermediate_size=96, vocab_size=10, model_name="m")


def test_engine_config_refuses_a_nonpositive_size() -> None:
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="tensor_parallel_size must be positive"):
        EngineConfig(tensor_parallel_size=0)


def test_the_kv_layout_names_each_ranks_heads_and_travels() -> None:
    from kv_transfer.layout import KVLayout

    layout = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, dtype="float32",
                      tensor_parallel_size=4)
    shape = check_tp_size(tp_size=4, **LLAMA_1B)
    assert [layout.kv_head_range(r) for r in range(4)] == [shape.kv_head_range(r) for r in range(4)]
    assert KVLayout.from_proto(layout.to_proto()) == layout
    tp1 = KVLayout(num_layers=16, num_kv_heads=8, head_dim=64, block_size=16, dtype="float32")
    with pytest.raises(Exception, match="tensor_parallel_size: ours 4, peer's 1"):
        layout.check_compatible(tp1)


def test_serve_sizes_each_pool_apart(tmp_path) -> None:  # noqa: ANN001
    from deploy.cli import build_parser
    from deploy.serve_args import controller_config_from_args

    def serve(*flags: str):  # noqa: ANN202
        return controller_config_from_args(build_parser().parse_args(
            ["serve", "--model", str(tmp_path), "--no-prefix-index", *flags]))

    assert serve("--tensor-parallel-size", "2", "--colocated").engine.tensor_parallel_size == 2
    common = serve("--tensor-parallel-size", "2")
    assert [common.engine_for(role).tensor_parallel_size for role in ("prefill", "decode")] == [2, 2]
    apart = serve("--prefill-tensor-parallel-size", "3", "--decode-tensor-parallel-size", "1", "--num-threads", "1")
    assert [apart.engine_for(role).tensor_parallel_size for role in ("prefill", "decode")] == [3, 1]
    assert apart.engine.tensor_parallel_size == 1
    with pytest.raises(ValueError, match="--decode-tensor-parallel-size must be at least 1, got 0"):
        serve("--decode-tensor-parallel-size", "0")
    with pytest.raises(ValueError, match="--prefill-tensor-parallel-size sizes a prefill pool; --colocated runs none"):
        serve("--prefill-tensor-parallel-size", "2", "--colocated")


def test_a_worker_asks_ray_for_a_cpu_share_and_a_gpu_per_rank() -> None:
    from deploy.placement import host_actor_options

    options = host_actor_options(["decode"], cluster_resources={}, reserve_devices=True, num_threads=2,
                                 device="cuda", ranks=[4])
    assert (options["num_cpus"], options["num_gpus"]) == (8, 4)
    assert host_actor_options(["prefill"], cluster_resources={}, reserve_devices=True, num_threads=2,
                              device="cpu")["num_cpus"] == 2
