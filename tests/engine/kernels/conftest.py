"""The Triton kernels' tests: on a machine without CUDA they run in Triton's interpreter (on CPU tensors).

TRITON_INTERPRET must be set before a kernel module is imported (`@triton.jit` reads it when it decorates), so it
is set here, at import of this conftest: pytest imports a directory's conftest before that directory's test
modules, and nothing outside `engine/kernels/triton/` imports triton. It is set only when no CUDA device is
present: there no compiled Triton kernel could run in this process anyway, so turning the interpreter on for the
rest of the pytest process (the variable is process-wide, and child processes inherit it) changes nothing else.
On a CUDA machine it stays unset, and the same small-size tests run compiled, on the GPU (`device` fixture).
`setdefault`: an explicit TRITON_INTERPRET=0/1 from the caller wins. A kernel module imported before this conftest
(by a test collected earlier) would already be compiled-mode: that stops the run with a clear error instead.

`@pytest.mark.gpu` tests skip themselves here without CUDA (the marker alone skips nothing).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    _already_jitted = sorted(name for name in sys.modules if name.startswith("engine.kernels.triton."))
    if _already_jitted and "TRITON_INTERPRET" not in os.environ:
        # Decorated before the interpreter was on: they would try to compile for a GPU this machine lacks.
        raise pytest.UsageError(
            f"{', '.join(_already_jitted)} imported before tests/engine/kernels/conftest.py set TRITON_INTERPRET=1; "
            "a test elsewhere that imports Triton kernels must set it first too (or run with TRITON_INTERPRET=1)"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with `int(array)`, but its scalars are 1-element
    1-d arrays, which NumPy >= 2.4 refuses to convert: every loop with a run-time bound fails. Convert through
    its one element instead (test-time only; the compiled path never runs this code)."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # no triton here: the test modules skip themselves
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_splitserve_patched", False):
        return

    def patch_lang_tensor(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._splitserve_patched = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_interpreter_for_numpy_2_4()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the interpreter-size tests run: the GPU when there is one, else the CPU (through the interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
