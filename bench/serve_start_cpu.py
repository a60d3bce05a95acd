"""The CPU one `splitserve serve` start costs: this tree against another checkout (`--baseline-tree`), in turn.

Each start: SmolLM2 on 1 prefill + 1 decode worker over gRPC with the test suite's flags (tests/deploy/processes.py:
one thread a worker, 256 MiB of KV), `--max-model-len 2048`, until /health answers; 3 completions of 8 tokens;
SIGINT, and the exit checked. Its CPU is that of the whole process tree (serve, Ray's processes, the workers),
read from a cgroup of its own (cgroup v1 `cpuacct`, so root), which is why no per-process sum can miss a child.

    sudo .venv/bin/python bench/serve_start_cpu.py --baseline-tree ../old-checkout --repeats 3

The baseline tree needs this tree's .venv (a symlink does) and its kernels built (`build-kernels` there).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup/cpuacct")
ONE_START = """
import sys
from pathlib import Path
import httpx
sys.path.insert(0, ".")
from tests.deploy.processes import serve_argv, serving
argv = serve_argv("smollm2-135m", "--prefill-workers", "1", "--decode-workers", "1", "--max-model-len", "2048")
with serving(argv, stderr_path=Path(sys.argv[1])) as serve:
    for prompt in ("a b c", "hello there", "one two"):
        r = httpx.post(f"{serve.url}/v1/completions", timeout=60,
                       json={"model": "smollm2-135m", "prompt": prompt, "max_tokens": 8})
        assert r.status_code == 200, r.text
"""


def one_start(tree: Path, cgroup: Path, log: Path) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one start in `tree`, its process tree in `cgroup`."""
    usage = cgroup / "cpuacct.usage"
    before_ns, started = int(usage.read_text()), time.perf_counter()
    child = subprocess.Popen([str(tree / ".venv/bin/python"), "-c", ONE_START, str(log)], cwd=tree,
                             preexec_fn=lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid())))
    if child.wait(timeout=600) != 0:
        raise SystemExit(f"a start in {tree} failed (exit {child.returncode}); see {log}")
    return (int(usage.read_text()) - before_ns) / 1e9, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-tree", type=Path, required=True, help="another checkout, e.g. an older commit")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not os.access(CGROUP_ROOT, os.W_OK):
        raise SystemExit(f"{CGROUP_ROOT} is not writable: this bench needs root and cgroup v1's cpuacct")
    cgroup = CGROUP_ROOT / f"splitserve-bench-{os.getpid()}"
    cgroup.mkdir()
    ours = Path(__file__).resolve().parents[1]
    runs: dict[str, list[tuple[float, float]]] = {"baseline": [], "ours": []}
    try:
        for _ in range(args.repeats):
            for name, tree in (("baseline", args.baseline_tree.resolve()), ("ours", ours)):
                cpu_s, wall_s = one_start(tree, cgroup, Path(f"/tmp/serve_start_cpu-{name}.log"))
                runs[name].append((cpu_s, wall_s))
                print(f"{name}: {cpu_s:.1f} CPU-s, {wall_s:.1f} s wall", flush=True)
    finally:
        for _ in range(50):  # Ray's last processes may still be exiting
            try:
                cgroup.rmdir()
                break
            except OSError:
                time.sleep(0.2)
    cpu = {name: statistics.median(c for c, _ in r) for name, r in runs.items()}
    wall = {name: statistics.median(w for _, w in r) for name, r in runs.items()}
    for name in runs:
        print(f"{name}: median {cpu[name]:.1f} CPU-s, {wall[name]:.1f} s wall")
    print(f"ours / baseline: {cpu['ours'] / cpu['baseline']:.2f}x the CPU, "
          f"{wall['ours'] / wall['baseline']:.2f}x the wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
