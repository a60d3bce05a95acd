"""What the serving benchmarks share: a real `splitserve serve` subprocess, and AIPerf runs against it.

    server = Serve(["--prefill-workers", "2"])        starts, returns once the gateway serves; server.url
    summary = aiperf(url, ["--request-rate", "4"], artifacts=...)    AIPerf's summary JSON (profile_export_aiperf.json)
    server.stop()

AIPerf (NVIDIA's load generator, on PyPI) stays out of splitserve's dependencies: install it in a venv of its own,
`python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf`. Offline it needs a local tokenizer:
`../shared/tools/bench-tokenizer.sh` saves ours; `aiperf()` runs it when the saved copy is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
TOKENIZER_DIR = Path(os.environ.get("BENCH_TOKENIZER_DIR", "/tmp/bench-tokenizer"))
AIPERF = os.environ.get("AIPERF", "/tmp/aiperf-venv/bin/aiperf")


class Serve:
    """`splitserve serve --model <model> --port 0 <flags>` in its own process group, until `stop()`."""

    def __init__(self, flags: list[str], *, model: str = MODEL, stderr_path: str | None = None) -> None:
        self.flags = flags
        stderr = open(stderr_path, "wb") if stderr_path else subprocess.DEVNULL  # noqa: SIM115 - the child's
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "serve", "--model", model, "--port", "0", *flags],
            cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True,
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("splitserve: serving"):
                self.url = line.split(" on ")[1].split()[0]
                return
        raise RuntimeError(f"serve {' '.join(flags)} did not start")

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def ensure_tokenizer() -> None:
    if not (TOKENIZER_DIR / "hf").exists():
        subprocess.run(["bash", str(REPO.parent / "shared/tools/bench-tokenizer.sh"), sys.executable, MODEL],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)


def aiperf(url: str, flags: list[str], *, model: str = MODEL) -> dict:
    """One `aiperf profile` run against `url`; its summary JSON. `flags`: the workload and the load."""
    ensure_tokenizer()
    with tempfile.TemporaryDirectory() as out:
        command = [AIPERF, "profile", "--tokenizer", f"local/{MODEL}", "--model", model, "--url", url,
                   "--artifact-dir", out, "--ui-type", "none", *flags]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(TOKENIZER_DIR / "hf")}
        done = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if done.returncode:
            raise RuntimeError(f"aiperf failed ({done.returncode}): {done.stderr[-2000:]}")
        return json.loads((Path(out) / "profile_export_aiperf.json").read_text())


def metric(summary: dict, name: str, stat: str = "avg") -> float:
    """One statistic of one AIPerf metric; 0 when AIPerf did not report it."""
    value = summary.get(name) or {}
    return float(value.get(stat) or 0.0)
