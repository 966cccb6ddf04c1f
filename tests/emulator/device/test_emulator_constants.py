"""device/constants.py: a wrapped module's plain attributes frozen as PopTorch's trace leaves
them, driven by hand (capture, a trace, settle; then enter, refresh, exit as the executor
calls them). Programs under it are in ``test_emulator_fidelity_programs.py``."""

from __future__ import annotations

import torch
from torch import nn

from ipuloop.emulator.device.constants import capture, settle


class Counter(nn.Module):
    """forward counts its calls in a plain attribute, and appends to a plain list."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self.calls = 0
        self.seen: list[int] = []

    def forward(self, x):
        self.calls += 1
        self.seen.append(self.calls)
        return self.lin(x)


def live(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def test_a_model_without_plain_attributes_gets_no_plan():
    model = nn.Linear(2, 2)
    before = capture(model, live(model))
    model(torch.ones(1, 2))
    assert settle(before) is None


def test_what_the_trace_changed_is_replayed_from_where_the_trace_began_each_call():
    """The graph runs without forward's Python: each micro-batch's forward starts from the
    attributes as the trace found them, and the host keeps what the trace (or it) left."""
    model = Counter()
    before = capture(model, live(model))
    model(torch.ones(1, 1))  # the trace: calls 0 -> 1, seen [] -> [1]
    plan = settle(before)
    assert plan is not None and plan.changing
    assert (model.calls, model.seen) == (1, [1])  # the host sees the trace's change, once
    model.calls = 100  # the host changes one between calls
    saved = plan.enter()
    assert (model.calls, model.seen) == (0, [])  # as the trace found them
    model(torch.ones(1, 1))
    assert (model.calls, model.seen) == (1, [1])
    plan.refresh()  # the next micro-batch starts from there again
    assert (model.calls, model.seen) == (0, [])
    model(torch.ones(1, 1))
    plan.exit(saved)
    assert (model.calls, model.seen) == (100, [1])  # the host's own back


def test_a_tensor_attribute_is_the_constant_the_trace_saw():
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.tensor(2.0)  # not a buffer: a constant of the graph

        def forward(self, x):
            return x * self.scale

    model = Scaled()
    traced = model.scale
    before = capture(model, live(model))
    model(torch.ones(1))
    plan = settle(before)
    assert plan is not None and not plan.changing  # read only: nothing to refresh
    model.scale = torch.tensor(5.0)
    saved = plan.enter()
    assert model.scale is traced and float(model(torch.ones(1))) == 2.0
    plan.exit(saved)
    assert float(model.scale) == 5.0


def test_an_attribute_the_trace_added_is_absent_on_later_calls():
    class Caching(nn.Module):
        def forward(self, x):
            if not hasattr(self, "cache"):
                self.cache = x.sum()
            return x

    model = Caching()
    before = capture(model, live(model))
    model(torch.ones(2))
    plan = settle(before)
    assert plan is not None
    saved = plan.enter()
    assert not hasattr(model, "cache")  # as the trace found it: absent
    plan.exit(saved)
    assert float(model.cache) == 2.0


def test_parameters_and_buffers_are_never_frozen():
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))
            self.register_buffer("b", torch.zeros(1))
            self.refs = [self.w, self.b]  # plain list holding live tensors

        def forward(self, x):
            return x * self.w + self.b

    model = Holder()
    before = capture(model, live(model))
    model(torch.ones(1))
    assert settle(before) is None
