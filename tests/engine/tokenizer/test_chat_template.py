"""ChatTemplate: HF-compatible environment, sandboxing, and clear errors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine.tokenizer.chat_template import ChatTemplate, validate_messages
from engine.tokenizer.tokenizer import Tokenizer

USER_HI = [{"role": "user", "content": "hi"}]


def test_hf_environment_features() -> None:
    template = ChatTemplate(
        "{% for m in messages %}\n"
        "  {% if m['role'] == 'skip' %}{% continue %}{% endif %}\n"
        "{{ m | tojson }}|{{ bos_token }}|{{ eos_token }}|{{ tools is none }}\n"
        "{% endfor %}"
    )
    rendered = template.render(
        [{"role": "user", "content": "é \"q\""}, {"role": "skip", "content": ""}], bos_token="<s>", eos_token="</s>"
    )
    # trim_blocks + lstrip_blocks drop the block lines; tojson keeps non-ASCII and does not escape HTML.
    assert rendered == '{"role": "user", "content": "é \\"q\\""}|<s>|</s>|True\n'


def test_add_generation_prompt_and_missing_special_tokens() -> None:
    template = ChatTemplate("[{{ bos_token }}]{% if add_generation_prompt %}GEN{% endif %}")
    assert template.render(USER_HI) == "[]GEN"
    assert template.render(USER_HI, add_generation_prompt=False) == "[]"


def test_raise_exception_becomes_value_error() -> None:
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ValueError, match="roles must alternate"):
        template.render(USER_HI)


def test_sandbox_forbids_mutating_inputs() -> None:
    template = ChatTemplate("{{ messages.append(1) }}")
    with pytest.raises(ValueError, match="chat template failed"):
        template.render(USER_HI)


def test_syntax_error_is_value_error() -> None:
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hi", "must be a list"),
        ([["user", "hi"]], r"messages\[0\] must be a dict"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a string, got NoneType"),
        ([USER_HI[0], {"role": 1, "content": "x"}], r"messages\[1\]\['role'\] must be a string"),
    ],
)
def test_bad_messages_are_named(messages, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        validate_messages(messages)
    with pytest.raises(ValueError, match=message):
        ChatTemplate("{{ messages }}").render(messages)


def test_model_without_template(smollm_like: Tokenizer) -> None:
    bare = Tokenizer(replace(smollm_like.spec, chat_template=None))
    assert bare.chat_template is None
    with pytest.raises(ValueError, match="has no chat template"):
        bare.apply_chat_template(USER_HI)


def test_with_chat_template_replaces_the_models_template_only_in_the_copy(smollm_like: Tokenizer) -> None:
    """vLLM's --chat-template: the gateway's tokenizer renders the operator's template; the vocabulary is shared,
    the original keeps the model's template."""
    own = smollm_like.chat_template
    custom = smollm_like.with_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert custom.apply_chat_template(USER_HI) == "<user>hi"
    assert custom.chat_template != own and smollm_like.chat_template == own
    assert custom.encode("hello there") == smollm_like.encode("hello there")
    with pytest.raises(ValueError, match="does not parse"):
        smollm_like.with_chat_template("{% for m in messages %}")


def test_continue_final_message_ends_inside_the_last_message(smollm_like: Tokenizer) -> None:
    """HF's and vLLM's continue_final_message: what the template writes after the last message's content is cut;
    a template that trims the content trims it here too; one that does not write it is a clear error."""
    partial = [*USER_HI, {"role": "assistant", "content": "Sure, "}]
    keeps = smollm_like.with_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content }}</s>{% endfor %}")
    assert keeps.apply_chat_template(partial, add_generation_prompt=False,
                                     continue_final_message=True) == "<user>hi</s><assistant>Sure, "
    trims = smollm_like.with_chat_template("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</s>"
                                           "{% endfor %}")
    assert trims.apply_chat_template(partial, add_generation_prompt=False,
                                     continue_final_message=True) == "<user>hi</s><assistant>Sure,"
    drops = smollm_like.with_chat_template("{% for m in messages %}<{{ m.role }}>{% endfor %}")
    with pytest.raises(ValueError, match="does not write the last message's content"):
        drops.apply_chat_template(partial, add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(ValueError, match="cannot both be true"):
        keeps.apply_chat_template(partial, continue_final_message=True)
