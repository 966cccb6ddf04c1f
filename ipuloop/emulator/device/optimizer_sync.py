"""A training model's optimizer on the device: the host's optimizer, its device copy, and the
uploads (compile, ``setOptimizer``, a loaded state) and downloads (detach, destroy) between.

As on hardware, host-side changes to the optimizer reach the device only through
``setOptimizer`` (hyper-parameters, checked against what the executable fixed as constants) or
a re-upload (a ``poptorch.optim`` optimizer whose state was loaded); the device's moments stay
on the device until read through the patched ``state_dict()``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .. import _logging
from .. import optim as _optim
from ..enums import MeanReductionStrategy, ReductionType
from ..errors import Error
from . import distributed as _distributed
from . import loss_scaling as _loss_scaling

__all__ = ["OptimizerSync"]

_profiler_enabled = torch._C._autograd._profiler_enabled


class OptimizerSync:
    """The optimizer of training executor ``owner`` (which has ``_attached``, ``_compiled``
    and ``_options``); ``optimizer`` is the user's, or None for PopTorch's default SGD over
    ``model``'s parameters."""

    def __init__(
        self, owner: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> None:
        self._owner = owner
        if optimizer is None:
            optimizer = _optim.default_optimizer(model.parameters())
        _optim.check_supported(optimizer)
        self.tracker = _optim.AttributeTracker(owner._options._relax_optimizer_checks)
        self.tracker.check(optimizer)
        self.optimizer = optimizer  # the host's
        self.device: torch.optim.Optimizer | None = None  # its copy on the device
        self.snapshot: dict | None = None  # the hyper-parameters the device has
        self.constants: set[str] = set()  # those the executable fixed
        self.dirty = False  # the host's state must be uploaded before the next run
        self.host_stale = False  # the device's state changed since the host last read it
        self.loss_scaling = 1.0  # the loss scale of the next step (the optimizer's, times ALS's)
        self._base_loss_scaling = 1.0  # the optimizer's loss_scaling
        self.als: _loss_scaling.AutoLossScale | None = None  # automatic loss scaling
        self.rounding: torch.Generator | None = None  # draws stochastic rounding (``upload``)
        self._device_params: list[torch.Tensor] = []  # the device optimizer's, in group order
        self._plain_zero_grad = False  # its zero_grad() is torch's: ``step`` clears grads itself
        self.reducer: Any = None  # several processes: all-reduces before each update
        self.set_reduction_strategy(optimizer)
        self.patch(optimizer)

    def join(
        self,
        options: Any,
        device: torch.device,
        model: torch.nn.Module,
        host_params: list[torch.Tensor],
    ) -> None:
        """At compile, with ``Distributed.numProcesses`` > 1: join the other instances, check
        that they agree, and all-reduce gradients before each update (``distributed``)."""
        self.reducer = _distributed.join(options, device, self.optimizer, model, host_params)

    def params(self) -> list[torch.Tensor]:
        """The parameters the host optimizer trains, in its groups' order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # -- state_dict() reads the device's state ---------------------------------------------
    def patch(self, opt: torch.optim.Optimizer) -> None:
        """PopTorch rebinds ``state_dict()``/``load_state_dict()`` so they read and write the
        IPU's state, for ``poptorch.optim`` optimizers only: a torch.optim one's stays on the
        device."""
        if not isinstance(opt, _optim.Optimizer):
            return
        cls_state_dict, cls_load = type(opt).state_dict, type(opt).load_state_dict

        def state_dict():
            if self.device is not None and self._owner._attached:
                self._note_read()
                return self.device_state_dict()
            if self.device is not None:  # detached: read back when it detached
                self._note_read()
            return cls_state_dict(opt)

        def load_state_dict(sd):
            cls_load(opt, sd)
            self.dirty = True

        opt.state_dict, opt.load_state_dict = state_dict, load_state_dict  # type: ignore[method-assign]

    def _note_read(self) -> None:
        """PopTorch's words when a ``poptorch.optim`` optimizer's state is read: copied from
        the device (INFO) if it changed since the last read, else the host's copy (DEBUG)."""
        if self.host_stale:
            _logging.logger.info("Writing optimiser state tensors from IPU to host.")
            self.host_stale = False
        else:
            _logging.logger.debug("Using cached optimiser state dict")

    @staticmethod
    def unpatch(opt: torch.optim.Optimizer) -> None:
        opt.__dict__.pop("state_dict", None)
        opt.__dict__.pop("load_state_dict", None)

    def device_state_dict(self) -> dict:
        """The device's state (moments, step counts) with the host's hyper-parameters: as in
        PopTorch, reading the state back must not undo host LR scheduling. With automatic loss
        scaling, ``ipu_state["lossScaleUpdateFactor"]`` is the factor the next step uses."""
        assert self.device is not None, "read while compiled"
        sd = self.device.state_dict()
        sd["param_groups"] = type(self.optimizer).state_dict(self.optimizer)["param_groups"]
        if self.als is not None:
            sd["ipu_state"] = {"lossScaleUpdateFactor": torch.tensor(self.als.factor)}
        return sd

    def anchor_scalars(self) -> dict[str, Any]:
        """The loss scale tensors ``Options.anchorTensor`` may name, by PopART's names, with
        automatic loss scaling: "finalLossScale" (the last update's loss scale) and
        "lossScaleUpdateFactor" (the factor the next update uses)."""
        if self.als is None and _loss_scaling.settings(self._owner._options) is None:
            return {}

        def final() -> torch.Tensor:
            last = self.als.last_final if self.als is not None else None
            return torch.tensor(self.loss_scaling if last is None else last)

        return {
            "finalLossScale": final,
            "lossScaleUpdateFactor": lambda: torch.tensor(
                self.als.factor if self.als is not None else 1.0
            ),
        }

    def _stochastic_rounding(self, dev: torch.optim.Optimizer) -> torch.Generator | None:
        """``Precision.enableStochasticRounding(True)``: float16 weight updates round
        stochastically, drawn from a generator seeded from ``randomSeed`` (else from torch's
        initial seed) and kept across re-attaches, as the device's RNG is."""
        options = self._owner._options
        if not options._Popart.options.get("enableStochasticRounding", False) or not any(
            p.dtype == torch.float16 for g in dev.param_groups for p in g["params"]
        ):
            return None
        if self.rounding is None:
            params = [p for g in dev.param_groups for p in g["params"]]
            seed = options.random_seed if options.exists("random_seed") else torch.initial_seed()
            self.rounding = torch.Generator(device=params[0].device)
            self.rounding.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
        return self.rounding

    def _set_loss_scaling(self, optimizer: torch.optim.Optimizer) -> None:
        self._base_loss_scaling = _optim.loss_scaling(optimizer)
        self.loss_scaling = (
            self._base_loss_scaling if self.als is None else self.als.final(self._base_loss_scaling)
        )

    def _start_auto_loss_scaling(self) -> None:
        """``Training.setAutomaticLossScaling(True)``: the executor counts the float16
        gradients of each run (``loss_scaling``); the factor is the device's, kept across
        re-attaches."""
        options = self._owner._options
        values = _loss_scaling.settings(options)
        if values is None:
            return
        if options.Distributed.numProcesses > 1:
            raise Error(
                "Training.setAutomaticLossScaling(True) with Distributed.numProcesses "
                f"= {options.Distributed.numProcesses}: the ipuloop emulator adjusts "
                "the loss scale of one process only. Set the loss scale with the "
                "optimizer's loss_scaling instead."
            )
        if self.als is None:
            t = options.Training
            mean = (
                ReductionType(t.accumulation_and_replication_reduction_type) == ReductionType.Mean
            )
            self.als = _loss_scaling.AutoLossScale(
                values, float(t.gradient_accumulation * options.replication_factor) if mean else 1.0
            )

    # -- uploads and downloads ---------------------------------------------------------------
    def upload(self, host_params: list[torch.Tensor]) -> None:
        """Copy the host optimizer to the device: its copy runs on ``host_params`` (the tensors
        the device's weights are swapped into for a run)."""
        opt = self.optimizer
        self._start_auto_loss_scaling()
        if self.dirty and isinstance(opt, _optim.Optimizer):  # a loaded state reaches the device
            _logging.logger.info("Writing optimiser state tensors from host to IPU memory.")
        memo = {id(h): h for h in host_params}  # runs on them, swapped in
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in memo:
                    raise ValueError(
                        "The optimizer holds a parameter that the optimizer given "
                        "when wrapping did not hold and the model does not have: "
                        "wrap the model again with this optimizer."
                    )
        patched: dict[str, Any] = {
            k: opt.__dict__.pop(k) for k in ("state_dict", "load_state_dict") if k in opt.__dict__
        }
        try:
            dev = copy.deepcopy(opt, memo)
        finally:
            opt.__dict__.update(patched)
        # Instance-level wrappers (an LR scheduler's step counter) would call the host optimizer.
        for name in ("step", "zero_grad", "_opt_called"):
            dev.__dict__.pop(name, None)
        rounding = self._stochastic_rounding(dev)
        if isinstance(dev, _optim.Optimizer):
            dev.__dict__["_rounding"] = rounding
        elif _optim.has_16bit_params(dev):  # as poptorch.optim's own step does:
            dev.step = _optim.float32_step(dev, rounding)  # type: ignore[method-assign]
        if self.reducer is not None:  # each update first all-reduces across the instances
            self.reducer.wrap(dev)
        self.device = dev
        self._device_params = [p for group in dev.param_groups for p in group["params"]]
        self._plain_zero_grad = (
            type(dev).zero_grad is torch.optim.Optimizer.zero_grad
            and "zero_grad" not in dev.__dict__
        )
        self.snapshot = _optim.hyperparameters(opt)
        self.constants = _optim.constant_attributes(opt)
        if self.als is not None:  # PopTorch: automatic loss scaling makes it variable
            self.constants.discard("loss_scaling")
        self._set_loss_scaling(opt)
        self.dirty = False
        self.host_stale = True  # as after PopTorch's compile: the host has not read it yet

    def step(self) -> None:
        """One update of the device's weights from the gradients the call's micro-batches left
        (complete here), then the gradients cleared: ``zero_grad(set_to_none=True)``, done
        directly when it is torch's own and no profiler records its scope."""
        dev = self.device
        assert dev is not None, "stepped while compiled"
        if self.als is None:
            dev.step()
        else:
            self._auto_scaled_step(dev)
        self.host_stale = True
        if self._plain_zero_grad and not _profiler_enabled():
            for p in self._device_params:
                p.grad = None
        else:
            dev.zero_grad(set_to_none=True)

    def _auto_scaled_step(self, dev: torch.optim.Optimizer) -> None:
        """The update with the gradients unscaled by the loss scale their backward used (the
        optimizer's times the factor), then the factor's update (``loss_scaling``)."""
        final, base, als = self.loss_scaling, self._base_loss_scaling, self.als
        assert als is not None, "automatic loss scaling"
        if isinstance(dev, _optim.Optimizer):
            dev.loss_scaling = final  # poptorch.optim's step divides by its loss_scaling
            try:
                dev.step()
            finally:
                dev.loss_scaling = base
        else:
            grads = [p.grad for p in self._device_params if p.grad is not None]
            if grads and final != 1.0:
                torch._foreach_div_(grads, final)
            dev.step()
        als.after_step(base)
        self.loss_scaling = als.final(base)

    def download(self) -> None:
        """Copy the device's state into a ``poptorch.optim`` host optimizer."""
        if self.device is not None and isinstance(self.optimizer, _optim.Optimizer):
            self._note_read()
            type(self.optimizer).load_state_dict(self.optimizer, self.device_state_dict())

    def release(self) -> None:
        """The model is unwrapped: the host optimizer's own state_dict() again."""
        self.unpatch(self.optimizer)
        self.device = None

    def set(self, optimizer: torch.optim.Optimizer, host_params: list[torch.Tensor]) -> None:
        """``setOptimizer``: push ``optimizer``'s hyper-parameters (and loaded state) to the
        device, refusing a change of one the executable holds constant."""
        _optim.check_supported(optimizer)
        self.tracker.check(optimizer)
        self.set_reduction_strategy(optimizer)
        if optimizer is not self.optimizer:
            self.unpatch(self.optimizer)
            self.optimizer = optimizer
            self.patch(optimizer)
            if optimizer.state and isinstance(optimizer, _optim.Optimizer):
                # only a poptorch.optim optimizer carrying state resets the device's
                self.dirty = True
        if self.device is None:
            return  # not compiled yet: used as is at compile time
        assert self.snapshot is not None, "taken at compile time"
        new = _optim.hyperparameters(optimizer)
        changed = _optim.changed_constants(self.snapshot, new, self.constants)
        if changed == ["param_groups"]:  # a group added (add_param_group) or removed
            raise ValueError(
                _optim.group_count_error(len(new["groups"]), len(self.snapshot["groups"]))
            )
        if changed:
            raise ValueError(
                f"Optimizer attribute(s) {changed} are constant in the compiled "
                "graph and cannot change: pass them explicitly to the optimizer's "
                "constructor to make them variable, or re-wrap the model."
            )
        if self.dirty:
            self.upload(host_params)
        else:
            _optim.apply_hyperparameters(self.device, new)
            self.snapshot = new
            self._set_loss_scaling(optimizer)

    def set_reduction_strategy(self, optimizer: torch.optim.Optimizer) -> None:
        """PopTorch: a float16 accumulator (non-combined) needs the Running mean strategy; it
        is switched before compilation and cannot be switched after. Numerics here are exact
        means either way: only the option and the error are reproduced."""
        if not _optim.needs_running_mean(optimizer):
            return
        options = self._owner._options
        training = options.Training
        if not self._owner._compiled:
            options._unfreeze()
            training.setMeanAccumulationAndReplicationReductionStrategy(
                MeanReductionStrategy.Running
            )
            options._freeze()
        elif (
            training.meanAccumulationAndReplicationReductionStrategy
            != MeanReductionStrategy.Running
        ):
            raise ValueError(
                "Invalid optimizer: the new optimizer would require changing "
                "options.Training.meanAccumulationAndReplicationReductionStrategy to "
                "poptorch.MeanReductionStrategy.Running but the executable is "
                "already compiled."
            )
