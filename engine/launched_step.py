"""A step the runner has launched: its sampled tokens on the device (what the next step may take as inputs, async
scheduling: engine/core/overlap.py) and on their way to the host, which reads them with `result()`.

    launch N ──▶ LaunchedStep N ──(token_ids, row_of: the next step's placeholders)──▶ launch N+1
                      └──── result(): {request id: tokens}, logprobs, prompt logprobs ───▶ update N (host)

A step that verified drafts, or whose requests the runner sampled on the host, is complete at launch: `result()`
returns at once and `token_ids` is None (no step takes placeholders from it: such steps do not overlap).
"""

from __future__ import annotations

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
        result: StepResult | None = None,
        prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None,
    ) -> None:
        """`request_ids`: the requests sampled, in the sample's row order; `sample` (their one token each, still on
        the device) or `result` (already on the host) holds what they got."""
        assert (sample is None) != (result is None)
        self._sample = sample
        self._result = result
        self._prompt_logprobs = prompt_logprobs or {}
        self.row_of = {request_id: row for row, request_id in enumerate(request_ids)} if sample is not None else {}

    @classmethod
    def done(cls, result: StepResult) -> LaunchedStep:
        return cls(request_ids=[], result=result)

    @property
    def token_ids(self) -> torch.Tensor | None:
        """[len(row_of)] int64 on the device: each sampled request's token, at its row; None: complete at launch."""
        return None if self._sample is None else self._sample.token_ids

    def result(self) -> StepResult:
        """For each request that sampled, its accepted drafts and the token after them (one token without drafts),
        their logprobs where asked, and the prompt logprobs computed (see `ModelRunner.execute`). Waits for the
        device as far as this step, once."""
        if self._result is None:
            assert self._sample is not None
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
