"""Structured outputs in the engine: the token bitmask against its torch definition, the sampler under a mask,
the compiler cache (once per spec, LRU, errors that name the problem) and the matchers (replay, drafts, end)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.core.request import Request
from engine.request.sampling_params import SamplingParams
from engine.sampling.rejection_sampler import RejectionSampler, VerifyRequest
from engine.sampling.sampler import Sampler
from engine.structured.bitmask import (
    TokenBitmask,
    apply_token_bitmask,
    apply_token_bitmask_reference,
    pack_bitmask,
    unpack_bitmask,
)
from engine.request.grammar_spec import GrammarSpec
from engine.structured.compiler import GrammarCompilerCache
from engine.structured.matchers import GrammarMatchers
from tests.engine.sampling.helpers import make_row
from tests.engine.structured.tiny_vocab import EOS_ID, VOCAB_SIZE, TinyTokenizer, byte_ids, token_id


def random_allowed(num_rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(num_rows, vocab_size, generator=generator) < 0.3  # [num_rows, vocab_size] bool


# --- the bitmask ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab_size", [32, 1000, 49152 + 7])
def test_pack_and_unpack_are_inverse(vocab_size: int) -> None:
    allowed = random_allowed(5, vocab_size, seed=vocab_size)
    packed = pack_bitmask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (5, (vocab_size + 31) // 32)
    assert torch.equal(unpack_bitmask(packed, vocab_size), allowed)


def test_pack_matches_xgrammar_layout() -> None:
    """Token t is bit t % 32 of word t // 32 (bit 31 is the int32's sign)."""
    allowed = torch.zeros(1, 64, dtype=torch.bool)
    allowed[0, [0, 31, 33]] = True
    assert pack_bitmask(allowed).tolist() == [[1 | -(2**31), 2]]


@pytest.mark.parametrize("row_indices", [[0, 1, 2, 3, 4, 5], [1, 4], [5, 0, 3]])
def test_kernel_equals_the_torch_reference(row_indices: list[int]) -> None:
    vocab_size = 1000  # not a multiple of 32
    logits = torch.randn(6, vocab_size, generator=torch.Generator().manual_seed(1))
    mask = TokenBitmask(bitmask=pack_bitmask(random_allowed(len(row_indices), vocab_size, seed=2)),
                        row_indices=row_indices)
    expected = logits.clone()
    apply_token_bitmask_reference(expected, mask)
    got = logits.clone()
    apply_token_bitmask(got, mask)
    assert torch.equal(got, expected)
    untouched = [r for r in range(6) if r not in row_indices]
    assert torch.equal(got[untouched], logits[untouched])
    assert (got[row_indices] == float("-inf")).any()


def test_sampler_picks_only_allowed_tokens_and_leaves_logits_untouched() -> None:
    vocab_size = 300
    logits = torch.randn(4, vocab_size, generator=torch.Generator().manual_seed(3)) * 3
    before = logits.clone()
    allowed = random_allowed(3, vocab_size, seed=4)
    mask = TokenBitmask(bitmask=pack_bitmask(allowed), row_indices=[0, 2, 3])
    rows = [make_row(SamplingParams(temperature=0.0)), make_row(SamplingParams(temperature=0.0)),
            make_row(SamplingParams(temperature=1.0, seed=5)), make_row(SamplingParams(temperature=0.7, top_k=50))]
    reference = logits.clone()
    apply_token_bitmask_reference(reference, mask)
    for _ in range(20):
        out = Sampler(seed=6).sample(logits, rows, mask)
        assert out.token_ids[0] == int(reference[0].argmax())  # greedy: the best allowed token
        assert out.token_ids[1] == int(logits[1].argmax())  # unconstrained row
        assert allowed[1, out.token_ids[2]] and allowed[2, out.token_ids[3]]
    assert torch.equal(logits, before)



def test_the_grammar_has_the_last_word_over_logit_bias() -> None:
    """The bitmask comes after logit_bias (and the penalties): +100 on a rejected token cannot bring it back,
    while a bias among the allowed tokens still picks among them."""
    vocab_size = 64
    logits = torch.zeros(2, vocab_size)
    allowed = torch.zeros(2, vocab_size, dtype=torch.bool)
    allowed[:, 10:20] = True
    mask = TokenBitmask(bitmask=pack_bitmask(allowed), row_indices=[0, 1])
    rows = [make_row(SamplingParams(temperature=0.0, logit_bias={3: 100.0, 15: 5.0}, repetition_penalty=1.5),
                     output=[15]),
            make_row(SamplingParams(temperature=1.0, seed=1, logit_bias={40: 100.0}))]
    for _ in range(10):
        out = Sampler(seed=2).sample(logits, rows, mask)
        assert out.token_ids[0] == 15  # biased and allowed; 3 is biased more but rejected
        assert 10 <= out.token_ids[1] < 20


# --- compiler and matchers on a tiny vocabulary ----------------------------------------------------------------


@pytest.fixture(scope="module")
def compilers() -> GrammarCompilerCache:
    return GrammarCompilerCache(TinyTokenizer(), vocab_size=VOCAB_SIZE, max_entries=2)  # type: ignore[arg-type]


def request_with(spec: GrammarSpec, output: list[int], request_id: str = "r", stop_token_ids: list[int] | None = None
                 ) -> Request:
    params = SamplingParams(structured_outputs=spec, stop_token_ids=stop_token_ids or [])
    request = Request(request_id, [1, 2, 3], params, eos_token_ids=(EOS_ID,), max_tokens=64, hash_namespace=None)
    for token in output:
        request.append_output_token(token)
    return request


def allowed_of(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    return set(torch.nonzero(unpack_bitmask(bitmask[row : row + 1], VOCAB_SIZE)[0]).flatten().tolist())


def test_a_spec_compiles_once_and_the_cache_is_lru(compilers: GrammarCompilerCache) -> None:
    a, b, c = (GrammarSpec(kind="regex", source=r) for r in ("a+", "b+", "c+"))
    start = compilers.num_compiled
    first = compilers.compile(a)
    assert compilers.compile(GrammarSpec(kind="regex", source="a+")) is first  # equal specs share an entry
    compilers.compile(b)
    compilers.compile(a)  # a is now the most recent: c evicts b
    compilers.compile(c)
    assert compilers.num_compiled == start + 3
    compilers.compile(a)
    assert compilers.num_compiled == start + 3
    compilers.compile(b)
    assert compilers.num_compiled == start + 4


@pytest.mark.parametrize(("spec", "message"), [
    (GrammarSpec(kind="json_schema", source='{"type": "objec"}'), r"invalid json_schema: .*objec"),
    (GrammarSpec(kind="json_schema", source='{"type": '), r"json_schema is not valid JSON"),
    (GrammarSpec(kind="regex", source="a(b"), r"invalid regex: .*parenthesis"),
    (GrammarSpec(kind="grammar", source="root ::= foo"), r"invalid grammar: .*foo"),
    (GrammarSpec(kind="choice", source="[]"), r"choice must be a non-empty list"),
])
def test_a_bad_spec_is_a_value_error_naming_the_problem(compilers: GrammarCompilerCache, spec: GrammarSpec,
                                                        message: str) -> None:
    with pytest.raises(ValueError, match=message) as error:
        compilers.compile(spec)
    assert ".cc:" not in str(error.value)  # xgrammar's C++ location is dropped


def test_the_matcher_replays_the_output_so_far(compilers: GrammarCompilerCache) -> None:
    """A matcher made after some tokens (a decode worker after the handoff) masks as one that saw them."""
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    prefix = [token_id('{"')] + byte_ids('ok')
    late = GrammarMatchers(compilers)
    late_mask = late.fill([request_with(spec, prefix)], [0]).bitmask
    live = GrammarMatchers(compilers)
    request = request_with(spec, [])
    live.fill([request], [0])
    for token in prefix:
        request.append_output_token(token)
        step = live.fill([request], [0]).bitmask
    assert torch.equal(step, late_mask)
    assert allowed_of(late_mask) == {ord('"'), token_id('":')}
    # the rest of the object, then only EOS; the EOS terminates it, and later rows allow only EOS again
    for token in [token_id('":'), ord(" "), token_id("true"), token_id("}")]:
        request.append_output_token(token)
    assert allowed_of(live.fill([request], [0]).bitmask) == {EOS_ID}
    request.append_output_token(EOS_ID)
    assert allowed_of(live.fill([request], [0]).bitmask) == {EOS_ID}
    live.release("r")
    assert live.num_requests == 0


def test_stop_token_ids_end_the_grammar_too(compilers: GrammarCompilerCache) -> None:
    request = request_with(GrammarSpec.choice(["ab"]), [token_id("ab")], stop_token_ids=[7])
    assert allowed_of(GrammarMatchers(compilers).fill([request], [0]).bitmask) == {EOS_ID, 7}


def test_drafts_are_cut_at_the_first_token_the_grammar_rejects(compilers: GrammarCompilerCache) -> None:
    matchers = GrammarMatchers(compilers)
    request = request_with(GrammarSpec.choice(["abc", "abd"]), [ord("a")])
    bitmask = matchers.allocate(8)
    # after "a": "b" is fine, "x" is not; the rows are the states before b, and before x (the recovery)
    assert matchers.fill_with_drafts(request, [ord("b"), ord("x"), ord("c")], bitmask, 2) == 1
    assert allowed_of(bitmask, 2) == {ord("b")}
    assert allowed_of(bitmask, 3) == {ord("c"), ord("d")}
    assert allowed_of(bitmask, 4) == set(range(VOCAB_SIZE))  # not filled
    # all accepted: one row per draft and one for the bonus token; the matcher is back at the real output
    assert matchers.fill_with_drafts(request, [ord("b"), ord("d")], bitmask, 5) == 2
    assert allowed_of(bitmask, 7) == {EOS_ID}
    assert allowed_of(matchers.fill([request], [0]).bitmask) == {ord("b")}


def test_the_rejection_sampler_never_emits_a_grammar_rejected_draft(compilers: GrammarCompilerCache) -> None:
    """Greedy logits that favour the draft everywhere: the grammar's mask makes its own choice win at the cut."""
    matchers = GrammarMatchers(compilers)
    request = request_with(GrammarSpec(kind="regex", source="a[bc]d"), [ord("a")])
    drafts = [ord("b"), ord("x"), ord("d")]
    bitmask = matchers.allocate(4)
    num_kept = matchers.fill_with_drafts(request, drafts, bitmask, 0)
    assert num_kept == 1
    logits = torch.zeros(num_kept + 1, VOCAB_SIZE)
    for position, token in enumerate(drafts[: num_kept + 1]):
        logits[position, token] = 10.0
    logits[1, ord("d")] = 1.0  # the best token the grammar allows after "ab"
    rows = [make_row(SamplingParams(temperature=0.0)) for _ in range(num_kept + 1)]
    mask = TokenBitmask(bitmask=bitmask[: num_kept + 1], row_indices=list(range(num_kept + 1)))
    [result] = RejectionSampler(Sampler()).verify(
        logits, [VerifyRequest(rows=rows, draft_token_ids=drafts[:num_kept])], mask)
    assert result.token_ids == [ord("b"), ord("d")]


def test_json_object_and_choice_specs(compilers: GrammarCompilerCache) -> None:
    matchers = GrammarMatchers(compilers)
    json_object = request_with(GrammarSpec(kind="json_object"), [], request_id="j")
    assert token_id('{"') in allowed_of(matchers.fill([json_object], [0]).bitmask)
    assert ord("[") not in allowed_of(matchers.fill([json_object], [0]).bitmask)
    choice = request_with(GrammarSpec.choice(["ab", "x\"y"]), [ord("x")], request_id="c")
    assert allowed_of(matchers.fill([choice], [0]).bitmask) == {ord('"')}


def test_grammar_spec_validation() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        GrammarSpec(kind="xml", source="x").validate()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="regex is empty"):
        SamplingParams(structured_outputs=GrammarSpec(kind="regex")).validate()
    assert json.loads(GrammarSpec.json_schema({"b": 1, "a": 2}).source) == {"b": 1, "a": 2}
    GrammarSpec(kind="json_object").validate()


def test_the_spec_crosses_processes_in_the_proto() -> None:
    from engine.request.wire import sampling_params_from_proto, sampling_params_to_proto

    spec = GrammarSpec.choice(["yes", "no"])
    params = sampling_params_from_proto(sampling_params_to_proto(SamplingParams(structured_outputs=spec)))
    assert params.structured_outputs == spec
    assert sampling_params_from_proto(sampling_params_to_proto(SamplingParams())).structured_outputs is None


def test_a_batch_fills_as_its_rows_one_by_one(compilers: GrammarCompilerCache) -> None:
    specs = [GrammarSpec.choice(["abc", "abd"]), GrammarSpec(kind="regex", source="a[xy]+"), GrammarSpec.choice(["ab"])]
    outputs = [[ord("a")], [ord("a"), ord("x")], [token_id("ab"), EOS_ID]]  # the last one is terminated
    requests = [request_with(spec, out, request_id=f"b{i}") for i, (spec, out) in enumerate(zip(specs, outputs))]
    batch = GrammarMatchers(compilers).fill(requests, [4, 1, 2])
    assert batch.row_indices == [4, 1, 2]
    for i, request in enumerate(requests):
        alone = GrammarMatchers(compilers).fill([request], [0]).bitmask
        assert torch.equal(batch.bitmask[i], alone[0])
