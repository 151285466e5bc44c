"""The byte accounting around the pages: the sentinel fill of the allocation,
the caches' tiling of the manager pages, and bytes changed outside every page."""

from __future__ import annotations

from .layout import Layout

SENTINEL = 0xA5


def stray_bytes(layout: Layout, blocks: set[int]) -> int:
    """Bytes that differ from the sentinel outside every cache's pages in
    ``blocks`` (every block the run allocated)."""
    own = layout.mask_of({name: sorted(blocks) for name in layout.caches})
    return int(((layout.storage != SENTINEL) & ~own).sum())


def tiling_problems(layout: Layout) -> list[str]:
    """Per cache group and block: the caches' pages (kernel pages where split)
    must not overlap and must cover exactly the bytes of their manager pages."""
    problems = []
    for gid in range(len(layout.kv_cache_config.kv_cache_groups)):
        caches = [c for c in layout.caches.values() if c.group_id == gid]
        for block in range(1, layout.kv_cache_config.num_blocks):
            pages = sorted(r for c in caches for r in layout.own_bytes(c, [block]))
            manager = sorted(
                (
                    c.manager_view.element_size()
                    * (c.manager_view.storage_offset() + block * c.manager_view.stride(0)),
                    c.manager_view.element_size()
                    * (c.manager_view.storage_offset() + block * c.manager_view.stride(0))
                    + c.spec.page_size_bytes,
                )
                for c in caches
            )
            if any(a[1] > b[0] for a, b in zip(pages, pages[1:])):
                problems.append(f"group {gid} block {block}: pages overlap")
            if _merged(pages) != _merged(manager):
                problems.append(
                    f"group {gid} block {block}: pages {_merged(pages)} do not "
                    f"tile the manager pages {_merged(manager)}"
                )
    return problems


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
