"""`splitserve bench`'s pure parts: the TTFT stage histograms' delta and quantiles, AIPerf's summary -> a run of
report.json (readable by `plan --validate`), the workloads' AIPerf flags, and the page's tables."""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path

import pytest

from deploy.bench import html_report, report, stages
from deploy.bench.workload import aiperf_flags, make_workload
from deploy.planner.planner import SLO, PlanOptions, Traffic, plan
from deploy.planner.render import plan_json
from deploy.planner.validate import compare_run_dir
from tests.deploy.planner.synthetic import synthetic_profile

SUMMARY = Path(__file__).resolve().parents[2] / "data" / "aiperf_summary.json"  # a real AIPerf 0.13 run's, trimmed


def exposition(stage_buckets: dict[str, tuple[list[float], float]]) -> str:
    """A /metrics page with splitserve:ttft_stage_seconds: per stage, cumulative counts at le 0.1, 0.5, 1, +Inf
    and the sum; plus another metric, which must be ignored."""
    lines = ["# HELP splitserve:ttft_stage_seconds Time to first token, by stage.",
             "# TYPE splitserve:ttft_stage_seconds histogram"]
    for stage, (cumulative, total) in stage_buckets.items():
        for le, count in zip(("0.1", "0.5", "1.0", "+Inf"), cumulative):
            lines.append(f'splitserve:ttft_stage_seconds_bucket{{le="{le}",stage="{stage}"}} {count}')
        lines.append(f'splitserve:ttft_stage_seconds_count{{stage="{stage}"}} {cumulative[-1]}')
        lines.append(f'splitserve:ttft_stage_seconds_sum{{stage="{stage}"}} {total}')
    lines += ["# HELP splitserve:prompt_tokens_total Prompt tokens.", "# TYPE splitserve:prompt_tokens_total counter",
              "splitserve:prompt_tokens_total 123.0", ""]
    return "\n".join(lines)


def test_stage_deltas_count_only_the_run_and_interpolate_quantiles_in_buckets() -> None:
    before = stages.parse_stage_histograms(exposition({"prefill": ([1, 2, 2, 2], 0.3),
                                                       "kv_transfer": ([4, 4, 4, 4], 0.2)}))
    after = stages.parse_stage_histograms(exposition({"prefill": ([1, 5, 8, 9], 5.0),
                                                      "kv_transfer": ([4, 4, 4, 4], 0.2)}))
    deltas = stages.stage_deltas(before, after)
    assert list(deltas) == ["prefill", "kv_transfer"]
    prefill = deltas["prefill"]
    # between the scrapes: 0 in (0, 0.1], 3 in (0.1, 0.5], 3 in (0.5, 1], 1 above 1; 7 requests, 4.7 s
    assert prefill["count"] == 7 and prefill["sum_s"] == pytest.approx(4.7)
    assert prefill["mean_s"] == pytest.approx(4.7 / 7)
    assert prefill["p50_s"] == pytest.approx(0.5 + 0.5 * (3.5 - 3) / 3)  # rank 3.5 lies in (0.5, 1]
    assert prefill["p90_s"] == 1.0  # rank 6.3 lies past the last finite bound: that bound, as Prometheus says
    assert deltas["kv_transfer"] == {"count": 0, "sum_s": 0.0, "mean_s": None, "p50_s": None, "p90_s": None}


def test_a_server_without_the_stage_metric_has_no_stages() -> None:
    assert stages.parse_stage_histograms("# TYPE x counter\nx_total 1.0\n") == {}
    assert stages.stage_deltas({}, {}) == {}
    assert stages.scrape("http://127.0.0.1:1") == {}  # nothing listens: no stages, no error


def test_a_histogram_of_another_process_is_refused() -> None:
    a = stages.Histogram(buckets=((0.1, 1.0), (float("inf"), 1.0)), count=1.0, sum_s=0.05)
    b = stages.Histogram(buckets=((0.2, 1.0), (float("inf"), 1.0)), count=1.0, sum_s=0.05)
    with pytest.raises(ValueError, match="buckets changed"):
        a.minus(b)
    restarted = stages.Histogram(buckets=((0.1, 0.0), (float("inf"), 0.0)), count=0.0, sum_s=0.0)
    with pytest.raises(ValueError, match="count went down"):
        restarted.minus(a)


def test_a_run_holds_aiperfs_numbers_in_seconds() -> None:
    summary = json.loads(SUMMARY.read_text())
    run = report.run_from_summary(summary, mode="rate", point=1.0, seed=7, command=["aiperf", "profile"],
                                  stages=None)
    assert run["rate"] == 1.0 and run["concurrency"] is None and "stages" not in run
    assert run["num_requests"] == summary["request_count"]["avg"] and run["num_errors"] == 0
    for key, name in (("ttft_s", "time_to_first_token"), ("tpot_s", "inter_token_latency"),
                      ("itl_s", "inter_chunk_latency"), ("latency_s", "request_latency")):
        for q in ("avg", "p50", "p90", "p99"):
            assert run[key][q] == pytest.approx(summary[name][q] / 1000), (key, q)  # AIPerf's ms
    assert run["throughput_rps"] == summary["request_throughput"]["avg"]
    assert run["goodput_rps"] == summary["goodput"]["avg"]
    concurrency = report.run_from_summary(summary, mode="concurrency", point=4, seed=0, command=[], stages={})
    assert concurrency["rate"] is None and concurrency["concurrency"] == 4
    without_goodput = {k: v for k, v in summary.items() if k != "goodput"}
    assert report.run_from_summary(without_goodput, mode="rate", point=1, seed=0, command=[],
                                   stages=None)["goodput_rps"] is None


def test_a_summary_without_ttft_is_a_clear_error() -> None:
    summary = {k: v for k, v in json.loads(SUMMARY.read_text()).items() if k != "time_to_first_token"}
    with pytest.raises(ValueError, match="no time_to_first_token"):
        report.run_from_summary(summary, mode="rate", point=1, seed=0, command=[], stages=None)


def test_plan_validate_reads_the_report(tmp_path: Path) -> None:
    profile = synthetic_profile()
    result = plan(profile, Traffic(isl=64, osl=8), SLO(ttft_s=1.0, tpot_s=0.1), PlanOptions(max_workers=2))
    (tmp_path / "plan.json").write_text(json.dumps(plan_json(profile, result)))
    summary = json.loads(SUMMARY.read_text())
    bench = report.new_report(created="now", url="http://x", model="smollm2-135m", workload={"kind": "random"},
                              mode="rate", points=[0.5, 1.0], slo={"ttft_s": 1.0, "tpot_s": 0.1},
                              splitserve_version="test")
    for rate in (0.5, 1.0):
        report.add_run(bench, report.run_from_summary(summary, mode="rate", point=rate, seed=0, command=[],
                                                      stages=None), summary)
    (tmp_path / "report.json").write_text(json.dumps(bench))
    comparisons, _ = compare_run_dir(profile, tmp_path, PlanOptions(max_workers=2))
    measured = {(c.rate, c.metric): c.measured for c in comparisons}
    run = bench["runs"][1]
    assert measured == {**{(rate, m): v for rate in (0.5, 1.0) for m, v in (
        ("ttft_p50_s", run["ttft_s"]["p50"]), ("ttft_p90_s", run["ttft_s"]["p90"]),
        ("tpot_p50_s", run["tpot_s"]["p50"]), ("tpot_p90_s", run["tpot_s"]["p90"]),
        ("goodput", run["goodput_rps"]), ("refused", run["num_errors"]))}}
    assert bench["versions"]["aiperf"] == summary["aiperf_version"]


@pytest.mark.parametrize(("name", "expected", "absent"), [
    ("random", ["--endpoint-type completions", "--isl 64", "--isl-stddev 0", "--osl 8"],
     ["--num-prefix-prompts", "--conversation-num"]),
    ("shared-prefix", ["--num-prefix-prompts 3", "--prefix-prompt-length 128", "--isl 64"], ["--conversation-num"]),
    ("chat", ["--endpoint-type chat", "--conversation-num 4", "--conversation-turn-mean 3"], ["--num-prefix-prompts"]),
])
def test_workloads_become_aiperf_flags(name: str, expected: list[str], absent: list[str]) -> None:
    workload = make_workload(name, isl=64, osl=8, prefix_length=128, num_prefixes=3, turns=3, endpoint=None)
    text = " ".join(aiperf_flags(workload, num_requests=10))  # chat: ceil(10 / 3) conversations
    assert all(flag in text for flag in expected), text
    assert not any(flag in text for flag in absent), text
    assert "--extra-inputs ignore_eos:true" in text and "--streaming" in text


def test_a_jsonl_file_is_aiperfs_custom_dataset(tmp_path: Path) -> None:
    single = tmp_path / "single.jsonl"
    single.write_text('{"text": "hello"}\n\n{"text": "bye"}\n')
    multi = tmp_path / "multi.jsonl"
    multi.write_text('{"turns": [{"text": "hi"}, {"text": "and?"}]}\n')
    for path, kind in ((single, "single-turn"), (multi, "multi-turn")):
        workload = make_workload(str(path), isl=1, osl=8, prefix_length=1, num_prefixes=1, turns=1, endpoint=None)
        text = " ".join(aiperf_flags(workload, num_requests=5))
        assert f"--input-file {path} --custom-dataset-type {kind}" in text and "--isl" not in text


class _Cells(HTMLParser):
    """data-key -> the text of every cell carrying one, and the img sources."""

    def __init__(self) -> None:
        super().__init__()
        self.cells: dict[str, list[str]] = {}
        self.images: list[str] = []
        self._key: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "td" and a.get("data-key"):
            self._key = a["data-key"]
            self.cells.setdefault(self._key, []).append("")
        if tag == "img":
            self.images.append(a["src"] or "")

    def handle_data(self, data: str) -> None:
        if self._key is not None:
            self.cells[self._key][-1] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._key = None


def test_the_pages_tables_hold_the_reports_numbers() -> None:
    summary = json.loads(SUMMARY.read_text())
    bench = report.new_report(created="now", url="http://x", model="m<1>", workload={"kind": "random"},
                              mode="rate", points=[1.0], slo={"ttft_s": None, "tpot_s": None}, splitserve_version="t")
    deltas = {"prefill": {"count": 6.0, "sum_s": 0.6, "mean_s": 0.1, "p50_s": 0.09375, "p90_s": None}}
    report.add_run(bench, report.run_from_summary(summary, mode="rate", point=1.0, seed=0, command=["aiperf"],
                                                  stages=deltas), summary)
    page = html_report.render(bench, ["a.png", "b.png"])
    assert "m&lt;1&gt;" in page and "m<1>" not in page
    parsed = _Cells()
    parsed.feed(page)
    assert parsed.images == ["a.png", "b.png"]
    run = bench["runs"][0]
    for key in ("ttft_s.p50", "ttft_s.p90", "tpot_s.p50", "tpot_s.p90", "throughput_rps", "goodput_rps",
                "stages.prefill.mean_s", "stages.prefill.p50_s"):
        value = run
        for part in key.split("."):
            value = value[part]
        (text,) = parsed.cells[f"runs.0.{key}"]
        assert float(text) == pytest.approx(value, rel=1e-5), key
    assert parsed.cells["runs.0.stages.prefill.p90_s"] == ["-"]
