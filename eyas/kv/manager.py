"""Per-request block tables, one per KV-cache group, and prefix-cache lookups.

A KV-cache group is a set of layers that share one block table (today: all the target's
full-attention layers; drafters and cache-only layers add groups of their own). Each group
has its own block pool, so a request holds one block table per group.
"""

from __future__ import annotations

from dataclasses import dataclass

from eyas.kv.block_pool import BlockPool, block_keys


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers sharing one block table; ``bytes_per_token`` sums K and V over those layers."""

    name: str
    layer_names: tuple[str, ...]
    bytes_per_token: int


class KVCacheManager:
    def __init__(self, groups: list[KVCacheGroupSpec], num_blocks: int, block_size: int,
                 enable_prefix_caching: bool):
        self.groups = groups
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [BlockPool(num_blocks, enable_prefix_caching) for _ in groups]
        self.tables: dict[str, list[list[int]]] = {}  # request id -> block table per group
        self.num_registered: dict[str, int] = {}  # request id -> full blocks already in the prefix cache

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def lookup_prefix(self, request_id: str, token_ids: list[int]) -> int:
        """Take shared blocks for the longest cached prefix; returns the number of tokens it covers.

        At least one token is left to compute so the step has logits to sample from.
        """
        table = self.tables.setdefault(request_id, [[] for _ in self.groups])
        assert not any(table), "prefix lookup happens before any allocation"
        if not self.enable_prefix_caching:
            return 0
        keys = block_keys(token_ids, self.block_size, (len(token_ids) - 1) // self.block_size)
        hits = None
        for pool in self.pools:
            found = 0
            for key in keys[: hits if hits is not None else len(keys)]:
                if pool.lookup(key) is None:
                    break
                found += 1
            hits = found
        for pool, group_table in zip(self.pools, table):
            for key in keys[:hits]:
                block = pool.lookup(key)
                pool.take(block)
                group_table.append(block)
        self.num_registered[request_id] = hits
        return hits * self.block_size

    def allocate(self, request_id: str, num_tokens: int) -> bool:
        """Make room for the request's first ``num_tokens`` tokens in every group; False if it cannot."""
        table = self.tables.setdefault(request_id, [[] for _ in self.groups])
        needed = self.blocks_needed(num_tokens)
        if any(needed - len(t) > pool.num_free for pool, t in zip(self.pools, table)):
            return False
        for pool, group_table in zip(self.pools, table):
            if needed > len(group_table):
                group_table.extend(pool.allocate(needed - len(group_table)))
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Free the blocks past the first ``num_tokens`` tokens (slots of rejected drafts)."""
        keep = self.blocks_needed(num_tokens)
        for pool, group_table in zip(self.pools, self.tables[request_id]):
            if len(group_table) > keep:
                pool.release(group_table[keep:][::-1])
                del group_table[keep:]

    def register_full_blocks(self, request_id: str, token_ids: list[int], num_computed: int) -> None:
        """Publish the request's newly completed blocks (committed tokens only) to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        done = self.num_registered.get(request_id, 0)
        full = num_computed // self.block_size
        if full <= done:
            return
        keys = block_keys(token_ids, self.block_size, full)
        for pool, group_table in zip(self.pools, self.tables[request_id]):
            for i in range(done, full):
                pool.register(group_table[i], keys[i])
        self.num_registered[request_id] = full

    def free(self, request_id: str) -> list[list[int]] | None:
        """Release the request's blocks; returns its block tables (contents stay until blocks are reused)."""
        table = self.tables.pop(request_id, None)
        self.num_registered.pop(request_id, None)
        if table is not None:
            for pool, group_table in zip(self.pools, table):
                pool.release(group_table[::-1])
        return table

    def block_tables(self, request_id: str) -> list[list[int]]:
        return self.tables[request_id]

    @property
    def num_free_blocks(self) -> int:
        return min(pool.num_free for pool in self.pools)
