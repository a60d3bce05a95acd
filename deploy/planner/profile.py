"""A worker's measured profile (`splitserve profile` writes it, `splitserve plan` reads it): the curves the planner
prices a layout with, their points, and what they were measured on. Torch-free; reading checks every field.

profile.json (schema "splitserve-profile/1"):

    model      {name: the --model given, identity: the KV hash namespace's model (a digest of the weights, with
                +quantization), num_layers, num_kv_heads, head_dim}
    engine     the engine flags it ran with (dtype, kv_cache_dtype, block_size, max_num_seqs, ...)
    machine    {cpu_count, num_threads: torch's intra-op threads, device, device_name, platform}
    versions   {splitserve, python, torch, grpcio}
    prefill    {points: [{num_new_tokens, num_cached_tokens, seconds}], fit: PrefillFit}
    decode     {points: [{batch_size, context_len, seconds}], fit: DecodeFit}      seconds: one decode step
    handoff    {transports: {name: {points: [{num_bytes, seconds}], fit: HandoffFit}}, skipped: {name: why}}
    kv         {num_blocks, block_size, block_bytes, capacity_tokens}
    one_thread {prefill, decode}: how many times slower one point of each ran on 1 thread than on num_threads
               (absent when the profile ran on 1; `plan --one-host` scales by them)
    contention {prefill, decode: [{background_cores, slowdown}]}: how many times slower one point of each ran on
               num_threads while other processes kept `background_cores` of the machine busy (absent: not measured;
               `plan --one-host` prices the gateway's and the load generator's CPU with it)
    tensor_parallel {N: {prefill, decode, threads_per_rank, num_kv_blocks}}: how many times longer one point of each
               phase took on the engine at tensor-parallel size N (threads_per_rank threads a rank, num_threads // N)
               than at size 1 on num_threads, and the KV blocks it held (absent: only size 1 measured; `plan`
               searches the sizes measured here)
    serving    {num_requests, prompt_tokens, ttft_overhead_s, step_overhead_s, gateway_cpu_per_request_s,
                gateway_cpu_per_token_s}: a real `serve` of one colocated worker, one request at a time from a
               light client (absent: not measured): its TTFT over the engine's prefill, its inter-token time over
               the engine's decode step, and the CPU its gateway process spent per request and per streamed token
    loaded     {layout: {num_colocated, num_prefill, num_decode, max_num_seqs, transport}, isl, osl, client,
                points: [{rate, num_requests, ttft_mean_s, router_queue_s, prefill_queue_s, prefill_s,
                kv_transfer_s, tpot_p50_s, host_busy_cores}]}: a real `serve` of that layout on this machine driven
               at Poisson rates by `client` (AIPerf), each point a run's means of the gateway's TTFT stage
               histograms (absent: not measured; `plan --one-host` prices a layout of its kind with these stage
               costs under load: loaded.py)
    quick, created, wall_s

The fitted curves (all coefficients >= 0, fitted in relative error by fit.py):

    prefill(n new, c cached) = intercept_s + per_token_s * n + per_token_context_s * n * (c + n / 2)
    decode step(B seqs, ctx tokens each) = intercept_s + per_seq_s * B + per_seq_token_s * B * ctx
    handoff(bytes) = intercept_s + per_byte_s * bytes
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "splitserve-profile/1"


@dataclass(frozen=True, kw_only=True)
class PrefillFit:
    intercept_s: float
    per_token_s: float
    per_token_context_s: float

    @classmethod
    def of(cls, intercept_s: float, per_token_s: float, per_token_context_s: float) -> PrefillFit:
        return cls(intercept_s=intercept_s, per_token_s=per_token_s, per_token_context_s=per_token_context_s)

    @staticmethod
    def features(num_new_tokens: float, num_cached_tokens: float) -> tuple[float, float, float]:
        return 1.0, num_new_tokens, num_new_tokens * (num_cached_tokens + num_new_tokens / 2)

    def seconds(self, num_new_tokens: float, num_cached_tokens: float = 0.0) -> float:
        """One prompt's prefill, alone on the worker: `num_new_tokens` computed after `num_cached_tokens` hit."""
        one, n, nc = self.features(num_new_tokens, num_cached_tokens)
        return self.intercept_s * one + self.per_token_s * n + self.per_token_context_s * nc


@dataclass(frozen=True, kw_only=True)
class DecodeFit:
    intercept_s: float
    per_seq_s: float
    per_seq_token_s: float

    @classmethod
    def of(cls, intercept_s: float, per_seq_s: float, per_seq_token_s: float) -> DecodeFit:
        return cls(intercept_s=intercept_s, per_seq_s=per_seq_s, per_seq_token_s=per_seq_token_s)

    @staticmethod
    def features(batch_size: float, context_len: float) -> tuple[float, float, float]:
        return 1.0, batch_size, batch_size * context_len

    def seconds(self, batch_size: float, context_len: float) -> float:
        """One decode step of `batch_size` sequences of `context_len` tokens each."""
        one, b, bc = self.features(batch_size, context_len)
        return self.intercept_s * one + self.per_seq_s * b + self.per_seq_token_s * bc


@dataclass(frozen=True, kw_only=True)
class HandoffFit:
    intercept_s: float
    per_byte_s: float

    def seconds(self, num_bytes: float) -> float:
        return self.intercept_s + self.per_byte_s * num_bytes


@dataclass(frozen=True, kw_only=True)
class PrefillPoint:
    num_new_tokens: int
    num_cached_tokens: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class DecodePoint:
    batch_size: int
    context_len: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class HandoffPoint:
    num_bytes: int
    seconds: float


@dataclass(frozen=True, kw_only=True)
class TransportProfile:
    points: tuple[HandoffPoint, ...]
    fit: HandoffFit


@dataclass(frozen=True, kw_only=True)
class KVCapacity:
    num_blocks: int
    block_size: int
    block_bytes: int  # one block, every layer, K and V

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> float:
        return self.block_bytes / self.block_size


@dataclass(frozen=True, kw_only=True)
class ContentionPoint:
    background_cores: float  # cores other processes kept busy while the point ran
    slowdown: float  # its time then over its time alone (>= 1 unless the noise says otherwise)


@dataclass(frozen=True, kw_only=True)
class TPScale:
    """A tensor-parallel size's times over size 1's, on the same cores (one point of each phase)."""

    prefill: float
    decode: float
    threads_per_rank: int
    num_kv_blocks: int  # the blocks a worker of this size holds with the profiled KV flags (they size each rank)


@dataclass(frozen=True, kw_only=True)
class Serving:
    """What a real `serve` adds to the engine's own times (see the module docstring); all >= 0."""

    num_requests: int
    prompt_tokens: int
    ttft_overhead_s: float  # the client's TTFT minus the engine's prefill of that prompt (gateway, HTTP, stream)
    step_overhead_s: float  # the client's inter-token time minus the engine's decode step at batch 1
    gateway_cpu_per_request_s: float  # CPU seconds of the gateway's process per request (max_tokens 1)
    gateway_cpu_per_token_s: float  # ... and per streamed token beyond the first


@dataclass(frozen=True, kw_only=True)
class LoadedPoint:
    """One rate of the loaded probe: what the client and the gateway's ttft_stage_seconds histograms measured."""

    rate: float  # requests/s offered (Poisson)
    num_requests: int  # sent
    ttft_mean_s: float  # the client's mean TTFT
    router_queue_s: float  # each stage's mean over the run (the histograms' sum / count between two scrapes)
    prefill_queue_s: float
    prefill_s: float
    kv_transfer_s: float  # 0 for a colocated layout
    tpot_p50_s: float  # the client's inter-token latency p50
    host_busy_cores: float  # the whole machine's busy cores over the run (/proc/stat), other work included


@dataclass(frozen=True, kw_only=True)
class Loaded:
    """The loaded probe: a served layout (its pools as planner.Layout's fields), its traffic and its points."""

    num_colocated: int
    num_prefill: int
    num_decode: int
    max_num_seqs: int
    transport: str | None
    isl: int
    osl: int
    client: str
    points: tuple[LoadedPoint, ...]

    @property
    def colocated(self) -> bool:
        return self.num_colocated > 0

    def to_json(self) -> dict[str, Any]:
        return {"layout": {"num_colocated": self.num_colocated, "num_prefill": self.num_prefill,
                           "num_decode": self.num_decode, "max_num_seqs": self.max_num_seqs,
                           "transport": self.transport},
                "isl": self.isl, "osl": self.osl, "client": self.client,
                "points": [dataclasses.asdict(p) for p in self.points]}


def loaded_from_json(data: Any, source: str) -> Loaded:
    """A Loaded from profile.json's `loaded`; ValueError naming the bad field."""
    if not isinstance(data, dict) or not isinstance(data.get("layout"), dict):
        raise ValueError(f"{source}: loaded: expected an object with a layout")
    layout = data["layout"]
    counts = _build(_LoadedShape, {**{k: layout.get(k) for k in ("num_colocated", "num_prefill", "num_decode",
                                                                   "max_num_seqs")},
                                   "isl": data.get("isl"), "osl": data.get("osl")}, f"{source}: loaded")
    if (counts.num_colocated > 0) == (counts.num_prefill > 0 or counts.num_decode > 0) or counts.max_num_seqs < 1 \
            or counts.isl < 1 or counts.osl < 1:
        raise ValueError(f"{source}: loaded: a colocated or a disaggregated layout with sequences and traffic, got "
                         f"{layout} (isl {counts.isl}, osl {counts.osl})")
    points = tuple(sorted((_build(LoadedPoint, p, f"{source}: loaded.points[{i}]")
                           for i, p in enumerate(data.get("points") or [])), key=lambda p: p.rate))
    if not points or any(p.rate <= 0 or p.prefill_s <= 0 for p in points):
        raise ValueError(f"{source}: loaded: points need a positive rate and prefill_s")
    transport = layout.get("transport")
    return Loaded(num_colocated=int(counts.num_colocated), num_prefill=int(counts.num_prefill),
                  num_decode=int(counts.num_decode), max_num_seqs=int(counts.max_num_seqs),
                  transport=None if transport is None else str(transport), isl=int(counts.isl), osl=int(counts.osl),
                  client=str(data.get("client", "")), points=points)


@dataclass(frozen=True, kw_only=True)
class _LoadedShape:
    num_colocated: int
    num_prefill: int
    num_decode: int
    max_num_seqs: int
    isl: int
    osl: int


@dataclass(frozen=True, kw_only=True)
class ModelIdentity:
    name: str  # the --model it was measured with
    identity: str  # the KV hash namespace's model: a digest of the weights (+quantization), or --model-id


@dataclass(frozen=True, kw_only=True)
class Profile:
    model: ModelIdentity
    engine: dict[str, Any]
    machine: dict[str, Any]
    versions: dict[str, Any]
    prefill_points: tuple[PrefillPoint, ...]
    prefill: PrefillFit
    decode_points: tuple[DecodePoint, ...]
    decode: DecodeFit
    handoff: dict[str, TransportProfile]
    kv: KVCapacity
    handoff_skipped: dict[str, str] = field(default_factory=dict)
    # phase ("prefill", "decode") -> its time on 1 thread over its time on num_threads (measured on one point)
    one_thread: dict[str, float] = field(default_factory=dict)
    # phase ("prefill", "decode") -> its slowdowns on num_threads under background load, by background cores
    contention: dict[str, tuple[ContentionPoint, ...]] = field(default_factory=dict)
    serving: Serving | None = None
    loaded: Loaded | None = None
    # tensor-parallel size N >= 2 -> its phases' times over size 1's (`profile --tensor-parallel-sizes`)
    tensor_parallel: dict[int, TPScale] = field(default_factory=dict)
    quick: bool = False
    created: str = ""
    wall_s: float = 0.0

    @property
    def max_num_seqs(self) -> int:
        return int(self.engine.get("max_num_seqs", 256))

    @property
    def max_model_len(self) -> int | None:
        value = self.engine.get("max_model_len")
        return None if value is None else int(value)

    @property
    def cpu_count(self) -> int:
        return int(self.machine.get("cpu_count") or 1)

    @property
    def num_threads(self) -> int:
        return int(self.machine.get("num_threads") or self.cpu_count)

    @property
    def tensor_parallel_sizes(self) -> tuple[int, ...]:
        """The sizes a layout may take: 1 and those measured."""
        return (1, *sorted(self.tensor_parallel))

    def tp_scale(self, size: int, phase: str) -> float:
        """`phase`'s time at tensor-parallel size `size` over size 1's (1 at size 1)."""
        return 1.0 if size == 1 else getattr(self.tensor_parallel[size], phase)

    def num_kv_blocks(self, size: int = 1) -> int:
        """The KV blocks a worker of tensor-parallel size `size` holds (each rank its heads of each)."""
        return self.kv.num_blocks if size == 1 else self.tensor_parallel[size].num_kv_blocks

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "created": self.created,
            "quick": self.quick,
            "wall_s": self.wall_s,
            "model": dataclasses.asdict(self.model),
            "engine": self.engine,
            "machine": self.machine,
            "versions": self.versions,
            "prefill": {"points": [dataclasses.asdict(p) for p in self.prefill_points],
                        "fit": dataclasses.asdict(self.prefill)},
            "decode": {"points": [dataclasses.asdict(p) for p in self.decode_points],
                       "fit": dataclasses.asdict(self.decode)},
            "handoff": {"transports": {name: {"points": [dataclasses.asdict(p) for p in t.points],
                                              "fit": dataclasses.asdict(t.fit)}
                                       for name, t in self.handoff.items()},
                        "skipped": self.handoff_skipped},
            "kv": {**dataclasses.asdict(self.kv), "capacity_tokens": self.kv.capacity_tokens},
            "one_thread": self.one_thread,
            "contention": {phase: [dataclasses.asdict(p) for p in points] for phase, points in self.contention.items()},
            "serving": None if self.serving is None else dataclasses.asdict(self.serving),
            "loaded": None if self.loaded is None else self.loaded.to_json(),
            "tensor_parallel": {str(n): dataclasses.asdict(s) for n, s in sorted(self.tensor_parallel.items())},
        }

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")


def _build(cls: type, values: Any, where: str) -> Any:
    """`cls(**values)` with every field present and numeric fields non-negative; a ValueError names `where`."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: expected an object, got {type(values).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in values]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    for name in names:
        value = values[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{where}.{name}: expected a number >= 0, got {value!r}")
    return cls(**{n: values[n] for n in names})


def profile_from_json(data: Any, *, source: str = "profile") -> Profile:
    """A Profile from profile.json's contents; ValueError naming the bad field."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{source}: not a splitserve profile (schema {found!r}, expected {SCHEMA!r})")
    try:
        model = data["model"]
        if not isinstance(model, dict) or not model.get("name") or not model.get("identity"):
            raise ValueError(f"{source}: model needs its name and identity")
        transports = data["handoff"]["transports"]
        return Profile(
            model=ModelIdentity(name=str(model["name"]), identity=str(model["identity"])),
            engine=dict(data["engine"]), machine=dict(data["machine"]), versions=dict(data.get("versions", {})),
            prefill_points=tuple(_build(PrefillPoint, p, f"{source}: prefill.points[{i}]")
                                 for i, p in enumerate(data["prefill"]["points"])),
            prefill=_build(PrefillFit, data["prefill"]["fit"], f"{source}: prefill.fit"),
            decode_points=tuple(_build(DecodePoint, p, f"{source}: decode.points[{i}]")
                                for i, p in enumerate(data["decode"]["points"])),
            decode=_build(DecodeFit, data["decode"]["fit"], f"{source}: decode.fit"),
            handoff={name: TransportProfile(
                points=tuple(_build(HandoffPoint, p, f"{source}: handoff.{name}.points[{i}]")
                             for i, p in enumerate(t["points"])),
                fit=_build(HandoffFit, t["fit"], f"{source}: handoff.{name}.fit")) for name, t in transports.items()},
            handoff_skipped=dict(data["handoff"].get("skipped", {})),
            kv=_build(KVCapacity, {k: data["kv"][k] for k in ("num_blocks", "block_size", "block_bytes")},
                      f"{source}: kv"),
            one_thread={str(k): float(v) for k, v in data.get("one_thread", {}).items()},
            contention={str(phase): tuple(sorted((_build(ContentionPoint, p, f"{source}: contention.{phase}[{i}]")
                                                  for i, p in enumerate(points)), key=lambda p: p.background_cores))
                        for phase, points in (data.get("contention") or {}).items()},
            serving=None if data.get("serving") is None else _build(Serving, data["serving"], f"{source}: serving"),
            loaded=None if data.get("loaded") is None else loaded_from_json(data["loaded"], source),
            tensor_parallel={_tp_size(n, source): _build(TPScale, s, f"{source}: tensor_parallel.{n}")
                             for n, s in (data.get("tensor_parallel") or {}).items()},
            quick=bool(data.get("quick", False)), created=str(data.get("created", "")),
            wall_s=float(data.get("wall_s", 0.0)),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{source}: malformed profile ({type(exc).__name__}: {exc})") from None


def _tp_size(key: Any, source: str) -> int:
    try:
        size = int(key)
    except (TypeError, ValueError):
        size = 0
    if size < 2:
        raise ValueError(f"{source}: tensor_parallel: sizes are integers >= 2 (1 is the profile itself), got {key!r}")
    return size


def load_profile(path: str | Path) -> Profile:
    """Read and check profile.json; FileNotFoundError or ValueError with the path in the message."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    profile = profile_from_json(data, source=str(path))
    if any(not ratio > 0 for ratio in profile.one_thread.values()):
        raise ValueError(f"{path}: one_thread: ratios must be positive, got {profile.one_thread}")
    for size, scale in profile.tensor_parallel.items():
        if not (scale.prefill > 0 and scale.decode > 0 and scale.threads_per_rank >= 1 and scale.num_kv_blocks >= 1):
            raise ValueError(f"{path}: tensor_parallel.{size}: positive ratios, threads_per_rank >= 1 and "
                             f"num_kv_blocks >= 1, got {scale}")
    if profile.tensor_parallel and int(profile.engine.get("tensor_parallel_size") or 1) != 1:
        raise ValueError(f"{path}: tensor_parallel: ratios are over size 1, but the profile ran at size "
                         f"{profile.engine.get('tensor_parallel_size')}")
    loaded = profile.loaded
    if loaded is not None and not loaded.colocated and loaded.transport not in profile.handoff:
        raise ValueError(f"{path}: loaded: its layout hands KV off over {loaded.transport!r}, which the profile's "
                         f"handoffs did not measure ({', '.join(profile.handoff) or 'none'})")
    if profile.kv.block_size <= 0 or profile.kv.num_blocks <= 0:
        raise ValueError(f"{path}: kv: a KV cache of {profile.kv.num_blocks} blocks of {profile.kv.block_size} tokens")
    return profile
