"""The load generator's own CPU while its requests ran: what `plan --one-host` counts as --client-cores.

    with ClientCpu() as sampler:                 # this process's descendants (AIPerf's process tree)
        summary = run_aiperf(...)
    cores = sampler.cores_between(start_s, end_s)    # AIPerf's start_time and end_time, as epoch seconds

A benchmark on one host shares its cores with the server: AIPerf's workers, its record processors and its other
services spend CPU the workers then lack. The sampler reads every descendant's CPU seconds (utime + stime, /proc) 4
times a second, leaving out one subtree (`exclude`: a server this process started); `cores_between` counts what
they spent between two wall-clock times. A run's requests are measured between AIPerf's own start and end times:
its start-up (importing, spawning its services) comes before them and would count several times what it spends
while the requests run (on 2 cores: 0.7 cores over a 4-request warm-up, 0.06 over a 60-request run's requests).
Linux only; elsewhere /proc is absent and the figure is 0.
"""

from __future__ import annotations

import os
from pathlib import Path

from deploy.planner.load_probe import Sampler


def proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds: utime + stime) of every process /proc shows."""
    ticks = os.sysconf("SC_CLK_TCK")
    table = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / ticks)
    return table


class ClientCpu(Sampler[dict[int, float]]):
    """Samples the CPU seconds of this process's descendants, but for `exclude`'s subtree, until the `with` block
    ends; `cores_between(t0, t1)`: the cores they kept busy in that window."""

    def __init__(self, *, exclude: int | None = None, period_s: float = 0.25) -> None:
        super().__init__(self._descendants, period_s=period_s)
        self.exclude = exclude

    def _descendants(self) -> dict[int, float]:
        table = proc_table()
        out, me = {}, os.getpid()
        for pid, (_, cpu_s) in table.items():
            ancestor = pid
            while ancestor in table and ancestor not in (me, self.exclude, 0, 1):
                ancestor = table[ancestor][0]
            if ancestor == me and pid != me:
                out[pid] = cpu_s
        return out

    def cores_between(self, start_s: float, end_s: float) -> float:
        window = self.window(start_s, end_s)
        if len(window) < 2 or window[-1][0] <= window[0][0]:
            return 0.0
        (t0, first), (t1, _) = window[0], window[-1]
        last: dict[int, float] = {}
        for _, cpu in window:  # a process's last sample in the window: one that exits within it still counts
            last.update(cpu)
        return sum(cpu_s - first.get(pid, 0.0) for pid, cpu_s in last.items()) / (t1 - t0)
