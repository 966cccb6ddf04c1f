"""The executor methods that need IPU hardware or a Poplar executable, each raising why the
emulator cannot provide it and what to use instead."""

from __future__ import annotations

from typing import Any

from .errors import Error

__all__ = ["HardwareOnly"]


class HardwareOnly:
    """PopTorch's ``PoplarExecutor`` methods the emulator refuses (a base of its executor)."""

    def cycleCount(self) -> int:
        raise Error(
            "cycleCount() needs IPU hardware cycle counters, which the ipuloop emulator "
            "does not have: time host calls instead (ipuloop.callbacks.ProfileCapture)."
        )

    def _no_timestamps(self, name: str) -> Any:
        raise Error(
            f"{name}() reads the IPU's host-transfer timestamps, which the ipuloop "
            "emulator does not have: time host calls instead (time.perf_counter() "
            "around the call, or ipuloop.callbacks.ProfileCapture)."
        )

    def getPerfCounters(self) -> dict:
        return self._no_timestamps("getPerfCounters")

    def getHostIpuLatency(self) -> tuple[float, float, float]:
        return self._no_timestamps("getHostIpuLatency")

    def getComputeLatency(self) -> tuple[float, float, float]:
        return self._no_timestamps("getComputeLatency")

    def getIpuHostLatency(self) -> tuple[float, float, float]:
        return self._no_timestamps("getIpuHostLatency")

    def compileAndExport(self, filename: str, *args: Any, **kwargs: Any) -> None:
        raise Error(
            "compileAndExport() writes a Poplar executable, which the ipuloop emulator "
            "cannot produce: use compile() and torch.save(model.state_dict())."
        )

    def loadExecutable(self, filename: str) -> None:
        raise Error(
            "loadExecutable() needs a Poplar executable, which the ipuloop emulator cannot load."
        )
