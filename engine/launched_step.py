"""A step the runner has launched: its sampled tokens on the device (what the next step may take as inputs, async
scheduling: engine/core/overlap.py) and on their way to the host, which reads them with `result()`.

    launch N ──▶ LaunchedStep N ──(token_ids, row_of: the next step's placeholders)──▶ launch N+1
                      └──── result(): {request id: tokens}, logprobs, prompt logprobs ───▶ update N (host)

A step that verified drafts, or whose requests the runner sampled on the host, is complete at launch: `result()`
returns at once and `token_ids` is None (no step takes placeholders from it: such steps do not overlap).

A step whose grammar bitmask is still being filled (engine/structured/fill_ahead.py) launches its forward and
defers its sampling: `finalize()` waits for the fill and launches the sampler, so that the engine processes the
step before it meanwhile (async scheduling). The runner finalizes it before it launches the next step (whose
placeholders, and a CUDA graph's reused logits, need it); `token_ids` and `result()` finalize too.

The grammar's fill thread reads the previous step's tokens with `token_of` while the engine thread may read the
same step's `result()`: both wait on the one host copy, under a lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from engine.request.logprobs import TokenLogprobs
from engine.sampling.sampler import LaunchedSample

StepResult = tuple[dict[str, list[int]], dict[str, list[TokenLogprobs]], dict[str, tuple[int, list[TokenLogprobs]]]]


class LaunchedStep:
    def __init__(
        self,
        *,
        request_ids: list[str],
        sample: LaunchedSample | None = None,
        deferred: Callable[[], LaunchedSample] | None = None,
        result: StepResult | None = None,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None,
    ) -> None:
        """`request_ids`: the requests sampled, in the sample's row order; `sample` (their one token each, still on
        the device), `deferred` (what launches that sample, once: see `finalize`) or `result` (already on the host)
        holds what they got."""
        assert sum(x is not None for x in (sample, deferred, result)) == 1
        self._sample = sample
        self._deferred = deferred
        self._deferred_error: Exception | None = None
        self._result = result
        self._lock = threading.Lock()
        self._prompt_logprobs = prompt_logprobs or {}
        self.row_of = {request_id: row for row, request_id in enumerate(request_ids)} if result is None else {}

    @classmethod
    def done(cls, result: StepResult) -> LaunchedStep:
        return cls(request_ids=[], result=result)

    def finalize(self, *, quiet: bool = False) -> None:
        """Launch the deferred sampling, if any (waiting for its grammar bitmask); raises what it raised, here
        (unless `quiet`: the runner launching the next step, which only the step's own readers should fail) and from
        every later `token_ids` and `result()`. Engine thread only."""
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            try:
                self._sample = deferred()
            except Exception as exc:
                self._deferred_error = exc
        if self._deferred_error is not None and not quiet:
            raise self._deferred_error

    @property
    def token_ids(self) -> torch.Tensor | None:
        """[len(row_of)] int64 on the device: each sampled request's token, at its row; None: complete at launch."""
        self.finalize()
        return None if self._sample is None else self._sample.token_ids

    def token_of(self, request_id: str) -> int:
        """`request_id`'s sampled token, on the host (waits for the device as far as the sampling). The step must be
        finalized; any thread."""
        assert self._deferred is None and self._deferred_error is None and self._sample is not None
        with self._lock:
            return self._sample.result().token_ids[self.row_of[request_id]]

    def result(self) -> StepResult:
        """For each request that sampled, its accepted drafts and the token after them (one token without drafts),
        their logprobs where asked, and the prompt logprobs computed (see `ModelRunner.execute`). Waits for the
        device as far as this step, once."""
        if self._result is None:
            self.finalize()
            assert self._sample is not None
            with self._lock:
                out = self._sample.result()
            sampled: dict[str, list[int]] = {}
            logprobs: dict[str, list[TokenLogprobs]] = {}
            for request_id, row in self.row_of.items():
                sampled[request_id] = [out.token_ids[row]]
                token_logprobs = out.logprobs[row]
                if token_logprobs is not None:
                    logprobs[request_id] = [token_logprobs]
            self._result = (sampled, logprobs, self._prompt_logprobs)
        return self._result
