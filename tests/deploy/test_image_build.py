"""The images' build steps, run as the Dockerfiles say (tests/deploy/dockerfile.py: every RUN in order, with its
ARG and ENV values, in a scratch prefix), build every C++ kernel variant into the image's kernel cache, so that an
image built on one CPU runs its kernels on AVX2 and AVX-512 nodes alike.

Two things stand in for what cannot run here, and say so:
- setup.sh's pip steps (torch from PyTorch's index, `pip install -e .`): the scratch `.venv` is what they leave, this
  checkout installed in editable mode over the test's own packages, with setup.sh's stamp, so the script runs
  as on a second build (it skips the installs, as it does wherever they are done);
- `splitserve build-kernels` runs with `SPLITSERVE_DRY_RUN=1`: every call the build makes, setup.sh's included,
  lists the builds it would compile (module, variant) instead of compiling them (minutes on two cores).
The model step runs with `--build-arg MODEL=` (the README's image without a model: no download).
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from tests.deploy.dockerfile import DockerfileBuild

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
_PLANNED = re.compile(r"^(\w+) \(([\w-]+)\): would build$", re.M)


def _installed(workdir: Path) -> None:
    """What setup.sh's pip steps leave in `workdir`/.venv: a venv of this interpreter where the checkout (`workdir`)
    is installed in editable mode, the test's own packages (torch, ...) importable, pyproject's console scripts,
    and setup.sh's stamp."""
    venv = workdir / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site / "splitserve-test-install.pth").write_text(f"{workdir}\n{sysconfig.get_paths()['purelib']}\n")
    scripts = tomllib.loads((workdir / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        script = venv / "bin" / name
        script.write_text(f"#!{venv}/bin/python\nimport sys\nfrom {module} import {function}\n"
                          f"sys.exit({function}())\n")
        script.chmod(0o755)
    (venv / ".splitserve-installed").touch()


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_image_build_compiles_every_kernel_variant_into_the_images_cache(name: str, tmp_path: Path) -> None:
    from engine.kernels.registry import native_modules
    from kv_transfer.native_build import VARIANTS

    build = DockerfileBuild(REPO_ROOT / "deploy" / "docker" / name, context=REPO_ROOT, prefix=tmp_path / "image",
                            build_args={"MODEL": ""}, extra_env={"SPLITSERVE_DRY_RUN": "1"}, after_copy=_installed)
    build.run()

    planned = set(_PLANNED.findall(build.output))
    every = {(module.name, variant.name) for module in native_modules() for variant in VARIANTS}
    assert planned == every, f"{name} builds {sorted(planned)}, not every variant:\n{build.output[-4000:]}"
    # ... into the cache the image's processes read (its ENV), not one of the build's own
    image_cache = Path(build.env["SPLITSERVE_KERNEL_CACHE"])
    assert image_cache.is_relative_to(build.prefix)
    caches = {Path(c).parent for c in re.findall(r"^kernel cache: (.*)$", build.output, re.M)}
    assert caches == {image_cache}, build.output[-4000:]
    # and the image has the compiler they are built with
    assert [c for c in build.stub_calls if c[:2] == ["apt-get", "install"] and "g++" in c], build.stub_calls
