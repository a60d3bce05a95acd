"""The workloads `splitserve bench` offers, each as AIPerf flags (AIPerf builds the prompts; we build none).

    random          synthetic prompts of exactly --isl tokens (AIPerf's --isl, stddev 0), completions endpoint
    shared-prefix   --num-prefixes prefixes of --prefix-length tokens, one picked per request and followed by a
                    unique --isl-token prompt (AIPerf's --num-prefix-prompts/--prefix-prompt-length): prefix-cache
                    and prefix-routing traffic, completions endpoint
    chat            multi-turn conversations of --turns turns (AIPerf's --conversation-turn-mean, stddev 0), each
                    turn --isl new tokens on top of the history, chat endpoint
    FILE.jsonl      AIPerf's custom dataset: one JSON object a line, `{"text": ...}` (single_turn) or
                    `{"turns": [{"text": ...}, ...]}` (multi_turn; chosen when the records have "turns"),
                    chat endpoint

Every request asks for exactly --osl tokens (max tokens --osl, ignore_eos), streamed, with the server's own token
counts (--use-server-token-count): TTFT, TPOT and the goodput SLOs are then comparable across servers and with a
plan. --endpoint overrides the endpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

WORKLOADS = ("random", "shared-prefix", "chat")
ENDPOINTS = ("completions", "chat")


@dataclass(frozen=True, kw_only=True)
class Workload:
    kind: str  # random | shared-prefix | chat | file
    isl: int
    osl: int
    prefix_length: int = 0
    num_prefixes: int = 0
    turns: int = 1
    path: str | None = None  # the JSONL file, kind "file"
    dataset_type: str | None = None  # AIPerf's --custom-dataset-type of the file: single-turn | multi-turn
    endpoint: str = "completions"

    def as_json(self) -> dict[str, object]:
        """The fields that shape this kind of workload (report.json's "workload")."""
        unused = {"random": ("prefix_length", "num_prefixes", "turns"), "shared-prefix": ("turns",),
                  "chat": ("prefix_length", "num_prefixes"), "file": ("isl", "prefix_length", "num_prefixes", "turns")}
        return {k: v for k, v in self.__dict__.items() if v is not None and k not in unused[self.kind]}


def check_jsonl(path: str) -> str:
    """AIPerf's dataset type for a JSONL file (multi-turn if its records have "turns", else single-turn);
    a ValueError naming the line for a file that is not one JSON object a line with "text"/"texts"/"turns"."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--workload {path}: no such file")
    kinds = set()
    with file.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--workload {path}: line {number} is not JSON ({exc.msg})") from None
            if not isinstance(record, dict) or not ({"text", "texts", "turns"} & record.keys()):
                raise ValueError(f"--workload {path}: line {number} is not an object with \"text\", \"texts\" "
                                 "or \"turns\" (AIPerf's single_turn or multi_turn record)")
            kinds.add("multi-turn" if "turns" in record else "single-turn")
    if not kinds:
        raise ValueError(f"--workload {path}: no records")
    if len(kinds) > 1:
        raise ValueError(f"--workload {path}: mixes single-turn records and records with \"turns\"")
    return kinds.pop()


def make_workload(name: str, *, isl: int, osl: int, prefix_length: int, num_prefixes: int, turns: int,
                  endpoint: str | None) -> Workload:
    """The workload --workload names (one of WORKLOADS, or a .jsonl file); ValueError for a bad one."""
    for flag, value, least in (("--isl", isl, 1), ("--osl", osl, 1), ("--turns", turns, 1),
                               ("--prefix-length", prefix_length, 1), ("--num-prefixes", num_prefixes, 1)):
        if value < least:
            raise ValueError(f"{flag} must be at least {least}, got {value}")
    if endpoint is not None and endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint: one of {', '.join(ENDPOINTS)}, got {endpoint!r}")
    if name == "random":
        return Workload(kind="random", isl=isl, osl=osl, endpoint=endpoint or "completions")
    if name == "shared-prefix":
        return Workload(kind="shared-prefix", isl=isl, osl=osl, prefix_length=prefix_length,
                        num_prefixes=num_prefixes, endpoint=endpoint or "completions")
    if name == "chat":
        return Workload(kind="chat", isl=isl, osl=osl, turns=turns, endpoint=endpoint or "chat")
    if name.endswith(".jsonl"):
        return Workload(kind="file", isl=isl, osl=osl, path=str(Path(name).resolve()),
                        dataset_type=check_jsonl(name), endpoint=endpoint or "chat")
    raise ValueError(f"--workload: one of {', '.join(WORKLOADS)} or a FILE.jsonl, got {name!r}")


def aiperf_flags(workload: Workload, *, num_requests: int) -> list[str]:
    """The AIPerf flags of the workload's prompts and outputs for a run of `num_requests` requests (turns)."""
    flags = ["--endpoint-type", workload.endpoint, "--streaming", "--use-server-token-count",
             "--osl", str(workload.osl), "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true"]
    if workload.kind == "file":
        assert workload.path is not None and workload.dataset_type is not None
        return [*flags, "--input-file", workload.path, "--custom-dataset-type", workload.dataset_type]
    flags += ["--isl", str(workload.isl), "--isl-stddev", "0"]
    if workload.kind == "shared-prefix":
        flags += ["--num-prefix-prompts", str(workload.num_prefixes),
                  "--prefix-prompt-length", str(workload.prefix_length)]
    elif workload.kind == "chat":
        flags += ["--conversation-num", str(math.ceil(num_requests / workload.turns)),
                  "--conversation-turn-mean", str(workload.turns), "--conversation-turn-stddev", "0"]
    return flags
