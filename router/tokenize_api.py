"""vLLM's `POST /tokenize` and `POST /detokenize`, answered by the gateway itself (it holds the tokenizer; no worker
is asked): how many tokens a prompt is, or what text token ids are.

    /tokenize    {"prompt": "..."}  or  {"messages": [...], "add_generation_prompt": true, "chat_template_kwargs": ...}
                 ─▶ {"count": n, "max_model_len": L, "tokens": [...], "token_strs": null | [...]}
                 a chat is rendered and tokenized exactly as /v1/chat/completions does it (the same template, the
                 same tool prompt), so `count` is what that request's prompt would cost
    /detokenize  {"tokens": [...]}  ─▶  {"prompt": "..."}   (special tokens kept, as vLLM's)

`model` is optional, as in vLLM; given, it must be a served name (404). Text is held to the generation endpoints'
rules (a 400 for lone surrogates and NUL), ids to the vocabulary. API keys guard both, as /v1/* (vLLM leaves them
open; here they cost the gateway's CPU, so a key is needed where keys are set: router/api_keys.py).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from router.errors import ErrorResponse, bad_request
from router.prompt import chat_prompt_token_ids, check_in_vocab
from router.protocol import ChatCompletionRequest, ChatMessage, check_chat_request, check_text
from router.tools import plan_tools

if TYPE_CHECKING:
    from router.config import RouterConfig
    from router.lora_api import ServedModels
    from router.request_chat_template import RequestChatTemplates

TOKENIZE_PATHS = ("/tokenize", "/detokenize")
_ERRORS: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse, "description": description}
    for code, description in ((400, "a bad parameter, text that cannot be encoded, an id outside the vocabulary"),
                              (404, "a model this server does not serve"), (413, "a body over the size limit"))
}


class TokenizeRequest(BaseModel):
    """POST /tokenize: `prompt` or `messages`, one of them."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # the tokenizer's special tokens around a prompt (BOS); a chat's come from its template, as in vLLM
    add_special_tokens: bool = True
    chat_template_kwargs: dict[str, object] | None = None
    chat_template: str | None = None  # vLLM's: this request's own (--trust-request-chat-template)
    tools: list[dict[str, object]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def install_tokenize_routes(app: FastAPI, config: RouterConfig, templates: RequestChatTemplates,
                            models: ServedModels) -> None:
    tokenizer = templates.tokenizer

    @app.post("/tokenize", responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> dict[str, object]:
        if body.model is not None:
            models.resolve(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give `prompt` or `messages`, one of them", "prompt")
        if body.prompt is not None:
            check_text(body.prompt, param="prompt", allow_nul=False)
            token_ids = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
        else:
            chat = ChatCompletionRequest(model=body.model or config.served_model_names[0], messages=body.messages,
                                         add_generation_prompt=body.add_generation_prompt,
                                         continue_final_message=body.continue_final_message,
                                         chat_template_kwargs=body.chat_template_kwargs,
                                         chat_template=body.chat_template, tools=body.tools)
            check_chat_request(chat)
            token_ids = await asyncio.to_thread(lambda: chat_prompt_token_ids(chat, templates.tokenizer_for(chat),
                                                                              plan_tools(chat)))
        return {"count": len(token_ids), "max_model_len": config.max_model_len, "tokens": token_ids,
                "token_strs": [tokenizer.id_to_token(i) for i in token_ids] if body.return_token_strs else None}

    @app.post("/detokenize", responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> dict[str, object]:
        if body.model is not None:
            models.resolve(body.model)
        check_in_vocab(body.tokens, tokenizer, "tokens")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, body.tokens, False)}
