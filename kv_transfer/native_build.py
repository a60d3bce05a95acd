"""Building and loading our C++ CPU code (the engine's kernels, the KV transports' fused copy): the one module
every C++ user calls. It lives in kv_transfer, the lowest layer that uses torch, so that both can reach it.

Nothing is compiled on the request path. Builds happen at set-up (`splitserve build-kernels`, which
`deploy/setup.sh` and an image build run), in the parent of `serve` before any worker starts, or when an engine
starts (a worker on a host nobody built for); every engine loads its kernels before it serves.

    NativeModule          one extension: its C++ source and the functions it exports, declared beside the torch
                          code that runs whenever it does not load
    Variant               a named build target (x86-64-v3: AVX2; x86-64-v4: AVX-512), never -march=native, so a
                          build made on one machine runs on another; chosen at load time from the CPU's flags
    load(module)          the extension for this CPU's variant, built first if missing; None: run the torch ops
    build(module, v)      build one variant if missing, without loading it (so any variant, on any x86-64 CPU)
    statuses()            what this process runs: a KernelStatus per module it asked for (logs, /metrics)
    recorded_ready()      whether `build-kernels` recorded this CPU's every kernel built (record_ready), torch-free

The cache: $SPLITSERVE_KERNEL_CACHE, else $SPLITSERVE_CACHE/kernels, else ~/.cache/splitserve/kernels; under
it one folder per torch version and Python, holding per build:

    <module>-<variant>-<digest>/<import name>*.so    complete: the folder appears by one rename, never partial
    <module>-<variant>-<digest>.lock                 flock'd by the builder; the kernel drops it when it dies
    <module>-<variant>-<digest>.tmp-*/               a build under way (a dead builder's: removed by the next)

The digest covers the source, the flags, torch's version and ABI and this recipe, so a changed kernel is a new
folder. Two processes needing one build: one builds, the other waits on the lock, then loads the result. The
compiler runs in a child process (`python -m kv_transfer.native_build`: torch's BuildExtension, which compiles
without importing the result) that the kernel kills when its parent dies; the next builder stops whatever that
child left compiling in its temporary folder (found by working directory) before removing the folder.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

KERNEL_CACHE_ENV = "SPLITSERVE_KERNEL_CACHE"
DISABLE_ENV = "SPLITSERVE_DISABLE_CPU_KERNELS"
FALLBACK = "torch"  # the variant label of a module that did not load: its torch ops run
LOCK_TIMEOUT_S = 900.0  # waiting for a live builder; a dead one's lock is free at once
BUILD_TIMEOUT_S = 900.0
_RECIPE = 1  # bump when the build recipe changes: every digest, so every cached build, changes with it
_LOCK_POLL_S = 0.05
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def cpu_kernels_disabled() -> bool:
    """SPLITSERVE_DISABLE_CPU_KERNELS: plain torch ops for everything (our C++ kernels, the KV transports' fused copy
    and the oneDNN GEMMs)."""
    return bool(os.environ.get(DISABLE_ENV))


class NativeBuildError(RuntimeError):
    """A build that failed, timed out, or waited too long for another process's."""


# What a module's source and bindings need: ATen (at::Tensor and its ops), pybind11 with torch's Tensor casters, and
# torch::wrap_pybind_function. Not <torch/extension.h>: it adds the C++ frontend (autograd, nn, optim, ...), which no
# kernel uses, and compiling it took ~35 CPU-s of each kernel's ~45 (deploy/setup.sh builds four).
EXTENSION_HEADERS = (
    "#include <ATen/ATen.h>\n#include <torch/csrc/utils/pybind.h>\n#include <torch/csrc/Exceptions.h>\n"
)


@dataclass(frozen=True, kw_only=True)
class NativeModule:
    """One C++ extension: `source` is C++ on ATen (EXTENSION_HEADERS come first); each of `functions` is exported
    under its name."""

    name: str
    source: str
    functions: tuple[str, ...]
    cflags: tuple[str, ...] = ()

    def full_source(self) -> str:
        bindings = "".join(f'  m.def("{f}", torch::wrap_pybind_function({f}), "{f}");\n' for f in self.functions)
        return f"{EXTENSION_HEADERS}{self.source}\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{\n{bindings}}}\n"


@dataclass(frozen=True, kw_only=True)
class Variant:
    """A build target: the compiler's -march level, the /proc/cpuinfo flags a CPU needs to run it, and the ATen
    capability it is built for (code on at::vec must use the vector width torch's own ops use: same width, same
    bits)."""

    name: str
    march: str
    cpu_flags: frozenset[str]
    torch_capability: str  # "AVX2" | "AVX512", torch.backends.cpu.get_cpu_capability()'s names

    @property
    def cflags(self) -> tuple[str, ...]:
        cap = self.torch_capability
        return (f"-march={self.march}", f"-DCPU_CAPABILITY_{cap}", f"-DCPU_CAPABILITY={cap}")


_X86_64_V3_FLAGS = frozenset(
    "cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave".split()
)  # abm: how /proc/cpuinfo names LZCNT
_X86_64_V4_FLAGS = _X86_64_V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
VARIANTS = (  # best first
    Variant(name="x86-64-v4", march="x86-64-v4", cpu_flags=_X86_64_V4_FLAGS, torch_capability="AVX512"),
    Variant(name="x86-64-v3", march="x86-64-v3", cpu_flags=_X86_64_V3_FLAGS, torch_capability="AVX2"),
)
_CAPABILITY_RANK = {"AVX2": 1, "AVX512": 2}  # anything else torch reports ranks 0: no variant


def variant_named(name: str) -> Variant:
    for variant in VARIANTS:
        if variant.name == name:
            return variant
    raise ValueError(f"unknown kernel variant {name!r}; known: {', '.join(v.name for v in VARIANTS)}")


def choose_variant(cpu_flags: frozenset[str], torch_capability: str) -> tuple[Variant | None, str]:
    """The best variant the CPU runs, no higher than torch's own dispatch level; else None and why."""
    rank = _CAPABILITY_RANK.get(torch_capability, 0)
    for variant in VARIANTS:
        if variant.cpu_flags <= cpu_flags and _CAPABILITY_RANK[variant.torch_capability] <= rank:
            return variant, ""
    missing = sorted(VARIANTS[-1].cpu_flags - cpu_flags)
    why = f"the CPU lacks {' '.join(missing)}" if missing else f"torch dispatches to {torch_capability}"
    return None, f"no kernel variant fits this machine ({why}; variants: {', '.join(v.name for v in VARIANTS)})"


def read_cpu_flags() -> frozenset[str]:
    """The x86 CPU's feature flags from /proc/cpuinfo; empty on other machines and systems."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


@cache
def selected_variant() -> tuple[Variant | None, str]:
    """This process's variant (one for every module), or None and why; a None is warned about once."""
    import torch

    variant, reason = choose_variant(read_cpu_flags(), torch.backends.cpu.get_cpu_capability())
    if variant is None:
        logger.warning("C++ CPU kernels: %s; torch ops run instead", reason)
    return variant, reason


# -- where a build lives -------------------------------------------------------------------------------------
def _cache_base() -> Path:
    base = os.environ.get(KERNEL_CACHE_ENV)
    if base:
        return Path(base)
    return Path(os.environ.get("SPLITSERVE_CACHE") or Path.home() / ".cache" / "splitserve") / "kernels"


def cache_root() -> Path:
    import torch

    return _cache_base() / f"torch-{torch.__version__}-{sys.implementation.cache_tag}"


# -- "every kernel is built", read without torch (serve's parent) ------------------------------------------------
_KERNEL_SOURCE_DIRS = ("engine/kernels", "kv_transfer")  # every NativeModule is declared in a file of these


def _ready_stamp() -> Path:
    """Where `build-kernels` records that this CPU's variant of every kernel is built. Its name is a digest of what
    those builds depend on that can be read without importing torch: the interpreter, torch's installed version,
    the CPU's flags, the variables that steer the variant, and every file of the folders declaring the kernels (an
    edit to any of them is a new name: at worst one check too many, never a stale build taken as current)."""
    from importlib.metadata import version

    digest = hashlib.sha256(json.dumps([_RECIPE, sys.executable, sys.version, version("torch"),
                                        sorted(read_cpu_flags()), os.environ.get("ATEN_CPU_CAPABILITY")]).encode())
    for folder in _KERNEL_SOURCE_DIRS:
        for path in sorted((_PACKAGE_ROOT / folder).glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return _cache_base() / "ready" / f"{digest.hexdigest()[:16]}.json"


def record_ready(builds: list[Path]) -> None:
    """Note that `builds` (complete build folders) are every kernel this CPU loads (build-kernels, after building)."""
    stamp = _ready_stamp()
    stamp.parent.mkdir(parents=True, exist_ok=True)
    tmp = stamp.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps([str(b) for b in builds]))
    os.replace(tmp, stamp)


def recorded_ready() -> bool:
    """Whether build-kernels recorded every kernel built for what this process would load, and those builds are
    still there. Torch-free: serve's parent asks it before paying for a build-kernels process (~2 CPU-s)."""
    try:
        builds = json.loads(_ready_stamp().read_text())
    except (OSError, ValueError):
        return False
    return bool(builds) and all(Path(b).is_dir() for b in builds)


@dataclass(frozen=True, kw_only=True)
class _Paths:
    import_name: str  # the extension's module name (PyInit_<import_name>)
    final_dir: Path
    lock: Path
    tmp_prefix: str

    @staticmethod
    def of(module: NativeModule, variant: Variant) -> _Paths:
        import torch

        key = json.dumps([_RECIPE, module.full_source(), module.cflags, variant.cflags, torch.__version__,
                          bool(torch._C._GLIBCXX_USE_CXX11_ABI), sys.version])
        digest = hashlib.sha256(key.encode()).hexdigest()[:12]
        stem = f"{module.name}-{variant.name}-{digest}"
        root = cache_root()
        return _Paths(
            import_name=f"splitserve_{module.name}_{variant.name.replace('-', '_')}_{digest}",
            final_dir=root / stem,
            lock=root / f"{stem}.lock",
            tmp_prefix=f"{stem}.tmp-",
        )

    def complete(self) -> Path | None:
        """The built extension, if a complete build is in place."""
        found = sorted(self.final_dir.glob(f"{self.import_name}*.so"))
        return found[0] if found else None


# -- building ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class BuildResult:
    path: Path
    import_name: str
    built: bool  # this call compiled it (False: it was in place, or another process built it meanwhile)
    lock_wait_s: float = 0.0
    build_s: float = 0.0


def complete_build(module: NativeModule, variant: Variant) -> Path | None:
    """The folder of `module`'s complete build for `variant` in this process's kernel cache, if there is one."""
    paths = _Paths.of(module, variant)
    return paths.final_dir if paths.complete() is not None else None


def build(module: NativeModule, variant: Variant, *, lock_timeout_s: float = LOCK_TIMEOUT_S) -> BuildResult:
    """Make sure a complete build of `module` for `variant` is in the cache; load nothing. Raises NativeBuildError."""
    paths = _Paths.of(module, variant)
    found = paths.complete()
    if found is not None:
        return BuildResult(path=found, import_name=paths.import_name, built=False)
    paths.final_dir.parent.mkdir(parents=True, exist_ok=True)
    asked_s = time.monotonic()
    with _exclusive(paths.lock, timeout_s=lock_timeout_s, what=module.name):
        lock_wait_s = time.monotonic() - asked_s
        found = paths.complete()  # the holder we waited for built it
        if found is not None:
            return BuildResult(path=found, import_name=paths.import_name, built=False, lock_wait_s=lock_wait_s)
        for stale in paths.final_dir.parent.glob(f"{paths.tmp_prefix}*"):  # a dead builder's: we hold the lock
            _remove_stale(stale)
        started_s = time.monotonic()
        path = _compile(module, variant, paths)
        return BuildResult(path=path, import_name=paths.import_name, built=True, lock_wait_s=lock_wait_s,
                           build_s=time.monotonic() - started_s)


@contextlib.contextmanager
def _exclusive(lock_path: Path, *, timeout_s: float, what: str) -> Iterator[None]:
    """flock(LOCK_EX) on `lock_path`: released when the block ends or when this process dies, however it dies.
    The descriptor is not inherited (Python's default), so no child process can keep it alive."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise NativeBuildError(
                        f"another live process has been building {what} for over {timeout_s:.0f} s ({lock_path})"
                    ) from None
                time.sleep(_LOCK_POLL_S)
        yield
    finally:
        os.close(fd)  # drops the lock


def _remove_stale(folder: Path) -> None:
    """A dead builder's temporary folder: stop what it left compiling there (a process whose working directory
    is inside that folder can only be its compiler), then remove the folder."""
    deadline = time.monotonic() + 2.0
    while (pids := _pids_working_in(folder)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    shutil.rmtree(folder, ignore_errors=True)


def _pids_working_in(folder: Path) -> list[int]:
    """Processes whose working directory is `folder` or below it (Linux /proc; none found elsewhere)."""
    inside = str(folder.resolve())
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    pids = []
    for name in names:
        if name.isdigit():
            try:
                cwd = os.readlink(f"/proc/{name}/cwd")
            except OSError:  # gone, a zombie, or not ours to read
                continue
            if cwd == inside or cwd.startswith(inside + os.sep):
                pids.append(int(name))
    return pids


def _compile(module: NativeModule, variant: Variant, paths: _Paths) -> Path:
    """Compile in a fresh temporary folder, then publish its output folder by one rename. Holds the lock."""
    tmp = Path(tempfile.mkdtemp(prefix=paths.tmp_prefix, dir=paths.final_dir.parent))
    try:
        source = tmp / f"{paths.import_name}.cpp"
        source.write_text(module.full_source())
        out = tmp / "out"
        request = {
            "name": paths.import_name,
            "source": str(source),
            # -fopenmp: at::parallel_for is header code that only runs in parallel when compiled with OpenMP.
            "cflags": ["-O3", "-g0", *variant.cflags, *module.cflags, "-fopenmp"],
            "ldflags": ["-fopenmp"],
            "build_lib": str(out),
            "build_temp": str(tmp / "build"),
            "parent_pid": os.getpid(),
        }
        log_path = tmp / "build.log"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_PACKAGE_ROOT),
                                                                         os.environ.get("PYTHONPATH")]))}
        with open(log_path, "wb") as log:
            child = subprocess.Popen([sys.executable, "-m", "kv_transfer.native_build", json.dumps(request)],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp)
            try:
                code = child.wait(timeout=BUILD_TIMEOUT_S)
            except BaseException:  # timed out, or this process is being interrupted
                child.kill()
                child.wait()
                raise
        if code != 0:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-12:]
            raise NativeBuildError(f"the build of {module.name} ({variant.name}) failed (exit {code}):\n"
                                   + "\n".join(tail))
        built = sorted(out.glob(f"{paths.import_name}*.so"))
        if len(built) != 1:
            raise NativeBuildError(f"the build of {module.name} left {len(built)} extension files in {out}")
        for other in out.iterdir():
            if other != built[0]:
                shutil.rmtree(other) if other.is_dir() else other.unlink()
        os.rename(out, paths.final_dir)  # the one step that publishes: complete, or absent
        return paths.final_dir / built[0].name
    except subprocess.TimeoutExpired:
        raise NativeBuildError(f"the build of {module.name} took over {BUILD_TIMEOUT_S:.0f} s") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# -- loading -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class KernelStatus:
    """Which build of a module this process runs, for the start-up log and `splitserve:cpu_kernels_info`."""

    kernel: str
    variant: str  # a Variant's name, or FALLBACK ("torch"): the module's torch ops run
    reason: str = ""  # why FALLBACK
    built: bool = False  # this process compiled it
    build_s: float = 0.0
    lock_wait_s: float = 0.0


_statuses: dict[str, KernelStatus] = {}
_statuses_lock = threading.Lock()


def statuses() -> list[KernelStatus]:
    """One per module this process has loaded (or failed to), by name."""
    with _statuses_lock:
        return [_statuses[name] for name in sorted(_statuses)]


def load(module: NativeModule) -> ModuleType | None:
    """The compiled extension for this CPU's variant, building it first if the cache lacks it; None (and the
    reason in `statuses()`) when kernels are disabled, no variant fits, or the build or load fails. Callers cache
    the result: each call looks at the cache again."""
    status, extension = _load(module)
    with _statuses_lock:
        _statuses[module.name] = status
    return extension


def _load(module: NativeModule) -> tuple[KernelStatus, ModuleType | None]:
    if cpu_kernels_disabled():
        return KernelStatus(kernel=module.name, variant=FALLBACK, reason=f"{DISABLE_ENV} is set"), None
    variant, reason = selected_variant()
    if variant is None:
        return KernelStatus(kernel=module.name, variant=FALLBACK, reason=reason), None
    try:
        result = build(module, variant)
        extension = _import(result.import_name, result.path)
    except (NativeBuildError, ImportError, OSError) as exc:
        logger.warning("C++ CPU kernel %s (%s) unavailable, its torch ops run instead: %s", module.name,
                       variant.name, exc)
        return KernelStatus(kernel=module.name, variant=FALLBACK, reason=str(exc).splitlines()[0]), None
    if result.built:
        logger.info("built C++ CPU kernel %s (%s) in %.1f s", module.name, variant.name, result.build_s)
    status = KernelStatus(kernel=module.name, variant=variant.name, built=result.built, build_s=result.build_s,
                          lock_wait_s=result.lock_wait_s)
    return status, extension


def _import(import_name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(import_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    extension = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(extension)
    return extension


# -- the build child -----------------------------------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel SIGKILLs this process when the thread that started it ends (its process killed, say)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # it died before the line above
        print("native_build: the parent process is gone; not building", file=sys.stderr)
        os._exit(1)


def _child_main(request_json: str) -> int:
    request = json.loads(request_json)
    _die_with_parent(request["parent_pid"])
    from setuptools import Distribution
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    extension = CppExtension(request["name"], [request["source"]], extra_compile_args=request["cflags"],
                             extra_link_args=request["ldflags"])
    dist = Distribution({"name": request["name"], "ext_modules": [extension],
                         "cmdclass": {"build_ext": BuildExtension}})
    command = dist.get_command_obj("build_ext")
    command.build_lib = request["build_lib"]  # type: ignore[attr-defined]
    command.build_temp = request["build_temp"]  # type: ignore[attr-defined]
    dist.run_command("build_ext")
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
