"""tests/xdist_scheduler.py, in a real pytest-xdist run of two workers over a directory of small test files: the
files marked `ray` run whole on one worker, one after another, and start first (xdist alone would start the files
of more tests); the other files go to both workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFTEST = """from pathlib import Path

from tests.xdist_scheduler import ray_first_scheduler


def pytest_xdist_make_scheduler(config, log):
    return ray_first_scheduler(config, log, Path(__file__).resolve().parent)
"""


def _write(directory: Path, name: str, mark: str, num_tests: int, sleep_s: float) -> None:
    tests = "".join(f"def test_{i}():\n    time.sleep({sleep_s})\n\n\n" for i in range(num_tests))
    marks = f"pytestmark = [{mark}]\n\n\n" if mark else ""
    (directory / name).write_text(f"import time\n\nimport pytest\n\n{marks}{tests}")


def test_the_ray_files_run_in_turn_on_one_worker_and_start_first(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    ray: a Ray cluster\n    slow: slow\n")
    for name in ("a", "b", "c"):
        _write(tmp_path, f"test_ray_{name}.py", "pytest.mark.slow, pytest.mark.ray", 2, 0.2)
        _write(tmp_path, f"test_plain_{name}.py", "", 8, 0.05)  # more tests than the Ray files: xdist starts these
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
                           "-v", str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d)\] \[\s*\d+%\] PASSED (\S+?)::", done.stdout, flags=re.MULTILINE)
    assert len(ran) == 3 * 2 + 3 * 8, done.stdout
    workers = {gw for gw, f in ran if f.startswith("test_ray_")}
    assert len(workers) == 1, ran  # in turn, on one worker
    (ray_worker,) = workers
    files = [f for gw, f in ran if gw == ray_worker]
    assert files[:6] == sorted(files[:6]) and all(f.startswith("test_ray_") for f in files[:6]), files  # first
    assert {gw for gw, f in ran if f.startswith("test_plain_")} - workers, ran  # the other worker runs the rest
