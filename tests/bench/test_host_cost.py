"""bench/host_cost.py at toy sizes on CPU: every timed step is one decode of the whole batch through the graph path's
host code (the null replay), each phase is timed, and the engine ends with no request and no block held."""

from __future__ import annotations

import pytest

from bench import host_cost


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_toy_run_decodes_the_batch_through_the_graph_inputs(async_scheduling: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    built = []
    build = host_cost.build
    monkeypatch.setattr(host_cost, "build", lambda *a: built.append(build(*a)) or built[-1])
    args = host_cost.parse_args(["--batch", "6", "--context", "40", "--steps", "4", "--warmup-steps", "1",
                                 "--async-scheduling", async_scheduling, "--profile-first", "cpu"])
    result = host_cost.run(args)
    engine = built[0]
    assert result["async_scheduling"] is (async_scheduling == "on")
    # The prompts' steps are eager (many tokens); every step from the first decode on replays.
    assert result["graph_replays"] >= 2 * args.steps + args.warmup_steps
    phases = result["phases_ms"]
    assert {"schedule", "runner.launch", "  graph inputs (DecodeGraphs.run)", "  sampler.launch",
            "update_from_output", "postprocess (detokenize, outputs)"} <= phases.keys()
    assert ("can_schedule_ahead" in phases) is (async_scheduling == "on")
    assert not engine.has_unfinished_requests() and engine.block_pool.num_used_blocks == 0
