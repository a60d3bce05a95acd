"""bench/handoff_cost.py end to end on the CPU, small: every transport's handoffs commit and land the source's
bytes, the JSON carries each side's stages, and a transport whose handoff fails makes it exit 1. The GPU run (one
shot, paid by the minute) must not be the first to exercise the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "bench" / "handoff_cost.py"


def run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "handoff.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--num-tokens", "40", "--repeats", "2", "--warmup", "1",
                           "--json", str(out), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc, json.loads(out.read_text()) if out.exists() else {}


def test_every_transport_hands_off_and_reports_its_stages(tmp_path: Path) -> None:
    proc, figures = run(tmp_path, "--transports", "grpc,ipc,inproc")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert figures["num_bytes"] == 3 * figures["layout"]["num_layers"] * 2 * 16 * 3 * 64 * 4  # 3 float32 blocks
    by_name = {t["transport"]: t for t in figures["transports"]}
    assert set(by_name) == {"grpc", "ipc", "inproc"}
    for name, summary in by_name.items():
        assert summary["num_handoffs"] == 2 and not summary["problems"], (name, summary["problems"])
        assert 0 < summary["total_p50_ms"] <= summary["total_p90_ms"]
        assert summary["sender_stages"] and "python" in summary["sender_stages"], name
    for name in ("grpc", "ipc"):  # receivers in their own process report their handler's stages and the call's
        assert "handler" in by_name[name]["receiver_stages"] and by_name[name]["to_handler_p50_ms"] is not None
    assert "crc+copy" in by_name["grpc"]["receiver_stages"]
    assert "grpc " in proc.stdout and "receiver ms p50" in proc.stdout


def test_a_failing_transport_fails_the_run(tmp_path: Path) -> None:
    """Handoffs the receiver refuses (its KV dtype differs) are reported, and the command exits 1."""
    proc, figures = run(tmp_path, "--transports", "grpc", "--dtype", "bfloat16", "--receiver-dtype", "float32")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED: handoff 0 failed" in proc.stdout and "layout mismatch" in proc.stdout
    assert figures["transports"] == [{"transport": "grpc", "num_handoffs": 0, "problems": figures["transports"][0][
        "problems"]}] and len(figures["transports"][0]["problems"]) > 1
