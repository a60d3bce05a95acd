"""A request's prompt as token ids, and its max_tokens fitted to the model's context length.

Completions take text (tokenized with the model's own special-token policy, e.g. a BOS, unless the request's
`add_special_tokens` is false) or token ids as given. Chat renders the model's chat template and tokenizes the
result without special tokens (the template writes any BOS itself), unless the request's `add_special_tokens` says
otherwise (vLLM's field and defaults). Every problem is a 400 naming the field.

Token ids a client writes (a prompt of ids, stop_token_ids, logit_bias keys; /detokenize's) must lie in
[0, vocab_size): the router holds the tokenizer, so it refuses them here (`check_in_vocab`) rather than letting a
worker fail the request. The text was checked by `check_*_request` (router/protocol.py) before it gets here: it
encodes as UTF-8.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.tokenizer.chat_template import check_continuation, check_extra_variables
from router.errors import bad_request
from router.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from router.tools import ToolPlan, tool_messages

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer


def completion_prompt_token_ids(request: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    """The token ids of a /v1/completions prompt: one text or one token-id list (a batch of one is unwrapped; a
    larger batch is split into requests of one prompt each first).

    A 400 for ids outside the vocabulary, in the prompt or in `stop_token_ids`.
    """
    _check_token_id_fields(request, tokenizer)
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        assert len(prompt) == 1, "a batch's prompts are tokenized one by one (router/batched_completions.py)"
        prompt = prompt[0]
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
    else:
        token_ids = [int(token_id) for token_id in prompt]  # type: ignore[arg-type]
        check_in_vocab(token_ids, tokenizer, "prompt", what="prompt token ids")
    if not token_ids:
        raise bad_request("prompt must not be empty", "prompt")
    return token_ids


def chat_prompt_token_ids(
    request: ChatCompletionRequest, tokenizer: Tokenizer, tools: ToolPlan | None = None
) -> list[int]:
    """The token ids of the chat template rendered over `request.messages` (tool turns and the `tools` plan's
    tool prompt written in by router/tools.py); a 400 for `stop_token_ids` outside the vocabulary."""
    _check_token_id_fields(request, tokenizer)
    messages = [{"role": message.role, "content": _text_of(message, index)}
                for index, message in enumerate(request.messages)]
    messages = tool_messages(request, messages, tools)
    try:
        check_extra_variables(request.chat_template_kwargs)
    except ValueError as error:
        raise bad_request(str(error), "chat_template_kwargs") from error
    try:  # add_generation_prompt defaults true: the request sets it false to continue its last message
        check_continuation(request.add_generation_prompt, request.continue_final_message)
    except ValueError as error:
        raise bad_request(str(error), "continue_final_message") from error
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=request.add_generation_prompt,
                                             extra=request.chat_template_kwargs,
                                             continue_final_message=request.continue_final_message)
    except ValueError as error:
        raise bad_request(str(error), "messages") from error
    token_ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    if not token_ids:
        raise bad_request("the rendered chat prompt is empty", "messages")
    return token_ids


def _check_token_id_fields(request: CompletionRequest | ChatCompletionRequest, tokenizer: Tokenizer) -> None:
    """A 400 for a token id outside the vocabulary in `stop_token_ids`, `logit_bias` or `allowed_token_ids`."""
    check_in_vocab(request.stop_token_ids, tokenizer, "stop_token_ids")
    check_in_vocab(list(request.token_logit_bias), tokenizer, "logit_bias", what="logit_bias token ids")
    check_in_vocab(request.allowed_token_ids, tokenizer, "allowed_token_ids")


def truncate_prompt(token_ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: max_model_len of them; None: all); a
    400 naming the field for a value below -1, 0, or over max_model_len."""
    if keep is None:
        return token_ids
    if keep == -1:
        keep = max_model_len
    if keep < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 (max_model_len) or positive, got {keep}",
                          "truncate_prompt_tokens")
    if keep > max_model_len:
        raise bad_request(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}); "
                          "please select a smaller truncation size", "truncate_prompt_tokens")
    return token_ids[-keep:]


def fit_max_tokens(
    requested: int | None,
    *,
    default: int | None,
    num_prompt_tokens: int,
    max_model_len: int,
    prompt_param: str,
    max_tokens_param: str,
) -> int:
    """How many tokens to generate at most; a 400 when the prompt, or prompt + requested, exceeds the context.

    `requested` None takes `default` clipped to the room left (None: all of it). An explicit request that does
    not fit is refused rather than silently shortened, as in vLLM. Values below 1 pass through for
    `SamplingParams.validate()` to reject with its own message.
    """
    if num_prompt_tokens >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, leaving no room for the completion. Please shorten the prompt.",
            prompt_param,
        )
    room = max_model_len - num_prompt_tokens
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the prompt, {requested} for the "
            f"completion). Please reduce the prompt or {max_tokens_param}.",
            max_tokens_param,
        )
    return requested


def check_in_vocab(
    token_ids: list[int] | None, tokenizer: Tokenizer, param: str, *, what: str | None = None
) -> None:
    """A 400 naming `param` for the first id outside [0, vocab_size)."""
    vocab_size = tokenizer.vocab_size
    bad = next((token_id for token_id in token_ids or () if not 0 <= token_id < vocab_size), None)
    if bad is not None:
        raise bad_request(f"{what or param} must be in [0, {vocab_size}), got {bad}", param)


def _text_of(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"messages[{index}].content: only text parts are supported, got {part.type!r}",
                              "messages")
        texts.append(part.text)
    return "\n".join(texts)
