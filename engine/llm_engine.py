"""The engine: one model, continuous batching, on the thread that calls it. `step()` is the recipe:

    propose drafts → schedule → execute (drafts verified) → update the requests → postprocess → publish KV events

With async scheduling (`--async-scheduling`, engine/core/overlap.py) execute splits in two, launch and read, and
a step reads the one launched before it once its own is launched: the host updates, detokenizes and streams step N
while the device runs step N+1, whose placeholders are N's tokens, still on the device. `step()` then returns step
N's outputs (the first call after a pause returns none: its step is in flight), in step order as without; a step
that cannot overlap reads the one before it first.

Its parts are assembled once (engine/engine_builder.py); the step only runs them. Requests enter through
`add_request` (`make_request` + `enqueue`; on a decode worker `reserve_remote` + `commit_remote`), validated by
the input processor before any block is allocated, and leave finished, aborted or errored; on every one of
those exits the scheduler returns their KV blocks to the pool and the output processor hands out their last
output. The workers read it through `stats()`, `kv_blocks` and the methods below, never its parts.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.core.block_pool import BlockPool, KVBlock
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_tier_events import TieredEvents
from engine.core.request import Request, RequestStatus
from engine.request.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.core.stats import EngineStats, RequestStats, requests_by_adapter
from engine.core.waiting_reservations import WaitingReservations
from engine.engine_builder import build_engine_parts, kv_layout, rank_caches_of
from engine.input_processor import InputProcessor
from engine.kv_blocks import KVBlocks
from engine.kv_peer_blocks import PeerBlocks, TierChain
from engine.launched_step import LaunchedStep
from engine.loader.checkpoint import Checkpoint
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RemoteReservation, RequestOutput
from engine.request.logprobs import TokenLogprobs
from engine.spec_decode.speculator import NullSpeculator
from kv_transfer.block_hash import BlockHash
from kv_transfer.kv_events import DEVICE, KVEvent
from kv_transfer.layout import KVLayout
from kv_transfer.whole_blocks import WholeBlocks

if TYPE_CHECKING:
    import torch

KVEventSink = Callable[[Sequence[KVEvent]], None]

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step whose output is not read yet."""

    scheduled: SchedulerOutput
    launched: LaunchedStep
    started_s: float  # time.perf_counter() at its launch


class LLMEngine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None) -> None:
        """The parts the step runs on, assembled once (engine/engine_builder.py), and the control plane around them.
        Raises ValueError for a config the model or the device cannot run."""
        parts = build_engine_parts(config, checkpoint)
        self.config = config = parts.config  # device and dtype concrete
        self.device, self.model_config, self.tokenizer = parts.device, parts.model_config, parts.tokenizer
        self.max_model_len, self.num_kv_blocks = parts.max_model_len, parts.num_kv_blocks
        self.hash_namespace, self.runner, self.speculator = parts.hash_namespace, parts.runner, parts.speculator
        self.loras = parts.loras  # the LoRA adapters requests may name (--enable-lora); None: off
        # What a worker's KV handoff moves, and how it names it.
        self.kv_blocks = _kv_blocks(self.runner, kv_layout(self.model_config, config))
        # What start-up found: the cuda memory profile (None: not profiled), the C++ kernels loaded (cpu), the
        # attention backend, the seconds CUDA-graph capture took (None: no graphs).
        self.memory_profile, self.cpu_kernels = parts.memory_profile, parts.cpu_kernels
        self.attention_backend_name = parts.attention_backend_name
        self.cuda_graph_capture_seconds = parts.cuda_graph_capture_seconds
        self._shutdown = parts.shutdown  # its tensor-parallel ranks' (engine/distributed/), if any

        self.block_pool = BlockPool(self.num_kv_blocks, enable_caching=config.enable_prefix_caching)
        # The tier below the KV cache (--kv-offload-dir): evicted blocks go down, lookups that miss load them back,
        # and the KV events speak for the device cache and the tier together (engine/core/kv_tier_events.py).
        self.kv_tier = parts.kv_tier
        self._tier_events: TieredEvents | None = None
        if self.kv_tier is not None:
            self.block_pool.on_evict = self.kv_tier.on_evict
            self._tier_events = TieredEvents(self._on_device, self.kv_tier.__contains__, tier=self.kv_tier.kind,
                                             announced=self.kv_tier.tier.hashes())
        # Blocks fetched from a peer worker for a prompt about to be admitted (engine/kv_peer_blocks.py), looked up
        # before the offload tier; and the device blocks peers fetch from this one, pinned while they are sent.
        # At TP > 1 peers' blocks are staged whole and loaded into every rank's cache (mapped here: shared memory on
        # cpu, CUDA IPC on cuda).
        blocks = self.kv_blocks
        whole = None
        if blocks.layout.tensor_parallel_size > 1 and blocks.ranks is not None:
            whole = WholeBlocks(blocks.layout, blocks.ranks)
        self.peer_blocks = PeerBlocks(self.runner.kv_cache, self.runner.kv_scales, whole=whole)
        self._tiers = TierChain([self.peer_blocks, *([self.kv_tier] if self.kv_tier is not None else [])])
        self._pinned: dict[str, list[KVBlock]] = {}
        # Held by whoever touches the engine (a step, a worker's command), and let go while a step computes: what
        # touches only the block pool and the staged peer blocks (a peer's pin) may then take it instead of waiting
        # for the step to end (worker/engine_loop.py's `call_now`). Reentrant: a command may step.
        self.lock = threading.RLock()
        self.kv_cache = KVCacheManager(
            self.block_pool, block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            tier=self._tiers,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                policy=config.scheduling_policy,
                max_loras=config.max_loras,
            ),
            self.kv_cache,
        )
        self.inputs = InputProcessor(
            self.tokenizer, vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
            scheduling_policy=config.scheduling_policy, max_logprobs=config.max_logprobs,
            hash_namespace=self.hash_namespace if config.enable_prefix_caching else None,
            use_grammars=self.runner.use_grammars, loras=self.loras)
        self.outputs = OutputProcessor(self.tokenizer)
        self._num_prompt_tokens = 0  # of every request queued or reserved, since start
        self._finished_stats: deque[RequestStats] = deque(maxlen=100_000)  # drained by stats()
        self.kv_event_sink: KVEventSink | None = None  # where each step's KV events go (None: dropped)
        self.num_scheduled_last_step = 0  # requests the last step() launched or read; 0: it could do nothing
        # Async scheduling, where it can hold: speculative decoding runs every step synchronously (overlap.py).
        self.async_scheduling = bool(config.async_scheduling) and isinstance(self.speculator, NullSpeculator)
        self._in_flight: _InFlight | None = None  # the step launched and not read yet (async scheduling)
        self._drained_outputs: list[RequestOutput] = []  # of a step in flight read early (`_drain_in_flight`)
        self._stepping = False  # a step runs: what takes the lock meanwhile (call_now) runs while it computes
        self._waiting_reservations = (WaitingReservations()  # priority: reservations refused for want of blocks
                                      if config.scheduling_policy == "priority" else None)

    def close(self) -> None:
        """Stop the processes the engine runs beside its own (its tensor-parallel ranks; none at TP 1) and its KV
        tier (`close_kv_tier`): it cannot step afterwards. Idempotent; at TP > 1 the ranks also stop when the
        engine is collected or its process ends."""
        self.close_kv_tier()
        self._shutdown()

    def rank_pids(self) -> list[int]:
        """The processes of its tensor-parallel ranks 1..N-1 (rank 0 is this one); [] at TP 1."""
        ranks = getattr(self.runner.model, "ranks", None)
        return [] if ranks is None else ranks.pids

    def rank_lanes(self):  # noqa: ANN201 - kv_transfer.rank_lanes.RankLanes | None
        """Rank 0's control of its children's KV lanes (kv_transfer/rank_lanes.py); None at TP 1."""
        ranks = getattr(self.runner.model, "ranks", None)
        return None if ranks is None else ranks.lanes

    def rank_stats(self) -> list[RankStats]:
        """Each tensor-parallel rank's process, weight bytes and KV cache bytes, rank 0 first (one at TP 1)."""
        import os

        from engine.distributed.rank_worker import model_weight_bytes

        model = self.runner.model
        ranks = getattr(model, "ranks", None)
        local = getattr(model, "local", model)  # rank 0's shard of a TensorParallelModel
        kv_bytes = sum(t.numel() * t.element_size() for t in (self.runner.kv_cache, self.runner.kv_scales)
                       if t is not None)
        stats = [RankStats(rank=0, pid=os.getpid(), weight_bytes=model_weight_bytes(local), kv_cache_bytes=kv_bytes)]
        if ranks is not None:
            stats += [RankStats(rank=rank, pid=pid, weight_bytes=ready.weight_bytes,
                                kv_cache_bytes=ready.kv_cache_bytes)
                      for rank, (pid, ready) in enumerate(zip(ranks.pids, ranks.ready, strict=True), start=1)]
        return stats

    def failure(self) -> str | None:
        """Why the engine can run no further step (a tensor-parallel rank died, or its group failed); None while
        it can. Answers from any thread, at once."""
        ranks = getattr(self.runner.model, "ranks", None)  # a TensorParallelModel's RankGroup
        return None if ranks is None else ranks.dead()

    def close_kv_tier(self) -> None:
        """Write the blocks the device prefix cache holds down to the KV offload tier, for 10 s at most (a restart
        on the same --kv-offload-dir finds them), then stop its writer and free its slot of the directory; the
        engine then runs without a tier. Call it on the engine's thread, or once it steps no more. Idempotent; a
        no-op without a tier."""
        tier = self.kv_tier
        if tier is None:
            return
        cached = [(block.block_id, block_hash) for block_hash in self.block_pool.cached_block_hashes()
                  if (block := self.block_pool.get_cached_block(block_hash)) is not None]
        tier.write_back(cached, timeout_s=10.0)
        tier.close()
        self.kv_tier = None
        self._tiers = self._tiers.without(tier)
        if self.kv_cache.tier is not None:
            self.kv_cache.tier = self._tiers
        self.block_pool.on_evict = None
        self._tier_events = None

    # -- requests --------------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, *,
                    lora_name: str | None = None) -> Request:
        """Validate and queue a request. Raises ValueError naming the problem; allocates nothing on failure."""
        request = self.make_request(request_id, prompt, params, lora_name=lora_name)
        self.enqueue(request)
        return request

    def make_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams, *,
                     remote_decode: bool = False, lora_name: str | None = None) -> Request:
        """Validate and tokenize a request without queueing it (engine/input_processor.py): the engine is left
        untouched, so a caller can check a whole batch before queueing any of it. Raises ValueError naming the
        problem. A grammar is compiled here, which can take a second: callers on an event loop run this on a
        worker thread."""
        return self.inputs.make_request(request_id, prompt, params, remote_decode=remote_decode, lora_name=lora_name)

    def enqueue(self, request: Request) -> None:
        """Queue a request from `make_request`. Raises ValueError (and queues nothing) if its id is in use."""
        self._check_choice_ids_free(request)
        self.scheduler.add_request(request)
        self.outputs.add(request)
        self._num_prompt_tokens += request.num_prompt_tokens

    def _check_choice_ids_free(self, request: Request) -> None:
        """ValueError if the id of a choice `request` will fork (n > 1) is in use (the scheduler checks its own)."""
        for child in request.pending_forks:
            if child.request_id in self.scheduler.requests:
                raise ValueError(f"request id {child.request_id!r} is already in use")

    def abort_request(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """Abort requests, each with every choice of it (n > 1) still running."""
        outs = []
        for request_id in request_ids:
            if self.scheduler.release_held(request_id):  # its output already went out as "prefilled"
                continue
            for choice_id in self.outputs.choice_ids(request_id):
                request = self.scheduler.finish_request(choice_id, RequestStatus.FINISHED_ABORTED)
                if request is not None:
                    outs.extend(self._finish_with_choices(request))
        return outs

    def abort_all(self) -> list[RequestOutput]:
        """Abort every request, the held ones (prefilled, their KV being handed off) included: all their blocks go
        back (a worker stopping)."""
        return self.abort_request([*self.scheduler.requests, *self.scheduler.held])

    def has_unfinished_requests(self) -> bool:
        """Requests not finished, or outputs the next step returns. A step in flight (async scheduling) holds only
        running ones, or finished ones whose tokens in it are discarded when read (their blocks went back)."""
        return self.scheduler.has_unfinished_requests() or bool(self._drained_outputs)

    def has_schedulable_requests(self) -> bool:
        """Anything a step could run (requests waiting for remote KV are not), or outputs a step would return."""
        return self.scheduler.has_schedulable_requests() or bool(self._drained_outputs)

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

    # -- peer fetch: the holder pins and sends, the fetcher stages (worker/peer_fetch.py) -------------------------
    def pin_cached_blocks(self, pin_id: str, block_hashes: Sequence[BlockHash]) -> list[int] | None:
        """Pin the device blocks holding `block_hashes` (every one must be in the device prefix cache, else None and
        nothing pinned) so that no allocation evicts them while a peer reads them; their ids, in order. Undo with
        `unpin_blocks(pin_id)`."""
        if pin_id in self._pinned:
            raise ValueError(f"blocks are pinned under {pin_id!r} already")
        blocks = [self.block_pool.get_cached_block(h) for h in block_hashes]
        if not blocks or any(block is None for block in blocks):
            return None
        found = [block for block in blocks if block is not None]
        self.block_pool.touch(found)
        self._pinned[pin_id] = found
        return [block.block_id for block in found]

    def unpin_blocks(self, pin_id: str) -> bool:
        """Release what `pin_cached_blocks(pin_id)` pinned (the blocks stay prefix cache); False if nothing was."""
        blocks = self._pinned.pop(pin_id, None)
        if blocks is None:
            return False
        self.block_pool.free(reversed(blocks))
        return True

    def num_leading_blocks_held(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of `block_hashes`, from the first, this engine can serve without computing them: on the
        device, in its offload tier, or staged from a peer."""
        for index, block_hash in enumerate(block_hashes):
            if not (self._holds(block_hash) or block_hash in self.peer_blocks):
                return index
        return len(block_hashes)

    def stage_peer_blocks(self, block_hashes: Sequence[BlockHash], kv: torch.Tensor,
                          scales: torch.Tensor | None) -> None:
        """Blocks fetched from a peer, loadable by the next admission of a prompt they begin (PeerBlocks.stage)."""
        self.peer_blocks.stage(block_hashes, kv, scales)

    def unstage_peer_blocks(self, block_hashes: Sequence[BlockHash]) -> None:
        self.peer_blocks.unstage(block_hashes)

    def reserve_remote(self, request: Request, *, preempt: bool = False) -> RemoteReservation | None:
        """Reserve blocks for a request whose prompt KV a prefill worker will send (all but its prefix cached
        here); None (nothing allocated) if the pool cannot hold it now. Undo with `abort_request`. `preempt`
        (priority policy; between steps, not from `call_now`): running requests it outranks may give their blocks
        up for it, once a step in flight (async scheduling), which may still write their KV, has been read (its
        outputs go with the next step's). One a waiting reservation outranks is refused (waiting_reservations.py)."""
        self._check_choice_ids_free(request)
        preempt = preempt and not self._stepping  # never from inside a step (call_now): its requests are in use
        drain = self._drain_in_flight if self._in_flight is not None else None
        reserve = functools.partial(self.scheduler.reserve_remote, request, preempt=preempt, before_preempting=drain)
        waiting = self._waiting_reservations
        if not (reserve() if waiting is None else waiting.attempt(request.request_id,
                                                                  request.sampling_params.priority, reserve)):
            return None
        self.outputs.add(request)
        self._num_prompt_tokens += request.num_prompt_tokens
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
        """Run one step of the recipe; the outputs of the requests that produced tokens or ended in it. With async
        scheduling: launch a step, then read the one launched before it, whose outputs these are. Under `lock`,
        which it lets go of while the step computes (`_computing`)."""
        with self.lock:
            self._stepping = True
            try:
                return self._step()
            finally:
                self._stepping = False

    @contextlib.contextmanager
    def _computing(self):  # noqa: ANN202
        """The model's forward (and the draft's, and the wait for the device): `lock` is free meanwhile. Nothing
        that runs under it elsewhere may touch the step's requests, the runner or the cache rows being written."""
        self.lock.release()
        try:
            yield
        finally:
            self.lock.acquire()

    def _drain_in_flight(self) -> None:
        """Read the step in flight now (async scheduling), between steps; its outputs go out with the next step's."""
        with self.lock:  # `_read` lets it go while it waits for the device: held here, whoever called
            step, self._in_flight = self._in_flight, None
            if step is not None:
                self._drained_outputs += self._read(step)

    def _step(self) -> list[RequestOutput]:
        previous = self._in_flight  # cleared once read: a schedule that raises leaves it for the next step
        outs: list[RequestOutput] = []
        num_read = 0
        if previous is not None and not self.scheduler.can_schedule_ahead(previous.scheduled):
            self._in_flight = None
            outs, num_read, previous = self._read(previous), len(previous.scheduled.scheduled), None
        # Drafts wait on the requests for the scheduler to take as extra tokens (none without speculation).
        self.speculator.propose(self.scheduler.running, self.scheduler.waiting)
        scheduled = self.scheduler.schedule(in_flight=None if previous is None else previous.scheduled)
        launched = None
        if not scheduled.is_empty:
            try:
                launched = self._launch(scheduled)
            except Exception as exc:  # a failed step must not strand its requests' blocks
                logger.exception("engine step failed")
                outs += self._fail(scheduled, exc)
        if previous is not None:
            self._in_flight = None
            outs += self._read(previous)
            num_read += len(previous.scheduled.scheduled)
        if launched is not None:
            if self.async_scheduling:
                self._in_flight = launched
            else:
                outs += self._read(launched)
        self.num_scheduled_last_step = len(scheduled.scheduled) + num_read
        self.publish_kv_events()
        if self._drained_outputs:  # a step read early for a preempting reservation: its outputs come first
            outs, self._drained_outputs = self._drained_outputs + outs, []
        return outs

    def _launch(self, scheduled: SchedulerOutput) -> _InFlight:
        """Queue the step on the device."""
        with self._computing():
            self.speculator.draft(scheduled)  # a model proposer drafts into the slots just allocated
            started_s = time.perf_counter()
            return _InFlight(scheduled, self.runner.launch(scheduled), started_s)

    def _read(self, step: _InFlight) -> list[RequestOutput]:
        """Read a launched step's tokens and update, postprocess and output its requests (those finished since it
        was launched, its tokens for them are discarded)."""
        try:
            with self._computing():
                sampled, logprobs, prompt_logprobs = step.launched.result()
            self.speculator.observe_step(step.scheduled, sampled, time.perf_counter() - step.started_s)
        except Exception as exc:
            logger.exception("engine step failed")
            return self._fail(step.scheduled, exc)
        # The tokens exist from here: stamped before update_from_output, which stamps finish times, so that a
        # request finishing on its first token never reports a ttft longer than its e2e latency.
        sampled_s = time.monotonic()
        self.outputs.record_prompt_logprobs(prompt_logprobs, self.scheduler.requests)
        produced = self.scheduler.update_from_output(step.scheduled, sampled)
        return self._postprocess(produced, logprobs, sampled_s)

    def _fail(self, scheduled: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """End a failed step's requests (those still running) with an error: their blocks go back."""
        outs = []
        for item in scheduled.scheduled:
            request_id = item.request.request_id
            if self.scheduler.requests.get(request_id) is not item.request:
                continue  # finished since the step was launched
            request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            if request is not None:
                outs.extend(self._finish_with_choices(request, error=f"engine step failed: {exc}"))
        return outs

    def _postprocess(
        self, produced: list[tuple[Request, int]], logprobs: dict[str, list[TokenLogprobs]], sampled_s: float
    ) -> list[RequestOutput]:
        """One output per request that produced tokens (several when drafts were accepted); a request whose text
        reached a stop string ends here."""
        outs = []
        for request, token_ids in _by_request(produced):
            if self.outputs.append_tokens(request, token_ids, logprobs.get(request.request_id), sampled_s):
                self._stop_on_string(request)
            outs.append(self._finish(request) if request.is_finished else self.outputs.snapshot(request))
        return outs

    def _stop_on_string(self, request: Request) -> None:
        """End a request whose text reached a stop string (its output already cut there), as stopped even when
        the same token also finished it."""
        if request.is_finished:
            self.scheduler.release_held(request.request_id)  # a prefilled request needs no handoff now
            request.status = RequestStatus.FINISHED_STOPPED
        else:
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)

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
        self.runner.release(request.request_id)
        self.speculator.release(request.request_id)
        stats = RequestStats.of(request)
        self._finished_stats.append(stats)
        return self.outputs.finish(request, stats, error)

    # -- observability ---------------------------------------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget every block the prefix cache holds on the device (the KV events say AllBlocksCleared;
        a KV offload tier keeps its blocks). Refused (False, nothing changed) while any block is held."""
        return self.block_pool.reset_prefix_cache()

    def publish_kv_events(self) -> None:
        """The recipe's last step (and after anything that changes the cache outside a step: the serving loop
        calls it after every command): the block pool's events go to `kv_event_sink`, or are dropped, so that
        nothing accumulates."""
        events = self.block_pool.take_events()
        if self._tier_events is not None:
            assert self.kv_tier is not None
            events = self._tier_events.merge(events, self.kv_tier.tier.take_removed())
        if events and self.kv_event_sink is not None:
            self.kv_event_sink(events)

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every block hash the prefix cache holds now, on the device or in its KV tier: after
        `publish_kv_events`, the snapshot a worker's prefix index publisher sends in place of the events it may
        have missed (the first one of a restarted worker announces its tier's blocks found again)."""
        device = self.block_pool.cached_block_hashes()
        if self._tier_events is None:
            return device
        on_device = set(device)
        return [*device, *(h for h in self._tier_events.announced if h not in on_device)]

    def cached_blocks(self) -> dict[str, list[BlockHash]]:
        """`cached_block_hashes` by tier, as the KV events last announced them: "device", then the KV tier's kind
        ("disk" | "host") for the blocks only the tier holds. The snapshot a prefix index publisher sends."""
        device = self.block_pool.cached_block_hashes()
        if self._tier_events is None:
            return {DEVICE: device}
        on_device = set(device)
        below = [h for h in self._tier_events.announced if h not in on_device]
        return {DEVICE: device, self._tier_events.tier: below}

    def _on_device(self, block_hash: BlockHash) -> bool:
        return self.block_pool.get_cached_block(block_hash) is not None

    def _holds(self, block_hash: BlockHash) -> bool:
        """Whether this engine can serve the block without computing it: on the device or in its tier."""
        return self._on_device(block_hash) or (self.kv_tier is not None and block_hash in self.kv_tier)

    def stats(self, *, take_finished: bool = True) -> EngineStats:
        """Gauges now, counters since start; with `take_finished`, the finished-request stats since the previous
        taking call (each handed out once; False, as a worker's GetLoad passes: `finished` empty, the stats kept)."""
        finished: list[RequestStats] = []
        if take_finished:
            finished = list(self._finished_stats)
            self._finished_stats.clear()
        spec = self.speculator  # its counters stay zero without speculative decoding
        return EngineStats(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            num_requests_receiving_kv=self.scheduler.num_receiving_kv,
            num_queued_prompt_tokens=self.scheduler.num_queued_prompt_tokens,
            kv_blocks_used=self.block_pool.num_used_blocks,
            kv_blocks_free=self.block_pool.num_free_blocks,
            kv_cache_usage=self.block_pool.usage,
            prefix_cache_queries=self.kv_cache.prefix_queries_tokens,
            prefix_cache_hits=self.kv_cache.prefix_hits_tokens,
            prefix_cache_hits_by_tier=self._prefix_cache_hits_by_tier(),
            kv_offload=None if self.kv_tier is None else self.kv_tier.tier.stats_snapshot(),
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self.outputs.num_generation_tokens,
            spec_decode_num_drafts=spec.num_drafts,
            spec_decode_num_draft_tokens=spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=list(spec.num_accepted_tokens_per_pos),
            spec_decode_chosen_k=dict(sorted(spec.chosen_k.items())),
            lora_requests_running=requests_by_adapter(self.scheduler.running),
            lora_requests_waiting=requests_by_adapter(self.scheduler.waiting),
            finished=finished,
        )

    def _prefix_cache_hits_by_tier(self) -> dict[str, int]:
        hits = {"device": self.kv_cache.prefix_hits_tokens}
        for kind, num_blocks in self._tiers.blocks_loaded.items():
            hits[kind] = num_blocks * self.config.block_size
        return hits


def _by_request(produced: list[tuple[Request, int]]) -> list[tuple[Request, list[int]]]:
    """A step's tokens by request (a request's in order), the requests in the order they first appear."""
    grouped: dict[str, tuple[Request, list[int]]] = {}
    for request, token_id in produced:
        grouped.setdefault(request.request_id, (request, []))[1].append(token_id)
    return list(grouped.values())


def _kv_blocks(runner: ModelRunner, layout: KVLayout) -> KVBlocks:
    """The runner's KV cache as handoffs see it, with every tensor-parallel rank's where the model maps them."""
    ranks = rank_caches_of(runner)
    return KVBlocks(runner.kv_cache, runner.kv_scales, layout, None if ranks is None else tuple(ranks))


@dataclass(frozen=True)
class RankStats:
    """One tensor-parallel rank of the engine (`LLMEngine.rank_stats`)."""

    rank: int
    pid: int
    weight_bytes: int
    kv_cache_bytes: int
