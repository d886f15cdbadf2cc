"""Per-request block tables over the BlockPool, with prefix matching.

The scheduler sees only: the cached prefix of a request (a ``PrefixHit``), whether slots for
N more tokens could be allocated, and the block ids of a request.

KV groups (``core/kv_groups.py``, one per entry of ``windows``): a request holds one table per
group, all of one length (one entry per logical block), all drawn from the one pool. Group 0
is full attention (or the only group). In a sliding-window group an entry becomes None (block
id ``NULL_BLOCK`` for the runner) once its block lies wholly behind the window of the next
token to compute, and the block goes back to the pool::

    window 32, block_size 16, num_computed_tokens 70: the next query (position 70) sees
    keys 39..70, so blocks 0 and 1 (tokens 0..31) go back
    full     [b0 b1 b2 b3 b4]
    sliding  [-- -- b2 b3 b4]       -- = NULL_BLOCK: masked by the window, never attended

Prefix cache: each group indexes its own blocks (its key chain starts from the group's
number, so equal tokens give each group its own keys). A hit of P blocks needs every full
group's blocks 0..P-1 and each sliding group's blocks holding the window before position
P * block_size (vLLM's rule: a sliding block given back stays indexed until it is reused);
the longest P that every group allows is taken.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from treadle.core.block_pool import BlockKey, BlockPool, KVBlock
from treadle.core.request import Request

NULL_BLOCK = 0  # the id a table entry behind a sliding window gets (attention masks those keys)


@dataclass
class PrefixHit:
    """A cached prefix of ``num_blocks`` blocks: per group its table entries (None: behind the
    window) and the content keys of all ``num_blocks`` blocks."""

    num_blocks: int
    tables: list[list[KVBlock | None]]
    keys: list[list[BlockKey]]

    def blocks(self) -> list[KVBlock]:
        return [b for table in self.tables for b in table if b is not None]


def _ids(table: list[KVBlock | None]) -> list[int]:
    return [NULL_BLOCK if b is None else b.block_id for b in table]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,)) -> None:
        """``windows``: one per KV group, None for full attention (``KVGroups.windows``)."""
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        self._tables: dict[str, list[list[KVBlock | None]]] = {}
        self._keys: dict[str, list[list[BlockKey]]] = {}  # per group: keys of the full, computed blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks of one table holding ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """Most blocks a request of ``num_tokens`` tokens holds at once, computed in chunks of
        at most ``chunk`` tokens: every full group's blocks, and per sliding group the window
        before a chunk plus the chunk (one more block for alignment)."""
        n = self.blocks_needed(num_tokens)
        return sum(n if w is None else min(n, self.blocks_needed(w - 1 + chunk) + 1) for w in self.windows)

    def block_ids(self, request_id: str) -> list[int]:
        """Group 0's table: every block of the request (full attention, or the only group)."""
        tables = self._tables.get(request_id)
        return [] if tables is None else _ids(tables[0])

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The other groups' tables (empty with one group)."""
        tables = self._tables.get(request_id)
        return [] if tables is None else [_ids(t) for t in tables[1:]]

    def blocks_held(self, request_id: str) -> list[int]:
        """Blocks the request holds, per group."""
        return [sum(b is not None for b in t) for t in self._tables.get(request_id, [])]

    # -- prefix cache ----------------------------------------------------------
    def _key(self, parent: int, tokens: list[int], i: int) -> BlockKey:
        bs = self.block_size
        return parent, tuple(tokens[i * bs : (i + 1) * bs])

    def _walk(self, tokens: list[int], group: int, n: int, stop_on_miss: bool) -> tuple[list[BlockKey], list[KVBlock | None]]:
        """Group ``group``'s keys of blocks 0..n-1 and the cached block of each (None: not cached)."""
        keys: list[BlockKey] = []
        found: list[KVBlock | None] = []
        parent = group
        for i in range(n):
            key = self._key(parent, tokens, i)
            block = self.pool.lookup(key)
            if block is None and stop_on_miss:
                break
            keys.append(key)
            found.append(block)
            parent = hash(key)
        return keys, found

    def _window_start(self, num_tokens: int, window: int) -> int:
        """First block holding a key that the token at position ``num_tokens`` still sees."""
        return max(0, num_tokens - window + 1) // self.block_size

    def _window_hit(self, found: list[KVBlock | None], p: int, window: int) -> int:
        """Largest q <= p whose window blocks (``_window_start(q * bs)`` .. q - 1) are all cached."""
        best, run_start = 0, 0
        for i in range(p):
            if found[i] is None:
                run_start = i + 1
            elif run_start <= self._window_start((i + 1) * self.block_size, window):
                best = i + 1
        return best

    def match_prefix(self, request: Request) -> PrefixHit:
        """Cached blocks holding a prefix of the request's tokens. At least one
        token is always left to compute, so the step yields logits to sample. None for a
        request that asks for prompt logprobs: every prompt position must be computed."""
        none = PrefixHit(0, [[] for _ in self.windows], [[] for _ in self.windows])
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return none
        tokens = request.all_token_ids
        p = (len(tokens) - 1) // self.block_size
        walks: list[tuple[list[BlockKey], list[KVBlock | None]]] = []
        for g, window in enumerate(self.windows):  # full groups first: they bound the sliding walks
            walks.append(self._walk(tokens, g, p, window is None))
            p = len(walks[g][1]) if window is None else self._window_hit(walks[g][1], p, window)
        while True:  # a shorter hit moves the windows: every sliding group must still allow it
            q = min([p] + [self._window_hit(found, p, w) for (_, found), w in zip(walks, self.windows) if w is not None])
            if q == p:
                break
            p = q
        if p == 0:
            return none
        tables: list[list[KVBlock | None]] = []
        for (_, found), window in zip(walks, self.windows):
            lo = 0 if window is None else self._window_start(p * self.block_size, window)
            behind: list[KVBlock | None] = [None] * lo
            tables.append(behind + found[lo:p])
        return PrefixHit(p, tables, [keys[:p] for keys, _ in walks])

    # -- allocation -------------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, cached: PrefixHit | None = None) -> bool:
        """Make room for ``num_new_tokens`` after the computed (and cached) ones.
        Returns False, changing nothing, when the pool is too small right now."""
        rid = request.request_id
        hit = cached if cached is not None and cached.num_blocks else None
        tables = self._tables.get(rid)
        num_hit = hit.num_blocks if hit is not None else 0
        have = len(tables[0]) if tables is not None else num_hit
        total = request.num_computed_tokens + num_hit * self.block_size + num_new_tokens
        per_group = max(0, self.blocks_needed(total) - have)
        reused = hit.blocks() if hit is not None else []
        if per_group * len(self.windows) > self.pool.num_free_blocks - self.pool.evictable_among(reused):
            return False
        if tables is None:
            tables = self._tables[rid] = [[] for _ in self.windows]
        if hit is not None:
            self.pool.touch(reused)
            for table, entries in zip(tables, hit.tables):
                table.extend(entries)
            self._keys[rid] = [list(keys) for keys in hit.keys]
        if per_group:
            fresh = self.pool.allocate(per_group * len(self.windows))
            for g, table in enumerate(tables):
                table.extend(fresh[g * per_group : (g + 1) * per_group])
        return True

    def on_tokens_computed(self, request: Request) -> None:
        """The request's computed tokens advanced: index its newly full blocks, then give back
        the sliding groups' blocks now wholly behind their windows (still indexed: a later
        prompt may take them back while they wait in the free list)."""
        self.cache_computed_blocks(request)
        self._free_behind_window(request)

    def cache_computed_blocks(self, request: Request) -> None:
        """Index every full block whose tokens are all computed."""
        tables = self._tables.get(request.request_id)
        if not self.enable_prefix_caching or tables is None:
            return
        keys = self._keys.setdefault(request.request_id, [[] for _ in self.windows])
        num_full = min(request.num_computed_tokens // self.block_size, len(tables[0]))
        done = len(keys[0])  # every group has indexed as many
        if done >= num_full:
            return
        tokens = request.all_token_ids
        for g, (table, chain) in enumerate(zip(tables, keys)):
            parent = hash(chain[-1]) if chain else g
            for i in range(done, num_full):
                key = self._key(parent, tokens, i)
                block = table[i]
                if block is not None:
                    self.pool.cache(block, key)
                chain.append(key)
                parent = hash(key)

    def _free_behind_window(self, request: Request) -> None:
        tables = self._tables.get(request.request_id)
        if tables is None:
            return
        for window, table in zip(self.windows, tables):
            if window is None:
                continue
            i = min(self._window_start(request.num_computed_tokens, window), len(table)) - 1
            gone: list[KVBlock] = []
            while i >= 0 and (block := table[i]) is not None:  # entries behind the window: a None prefix
                gone.append(block)
                table[i] = None
                i -= 1
            self.pool.free(gone)

    def trim(self, request: Request) -> None:
        """Rollback after rejected drafts: give back the tail blocks holding no computed token.
        They were never indexed (only blocks whose tokens are all computed are)."""
        keep = self.blocks_needed(request.num_computed_tokens)
        for table in self._tables.get(request.request_id, []):
            tail = table[keep:]
            del table[keep:]
            self.pool.free([b for b in reversed(tail) if b is not None])

    def free(self, request: Request) -> None:
        tables = self._tables.pop(request.request_id, [])
        self._keys.pop(request.request_id, None)
        for table in tables:
            self.pool.free([b for b in reversed(table) if b is not None])  # tail blocks are evicted first
