"""The dispatcher with peer fetch and a family's first prompt still being prefilled (router/inflight_prefixes.py): the
second prompt of the family, which a load-based policy sends to the other worker, waits for the first's prefill and
fetches its blocks instead of computing them again; if the first fails, the second is dispatched at once and
computes; with --no-kv-peer-fetch nothing waits. And prefix-aware routing through the dispatcher: a busy holder's
family goes to a worker that fetches it. Fakes for the workers, the registry and the index: what is under test is
the dispatcher's order of events and what it asks the workers, not gRPC."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio

from engine.request.sampling_params import SamplingParams
from kv_transfer.block_hash import BlockHashNamespace, adapter_root, hash_token_blocks
from protos import serving_pb2
from router.admission import Ticket
from router.config import RouterConfig
from router.dispatcher import Dispatcher, GenerationJob
from router.inflight_prefixes import InflightPrefixes
from router.peer_fetch import PeerFetchRates
from router.prefix_routing import PrefixLookup
from router.routing import WorkerLoad

BLOCK = 16
BLOCK_BYTES = 368_640
NS = BlockHashNamespace(model="sha256:family", block_size=BLOCK, kv_dtype="float32")
FAMILY = list(range(1_000, 2_500))  # 1,500 tokens: 93 full blocks
PROMPT_1 = FAMILY + list(range(10, 42))
PROMPT_2 = FAMILY + list(range(50, 82))


class Call:
    """A Generate call whose first (and last) message comes when the test says, or fails."""

    def __init__(self) -> None:
        self.reply: asyncio.Future[serving_pb2.GenerateResponse | None] = asyncio.get_running_loop().create_future()

    async def read(self) -> serving_pb2.GenerateResponse:
        message = await self.reply
        if message is None:
            raise grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="the prefill failed")
        return message

    def cancel(self) -> None:
        if not self.reply.done():
            self.reply.cancel()


class Stub:
    def __init__(self, worker_id: str, sent: dict[str, tuple[str, serving_pb2.GenerateRequest, Call]]) -> None:
        self.worker_id = worker_id
        self.sent = sent

    def Generate(self, request: serving_pb2.GenerateRequest, timeout: float) -> Call:  # noqa: N802 - gRPC's name
        call = Call()  # the decode worker's; the worker that prefills is the request's prefill_endpoint
        self.sent[request.request_id] = (request.prefill_endpoint.split(":")[0], request, call)
        return call

    def Abort(self, request: serving_pb2.AbortRequest, timeout: float):  # noqa: N802, ANN201
        async def done() -> serving_pb2.AbortResponse:
            return serving_pb2.AbortResponse()
        return done()


class Registry:
    def __init__(self) -> None:
        self.sent: dict[str, tuple[str, serving_pb2.GenerateRequest, Call]] = {}
        self.queued = {"p0": 0, "p1": 0, "d0": 0}

    def loads(self) -> list[WorkerLoad]:
        return [WorkerLoad(worker_id=w, role="decode" if w == "d0" else "prefill", endpoint=f"{w}:1", healthy=True,
                           num_pending=n, kv_blocks_free=600, kv_blocks_total=600, kv_block_bytes=BLOCK_BYTES,
                           incarnation=1) for w, n in self.queued.items()]

    def note_dispatch(self, worker_id: str, num_blocks: int) -> None:
        self.queued[worker_id] += 1

    def stub(self, worker_id: str) -> Stub:
        return Stub(worker_id, self.sent)

    def mark_unhealthy(self, worker_id: str, reason: str) -> None:
        pass

    def spawn(self, coroutine, name: str) -> None:  # noqa: ANN001
        asyncio.ensure_future(coroutine)


class Index:
    """The prefix index as the workers' KV events left it: `held` (worker -> leading blocks of FAMILY)."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    async def lookup(self, token_ids: list[int], *, adapter: str | None = None) -> PrefixLookup:
        hashes = hash_token_blocks(NS, token_ids, root=adapter_root(NS, adapter))
        return PrefixLookup(namespace=NS, block_hashes=hashes, overlap=dict(self.held))

    def record(self, lookup: PrefixLookup, route) -> None:  # noqa: ANN001 - prefix-aware's provisional entries
        pass

    def check_prediction(self, *args) -> None:  # noqa: ANN002
        pass


class Admission:
    async def acquire(self, num_blocks: int, priority: int = 0) -> Ticket:
        return Ticket(None, num_blocks, 0.0, 0.0)


class Tracker:
    def dispatched(self) -> float:
        return 0.0

    def __getattr__(self, name: str):  # noqa: ANN204 - on_message, finished, failed, retried: counted elsewhere
        return lambda *args, **kwargs: None


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def first_message() -> serving_pb2.GenerateResponse:
    return serving_pb2.GenerateResponse(token_ids=[5], finish_reason="length",
                                        usage=serving_pb2.Usage(prompt_tokens=1532, completion_tokens=1))


def dispatcher(*, peer_fetch: bool, policy: str = "least-loaded") -> tuple[Dispatcher, Registry, Index, Clock]:
    config = RouterConfig(served_model_names=("m",), max_model_len=4096, block_size=BLOCK,
                          routing_policy=policy, kv_peer_fetch=peer_fetch, disagg_prefill_threshold_tokens=0)
    registry, index, clock = Registry(), Index(), Clock()
    d = Dispatcher(config=config, registry=registry, admission=Admission(), prefix_index=index)  # type: ignore[arg-type]
    if peer_fetch:
        d._inflight = InflightPrefixes(clock=clock)
    # A slow prefill (100 tokens/s, both workers): the family's 93 blocks compute in 14.9 s, fetch in 69 ms.
    d._peer_rates = PeerFetchRates()
    for worker_id in ("p0", "p1"):
        d._peer_rates.observe_prefill(worker_id, 100, 1.0)
    return d, registry, index, clock


def job(request_id: str, prompt: list[int]) -> GenerationJob:
    return GenerationJob(request_id=request_id, prompt_token_ids=prompt, params=SamplingParams(max_tokens=1))


async def until(condition, what: str) -> None:  # noqa: ANN001
    for _ in range(1_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never: {what}")


def test_the_second_prompt_of_a_family_in_flight_waits_and_fetches_it_from_the_first_ones_worker() -> None:
    async def scenario() -> tuple[str, serving_pb2.GenerateRequest, int]:
        d, registry, index, clock = dispatcher(peer_fetch=True)
        first = asyncio.ensure_future(d.open(job("r1", PROMPT_1), Tracker()))  # type: ignore[arg-type]
        await until(lambda: "r1" in registry.sent, "r1 dispatched")
        assert registry.sent["r1"][0] == "p0" and not registry.sent["r1"][1].HasField("peer_fetch")
        clock.now += 5.0  # r1 expected to end in 15.3 - 5 s; r2 would compute the family in 14.9 s
        second = asyncio.ensure_future(d.open(job("r2", PROMPT_2), Tracker()))  # type: ignore[arg-type]
        for _ in range(50):
            await asyncio.sleep(0)
        waited = "r2" not in registry.sent
        index.held = {"p0": 93}  # r1's prefill ended: its KV events reached the index...
        registry.sent["r1"][2].reply.set_result(first_message())  # ...and its first message the gateway
        (await first).close()
        await until(lambda: "r2" in registry.sent, "r2 dispatched")
        worker, request, call = registry.sent["r2"]
        call.reply.set_result(first_message())
        (await second).close()
        assert waited, "r2 was dispatched before r1's prefill ended"
        return worker, request, len(d._inflight)

    worker, request, num_inflight = asyncio.run(scenario())
    assert worker == "p1"  # least-loaded: p0 is busy with r1
    assert (request.peer_fetch.worker_id, request.peer_fetch.num_blocks) == ("p0", 93)
    assert num_inflight == 1  # r2's own, committed: until the index lists it or its short TTL ends


def test_a_prefill_that_fails_wakes_the_waiter_which_computes() -> None:
    async def scenario() -> tuple[serving_pb2.GenerateRequest, int]:
        d, registry, index, clock = dispatcher(peer_fetch=True)
        first = asyncio.ensure_future(d.open(job("r1", PROMPT_1), Tracker()))  # type: ignore[arg-type]
        await until(lambda: "r1" in registry.sent, "r1 dispatched")
        clock.now += 5.0
        second = asyncio.ensure_future(d.open(job("r2", PROMPT_2), Tracker()))  # type: ignore[arg-type]
        for _ in range(50):
            await asyncio.sleep(0)
        assert "r2" not in registry.sent
        registry.sent["r1"][2].reply.set_result(None)  # r1 fails before any message
        try:
            await first
        except Exception:  # noqa: BLE001 - the client's 400; what matters here is r2
            pass
        await until(lambda: "r2" in registry.sent, "r2 dispatched")
        _, request, call = registry.sent["r2"]
        call.reply.set_result(first_message())
        (await second).close()
        return request, len(d._inflight)

    request, num_inflight = asyncio.run(scenario())
    assert not request.HasField("peer_fetch")  # nobody holds the family: r2 computes it
    assert num_inflight == 1  # r2's own (committed); r1's went with its failure


async def dispatch_r2_while_r1_in_flight(d, registry, between=lambda: None) -> None:  # noqa: ANN001
    """Open r1, then (after `between`) r2 while r1's prefill is in flight; both are dispatched, then answered."""
    first = asyncio.ensure_future(d.open(job("r1", PROMPT_1), Tracker()))  # type: ignore[arg-type]
    await until(lambda: "r1" in registry.sent, "r1 dispatched")
    between()
    second = asyncio.ensure_future(d.open(job("r2", PROMPT_2), Tracker()))  # type: ignore[arg-type]
    await until(lambda: "r2" in registry.sent, "r2 dispatched while r1 is in flight")
    for name in ("r1", "r2"):
        registry.sent[name][2].reply.set_result(first_message())
    for task in (first, second):
        (await task).close()


def test_without_peer_fetch_nothing_waits() -> None:
    async def scenario() -> serving_pb2.GenerateRequest:
        d, registry, index, clock = dispatcher(peer_fetch=False)
        assert d._inflight is None
        await dispatch_r2_while_r1_in_flight(d, registry)
        return registry.sent["r2"][1]

    request = asyncio.run(scenario())
    assert not request.HasField("peer_fetch")


def test_a_prompt_the_first_ones_worker_runs_itself_does_not_wait() -> None:
    """Round-robin's next turn is p0 again... here: p1 busy, so least-loaded sends r2 to p0, r1's own worker: its
    queue runs r1 first and r2 hits r1's blocks there; nothing to wait for."""
    async def scenario() -> tuple[str, bool]:
        d, registry, index, clock = dispatcher(peer_fetch=True)
        registry.queued["p1"] = 5

        def later() -> None:
            clock.now += 5.0

        await dispatch_r2_while_r1_in_flight(d, registry, later)
        return registry.sent["r2"][0], registry.sent["r2"][1].HasField("peer_fetch")

    assert asyncio.run(scenario()) == ("p0", False)




def test_prefix_aware_spreads_a_busy_holders_family_to_a_worker_that_fetches_it() -> None:
    """The gateway prices p1's fetch of the family from p0 as routing's cost (tests/router/test_fetch_priced_routing.py
    has the arithmetic): with 4 requests queued on p0 the family goes to p1, which fetches it; with peer fetch off
    p1 would compute it, and the family waits on p0."""
    async def scenario(peer_fetch: bool) -> tuple[str, serving_pb2.GenerateRequest]:
        d, registry, index, clock = dispatcher(peer_fetch=peer_fetch, policy="prefix-aware")
        d._peer_rates = PeerFetchRates()  # the priors: 0.74 ms a block fetched, 8 ms computed
        index.held = {"p0": 93}
        registry.queued["p0"] = 4
        task = asyncio.ensure_future(d.open(job("r1", PROMPT_1), Tracker()))  # type: ignore[arg-type]
        await until(lambda: "r1" in registry.sent, "r1 dispatched")
        worker, request, call = registry.sent["r1"]
        call.reply.set_result(first_message())
        (await task).close()
        return worker, request

    worker, request = asyncio.run(scenario(peer_fetch=True))
    assert (worker, request.peer_fetch.worker_id, request.peer_fetch.num_blocks) == ("p1", "p0", 93)
    worker, request = asyncio.run(scenario(peer_fetch=False))
    assert (worker, request.HasField("peer_fetch")) == ("p0", False)


def test_prefix_aware_waits_rather_than_fetch_from_provisional_entries() -> None:
    """Prefix-aware writes provisional index entries at dispatch, for the prefill worker and the decode worker it hands
    off to: while r1 is prefilled on p0 the index says p0 and d0 hold the family, though neither can send it yet
    (benchmark run 6's two refused fetches). p0 busy (4 queued), r2 goes to p1; it waits for r1 instead of fetching
    from d0's provisional entries, then fetches."""
    async def scenario() -> tuple[bool, str, serving_pb2.GenerateRequest]:
        d, registry, index, clock = dispatcher(peer_fetch=True, policy="prefix-aware")
        first = asyncio.ensure_future(d.open(job("r1", PROMPT_1), Tracker()))  # type: ignore[arg-type]
        await until(lambda: "r1" in registry.sent, "r1 dispatched")
        assert registry.sent["r1"][0] == "p0"
        index.held = {"p0": 93, "d0": 93}  # r1's provisional entries (r2 shares the family's 93 blocks)
        registry.queued["p0"] = 4  # more arrive on p0
        clock.now += 5.0  # r1 expected to end in 15.3 - 5 s; r2 would compute the family in 14.9 s
        second = asyncio.ensure_future(d.open(job("r2", PROMPT_2), Tracker()))  # type: ignore[arg-type]
        for _ in range(50):
            await asyncio.sleep(0)
        waited = "r2" not in registry.sent
        index.held = {"p0": 93, "d0": 93}  # now confirmed: r1's prefill ended and d0 received its blocks
        registry.sent["r1"][2].reply.set_result(first_message())
        (await first).close()
        await until(lambda: "r2" in registry.sent, "r2 dispatched")
        worker, request, call = registry.sent["r2"]
        call.reply.set_result(first_message())
        (await second).close()
        return waited, worker, request

    waited, worker, request = asyncio.run(scenario())
    assert waited, "r2 was dispatched (to fetch from provisional entries) before r1's prefill ended"
    assert worker == "p1" and request.peer_fetch.num_blocks == 93
