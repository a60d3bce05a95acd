"""Per-request output state: incremental detokenization, the stop-string cut, logprobs, the outputs handed back.

    add(request)                   state for a request and for the choices it will fork (n > 1)
    record_prompt_logprobs(...)    a step's prompt logprobs kept on their requests
    append_tokens(request, ...)    one step's tokens of a request; True: a stop string ended its text there
    snapshot(request)              the output of a running request after the step (its delta consumed)
    finish(request, stats)         its final output; its state goes

A request is added when it is queued or reserved and finished exactly once, whatever ends it. The processor
also knows which choices of a request are still unfinished (`choice_ids`: what aborting the request ends) and
counts the output tokens kept (`num_generation_tokens`, since start).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine.core.fork import parent_request_id
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
        self._choices: dict[str, list[str]] = {}  # n > 1: a request's other choices that have not finished
        self.num_generation_tokens = 0  # output tokens kept (those after a stop string are not), since start

    def add(self, request: Request) -> None:
        """Output state for `request` and for each choice it will fork (`pending_forks`), which `choice_ids`
        names with it until they finish."""
        for each in (request, *request.pending_forks):
            self._add_state(each)
        if request.pending_forks:
            self._choices[request.request_id] = [child.request_id for child in request.pending_forks]

    def _add_state(self, request: Request) -> None:
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

    def choice_ids(self, request_id: str) -> list[str]:
        """`request_id` and those of its other choices (n > 1) that have not finished."""
        return [request_id, *self._choices.get(request_id, ())]

    def append_tokens(
        self, request: Request, token_ids: Sequence[int], logprobs: Sequence[TokenLogprobs] | None, sampled_s: float
    ) -> bool:
        """Record the tokens `request` produced in one step, sampled at `sampled_s` (several when drafts were
        accepted; the scheduler has appended them to its output already), with their logprobs where asked for.

        A token that completes a stop string ends the text there: the request's output is cut after that token
        (the tokens after it are dropped, and not counted), its `stop_reason` becomes the string, and True is
        returned: the caller ends the request, which may still hold its blocks."""
        times = request.times
        if times.first_token_s is None:
            times.first_token_s = sampled_s
        times.last_token_s = sampled_s
        num_output_before = request.num_output_tokens - len(token_ids)
        for i, token_id in enumerate(token_ids):
            stop_string = self._append_token(request, token_id, logprobs[i] if logprobs else None)
            if stop_string is not None:
                # The text is cut at the stop string, so that is why the request ended, even when the same token
                # also reached max_tokens or was a stop token id (vLLM's rule too).
                request.truncate_output(num_output_before + i + 1)
                request.stop_reason = stop_string
                self.num_generation_tokens += i + 1
                return True
        self.num_generation_tokens += len(token_ids)
        return False

    def record_prompt_logprobs(
        self, prompt_logprobs: Mapping[str, tuple[int, list[TokenLogprobs]]], requests: Mapping[str, Request]
    ) -> None:
        """Keep a step's prompt logprobs (by request id: the first position, the entries from it) on their
        `requests`, for the first output to hand out; positions already recorded (a prompt recomputed after a
        preemption) are not recorded twice."""
        for request_id, (start, entries) in prompt_logprobs.items():
            request = requests.get(request_id)
            if request is None:
                continue
            skip = len(request.prompt_logprobs) - start
            if skip >= 0:
                request.prompt_logprobs.extend(entries[skip:])

    def _append_token(self, request: Request, token_id: int, logprobs: TokenLogprobs | None) -> str | None:
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
        self._forget_choice(request)
        state = self._states.pop(request.request_id)
        state.delta_text += state.detokenizer.finish()
        out = self._output(state, request)
        out.finished = True
        out.finish_reason = request.status.finish_reason
        out.stop_reason = request.stop_reason
        out.error = error
        out.stats = stats
        return out

    def _forget_choice(self, request: Request) -> None:
        """A choice finished: its request's list of unfinished choices loses it, and goes once it is empty."""
        parent_id = parent_request_id(request.request_id, request.index)
        choices = self._choices.get(parent_id)
        if choices is not None and request.index:
            choices.remove(request.request_id)
        if choices is not None and not choices:
            del self._choices[parent_id]

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
