"""kv_transfer.native_build: variants chosen from the CPU's flags, and builds that no killed or concurrent process
can leave half-done or locked.

The process tests build a tiny extension (tests/kv_transfer/native_peer.py) into a fresh cache each; one build
is ~10 CPU-s of compiling ATen's headers (native_build.EXTENSION_HEADERS), so they are marked slow.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kv_transfer import native_build
from kv_transfer.native_build import VARIANTS, NativeModule, choose_variant, variant_named
from tests.deploy.processes import REPO_ROOT, descendants, survivors
from tests.kv_transfer.native_peer import TINY

V3, V4 = variant_named("x86-64-v3"), variant_named("x86-64-v4")
PEER = [sys.executable, "-m", "tests.kv_transfer.native_peer"]


# -- choosing a variant (pure) -------------------------------------------------------------------------------
def test_the_best_variant_the_cpu_runs_is_chosen() -> None:
    assert choose_variant(V4.cpu_flags | {"sha_ni"}, "AVX512") == (V4, "")
    assert choose_variant(V3.cpu_flags, "AVX2") == (V3, "")


def test_the_variant_is_capped_at_torchs_own_dispatch_level() -> None:
    # ATEN_CPU_CAPABILITY=avx2 on an AVX-512 machine: at::vec code must use torch's vector width to match its bits
    assert choose_variant(V4.cpu_flags, "AVX2") == (V3, "")
    variant, reason = choose_variant(V4.cpu_flags, "DEFAULT")
    assert variant is None and "torch dispatches to DEFAULT" in reason


def test_a_cpu_that_fits_no_variant_is_told_what_it_lacks() -> None:
    variant, reason = choose_variant(V3.cpu_flags - {"avx2", "fma"}, "AVX2")
    assert variant is None
    assert "lacks avx2 fma" in reason
    variant, reason = choose_variant(frozenset(), "SVE256")  # an aarch64 machine: no x86 flags at all
    assert variant is None and "x86-64-v3" in reason


def test_variants_are_named_targets_not_native() -> None:
    assert [v.name for v in VARIANTS] == ["x86-64-v4", "x86-64-v3"]
    for variant in VARIANTS:
        assert f"-march={variant.name}" in variant.cflags
        assert not any("native" in flag for flag in variant.cflags)
    assert V3.cpu_flags < V4.cpu_flags
    with pytest.raises(ValueError, match="unknown kernel variant"):
        variant_named("native")


def test_full_source_binds_every_function() -> None:
    module = NativeModule(name="m", source="int a(); int b();", functions=("a", "b"))
    text = module.full_source()
    assert "PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)" in text
    assert 'm.def("a", torch::wrap_pybind_function(a), "a");' in text
    assert 'm.def("b", torch::wrap_pybind_function(b), "b");' in text


# -- loading without building --------------------------------------------------------------------------------
@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty kernel cache; this process's statuses as they were, after the test."""
    monkeypatch.setenv(native_build.KERNEL_CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(native_build.DISABLE_ENV, raising=False)
    monkeypatch.setattr(native_build, "_statuses", dict(native_build._statuses))
    return tmp_path


def test_the_kill_switch_loads_nothing_and_builds_nothing(fresh_cache: Path, monkeypatch) -> None:
    monkeypatch.setenv(native_build.DISABLE_ENV, "1")
    assert native_build.load(TINY) is None
    status = {s.kernel: s for s in native_build.statuses()}[TINY.name]
    assert status.variant == native_build.FALLBACK
    assert native_build.DISABLE_ENV in status.reason
    assert list(fresh_cache.iterdir()) == []


def test_a_cpu_that_fits_no_variant_runs_torch_ops_with_one_warning(fresh_cache: Path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(native_build, "read_cpu_flags", lambda: frozenset({"sse2"}))
    native_build.selected_variant.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger=native_build.__name__):
            other = NativeModule(name="other", source="", functions=())
            assert native_build.load(TINY) is None
            assert native_build.load(other) is None
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "no kernel variant fits" in warnings[0].getMessage()
        statuses = {s.kernel: s for s in native_build.statuses()}
        assert statuses[TINY.name].variant == statuses["other"].variant == native_build.FALLBACK
        assert "lacks" in statuses[TINY.name].reason
        assert list(fresh_cache.iterdir()) == []
    finally:
        native_build.selected_variant.cache_clear()


def test_a_failed_build_falls_back_and_leaves_nothing_behind(fresh_cache: Path) -> None:
    # The forced include of a missing header fails the compile at once, before the ~8 s of EXTENSION_HEADERS that
    # precede the #error.
    broken = NativeModule(name="broken", source="#error this kernel does not compile\n", functions=(),
                          cflags=("-include", "no_such_header.h"))
    assert native_build.load(broken) is None
    status = {s.kernel: s for s in native_build.statuses()}["broken"]
    assert status.variant == native_build.FALLBACK
    assert "the build of broken" in status.reason and "failed" in status.reason
    (root,) = fresh_cache.iterdir()
    leftovers = sorted(p.name for p in root.iterdir())
    assert len(leftovers) == 1 and leftovers[0].endswith(".lock"), leftovers  # no temporary folder, no build
    with open(root / leftovers[0]) as lock:  # and the lock is free
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_build_kernels_records_every_kernel_built_and_serve_then_starts_no_build_process(tmp_path, monkeypatch):
    """`build-kernels` (a real run, over copies of this machine's builds: no compile) records that every kernel this
    CPU loads is built; serve's parent reads that without torch and starts no build-kernels process. A build folder
    removed, or a variable that changes the variant, and serve asks again."""
    from deploy import serve_command
    from engine.kernels.registry import native_modules

    variant, reason = native_build.selected_variant()
    if variant is None:
        pytest.skip(f"this CPU runs no variant: {reason}")
    machine_builds = [native_build.complete_build(module, variant) for module in native_modules()]
    if None in machine_builds:
        pytest.skip("this machine's kernel cache lacks a build (deploy/setup.sh builds them)")
    cache = tmp_path / "cache"
    for built in machine_builds:
        shutil.copytree(built, cache / built.parent.name / built.name)
    monkeypatch.setenv(native_build.KERNEL_CACHE_ENV, str(cache))
    monkeypatch.delenv(native_build.DISABLE_ENV, raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    started: list[list[str]] = []
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run",  # serve's call; the test's own build-kernels run is real_run
                        lambda command, **_: started.append(command) or subprocess.CompletedProcess(command, 0))
    assert not native_build.recorded_ready()
    serve_command.build_kernels_ahead()
    assert len(started) == 1 and started[0][-1] == "build-kernels"  # nothing recorded yet: serve asks

    done = real_run([sys.executable, "-m", "deploy.cli", "build-kernels"], env=_env(cache), cwd=REPO_ROOT,
                    capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count("already built") == len(machine_builds), done.stdout
    assert native_build.recorded_ready()
    serve_command.build_kernels_ahead()
    assert len(started) == 1  # recorded: no process started

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # another variant may load: not what was recorded
    assert not native_build.recorded_ready()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert native_build.recorded_ready()
    shutil.rmtree(next(cache.glob("*/block_copy-*")))
    assert not native_build.recorded_ready()
    serve_command.build_kernels_ahead()
    assert len(started) == 2


# -- builds across processes (real compiles) ------------------------------------------------------------------
def _env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != native_build.DISABLE_ENV}
    env[native_build.KERNEL_CACHE_ENV] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _cache_entries(cache: Path) -> list[str]:
    (root,) = cache.iterdir()
    return sorted(p.name for p in root.iterdir())


def _wait_until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _run_peers_at_once(cache: Path, count: int) -> list[dict]:
    peers = [subprocess.Popen(PEER, env=_env(cache), cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(count)]
    results = []
    for peer in peers:
        out, err = peer.communicate(timeout=300)
        assert peer.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.slow
def test_a_build_killed_mid_compile_never_blocks_the_next_two(tmp_path: Path) -> None:
    """`kill -9` of the process building while the compiler runs (the compiler, its grandchild, is left running:
    the harder case than killing the whole group); then two processes start at once: one takes the lock at once,
    builds and loads, the other waits for that build and loads it; no trace of the killed build is left, and the
    orphaned compiler is stopped. (Two builders at once and a killed one in one test: each real compile costs
    seconds even for tests/kv_transfer/native_peer.py's tiny module.)"""
    cache = tmp_path / "cache"
    first = subprocess.Popen(PEER, env=_env(cache), cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_until(lambda: any(_comm(p) == "cc1plus" for p in descendants(first.pid)), 120, "the compiler")
        below = descendants(first.pid)
        builder = {p: t for p, t in below.items() if b"kv_transfer.native_build" in _cmdline(p)}
        assert builder, "the compiler runs in a child process"
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        # The build child dies with its parent (PR_SET_PDEATHSIG); the compiler it started may run on.
        _wait_until(lambda: not survivors(builder), 10, "the build child to die with its parent")
        assert any(".tmp-" in name for name in _cache_entries(cache)), "the killed build left its temporary folder"

        results = _run_peers_at_once(cache, 2)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    assert [r["answer"] for r in results] == [42, 42]
    assert sorted(r["built"] for r in results) == [False, True], results  # one compiled, the other waited
    second = next(r for r in results if r["built"])
    waiter = next(r for r in results if not r["built"])
    assert second["variant"] != native_build.FALLBACK and waiter["variant"] == second["variant"]
    assert second["lock_wait_s"] < 5.0, second  # the dead holder's lock was free at once: no timeout ran out
    assert waiter["lock_wait_s"] > 1.0, waiter  # it waited for the live build, then loaded it
    # It waited for the live build and no longer: a bound on its own wait, not on the wall time, which two Python
    # start-ups on a loaded machine (a parallel test run) stretch past any fixed slack.
    assert waiter["lock_wait_s"] < second["build_s"] + 10.0, (waiter, second)
    # The killed build's folder is gone, and with it whatever was still compiling there.
    entries = _cache_entries(cache)
    assert len(entries) == 2 and entries[1].endswith(".lock") and ".tmp-" not in entries[0], entries
    assert not survivors(below), "whatever the dead build left compiling was stopped"

    (third,) = _run_peers_at_once(cache, 1)  # complete builds are simply loaded
    assert third["answer"] == 42 and not third["built"] and third["variant"] == second["variant"]


@pytest.mark.slow
def test_the_avx2_variant_is_exact_where_torch_dispatches_avx2() -> None:
    """ATEN_CPU_CAPABILITY=avx2: torch's ops run AVX2 code, so the x86-64-v3 build loads, and the fused
    elementwise kernels' bit-exactness tests pass against it (the default variant's run in the main suite).
    The builds go to the machine's kernel cache, as serving's do: built once per machine (on an AVX2-only machine
    `deploy/setup.sh` has built them already), loaded from then on."""
    variant, reason = choose_variant(native_build.read_cpu_flags(), "AVX2")
    if variant is None:
        pytest.skip(f"this CPU runs no variant: {reason}")
    env = _env(Path())
    del env[native_build.KERNEL_CACHE_ENV]
    env["ATEN_CPU_CAPABILITY"] = "avx2"
    probe = ("import torch; from engine.kernels.registry import load_all; "
             "print(torch.backends.cpu.get_cpu_capability(), *(s.variant for s in load_all()))")
    done = subprocess.run([sys.executable, "-c", probe], env=env, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["AVX2"] + ["x86-64-v3"] * 4, done.stdout
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/engine/kernels/test_cpu_elementwise.py", "tests/kv_transfer/test_block_copy.py",
                            "tests/engine/kernels/test_cpu_paged_attention.py",
                            "tests/engine/kernels/test_cpu_quantized_linear.py"],
                           env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert " passed" in tests.stdout and "skipped" not in tests.stdout, tests.stdout[-500:]
