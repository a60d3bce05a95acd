"""A process that loads a tiny C++ extension through kv_transfer.native_build, for the tests that kill builders
and run two at once. `python -m tests.kv_transfer.native_peer` (cache: $SPLITSERVE_KERNEL_CACHE) prints one JSON
line: the module's KernelStatus and what its function returned."""

from __future__ import annotations

import dataclasses
import json

from kv_transfer import native_build

TINY = native_build.NativeModule(
    name="peer_answer",
    source="int64_t answer() { return 42; }\n",
    functions=("answer",),
)


def main() -> None:
    extension = native_build.load(TINY)
    (status,) = native_build.statuses()
    print(json.dumps({**dataclasses.asdict(status), "answer": extension.answer() if extension else None}), flush=True)


if __name__ == "__main__":
    main()
