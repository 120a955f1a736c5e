"""A pool of fixed-size KV blocks with reference counts and a prefix cache over full blocks.

Block 0 is the null block: padding tokens write into its slots and it is never handed out.
Freed blocks keep their contents and hash until reused, so a later request with the same
prefix can take them back (least recently freed blocks are reused first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

NULL_BLOCK = 0


@dataclass
class CachedKey:
    """Identity of a full block: hash of (parent hash, its tokens), plus the tokens to rule out collisions."""

    hash: int
    tokens: tuple[int, ...]


def block_keys(token_ids: list[int], block_size: int, num_blocks: int, salt: int = 0) -> list[CachedKey]:
    """Hash chain over the first ``num_blocks`` full blocks of ``token_ids``.

    Example (block_size 2): tokens [5, 6, 7, 8, 9] -> keys for (5, 6) and (7, 8); the
    second key hashes the first's hash, so equal blocks after different prefixes differ.
    """
    keys, parent = [], salt
    for i in range(num_blocks):
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        parent = hash((parent, tokens))
        keys.append(CachedKey(parent, tokens))
    return keys


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.keys: list[CachedKey | None] = [None] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self.cached: dict[int, int] = {}  # key hash -> block id

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        assert count <= len(self.free), "caller checks num_free first"
        blocks = []
        for _ in range(count):
            block, _ = self.free.popitem(last=False)
            key = self.keys[block]
            if key is not None:  # evict its cached contents
                del self.cached[key.hash]
                self.keys[block] = None
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def lookup(self, key: CachedKey) -> int | None:
        block = self.cached.get(key.hash)
        if block is None or self.keys[block].tokens != key.tokens:
            return None
        return block

    def take(self, block: int) -> None:
        """Share a cached block with one more request."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def register(self, block: int, key: CachedKey) -> None:
        if self.enable_prefix_caching and self.keys[block] is None and key.hash not in self.cached:
            self.keys[block] = key
            self.cached[key.hash] = block

    def release(self, blocks: list[int]) -> None:
        """Drop one reference from each block; pass tail blocks first so they are reused first."""
        for block in blocks:
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0
            if self.ref_counts[block] == 0:
                self.free[block] = None
                if self.keys[block] is None:  # nothing worth keeping: reuse it first
                    self.free.move_to_end(block, last=False)
