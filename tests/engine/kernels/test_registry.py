"""An engine loads every C++ CPU kernel when it is built, before its first step, and says which variant runs."""

from __future__ import annotations

from engine.kernels.registry import native_modules
from kv_transfer import native_build


def test_an_engine_has_its_kernels_loaded_before_its_first_step(tiny_engine) -> None:
    variant, _ = native_build.selected_variant()
    names = {module.name for module in native_modules()}
    assert names == {"cpu_elementwise", "cpu_paged_attention", "cpu_quantized_linear", "block_copy"}
    assert {k.kernel for k in tiny_engine.cpu_kernels} == names
    # The CI machine builds them at set-up (deploy/setup.sh), so here they are loaded, not fallen back.
    assert variant is not None, "no kernel variant fits the test machine"
    assert {k.variant for k in tiny_engine.cpu_kernels} == {variant.name}
    assert not any(k.built for k in tiny_engine.cpu_kernels), "built at set-up, not by an engine"

