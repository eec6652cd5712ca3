"""Which replica of a model takes a request (`device: [GPU.0, GPU.1]`): session affinity, bounded by load.

A policy, pure: `choose` reads what each replica is now (ready or not, its load, how much of this request's prefix
it holds) and names one; the Supervisor (appliance.front.supervisor) gathers the views, carries the choice out and
keeps each replica's AffinityMemory. Rules, in order:
- a replica that is not ready gets nothing (None when none is);
- the ready replica holding the longest part of this request's prefix takes it, unless more than `max_queue`
  requests already wait for it (a conversation is not worth a queue: its prefill elsewhere costs less than waiting),
  or its load is more than `max_queue` over the least loaded one's (a prefix every request shares, a chat UI's
  system prompt, is held first by whichever replica took the first request: without this bound that replica took
  every new conversation while the others idled, until a queue formed behind its whole batch);
- else the least loaded (running plus waiting), ties taken in turn.
`round_robin` (the bench's baseline) takes the ready replicas in turn, blind to prefixes and load.

Which hashing: the front's own hash of the request's prefix, in blocks of one message (a chat message, a Responses
input item; the system prompt, instructions and tools as the first block), chained, so that block i's hash covers
blocks 0..i. Not the worker's token-block hashes: the front never renders or tokenizes a prompt (the worker's chat
template does, appliance.worker.prompt), and asking a worker for its blocks would put a round trip before every
dispatch. A conversation's next turn repeats its earlier messages verbatim, so a message chain finds the replica
whose KV cache holds that conversation as well as token blocks would; each block weighs its characters, so a long
shared prefix outweighs a short one. A plain prompt (completions) is cut into blocks of BLOCK_CHARS characters.
"""

from __future__ import annotations

import collections
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Sequence

BLOCK_CHARS = 1024
# Prefix hashes a replica remembers, least recently used forgotten first: a few hundred conversations of tens of
# turns, far beyond what its KV cache keeps (its own LRU evicts blocks long before these are forgotten).
MEMORY_HASHES = 8192
# The request fields that come before the messages in every turn of a conversation (its first block).
HEAD_FIELDS = ("system", "instructions", "tools")
# The request fields that hold its messages, in the order a route family names them.
MESSAGE_FIELDS = ("messages", "input", "prompt")

Chain = list[tuple[bytes, int]]  # per block: the hash of the prefix through it, and the characters through it


def _canonical(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str).encode()


def _blocks(body: Any) -> list[bytes]:
    if not isinstance(body, dict):
        return []
    head = {key: body[key] for key in HEAD_FIELDS if body.get(key)}
    blocks = [_canonical(head)] if head else []
    for key in MESSAGE_FIELDS:
        value = body.get(key)
        if isinstance(value, list):
            blocks += [_canonical(item) for item in value]
        elif isinstance(value, str):
            text = value.encode()
            blocks += [text[i:i + BLOCK_CHARS] for i in range(0, len(text), BLOCK_CHARS)]
    return blocks


def prefix_chain(body: Any) -> Chain:
    """The request body's prefix hashes, block by block (empty: nothing to hash)."""
    digest, chain, size = hashlib.blake2b(digest_size=16), [], 0
    for block in _blocks(body):
        digest.update(len(block).to_bytes(8, "little"))  # block boundaries are part of the prefix
        digest.update(block)
        size += len(block)
        chain.append((digest.copy().digest(), size))
    return chain


class AffinityMemory:
    """The prefixes one replica's worker has been sent, least recently used forgotten first."""

    def __init__(self, size: int = MEMORY_HASHES):
        self.size = size
        self.hashes: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def remember(self, chain: Chain) -> None:
        for digest, _ in chain:
            self.hashes[digest] = None
            self.hashes.move_to_end(digest)
        while len(self.hashes) > self.size:
            self.hashes.popitem(last=False)

    def matched(self, chain: Chain) -> int:
        """Characters of the longest prefix of `chain` this replica was sent (0: none)."""
        return next((size for digest, size in reversed(chain) if digest in self.hashes), 0)


@dataclass(frozen=True)
class ReplicaView:
    key: str
    ready: bool
    running: int = 0
    waiting: int = 0  # queued in the front, or holding a reserved place
    matched: int = 0  # characters of this request's prefix it holds

    @property
    def load(self) -> int:
        return self.running + self.waiting


def choose(replicas: Sequence[ReplicaView], max_queue: int, turn: int = 0, round_robin: bool = False) -> str | None:
    """The key of the replica that takes the request, or None when none is ready. `turn`: a counter the caller
    advances per request, which breaks ties (and is round robin's whole rule)."""
    ready = [view for view in replicas if view.ready]
    if not ready:
        return None
    if round_robin:
        return ready[turn % len(ready)].key
    affine = max(ready, key=lambda view: (view.matched, -view.load))
    least = min(view.load for view in ready)
    if affine.matched > 0 and affine.waiting <= max_queue and affine.load - least <= max_queue:
        return affine.key
    ties = [view for view in ready if view.load == least]
    return ties[turn % len(ties)].key
