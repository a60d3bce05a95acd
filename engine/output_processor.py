"""Per-request output state: incremental detokenization, stop strings, logprobs, the outputs handed back."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.core.request import Request
from engine.core.stats import RequestStats
from engine.outputs import RequestOutput
from engine.request.logprobs import TokenLogprobs
from engine.tokenizer.detokenizer import IncrementalDetokenizer
from engine.tokenizer.tokenizer import Tokenizer


@dataclass
class _OutputState:
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    delta_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs_due: bool = False  # asked for, and not handed out yet


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _OutputState] = {}

    def add(self, request: Request) -> None:
        params = request.sampling_params
        self._states[request.request_id] = _OutputState(
            detokenizer=IncrementalDetokenizer(
                self.tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            ),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs_due=params.prompt_logprobs is not None,
        )

    def append_token(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> str | None:
        """Record a new token; returns the stop string it completed, if any."""
        state = self._states[request.request_id]
        state.new_token_ids.append(token_id)
        if state.logprobs is not None and logprobs is not None:
            state.logprobs.append(logprobs)
        stopped_before = state.detokenizer.stopped
        state.delta_text += state.detokenizer.add_token(token_id)
        if state.detokenizer.stopped and not stopped_before:
            return state.detokenizer.stop_str
        return None

    def snapshot(self, request: Request) -> RequestOutput:
        """The output of a running request after this step (its delta is consumed)."""
        return self._output(self._states[request.request_id], request)

    def finish(self, request: Request, stats: RequestStats, error: str | None = None) -> RequestOutput:
        """The final output of a finished request; forgets its state."""
        state = self._states.pop(request.request_id)
        state.delta_text += state.detokenizer.finish()
        out = self._output(state, request)
        out.finished = True
        out.finish_reason = request.status.finish_reason
        out.stop_reason = request.stop_reason
        out.error = error
        out.stats = stats
        return out

    def _output(self, state: _OutputState, request: Request) -> RequestOutput:
        out = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=state.detokenizer.text,
            new_token_ids=state.new_token_ids,
            delta_text=state.delta_text,
            logprobs=list(state.logprobs) if state.logprobs is not None else None,
            index=request.index,
        )
        if state.prompt_logprobs_due and state.new_token_ids:
            state.prompt_logprobs_due = False
            out.prompt_logprobs = list(request.prompt_logprobs)
        state.delta_text, state.new_token_ids = "", []
        return out
