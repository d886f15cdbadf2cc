"""KV layer groups: which layers share a block table (vLLM's hybrid allocator, reduced).

A model whose layers all attend alike has one group: every layer reads one block table per
request, and one block holds ``block_size`` tokens of KV for every layer. A model that mixes
full-attention and sliding-window layers (Gemma 3: 5 sliding to 1 global) splits its layers
into groups of ``group_size`` layers of one kind each; each group has its own block table per
request, all drawn from one block pool, and one block holds ``block_size`` tokens of KV for
``group_size`` layers. A sliding group gives back the blocks that fall wholly behind its
window, so a long sequence costs its full groups' KV plus a window per sliding group::

    Gemma 3 270M: 18 layers, 3 full (5, 11, 17) and 15 sliding  ->  group_size 3
    group 0  full     layers 5 11 17      table  [b b b b b b b b b b b b]   (every block)
    group 1  sliding  layers 0  1  2      table  [- - - - - - - - - b b b]   (the window's)
    ...
    group 5  sliding  layers 14 15 16     table  [- - - - - - - - - b b b]

The KV tensors: ``group_size`` (k, v) pairs of ``num_blocks`` blocks; layer ``l`` reads and
writes pair ``slot_of(l)`` (its index inside its group) through its group's table, so a block
id names the same rows in each pair, and a block belongs to one group at a time.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from treadle.config import ModelConfig


@dataclass(frozen=True)
class KVGroup:
    layers: tuple[int, ...]  # decoder layers, ascending
    sliding_window: int | None  # None: full attention (the group keeps every block)


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]  # full-attention groups first (group 0 is the request's main table)

    @staticmethod
    def single(num_layers: int) -> KVGroups:
        return KVGroups((KVGroup(tuple(range(num_layers)), None),))

    @staticmethod
    def from_windows(windows: Sequence[int | None]) -> KVGroups:
        """Group layers by window (``windows[l]``: layer l's, None for full attention); one kind
        of layer (or a model without full-attention layers: nothing a group could share) gives
        the single group of today's cache."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        if len(kinds) == 1 or None not in kinds:
            return KVGroups.single(len(windows))
        size = min(len(layers) for layers in kinds.values())
        order = sorted(kinds, key=lambda w: -1 if w is None else w)
        return KVGroups(tuple(KVGroup(tuple(kinds[w][i : i + size]), w)
                              for w in order for i in range(0, len(kinds[w]), size)))

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.sliding_window for g in self.groups)

    @property
    def group_size(self) -> int:
        """Layers whose KV one block holds (the (k, v) tensor pairs to allocate)."""
        return max(len(g.layers) for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1

    def group_of(self, layer: int) -> int:
        return next(i for i, g in enumerate(self.groups) if layer in g.layers)

    def slot_of(self, layer: int) -> int:
        """Which (k, v) tensor pair layer ``layer`` uses: its index inside its group."""
        return self.groups[self.group_of(layer)].layers.index(layer)


def kv_groups(cfg: ModelConfig, hybrid: bool) -> KVGroups:
    """The model's KV groups: per window kind when ``hybrid`` (the resolver's
    ``CacheConfig.hybrid_kv``), else one group of all layers."""
    if not hybrid:
        return KVGroups.single(cfg.num_layers)
    return KVGroups.from_windows([cfg.layer_window(i) for i in range(cfg.num_layers)])
