"""How a size splits into one part per rank, as equal as can be."""

from __future__ import annotations


def bounds(total: int, size: int, rank: int) -> tuple[int, int]:
    """The rows [start, stop) of `total` that `rank` of `size` holds: as equal as can be."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def aligned_bounds(total: int, size: int, rank: int, unit: int) -> tuple[int, int]:
    """`bounds` in whole units of `unit` (a quantization group): the last unit may be short."""
    units = -(-total // unit)
    start, stop = bounds(units, size, rank)
    return start * unit, min(stop * unit, total)
