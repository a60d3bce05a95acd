"""`splitserve generate`: offline generation from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from engine.engine_args import add_engine_args, engine_config_from_args
from engine.request.sampling_params import SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text offline with the in-process engine")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--stop", action="append", default=[], help="a stop string; repeatable")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--request-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--json", action="store_true", help='print one {"text", "token_ids"} JSON object per prompt')
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        seed=args.request_seed,
    )
    params.validate()  # fail on bad sampling flags before loading the model
    from engine.llm import LLM  # torch loads here, after the flags are known to be good

    config = engine_config_from_args(args)
    llm = LLM(**dataclasses.asdict(config))
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for out in outputs:
        if args.json:
            print(json.dumps({"text": out.text, "token_ids": out.token_ids}))
        else:
            print(out.text)
    sys.stdout.flush()
    return 0
