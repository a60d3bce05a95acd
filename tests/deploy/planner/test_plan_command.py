"""`splitserve plan` end to end on a synthetic profile file: the table, --json, --values-out (rendered by the real
chart), the serve flags (parsed by the real `serve` parser), --validate, and bad input's exit status and message.
Torch-free."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.cli import build_parser, main
from deploy.planner.planner import SLO, Layout, LayoutModel, PlanOptions, Traffic
from deploy.planner.profile import load_profile, profile_from_json
from deploy.planner.render import serve_flags
from tests.deploy.planner.synthetic import synthetic_profile

PLAN = ["--isl", "1024", "--osl", "256", "--rate", "2.5", "--ttft-slo", "2", "--tpot-slo", "0.15", "--max-workers", "8"]


@pytest.fixture()
def profile_path(tmp_path: Path) -> Path:
    path = tmp_path / "profile.json"
    synthetic_profile().write(path)
    return path


def test_a_profile_reads_back_as_written(profile_path: Path) -> None:
    assert load_profile(profile_path) == synthetic_profile()


@pytest.mark.parametrize("damage, match", [
    (lambda d: d.update(schema="other/1"), "not a splitserve profile"),
    (lambda d: d["prefill"]["fit"].pop("per_token_s"), r"prefill.fit: missing per_token_s"),
    (lambda d: d["decode"]["points"][0].update(seconds=-1), r"decode.points\[0\].seconds: expected a number >= 0"),
    (lambda d: d["model"].update(identity=""), "model needs its name and identity"),
    (lambda d: d.pop("kv"), "malformed profile"),
])
def test_a_damaged_profile_is_a_clear_error(damage, match: str) -> None:
    data = synthetic_profile().to_json()
    damage(data)
    with pytest.raises(ValueError, match=match):
        profile_from_json(data)


def test_plan_prints_the_ranked_table_and_the_best_as_serve_flags(profile_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", str(profile_path), *PLAN]) == 0
    out = capsys.readouterr().out
    assert "TTFT p50" in out and "goodput" in out and "meets" in out
    (command,) = [line.strip() for line in out.splitlines() if line.strip().startswith("splitserve serve")]
    # the flags are the real `serve` flags: its own parser takes them and builds the pools they name
    args = build_parser().parse_args(command.split()[1:])
    assert args.command == "serve" and args.model == "smollm2-135m"


def test_plan_json_holds_the_ranked_layouts_and_their_predictions(profile_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", str(profile_path), *PLAN, "--json", "--top", "5"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["schema"] == "splitserve-plan/1" and data["met"] and len(data["ranked"]) == 5
    first = data["ranked"][0]
    assert first == {k: v for k, v in data["best"].items() if k != "serve_flags"}
    assert first["meets_slo"] and first["ttft_p90_s"] <= 2 and first["tpot_p90_s"] <= 0.15
    assert {"num_prefill", "num_decode", "num_colocated", "max_num_seqs", "kind"} <= set(first["layout"])
    workers = [r["layout"]["num_workers"] for r in data["ranked"] if r["meets_slo"]]
    assert workers == sorted(workers)


def test_serve_flags_make_the_pools_the_layout_names() -> None:
    from deploy.planner.planner import Layout
    from deploy.serve_args import pools_from_args

    profile = synthetic_profile(kv_cache_dtype="int8")
    for layout, pools in [(Layout(num_prefill=2, num_decode=3, max_num_seqs=32, transport="grpc"), (2, 3, 0)),
                          (Layout(num_colocated=4, max_num_seqs=16), (0, 0, 4))]:
        args = build_parser().parse_args(["serve", *serve_flags(profile, layout)])
        config, _ = pools_from_args(args, autoscale=False)
        assert (config.num_prefill_workers, config.num_decode_workers, config.num_colocated_workers) == pools
        assert config.engine.max_num_seqs == layout.max_num_seqs and config.engine.kv_cache_dtype == "int8"


@pytest.mark.slow  # renders the chart through Helm's Go SDK
def test_values_out_renders_with_the_chart(profile_path: Path, tmp_path: Path) -> None:
    import yaml

    from tests.helm.chart import find, render

    out = tmp_path / "values.yaml"
    assert main(["plan", "--profile", str(profile_path), *PLAN, "--values-out", str(out)]) == 0
    values = yaml.safe_load(out.read_text())
    assert set(values) == {"model", "kvTransport", "engine", "gateway", "prefill", "decode"}
    objects = render(values)  # the chart's values.schema.json takes them
    head = json.dumps(find(objects, "Deployment", "head"))
    assert f"--prefill-workers={values['prefill']['replicas']}" in head
    assert f"--decode-workers={values['decode']['replicas']}" in head


def test_no_layout_meeting_the_slo_exits_1_naming_the_closest(profile_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", str(profile_path), "--isl", "1024", "--osl", "256", "--rate", "20",
                 "--ttft-slo", "2", "--tpot-slo", "0.15", "--max-workers", "3"]) == 1
    out = capsys.readouterr().out
    assert "no layout within 3 workers meets the SLO at 20.0 requests/s" in out and "binding:" in out


@pytest.mark.parametrize("extra, match", [
    (["--model", "llama-3.2-1b"], "the profile is of smollm2-135m (sha256:1a02d2c24148c4f7bbae9ff4), not llama-3.2-1b"),
    (["--rate", "-2"], "--rate must be positive"),
    (["--ttft-slo", "0.1"], "--ttft-slo 0.1 s is below the profile's floor"),
    (["--max-workers", "0"], "--max-workers must be at least 1"),
    (["--one-host", "--client-cores", "-1"], "--client-cores must be >= 0"),
    (["--serving-overhead-s", "-0.1"], "--serving-overhead-s must be >= 0"),
])
def test_bad_input_exits_2_with_a_clear_message(profile_path: Path, capsys: pytest.CaptureFixture[str],
                                                extra: list[str], match: str) -> None:
    base = ["--isl", "1024", "--osl", "256", "--rate", "1", "--ttft-slo", "2", "--tpot-slo", "0.15"]
    assert main(["plan", "--profile", str(profile_path), *base, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve: error: ") and match in err


def test_the_profiles_model_by_name_or_identity_is_accepted(profile_path: Path) -> None:
    for model in ("smollm2-135m", "sha256:1a02d2c24148c4f7bbae9ff4"):
        assert main(["plan", "--profile", str(profile_path), *PLAN, "--model", model]) == 0


def test_missing_traffic_flags_and_a_missing_profile_are_clear(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    synthetic_profile().write(tmp_path / "p.json")
    assert main(["plan", "--profile", str(tmp_path / "p.json"), "--isl", "10"]) == 2
    assert "plan needs --osl, --ttft-slo, --tpot-slo" in capsys.readouterr().err
    assert main(["plan", "--profile", str(tmp_path / "none.json"), *PLAN]) == 2
    assert "none.json" in capsys.readouterr().err


def planned_run(profile_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[Path, dict, Layout]:
    """A run directory holding `plan --json`'s plan.json of PLAN, that plan, and its best layout."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert main(["plan", "--profile", str(profile_path), *PLAN, "--json"]) == 0
    (run_dir / "plan.json").write_text(capsys.readouterr().out)
    planned = json.loads((run_dir / "plan.json").read_text())
    derived = ("label", "num_workers", "num_ranks", "kind")
    return run_dir, planned, Layout(**{k: v for k, v in planned["best"]["layout"].items() if k not in derived})


def test_validate_compares_a_bench_report_with_the_plan(profile_path: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, planned, layout = planned_run(profile_path, tmp_path, capsys)
    # Each run is priced as a finite run of the requests it sent (100: completed + refused).
    profile = load_profile(profile_path)
    traffic = Traffic(isl=1024, osl=256, num_requests=100)
    predicted = LayoutModel(profile, traffic, layout, PlanOptions()).predict(2.5, SLO(ttft_s=2, tpot_s=0.15))
    # A report whose numbers are that prediction's at 2.5 req/s, 10% higher, and a run at 40 req/s that missed.
    report = {"schema": "splitserve-bench/1", "runs": [
        {"rate": 2.5, "num_requests": 100, "ttft_s": {"p50": predicted.ttft_p50_s * 1.1,
                                                      "p90": predicted.ttft_p90_s * 1.1},
         "tpot_s": {"p50": predicted.tpot_p50_s * 1.1, "p90": predicted.tpot_p90_s * 1.1},
         # the gateway's TTFT stage histograms over the run (deploy/bench/stages.py), one of them empty
         "stages": {"prefill": {"count": 100, "mean_s": 0.5}, "router_queue": {"count": 100, "mean_s": 0.25},
                    "kv_transfer": {"count": 0, "mean_s": None}}},
        {"rate": 40.0, "num_requests": 100, "num_errors": 200, "ttft_s": {"p50": 30.0, "p90": 60.0},
         "tpot_s": {"p50": 0.5, "p90": 0.9}}]}
    (run_dir / "report.json").write_text(json.dumps(report))
    assert main(["plan", "--profile", str(profile_path), "--validate", str(run_dir), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    at_plan = [c for c in data["comparisons"] if c["rate"] == 2.5]
    assert {c["metric"] for c in at_plan} == {"ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s", "refused",
                                              "prefill_s", "router_queue_s"}  # the stages the run timed
    stages = {c["metric"]: c for c in at_plan if c["metric"] in ("prefill_s", "router_queue_s")}
    finite = LayoutModel(profile, traffic, layout, PlanOptions()).predict_finite(2.5, SLO(ttft_s=2, tpot_s=0.15), 100)
    for stage, c in stages.items():
        assert c["predicted"] == pytest.approx(finite.stages[stage.removesuffix("_s")])
        assert c["steady"] is None and c["error"] == pytest.approx(c["predicted"] / c["measured"] - 1)
    at_plan = [c for c in at_plan if c["metric"] not in stages]
    for c in at_plan:
        assert c["num_requests"] == 100
        if c["metric"] == "refused":
            assert c["measured"] == 0 and c["error"] == c["predicted"] == 0
        else:
            assert c["error"] == pytest.approx(1 / 1.1 - 1, abs=1e-3), c
            assert c["steady"] == pytest.approx(planned["best"][c["metric"]], rel=1e-3)  # the steady state's, beside
    # At 40 req/s the run refused 200 of its 300 (colocated x4: 64 slots and as many queued); the finite run
    # predicts refusals too, and their error is a difference.
    (refused,) = [c for c in data["comparisons"] if c["rate"] == 40.0 and c["metric"] == "refused"]
    assert refused["measured"] == 200 and refused["num_requests"] == 300 and refused["predicted"] > 100
    assert refused["error"] == pytest.approx(refused["predicted"] - 200)
    summary = data["summary"]
    assert summary["measured_max_rate"] == 2.5 and summary["num_requests"] == 100
    assert summary["predicted_max_rate"] > 2.5 and summary["steady_max_rate"] > 2.5
    assert main(["plan", "--profile", str(profile_path), "--validate", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "highest rate within the SLO: predicted" in out and "(a run of 100), steady state" in out
    assert "prefill_s" in out and "router_queue_s" in out
    # a plan made on another model's profile is refused
    other = tmp_path / "other.json"
    synthetic_profile(model="llama-3.2-1b", identity="sha256:other").write(other)
    assert main(["plan", "--profile", str(other), "--validate", str(run_dir)]) == 2
    assert "was planned on a profile of smollm2-135m" in capsys.readouterr().err


def test_validate_counts_no_run_that_refused_requests_as_sustained(profile_path: Path, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, _, _ = planned_run(profile_path, tmp_path, capsys)
    within = {"ttft_s": {"p50": 0.5, "p90": 1.0}, "tpot_s": {"p50": 0.05, "p90": 0.1}}
    (run_dir / "report.json").write_text(json.dumps({"schema": "splitserve-bench/1", "runs": [
        {"rate": 1.0, "num_requests": 40, **within},
        {"rate": 2.0, "num_requests": 37, "num_errors": 3, **within}]}))  # its completed ones within the SLO
    assert main(["plan", "--profile", str(profile_path), "--validate", str(run_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["measured_max_rate"] == 1.0


def test_plan_prices_a_finite_run(profile_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", str(profile_path), *PLAN, "--num-requests", "40", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["traffic"]["num_requests"] == 40
    assert data["best"]["num_requests"] == 40 and data["best"]["num_refused"] == 0
    assert main(["plan", "--profile", str(profile_path), *PLAN, "--num-requests", "40"]) == 0
    assert "refused" in capsys.readouterr().out.splitlines()[1]
    assert main(["plan", "--profile", str(profile_path), *PLAN, "--num-requests", "0"]) == 2
    assert "--num-requests must be at least 1" in capsys.readouterr().err


def test_validate_names_what_a_report_lacks(profile_path: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert main(["plan", "--profile", str(profile_path), "--validate", str(run_dir)]) == 2
    assert "plan.json: not found" in capsys.readouterr().err
    assert main(["plan", "--profile", str(profile_path), *PLAN, "--json"]) == 0
    (run_dir / "plan.json").write_text(capsys.readouterr().out)
    (run_dir / "report.json").write_text(json.dumps({"schema": "aiperf/1"}))
    assert main(["plan", "--profile", str(profile_path), "--validate", str(run_dir)]) == 2
    assert "expected schema 'splitserve-bench/1'" in capsys.readouterr().err
    (run_dir / "report.json").write_text(json.dumps({"schema": "splitserve-bench/1",
                                                     "runs": [{"rate": 1.0, "ttft_s": {"p50": 0.5}}]}))
    assert main(["plan", "--profile", str(profile_path), "--validate", str(run_dir)]) == 2
    assert "runs[0] needs ttft_s and tpot_s with p50 and p90" in capsys.readouterr().err


def test_validate_prices_each_run_with_the_client_cpu_it_measured(profile_path: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, _, layout = planned_run(profile_path, tmp_path, capsys)
    within = {"ttft_s": {"p50": 0.5, "p90": 1.0}, "tpot_s": {"p50": 0.05, "p90": 0.1}}
    report = {"schema": "splitserve-bench/1", "runs": [
        {"rate": 1.0, "num_requests": 40, "client_cores": 0.3, **within},
        {"rate": 2.0, "num_requests": 40, "client_cores": 0.6, **within}]}
    (run_dir / "report.json").write_text(json.dumps(report))
    profile, slo = load_profile(profile_path), SLO(ttft_s=2, tpot_s=0.15)

    def predicted(rate: float, cores: float) -> float:
        options = PlanOptions(one_host=True, client_cores=cores)
        return LayoutModel(profile, Traffic(isl=1024, osl=256), layout, options).predict_finite(rate, slo,
                                                                                              40).tpot_p50_s

    def tpot_p50(*flags: str) -> tuple[dict[float, float], dict]:
        assert main(["plan", "--profile", str(profile_path), "--validate", str(run_dir), "--json", *flags]) == 0
        data = json.loads(capsys.readouterr().out)
        return {c["rate"]: c["predicted"] for c in data["comparisons"] if c["metric"] == "tpot_p50_s"}, data["summary"]

    # --one-host, no --client-cores: each run at the cores its load generator measured, the highest rate at their mean
    by_rate, summary = tpot_p50("--one-host")
    assert by_rate == {1.0: pytest.approx(predicted(1.0, 0.3)), 2.0: pytest.approx(predicted(2.0, 0.6))}
    assert summary["client_cores"] == pytest.approx(0.45) and summary["client_measured"] is True
    assert predicted(2.0, 0.6) > predicted(2.0, 0.0)  # the client's CPU is priced: it slows the workers
    # --client-cores given: that figure for every run
    by_rate, summary = tpot_p50("--one-host", "--client-cores", "0")
    assert by_rate == {1.0: pytest.approx(predicted(1.0, 0.0)), 2.0: pytest.approx(predicted(2.0, 0.0))}
    assert summary["client_cores"] == 0 and summary["client_measured"] is False
    assert main(["plan", "--profile", str(profile_path), "--validate", str(run_dir), "--one-host"]) == 0
    assert "the load generator's CPU as each run measured it (mean 0.450 cores)" in capsys.readouterr().out
    # not on one host: the client shares no cores with the workers, whatever the report measured
    assert tpot_p50()[1]["client_cores"] is None
    report["runs"][1]["client_cores"] = -1
    (run_dir / "report.json").write_text(json.dumps(report))
    assert main(["plan", "--profile", str(profile_path), "--validate", str(run_dir), "--one-host"]) == 2
    assert "runs[1].client_cores: expected cores >= 0, got -1" in capsys.readouterr().err
