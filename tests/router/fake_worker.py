"""An in-process fake of the gRPC `Worker` service with scripted token streams, for the router's unit tests.

The router's logic (routing, dispatch, streaming, cancellation, errors) is what is under test; a real worker
needs torch and a model. Each fake runs a threaded grpc server on 127.0.0.1 and records what it saw.
Tokens are bytes of the scripted text, so with `byte_tokenizer()` a token id is 3 + its byte.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc

from engine.request.wire import stop_reason_to_proto
from engine.tokenizer.bpe import BYTE_TO_UNICODE, AddedToken
from engine.tokenizer.pre_tokenizer import GPT2_PATTERN
from engine.tokenizer.spec import TokenizerSpec
from engine.tokenizer.tokenizer import Tokenizer
from protos import serving_pb2, serving_pb2_grpc

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NUM_SPECIAL = 3  # <|endoftext|> 0, <|im_start|> 1, <|im_end|> 2


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer without merges: one token per byte (id 3 + byte), ChatML specials, EOS 2."""
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({char: NUM_SPECIAL + byte for byte, char in enumerate(BYTE_TO_UNICODE)})
    spec = TokenizerSpec(
        vocab=vocab,
        merges=(),
        pre_tokenizer_stages=(GPT2_PATTERN,),
        added_tokens=tuple(AddedToken(content=t, id=i, special=True) for t, i in list(vocab.items())[:3]),
        eos_token_id=2,
        chat_template=CHATML_TEMPLATE,
        source="byte tokenizer",
    )
    return Tokenizer(spec)


def token_ids_of(text: str) -> list[int]:
    return [NUM_SPECIAL + byte for byte in text.encode()]


@dataclass
class Script:
    """What the fake does with the next Generate calls."""

    text: str = "Hello world"  # generated one byte-token per message, up to max_tokens
    finish_reason: str = ""  # "": "length" when max_tokens cut the text, else "stop" (EOS)
    stop_reason: int | str | None = None  # the stop token id or stop string the finish reports (None: EOS)
    delay_s: float = 0.0  # before each message
    status: grpc.StatusCode | None = None  # abort the call with this before any message
    status_times: int | None = None  # ... only the first this many calls (None: every call)
    error_after: int | None = None  # send a message with `error` set after this many tokens
    error_times: int | None = None  # ... only in the first this many calls (None: every call)
    abort_after: int | None = None  # finish with "abort" after this many tokens
    hang_after: int | None = None  # stop sending after this many tokens until the call is cancelled
    # The worker goes away after this many tokens: the call fails with `cut_status` (as a stopped server's calls do)
    cut_after: int | None = None
    cut_status: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE


@dataclass
class FakeWorker(serving_pb2_grpc.WorkerServicer):
    worker_id: str
    role: str
    script: Script = field(default_factory=Script)
    load: serving_pb2.LoadStats = field(default_factory=serving_pb2.LoadStats)
    load_status: grpc.StatusCode | None = None  # GetLoad fails with this
    load_delay_s: float = 0.0  # GetLoad answers after this long, with the load as it was when called
    health: serving_pb2.HealthResponse | None = None  # what Health answers (None: ok, with its id and role)
    # ResetPrefixCache: fails with this status, else answers this (None: reset)
    reset_status: grpc.StatusCode | None = None
    reset_reply: serving_pb2.ResetPrefixCacheResponse | None = None
    # LoadLoRAAdapter: fails with this status, else adds the adapter to `load.lora_adapters` (digest "d-" + path)
    lora_status: grpc.StatusCode | None = None
    lora_calls: list[str] = field(default_factory=list)  # "load <name>" / "unload <name>", in order
    requests: list[serving_pb2.GenerateRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    changed: threading.Condition = field(default_factory=threading.Condition)
    endpoint: str = ""

    def __post_init__(self) -> None:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        serving_pb2_grpc.add_WorkerServicer_to_server(self, self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"127.0.0.1:{port}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(grace=0).wait()

    def reset(self) -> None:
        self.script = Script()
        self.load = serving_pb2.LoadStats(worker_id=self.worker_id, role=self.role, kv_blocks_free=100,
                                          kv_blocks_total=100)
        self.load_status = None
        self.load_delay_s = 0.0
        self.reset_status = self.reset_reply = None
        self.lora_status = None
        with self.changed:
            self.lora_calls.clear()
            self.requests.clear()
            self.aborts.clear()
            self.cancelled.clear()

    def wait_for(self, predicate, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
        with self.changed:
            return self.changed.wait_for(lambda: predicate(self), timeout_s)

    def _record(self, items: list[str], value: str) -> None:
        with self.changed:
            items.append(value)
            self.changed.notify_all()

    # -- the service --------------------------------------------------------------------------------------------

    def Generate(self, request, context):  # type: ignore[no-untyped-def]
        script = self.script
        with self.changed:
            self.requests.append(request)
            num_calls = len(self.requests)
            self.changed.notify_all()
        state = {"completed": False}

        def on_done() -> None:
            if not state["completed"]:
                self._record(self.cancelled, request.request_id)

        context.add_callback(on_done)
        if script.status is not None and (script.status_times is None or num_calls <= script.status_times):
            state["completed"] = True
            context.abort(script.status, f"scripted {script.status.name}")
        max_tokens = request.params.max_tokens if request.params.HasField("max_tokens") else 1 << 30
        data = script.text.encode()
        num_tokens = min(max_tokens, len(data))
        # n > 1 (best_of): the same text for every choice, one choice after the other, each tagged with its index
        num_choices = request.params.best_of if request.params.HasField("best_of") else max(request.params.n, 1)
        for choice, index in ((c, i) for c in range(num_choices) for i in range(num_tokens)):
            if script.delay_s:
                time.sleep(script.delay_s)
            if script.hang_after is not None and index >= script.hang_after:
                while context.is_active():
                    time.sleep(0.01)
                return
            if not context.is_active():
                return
            if script.cut_after is not None and index >= script.cut_after:
                state["completed"] = True
                context.abort(script.cut_status, "scripted: the worker went away")
            if (script.error_after is not None and index >= script.error_after
                    and (script.error_times is None or num_calls <= script.error_times)):
                state["completed"] = True
                yield serving_pb2.GenerateResponse(request_id=request.request_id, finish_reason="error",
                                                   error="scripted failure")
                return
            if script.abort_after is not None and index >= script.abort_after:
                state["completed"] = True
                yield serving_pb2.GenerateResponse(request_id=request.request_id, finish_reason="abort")
                return
            message = serving_pb2.GenerateResponse(
                request_id=request.request_id,
                token_ids=[NUM_SPECIAL + data[index]],
                text_delta=data[index : index + 1].decode(errors="replace"),
                index=choice,
            )
            if request.params.HasField("logprobs"):
                message.logprobs.append(_logprobs(NUM_SPECIAL + data[index], request.params.logprobs))
            if index == 0 and choice == 0:
                message.timings.CopyFrom(serving_pb2.StageTimings(
                    router_queue_s=request.router_queue_s, decode_queue_s=0.001, prefill_queue_s=0.002,
                    prefill_s=0.003, kv_transfer_s=0.004 if request.prefill_endpoint else 0.0,
                    kv_transfer_bytes=4096 if request.prefill_endpoint else 0))
                if request.params.HasField("prompt_logprobs"):
                    message.prompt_logprobs.extend(_logprobs(token_id, request.params.prompt_logprobs)
                                                   for token_id in request.prompt_token_ids[1:])
            if index == num_tokens - 1:
                message.finish_reason = script.finish_reason or ("length" if num_tokens < len(data) else "stop")
                if script.stop_reason is not None:
                    message.stop_reason.CopyFrom(stop_reason_to_proto(script.stop_reason))
                message.usage.CopyFrom(serving_pb2.Usage(prompt_tokens=len(request.prompt_token_ids),
                                                         completion_tokens=num_tokens * (choice + 1),
                                                         cached_tokens=0))
                state["completed"] = choice == num_choices - 1
            yield message

    def Abort(self, request, context):  # type: ignore[no-untyped-def]
        self._record(self.aborts, request.request_id)
        return serving_pb2.AbortResponse(found=True)

    def Health(self, request, context):  # type: ignore[no-untyped-def]
        if self.health is not None:
            return self.health
        return serving_pb2.HealthResponse(ok=True, worker_id=self.worker_id, role=self.role)

    def GetLoad(self, request, context):  # type: ignore[no-untyped-def]
        if self.load_status is not None:
            context.abort(self.load_status, "scripted GetLoad failure")
        answer = serving_pb2.LoadStats()
        answer.CopyFrom(self.load)
        time.sleep(self.load_delay_s)
        return answer

    def ResetPrefixCache(self, request, context):  # type: ignore[no-untyped-def]
        if self.reset_status is not None:
            context.abort(self.reset_status, "scripted ResetPrefixCache failure")
        return self.reset_reply or serving_pb2.ResetPrefixCacheResponse(reset=True)

    def LoadLoRAAdapter(self, request, context):  # type: ignore[no-untyped-def]
        self._record(self.lora_calls, f"load {request.lora_name}")
        if self.lora_status is not None:
            context.abort(self.lora_status, f"scripted LoadLoRAAdapter failure of {request.lora_name}")
        adapter = serving_pb2.LoRAAdapter(name=request.lora_name, digest=f"d-{request.lora_path}",
                                          path=request.lora_path)
        self.load.lora_adapters.append(adapter)
        return serving_pb2.LoRAAdapterResponse(adapter=adapter)

    def UnloadLoRAAdapter(self, request, context):  # type: ignore[no-untyped-def]
        self._record(self.lora_calls, f"unload {request.lora_name}")
        kept = [a for a in self.load.lora_adapters if a.name != request.lora_name]
        if len(kept) == len(self.load.lora_adapters):
            context.abort(grpc.StatusCode.NOT_FOUND, f"no LoRA adapter named {request.lora_name!r} is loaded")
        del self.load.lora_adapters[:]
        self.load.lora_adapters.extend(kept)
        return serving_pb2.LoRAAdapterResponse()


def _logprobs(token_id: int, num_top: int) -> serving_pb2.TokenLogprobs:
    top = [serving_pb2.TopLogprob(token_id=token_id, logprob=-0.25),
           serving_pb2.TopLogprob(token_id=NUM_SPECIAL + ord("?"), logprob=-1.5),
           serving_pb2.TopLogprob(token_id=NUM_SPECIAL + ord("!"), logprob=-float("inf"))][:num_top]
    return serving_pb2.TokenLogprobs(token_id=token_id, logprob=-0.25, rank=1, top=top)
