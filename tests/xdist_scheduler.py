"""pytest-xdist's `--dist loadfile` (deploy/test.sh: each worker takes a test file at a time, so a file's
module-scoped fixtures are set up once), with the files that start a real Ray cluster (the `ray` marker) in one
scope: they run one after another on one worker, and that scope is handed out first. tests/conftest.py's
`pytest_xdist_make_scheduler` uses it.

- One after another: two clusters at once on the 2-core, 23 GB machine let Ray's memory monitor kill a worker
  mid-test. (`--dist loadgroup` would say this with marks, but pytest-xdist 3.8 cannot regroup under pytest 9: it
  rewrites a node id field pytest no longer reads.)
- First: those files are ~21 of the suite's ~23 minutes on one worker, its critical path, while the other worker
  runs everything else. xdist alone hands out files with more tests first, so the Ray scope started only after one
  or two of them (~30 s late).
- Tried on 2026-11-28 and dropped: two Ray lanes, one a worker. The suite is CPU-bound, and a Ray test spends much of
  its time waiting (a cluster starting, a fault's interval, a request's deadline), time the other worker's CPU-bound
  files fill; two lanes side by side left those waits unfilled, and the run took 1,552 s against 1,379 s.
"""

from __future__ import annotations

from pathlib import Path

import pytest

RAY_SCOPE = "ray-clusters"


def ray_first_scheduler(config: pytest.Config, log: object, tests: Path) -> object | None:
    """The scheduler for the test files under `tests`; None (xdist's own) unless `--dist loadfile`."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    ray_files = {str(path.relative_to(config.rootpath)) for path in tests.rglob("test_*.py")
                 if "pytest.mark.ray" in path.read_text()}

    class RayClustersFirstInTurn(LoadFileScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return RAY_SCOPE if scope in ray_files else scope

        def _assign_work_unit(self, node: object) -> None:
            if not self.ordered:  # the first assignment: the queue is complete
                self.ordered = True
                if RAY_SCOPE in self.workqueue:
                    self.workqueue.move_to_end(RAY_SCOPE, last=False)
            super()._assign_work_unit(node)

    return RayClustersFirstInTurn(config, log)
