"""The grammar matchers of the running structured requests, and the step's token bitmask.

A request's matcher follows its output tokens lazily: before each step that samples for it, `sync` accepts the
output tokens it has not seen yet. So the matcher needs nothing but the token ids to be rebuilt anywhere: on a
decode worker the first token (sampled under the grammar by the prefill worker) is simply the first one it
replays, and a preempted request keeps its matcher, as it keeps its output.

    step k:   sync (accept the tokens step k-1 produced) ─▶ fill the row's bitmask ─▶ sampler masks and samples

Speculative drafts: `fill_with_drafts` walks the drafts through the matcher, one bitmask row per position (the
state after the drafts before it), and stops at the first draft the grammar rejects: the caller verifies only the
drafts before it, and the position of the rejected one is sampled under the grammar. Then the matcher rolls back
to the request's real tokens. So a grammar-rejected token is never emitted, draft or not.

End: the matcher's stop tokens are the request's EOS and stop token ids. Once the grammar is complete only those
are allowed; the sampled one ends the request (the engine's stop rule) and terminates the matcher. Should the
request go on past it (`ignore_eos`), every later row allows only the stop tokens again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from engine.core.request import Request
from engine.structured.bitmask import TokenBitmask
from engine.structured.compiler import GrammarCompilerCache

logger = logging.getLogger(__name__)


@dataclass
class _RequestGrammar:
    matcher: xgr.GrammarMatcher
    stop_token_ids: list[int]
    num_accepted: int = 0  # output tokens the matcher has seen (accepted, or counted after its termination)
    broken: bool = False  # a token it could not accept came out (should not happen): constrain no further


class GrammarMatchers:
    """One per engine (its runner's); used on the engine thread only."""

    def __init__(self, compilers: GrammarCompilerCache) -> None:
        self.compilers = compilers
        self.vocab_size = compilers.vocab_size
        self._grammars: dict[str, _RequestGrammar] = {}
        # Rows are filled on as many threads as torch computes on (idle between the forward passes).
        self._batch = xgr.BatchGrammarMatcher(max_threads=max(1, torch.get_num_threads()))

    @property
    def num_requests(self) -> int:
        return len(self._grammars)

    def release(self, request_id: str) -> None:
        """Forget a finished request's matcher."""
        self._grammars.pop(request_id, None)

    def allocate(self, num_rows: int) -> torch.Tensor:
        """A bitmask of `num_rows` rows, everything allowed: [num_rows, ceil(vocab_size / 32)] int32."""
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def fill(self, requests: Sequence[Request], row_indices: Sequence[int]) -> TokenBitmask:
        """The bitmask for the next token of each (structured) request, constraining logits row `row_indices[i]`."""
        bitmask = self.allocate(len(requests))
        grammars = [self._synced(request) for request in requests]
        live = [i for i, g in enumerate(grammars) if not g.broken and not g.matcher.is_terminated()]
        if len(live) > 1:
            self._batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in live], bitmask, indices=live)
        for i, grammar in enumerate(grammars):
            if len(live) <= 1 or i not in live:
                self._fill_row(grammar, bitmask, i)
        return TokenBitmask(bitmask=bitmask, row_indices=list(row_indices))

    def fill_with_drafts(self, request: Request, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int
                         ) -> int:
        """Fill rows `first_row`, ... of `bitmask` for the positions of `request`'s drafts, up to and including
        the first draft the grammar rejects; returns how many drafts it accepts (rows filled: that + 1)."""
        grammar = self._synced(request)
        num_kept = 0
        for j in range(len(drafts) + 1):
            self._fill_row(grammar, bitmask, first_row + j)
            if j == len(drafts) or not self._accepts(grammar, drafts[j]):
                break
            num_kept += 1
        if num_kept and not grammar.broken:
            grammar.matcher.rollback(num_kept)
        return num_kept

    # -- one request -------------------------------------------------------------------------------------------
    def _synced(self, request: Request) -> _RequestGrammar:
        grammar = self._grammars.get(request.request_id)
        if grammar is None:
            spec = request.sampling_params.structured_outputs
            assert spec is not None
            stop_token_ids = list(dict.fromkeys([*request.eos_token_ids, *request.sampling_params.stop_token_ids]))
            matcher = xgr.GrammarMatcher(self.compilers.compile(spec), override_stop_tokens=stop_token_ids)
            grammar = self._grammars[request.request_id] = _RequestGrammar(matcher, stop_token_ids)
        output = request.output_token_ids
        if len(output) < grammar.num_accepted and not grammar.broken:  # output cut back (a stop string)
            grammar.matcher.rollback(grammar.num_accepted - len(output))
            grammar.num_accepted = len(output)
        for token_id in output[grammar.num_accepted :]:
            if not grammar.broken and not grammar.matcher.is_terminated() and not grammar.matcher.accept_token(
                    token_id):
                logger.warning("request %s: output token %d breaks its grammar; no longer constrained",
                               request.request_id, token_id)
                grammar.broken = True
            grammar.num_accepted += 1
        return grammar

    def _accepts(self, grammar: _RequestGrammar, token_id: int) -> bool:
        if grammar.broken:
            return True
        if grammar.matcher.is_terminated():
            return False
        return grammar.matcher.accept_token(token_id)

    def _fill_row(self, grammar: _RequestGrammar, bitmask: torch.Tensor, row: int) -> None:
        if grammar.broken:
            bitmask[row] = -1
        elif grammar.matcher.is_terminated():
            bitmask[row] = 0
            for token_id in grammar.stop_token_ids:
                if token_id < self.vocab_size:
                    word = bitmask[row, token_id // 32].item()
                    bit = 1 << (token_id % 32)
                    value = (word & 0xFFFFFFFF) | bit
                    bitmask[row, token_id // 32] = value - (1 << 32) if value >= 1 << 31 else value
        else:
            grammar.matcher.fill_next_token_bitmask(bitmask, row)
