"""Draft tokens in the scheduler: extra tokens of a decoding request, within the budget left by real tokens, rolled
back when rejected (blocks only they used freed, never cached)."""

from __future__ import annotations

import pytest

from tests.engine.core.scheduler_harness import check_ref_counts, make_request, make_scheduler, prompt


def _decoding(scheduler, request_id: str, n: int = 6, max_tokens: int = 10):  # noqa: ANN001, ANN202
    request = make_request(request_id, prompt(n, 100 if request_id == "a" else 200), max_tokens=max_tokens)
    scheduler.add_request(request)
    return request


def _prefill_all(scheduler) -> None:  # noqa: ANN001
    out = scheduler.schedule()
    scheduler.update_from_output(out, {s.request.request_id: [7] for s in out.scheduled if s.samples})


def test_drafts_are_extra_tokens_and_accepted_ones_are_computed() -> None:
    scheduler, pool = make_scheduler()
    a = _decoding(scheduler, "a")
    _prefill_all(scheduler)  # a: 6 prompt tokens computed, output [7]
    a.spec_token_ids = [8, 9, 10, 11]
    out = scheduler.schedule()
    [item] = out.scheduled
    assert (item.start, item.num_new_tokens, item.spec_token_ids) == (6, 5, [8, 9, 10, 11])
    assert item.num_sample_positions == 5
    assert len(item.block_ids) == 3  # positions 6..10
    produced = scheduler.update_from_output(out, {"a": [8, 9, 42]})  # two accepted, then the target's own token
    assert [t for _, t in produced] == [8, 9, 42]
    assert a.output_token_ids == [7, 8, 9, 42]
    assert a.num_computed_tokens == 9  # prompt, 7, 8, 9: the KV of the rejected drafts 10, 11 is not counted
    assert a.spec_token_ids == []
    assert (a.spec.num_drafts, a.spec.num_draft_tokens, a.spec.num_accepted_tokens) == (1, 4, 2)
    assert a.spec.num_accepted_tokens_per_pos == [1, 1, 0, 0]
    assert len(scheduler.kv_cache.block_ids("a")) == 3
    assert pool.num_cached_blocks == 2  # [100..103], [104, 105, 7, 8]
    check_ref_counts(scheduler, pool)


def test_rejected_drafts_free_their_blocks_and_are_never_cached() -> None:
    scheduler, pool = make_scheduler()
    a = _decoding(scheduler, "a")
    _prefill_all(scheduler)
    a.spec_token_ids = [8, 9, 10, 11]
    out = scheduler.schedule()
    table = out.scheduled[0].block_ids
    assert len(table) == 3
    scheduler.update_from_output(out, {"a": [50]})  # the first draft rejected
    assert a.num_computed_tokens == 7
    assert scheduler.kv_cache.block_ids("a") == table[:2]  # block 2 held only rejected drafts: freed
    assert pool.blocks[table[2]].ref_cnt == 0
    # Block 1 holds 104, 105, 7 and the rejected draft 8 in its last slot: not cached until recomputed as 50.
    assert pool.num_cached_blocks == 1
    out = scheduler.schedule()
    assert [(s.start, s.num_new_tokens) for s in out.scheduled] == [(7, 1)]
    scheduler.update_from_output(out, {"a": [51]})
    assert pool.num_cached_blocks == 2
    assert pool.blocks[table[1]].block_hash == a.block_hashes[1]  # the hash of [104, 105, 7, 50]
    check_ref_counts(scheduler, pool)
    scheduler.abort_requests(["a"])
    assert pool.num_free_blocks == pool.num_blocks


def test_drafts_get_only_the_budget_left_and_never_preempt() -> None:
    scheduler, pool = make_scheduler(max_num_batched_tokens=12, num_blocks=7)
    a, b = _decoding(scheduler, "a"), _decoding(scheduler, "b")
    _prefill_all(scheduler)  # 12 tokens, 4 blocks
    a.spec_token_ids, b.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8], [4, 5, 6]
    out = scheduler.schedule()
    # 2 real tokens, 10 left: a takes 8 drafts, b the last 2. Blocks: a positions 6..14 (4), b 6..8 (3): all 7.
    assert [(s.request.request_id, s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [
        ("a", 9, [1, 2, 3, 4, 5, 6, 7, 8]), ("b", 3, [4, 5])
    ]
    assert pool.num_free_blocks == 0
    scheduler.update_from_output(out, {"a": [1, 2, 3, 99], "b": [9]})
    check_ref_counts(scheduler, pool)
    assert [len(scheduler.kv_cache.block_ids(r)) for r in "ab"] == [3, 2]  # computed 10 and 7 tokens
    assert pool.num_free_blocks == 2
    a.spec_token_ids, b.spec_token_ids = [5, 6, 7, 8], [9] * 5
    out = scheduler.schedule()
    # a's drafts take one more block, the last free one; b's would need two more: b decodes without drafts.
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 5), ("b", 1)]
    assert scheduler.num_preemptions == 0 and out.preempted == []
    scheduler.update_from_output(out, {"a": [5], "b": [9]})
    check_ref_counts(scheduler, pool)
    scheduler.abort_requests(["a", "b"])
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize(("max_tokens", "max_model_len", "num_drafts"), [(10, 100, 4), (3, 100, 1), (10, 9, 1)])
def test_drafts_are_cut_to_what_the_request_can_still_produce(
    max_tokens: int, max_model_len: int, num_drafts: int
) -> None:
    scheduler, pool = make_scheduler(max_model_len=max_model_len)
    a = _decoding(scheduler, "a", max_tokens=max_tokens)
    _prefill_all(scheduler)  # 7 tokens, 1 output
    a.spec_token_ids = [8, 9, 10, 11]
    out = scheduler.schedule()
    assert out.scheduled[0].spec_token_ids == [8, 9, 10, 11][:num_drafts]
    produced = scheduler.update_from_output(out, {"a": [8, 9, 10, 11, 12][: num_drafts + 1]})
    assert len(produced) == num_drafts + 1
    assert a.num_output_tokens <= max_tokens and a.num_tokens <= max_model_len


def test_a_stop_token_among_accepted_drafts_drops_the_rest() -> None:
    scheduler, pool = make_scheduler()
    a = _decoding(scheduler, "a")
    _prefill_all(scheduler)
    a.spec_token_ids = [8, 0, 10]  # 0 is EOS
    out = scheduler.schedule()
    produced = scheduler.update_from_output(out, {"a": [8, 0, 10, 11]})
    assert [t for _, t in produced] == [8, 0]
    assert a.output_token_ids == [7, 8, 0] and a.status.finish_reason == "stop"
    assert pool.num_free_blocks == pool.num_blocks
