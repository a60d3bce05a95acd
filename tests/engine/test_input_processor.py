"""The input processor on its own, without an engine or a model: the requests it makes, the choices of n > 1,
the grammar cache handed over once, and no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from engine.request.sampling_params import SamplingParams
from engine.input_processor import InputProcessor
from engine.request.grammar_spec import GrammarSpec
from kv_transfer.block_hash import BlockHashNamespace
from tests.engine.structured.tiny_vocab import EOS_ID, VOCAB_SIZE, TinyTokenizer

REPO_ROOT = Path(__file__).resolve().parents[2]


def _inputs(handed: list[object], *, max_model_len: int = 16) -> InputProcessor:
    namespace = BlockHashNamespace(model="tiny", block_size=4, kv_dtype="float32")
    return InputProcessor(TinyTokenizer(), vocab_size=VOCAB_SIZE, max_model_len=max_model_len,  # type: ignore[arg-type]
                          hash_namespace=namespace, use_grammars=handed.append)


def test_a_request_with_choices_and_its_room_to_generate() -> None:
    inputs = _inputs([])
    request = inputs.make_request("r", [1, 2, 3], SamplingParams(n=3, max_tokens=100))
    assert [request.request_id, *(c.request_id for c in request.pending_forks)] == ["r", "r#1", "r#2"]
    assert [c.index for c in request.pending_forks] == [1, 2] and request.pending_forks[0].pending_forks == []
    assert request.max_tokens == 16 - 3  # capped at what max_model_len leaves
    assert request.eos_token_ids == (EOS_ID,)
    assert len(inputs.make_request("h", list(range(8)), SamplingParams()).block_hashes) == 2  # hashed: 2 full blocks
    remote = inputs.make_request("p", [1, 2, 3], SamplingParams(n=3), remote_decode=True)
    assert remote.remote_decode and remote.pending_forks == []  # the decode worker forks the other choices


@pytest.mark.parametrize(("prompt", "params", "message"), [
    ([], SamplingParams(), "prompt is empty"),
    ([1, VOCAB_SIZE], SamplingParams(), rf"prompt token ids out of range \[0, {VOCAB_SIZE}\): \[{VOCAB_SIZE}\]"),
    ([1.5], SamplingParams(), "a prompt is text or a sequence of integer token ids"),
    ([1, 2], SamplingParams(logit_bias={VOCAB_SIZE: 1.0}), "logit_bias token ids out of range"),
    (list(range(16)), SamplingParams(), "prompt has 16 tokens, which leaves no room to generate"),
])
def test_a_bad_input_is_a_value_error_naming_it(prompt: list, params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _inputs([]).make_request("bad", prompt, params)


def test_the_grammar_cache_is_made_with_the_first_grammar_and_handed_over_once() -> None:
    handed: list[object] = []
    inputs = _inputs(handed)
    inputs.make_request("plain", [1, 2], SamplingParams())
    assert handed == []  # xgrammar is not loaded for requests without a grammar
    for name in ("a", "b"):
        inputs.make_request(name, [1, 2], SamplingParams(structured_outputs=GrammarSpec(kind="regex", source="a+")))
    assert handed == [inputs.grammar_compilers()]
    with pytest.raises(ValueError, match="invalid json_schema"):
        inputs.make_request("c", [1, 2], SamplingParams(structured_outputs=GrammarSpec(kind="json_schema",
                                                                                       source='{"type": "objec"}')))


def test_the_input_processor_does_not_import_torch() -> None:
    code = "import sys, engine.input_processor\nprint('torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True,
                            timeout=120)
    assert result.stdout.strip() == "False"
