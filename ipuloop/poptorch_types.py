"""The PopTorch objects the loop holds, as protocols: only the members the loop side uses.

``poptorch.Options`` (``Options``, with its ``Training`` and ``Distributed`` groups),
``poptorch.DataLoader`` (``DataLoader``) and the executor ``trainingModel`` and
``inferenceModel`` return (``Executor``). PopTorch and the emulator both satisfy them; a
reader sees at each hand-off what crosses it.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol

import torch

__all__ = ["Options", "TrainingOptions", "DistributedOptions", "DataLoader", "Executor"]


class TrainingOptions(Protocol):
    """``Options.Training``."""

    @property
    def gradient_accumulation(self) -> int: ...


class DistributedOptions(Protocol):
    """``Options.Distributed``."""

    @property
    def numProcesses(self) -> int: ...

    @property
    def processId(self) -> int: ...

    def disable(self) -> Any: ...

    def configureProcessId(self, process_id: int, num_processes: int) -> Any: ...


class Options(Protocol):
    """``poptorch.Options``: the factors of a host call (DI, RF and its input groups, GA),
    the processes, the seed and the output mode."""

    @property
    def device_iterations(self) -> int: ...

    @property
    def replication_factor(self) -> int: ...

    @property
    def input_group_size(self) -> int: ...

    @property
    def output_mode(self) -> Any: ...  # poptorch.OutputMode

    @property
    def output_return_period(self) -> int: ...

    @property
    def random_seed(self) -> int: ...

    @property
    def Training(self) -> TrainingOptions: ...

    @property
    def Distributed(self) -> DistributedOptions: ...

    def exists(self, name: str) -> bool: ...

    def _freeze(self) -> None: ...  # (no setter works after it)

    def clone(self) -> Any: ...  # (an Options of the same class)

    def replicationFactor(self, replication_factor: int) -> Any: ...

    def deviceIterations(self, device_iterations: int) -> Any: ...

    def randomSeed(self, random_seed: int) -> Any: ...

    def outputMode(self, output_mode: object, output_return_period: int | None = None) -> Any: ...


class DataLoader(Protocol):
    """``poptorch.DataLoader``, a ``torch.utils.data.DataLoader`` with its options."""

    dataset: Any  # (the user's dataset)
    batch_size: int | None
    num_workers: int
    generator: torch.Generator | None

    @property
    def options(self) -> Options: ...

    @property
    def combinedBatchSize(self) -> int | None: ...

    def collate_fn(self, samples: list[Any]) -> Any: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...

    def terminate(self) -> None: ...  # (Async modes: its reading process or thread)


class Executor(Protocol):
    """What ``poptorch.trainingModel`` and ``inferenceModel`` return: a model compiled for
    one input shape, attached to the IPUs it runs on while it runs."""

    rng_state: torch.Tensor  # the device's random state
    # PopTorch's own flag: a training call ran since the host's weights were last synced
    _dirty_host_weights: bool

    def __call__(self, *args: object, **kwargs: object) -> Any: ...

    def compile(self, *args: object, **kwargs: object) -> None: ...

    def isCompiled(self) -> bool: ...

    def isAttachedToDevice(self) -> bool: ...

    def detachFromDevice(self) -> None: ...

    def copyWeightsToHostIfNeeded(self) -> bool: ...

    def copyWeightsToDevice(self) -> None: ...

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None: ...

    def destroy(self) -> None: ...

    def load_state_dict(self, state_dict: dict[str, Any], *, strict: bool = True) -> Any: ...
