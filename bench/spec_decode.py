"""Speculative decoding: TPOT and output tokens/s with speculation off, fixed k and dynamic, per method, at several
concurrencies, on a workload where prompt lookup pays and one where it does not — all in one run.

    PYTHONPATH=. .venv/bin/python bench/spec_decode.py            # the full run recorded in docs/benchmarks.md
    PYTHONPATH=. .venv/bin/python bench/spec_decode.py --quick    # a smoke run (a minute or two)

What runs. One process, the offline engine, SmolLM2-135M-Instruct in float32, greedy (temperature 0, EOS ignored,
exactly --max-tokens output tokens per request), prefix caching off (every config prefills every prompt in full).
One engine per config, built once from one loaded checkpoint and reused for every workload and concurrency:
`off` (no speculation), then per method `fixed` (k = --num-speculative-tokens every step) and `dynamic` (the
policy picks k per request and step from the costs it measures). Each engine is warmed up once on a short request
(so the dynamic policy has measured costs) before anything is timed.

Workloads (real text: passages and functions from the Python standard library's own docstrings and source, put in
the model's chat template):
  edit  prompt lookup pays: the model is asked to copy, lightly edit or rename in a given passage or code snippet,
        so its answer repeats the prompt;
  chat  it does not: short open-ended questions with creative answers.
Every request has its own prompt (seeded choice), so no two requests in a wave run the same tokens.

Concurrency c: a wave of c requests submitted at once and stepped until all finish; each concurrency runs
ceil(--min-requests / c) waves, each on fresh prompts. The configs take turns wave by wave (every config runs the
same wave, in alternating order), so that the machine's drift over the run tilts no comparison.

Measured:
  TPOT p50   the median over requests of the engine's own RequestStats.tpot_s: (last token - first token) /
             (output tokens - 1), i.e. (e2e - ttft) / (n - 1) up to the finish bookkeeping;
  tok/s      output tokens of a wave / the wave's wall time (submission to last finish), summed over waves;
  ratio      TPOT p50 / off's TPOT p50 at the same workload and concurrency (< 1: faster);
  accept     accepted / verified draft tokens; k  the policy's mean chosen k per decoding request-step (0: none);
             draft/step  draft tokens verified per decoding request-step (the proposer may find fewer than k);
  per position: accepted drafts at position i / verifications (vLLM's spec_decode acceptance per position).
Every speculative request's output tokens are checked against off's for the same prompt: speculation changes no
token of greedy decoding. A mismatch is printed and makes the run exit 1, after the tables.

Targets (the issue): dynamic's TPOT >= 1.5x lower than off's at c=1 on `edit`, and never more than 5% above off's
at any concurrency on either workload; verdicts printed at the end.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core.stats import RequestStats
from engine.llm_engine import LLMEngine
from engine.loader.checkpoint import load_checkpoint
from engine.loader.model_registry import resolve_model

OFF = "off"

# Standard-library modules whose docstrings (prose) and functions (code) the edit workload quotes: real text,
# present wherever Python is, the same for a given Python version.
_TEXT_MODULES = ("argparse", "textwrap", "json", "logging", "collections", "string", "unittest", "doctest",
                 "pickle", "subprocess", "tarfile", "zipfile", "socket", "threading", "shutil", "csv", "heapq",
                 "bisect", "difflib", "functools", "itertools", "contextlib", "dataclasses", "enum", "fractions",
                 "decimal", "statistics", "random", "inspect", "typing", "pathlib", "tempfile", "calendar", "email",
                 "http.client", "urllib.parse", "xml.dom.minidom", "sqlite3", "configparser", "gettext", "locale")
_CODE_MODULES = ("textwrap", "json.encoder", "json.decoder", "collections", "heapq", "bisect", "difflib",
                 "functools", "shutil", "csv", "calendar", "fractions", "statistics", "random", "string", "posixpath",
                 "urllib.parse", "base64", "quopri", "colorsys", "fnmatch", "glob", "shlex", "tokenize", "pprint")

_EDIT_TASKS = (
    "Copy the following text exactly, word for word, and nothing else:\n\n{text}",
    "Fix any spelling mistakes in the following text and write it out again in full:\n\n{text}",
    "Rewrite the following text with every sentence on its own line:\n\n{text}",
)
_CODE_TASKS = (
    (
        "Rewrite the following Python function, renaming `{name}` to `{name}_v2`. Reply with the code only.\n\n"
        "```python\n{code}\n```"
    ),
    (
        "Add a type hint to every argument of the following Python function and write out the whole function:\n\n"
        "```python\n{code}\n```"
    ),
    "Copy the following Python code exactly:\n\n```python\n{code}\n```",
)
_CHAT_TASKS = (
    "Write a short poem about {x}.",
    "Tell me a story about {x}.",
    "What would a day in the life of {x} look like?",
    "Give me three creative ideas involving {x}.",
    "Describe {x} to someone who has never seen one.",
    "Why might {x} be important to people? Share your thoughts.",
    "Imagine you are {x}. What do you dream about?",
    "Invent a holiday that celebrates {x} and explain how people celebrate it.",
)
_CHAT_SUBJECTS = (
    "a lighthouse keeper", "a lost umbrella", "the first snow of winter", "a robot learning to paint",
    "an old oak tree", "a dragon who loves tea", "a city on the moon", "a forgotten library", "a paper boat",
    "a cat that runs a bakery", "the last bus of the night", "a whale singing", "a tiny island", "a clockmaker",
    "a volcano", "a friendly ghost", "a sunflower field", "a night market", "a mountain goat", "a time traveller",
    "a garden in the desert", "a jazz musician", "a broken compass", "a balloon race", "an ant colony",
    "a snowman in spring", "a haunted train", "a pirate parrot", "a secret tunnel", "a rainy Monday",
    "a bicycle", "a violin maker", "the northern lights", "a chess tournament", "a kite", "a beekeeper",
)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """One engine: speculation off, or a method with a policy."""

    method: str  # OFF, or a speculative method
    policy: str  # "" for OFF
    spec: dict[str, object] | None

    @property
    def name(self) -> str:
        return OFF if self.method == OFF else f"{self.method}/{self.policy}"


@dataclass
class SpecCounters:
    """The engine's speculation counters (deltas over a stretch of the run)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    chosen_k: Counter[int] = field(default_factory=Counter)

    @classmethod
    def of(cls, engine: LLMEngine) -> SpecCounters:
        s = engine.stats()
        return cls(num_drafts=s.spec_decode_num_drafts, num_draft_tokens=s.spec_decode_num_draft_tokens,
                   num_accepted_tokens=s.spec_decode_num_accepted_tokens,
                   accepted_per_pos=list(s.spec_decode_num_accepted_tokens_per_pos),
                   chosen_k=Counter(s.spec_decode_chosen_k))

    def minus(self, before: SpecCounters) -> SpecCounters:
        pos = [a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos) else 0)
               for i, a in enumerate(self.accepted_per_pos)]
        k = Counter(self.chosen_k)
        k.subtract(before.chosen_k)
        return SpecCounters(num_drafts=self.num_drafts - before.num_drafts,
                            num_draft_tokens=self.num_draft_tokens - before.num_draft_tokens,
                            num_accepted_tokens=self.num_accepted_tokens - before.num_accepted_tokens,
                            accepted_per_pos=pos, chosen_k=+k)

    def add(self, other: SpecCounters) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        if len(self.accepted_per_pos) < len(other.accepted_per_pos):
            self.accepted_per_pos.extend([0] * (len(other.accepted_per_pos) - len(self.accepted_per_pos)))
        for i, a in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += a
        self.chosen_k.update(other.chosen_k)

    @property
    def acceptance(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_k(self) -> float | None:
        n = sum(self.chosen_k.values())
        return sum(k * c for k, c in self.chosen_k.items()) / n if n else None

    @property
    def drafts_per_step(self) -> float | None:
        n = sum(self.chosen_k.values())  # decoding request-steps the policy saw
        return self.num_draft_tokens / n if n else None


@dataclass
class Row:
    workload: str
    config: BenchConfig
    concurrency: int
    tpot_p50_s: float
    tokens_per_s: float
    num_requests: int
    spec: SpecCounters


# -- workloads --------------------------------------------------------------------------------------------------
def _passages(tokenizer, max_prompt_tokens: int) -> list[str]:
    """Paragraph runs of the standard library's module docstrings, each up to ~max_prompt_tokens * 0.8 tokens."""
    out = []
    budget = int(max_prompt_tokens * 0.8)
    for name in _TEXT_MODULES:
        try:
            doc = inspect.getdoc(importlib.import_module(name)) or ""
        except ImportError:
            continue
        chunk: list[str] = []
        for para in (p.strip() for p in doc.split("\n\n")):
            if not para:
                continue
            candidate = "\n\n".join([*chunk, para])
            if len(tokenizer.encode(candidate, add_special_tokens=False)) > budget:
                if chunk and len(" ".join(chunk).split()) >= 30:
                    out.append("\n\n".join(chunk))
                chunk = [para] if len(tokenizer.encode(para, add_special_tokens=False)) <= budget else []
            else:
                chunk.append(para)
        if chunk and len(" ".join(chunk).split()) >= 30:
            out.append("\n\n".join(chunk))
    return out


def _functions(tokenizer, max_prompt_tokens: int) -> list[tuple[str, str]]:
    """(name, source) of standard-library functions of 6 to 40 lines that fit the prompt budget."""
    out = []
    budget = int(max_prompt_tokens * 0.8)
    for name in _CODE_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for fname, fn in sorted(vars(module).items()):
            if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
                continue
            try:
                source = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            num_lines = source.count("\n")
            if 6 <= num_lines <= 40 and len(tokenizer.encode(source, add_special_tokens=False)) <= budget:
                out.append((fname, source.rstrip()))
    return out


def _chat_ids(tokenizer, content: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def make_prompts(tokenizer, workload: str, n: int, *, seed: int, max_prompt_tokens: int) -> list[list[int]]:
    """n distinct chat-templated prompts of the workload, token ids, seeded."""
    rng = random.Random(f"{seed}-{workload}")
    if workload == "chat":
        pairs = [(t, x) for t in _CHAT_TASKS for x in _CHAT_SUBJECTS]
        rng.shuffle(pairs)
        if n > len(pairs):
            raise ValueError(f"the chat workload has {len(pairs)} distinct prompts, {n} asked for")
        return [_chat_ids(tokenizer, t.format(x=x)) for t, x in pairs[:n]]
    if workload != "edit":
        raise ValueError(f"unknown workload {workload!r}")
    texts = [(t, p) for p in _passages(tokenizer, max_prompt_tokens) for t in _EDIT_TASKS]
    codes = [(t, f) for f in _functions(tokenizer, max_prompt_tokens) for t in _CODE_TASKS]
    rng.shuffle(texts)
    rng.shuffle(codes)
    # Alternate prose and code; each passage or function once per task, so prompts stay distinct.
    items = [item for pair in zip(texts, codes) for item in pair]
    prompts: list[list[int]] = []
    for template, payload in items:
        if isinstance(payload, tuple):
            content = template.format(name=payload[0], code=payload[1])
        else:
            content = template.format(text=payload)
        ids = _chat_ids(tokenizer, content)
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == n:
            return prompts
    raise ValueError(f"the edit workload has {len(prompts)} distinct prompts of <= {max_prompt_tokens} tokens, "
                     f"{n} asked for")


# -- running ----------------------------------------------------------------------------------------------------
def run_wave(
    engine: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str
) -> tuple[list[list[int]], list[RequestStats], float]:
    """Submit every prompt at once, step to the end: (outputs in order, their RequestStats, wall seconds)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    wall_s = time.perf_counter() - start
    assert engine.stats().kv_blocks_used == 0, "KV blocks leaked"
    outs = [done[i] for i in ids]
    for out in outs:
        if out.finish_reason != "length" or len(out.token_ids) != max_tokens:
            raise RuntimeError(f"{out.request_id}: {out.finish_reason} after {len(out.token_ids)} tokens "
                               f"({out.error or 'no error'})")
    return [o.token_ids for o in outs], [o.stats for o in outs if o.stats is not None], wall_s


def build_configs(methods: list[str], args: argparse.Namespace, num_layers: int) -> list[BenchConfig]:
    configs = [BenchConfig(method=OFF, policy="", spec=None)]
    for method in methods:
        base: dict[str, object] = {"method": method, "num_speculative_tokens": args.num_speculative_tokens}
        if method == "ngram":
            base |= {"prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
        elif method == "layer_skip":
            base["num_layers"] = args.layer_skip_layers or num_layers // 2
        elif method == "draft_model":
            if not args.draft_model:
                print("draft_model: skipped — no smaller model with SmolLM2's vocabulary is available here "
                      "(SmolLM2-135M is the smallest); pass --draft-model PATH to include it")
                continue
            base["model"] = args.draft_model
        else:
            raise SystemExit(f"unknown method {method!r}")
        for policy in ("fixed", "dynamic"):
            configs.append(BenchConfig(method=method, policy=policy, spec={**base, "policy": policy}))
    return configs


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,4,16,64", help="comma-separated")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    p.add_argument("--min-requests", type=int, default=4,
                   help="requests per concurrency at least: ceil(this / c) waves of c")
    p.add_argument("--methods", default="ngram,layer_skip,draft_model",
                   help="draft_model runs only with --draft-model")
    p.add_argument("--workloads", default="edit,chat")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--layer-skip-layers", type=int, default=None, help="layer_skip's draft layers (default: half)")
    p.add_argument("--draft-model", default=None, help="a draft model with the target's vocabulary (path or name)")
    p.add_argument("--max-prompt-tokens", type=int, default=320)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: defaults concurrency 1,4, 16 tokens, 1 request minimum, prompts <= 160 tokens "
                        "(flags given explicitly still win)")
    if p.parse_known_args()[0].quick:
        p.set_defaults(concurrency="1,4", max_tokens=16, min_requests=1, max_prompt_tokens=160)
    args = p.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    workloads = args.workloads.split(",")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)

    checkpoint = load_checkpoint(str(resolve_model("smollm2-135m")), dtype=torch.float32)
    tok = checkpoint.tokenizer
    configs = build_configs(args.methods.split(","), args, checkpoint.config.num_layers)
    waves = {c: math.ceil(args.min_requests / c) for c in concurrencies}
    num_per_workload = 1 + sum(c * w for c, w in waves.items())  # the first prompt warms up
    prompts = {w: make_prompts(tok, w, num_per_workload, seed=args.seed, max_prompt_tokens=args.max_prompt_tokens)
               for w in workloads}

    # KV for the largest wave: every request's prompt, output and a step's drafts, in blocks of 16.
    block_size = 16
    longest = max(len(ids) for ps in prompts.values() for ids in ps)
    per_request = math.ceil((longest + args.max_tokens + args.num_speculative_tokens + 1) / block_size)
    num_kv_blocks = max(concurrencies) * per_request + 8
    max_model_len = block_size * per_request
    engines: dict[str, LLMEngine] = {}
    for config in configs:
        engines[config.name] = LLMEngine(
            EngineConfig(dtype="float32", max_model_len=max_model_len, max_num_seqs=max(max(concurrencies), 1),
                         max_num_batched_tokens=2048, num_kv_blocks=num_kv_blocks, block_size=block_size,
                         enable_prefix_caching=False, speculative_config=config.spec, seed=args.seed),
            checkpoint=checkpoint,
        )

    print(f"torch threads {torch.get_num_threads()}; configs: {', '.join(c.name for c in configs)}; "
          f"workloads: {', '.join(workloads)}; concurrency {concurrencies} "
          f"(waves {[waves[c] for c in concurrencies]}); {args.max_tokens} output tokens per request")
    for w in workloads:
        lens = [len(ids) for ids in prompts[w]]
        print(f"  {w}: {len(lens)} prompts, {min(lens)}-{max(lens)} tokens (mean {statistics.mean(lens):.0f})")

    # Warm-up: each engine, one short request per workload (the dynamic policy measures its first costs here).
    warm_tokens = 8
    warm_stats: list[RequestStats] = []
    for config in configs:
        for w in workloads:
            _, stats, _ = run_wave(engines[config.name], prompts[w][:1], warm_tokens, f"warm-{w}")
            if config.method == OFF:
                warm_stats += stats
    # A rough estimate of the timed run, from off's warm-up: its single-stream decode step (TPOT) scaled as if a
    # batch of c cost (1 + c / 5) single steps (CPU decode gets cheaper per token with batching, not free), its
    # prefill time per prompt token, and every config costing what off does (fixed k at high c costs more).
    step_s = min(s.tpot_s for s in warm_stats)
    prefill_s_per_token = min(s.ttft_s / s.num_prompt_tokens for s in warm_stats)
    est_s = len(configs) * sum(
        sum(waves[c] * args.max_tokens * step_s * (1 + c / 5) for c in concurrencies)
        + prefill_s_per_token * sum(len(ids) for ids in prompts[w][1:])
        for w in workloads
    )
    print(f"warm-up done (off: {step_s * 1e3:.1f} ms per decode step at c=1); rough estimate of the timed run: "
          f"{est_s / 60:.1f} min", flush=True)

    rows: list[Row] = []
    mismatches: list[str] = []
    run_start = time.perf_counter()
    header = (f"{'workload':<8} {'config':<20} {'conc':>4} {'TPOT p50 ms':>11} {'out tok/s':>9} {'vs off':>7} "
              f"{'accept':>6} {'mean k':>6} {'draft/step':>10}")
    print(header)
    for w in workloads:
        offset = 1
        for ci, c in enumerate(concurrencies):
            before = {cfg.name: SpecCounters.of(engines[cfg.name]) for cfg in configs if cfg.spec}
            tpots: dict[str, list[float]] = {cfg.name: [] for cfg in configs}
            tokens = dict.fromkeys(tpots, 0)
            wall = dict.fromkeys(tpots, 0.0)
            for i in range(waves[c]):
                batch = prompts[w][offset : offset + c]
                offset += c
                # The configs take turns wave by wave, in alternating order, so that drift tilts none of them.
                order = configs if (ci + i) % 2 == 0 else configs[::-1]
                outputs: dict[str, list[list[int]]] = {}
                for config in order:
                    outputs[config.name], stats, wave_s = run_wave(
                        engines[config.name], batch, args.max_tokens, f"{w}-c{c}-w{i}")
                    tpots[config.name] += [s.tpot_s for s in stats]
                    tokens[config.name] += sum(s.num_output_tokens for s in stats)
                    wall[config.name] += wave_s
                for config in configs:
                    for j, (got, want) in enumerate(zip(outputs[config.name], outputs[OFF], strict=True)):
                        if got != want:
                            first = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
                            mismatches.append(f"{w} c={c} wave {i} request {j} {config.name}: output differs "
                                              f"from off at token {first}")
            off_tpot_s = statistics.median(tpots[OFF])
            for config in configs:
                spec = SpecCounters.of(engines[config.name]).minus(before[config.name]) if config.spec else \
                    SpecCounters()
                row = Row(workload=w, config=config, concurrency=c, tpot_p50_s=statistics.median(tpots[config.name]),
                          tokens_per_s=tokens[config.name] / wall[config.name], num_requests=len(tpots[config.name]),
                          spec=spec)
                rows.append(row)
                print(f"{w:<8} {config.name:<20} {c:>4} {row.tpot_p50_s * 1e3:>11.1f} {row.tokens_per_s:>9.1f} "
                      f"{row.tpot_p50_s / off_tpot_s:>6.2f}x {_fmt(spec.acceptance, '.2f'):>6} "
                      f"{_fmt(spec.mean_k, '.2f'):>6} {_fmt(spec.drafts_per_step, '.2f'):>10}", flush=True)
    print(f"timed run: {(time.perf_counter() - run_start) / 60:.1f} min")

    print("\nacceptance per draft position (accepted at position i / verifications), all concurrencies:")
    k = args.num_speculative_tokens
    print(f"{'workload':<8} {'config':<20} {'verifs':>7} " + " ".join(f"{'pos ' + str(i):>6}" for i in range(k)))
    for w in workloads:
        for config in configs:
            if config.spec is None:
                continue
            total = SpecCounters()
            for r in rows:
                if r.workload == w and r.config == config:
                    total.add(r.spec)
            per_pos = [(total.accepted_per_pos[i] if i < len(total.accepted_per_pos) else 0) for i in range(k)]
            cells = " ".join(f"{_fmt(a / total.num_drafts if total.num_drafts else None, '.2f'):>6}" for a in per_pos)
            print(f"{w:<8} {config.name:<20} {total.num_drafts:>7} {cells}")

    print("\ntargets:")
    for config in configs:
        if config.policy != "dynamic":
            continue
        by = {(r.workload, r.concurrency): r for r in rows if r.config == config}
        off = {(r.workload, r.concurrency): r for r in rows if r.config.method == OFF}
        if ("edit", 1) in by:
            speedup = off[("edit", 1)].tpot_p50_s / by[("edit", 1)].tpot_p50_s
            print(f"  {config.name}: TPOT at c=1 on edit {speedup:.2f}x lower than off (target >= 1.5x): "
                  f"{'MET' if speedup >= 1.5 else 'NOT MET'}")
        worst = max(by, key=lambda key: by[key].tpot_p50_s / off[key].tpot_p50_s)
        ratio = by[worst].tpot_p50_s / off[worst].tpot_p50_s
        print(f"  {config.name}: worst TPOT vs off {ratio:.2f}x at {worst[0]} c={worst[1]} (target <= 1.05x): "
              f"{'MET' if ratio <= 1.05 else 'NOT MET'}")

    if mismatches:
        print(f"\n{len(mismatches)} requests' outputs differ from speculation off:")
        for m in mismatches:
            print(f"  {m}")
        sys.exit(1)
    print(f"\nevery speculative request's {args.max_tokens} output tokens equal off's")


if __name__ == "__main__":
    main()
