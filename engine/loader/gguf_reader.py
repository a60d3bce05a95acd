"""`open_gguf`: a GGUF file's header and tensor directory, parsed by gguf's `GGUFReader` with its one primitive
read replaced (`_BoundsCheckedReader`), the tensor data left memory-mapped. Torch-free, so that the gateway's
tokenizer load (router/server.py) parses the file as fast as a worker's checkpoint load does: with the stock reader
that load (parse and tokenizer) took 3.7 CPU-s of every `serve` start on SmolLM2's 49k-token vocabulary, 0.5 now.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

from engine.loader.errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


class _TruncatedRead(Exception):
    def __init__(self, end: int) -> None:
        super().__init__(end)
        self.end = end


class _BoundsCheckedReader(GGUFReader):
    """`GGUFReader` with its one primitive read replaced (same contract) to do two things better:

    - a read past the end of the file raises `_TruncatedRead`; the stock reader gets a short array back from
      the memmap and fails later with an unrelated-looking reshape or index error;
    - it slices a plain ndarray view of the memmap: slicing the memmap itself runs Python-level hooks on every
      one of the ~250k small reads a 50k-token vocabulary takes, which made the header parse twice as slow.
    """

    _plain: np.ndarray | None = None

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        dtype = np.dtype(dtype)
        end = int(offset) + dtype.itemsize * int(count)
        if end > self._plain.shape[0]:
            raise _TruncatedRead(end)
        values = self._plain[offset:end].view(dtype)
        return values.view(values.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        """The stock reader's contract, with arrays of strings or scalars read in one loop: the stock reader
        recurses once per element (the Enum lookups and size sums of ~150k calls for a 50k-token vocabulary,
        its merges and token types, were two thirds of SmolLM2's load). Same parts, indices and types."""
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        item_type = GGUFValueType(int(raw_itype[0]))
        item_np = self.gguf_scalar_to_np.get(item_type)
        if item_type != GGUFValueType.STRING and item_np is None:  # nested arrays: rare and small
            return super()._get_field_parts(orig_offs, raw_type)
        alen = self._get(orig_offs + 4, np.uint64)
        count = int(alen[0])
        offs = orig_offs + 12
        plain = self._plain
        assert plain is not None  # set by _get
        parts: list[np.ndarray] = [raw_itype, alen]
        if item_type == GGUFValueType.STRING:
            raw = memoryview(plain)
            size = plain.shape[0]
            for _ in range(count):
                if offs + 8 > size:
                    raise _TruncatedRead(offs + 8)
                length = int.from_bytes(raw[offs : offs + 8], "little")
                end = offs + 8 + length
                if end > size:
                    raise _TruncatedRead(end)
                parts.append(plain[offs : offs + 8].view(np.uint64))
                parts.append(plain[offs + 8 : end])
                offs = end
            data_idxs = list(range(3, 2 + 2 * count + 1, 2))
        else:
            values = self._get(offs, item_np, count)
            parts.extend(values[i : i + 1] for i in range(count))
            offs += int(values.nbytes)
            data_idxs = list(range(2, 2 + count))
        return offs - orig_offs, parts, data_idxs, [GGUFValueType.ARRAY, *([item_type] if count else [])]


def open_gguf(path: Path) -> GGUFReader:
    """Parse the header and tensor directory of `path` (tensor data stays memory-mapped)."""
    try:
        size_bytes = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise ModelLoadError(f"{path}: cannot read GGUF file ({err.strerror or err})") from err
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = _BoundsCheckedReader(path)
    except _TruncatedRead as err:
        raise ModelLoadError(
            f"{path}: truncated or corrupt GGUF: its header refers to byte {err.end} but the file has {size_bytes}"
        ) from None
    except Exception as err:
        # The reader is a parser of untrusted bytes; whatever it trips over, the file is at fault.
        raise ModelLoadError(f"{path}: corrupt GGUF ({type(err).__name__}: {err})") from err
    if reader.byte_order != "I":
        raise ModelLoadError(f"{path}: GGUF byte order differs from this machine's; convert the file first")
    return reader
