"""Copying a KV block and computing its CRC-32C in one pass over its bytes.

Every block crosses the wire with a CRC-32C, and every block is copied on each side anyway: the sender gathers it
out of the paged cache into the outgoing message, the receiver scatters it from the message into its paged cache.
Taken as a pass of its own, the checksum reads the block once more on each side; done while copying, it rides on
loads the copy makes.

    frame(head, block, tail)       sender:   head ‖ the block's bytes ‖ tail ‖ CRC-32C (4 bytes, little-endian),
                                             as one `bytes`; `block` may be a strided view of the paged cache
    frame_blocks(head, blocks, tail) sender: head ‖ each block's bytes ‖ tail ‖ each block's CRC-32C, as one
                                             `bytes` written in place (a run of blocks in one gRPC message)
    copy_checked(dst, src, crc)    receiver: dst ← src, then KVChecksumError unless CRC-32C(src) == crc
    copy_checked_parts(pairs, crc) receiver: the same over several (dst, src) pairs, one CRC over the srcs in order
    gather(block)                  sender, tensor transports: a contiguous copy of `block` and its CRC-32C

The native path (C++, x86-64): the SSE4.2 CRC32 instruction on three interleaved lanes of the block (one lane
would wait on the instruction's latency), the lanes' CRCs then joined by multiplying in GF(2)[x] mod the CRC-32C
polynomial. Tried and measured no faster end to end, so not kept: streaming stores into the cache, and a CRC by
carry-less-multiplication folding (AVX-512 VPCLMULQDQ, 55 GB/s against the three lanes' 27 on one Zen 4 core)
after a plain copy: on the wire path both copies are bound by memory, not by the checksum. Without native code
(another CPU, no compiler, SPLITSERVE_DISABLE_CPU_KERNELS) the same contract runs as a torch copy and the `crc32c`
package; the results are identical either way (a test checks).

When the copy is fused, `copy_checked` finds a mismatch only after writing: `dst` then holds unverified bytes.
Callers copy into blocks reserved for the handoff and fail the handoff on the error, which frees them unread: a
bad block is never decoded.
"""

from __future__ import annotations

import ctypes
import struct
import warnings
from collections.abc import Sequence
from functools import cache
from types import ModuleType

import torch

from kv_transfer.base import block_bytes, tensor_checksum
from kv_transfer.layout import KVChecksumError, block_checksum
from kv_transfer import native_build
from kv_transfer.native_build import NativeModule

_SOURCE = r"""
#include <nmmintrin.h>
#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#if !defined(__SSE4_2__) || !defined(__x86_64__)
#error "the fused CRC-32C copy needs x86-64 with SSE4.2"
#endif

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC-32C (Castagnoli), bit-reflected: bit 31 holds x^0
constexpr int64_t kMinLaneBytes = 4096;  // below three lanes of this, one lane

// a * b mod P
uint32_t mul_mod(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & (0x80000000u >> i)) product ^= b;  // a's x^i term
    b = (b & 1u) ? (b >> 1) ^ kPoly : b >> 1;  // b *= x
  }
  return product;
}

// x^(8 * num_bytes) mod P: a CRC register followed by num_bytes bytes of zeros is the register times this.
// Blocks come in few sizes, so the last few factors are kept.
uint32_t zeros_factor(int64_t num_bytes) {
  thread_local int64_t cached_bytes[4] = {-1, -1, -1, -1};
  thread_local uint32_t cached_factor[4] = {0, 0, 0, 0};
  thread_local int next = 0;
  for (int i = 0; i < 4; ++i) {
    if (cached_bytes[i] == num_bytes) return cached_factor[i];
  }
  uint32_t factor = 0x80000000u, power = 0x40000000u;  // x^0, x^1
  for (uint64_t e = static_cast<uint64_t>(num_bytes) * 8; e; e >>= 1) {
    if (e & 1) factor = mul_mod(factor, power);
    power = mul_mod(power, power);
  }
  cached_bytes[next] = num_bytes;
  cached_factor[next] = factor;
  next = (next + 1) % 4;
  return factor;
}

// The contiguous byte runs of a tensor, in its logical (row-major) order.
std::vector<std::pair<uint8_t*, int64_t>> runs(const at::Tensor& t) {
  std::vector<std::pair<uint8_t*, int64_t>> out;
  if (t.numel() == 0) return out;
  const int64_t elem = t.element_size();
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  int64_t run = elem, outer = t.dim();
  while (outer > 0 && (sizes[outer - 1] == 1 || strides[outer - 1] * elem == run)) {
    run *= sizes[outer - 1];
    --outer;
  }
  auto* base = static_cast<uint8_t*>(t.data_ptr());
  std::vector<int64_t> index(outer, 0);
  while (true) {
    int64_t offset = 0;
    for (int64_t d = 0; d < outer; ++d) offset += index[d] * strides[d];
    out.emplace_back(base + offset * elem, run);
    int64_t d = outer - 1;
    for (; d >= 0; --d) {
      if (++index[d] < sizes[d]) break;
      index[d] = 0;
    }
    if (d < 0) return out;
  }
}

struct Piece {  // a stretch contiguous in both source and destination
  const uint8_t* src;
  uint8_t* dst;
  int64_t len;
};

std::vector<Piece> pieces(const at::Tensor& dst, const at::Tensor& src) {
  const auto d = runs(dst), s = runs(src);
  std::vector<Piece> out;
  size_t i = 0, j = 0;
  int64_t di = 0, sj = 0;
  while (i < d.size() && j < s.size()) {
    const int64_t n = std::min(d[i].second - di, s[j].second - sj);
    out.push_back({s[j].first + sj, d[i].first + di, n});
    di += n;
    sj += n;
    if (di == d[i].second) { ++i; di = 0; }
    if (sj == s[j].second) { ++j; sj = 0; }
  }
  return out;
}

struct Cursor {  // a position in a piece list
  const Piece* piece;
  int64_t at;
  int64_t avail() const { return piece->len - at; }
  const uint8_t* src() const { return piece->src + at; }
  uint8_t* dst() const { return piece->dst + at; }
  void advance(int64_t n) {
    at += n;
    if (at == piece->len) { ++piece; at = 0; }
  }
};

Cursor seek(const std::vector<Piece>& ps, int64_t offset) {
  size_t i = 0;
  while (i < ps.size() && offset >= ps[i].len) offset -= ps[i++].len;
  return {ps.data() + i, offset};
}

uint64_t copy_crc_tail(const uint8_t* s, uint8_t* d, int64_t n, uint64_t r) {
  for (int64_t i = 0; i < n; ++i) {
    d[i] = s[i];
    r = _mm_crc32_u8(static_cast<uint32_t>(r), s[i]);
  }
  return r;
}

uint64_t copy_crc_1(const uint8_t* s, uint8_t* d, int64_t n, uint64_t r) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v;
    std::memcpy(&v, s + i, 8);
    std::memcpy(d + i, &v, 8);
    r = _mm_crc32_u64(r, v);
  }
  return copy_crc_tail(s + i, d + i, n - i, r);
}

void copy_crc_3(Cursor& c0, Cursor& c1, Cursor& c2, int64_t n, uint64_t r[3]) {
  const uint8_t *s0 = c0.src(), *s1 = c1.src(), *s2 = c2.src();
  uint8_t *d0 = c0.dst(), *d1 = c1.dst(), *d2 = c2.dst();
  uint64_t r0 = r[0], r1 = r[1], r2 = r[2];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t v0, v1, v2;
    std::memcpy(&v0, s0 + i, 8);
    std::memcpy(&v1, s1 + i, 8);
    std::memcpy(&v2, s2 + i, 8);
    std::memcpy(d0 + i, &v0, 8);
    std::memcpy(d1 + i, &v1, 8);
    std::memcpy(d2 + i, &v2, 8);
    r0 = _mm_crc32_u64(r0, v0);
    r1 = _mm_crc32_u64(r1, v1);
    r2 = _mm_crc32_u64(r2, v2);
  }
  r[0] = copy_crc_tail(s0 + i, d0 + i, n - i, r0);
  r[1] = copy_crc_tail(s1 + i, d1 + i, n - i, r1);
  r[2] = copy_crc_tail(s2 + i, d2 + i, n - i, r2);
  c0.advance(n);
  c1.advance(n);
  c2.advance(n);
}

// Copy every piece; return the CRC-32C of the source bytes, continuing from `crc`.
uint32_t copy_crc(const std::vector<Piece>& ps, uint32_t crc) {
  int64_t total = 0;
  for (const auto& p : ps) total += p.len;
  uint64_t r[3] = {static_cast<uint32_t>(~crc), 0, 0};
  const int64_t lane = (total / 3) & ~int64_t{7};
  if (lane < kMinLaneBytes) {
    for (const auto& p : ps) r[0] = copy_crc_1(p.src, p.dst, p.len, r[0]);
    return ~static_cast<uint32_t>(r[0]);
  }
  // lanes [0, lane), [lane, 2 lane), [2 lane, total), walked side by side
  Cursor c0 = seek(ps, 0), c1 = seek(ps, lane), c2 = seek(ps, 2 * lane);
  for (int64_t left = lane; left > 0;) {
    const int64_t n = std::min({left, c0.avail(), c1.avail(), c2.avail()});
    copy_crc_3(c0, c1, c2, n, r);
    left -= n;
  }
  for (int64_t left = total - 3 * lane; left > 0;) {
    const int64_t n = std::min(left, c2.avail());
    r[2] = copy_crc_1(c2.src(), c2.dst(), n, r[2]);
    c2.advance(n);
    left -= n;
  }
  // crc(A ‖ B) = crc(A) * x^(8|B|) + crc0(B), lanes 1 and 2 having started from a zero register
  uint32_t joined = mul_mod(static_cast<uint32_t>(r[0]), zeros_factor(lane)) ^ static_cast<uint32_t>(r[1]);
  joined = mul_mod(joined, zeros_factor(total - 2 * lane)) ^ static_cast<uint32_t>(r[2]);
  return ~joined;
}

void check_cpu(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be on the CPU");
}

}  // namespace

int64_t copy_crc32c(at::Tensor dst, at::Tensor src, int64_t crc) {
  check_cpu(dst, "dst");
  check_cpu(src, "src");
  TORCH_CHECK(dst.sizes() == src.sizes() && dst.scalar_type() == src.scalar_type(),
              "dst and src must have the same shape and dtype");
  const auto ps = pieces(dst, src);
  uint32_t out;
  {
    py::gil_scoped_release no_gil;
    out = copy_crc(ps, static_cast<uint32_t>(crc));
  }
  return out;
}

py::tuple frame_crc32c(py::bytes head, at::Tensor src, py::bytes tail, int64_t crc, bool append_crc) {
  check_cpu(src, "src");
  char *head_ptr, *tail_ptr;
  Py_ssize_t head_len, tail_len;
  if (PyBytes_AsStringAndSize(head.ptr(), &head_ptr, &head_len) ||
      PyBytes_AsStringAndSize(tail.ptr(), &tail_ptr, &tail_len))
    throw py::error_already_set();
  const int64_t data_len = src.numel() * src.element_size();
  PyObject* raw = PyBytes_FromStringAndSize(nullptr, head_len + data_len + tail_len + (append_crc ? 4 : 0));
  if (raw == nullptr) throw py::error_already_set();
  auto out = py::reinterpret_steal<py::bytes>(raw);
  char* p = PyBytes_AS_STRING(raw);
  std::memcpy(p, head_ptr, head_len);
  const auto dst = at::from_blob(p + head_len, src.sizes(), src.options());  // contiguous, inside `out`
  const auto ps = pieces(dst, src);
  uint32_t sum;
  {
    py::gil_scoped_release no_gil;  // `out` is ours alone until returned
    sum = copy_crc(ps, static_cast<uint32_t>(crc));
  }
  std::memcpy(p + head_len + data_len, tail_ptr, tail_len);
  if (append_crc) {
    for (int k = 0; k < 4; ++k) p[head_len + data_len + tail_len + k] = static_cast<char>((sum >> (8 * k)) & 0xFF);
  }
  return py::make_tuple(out, sum);
}
"""

NATIVE = NativeModule(name="block_copy", source=_SOURCE, functions=("copy_crc32c", "frame_crc32c"))

# `frame_blocks` writes a message into a `bytes` object it has just made (as the C++ `frame_crc32c` does): torch
# warns that a tensor over an immutable buffer must not be written; nobody else holds the object yet.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=__name__)
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize  # (NULL, n): n bytes, uninitialised
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_char_p, ctypes.c_ssize_t)


@cache
def native_ops() -> ModuleType | None:
    """The compiled functions, or None (see kv_transfer/native_build.py)."""
    return native_build.load(NATIVE)


def _both_on_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def host_copy_(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`, as one plain memcpy on this thread when both are contiguous CPU tensors of one dtype and
    size. torch's CPU copy of a block (~0.4 MB) runs on its intra-op thread pool, and in a worker whose peer
    copies at the same moment (a handoff's sender frames while its receiver checks) the two pools oversubscribe
    the cores: on the H200 host (16 cores, a pool of 16 in each of five worker processes) a 1,000-token gRPC
    handoff took ~450 ms in the workers against ~25 ms alone. A memcpy of a block takes microseconds and never waits
    on another thread."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype
            and dst.numel() == src.numel() and dst.is_contiguous() and src.is_contiguous()):
        if dst.numel():
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
        return
    dst.copy_(src)


def frame(head: bytes, block: torch.Tensor, tail: bytes, *, crc32c: int = 0, append_crc: bool = True,
          native: bool = True) -> tuple[bytes, int]:
    """`head ‖ block's bytes ‖ tail`, then (with `append_crc`) the CRC-32C of the block's bytes in 4 little-endian
    bytes, and that CRC; `crc32c` continues a CRC over earlier bytes (a block sent in several chunks). The block's
    bytes are its elements in logical order: a strided CPU view (a block of the paged cache) is gathered here.
    `native=False` forces the fallback (for tests)."""
    ops = native_ops() if native else None
    if ops is not None and _both_on_cpu(block):
        return ops.frame_crc32c(head, block, tail, crc32c, append_crc)
    data = block_bytes(block.contiguous())
    crc = block_checksum(data, crc32c)
    parts = [head, data, tail, crc.to_bytes(4, "little")] if append_crc else [head, data, tail]
    return b"".join(parts), crc


def as_bytes(block: torch.Tensor) -> torch.Tensor:
    """`block`'s bytes as a uint8 tensor, in its logical order, without a copy when its last dimension is contiguous
    (a block of the paged cache is): [..., last * element size]."""
    if block.dim() == 0 or block.stride(-1) != 1:
        block = block.contiguous()
    return block.view(torch.uint8)


def frame_blocks(head: bytes, blocks: Sequence[torch.Tensor], tail: bytes, *, native: bool = True
                 ) -> tuple[bytes, list[int]]:
    """`head ‖ each block's bytes ‖ tail ‖ each block's CRC-32C` (4 bytes little-endian each, in order) as one
    `bytes`, and the CRCs: a run of blocks in one gRPC message (kv_transfer.grpc_wire.run_frame). Each block (a CPU
    tensor: a strided view of the paged cache, or pinned staging) is copied straight into the new message, gathered
    and checksummed in one pass with native code, else copied and then checksummed there. `native=False` forces
    the fallback (for tests)."""
    ops = native_ops() if native else None
    sources = [as_bytes(block) for block in blocks]
    data_len = sum(src.numel() for src in sources)
    out = _new_bytes(None, len(head) + data_len + len(tail) + 4 * len(sources))
    message = torch.frombuffer(out, dtype=torch.uint8)  # writable in fact: `out` is ours alone until returned
    base = message.data_ptr()
    ctypes.memmove(base, head, len(head))
    pos, crcs = len(head), []
    for src in sources:
        if src.device.type != "cpu":
            raise ValueError("frame_blocks frames host blocks (stage device blocks in host memory first)")
        dst = message[pos:pos + src.numel()].view(src.shape)
        if ops is not None:
            crcs.append(ops.copy_crc32c(dst, src, 0))
        else:
            host_copy_(dst, src)
            crcs.append(block_checksum(memoryview(dst.view(-1).numpy())))
        pos += src.numel()
    ctypes.memmove(base + pos, tail, len(tail))
    ctypes.memmove(base + pos + len(tail), struct.pack(f"<{len(crcs)}I", *crcs), 4 * len(crcs))
    return out, crcs


def gather(block: torch.Tensor, *, native: bool = True) -> tuple[torch.Tensor, int]:
    """A contiguous copy of `block` (a strided view of the paged cache) and the CRC-32C of its bytes, in one pass on
    the CPU; elsewhere (a GPU block, no native code) `block.contiguous()` and then its checksum."""
    if native and native_ops() is not None and _both_on_cpu(block):
        out = torch.empty(block.shape, dtype=block.dtype)
        return out, gather_into(out, block)
    out = block.contiguous()
    return out, tensor_checksum(out)


def gather_into(out: torch.Tensor, block: torch.Tensor, *, native: bool = True) -> int:
    """Copy `block` (a strided view) into `out` (contiguous, same shape and dtype) and return the CRC-32C of its
    bytes: one pass on the CPU, else a copy and then a checksum of `out` (through the host for a GPU tensor)."""
    ops = native_ops() if native else None
    if ops is not None and _both_on_cpu(out, block):
        return ops.copy_crc32c(out, block, 0)
    host_copy_(out, block)
    return tensor_checksum(out)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, crc32c: int | None, *, native: bool = True) -> None:
    """`dst.copy_(src)`; when `crc32c` is given, raise KVChecksumError unless the CRC-32C of src's bytes equals it.
    Fused (CPU tensors of one dtype and shape), the check comes after the write; otherwise before it. `src` may be
    read-only (a view into a received message): it is only read."""
    if crc32c is None:
        host_copy_(dst, src)
        return
    ops = native_ops() if native else None
    if ops is not None and _both_on_cpu(dst, src) and dst.dtype == src.dtype and dst.shape == src.shape:
        computed = ops.copy_crc32c(dst, src, 0)
    else:
        computed = tensor_checksum(src.contiguous())
        if computed == crc32c:
            host_copy_(dst, src)
    if computed != crc32c:
        raise KVChecksumError(f"CRC-32C {computed:#010x} where the sender's was {crc32c:#010x}")


def copy_checked_parts(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], crc32c: int | None, *,
                       native: bool = True) -> None:
    """`copy_checked` over several (dst, src) pairs whose sources, in order, are one block's bytes (an int8 block's
    values, then its scales): one CRC-32C covers them all. Fused (every pair on the CPU, of one dtype and shape),
    the check comes after the writes; otherwise before them."""
    if crc32c is None:
        for dst, src in pairs:
            host_copy_(dst, src)
        return
    ops = native_ops() if native else None
    computed = 0
    if ops is not None and all(_both_on_cpu(d, s) and d.dtype == s.dtype and d.shape == s.shape for d, s in pairs):
        for dst, src in pairs:
            computed = ops.copy_crc32c(dst, src, computed)
    else:
        for _, src in pairs:
            computed = block_checksum(block_bytes(src.contiguous()), computed)
        if computed == crc32c:
            for dst, src in pairs:
                host_copy_(dst, src)
    if computed != crc32c:
        raise KVChecksumError(f"CRC-32C {computed:#010x} where the sender's was {crc32c:#010x}")
