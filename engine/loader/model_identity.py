"""A checkpoint's identity: what namespaces its KV block hashes, so that two copies of the same weights share
hashes wherever they live, and two different checkpoints never do, whatever their file names.

    model_identity(path) = "sha256:" + 24 hex chars of
        SHA-256 over, for each weight file in name order (the .gguf itself, or a directory's *.safetensors and
        config.json): its name relative to the checkpoint, its size, and SHA-256 of its first and last 4 MiB

Sampling the ends instead of hashing every byte keeps start-up fast for multi-GB checkpoints: a GGUF or
safetensors file starts with its tensor index (names, shapes, offsets) and ends with the last tensors' data, so
two different trainings of one architecture differ in the sampled bytes. A deployment that wants a name of its
own passes `--model-id` instead. Pure file I/O, no torch.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_SAMPLE_BYTES = 4 << 20


def model_identity(path: str | Path) -> str:
    path = Path(path)
    files = [path] if path.is_file() else sorted(
        p for p in path.iterdir() if p.is_file() and (p.suffix == ".safetensors" or p.name == "config.json"))
    if not files:
        raise FileNotFoundError(f"{path}: no weight files to identify")
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name if path.is_dir() else ''}\0{size}\0".encode())
        with file.open("rb") as f:
            digest.update(hashlib.sha256(f.read(_SAMPLE_BYTES)).digest())
            f.seek(max(0, size - _SAMPLE_BYTES))
            digest.update(hashlib.sha256(f.read(_SAMPLE_BYTES)).digest())
    return "sha256:" + digest.hexdigest()[:24]
