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

Filling ahead (`fill_ahead`, on for a cuda engine): a step's bitmask depends only on tokens already output, so
`start_fill` begins it on the matchers' own thread (engine/structured/fill_ahead.py) when the step's inputs are
known, and it runs while the forward pass does; `fill` then hands the sampler a `PendingBitmask`, which it waits for
just before masking. Its rows are all the step's sampling rows (the unconstrained ones allow everything), so the
device masks the whole batch in one kernel with no row gather, and on cuda it comes in pinned memory, copied to
the device without a host sync. On CPU it stays off: the forward keeps every core busy, so the fill has nowhere to
hide, and measured slower there (docs/benchmarks.md, "Structured outputs"). Steps with drafts fill in the step.

    step k:   start_fill ─▶ forward ─────────────▶ sampler: wait, mask, sample
              └─ fill thread: sync, fill ──┘

Async scheduling (engine/core/overlap.py): step k+1 is launched before step k's tokens reach the host, so a
structured request's output lacks its last token when k+1's mask is filled. The runner passes what reads those
tokens (`InFlightTokens`): the fill (on its thread, or in the step) waits for them, and the matcher accepts each
after the request's output, counted as accepted; when the output catches up, `sync` finds them already there. With
the fill ahead, the runner defers k+1's sampling until the engine has processed step k (engine/launched_step.py),
so the fill overlaps that; the fill thread reads each output only up to the length it had at `start_fill`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from engine.core.request import Request
from engine.structured.bitmask import InFlightTokens, PendingBitmask, TokenBitmask
from engine.structured.compiler import GrammarCompilerCache
from engine.structured.fill_ahead import FillAhead

if TYPE_CHECKING:
    from engine.core.scheduler import ScheduledRequest

logger = logging.getLogger(__name__)


@dataclass
class _RequestGrammar:
    matcher: xgr.GrammarMatcher
    stop_token_ids: list[int]
    num_accepted: int = 0  # output tokens the matcher has seen (accepted, or counted after its termination)
    broken: bool = False  # a token it could not accept came out (should not happen): constrain no further


class GrammarMatchers:
    """One per engine (its runner's); used on the engine thread, and on its own fill thread while a fill started
    by `start_fill` runs (every other method waits that fill out first)."""

    def __init__(self, compilers: GrammarCompilerCache, *, device: torch.device | None = None) -> None:
        """`device`: where the engine's logits are; a cuda engine fills ahead (module docstring)."""
        self.compilers = compilers
        self.vocab_size = compilers.vocab_size
        self._grammars: dict[str, _RequestGrammar] = {}
        # Rows are filled on as many threads as torch computes on (idle between the forward passes).
        self._batch = xgr.BatchGrammarMatcher(max_threads=max(1, torch.get_num_threads()))
        on_cuda = device is not None and device.type == "cuda"
        self.fill_ahead = on_cuda  # a switch: tests turn it on for a CPU engine
        # A bitmask filled ahead comes in pinned memory (an async copy to the device), pinned for this device.
        self._pin_device = device if on_cuda else None
        self._ahead = FillAhead()

    @property
    def num_requests(self) -> int:
        return len(self._grammars)

    def release(self, request_id: str) -> None:
        """Forget a finished request's matcher."""
        self._ahead.drain()
        self._grammars.pop(request_id, None)

    def close(self) -> None:
        """End the fill thread, if one was started (it also ends when this object is garbage collected)."""
        self._ahead.close()

    def allocate(self, num_rows: int) -> torch.Tensor:
        """A bitmask of `num_rows` rows, everything allowed: [num_rows, ceil(vocab_size / 32)] int32."""
        return xgr.allocate_token_bitmask(num_rows, self.vocab_size)

    def start_fill(self, items: Sequence[ScheduledRequest], in_flight: InFlightTokens | None = None) -> None:
        """A step's inputs are known (`items` in step order): with `fill_ahead`, start filling on the fill thread
        the bitmask its sampler will ask `fill` for (after the tokens `in_flight` reads, module docstring). Nothing
        to do for a step without structured rows to sample, or with drafts (`fill_with_drafts` fills those in the
        step)."""
        if not self.fill_ahead:
            return
        sampling = [item for item in items if item.samples]
        if any(item.spec_token_ids for item in sampling):
            return
        rows = [i for i, item in enumerate(sampling) if item.request.sampling_params.structured_outputs]
        if not rows:
            return
        requests = [sampling[i].request for i in rows]
        known = [len(request.output_token_ids) for request in requests]  # the engine thread appends from here on
        num_rows = len(sampling)
        self._ahead.start(_fill_key(requests, rows),
                          lambda: self._fill_all_rows(requests, rows, num_rows, known, in_flight))

    def fill(self, requests: Sequence[Request], row_indices: Sequence[int],
             in_flight: InFlightTokens | None = None) -> TokenBitmask | PendingBitmask:
        """The bitmask for the next token of each (structured) request, constraining logits row `row_indices[i]`:
        the one `start_fill` began for exactly these, or one filled now (after the tokens `in_flight` reads)."""
        if self._ahead.tracking:
            pending = self._ahead.take(_fill_key(requests, row_indices))
            if pending is not None:
                return pending
        extra = in_flight() if in_flight is not None else {}
        bitmask = self.allocate(len(requests))
        self._fill_rows([self._synced(request, extra=extra.get(request.request_id)) for request in requests],
                        bitmask, range(len(requests)))
        return TokenBitmask(bitmask=bitmask, row_indices=list(row_indices))

    def _fill_all_rows(self, requests: Sequence[Request], row_indices: Sequence[int], num_rows: int,
                       known: Sequence[int], in_flight: InFlightTokens | None) -> TokenBitmask:
        """On the fill thread: a bitmask of all `num_rows` logits rows, request i's at `row_indices[i]` (its output
        read up to `known[i]` tokens, then its token in flight), the rest allowing everything."""
        extra = in_flight() if in_flight is not None else {}
        bitmask = self.allocate(num_rows)
        grammars = [self._synced(request, known=length, extra=extra.get(request.request_id))
                    for request, length in zip(requests, known, strict=True)]
        self._fill_rows(grammars, bitmask, row_indices)
        if self._pin_device is not None:
            bitmask = self._pinned(bitmask, self._pin_device)
        return TokenBitmask(bitmask=bitmask, row_indices=list(range(num_rows)))

    def _pinned(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A pinned copy of `bitmask`, made on the fill thread with `device` current (a thread starts on device 0).
        Should pinning fail, the unpinned one (its copy then syncs the host): the step still gets its mask."""
        try:
            with torch.cuda.device(device):
                return bitmask.pin_memory()
        except RuntimeError as error:
            logger.warning("grammar bitmasks stay unpinned (host-synchronous copies): %s", error)
            self._pin_device = None
            return bitmask

    def _fill_rows(self, grammars: Sequence[_RequestGrammar], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """Fill bitmask row `rows[i]` for `grammars[i]`: the live matchers in one batched call."""
        live = [i for i, g in enumerate(grammars) if not g.broken and not g.matcher.is_terminated()]
        if len(live) > 1:
            self._batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in live], bitmask,
                                                      indices=[rows[i] for i in live])
        batched = set(live) if len(live) > 1 else set()
        for i, grammar in enumerate(grammars):
            if i not in batched:
                self._fill_row(grammar, bitmask, rows[i])

    def fill_with_drafts(self, request: Request, drafts: Sequence[int], bitmask: torch.Tensor, first_row: int
                         ) -> int:
        """Fill rows `first_row`, ... of `bitmask` for the positions of `request`'s drafts, up to and including
        the first draft the grammar rejects; returns how many drafts it accepts (rows filled: that + 1)."""
        self._ahead.drain()
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
    def _synced(self, request: Request, *, known: int | None = None, extra: int | None = None) -> _RequestGrammar:
        """`request`'s matcher, having accepted its output's first `known` tokens (default: all of them) and then
        `extra` (a token still in flight, not in the output yet)."""
        grammar = self._grammars.get(request.request_id)
        if grammar is None:
            spec = request.sampling_params.structured_outputs
            assert spec is not None
            stop_token_ids = list(dict.fromkeys([*request.eos_token_ids, *request.sampling_params.stop_token_ids]))
            matcher = xgr.GrammarMatcher(self.compilers.compile(spec), override_stop_tokens=stop_token_ids)
            grammar = self._grammars[request.request_id] = _RequestGrammar(matcher, stop_token_ids)
        output = request.output_token_ids
        length = len(output) if known is None else known
        if length < grammar.num_accepted and not grammar.broken:  # output cut back (a stop string)
            grammar.matcher.rollback(grammar.num_accepted - length)
            grammar.num_accepted = length
        for token_id in [*output[grammar.num_accepted : length], *([] if extra is None else [extra])]:
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


def _fill_key(requests: Sequence[Request], row_indices: Sequence[int]) -> tuple[object, ...]:
    """What a fill is for: each request at the output length it is filled after, and its logits row."""
    return tuple((r.request_id, len(r.output_token_ids), row) for r, row in zip(requests, row_indices, strict=True))
