"""The scheduler test harness: a fake model, request and scheduler builders, exact-state checks."""

from __future__ import annotations

from collections.abc import Callable


from engine.core.block_pool import BlockPool
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.request.sampling_params import SamplingParams
from kv_transfer.block_hash import BlockHashNamespace
from kv_transfer.layout import cdiv

AllFree = Callable[[BlockPool], None]

B = 4  # block size
EOS = 0
NS = BlockHashNamespace(model="test-model", block_size=B, kv_dtype="float16")

Trace = list[tuple[str, int, int]]  # (request id, start, num_new_tokens) per scheduled request, in order


class FakeModel:
    """Samples `tokens[request_id]` (default 7) for every request whose step reaches the end of its tokens; a
    scripted request emits its script in order, then the default."""

    def __init__(self, tokens: dict[str, int] | None = None, scripts: dict[str, list[int]] | None = None) -> None:
        self.tokens = tokens or {}
        self.scripts = {rid: list(s) for rid, s in (scripts or {}).items()}

    def __call__(self, out: SchedulerOutput) -> dict[str, list[int]]:
        sampled = {}
        for item in out.scheduled:
            if item.samples:
                rid = item.request.request_id
                script = self.scripts.get(rid)
                sampled[rid] = [script.pop(0) if script else self.tokens.get(rid, 7)]
        return sampled


def make_scheduler(
    *,
    num_blocks: int = 16,
    max_num_seqs: int = 128,
    max_num_batched_tokens: int = 2048,
    max_model_len: int = 8192,
    prefix_caching: bool = True,
    policy: str = "fcfs",
) -> tuple[Scheduler, BlockPool]:
    pool = BlockPool(num_blocks)
    kv = KVCacheManager(pool, block_size=B, enable_prefix_caching=prefix_caching)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
        policy=policy,
    )
    return Scheduler(config, kv), pool


def make_request(request_id: str, prompt: list[int], *, max_tokens: int = 4, **params: object) -> Request:
    sampling_params = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    sampling_params.validate()
    return Request(
        request_id, prompt, sampling_params, eos_token_ids=(EOS,), max_tokens=max_tokens, hash_namespace=NS
    )


def prompt(n: int, first: int = 100) -> list[int]:
    return list(range(first, first + n))


def check_ref_counts(scheduler: Scheduler, pool: BlockPool) -> None:
    """A block's ref count is the number of block tables holding it; only running, reserved (remote KV), committed
    (remote KV in place, waiting) and held (prefilled, handing off) requests hold blocks."""
    holders = [0] * pool.num_blocks
    for rid in [*scheduler.requests, *scheduler.held]:
        for block_id in scheduler.kv_cache.block_ids(rid):
            holders[block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == holders
    for request in scheduler.waiting:
        if request.kv_in_place:  # exactly the blocks its computed tokens and its next token need; a forked
            # choice (n > 1) exactly the full prompt blocks it shares, the rest of its prompt still to compute
            bs = scheduler.kv_cache.block_size
            computed = request.num_computed_tokens
            num_blocks = computed // bs if request.num_output_tokens == 0 else cdiv(computed + 1, bs)
            assert len(scheduler.kv_cache.block_ids(request.request_id)) == num_blocks
        else:
            assert scheduler.kv_cache.block_ids(request.request_id) == []


def step(scheduler: Scheduler, model: FakeModel) -> tuple[Trace, SchedulerOutput, list[tuple[str, int]]]:
    out = scheduler.schedule()
    assert out.num_batched_tokens <= scheduler.config.max_num_batched_tokens
    trace = [(s.request.request_id, s.start, s.num_new_tokens) for s in out.scheduled]
    produced = scheduler.update_from_output(out, model(out))
    check_ref_counts(scheduler, scheduler.kv_cache.pool)
    return trace, out, [(r.request_id, t) for r, t in produced]


def run(scheduler: Scheduler, model: FakeModel, max_steps: int = 1000) -> list[Trace]:
    traces = []
    while scheduler.has_unfinished_requests():
        assert len(traces) < max_steps, "workload did not finish"
        trace, _, _ = step(scheduler, model)
        traces.append(trace)
    return traces
