"""The planner's serving terms on synthetic profiles: the serving overhead a real `serve` adds (TTFT, decode step),
and, on one host, the gateway's and the load generator's CPU slowing the workers (`contention_slowdown`). Pure: no
torch, no engine; monotonic in every new input."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from deploy.planner.planner import SLO, Layout, LayoutModel, PlanOptions, Traffic, contention_slowdown, plan
from deploy.planner.profile import ContentionPoint, Serving, load_profile
from tests.deploy.planner.synthetic import synthetic_profile

SERVING = Serving(num_requests=6, prompt_tokens=256, ttft_overhead_s=0.05, step_overhead_s=0.002,
                  gateway_cpu_per_request_s=0.01, gateway_cpu_per_token_s=0.001)
CONTENTION = {"prefill": (ContentionPoint(background_cores=0.5, slowdown=1.6),
                          ContentionPoint(background_cores=1.0, slowdown=2.5)),
              "decode": (ContentionPoint(background_cores=0.5, slowdown=1.8),
                         ContentionPoint(background_cores=1.0, slowdown=3.0))}
PROFILE = dataclasses.replace(synthetic_profile(), serving=SERVING, contention=CONTENTION)
SLO_ = SLO(ttft_s=2.0, tpot_s=0.15)
TRAFFIC = Traffic(isl=256, osl=64)
COLOCATED = Layout(num_colocated=1, max_num_seqs=32)
DISAGGREGATED = Layout(num_prefill=1, num_decode=1, max_num_seqs=32, transport="grpc")
ONE_HOST = PlanOptions(max_workers=2, one_host=True)


def with_serving(**changes: float):
    return dataclasses.replace(PROFILE, serving=dataclasses.replace(SERVING, **changes))


def test_the_serving_overhead_adds_to_ttft_and_the_step_overhead_to_tpot() -> None:
    bare = dataclasses.replace(PROFILE, serving=None, contention={})
    for layout in (COLOCATED, DISAGGREGATED):
        without = LayoutModel(bare, TRAFFIC, layout, PlanOptions()).predict(0.01, SLO_)
        served = LayoutModel(with_serving(step_overhead_s=0.0), TRAFFIC, layout, PlanOptions()).predict(0.01, SLO_)
        # off one host the gateway's CPU is another machine's: at a trickle TTFT grows by the overhead alone
        assert served.ttft_p50_s == pytest.approx(without.ttft_p50_s + 0.05, abs=2e-4)
        stepped = LayoutModel(with_serving(ttft_overhead_s=0.0), TRAFFIC, layout, PlanOptions()).predict(0.01, SLO_)
        assert stepped.tpot_p50_s == pytest.approx(without.tpot_p50_s + 0.002, abs=1e-4)
    # --serving-overhead-s overrides the profile's measurement
    override = LayoutModel(PROFILE, TRAFFIC, COLOCATED, PlanOptions(serving_overhead_s=0.3)).predict(0.01, SLO_)
    measured = LayoutModel(PROFILE, TRAFFIC, COLOCATED, PlanOptions()).predict(0.01, SLO_)
    assert override.ttft_p50_s == pytest.approx(measured.ttft_p50_s + 0.25, abs=2e-4)


def test_the_step_overhead_applies_where_it_was_measured_a_worker_on_every_profiled_thread() -> None:
    # on one host of 2 cores a colocated x1 worker runs the profile's 2 threads; 1P+1D's workers 1 each
    bare = with_serving(step_overhead_s=0.0)
    for layout, expected in ((COLOCATED, 0.002), (DISAGGREGATED, 0.0)):
        stepped = LayoutModel(PROFILE, TRAFFIC, layout, ONE_HOST).predict(0.01, SLO_)
        without = LayoutModel(bare, TRAFFIC, layout, ONE_HOST).predict(0.01, SLO_)
        assert stepped.tpot_p50_s - without.tpot_p50_s == pytest.approx(expected, abs=1e-4), layout.label


@pytest.mark.parametrize("layout", [COLOCATED, DISAGGREGATED], ids=["colocated", "1P+1D"])
@pytest.mark.parametrize("field, values", [
    ("ttft_overhead_s", (0.0, 0.02, 0.1, 0.3)),
    ("gateway_cpu_per_request_s", (0.0, 0.01, 0.05, 0.1)),
    ("gateway_cpu_per_token_s", (0.0, 0.0005, 0.002, 0.004)),
])
def test_more_gateway_cost_never_lowers_predicted_ttft_or_tpot(layout: Layout, field: str,
                                                                values: tuple[float, ...]) -> None:
    for rate in (0.5, 1.0, 1.5):
        predictions = [LayoutModel(with_serving(**{field: v}), TRAFFIC, layout, ONE_HOST).predict(rate, SLO_)
                       for v in values]
        for metric in ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s"):
            series = [getattr(p, metric) for p in predictions]
            assert series == sorted(series), (field, rate, metric, series)
        assert predictions[-1].ttft_p50_s > predictions[0].ttft_p50_s  # and each cost does count


@pytest.mark.parametrize("layout", [COLOCATED, DISAGGREGATED], ids=["colocated", "1P+1D"])
def test_more_load_generator_cpu_never_raises_the_sustainable_rate(layout: Layout) -> None:
    rates = []
    for cores in (0.0, 0.25, 0.5, 1.0, 1.5):
        best = LayoutModel(PROFILE, TRAFFIC, layout, dataclasses.replace(ONE_HOST, client_cores=cores)).max_rate(SLO_)
        rates.append(0.0 if best is None else best.max_rate)
    assert rates == sorted(rates, reverse=True), rates
    assert rates[-1] < rates[0]
    # off one host the load generator runs elsewhere: --client-cores changes nothing
    apart = [LayoutModel(PROFILE, TRAFFIC, layout, PlanOptions(client_cores=c)).max_rate(SLO_).max_rate
             for c in (0.0, 1.0)]
    assert apart[0] == apart[1]


def test_a_load_generator_taking_every_core_leaves_no_layout() -> None:
    result = plan(PROFILE, Traffic(isl=256, osl=64, rate=0.5), SLO_, dataclasses.replace(ONE_HOST, client_cores=2.0))
    assert not result.met and not result.best.stable and result.best.binding == "host cores"


def test_contention_slowdown_follows_the_measured_points_then_the_analytic_curve() -> None:
    threads = PROFILE.num_threads  # 2 on 2 cores
    assert contention_slowdown(PROFILE, "decode", 0.0, threads) == 1.0
    assert contention_slowdown(PROFILE, "decode", 0.25, threads) == pytest.approx(1.4)  # halfway to (0.5, 1.8)
    assert contention_slowdown(PROFILE, "decode", 1.0, threads) == pytest.approx(3.0)
    # beyond the last point: 3.0 x (2 / (2 - 1.5)) / (2 / (2 - 1))
    assert contention_slowdown(PROFILE, "decode", 1.5, threads) == pytest.approx(6.0)
    assert math.isinf(contention_slowdown(PROFILE, "decode", 2.0, threads))
    # one thread of two, or no measured curve: each thread loses its share, cores / (cores - background)
    assert contention_slowdown(PROFILE, "prefill", 0.5, 1) == pytest.approx(2 / 1.5)
    assert contention_slowdown(synthetic_profile(), "prefill", 1.0, 2) == pytest.approx(2.0)
    # noisy points (a slowdown below 1, one below its predecessor) never make more background cheaper
    noisy = dataclasses.replace(PROFILE, contention={"decode": (ContentionPoint(background_cores=0.5, slowdown=0.8),
                                                                ContentionPoint(background_cores=1.0, slowdown=2.0),
                                                                ContentionPoint(background_cores=1.5, slowdown=1.5))})
    grid = [i / 20 for i in range(40)]
    for profile in (PROFILE, noisy, synthetic_profile()):
        for threads in (1, 2):
            series = [contention_slowdown(profile, "decode", b, threads) for b in grid]
            assert series == sorted(series) and series[0] == 1.0 and min(series) >= 1.0, series


def test_one_host_contention_grows_with_the_rate_through_the_gateways_cpu() -> None:
    model = LayoutModel(PROFILE, TRAFFIC, COLOCATED, dataclasses.replace(ONE_HOST, client_cores=0.3))
    # 0.3 + rate x (0.01 + 64 x 0.001)
    assert model.background_cores(1.0) == pytest.approx(0.374)
    assert model.background_cores(2.0) == pytest.approx(0.448)
    assert LayoutModel(PROFILE, TRAFFIC, COLOCATED, PlanOptions(client_cores=0.3)).background_cores(2.0) == 0.0
    factors = [model.contention(r) for r in (0.5, 1.0, 2.0, 4.0)]
    assert factors == sorted(factors) and factors[0][1] > 1.0


def test_a_profile_with_serving_and_contention_round_trips_and_an_older_one_loads(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    PROFILE.write(path)
    loaded = load_profile(path)
    assert loaded.serving == SERVING and loaded.contention == CONTENTION
    data = json.loads(path.read_text())
    del data["serving"], data["contention"]  # a profile written before these were measured
    path.write_text(json.dumps(data))
    older = load_profile(path)
    assert older.serving is None and older.contention == {}
    data["serving"] = {**dataclasses.asdict(SERVING), "gateway_cpu_per_token_s": -1}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"serving.gateway_cpu_per_token_s: expected a number >= 0, got -1"):
        load_profile(path)


@pytest.mark.parametrize("options, match", [(dict(client_cores=-0.5), "--client-cores must be >= 0"),
                                            (dict(serving_overhead_s=-1.0), "--serving-overhead-s must be >= 0")])
def test_negative_serving_options_are_a_clear_error(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PlanOptions(**options)


def test_process_cpu_s_reads_this_processs_cpu() -> None:
    import os
    import time

    from deploy.planner.serving_probe import process_cpu_s

    before = process_cpu_s(os.getpid())
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
    assert process_cpu_s(os.getpid()) - before >= 0.15


def test_the_serving_probes_overheads_are_its_fastest_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's profile keeps each point's fastest measurement; the serving probe sets its fastest request
    against it, not its median (a median counted the host's noise as serving). Fakes stand in for the serve."""
    from deploy.planner import serving_probe

    class FakeServe:
        def __init__(self, args: object) -> None:
            self.url, self.proc = "http://fake", type("P", (), {"pid": 1})()

        def stop(self) -> None:
            pass

    ttfts = iter([0.5, 0.30, 0.45])  # the fastest TTFT 0.30 s, the median 0.45
    gaps = iter([0.05, 0.03, 0.04])  # the long requests' inter-token times

    def fake_stream(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
        if max_tokens == 4:
            return 0.9, [0.0], 256  # the warm-up
        if max_tokens == 1:
            return next(ttfts), [0.0], 256
        gap = next(gaps)
        return 0.3, [k * gap for k in range(max_tokens)], 256

    monkeypatch.setattr(serving_probe, "ServeProcess", FakeServe)
    monkeypatch.setattr(serving_probe, "_stream", fake_stream)
    monkeypatch.setattr(serving_probe, "process_cpu_s", lambda pid: 0.0)
    measured = serving_probe.measure_serving([], model="m", prompt_words=256, prefill_s=lambda n: 0.2,
                                             decode_step_s=lambda ctx: 0.02, num_requests=3, max_tokens=8)
    assert measured.ttft_overhead_s == pytest.approx(0.30 - 0.2)  # min(TTFT) - prefill, not the median's 0.25
    assert measured.step_overhead_s == pytest.approx(0.03 - 0.02)
