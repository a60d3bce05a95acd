"""`splitserve bench` end to end: real AIPerf against a real `splitserve serve` of SmolLM2 (one prefill and one
decode worker, KV over gRPC), two Poisson rates of a few requests each. The report holds each point's run with
the gateway's TTFT stages counting exactly that run's requests (not the warm-up's), `plan --validate` reads it,
and report.html renders in real headless Chromium: every image loads, the tables hold report.json's numbers. Then
multi-turn chat at a concurrency, on the same serve.

AIPerf and Chromium are not Python dependencies: deploy/setup.sh installs them (.venv-aiperf; apt's chromium and
chromium-driver). Where they are missing these tests skip, saying which.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from deploy import cli
from tests.deploy.planner.synthetic import synthetic_profile
from tests.deploy.processes import REPO_ROOT, serve_argv, serving

pytestmark = [pytest.mark.slow, pytest.mark.ray]
RATES = (0.5, 1.0)
NUM_REQUESTS = 4


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The URL of a serve of SmolLM2 (1P+1D over gRPC) for the module's bench runs."""
    from deploy.bench.aiperf_driver import find_aiperf

    try:
        find_aiperf()
    except FileNotFoundError as exc:
        pytest.skip(f"AIPerf is not installed (deploy/setup.sh installs it): {exc}")
    tmp = tmp_path_factory.mktemp("serve")
    with serving(serve_argv("smollm2-135m", "--prefill-workers", "1", "--decode-workers", "1",
                            "--max-model-len", "2048"), stderr_path=tmp / "serve.txt") as serve:
        yield serve.url


def run_bench(url: str, out: Path, *flags: str) -> None:
    done = subprocess.run([sys.executable, "-m", "deploy.cli", "bench", "--url", url, *flags, "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=480)
    assert done.returncode == 0, done.stderr[-4000:]


@pytest.fixture(scope="module")
def bench_dir(served: str, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench") / "report"
    run_bench(served, out, "--rate", str(RATES[0]), "--sweep", ",".join(map(str, RATES[1:])), "--num-requests",
              str(NUM_REQUESTS), "--isl", "48", "--osl", "6", "--ttft-slo", "5", "--tpot-slo", "1", "--warmup", "1")
    return out


def test_each_point_is_a_run_with_the_gateways_stages(bench_dir: Path) -> None:
    report = json.loads((bench_dir / "report.json").read_text())
    assert report["schema"] == "splitserve-bench/1" and report["model"] == "smollm2-135m"
    assert report["load"] == {"mode": "rate", "points": list(RATES)}
    assert [run["rate"] for run in report["runs"]] == list(RATES)
    for run in report["runs"]:
        assert run["num_requests"] == NUM_REQUESTS and run["num_errors"] == 0, run
        assert run["osl_mean"] == 6 and run["isl_mean"] == 48, run  # the server's own token counts
        assert 0 < run["ttft_s"]["p50"] <= run["ttft_s"]["p90"] and 0 < run["tpot_s"]["p50"] <= run["tpot_s"]["p90"]
        assert run["goodput_rps"] is not None and 0 < run["goodput_rps"] <= run["throughput_rps"] * 1.0001
        # every request of the run, and only those, went through each stage once (48 tokens: past serve's
        # --disagg-prefill-threshold, so each prompt's KV moved over gRPC: kv_transfer too)
        assert {stage: s["count"] for stage, s in run["stages"].items()} == {
            **{stage: NUM_REQUESTS for stage in ("router_queue", "decode_queue", "prefill_queue", "prefill",
                                                 "kv_transfer")},
            "peer_fetch": 0}, run["stages"]  # fresh prompts: no head cached on another worker
        assert run["stages"]["prefill"]["mean_s"] > 0
        assert "--request-rate" in run["aiperf_command"]
        assert 0 < run["client_cores"] < 2, run  # AIPerf's own CPU over its requests, measured (client_cpu.py)
    assert report["plots"] == ["throughput_latency.png", "ttft_itl.png", "goodput.png", "stages.png"]
    for name in report["plots"]:
        assert (bench_dir / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


def test_plan_validate_reads_the_report(bench_dir: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "profile.json"
    synthetic_profile().write(profile)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copy(bench_dir / "report.json", run_dir / "report.json")
    assert cli.main(["plan", "--profile", str(profile), "--isl", "48", "--osl", "6", "--ttft-slo", "5",
                     "--tpot-slo", "1", "--max-workers", "2", "--json"]) == 0
    (run_dir / "plan.json").write_text(capsys.readouterr().out)
    assert cli.main(["plan", "--profile", str(profile), "--validate", str(run_dir), "--json"]) == 0
    comparisons = json.loads(capsys.readouterr().out)["comparisons"]
    # the run's metrics, and the TTFT stages the colocated server timed and the model simulates (no KV moved)
    assert {(c["rate"], c["metric"]) for c in comparisons} == {
        (rate, metric) for rate in RATES
        for metric in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s", "goodput", "refused",
                       "router_queue_s", "prefill_queue_s", "prefill_s")}


def test_chat_at_a_concurrency(served: str, tmp_path: Path) -> None:
    """AIPerf's multi-turn conversations on the chat endpoint, kept 2 in flight: 2 conversations of 2 turns."""
    run_bench(served, tmp_path, "--workload", "chat", "--turns", "2", "--concurrency", "2", "--num-requests", "4",
              "--isl", "48", "--osl", "4", "--warmup", "0")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["workload"] == {"kind": "chat", "isl": 48, "osl": 4, "turns": 2, "endpoint": "chat"}
    (run,) = report["runs"]
    assert run["concurrency"] == 2 and run["rate"] is None and "--concurrency" in run["aiperf_command"]
    assert run["num_requests"] == 4 and run["num_errors"] == 0 and run["osl_mean"] == 4
    assert run["isl_mean"] > 48  # the chat template's tokens, and the second turns' history
    assert run["stages"]["prefill"]["count"] == 4
    assert report["plots"] == ["throughput_latency.png", "ttft_itl.png", "stages.png"]  # no SLO: no goodput plot


def test_the_profiles_loaded_probe_reads_each_rates_stages(served: str, tmp_path: Path) -> None:
    """`splitserve profile`'s loaded probe (deploy/planner/load_probe.py) against this serve: per rate, the means of
    the stages its AIPerf run went through, inside the client's TTFT; the profile holding them reads back and
    calibrates (the planner's costs under load)."""
    import dataclasses

    from deploy.planner.load_probe import measure_loaded
    from deploy.planner.loaded import calibrate
    from deploy.planner.planner import Layout, PlanOptions
    from deploy.planner.profile import load_profile

    layout = Layout(num_prefill=1, num_decode=1, max_num_seqs=16, transport="grpc")
    loaded = measure_loaded(synthetic_profile(), layout, rates=[1.0, 2.0], num_requests=3, isl=48, osl=6,
                            log=lambda line: None, url=served)
    assert [p.rate for p in loaded.points] == [1.0, 2.0] and loaded.client == "aiperf"
    assert (loaded.num_prefill, loaded.num_decode, loaded.transport, loaded.isl, loaded.osl) == (1, 1, "grpc", 48, 6)
    for point in loaded.points:
        assert point.num_requests == 3 and point.prefill_s > 0 and point.kv_transfer_s > 0, point
        inside = point.router_queue_s + point.prefill_queue_s + point.prefill_s + point.kv_transfer_s
        assert inside < point.ttft_mean_s, point  # the gateway's stages lie within the client's TTFT
        assert 0 < point.host_busy_cores <= (os.cpu_count() or 1) + 0.1 and point.tpot_p50_s > 0, point
    profile = dataclasses.replace(synthetic_profile(), loaded=loaded)
    profile.write(tmp_path / "profile.json")
    assert load_profile(tmp_path / "profile.json").loaded == loaded
    costs = calibrate(profile, PlanOptions(one_host=True))
    assert [c.rate for c in costs.points] == [1.0, 2.0]
    assert all(c.handoff_extra_s >= 0 and c.overhead_s >= 0 for c in costs.points)


def _value(report: dict[str, Any], key: str) -> Any:
    value: Any = report
    for part in key.split("."):
        value = value[int(part)] if isinstance(value, list) else value[part]
    return value


def test_the_page_renders_in_headless_chromium(bench_dir: Path) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("no chromium and chromedriver (deploy/setup.sh installs Debian's chromium, chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    browser = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)  # never downloads
    try:
        browser.get((bench_dir / "report.html").as_uri())
        assert browser.execute_script("return document.readyState") == "complete"
        assert browser.title == "splitserve bench: smollm2-135m"
        images = browser.execute_script(
            "return Array.from(document.images).map(i => [i.getAttribute('src'), i.complete, i.naturalWidth])")
        cells = browser.execute_script(
            "return Array.from(document.querySelectorAll('td[data-key]')).map(td => [td.dataset.key, td.innerText])")
    finally:
        browser.quit()
    report = json.loads((bench_dir / "report.json").read_text())
    assert sorted(src for src, _, _ in images) == sorted(report["plots"])
    assert all(complete and width > 0 for _, complete, width in images), images  # each image decoded
    shown = {key for key, _ in cells}
    for i, run in enumerate(report["runs"]):
        wanted = {f"runs.{i}.{k}" for k in ("rate", "ttft_s.p50", "ttft_s.p90", "tpot_s.p50", "tpot_s.p90",
                                            "throughput_rps", "goodput_rps")}
        wanted |= {f"runs.{i}.stages.{stage}.{stat}" for stage in run["stages"] for stat in ("count", "mean_s")}
        assert wanted <= shown, wanted - shown
    for key, text in cells:
        value = _value(report, key)
        if value is None:
            assert text == "-", key
        else:
            assert float(text) == pytest.approx(value, rel=1e-5), (key, text, value)
