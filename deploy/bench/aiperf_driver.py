"""AIPerf (NVIDIA's load generator) run as a separate program: one `aiperf profile` per load point.

AIPerf is no dependency of splitserve: it lives in a venv of its own (deploy/setup.sh makes `.venv-aiperf` in
the checkout; by hand, `python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install aiperf`). It is found, in
this order: --aiperf PATH, $AIPERF, <checkout>/.venv-aiperf/bin/aiperf, `aiperf` on PATH.

    command = aiperf_command(aiperf, url=..., model=..., tokenizer=..., artifact_dir=..., flags=[...])
    summary = run_aiperf(command, env=..., artifact_dir=...)   # its profile_export_aiperf.json, as a dict
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

AIPERF_ENV = "AIPERF"
CHECKOUT = Path(__file__).resolve().parents[2]
VENV_AIPERF = CHECKOUT / ".venv-aiperf" / "bin" / "aiperf"
SUMMARY_FILE = "profile_export_aiperf.json"
INSTALL_HINT = ("install it in a venv of its own: python3 -m venv .venv-aiperf && .venv-aiperf/bin/pip install "
                "aiperf (deploy/setup.sh does), then pass --aiperf .venv-aiperf/bin/aiperf or set AIPERF")


class AIPerfError(RuntimeError):
    """AIPerf ran and failed: its exit status and the tail of its output."""


def find_aiperf(explicit: str | None = None) -> str:
    """The AIPerf executable (see the module docstring); FileNotFoundError naming how to install it."""
    if explicit:
        if not (Path(explicit).is_file() and os.access(explicit, os.X_OK)):
            raise FileNotFoundError(f"--aiperf {explicit}: not an executable file; {INSTALL_HINT}")
        return explicit
    if env := os.environ.get(AIPERF_ENV):
        if not (Path(env).is_file() and os.access(env, os.X_OK)):
            raise FileNotFoundError(f"${AIPERF_ENV}={env}: not an executable file; {INSTALL_HINT}")
        return env
    if VENV_AIPERF.is_file():
        return str(VENV_AIPERF)
    if found := shutil.which("aiperf"):
        return found
    raise FileNotFoundError(f"AIPerf not found (splitserve bench drives it; it is no dependency): {INSTALL_HINT}")


def aiperf_command(aiperf: str, *, url: str, model: str, tokenizer: str, artifact_dir: Path,
                   flags: list[str]) -> list[str]:
    """`aiperf profile` of one run: the endpoint and tokenizer, then `flags` (workload, load, seed, goodput)."""
    return [aiperf, "profile", "--url", url, "--model", model, "--tokenizer", tokenizer,
               "--artifact-dir", str(artifact_dir), "--ui-type", "none", "--no-gpu-telemetry", *flags]


def run_aiperf(command: list[str], *, env: dict[str, str], artifact_dir: Path) -> dict:
    """Run one AIPerf command (its output in artifact_dir/aiperf.log); its summary JSON. AIPerfError when it
    fails or writes no summary."""
    artifact_dir.mkdir(parents=True, exist_ok=True)
    log = artifact_dir / "aiperf.log"
    with log.open("wb") as out:
        done = subprocess.run(command, env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL)
    summary = artifact_dir / SUMMARY_FILE
    if done.returncode or not summary.exists():
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise AIPerfError(f"aiperf exited {done.returncode} (its log: {log}):\n{tail}")
    return json.loads(summary.read_text(encoding="utf-8"))
