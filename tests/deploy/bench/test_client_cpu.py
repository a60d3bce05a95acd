"""The load generator's CPU (deploy/bench/client_cpu.py): a child process that spins is counted, one outside the
sampled tree is not, and a window too short to hold two samples counts nothing. Real processes, /proc (Linux)."""

from __future__ import annotations

import subprocess
import sys
import time

from deploy.bench.client_cpu import ClientCpu

SPIN = "import time\nend = time.perf_counter() + {s}\nwhile time.perf_counter() < end:\n    pass\n"


def spin(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SPIN.format(s=seconds)])


def test_a_spinning_child_is_counted_and_an_excluded_one_is_not() -> None:
    with ClientCpu() as sampler:
        started = time.time()
        child = spin(1.5)
        child.wait(30)
        ended = time.time()
    cores = sampler.cores_between(started, ended)
    assert 0.3 < cores < 1.2, cores  # one process spinning: at most a core (shared with the suite's other worker)
    with ClientCpu(exclude=None) as sampler, ClientCpu() as outside:
        child = spin(1.0)
        outside.exclude = child.pid  # the server's subtree, as plan_check leaves it out
        started = time.time()
        child.wait(30)
        ended = time.time()
    counted, excluded = sampler.cores_between(started, ended), outside.cores_between(started, ended)
    assert counted > 0.3
    assert excluded < 0.1  # this test process's other descendants: none busy
    assert counted - excluded > 0.3  # the same window, the child's core the only difference


def test_a_window_without_two_samples_counts_nothing() -> None:
    with ClientCpu(period_s=10.0) as sampler:
        time.sleep(0.05)
    assert sampler.cores_between(time.time() - 1, time.time()) == 0.0
    assert sampler.cores_between(float("nan"), float("nan")) == 0.0  # AIPerf gave no start or end time
