"""vLLM's per-request `chat_template` (chat completions and /tokenize): a request may bring its own Jinja chat
template, rendered instead of the model's (or --chat-template's), only when the gateway runs with
--trust-request-chat-template (vLLM's flag, off by default: a template is code the gateway runs, sandboxed but
free to loop for long). Without it such a request is a 400 naming `chat_template`.

Each template compiles once: the tokenizers made for them (sharing the model's vocabulary) are kept in an LRU of
`CAPACITY`, keyed by the template's text.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from router.errors import bad_request

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer
    from router.protocol import ChatCompletionRequest

CAPACITY = 32


class RequestChatTemplates:
    def __init__(self, tokenizer: Tokenizer, *, trusted: bool) -> None:
        self.tokenizer = tokenizer
        self.trusted = trusted
        self._compiled: OrderedDict[str, Tokenizer] = OrderedDict()
        self._lock = threading.Lock()

    def tokenizer_for(self, request: ChatCompletionRequest) -> Tokenizer:
        """The tokenizer whose chat template renders `request`: the gateway's, or one with the request's own
        template. A 400 naming `chat_template` when that is not trusted here or does not parse. Any thread."""
        source = request.chat_template
        if source is None:
            return self.tokenizer
        if not self.trusted:
            raise bad_request("this gateway does not render a request's own chat_template: start it with "
                              "--trust-request-chat-template (vLLM's flag) to allow that", "chat_template")
        with self._lock:
            tokenizer = self._compiled.get(source)
            if tokenizer is not None:
                self._compiled.move_to_end(source)
                return tokenizer
        try:
            tokenizer = self.tokenizer.with_chat_template(source)
        except ValueError as error:
            raise bad_request(str(error), "chat_template") from error
        with self._lock:
            self._compiled[source] = tokenizer
            while len(self._compiled) > CAPACITY:
                self._compiled.popitem(last=False)
        return tokenizer
