"""A request's own chat template (vLLM's `chat_template` field): refused unless trusted, compiled once per text
(an LRU), a 400 naming the field when it does not parse."""

from __future__ import annotations

import pytest

from engine.tokenizer.tokenizer import Tokenizer
from router import request_chat_template
from router.errors import ApiError
from router.protocol import ChatCompletionRequest
from router.request_chat_template import RequestChatTemplates

MESSAGES = [{"role": "user", "content": "hi"}]


def _chat(template: str | None) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=MESSAGES, chat_template=template)


def test_untrusted_templates_are_refused_and_none_means_the_gateways(tokenizer: Tokenizer) -> None:
    templates = RequestChatTemplates(tokenizer, trusted=False)
    assert templates.tokenizer_for(_chat(None)) is tokenizer
    with pytest.raises(ApiError, match="--trust-request-chat-template") as error:
        templates.tokenizer_for(_chat("{{ messages[0].content }}"))
    assert error.value.status_code == 400 and error.value.param == "chat_template"


def test_trusted_templates_render_compile_once_and_are_bounded(tokenizer: Tokenizer,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_chat_template, "CAPACITY", 2)
    templates = RequestChatTemplates(tokenizer, trusted=True)
    first = templates.tokenizer_for(_chat("<{{ messages[0].content }}>"))
    assert first.apply_chat_template(MESSAGES) == "<hi>"
    assert templates.tokenizer_for(_chat("<{{ messages[0].content }}>")) is first  # compiled once
    templates.tokenizer_for(_chat("a{{ messages[0].content }}"))
    templates.tokenizer_for(_chat("b{{ messages[0].content }}"))  # the least recently used, the first, goes
    assert templates.tokenizer_for(_chat("<{{ messages[0].content }}>")) is not first
    with pytest.raises(ApiError, match="does not parse") as error:
        templates.tokenizer_for(_chat("{% if %}"))
    assert error.value.param == "chat_template"
