"""Why a request whose finish reason is "stop" stopped, as vLLM reports it. Torch-free.

    int    the stop token id (one of `stop_token_ids`) it sampled
    str    the stop string its text matched
    None   EOS, or a finish other than "stop"

On the wire it is a `StopReason` message whose oneof keeps the two kinds apart (engine/request/wire.py), so a
stop string "7" never reads back as stop token 7.
"""

from __future__ import annotations

from typing import TypeAlias

StopReason: TypeAlias = int | str | None
