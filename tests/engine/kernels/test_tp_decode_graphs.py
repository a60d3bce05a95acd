"""The decode step's graphs at tensor_parallel_size 2 (engine/cuda_graphs.py with a TensorParallelModel as its peers):
rank 0 has each child capture the same buckets in the same order, and every replay sends the children the step's
inputs (async scheduling's placeholders resolved) before rank 0 replays its own, so the collectives inside meet.

On CPU a bucket's "graph" is its eager step over the same static buffers (cuda_graphs._EagerReplay): everything but
the capture itself runs here, the ranks' collectives included. A child that replayed other inputs than rank 0's
would sum other partial products (wrong tokens, or logits off by more than 1e-3); one that missed a replay would leave
rank 0's all-reduce waiting. Over NCCL on two GPUs the real capture runs in
tests/engine/distributed/test_tensor_parallel_cuda.py (not on the one-GPU machines lent here). Here, under
TRITON_INTERPRET (tests/engine/kernels/conftest.py), the child ranks inherit the interpreter.
"""

from __future__ import annotations

import pytest
import torch

from engine.distributed import step_message
from tests.engine.distributed.test_tensor_parallel import ENGINE, Pair
from tests.engine.tiny_model import PROMPTS, greedy

pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("torch_single_thread")

# The Triton backend (interpreted on CPU) is the one the engine captures: a padding row (slot -1, length 0) writes
# no block and reads none. Six prompts decode in buckets of 4 and 8, fewer as they finish or preempt each other.
GRAPHS = dict(ENGINE, attention_backend="triton", num_kv_blocks=40, max_num_seqs=8)
SIZES = [1, 2, 4, 8]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_tp2_graph_replays_give_tp1s_tokens(tiny_checkpoint, device, async_scheduling: bool) -> None:  # noqa: ANN001
    if device.type == "cuda":
        pytest.skip("CPU stand-in only (the Triton kernels compile for the GPU there, and gloo cannot be captured)")
    pair = Pair(tiny_checkpoint, 2, **GRAPHS, async_scheduling=async_scheduling)
    try:
        for engine in (pair.tp1, pair.tpn):
            engine.runner.capture_cuda_graphs(max_seq_len=engine.max_model_len, sizes=SIZES)
        graphs = pair.tpn.runner.graphs
        assert graphs.peers is pair.tpn.runner.model and graphs.model is pair.tpn.runner.model.local
        pair.check({f"r{i}": (p, greedy(8)) for i, p in enumerate(PROMPTS)})
        assert graphs.num_replays >= 7  # the decode steps went through the buffers, on every rank
        pair.check({"again": (PROMPTS[1], greedy(5))})  # a bucket of 1, after the larger ones
        assert pair.tpn.runner.model.ranks.dead() is None
    finally:
        pair.close()


def test_replay_messages_carry_the_inputs_and_stay_on_the_host() -> None:
    ids = torch.tensor([5, 9], dtype=torch.int64)
    tables = torch.tensor([[3, 4, 0], [7, 8, 9]], dtype=torch.int64)
    message = step_message.Replay(ids, torch.tensor([6, 10]), torch.tensor([17, 37]), tables)
    back = step_message.decode(step_message.encode(message), torch.device("meta"))
    assert isinstance(back, step_message.Replay)
    assert back.input_ids.device.type == "cpu" and back.block_tables.device.type == "cpu"
    assert back.input_ids.tolist() == [5, 9] and back.block_tables.tolist() == tables.tolist()
    capture = step_message.decode(step_message.encode(step_message.CaptureGraphs((8, 4, 1), 128, 4)),
                                  torch.device("cpu"))
    assert capture == step_message.CaptureGraphs((8, 4, 1), 128, 4)
