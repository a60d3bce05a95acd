"""`splitserve bench`'s flow against a server that is not splitserve's (no /metrics): a stand-in AIPerf (a script
that records its arguments and writes a real AIPerf summary) behind a tiny OpenAI-shaped HTTP server. The real
AIPerf against the real serve is test_bench_serve.py; this checks, in a second, what is sent per point, that a
server without our stage metric gets a report without stages, and that a failing AIPerf is exit 1 with its log."""

from __future__ import annotations

import json
import shlex
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from deploy import cli

SUMMARY = Path(__file__).resolve().parents[2] / "data" / "aiperf_summary.json"
FAKE_AIPERF = f"""#!{sys.executable}
import json, os, shutil, sys
argv = sys.argv[1:]
with open(os.environ["FAKE_AIPERF_CALLS"], "a") as calls:
    calls.write(json.dumps(argv) + "\\n")
if os.environ.get("FAKE_AIPERF_FAIL"):
    print("aiperf: the endpoint refused every request")
    sys.exit(3)
out = argv[argv.index("--artifact-dir") + 1]
os.makedirs(out, exist_ok=True)
shutil.copy({str(SUMMARY)!r}, os.path.join(out, "profile_export_aiperf.json"))
"""


class _OpenAIShaped(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/v1/models":
            body = json.dumps({"object": "list", "data": [{"id": "other-model", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _OpenAIShaped)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def fake_aiperf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "aiperf"
    script.write_text(FAKE_AIPERF)
    script.chmod(0o755)
    monkeypatch.setenv("FAKE_AIPERF_CALLS", str(tmp_path / "calls.jsonl"))
    return script


def test_each_point_sends_its_load_and_seed_and_a_server_without_stages_gets_none(
        server: str, fake_aiperf: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli.main(["bench", "--url", server, "--rate", "1", "--sweep", "0.5", "--num-requests", "7", "--isl", "16",
                     "--osl", "4", "--ttft-slo", "2", "--tpot-slo", "0.1", "--seed", "10", "--aiperf", str(fake_aiperf),
                     "--out", str(out)]) == 0
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    warmup, *points = [shlex.join(c) for c in calls]
    assert "--concurrency 1" in warmup and "--request-count 2" in warmup and "--random-seed 1010" in warmup
    assert len(points) == 2
    for call, rate, seed in zip(points, ("0.5", "1"), (10, 11)):
        assert f"--request-rate {rate} " in call and f"--random-seed {seed}" in call and "--request-count 7" in call
        assert "--model other-model --tokenizer other-model" in call  # not ours: AIPerf fetches its tokenizer
        assert "--goodput 'time_to_first_token:2000 inter_token_latency:100'" in call
    report = json.loads((out / "report.json").read_text())
    assert report["model"] == "other-model" and [r["rate"] for r in report["runs"]] == [0.5, 1.0]
    assert all("stages" not in r for r in report["runs"])
    assert report["plots"] == ["throughput_latency.png", "ttft_itl.png", "goodput.png"]  # no stages plot
    page = (out / "report.html").read_text()
    assert "No TTFT stages" in page and 'id="stages"' not in page


def test_a_failing_aiperf_is_exit_1_with_its_log(server: str, fake_aiperf: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FAKE_AIPERF_FAIL", "1")
    assert cli.main(["bench", "--url", server, "--concurrency", "2", "--warmup", "0", "--aiperf", str(fake_aiperf),
                     "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "aiperf exited 3" in err and "the endpoint refused every request" in err
    assert (tmp_path / "out" / "aiperf" / "concurrency-2" / "aiperf.log").exists()
