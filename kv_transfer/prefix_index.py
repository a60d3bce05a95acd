"""The cluster-wide prefix index in Redis: which worker holds which KV blocks. The one module that owns its keys.

Workers write it (`worker/kv_event_publisher.py`, from their KV events); the router reads it
(`router/prefix_index_client.py`) and writes short-lived provisional entries for its routing decisions. Both sides
import this module: it needs the `redis` client only, never torch.

Key schema (standalone Redis; every key of one namespace starts with the same prefix):

    P = "splitserve:pi:v1:" + namespace root (32 hex chars: model identity, block size, KV dtype)

    P:meta               HASH  model, block_size, kv_dtype                     what the namespace is, for operators
    P:workers            HASH  worker_id -> "incarnation role seq"             publishers, the last batch applied
    P:w:<worker_id>      SET   block hashes (hex) the worker holds             for purges and stats
    P:wt:<worker_id>     HASH  block hash (hex) -> tier                        the worker's blocks that are below its
                                                                               device ("disk" | "host"); a held block
                                                                               not listed is on the device
    P:wtn:<worker_id>    HASH  tier -> number of blocks                        P:wt's sizes per tier, for stats
    P:b:<hash>           HASH  worker_id -> incarnation                        the holders of one block
    P:pv:<hash>          HASH  worker_id -> incarnation, key TTL ~seconds      provisional: a routing decision that
                                                                               events have not confirmed yet

A batch (one engine step's events) is applied atomically by one Lua script, `APPLY`:

    stored incarnation >  batch's       "stale"     an old incarnation's late batch: ignored
    stored incarnation <  batch's, or none:  a new start: the worker's old entries are purged; the batch must be a
                                        reset (a snapshot, or the first batch of a fresh cache) or the answer is
                                        "gap" and nothing else is applied
    same incarnation, reset             purge, apply                                                   "ok"
    same incarnation, seq = last + 1    apply                                                          "ok"
    same incarnation, any other seq     nothing applied                                                "gap"

On "gap" (or after Redis was unreachable) the worker republishes a full snapshot of its cache as a reset batch.
A block's holders and a worker's set are one fact written twice; the script keeps them in step. Block keys carry a
TTL (`BLOCK_TTL_S`, refreshed on every store) only as a safety net against entries nobody purges.

Tiers (kv_transfer/kv_events.py): "held" is the union of the worker's device cache and its KV offload tier, as it
always was: P:b, P:w and a lookup's leading-blocks count mean the same with or without tiers. Where each held block
is lives beside it, per worker: a store with a tier other than "device" sets the block's field in P:wt, a store on
the device (or a removal) deletes it, and P:wtn counts P:wt's fields per tier in the same script. So a block the
device evicts into its tier is stored again with the tier's name, and one loaded back is stored again on the device.
The keys are additive: a reader that knows nothing of tiers (an older gateway) sees the union as before, and an
index written by workers that send no tiers has every block on the device. Provisional entries are on the device
(the worker a request went to computes or loads its blocks there).

A lookup (`LOOKUP`) takes a request's chained block hashes and answers, in one round trip, per worker the number
of leading blocks it holds, and the tiers those blocks are on (runs in chain order: `HeldPrefix`): the walk stops
at the first block no remaining worker holds, and a worker drops out at the first block it lacks. An entry counts
only if its incarnation is the worker's registered one, so a restarted worker's old entries never count even before
they are purged. Provisional entries count like confirmed ones: two requests sharing a prefix that arrive before
any event still go to the same worker, from any gateway.

Purges: a worker's new incarnation purges its old entries (its first batch is a reset); the controller purges a
worker it declares dead (`purge_worker`); AllBlocksCleared empties the worker's entries (its tiers' keys with them).

The scripts walk keys they compute (not passed in KEYS), so the index wants a standalone Redis (or one Redis
Cluster slot per namespace), not a sharded cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kv_transfer.block_hash import BlockHash, BlockHashNamespace
from kv_transfer.kv_events import DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

KEY_VERSION = "v1"
BLOCK_TTL_S = 24 * 3600  # safety net only: entries are removed by events and purges
PROVISIONAL_TTL_S = 10.0  # a routing decision's entries live this long unless events confirm them sooner

# Batch answers of APPLY.
OK, GAP, STALE = "ok", "gap", "stale"

# Op markers inside a batch's argument list: the hashes after a marker are stored (on the device; "+<tier>": on that
# tier) / removed; CLEAR empties. Hashes are hex, so no marker is ever a hash.
_STORED, _REMOVED, _CLEAR = "+", "-", "!"


def key_prefix(namespace: BlockHashNamespace) -> str:
    return f"splitserve:pi:{KEY_VERSION}:{namespace.root.hex()}"


def workers_key(prefix: str) -> str:
    return f"{prefix}:workers"


def worker_blocks_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:w:{worker_id}"


def worker_tiers_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:wt:{worker_id}"


def worker_tier_counts_key(prefix: str, worker_id: str) -> str:
    return f"{prefix}:wtn:{worker_id}"


def block_key(prefix: str, block_hash: BlockHash) -> str:
    return f"{prefix}:b:{block_hash.hex()}"


def provisional_key(prefix: str, block_hash: BlockHash) -> str:
    return f"{prefix}:pv:{block_hash.hex()}"


def meta_key(prefix: str) -> str:
    return f"{prefix}:meta"


@dataclass(frozen=True, kw_only=True)
class PublisherId:
    """Who publishes a batch: a worker, in one incarnation (a restarted worker keeps its id, not its incarnation)."""

    worker_id: str
    incarnation: int
    role: str


@dataclass(frozen=True, kw_only=True)
class EventBatch:
    """One step's KV events of one worker, in order. `reset`: the worker's entries are replaced by this batch
    (a snapshot, or the first batch of a fresh cache). `seq` counts batches within the incarnation, from 1."""

    publisher: PublisherId
    seq: int
    events: tuple[KVEvent, ...]
    reset: bool = False


def encode_ops(events: Iterable[KVEvent]) -> list[str]:
    """The batch's events as APPLY's op list: markers and hex hashes, in event order."""
    ops: list[str] = []
    for event in events:
        if isinstance(event, AllBlocksCleared):
            ops.append(_CLEAR)
        elif isinstance(event, BlockStored):
            ops.append(_STORED if event.tier == DEVICE else _STORED + event.tier)
            ops.extend(h.hex() for h in event.block_hashes)
        elif isinstance(event, BlockRemoved):
            ops.append(_REMOVED)
            ops.extend(h.hex() for h in event.block_hashes)
        else:
            raise TypeError(f"not a KV event: {event!r}")
    return ops


def apply_args(prefix: str, batch: EventBatch) -> list[str | int]:
    p = batch.publisher
    return [prefix, p.worker_id, p.incarnation, p.role, batch.seq, int(batch.reset), BLOCK_TTL_S,
            *encode_ops(batch.events)]


def lookup_args(prefix: str, block_hashes: Sequence[BlockHash]) -> list[str]:
    return [prefix, *(h.hex() for h in block_hashes)]


@dataclass(frozen=True)
class HeldPrefix:
    """One worker's leading blocks of a looked-up prompt and the tiers they are on: `runs` in chain order, (tier,
    number of blocks), no two neighbours on the same tier.

        block    0       1       2       3     4     5
        tier     device  device  device  disk  disk  device     runs = (("device", 3), ("disk", 2), ("device", 1))
        device_reach(0) = 3, device_reach(3) = 3 (block 3 is not on the device), device_reach(5) = 6
    """

    runs: tuple[tuple[str, int], ...]

    @property
    def num_blocks(self) -> int:
        """The leading blocks held, on any tier (the lookup's overlap)."""
        return sum(n for _, n in self.runs)

    def by_tier(self) -> dict[str, int]:
        """How many of the leading blocks are on each tier."""
        out: dict[str, int] = {}
        for tier, n in self.runs:
            out[tier] = out.get(tier, 0) + n
        return out

    def device_reach(self, start: int) -> int:
        """The end of the run of device blocks from block `start`: blocks [start, end) are all on the device (end =
        start when block `start` is not on the device, or not held)."""
        first = 0
        for tier, n in self.runs:
            if start < first + n:
                return first + n if tier == DEVICE else start  # runs alternate: the next one is not the device
            first += n
        return start


def parse_held(reply: Sequence) -> dict[tuple[str, int], HeldPrefix]:
    """LOOKUP's reply [worker_id, incarnation, num_blocks, [tier, blocks, tier, blocks, ...]] repeated, as
    {(worker_id, incarnation): its leading blocks by tier}."""
    out: dict[tuple[str, int], HeldPrefix] = {}
    for i in range(0, len(reply), 4):
        flat = reply[i + 3]
        runs = tuple((_text(flat[j]), int(flat[j + 1])) for j in range(0, len(flat), 2))
        out[(_text(reply[i]), int(reply[i + 1]))] = HeldPrefix(runs)
    return out


def parse_lookup(reply: Sequence) -> dict[tuple[str, int], int]:
    """LOOKUP's reply as {(worker_id, incarnation): leading blocks held, on any tier}."""
    return {key: int(reply[i + 2]) for i, key in zip(range(0, len(reply), 4), parse_held(reply), strict=True)}


def _text(value: bytes | str | int) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_workers(reply: dict[bytes | str, bytes | str]) -> dict[str, tuple[int, str, int]]:
    """P:workers as {worker_id: (incarnation, role, seq)}."""
    out: dict[str, tuple[int, str, int]] = {}
    for worker_id, value in reply.items():
        wid = worker_id.decode() if isinstance(worker_id, bytes) else worker_id
        text = value.decode() if isinstance(value, bytes) else value
        incarnation, role, seq = text.split(" ")
        out[wid] = (int(incarnation), role, int(seq))
    return out


# Purges one worker's entries: its blocks' holder fields, its block set and tiers (its registration: the caller).
_PURGE_FN = """
local function purge(prefix, wid)
  local wkey = prefix .. ':w:' .. wid
  local hashes = redis.call('SMEMBERS', wkey)
  for _, h in ipairs(hashes) do
    redis.call('HDEL', prefix .. ':b:' .. h, wid)
  end
  redis.call('DEL', wkey, prefix .. ':wt:' .. wid, prefix .. ':wtn:' .. wid)
  return #hashes
end
"""

# ARGV: prefix, worker_id, incarnation, role, seq, reset (0/1), block ttl s, ops...
APPLY = _PURGE_FN + """
local prefix, wid = ARGV[1], ARGV[2]
local inc_s, role, seq_s, reset, ttl = ARGV[3], ARGV[4], ARGV[5], ARGV[6] == '1', tonumber(ARGV[7])
local inc, seq = tonumber(inc_s), tonumber(seq_s)  -- compared as numbers (exact below 2^53), stored as given
local wkey, tkey, nkey = prefix .. ':w:' .. wid, prefix .. ':wt:' .. wid, prefix .. ':wtn:' .. wid
-- Block h is now on `tier` (false: on the device, or gone): P:wt and its counts in P:wtn follow.
local function set_tier(h, tier)
  local old = redis.call('HGET', tkey, h)
  if old == tier then return end
  if old then
    redis.call('HDEL', tkey, h)
    redis.call('HINCRBY', nkey, old, -1)
  end
  if tier then
    redis.call('HSET', tkey, h, tier)
    redis.call('HINCRBY', nkey, tier, 1)
  end
end
local cur = redis.call('HGET', prefix .. ':workers', wid)
if cur then
  local cur_inc, cur_seq = string.match(cur, '^(%d+) %S+ (%d+)$')
  cur_inc, cur_seq = tonumber(cur_inc), tonumber(cur_seq)
  if cur_inc > inc then return 'stale' end
  if cur_inc < inc then
    purge(prefix, wid)
    redis.call('HDEL', prefix .. ':workers', wid)
    if not reset then return 'gap' end
  elseif reset then
    purge(prefix, wid)
  elseif seq ~= cur_seq + 1 then
    return 'gap'
  end
elseif not reset then
  return 'gap'
end
local mode, tier = '+', false
for i = 8, #ARGV do
  local a = ARGV[i]
  local op = string.sub(a, 1, 1)
  if op == '+' then
    mode, tier = '+', #a > 1 and string.sub(a, 2) or false
  elseif op == '-' then
    mode = '-'
  elseif op == '!' then
    purge(prefix, wid)
  elseif mode == '+' then
    local bkey = prefix .. ':b:' .. a
    redis.call('HSET', bkey, wid, inc_s)
    redis.call('EXPIRE', bkey, ttl)
    redis.call('SADD', wkey, a)
    set_tier(a, tier)
  else
    redis.call('HDEL', prefix .. ':b:' .. a, wid)
    redis.call('SREM', wkey, a)
    set_tier(a, false)
  end
end
redis.call('HSET', prefix .. ':workers', wid, inc_s .. ' ' .. role .. ' ' .. seq_s)
return 'ok'
"""

# ARGV: prefix, worker_id. Returns the number of blocks the worker was listed for.
PURGE = _PURGE_FN + """
local n = purge(ARGV[1], ARGV[2])
redis.call('HDEL', ARGV[1] .. ':workers', ARGV[2])
return n
"""

# ARGV: prefix, hashes... (chain order). Returns, per worker: worker_id, incarnation, leading blocks held, and
# {tier, blocks, tier, blocks, ...}: those blocks' tiers as runs in chain order (provisional entries: the device).
LOOKUP = """
local prefix = ARGV[1]
local registered = {}
local flat = redis.call('HGETALL', prefix .. ':workers')
for i = 1, #flat, 2 do
  registered[flat[i]] = tonumber(string.match(flat[i + 1], '^(%d+)'))
end
local alive, counts, order, runs = nil, {}, {}, {}
for i = 2, #ARGV do
  local now, tiers = {}, {}
  local found = false
  for _, kind in ipairs({':b:', ':pv:'}) do
    local holders = redis.call('HGETALL', prefix .. kind .. ARGV[i])
    for j = 1, #holders, 2 do
      local wid, inc = holders[j], tonumber(holders[j + 1])
      local known = registered[wid] == inc or (kind == ':pv:' and registered[wid] == nil)
      if known and (alive == nil or alive[wid]) and not now[wid] then
        now[wid] = inc
        tiers[wid] = (kind == ':b:' and redis.call('HGET', prefix .. ':wt:' .. wid, ARGV[i])) or 'device'
        found = true
      end
    end
  end
  if not found then break end
  for wid, inc in pairs(now) do
    if counts[wid] == nil then
      table.insert(order, wid)
      runs[wid] = {}
    end
    counts[wid] = {inc, i - 1}
    local r = runs[wid]
    if #r > 0 and r[#r - 1] == tiers[wid] then
      r[#r] = r[#r] + 1
    else
      table.insert(r, tiers[wid])
      table.insert(r, 1)
    end
  end
  alive = now
end
local out = {}
for _, wid in ipairs(order) do
  table.insert(out, wid)
  table.insert(out, counts[wid][1])
  table.insert(out, counts[wid][2])
  table.insert(out, runs[wid])
end
return out
"""

# ARGV: prefix, worker_id, incarnation, ttl ms, hashes... Marks the blocks provisionally held by the worker.
PROVISIONAL = """
local prefix, wid, inc, ttl = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
for i = 5, #ARGV do
  local key = prefix .. ':pv:' .. ARGV[i]
  redis.call('HSET', key, wid, inc)
  redis.call('PEXPIRE', key, ttl)
end
return #ARGV - 4
"""


def provisional_args(prefix: str, worker_id: str, incarnation: int, block_hashes: Sequence[BlockHash],
                     ttl_s: float = PROVISIONAL_TTL_S) -> list[str | int]:
    return [prefix, worker_id, incarnation, max(1, int(ttl_s * 1000)), *(h.hex() for h in block_hashes)]


def purge_worker_everywhere(client: Any, worker_id: str) -> int:
    """Purge `worker_id`'s entries in every namespace of the index (the controller, which knows a worker but not
    the model identity it hashed with, when it declares the worker dead). `client`: a sync `redis.Redis`.
    Returns the number of block entries removed."""
    removed = 0
    for key in client.scan_iter(match=f"splitserve:pi:{KEY_VERSION}:*:workers"):
        prefix = (key.decode() if isinstance(key, bytes) else key).removesuffix(":workers")
        removed += int(client.eval(PURGE, 0, prefix, worker_id))
    return removed


def meta_mapping(namespace: BlockHashNamespace) -> dict[str, str]:
    return {"model": namespace.model, "block_size": str(namespace.block_size), "kv_dtype": namespace.kv_dtype}
