"""Per-request block tables over the BlockPool, with prefix matching.

The scheduler sees only: how many prompt tokens are already cached, whether
slots for N more tokens could be allocated, and the block ids of a request.
"""
from __future__ import annotations

from treadle.core.block_pool import BlockKey, BlockPool, KVBlock
from treadle.core.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks: dict[str, list[KVBlock]] = {}
        self._keys: dict[str, list[BlockKey]] = {}  # keys of the request's full, computed blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def match_prefix(self, request: Request) -> list[KVBlock]:
        """Cached blocks holding a prefix of the request's tokens. At least one
        token is always left to compute, so the step yields logits to sample. None for a
        request that asks for prompt logprobs: every prompt position must be computed."""
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return []
        tokens = request.all_token_ids
        bs = self.block_size
        hits: list[KVBlock] = []
        parent = 0
        for i in range((len(tokens) - 1) // bs):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
            parent = hash(key)
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, cached: list[KVBlock] | None = None) -> bool:
        """Make room for ``num_new_tokens`` after the computed (and cached) ones.
        Returns False, changing nothing, when the pool is too small right now."""
        cached = cached or []
        blocks = self._blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + len(cached) * self.block_size + num_new_tokens
        need = self.blocks_needed(total) - len(blocks) - len(cached)
        if need > self.pool.num_free_blocks - self.pool.evictable_among(cached):
            if not blocks:
                del self._blocks[request.request_id]
            return False
        if cached:
            self.pool.touch(cached)
            blocks.extend(cached)
            self._keys[request.request_id] = [b.key for b in cached if b.key is not None]
        if need > 0:
            blocks.extend(self.pool.allocate(need))
        return True

    def cache_computed_blocks(self, request: Request) -> None:
        """Index every full block whose tokens are all computed."""
        if not self.enable_prefix_caching:
            return
        keys = self._keys.setdefault(request.request_id, [])
        blocks = self._blocks.get(request.request_id, [])
        bs = self.block_size
        num_full = min(request.num_computed_tokens // bs, len(blocks))
        if len(keys) >= num_full:
            return
        tokens = request.all_token_ids
        parent = hash(keys[-1]) if keys else 0
        for i in range(len(keys), num_full):
            key = (parent, tuple(tokens[i * bs : (i + 1) * bs]))
            self.pool.cache(blocks[i], key)
            keys.append(key)
            parent = hash(key)

    def trim(self, request: Request) -> None:
        """Rollback after rejected drafts: give back the tail blocks holding no computed token.
        They were never indexed (only blocks whose tokens are all computed are)."""
        blocks = self._blocks.get(request.request_id)
        keep = self.blocks_needed(request.num_computed_tokens)
        if blocks is not None and len(blocks) > keep:
            tail = blocks[keep:]
            del blocks[keep:]
            self.pool.free(list(reversed(tail)))

    def free(self, request: Request) -> None:
        blocks = self._blocks.pop(request.request_id, [])
        self._keys.pop(request.request_id, None)
        self.pool.free(list(reversed(blocks)))  # tail blocks are evicted first
