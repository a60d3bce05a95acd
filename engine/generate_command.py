"""`splitserve generate`: offline generation from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing

from engine.engine_args import add_engine_args, engine_config_from_args
from engine.request.generation_config import AUTO, parse_override
from engine.request.lora import LoRARequest
from engine.request.sampling_params import FLAG_FIELDS, SamplingParams, check_engine_rules


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text offline with the in-process engine")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user turn in the chat template")
    add_sampling_flags(p)
    p.add_argument("--generation-config", default=AUTO,
                   help="the sampling defaults the flags above override: auto (the model's generation_config.json, "
                        "if any), vllm (SamplingParams' own), or a folder holding such a file")
    p.add_argument("--override-generation-config", default=None,
                   help='a JSON object over --generation-config\'s values, e.g. \'{"temperature": 0.5}\'')
    p.add_argument("--lora-name", default=None, metavar="NAME",
                   help="run every prompt under this LoRA adapter of --lora-modules (with --enable-lora)")
    p.add_argument("--json", action="store_true", help='print one {"text", "token_ids"} JSON object per prompt')
    add_engine_args(p)
    p.set_defaults(func=run)


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for each SamplingParams field its table gives one (`param(flag=...)`): a bool is a switch, a list a
    repeatable flag, anything else one value of the field's type. A flag not given is None and sets nothing (the
    field keeps the default it is given: `sampling_params_from_flags`)."""
    types = typing.get_type_hints(SamplingParams)
    for field in dataclasses.fields(SamplingParams):
        flag = field.metadata.get("flag")
        if flag is None:
            continue
        kind = types[field.name]
        help_text = field.metadata["help"]
        if kind is bool:
            parser.add_argument(flag, action="store_true", default=None, help=help_text)
        elif typing.get_origin(kind) is list:
            parser.add_argument(flag, action="append", default=None, help=help_text)
        else:  # int, float, or one of them or None
            (scalar,) = [t for t in typing.get_args(kind) or (kind,) if t is not type(None)]
            parser.add_argument(flag, type=scalar, default=None, help=help_text)


def sampling_params_from_flags(args: argparse.Namespace, defaults: SamplingParams | None = None) -> SamplingParams:
    """`defaults` (else SamplingParams()) with the fields whose flags were given set as given."""
    given = {name: value for flag, name in FLAG_FIELDS.items()
             if (value := getattr(args, flag[2:].replace("-", "_"))) is not None}
    return dataclasses.replace(defaults if defaults is not None else SamplingParams(), **given)


def run(args: argparse.Namespace) -> int:
    given = sampling_params_from_flags(args)  # bad sampling flags fail before the model loads
    given.validate()
    check_engine_rules(given, scheduling_policy=args.scheduling_policy, max_logprobs=args.max_logprobs)
    config = engine_config_from_args(args)
    lora = None
    if args.lora_name is not None:
        paths = dict(config.lora_modules)
        if args.lora_name not in paths:
            known = ", ".join(paths) or "none"
            raise ValueError(f"--lora-name {args.lora_name!r} is not one of --lora-modules ({known})")
        lora = LoRARequest(args.lora_name, 1, paths[args.lora_name])
    from engine.llm import LLM  # torch loads here, after the flags are known to be good

    text = args.override_generation_config
    override = None if text is None else parse_override(text)
    llm = LLM(**dataclasses.asdict(config), generation_config=args.generation_config,
              override_generation_config=override)
    params = sampling_params_from_flags(args, llm.get_default_sampling_params())  # the model's, under the flags
    params.validate()
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, lora_request=lora)
        else:
            outputs = llm.generate(args.prompt, params, lora_request=lora)
    finally:
        llm.engine.close()  # with --kv-offload-dir, the prefix cache is written down for the next run
    for out in outputs:
        if args.json:
            print(json.dumps({"text": out.text, "token_ids": out.token_ids}))
        else:
            print(out.text)
    sys.stdout.flush()
    return 0
