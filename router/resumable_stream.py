"""A request's token stream as the client sees it: one GenerationStream, replaced by a resumed one whenever its
decode worker goes away mid-stream (router/migration.py says which failures, and what the resumed request is).

    read() ──GenerationStream.read──▶ message ──(after a migration: text re-derived, cut at a stop string)──▶
             │ the call failed, worker gone, migrations left: mark the worker unhealthy, Dispatcher.resume
             │     (that worker and every earlier one excluded), read on from the new stream
             └ worker gone, no migration left (or nowhere to go): ApiError 503 — an error event in SSE

Lifecycle as GenerationStream's: `read()` until a message carries a finish_reason, then always `close()`, which
gives the admission ticket back and cancels + aborts the current call unless it finished (so a client that
leaves after a migration aborts the request on the worker that has it now). A stop string found by the gateway
after a migration ends the request and closes the current call the same way, freeing its blocks.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc.aio

from protos import serving_pb2
from router.dispatcher import Dispatcher, GenerationJob, GenerationStream, api_error_from_rpc
from router.errors import ApiError
from router.metrics import RequestTracker
from router.migration import TextContinuation, resume_request, worker_gone

if TYPE_CHECKING:
    from engine.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class ResumableStream:
    """An open request (its first message arrived) that survives the loss of its decode worker."""

    def __init__(
        self, stream: GenerationStream, *, dispatcher: Dispatcher, tracker: RequestTracker, tokenizer: Tokenizer
    ) -> None:
        self._stream = stream
        self._job = stream.job  # the client's request, as first dispatched
        self._dispatcher = dispatcher
        self._tracker = tracker
        self._tokenizer = tokenizer
        self._streamed_token_ids: list[int] = []  # every token id handed to the client
        self._failed_workers: list[str] = []
        self._text: TextContinuation | None = None  # set on the first migration
        self._finished = False  # a finish_reason went out (the worker's, or a stop string the gateway found)
        self.num_migrations = 0

    @property
    def worker_id(self) -> str:
        return self._stream.worker_id

    @property
    def num_prompt_tokens(self) -> int:
        return self._stream.num_prompt_tokens

    @property
    def num_completion_tokens(self) -> int:
        return self._stream.num_completion_tokens

    @property
    def num_cached_tokens(self) -> int:
        return self._stream.num_cached_tokens

    async def read(self) -> serving_pb2.GenerateResponse | None:
        """The next message; None at the end of the stream. Raises grpc.aio.AioRpcError when the call failed
        with a request error, ApiError when its worker went away and the request could not be resumed."""
        while True:
            try:
                message = await self._stream.read(count_rpc_failure=False)
            except grpc.aio.AioRpcError as error:
                reason = worker_gone(error.code(), error.details() or "")
                if reason is None:
                    self._tracker.failed(api_error_from_rpc(error)[1])
                    raise
                resumed = await self._migrate(error, reason)
                if resumed is not None:
                    return resumed
                continue
            if message is None:
                return None
            if self._text is not None:
                message = self._continue_text(message)
            self._streamed_token_ids.extend(message.token_ids)
            return message

    def close(self) -> None:
        """Idempotent; see the module docstring."""
        self._stream.close()

    async def _migrate(self, error: grpc.aio.AioRpcError, reason: str) -> serving_pb2.GenerateResponse | None:
        """Replace the stream after its worker went away. Returns a final message when nothing was left to
        generate; raises ApiError when the request cannot be resumed."""
        old = self._stream
        self._failed_workers.append(old.worker_id)
        self._dispatcher.mark_unhealthy(old.worker_id, f"Generate stream lost: {error.details()}")
        limit = self._dispatcher.max_migrations
        if self._job.params.num_sequences > 1:  # its choices are not resumed (each would need its own request)
            self._tracker.failed("migration_limit")
            raise ApiError(status_code=503, message=(
                f"worker {old.worker_id} went away mid-stream ({error.code().name}: {error.details()}); a request "
                "with n > 1 or best_of is not migrated"))
        if self.num_migrations >= limit:
            self._tracker.failed("migration_limit")
            raise ApiError(status_code=503, message=(
                f"worker {old.worker_id} went away mid-stream ({error.code().name}: {error.details()}) and the "
                f"request was already migrated {self.num_migrations} time(s) (--max-migrations {limit})"))
        self.num_migrations += 1
        job = self._job
        request = resume_request(request_id=job.request_id, prompt_token_ids=job.prompt_token_ids,
                                 params=job.params, streamed_token_ids=self._streamed_token_ids,
                                 num_migrations=self.num_migrations)
        if request is None:  # the worker died after streaming its last token but before saying so
            return self._finish_locally(old)
        logger.warning("%s: worker %s went away after %d tokens (%s: %s); resuming elsewhere (migration %d/%d)",
                       job.request_id, old.worker_id, len(self._streamed_token_ids), error.code().name,
                       error.details(), self.num_migrations, limit)
        resumed_job = GenerationJob(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                                    params=request.params, lora=job.lora)
        try:
            stream = await self._dispatcher.resume(resumed_job, self._tracker,
                                                   num_prior_tokens=request.num_prior_tokens,
                                                   exclude=self._failed_workers)
        except ApiError as failure:
            raise ApiError(status_code=failure.status_code, message=(
                f"worker {old.worker_id} went away mid-stream and the request could not be resumed: "
                f"{failure.message}")) from failure
        self._tracker.migrated(reason)  # counted once resumed: a failed resume is a failed request
        stream.ticket, old.ticket = old.ticket, None
        old.close()  # gives nothing back: the call failed, so it was finished
        self._stream = stream
        if self._text is None:
            self._text = TextContinuation(self._tokenizer, job.params, self._streamed_token_ids)
        return None

    def _continue_text(self, message: serving_pb2.GenerateResponse) -> serving_pb2.GenerateResponse:
        """A resumed worker's message with the gateway's text; cut at, and finished by, a stop string."""
        assert self._text is not None
        step = self._text.step(message.token_ids)
        rewritten = serving_pb2.GenerateResponse()
        rewritten.CopyFrom(message)
        rewritten.text_delta = step.text_delta
        if step.stop_str is not None:
            del rewritten.token_ids[step.num_tokens_kept:]
            del rewritten.logprobs[step.num_tokens_kept:]
            rewritten.finish_reason = "stop"
            rewritten.stop_reason.CopyFrom(serving_pb2.StopReason(stop_string=step.stop_str))
            if not message.finish_reason:  # the worker would go on: the gateway ends it here
                self._end_stream(rewritten)
        elif message.finish_reason:
            rewritten.text_delta += self._text.finish()
        return rewritten

    def _end_stream(self, last: serving_pb2.GenerateResponse) -> None:
        """The gateway finished the request itself: count it, then cancel and abort the worker's call."""
        stream = self._stream
        num_tokens = len(self._streamed_token_ids) + len(last.token_ids)
        self._tracker.finished(last.finish_reason, num_prompt_tokens=stream.num_prompt_tokens,
                               num_generated_tokens=num_tokens)
        stream.num_generated_tokens = num_tokens - stream.num_prior_tokens  # usage counts what the client got
        stream.close()

    def _finish_locally(self, old: GenerationStream) -> serving_pb2.GenerateResponse:
        """max_tokens was reached: the finish the worker did not live to send, with the text it held back."""
        text = self._text or TextContinuation(self._tokenizer, self._job.params, self._streamed_token_ids)
        message = serving_pb2.GenerateResponse(request_id=self._job.request_id, text_delta=text.finish(),
                                               finish_reason="length")
        self._tracker.finished("length", num_prompt_tokens=old.num_prompt_tokens,
                               num_generated_tokens=old.num_completion_tokens)
        return message
