"""`splitserve profile` and `splitserve plan`: flags -> the profiler or the planner -> files and tables.

    splitserve profile --model M [engine flags] --out profile.json [--quick] [--transports grpc,inproc]
    splitserve plan --profile profile.json --isl 1024 --osl 256 --ttft-slo 2 --tpot-slo 0.15 [--rate 2.5] ...
    splitserve plan --profile profile.json --validate DIR
    splitserve plan ... --num-requests N       a finite run of N requests (deploy/planner/finite_run.py)

Exit status: 0; 1 when `plan` finds no layout meeting the SLO (the closest is printed, with what binds); 2 for bad
input (a profile from another model than --model, a negative rate, an SLO below the profile's floor).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import TYPE_CHECKING

from engine.engine_args import add_engine_args

if TYPE_CHECKING:
    from deploy.planner.profile import Loaded, Profile, Serving


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help="measure one worker of each role on this machine for `splitserve plan`")
    p.add_argument("--out", required=True, help="where to write the profile (JSON)")
    p.add_argument("--quick", action="store_true", help="a coarse profile: fewer, shorter points (minutes on 2 cores)")
    p.add_argument("--transports", default="grpc,inproc",
                   help="KV transports whose handoffs to time, comma-separated ('' for none)")
    p.add_argument("--serving-requests", type=int, default=6,
                   help="requests of each kind through a real `serve` of one colocated worker, to measure what the "
                        "gateway adds (0: not measured)")
    p.add_argument("--loaded-requests", type=int, default=None,
                   help="requests a rate of the loaded probe: a real `serve` of 1P+1D on this machine driven by "
                        "AIPerf, its TTFT stages read (default 40; 0, and with --quick: not measured)")
    p.add_argument("--loaded-rates", default=None,
                   help="the loaded probe's Poisson rates, comma-separated (default: 0.25 and 0.5 of what its "
                        "prefill worker can prefill)")
    p.add_argument("--tensor-parallel-sizes", default="",
                   help="tensor-parallel sizes (each >= 2, comma-separated) to time against size 1 on the same cores, "
                        "which `plan` then searches for each pool (default: none, size 1 only)")
    add_engine_args(p)
    p.set_defaults(func=run_profile_command)

    q = subparsers.add_parser("plan", help="size the pools for a traffic mix and an SLO from a profile")
    q.add_argument("--profile", required=True, help="a profile `splitserve profile` wrote")
    q.add_argument("--model", default=None,
                   help="the model to plan for: must be the profile's (its --model or its weights' identity)")
    q.add_argument("--isl", type=int, default=None, help="prompt tokens per request")
    q.add_argument("--osl", type=int, default=None, help="output tokens per request")
    q.add_argument("--prefix-hit", type=float, default=0.0, help="fraction of each prompt found in the prefix cache")
    q.add_argument("--rate", type=float, default=None,
                   help="requests/s (Poisson); omitted: each layout's highest rate within the SLO")
    q.add_argument("--num-requests", type=int, default=None,
                   help="price a finite run of this many requests (a bench run's length: its backlog past capacity "
                        "and the gateway's refusals); omitted: steady state")
    q.add_argument("--ttft-slo", type=float, default=None, help="seconds: the TTFT p90 to meet")
    q.add_argument("--tpot-slo", type=float, default=None, help="seconds: the TPOT p90 to meet")
    q.add_argument("--max-workers", type=int, default=16,
                   help="workers at most, all pools together (a worker of tensor-parallel size N counts N)")
    q.add_argument("--one-host", action="store_true",
                   help="every worker on the profiled machine, sharing its cores as `serve` splits them")
    q.add_argument("--client-cores", type=float, default=None,
                   help="with --one-host: cores the load generator keeps busy on the host while it runs (default 0; "
                        "with --validate, what each run measured where its report says)")
    q.add_argument("--serving-overhead-s", type=float, default=None,
                   help="seconds the serving path adds to TTFT (default: the profile's measured serving overhead)")
    q.add_argument("--no-loaded-costs", action="store_true",
                   help="with --one-host: price the engine's profile alone, not the stage costs the profile's "
                        "loaded probe measured")
    q.add_argument("--kv-transport", default=None,
                   help="the KV transport of disaggregated layouts (default: grpc, if the profile measured it)")
    q.add_argument("--top", type=int, default=10, help="layouts the table shows")
    q.add_argument("--json", action="store_true", help="print the ranked layouts as JSON")
    q.add_argument("--values-out", default=None, help="write the best disaggregated layout as Helm values (YAML)")
    q.add_argument("--validate", default=None, metavar="DIR",
                   help="compare DIR/report.json (a bench run) with DIR/plan.json (`plan --json`'s output)")
    q.set_defaults(func=run_plan_command)


def run_profile_command(args: argparse.Namespace) -> int:
    from engine.engine_args import engine_config_from_args

    config = engine_config_from_args(args)  # a bad engine flag fails here, before any measuring
    transports = [t for t in args.transports.split(",") if t]
    from kv_transfer.registry import TRANSPORTS

    unknown = [t for t in transports if t not in TRANSPORTS]
    if unknown:
        raise ValueError(f"--transports: unknown {', '.join(unknown)} (known: {', '.join(TRANSPORTS)})")
    from deploy.planner.profiler import run_profile  # torch loads here

    if args.serving_requests < 0:
        raise ValueError(f"--serving-requests must be >= 0, got {args.serving_requests}")
    loaded_requests = args.loaded_requests if args.loaded_requests is not None else 0 if args.quick else 40
    if loaded_requests < 0:
        raise ValueError(f"--loaded-requests must be >= 0, got {loaded_requests}")
    loaded_rates = _rates(args.loaded_rates)
    tp_sizes = _sizes(args.tensor_parallel_sizes)
    profile = run_profile(config, quick=args.quick, transports=transports, seed=args.seed or 0,
                          tensor_parallel_sizes=tp_sizes)
    serving = None
    if args.serving_requests:
        try:
            serving = _measure_serving(profile, args.serving_requests)
        except Exception as exc:  # noqa: BLE001 - the engine's profile stands without it; say why
            print(f"splitserve: serving not measured ({type(exc).__name__}: {exc}); plan adds nothing for it",
                  file=sys.stderr)
    if serving is not None:
        profile = dataclasses.replace(profile, serving=serving)
        print(f"splitserve: serving adds {profile.serving.ttft_overhead_s * 1e3:.1f} ms to TTFT and "
              f"{profile.serving.step_overhead_s * 1e3:.1f} ms to a step; the gateway takes "
              f"{profile.serving.gateway_cpu_per_request_s * 1e3:.1f} ms CPU a request, "
              f"{profile.serving.gateway_cpu_per_token_s * 1e3:.2f} ms a token", file=sys.stderr)
    if loaded_requests and "grpc" in profile.handoff:
        try:
            profile = dataclasses.replace(profile, loaded=_measure_loaded(profile, loaded_requests, loaded_rates))
        except Exception as exc:  # noqa: BLE001 - the profile stands without it; say why
            print(f"splitserve: the loaded probe was not measured ({type(exc).__name__}: {exc}); plan --one-host "
                  "prices no stage under load", file=sys.stderr)
    elif loaded_requests:
        print("splitserve: the loaded probe needs the grpc handoff profiled (--transports); not measured",
              file=sys.stderr)
    profile.write(args.out)
    print(f"splitserve: profile of {profile.model.name} ({profile.model.identity}) written to {args.out} in "
          f"{profile.wall_s:.0f} s: prefill {len(profile.prefill_points)} points, decode {len(profile.decode_points)}, "
          f"handoffs over {', '.join(profile.handoff) or 'no transport'}"
          + (f" (skipped: {'; '.join(f'{k}: {v}' for k, v in profile.handoff_skipped.items())})"
             if profile.handoff_skipped else ""), file=sys.stderr)
    return 0


def _sizes(text: str) -> list[int]:
    """--tensor-parallel-sizes: integers >= 2, comma-separated ("" for none)."""
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--tensor-parallel-sizes: integers, comma-separated, got {text!r}") from None
    if any(size < 2 for size in sizes):
        raise ValueError(f"--tensor-parallel-sizes: each size >= 2 (size 1 is the profile itself), got {text!r}")
    return sizes


def _measure_serving(profile: Profile, num_requests: int) -> Serving:
    """The profile's `serving`: a real `serve` of one colocated worker with the profiled flags (serving_probe.py)."""
    from deploy.planner.planner import Layout
    from deploy.planner.render import serve_flags
    from deploy.planner.serving_probe import measure_serving

    args = serve_flags(profile, Layout(num_colocated=1, max_num_seqs=profile.max_num_seqs))
    prompt_words = _probe_prompt_len(profile)
    return measure_serving(args, model=profile.model.name, prompt_words=prompt_words,
                           prefill_s=lambda n: profile.prefill.seconds(n),
                           decode_step_s=lambda ctx: profile.decode.seconds(1, ctx),
                           num_requests=num_requests, max_tokens=min(32, prompt_words))


def _probe_prompt_len(profile: Profile) -> int:
    """The prompt length the serving probes send: 256, or a quarter of a shorter context."""
    return min(256, (profile.max_model_len or 2048) // 4)


def _rates(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise ValueError(f"--loaded-rates: comma-separated requests/s, got {text!r}") from None
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--loaded-rates: positive requests/s, got {text!r}")
    return rates


def _measure_loaded(profile: Profile, num_requests: int, rates: list[float] | None) -> Loaded:
    """The profile's `loaded`: 1P+1D over grpc with the profiled flags, driven by AIPerf (load_probe.py)."""
    from deploy.planner.load_probe import default_rates, measure_loaded
    from deploy.planner.planner import Layout

    isl = _probe_prompt_len(profile)
    osl = min(64, isl)
    layout = Layout(num_prefill=1, num_decode=1, max_num_seqs=min(16, profile.max_num_seqs), transport="grpc")
    rates = rates or default_rates(profile, isl=isl)
    print(f"splitserve: loaded probe: 1P+1D at {', '.join(f'{r:g}' for r in rates)} req/s, {num_requests} "
          f"requests each", file=sys.stderr)
    return measure_loaded(profile, layout, rates=rates, num_requests=num_requests, isl=isl, osl=osl,
                          log=lambda line: print(f"splitserve: {line}", file=sys.stderr))


def check_model(profile_model: tuple[str, str], wanted: str | None) -> None:
    """The plan knows its model by the profile: --model, when given, must name the same (the --model the profile
    ran with, or its weights' identity, e.g. sha256:...); a ValueError otherwise."""
    name, identity = profile_model
    if wanted is not None and wanted not in (name, identity):
        raise ValueError(f"the profile is of {name} ({identity}), not {wanted}: profile {wanted} first "
                         f"(`splitserve profile --model {wanted} --out ...`)")


def run_plan_command(args: argparse.Namespace) -> int:
    from deploy.planner.loaded import describe as describe_loaded
    from deploy.planner.planner import SLO, PlanOptions, Traffic, plan
    from deploy.planner.profile import load_profile
    from deploy.planner.render import format_table, helm_values, plan_json, serve_command, to_yaml

    profile = load_profile(args.profile)
    check_model((profile.model.name, profile.model.identity), args.model)
    options = PlanOptions(max_workers=args.max_workers, one_host=args.one_host, transport=args.kv_transport,
                          client_cores=args.client_cores or 0.0, serving_overhead_s=args.serving_overhead_s,
                          loaded_costs=not args.no_loaded_costs)
    if args.validate is not None:
        from deploy.planner.validate import compare_run_dir, format_comparisons

        comparisons, summary = compare_run_dir(profile, args.validate, options,
                                               measured_client=args.client_cores is None)
        if args.json:
            print(json.dumps({"summary": summary, "comparisons": [  # a stage has no steady state: null, not NaN
                {**dataclasses.asdict(c), "error": c.error, "steady": None if math.isnan(c.steady) else c.steady}
                for c in comparisons]}, indent=1))
        else:
            print(format_comparisons(comparisons, summary))
        return 0
    missing = [flag for flag, value in (("--isl", args.isl), ("--osl", args.osl), ("--ttft-slo", args.ttft_slo),
                                        ("--tpot-slo", args.tpot_slo)) if value is None]
    if missing:
        raise ValueError(f"plan needs {', '.join(missing)} (or --validate DIR)")
    traffic = Traffic(isl=args.isl, osl=args.osl, prefix_hit=args.prefix_hit, rate=args.rate,
                      num_requests=args.num_requests)
    slo = SLO(ttft_s=args.ttft_slo, tpot_s=args.tpot_slo)
    result = plan(profile, traffic, slo, options)
    if args.json:
        print(json.dumps(plan_json(profile, result, top=args.top), indent=1))
    else:
        rate = f"{traffic.rate} req/s" if traffic.rate is not None else "the highest rate within the SLO"
        print(f"{profile.model.name} on {profile.machine.get('device_name')} ({profile.cpu_count} cores); "
              f"isl {traffic.isl}, osl {traffic.osl}, prefix hit {traffic.prefix_hit}, {rate}; SLO TTFT p90 <= "
              f"{slo.ttft_s} s, TPOT p90 <= {slo.tpot_s} s")
        if loaded_line := describe_loaded(profile, options):
            print(loaded_line)
        print(format_table(result, top=args.top))
        print()
        if result.met:
            print(f"best: {result.best.layout.label}\n  {serve_command(profile, result.best.layout)}")
        else:
            print(f"splitserve: {result.problem}")
    if args.values_out is not None:
        values, note = helm_values(profile, result)
        if not values:
            raise ValueError(f"--values-out: {note}")
        header = f"# splitserve plan: {note}\n" if note else "# splitserve plan\n"
        with open(args.values_out, "w", encoding="utf-8") as out:
            out.write(header + to_yaml(values) + "\n")
        if note:
            print(f"splitserve: {note}", file=sys.stderr)
    return 0 if result.met else 1
