"""KV paging groups: which layers share a page table, and where a layer's K/V sits in a page.

A model whose layers mix attention kinds (Gemma 2: full and sliding-window layers
alternating; Gemma 3: five windowed to one full) frees a windowed layer's pages once they
fall out of its window, while a full layer keeps every page. The layers are grouped by kind,
each group with its own page table per sequence, all groups' pages from one pool and one
free list (docs/memory.md, "Hybrid paging"). vLLM's layout: every group has the same number
of layers, `slots_per_page` (the fewest layers of any kind), so a page id is one page of
`slots_per_page` layers whatever group holds it, and the pool's shape is
[num_kv_heads, slots_per_page * num_pages, page_size, head_dim] (slot j of page p is physical
page j * num_pages + p). A kind with more layers takes several groups (its last one padded:
slots no layer uses). Gemma 3 with 26 layers (4 full, 22 windowed):

    group    0 (full)       1 (W)        2 (W)        ...  6 (W)
    layers   5 11 17 23     0 1 2 3      4 6 7 8      ...  24 25 (slots 2, 3 unused)
    slot     0  1  2  3     0 1 2 3      0 1 2 3           0  1

One kind (or windows kept whole) is one group of every layer, slot l for layer l: the pool
and page table of a model without groups.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KVGroups:
    windows: tuple[int | None, ...]  # per group: the window its pages are freed by; None: full
    layer_groups: tuple[int, ...]  # per layer: its group
    layer_slots: tuple[int, ...]  # per layer: its slot in its group's pages

    def __post_init__(self):
        if len(self.layer_groups) != len(self.layer_slots) or not self.layer_groups:
            raise ValueError(
                f"layer_groups ({len(self.layer_groups)}) and layer_slots "
                f"({len(self.layer_slots)}) must name the same layers, at least one"
            )

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def slots_per_page(self) -> int:
        """Layers one page id holds (the pool's layers per page)."""
        return max(self.layer_slots) + 1

    @property
    def grouped(self) -> bool:
        return self.num_groups > 1


def single_group(num_layers: int, window: int | None = None) -> KVGroups:
    """Every layer in one group (slot l for layer l), its pages freed by window (None: kept)."""
    return KVGroups((window,), (0,) * num_layers, tuple(range(num_layers)))


def kv_groups(
    layer_windows: tuple[int | None, ...],
    *,
    free_window_pages: bool,
    max_model_len: int | None = None,
) -> KVGroups:
    """The paging groups of layers with these windows (None: full attention).

    free_window_pages False, or a model of one kind: one group of every layer (its window,
    or None when kept whole). Otherwise one group per kind and `slots_per_page` layers
    (the fewest layers of any kind; module docstring), full attention first, then windows
    ascending, each kind's layers in order. max_model_len: a window of at least that many
    tokens never frees a page, so its layers page as full attention ones (no group, and no
    padded slots, for nothing).
    """
    if max_model_len is not None:
        layer_windows = tuple(None if w is not None and w >= max_model_len else w
                              for w in layer_windows)  # fmt: skip
    kinds = sorted(set(layer_windows), key=lambda w: (w is not None, w or 0))
    if len(kinds) == 1:
        return single_group(len(layer_windows), kinds[0] if free_window_pages else None)
    if not free_window_pages:
        return single_group(len(layer_windows))
    by_kind = {w: [i for i, x in enumerate(layer_windows) if x == w] for w in kinds}
    size = min(len(layers) for layers in by_kind.values())
    windows: list[int | None] = []
    groups = [0] * len(layer_windows)
    slots = [0] * len(layer_windows)
    for w in kinds:
        layers = by_kind[w]
        for first in range(0, len(layers), size):
            for slot, layer in enumerate(layers[first : first + size]):
                groups[layer], slots[layer] = len(windows), slot
            windows.append(w)
    return KVGroups(tuple(windows), tuple(groups), tuple(slots))
