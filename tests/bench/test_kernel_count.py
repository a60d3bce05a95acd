"""bench/kernel_count.py and its kernels-a-step probes (which bench/gpu.py runs): the tally's grouping on recorded
names, the probes' plumbing on a stand-in engine (the profiler faked: this machine has no CUDA activity to
record), the reason printed where nothing can be counted, CUPTI's release after counting (the profiler faked), and,
on a GPU, real counts of eager launches and of a graph replay's kernels."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import bench.kernel_count as kc
from bench.kernel_count import KernelCountUnavailable, count_kernels, kernel_group, tally


def test_groups_cut_templates_and_parameters_and_keep_copies_apart():
    assert kernel_group("void at::native::vectorized_elementwise_kernel<4, at::native::AddFunctor<float>>(int, ...)") \
        == "at::native::vectorized_elementwise_kernel"
    assert kernel_group("_rms_norm_kernel") == "_rms_norm_kernel"
    assert kernel_group("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "nvjet_tst_64x8_64x16_4x1_v_bz_TNT"
    count = tally([("_rms_norm_kernel", 1.5), ("Memcpy HtoD (Pinned -> Device)", 2.0), ("_rms_norm_kernel", 1.5),
                   ("void at::native::f<1>(int)", 4.0), ("Memset (Device)", 1.0)], top=1)
    assert (count.launches, count.kernel_us, count.copies) == (3, 7.0, 2)
    assert count.groups == [{"name": "_rms_norm_kernel", "count": 2, "us": 3.0}]  # the largest group only (top=1)


def test_unavailable_on_cpu_says_why():
    with pytest.raises(KernelCountUnavailable, match="the device is cpu"):
        count_kernels(lambda: None, torch.device("cpu"))
    engine = SimpleNamespace(device=torch.device("cpu"), runner=SimpleNamespace(graphs=None))
    assert kc.count_step_kernels(engine, 1, lambda: None) == {
        "unavailable": "kernel counts need CUDA activity; the device is cpu"}


def test_probes_on_a_graph_engine(monkeypatch: pytest.MonkeyPatch, capsys):
    """Each probe runs once under the counter; the unfused-rotary probe runs the forward with the model's flag off
    and sets it back; a probe that raises is recorded, the others still counted; the summary row reads them."""
    calls: list[str] = []
    model = SimpleNamespace(rotary_in_attention=True)

    class Graphs:
        def __init__(self) -> None:
            self.model = model

        def bucket(self, batch: int) -> int:
            return 2

        def _replay(self, bucket: int) -> None:
            calls.append(f"replay {bucket}")

        def _step(self, bucket: int) -> None:
            calls.append(f"forward {bucket} fused={model.rotary_in_attention}")

    def fake_count(fn, device):  # noqa: ANN001, ANN202
        before = len(calls)
        fn()
        fused = any("fused=False" not in c for c in calls[before:])
        return tally([("Memcpy HtoD", 1.0)] + [("_k", 2.0)] * (3 if fused else 4))

    def engine_step() -> None:
        raise RuntimeError("step failed")

    monkeypatch.setattr(kc, "count_kernels", fake_count)
    engine = SimpleNamespace(device=torch.device("cuda"), runner=SimpleNamespace(graphs=Graphs()))
    counts = kc.count_step_kernels(engine, 1, engine_step)
    assert calls == ["replay 2", "forward 2 fused=True", "forward 2 fused=False"]
    assert model.rotary_in_attention is True
    assert counts["graph_replay"]["launches"] == 3 and counts["eager_forward"]["launches"] == 3
    assert counts["eager_forward_rotary_unfused"]["launches"] == 4
    assert counts["engine_step"] == {"error": "RuntimeError: step failed"}
    assert "eager_forward_rotary_unfused: 4 kernels" in capsys.readouterr().out
    row = kc.kernel_row("smollm2-135m", {"batch": 1, "kernels": counts})
    assert row == "| smollm2-135m | 1 | 3 | 3 | 4 | - | 0.006 |"


def test_release_cupti_tears_down_once_after_a_count(monkeypatch: pytest.MonkeyPatch):
    """One empty session stopped with TEARDOWN_CUPTI=1 (Kineto reads it when a session stops), the variable as it
    was afterwards; nothing where nothing was counted, where the caller set TEARDOWN_CUPTI=0, or on CUDA < 12.6."""
    import torch.profiler

    sessions: list[str | None] = []

    class FakeProfile:
        def __init__(self, activities) -> None:  # noqa: ANN001
            pass

        def __enter__(self) -> FakeProfile:
            return self

        def __exit__(self, *exc: object) -> None:
            sessions.append(os.environ.get("TEARDOWN_CUPTI"))

    monkeypatch.setattr(torch.profiler, "profile", FakeProfile)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    monkeypatch.setattr(kc, "_cupti_started", False)
    assert not kc.release_cupti() and sessions == []  # nothing counted: CUPTI never attached
    monkeypatch.setattr(kc, "_cupti_started", True)
    assert kc.release_cupti() and sessions == ["1"]
    assert "TEARDOWN_CUPTI" not in os.environ and kc._cupti_started is False
    assert not kc.release_cupti() and sessions == ["1"]  # released already
    monkeypatch.setattr(kc, "_cupti_started", True)
    monkeypatch.setenv("TEARDOWN_CUPTI", "0")
    assert not kc.release_cupti()
    monkeypatch.delenv("TEARDOWN_CUPTI")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    assert not kc.release_cupti() and sessions == ["1"]


@pytest.mark.gpu
def test_counts_eager_launches_and_a_graph_replays_kernels():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    x = torch.ones(1024, device=device)

    def three_adds() -> None:
        for _ in range(3):
            x.add_(1)

    three_adds()  # warm: nothing lazy left inside the counted call
    count_kernels(three_adds, device)  # the first profiler session starts CUPTI
    eager = count_kernels(three_adds, device)
    assert eager.launches == 3 and eager.copies == 0 and eager.kernel_us > 0
    assert len(eager.groups) == 1 and eager.groups[0]["count"] == 3
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        three_adds()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        three_adds()
    replayed = count_kernels(graph.replay, device)
    assert replayed.launches == 3, replayed
