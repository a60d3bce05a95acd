"""What the serving benchmarks share: a real `splitserve serve` subprocess, and AIPerf runs against it.

    server = Serve(["--prefill-workers", "2"])        starts, returns once the gateway serves; server.url
    summary = aiperf(url, ["--request-rate", "4"], artifacts=...)    AIPerf's summary JSON (profile_export_aiperf.json)
    server.stop()

AIPerf (NVIDIA's load generator, on PyPI) stays out of splitserve's dependencies: `splitserve bench`'s driver
(deploy/bench/aiperf_driver.py) finds it ($AIPERF, the checkout's .venv-aiperf that deploy/setup.sh makes, or PATH)
and saves the model's tokenizer where AIPerf reads it offline (deploy/bench/tokenizer.py); `aiperf()` reuses both.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from deploy.process_group import interrupt_group  # noqa: E402
MODEL = "smollm2-135m"


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
        interrupt_group(self.proc)


def aiperf(url: str, flags: list[str], *, model: str = MODEL) -> dict:
    """One `aiperf profile` run against `url`; its summary JSON. `flags`: the workload and the load."""
    from deploy.bench.aiperf_driver import aiperf_command, find_aiperf, run_aiperf
    from deploy.bench.tokenizer import aiperf_tokenizer

    tokenizer, env = aiperf_tokenizer(model)
    with tempfile.TemporaryDirectory() as out:
        command = aiperf_command(find_aiperf(), url=url, model=model, tokenizer=tokenizer, artifact_dir=Path(out),
                                 flags=flags)
        return run_aiperf(command, env=env, artifact_dir=Path(out))


def metric(summary: dict, name: str, stat: str = "avg") -> float:
    """One statistic of one AIPerf metric; 0 when AIPerf did not report it."""
    value = summary.get(name) or {}
    return float(value.get(stat) or 0.0)
