"""The single-process engine. One `step()` is the recipe:

    schedule → execute → postprocess → publish stats/events

Requests enter through `add_request` (validated before any block is allocated) and leave finished, aborted or
errored; on every one of those exits the scheduler returns their KV blocks to the pool.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from engine.attention.backend import get_attention_backend
from engine.config import CPU_KV_CACHE_MEMORY_BYTES, EngineConfig, SpeculativeConfig
from engine.core.block_pool import BlockPool
from engine.core.fork import choice_params, choice_request_id, parent_request_id
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.request.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.stats import EngineStats, RequestStats
from engine.cuda_graphs import default_capture_sizes
from engine.device import TORCH_DTYPES, resolve_engine_config
from engine.kernels.registry import load_all
from engine.kv_cache_dtype import kv_block_bytes, kv_namespace_dtype
from engine.loader.checkpoint import Checkpoint, load_checkpoint, load_engine_checkpoint
from engine.memory_profile import GIB, MemoryBaseline, MemoryProfile, num_kv_blocks_for, profile_forward
from engine.model.llama import LlamaModel
from engine.model_runner import ModelRunner
from engine.outputs import RemoteReservation, RequestOutput
from engine.request.logprobs import TokenLogprobs
from engine.output_processor import OutputProcessor
from engine.spec_decode.draft_model_proposer import draft_kv_block_bytes
from engine.spec_decode.speculator import Speculator, make_proposer
from engine.loader.model_identity import model_identity
from kv_transfer.block_hash import BlockHashNamespace
from kv_transfer.kv_events import KVEvent

if TYPE_CHECKING:
    from engine.structured.compiler import GrammarCompilerCache

KVEventSink = Callable[[Sequence[KVEvent]], None]

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        # Device and dtype made concrete first: `--device cuda` without a GPU fails here, before any weight loads.
        self.config = config = resolve_engine_config(config)
        self.device = device = torch.device(config.device)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        dtype = TORCH_DTYPES[config.dtype]
        # On cuda with no KV size given, the KV cache gets what --gpu-memory-utilization leaves after a profile
        # forward (engine/memory_profile.py), measured from here: before any weight of this engine is on the GPU.
        memory_baseline = None
        self.memory_profile: MemoryProfile | None = None  # what the profile measured, where it ran
        if device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory_bytes is None:
            memory_baseline = MemoryBaseline(device, utilization=config.gpu_memory_utilization)
        checkpoint = checkpoint or load_engine_checkpoint(config, device)
        self.model_config = mc = checkpoint.config
        self.tokenizer = checkpoint.tokenizer

        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's context length {mc.max_position_embeddings}"
            )
        block_bytes = kv_block_bytes(mc, config.block_size, dtype, config.kv_cache_dtype)
        spec = config.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)  # EngineConfig turns a dict into one
        if spec is not None and spec.method in ("draft_model", "layer_skip") and device.type != "cpu":
            raise ValueError(f"speculative method {spec.method!r} runs on cpu only so far (its drafter builds its "
                             "step on the host); ngram runs on any device")
        draft_checkpoint = None
        if spec is not None and spec.method == "draft_model":  # its KV blocks come out of the same memory
            assert spec.model is not None
            draft_checkpoint = load_checkpoint(spec.model, dtype=dtype)
            block_bytes += draft_kv_block_bytes(draft_checkpoint, config.block_size, dtype.itemsize)
        if memory_baseline is None:  # else set once the model is on the GPU and profiled
            kv_cache_memory = config.kv_cache_memory_bytes or CPU_KV_CACHE_MEMORY_BYTES
            self.num_kv_blocks = config.num_kv_blocks or kv_cache_memory // block_bytes
            if self.num_kv_blocks * config.block_size < self.max_model_len:
                raise ValueError(
                    f"the KV cache ({self.num_kv_blocks} blocks of {config.block_size} tokens) cannot hold one request "
                    f"of max_model_len={self.max_model_len} tokens: raise --num-kv-blocks or lower --max-model-len"
                )

        # The C++ kernels load here (and build here only on a machine nobody built them for), never inside the
        # first request's forward pass.
        self.cpu_kernels = load_all() if device.type == "cpu" else []
        attention = get_attention_backend(config.attention_backend, scale=mc.head_dim**-0.5, device=device,
                                          kv_cache_dtype=config.kv_cache_dtype)
        self.attention_backend_name = attention.name
        logger.info("engine on %s, %s, KV cache %s, attention backend %s", device, config.dtype,
                    config.kv_cache_dtype, attention.name)
        weights = checkpoint.weights
        if device.type != "cpu" or any(t.dtype != dtype for t in weights.values()):
            # A copy per engine (the checkpoint's CPU tensors may be shared by other engines), in the engine's
            # dtype: a checkpoint passed in may have been loaded in another (e.g. float32 with dtype "auto" on cuda).
            weights = {name: tensor.to(device=device, dtype=dtype) for name, tensor in weights.items()}
        model = LlamaModel(mc, weights, attention, max_positions=self.max_model_len)
        if memory_baseline is not None:
            # Only what the model holds stays on the device before the profile counts the weights: the unfused
            # q/k/v and gate/up tensors the model concatenated go now, not when __init__ returns.
            del weights
            checkpoint = dataclasses.replace(checkpoint, weights={})
            self.num_kv_blocks = self._profiled_num_kv_blocks(model, memory_baseline, block_bytes)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", self.num_kv_blocks, config.block_size,
                    self.num_kv_blocks * block_bytes / GIB)
        self.block_pool = BlockPool(self.num_kv_blocks, enable_caching=config.enable_prefix_caching)
        self.kv_cache = KVCacheManager(
            self.block_pool, block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
            ),
            self.kv_cache,
        )
        self.runner = ModelRunner(model, num_blocks=self.num_kv_blocks, block_size=config.block_size, seed=config.seed,
                                  kv_cache_dtype=config.kv_cache_dtype)
        # None: no CUDA graphs (cpu, --enforce-eager, or a backend whose kernels a graph cannot hold)
        self.cuda_graph_capture_seconds: float | None = None
        if device.type == "cuda" and not config.enforce_eager:
            if attention.name == "triton" and config.kv_cache_dtype == "auto":
                self.cuda_graph_capture_seconds = self.runner.capture_cuda_graphs(
                    max_seq_len=min(self.max_model_len, config.max_seq_len_to_capture),
                    sizes=list(config.cuda_graph_sizes or default_capture_sizes(config.max_num_seqs)))
            else:
                logger.info("CUDA graphs off: the %s attention backend with a %s KV cache runs eagerly",
                            attention.name, config.kv_cache_dtype)
        self.hash_namespace = BlockHashNamespace(
            model=config.model_id or checkpoint.model_id or model_identity(checkpoint.path),
            block_size=config.block_size, kv_dtype=kv_namespace_dtype(config.dtype, config.kv_cache_dtype))
        self.speculator: Speculator | None = None
        if spec is not None:
            proposer = make_proposer(spec, self.runner, draft_checkpoint=draft_checkpoint,
                                     max_model_len=self.max_model_len, attention_backend=config.attention_backend)
            self.speculator = Speculator(spec, proposer, token_budget=config.max_num_batched_tokens)
        self.outputs = OutputProcessor(self.tokenizer)
        self._counters = EngineStats()
        self._finished_stats: deque[RequestStats] = deque(maxlen=100_000)  # drained by stats()
        # Where the block pool's KV events go after each step (a worker's prefix index publisher); None: dropped.
        self.kv_event_sink: KVEventSink | None = None
        self.num_scheduled_last_step = 0  # requests the last step() ran; 0: it could run nothing
        # Structured outputs: xgrammar loads with the first request that has a grammar (see grammar_compilers).
        self._grammar_compilers: GrammarCompilerCache | None = None
        self._grammar_lock = threading.Lock()
        self._children: dict[str, list[str]] = {}  # n > 1: a request's other choices that have not finished

    def _profiled_num_kv_blocks(self, model: LlamaModel, baseline: MemoryBaseline, block_bytes: int) -> int:
        """The KV blocks --gpu-memory-utilization leaves once a profile forward of the largest step has run."""
        config = self.config
        baseline.weights_loaded()
        spec = config.speculative_config
        num_spec = spec.num_speculative_tokens if isinstance(spec, SpeculativeConfig) else 0
        profile_forward(model, num_tokens=config.max_num_batched_tokens, max_model_len=self.max_model_len,
                        num_logit_rows=config.max_num_seqs * (1 + num_spec), block_size=config.block_size,
                        kv_cache_dtype=config.kv_cache_dtype)
        self.memory_profile = profile = baseline.measure()
        num_blocks = num_kv_blocks_for(profile, utilization=config.gpu_memory_utilization, block_bytes=block_bytes,
                                       block_size=config.block_size, max_model_len=self.max_model_len)
        logger.info("GPU memory: %.2f GiB total × utilization %s; weights %.2f GiB, profile peak %.2f GiB, "
                    "outside torch %.2f GiB", profile.total_bytes / GIB, config.gpu_memory_utilization,
                    profile.weights_bytes / GIB, profile.peak_torch_bytes / GIB, profile.non_torch_bytes / GIB)
        return num_blocks

    # -- requests --------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams) -> Request:
        """Validate and queue a request. Raises ValueError naming the problem; allocates nothing on failure."""
        request = self.make_request(request_id, prompt, params)
        self.enqueue(request)
        return request

    def make_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, *, remote_decode: bool = False
    ) -> Request:
        """Validate and tokenize a request without queueing it: the engine is left untouched, so a caller can
        check a whole batch before queueing any of it. Raises ValueError naming the problem.

        A request with `structured_outputs` has its grammar compiled here (a schema that does not compile is a
        ValueError), which can take a second: callers on an event loop run this on a worker thread."""
        params.validate()
        if params.structured_outputs is not None:
            self.grammar_compilers().compile(params.structured_outputs)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            try:  # an int-like id (numpy's too) is taken; a float or str would fail later, inside a shared step
                prompt_ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise ValueError(f"a prompt is text or a sequence of integer token ids, got {prompt!r:.100}") from None
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        bad = [t for t in params.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids out of range [0, {vocab}): {bad[:5]}")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, which leaves no room to generate within "
                f"max_model_len={self.max_model_len}"
            )
        room = self.max_model_len - len(prompt_ids)
        eos = tuple(self.tokenizer.eos_token_ids)
        # n > 1 (best_of): the other choices wait on choice 0 until its prompt is computed (engine/core/fork.py).
        # A prefill worker computes only choice 0's prompt and first token; its decode worker forks the rest.
        num_sequences = 1 if remote_decode else params.num_sequences
        requests = [
            Request(
                choice_request_id(request_id, index),
                prompt_ids,
                choice_params(params, index) if params.num_sequences > 1 else params,
                eos_token_ids=eos,
                max_tokens=min(params.max_tokens or room, room),
                hash_namespace=self.hash_namespace if self.config.enable_prefix_caching else None,
                remote_decode=remote_decode,
                index=index,
            )
            for index in range(num_sequences)
        ]
        requests[0].pending_forks = requests[1:]
        return requests[0]

    def grammar_compilers(self) -> GrammarCompilerCache:
        """The engine's grammar compiler cache, made (and its matchers given to the runner) on first use, from
        any thread."""
        with self._grammar_lock:
            if self._grammar_compilers is None:
                from engine.structured.compiler import GrammarCompilerCache
                from engine.structured.matchers import GrammarMatchers

                compilers = GrammarCompilerCache(self.tokenizer, vocab_size=self.model_config.vocab_size)
                self.runner.grammars = GrammarMatchers(compilers)
                self._grammar_compilers = compilers
            return self._grammar_compilers

    def enqueue(self, request: Request) -> None:
        """Queue a request from `make_request`. Raises ValueError (and queues nothing) if its id is in use."""
        for child in request.pending_forks:
            if child.request_id in self.scheduler.requests:
                raise ValueError(f"request id {child.request_id!r} is already in use")
        self.scheduler.add_request(request)
        self._add_outputs(request)
        self._counters.num_prompt_tokens += request.num_prompt_tokens

    def _add_outputs(self, request: Request) -> None:
        """Output state for a request and its pending choices; the engine aborts them with it (`_children`)."""
        self.outputs.add(request)
        for child in request.pending_forks:
            self.outputs.add(child)
        if request.pending_forks:
            self._children[request.request_id] = [child.request_id for child in request.pending_forks]

    def abort_request(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """Abort requests, each with every choice of it (n > 1) still running."""
        outs = []
        for request_id in request_ids:
            if self.scheduler.release_held(request_id):  # its output already went out as "prefilled"
                continue
            for choice_id in [request_id, *self._children.get(request_id, ())]:
                request = self.scheduler.finish_request(choice_id, RequestStatus.FINISHED_ABORTED)
                if request is not None:
                    outs.extend(self._finish_with_choices(request))
        return outs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_schedulable_requests(self) -> bool:
        return self.scheduler.has_schedulable_requests()

    # -- disaggregation: the prefill side holds, the decode side reserves and commits -------------------------
    def held_block_ids(self, request_id: str) -> list[int]:
        """The block table of a prefilled request whose KV is being handed off."""
        if request_id not in self.scheduler.held:
            raise KeyError(f"request {request_id!r} holds no KV blocks")
        return self.kv_cache.block_ids(request_id)

    def release_held(self, request_id: str) -> bool:
        """End a prefilled request's KV handoff: its blocks go back (full ones stay as prefix cache)."""
        released = self.scheduler.release_held(request_id)
        self.publish_kv_events()
        return released

    def reserve_remote(self, request: Request) -> RemoteReservation | None:
        """Reserve blocks for a request whose prompt KV a prefill worker will send (all but its prefix cached
        here); None (nothing allocated) if the pool cannot hold it now. Undo with `abort_request`."""
        for child in request.pending_forks:
            if child.request_id in self.scheduler.requests:
                raise ValueError(f"request id {child.request_id!r} is already in use")
        if not self.scheduler.reserve_remote(request):
            return None
        self._add_outputs(request)
        self._counters.num_prompt_tokens += request.num_prompt_tokens
        return RemoteReservation(block_ids=self.kv_cache.block_ids(request.request_id),
                                 num_held_blocks=self.kv_cache.num_cached_blocks(request.request_id))

    def commit_remote(
        self, request_id: str, first_token_id: int, logprobs: TokenLogprobs | None, num_cached_tokens: int = 0
    ) -> RequestOutput:
        """The reserved blocks now hold the prompt's KV: queue the request for decode with its first token."""
        request = self.scheduler.requests[request_id]
        request.num_cached_tokens = num_cached_tokens
        self.runner.skip_remote_draw(request)
        self.scheduler.commit_remote(request, first_token_id)
        outs = self._postprocess(
            [(request, first_token_id)], {request_id: [logprobs]} if logprobs else {}, time.monotonic()
        )
        self.publish_kv_events()
        return outs[0]

    def prefill_choices_here(self, request_id: str) -> None:
        """n > 1, disaggregated: the prefill worker ended choice 0 on its first token and sent no KV. Its
        reservation goes back, and the other choices compute the prompt here: the first of them prefills it,
        the rest fork off it (engine/core/fork.py). Choice 0's output is the caller's (the prefill worker's
        reply); its state here is dropped."""
        parent = self.scheduler.requests[request_id]
        children, parent.pending_forks = parent.pending_forks, []
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_STOPPED)
        self._finish(parent)
        if children:
            children[0].pending_forks = children[1:]
            self.scheduler.add_request(children[0])

    # -- the step --------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.speculator is not None:  # drafts wait on the requests for the scheduler to take as extra tokens
            self.speculator.propose(self.scheduler.running, self.scheduler.waiting)
        scheduled = self.scheduler.schedule()
        self.num_scheduled_last_step = len(scheduled.scheduled)
        if scheduled.is_empty:  # e.g. every waiting request needs blocks that only a finish or an abort frees
            return []
        try:
            if self.speculator is not None:
                self.speculator.draft(scheduled)  # a model proposer drafts into the slots just allocated
            start_s = time.perf_counter()
            sampled, logprobs, prompt_logprobs = self.runner.execute(scheduled)
            if self.speculator is not None:
                self.speculator.observe_step(scheduled, sampled, time.perf_counter() - start_s)
        except Exception as exc:  # a failed step must not strand its requests' blocks
            logger.exception("engine step failed")
            outs = []
            for item in scheduled.scheduled:
                request = self.scheduler.finish_request(item.request.request_id, RequestStatus.FINISHED_ERROR)
                if request is not None:
                    outs.extend(self._finish_with_choices(request, error=f"engine step failed: {exc}"))
            return outs
        # The tokens exist from here: stamped before update_from_output, which stamps finish times, so that a
        # request finishing on its first token never reports a ttft longer than its e2e latency.
        sampled_s = time.monotonic()
        self._record_prompt_logprobs(prompt_logprobs)
        produced = self.scheduler.update_from_output(scheduled, sampled)
        outs = self._postprocess(produced, logprobs, sampled_s)
        self.publish_kv_events()
        return outs

    def _record_prompt_logprobs(self, prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]]) -> None:
        """Keep the step's prompt logprobs on their requests; positions already recorded (a prompt recomputed
        after a preemption) are not recorded twice."""
        for request_id, (start, entries) in prompt_logprobs.items():
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue
            skip = len(request.prompt_logprobs) - start
            if skip >= 0:
                request.prompt_logprobs.extend(entries[skip:])

    def _postprocess(
        self, produced: list[tuple[Request, int]], logprobs: dict[str, list[TokenLogprobs]], sampled_s: float
    ) -> list[RequestOutput]:
        """Detokenize the step's tokens (several per request when drafts were accepted) and check stop strings;
        one output per request that produced tokens."""
        outs = []
        self._counters.num_generation_tokens += len(produced)
        by_request: dict[str, list[int]] = {}
        requests: list[Request] = []
        for request, token_id in produced:
            if request.request_id not in by_request:
                by_request[request.request_id] = []
                requests.append(request)
            by_request[request.request_id].append(token_id)
        for request in requests:
            token_ids = by_request[request.request_id]
            if request.times.first_token_s is None:
                request.times.first_token_s = sampled_s
            request.times.last_token_s = sampled_s
            token_logprobs = logprobs.get(request.request_id)
            num_output_before = request.num_output_tokens - len(token_ids)
            for i, token_id in enumerate(token_ids):
                stop_string = self.outputs.append_token(
                    request, token_id, token_logprobs[i] if token_logprobs else None
                )
                if stop_string is None:
                    continue
                # The text is cut at the stop string, so that is why the request ended, even when the same token
                # also reached max_tokens or was a stop token id (vLLM's rule too). Tokens after it are dropped.
                self._counters.num_generation_tokens -= len(token_ids) - i - 1
                request.truncate_output(num_output_before + i + 1)
                request.stop_reason = stop_string
                if request.is_finished:
                    self.scheduler.release_held(request.request_id)  # a prefilled request needs no handoff now
                    request.status = RequestStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                break
            outs.append(self._finish(request) if request.is_finished else self.outputs.snapshot(request))
        return outs

    def _finish_with_choices(self, request: Request, error: str | None = None) -> list[RequestOutput]:
        """The final output of a request ended from outside a step (abort, failed step), and of its choices not
        forked yet (its prompt never finished): they end the same way, having held no block."""
        pending, request.pending_forks = request.pending_forks, []
        outs = [self._finish(request, error)]
        for child in pending:
            child.status = request.status
            outs.append(self._finish(child, error))
        return outs

    def _finish(self, request: Request, error: str | None = None) -> RequestOutput:
        parent_id = parent_request_id(request.request_id, request.index)
        children = self._children.get(parent_id)
        if children is not None and request.index:
            children.remove(request.request_id)
        if children is not None and not children:
            del self._children[parent_id]
        self.runner.release(request.request_id)
        if self.speculator is not None:
            self.speculator.release(request.request_id)
        stats = RequestStats.of(request)
        self._finished_stats.append(stats)
        return self.outputs.finish(request, stats, error)

    # -- observability ---------------------------------------------------------------------------------------
    def publish_kv_events(self) -> None:
        """The recipe's last step (and after anything that changes the cache outside a step: the serving loop
        calls it after every command): the block pool's events go to `kv_event_sink`, or are dropped, so that
        nothing accumulates."""
        events = self.block_pool.take_events()
        if events and self.kv_event_sink is not None:
            self.kv_event_sink(events)

    def stats(self) -> EngineStats:
        """Gauges now, counters since start; finished-request stats since the previous call."""
        finished = list(self._finished_stats)
        self._finished_stats.clear()
        return EngineStats(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.block_pool.num_used_blocks,
            kv_blocks_free=self.block_pool.num_free_blocks,
            kv_cache_usage=self.block_pool.usage,
            prefix_cache_queries=self.kv_cache.prefix_queries_tokens,
            prefix_cache_hits=self.kv_cache.prefix_hits_tokens,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self._counters.num_prompt_tokens,
            num_generation_tokens=self._counters.num_generation_tokens,
            finished=finished,
            **self._spec_decode_stats(),
        )

    def _spec_decode_stats(self) -> dict[str, object]:
        spec = self.speculator
        if spec is None:
            return {}
        return dict(
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos),
            spec_decode_chosen_k=dict(sorted(spec.chosen_k.items())),
        )
