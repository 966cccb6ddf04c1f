"""A host call's round-trip latency, as PopTorch's ``getLatency`` reports it: from the
timestamps of the inputs the device requested and of the outputs it returned, grouped as
PopTorch's ``_computeLatency`` groups them (``python/_poplar_executor.py``)."""

from __future__ import annotations

from ..errors import Error

__all__ = ["latency"]


def latency(starts: list[float], ends: list[float]) -> tuple[float, float, float]:
    """(min, max, mean) of the durations from each group of ``starts`` to its end
    (PopTorch's ``_computeLatency``): there are as many groups as ``ends``, each of
    ``len(starts) // len(ends)`` consecutive starts, taken at their earliest."""
    if not ends:
        return (0.0, 0.0, 0.0)
    if len(starts) % len(ends):
        raise Error(
            f"Internal emulator error: {len(starts)} start timestamps do not group into "
            f"{len(ends)} ends when calculating latency"
        )
    factor = len(starts) // len(ends)
    firsts = [min(starts[i * factor : (i + 1) * factor]) for i in range(len(ends))]
    durations = [end - start for start, end in zip(firsts, ends)]
    return (min(durations), max(durations), sum(durations) / len(durations))
