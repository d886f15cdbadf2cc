"""The block allocator: reference counts, an O(1) free list kept in eviction
order, and the prefix index (block content key -> cached block).

A freed block keeps its content key until it is reused, so a later request
with the same prefix can take it back from the free list (a prefix-cache hit).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

BlockKey = tuple[int, tuple[int, ...]]  # (hash of the previous block's key, this block's token ids)


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # free blocks, least recently freed first (evicted first)
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._index: dict[BlockKey, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, key: BlockKey) -> KVBlock | None:
        return self._index.get(key)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` free blocks (evicting cached content); caller checked the count."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                del self._index[block.key]
                block.key = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix index."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop a reference; blocks are given in the order they should be evicted."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(self, block: KVBlock, key: BlockKey) -> None:
        """Record a full block's content so later prompts can reuse it."""
        if block.key is None and key not in self._index:
            block.key = key
            self._index[key] = block

    def evictable_among(self, blocks: list[KVBlock]) -> int:
        return sum(1 for b in blocks if b.ref_cnt == 0)
