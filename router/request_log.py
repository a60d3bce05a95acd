"""vLLM's `--enable-log-requests`: the gateway logs each request it accepts, one INFO line on logger
`router.request_log`, as vLLM's RequestLogger writes it: its id, its prompt (text and token ids, each cut to
`--max-log-len`), and its sampling params. Off by default, as in vLLM (prompts are the users' data)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer
    from router.dispatcher import GenerationJob

logger = logging.getLogger(__name__)


class RequestLog:
    def __init__(self, tokenizer: Tokenizer, max_log_len: int | None) -> None:
        self.tokenizer = tokenizer
        self.max_log_len = max_log_len

    def received(self, response_id: str, job: GenerationJob) -> None:
        ids = job.prompt_token_ids
        shown = ids if self.max_log_len is None else ids[:self.max_log_len]
        text = self.tokenizer.decode(shown, skip_special_tokens=False)
        if self.max_log_len is not None:
            text = text[:self.max_log_len]
        logger.info("Received request %s (workers' id %s): prompt: %r, params: %s, prompt_token_ids: %s%s",
                    response_id, job.request_id, text, job.params, list(shown),
                    f" (of {len(ids)})" if len(shown) < len(ids) else "")
