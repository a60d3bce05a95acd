"""Tensor parallelism inside one engine: a TP-N engine is N rank processes behind one control plane.

    rank 0 (the engine's own process)                    ranks 1..N-1 (spawned children, die with rank 0)
    scheduler, prefix cache, engine loop, sampling       ─
    its shard of the weights and of the KV cache         its shard of the weights and of the KV cache
    each step: broadcast the step's inputs ────────────▶ run the same forward over its shard
               forward over its shard  ◀── all-reduces, the logits gathered on rank 0 ──▶

Modules: `tp_sizes` (which sizes a model takes, each rank's head and vocabulary ranges; torch-free), `group` (the
process group under the model's `TPGroup`, engine/model/tp_group.py), `sharding` (a rank's slice of the HF
weights), `shared_weights` (a shard handed to a child in shared memory), `step_message` (what rank 0 sends each
step), `rank_worker` (a child's loop), `rank_group` (rank 0's handle on its children: spawn, handshake, liveness,
shutdown), `tp_model` (the model rank 0's runner drives). Nothing heavy is imported here.
"""
