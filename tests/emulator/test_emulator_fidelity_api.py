"""What PopTorch programs and tools rely on beyond the numerics: never stricter than PopTorch,
its words in the messages users and tools match on, the rest of its public API, and its
DataLoader behaviours (persistent workers, AsyncRebatched, worker failures, a loader kept
alive by its iterator).
"""

from __future__ import annotations

import copy
import datetime
import gc
import logging
import re

import pytest
import torch
from torch import nn

import ipuloop.emulator as poptorch
from ipuloop.backend import uses_ipu_model
from ipuloop.emulator.data import DataLoader
from ipuloop.emulator.enums import DataLoaderMode


class Linear(nn.Module):
    """y = w * x (+ an L1 loss to x + 1 when a target-free training model is wanted)."""

    def __init__(self, training: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 1, bias=False)
        nn.init.ones_(self.fc.weight)
        self.training_loss = training

    def forward(self, x):
        y = self.fc(x)
        return F_l1(y, x + 1) if self.training_loss else y


def F_l1(a, b):
    return torch.nn.functional.l1_loss(a, b)


# -- 7. never stricter than PopTorch ------------------------------------------------------------


@pytest.mark.parametrize(
    "torch_cls, poptorch_cls, extra",
    [
        (torch.optim.SGD, poptorch.optim.SGD, {"use_combined_accum": False}),
        (torch.optim.Adam, poptorch.optim.Adam, {}),
        (torch.optim.AdamW, poptorch.optim.AdamW, {}),
        (torch.optim.RMSprop, poptorch.optim.RMSprop, {}),
    ],
)
def test_torch_optimizer_swapped_for_the_poptorch_one_keeps_constants(
    torch_cls, poptorch_cls, extra
):
    model = Linear(training=True)
    train = poptorch.trainingModel(model, optimizer=torch_cls(model.parameters(), lr=0.1))
    train(torch.ones(2, 1))
    train.setOptimizer(poptorch_cls(model.parameters(), lr=0.05, **extra))  # same values
    train(torch.ones(2, 1))
    # a real change of a constant is still refused
    with pytest.raises(ValueError, match="loss_scaling"):
        train.setOptimizer(poptorch_cls(model.parameters(), lr=0.05, loss_scaling=4.0, **extra))


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, False),
        ({"POPTORCH_IPU_MODEL": "1"}, True),
        ({"POPTORCH_SMALL_IPU_MODEL": "1"}, True),
        ({"POPTORCH_SMALL_IPU_MODEL": "0"}, False),
        ({"POPTORCH_IPU_MODEL": "0", "POPTORCH_SMALL_IPU_MODEL": "1"}, True),
    ],
)
def test_small_ipu_model_environment_variable_counts_as_the_ipu_model(monkeypatch, env, expected):
    for name in ("POPTORCH_IPU_MODEL", "POPTORCH_SMALL_IPU_MODEL"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert uses_ipu_model(poptorch.Options()) is expected
    assert uses_ipu_model(poptorch.Options().useIpuModel(False)) is False  # the option wins


def test_small_ipu_model_relaxes_the_power_of_two_ipu_count(monkeypatch):
    class ThreeIpus(nn.Module):
        def forward(self, x):
            with poptorch.Block(ipu_id=0):
                x = x + 1
            with poptorch.Block(ipu_id=1):
                x = x * 2
            with poptorch.Block(ipu_id=2):
                return x - 1

    monkeypatch.delenv("POPTORCH_IPU_MODEL", raising=False)
    monkeypatch.setenv("POPTORCH_SMALL_IPU_MODEL", "1")
    out = poptorch.inferenceModel(ThreeIpus(), poptorch.Options().deviceIterations(3))(
        torch.zeros(3, 1)
    )
    assert out.flatten().tolist() == [1.0, 1.0, 1.0]


def test_block_takes_the_legacy_integer_user_id():
    # PopTorch accepts it when the block is made, shows it, and copies it ...
    layer = poptorch.BeginBlock(nn.Linear(2, 2), user_id=1, ipu_id=2)
    assert "BeginBlock(user_id=1, ipu_id=2)" in poptorch.module_repr(copy.deepcopy(layer))
    with poptorch.Block(3):
        pass
    with pytest.raises(TypeError, match="user_id"):
        poptorch.Block(True)

    # ... and, as in PopTorch, only a stage lookup while tracing wants string ids
    class IntBlocks(nn.Module):
        def forward(self, x):
            with poptorch.Block(1, ipu_id=0):
                return x + 1

    with pytest.raises(AssertionError, match="Block IDs are supposed to be strings"):
        poptorch.inferenceModel(IntBlocks())(torch.ones(1))


def test_options_group_can_be_wrapped_by_assigning_its_class():
    class Distributed(type(poptorch.Options().Distributed)):
        pass

    opts = poptorch.Options()
    opts.Distributed.__class__ = Distributed
    assert type(opts.Distributed) is Distributed
    opts.Distributed.configureProcessId(1, 2)
    assert opts.Distributed.processId == 1
    with pytest.raises(AttributeError, match="Invalid private attribute _other"):
        opts.Distributed._other = 1  # other private attributes are still refused


# -- 8. PopTorch's words -----------------------------------------------------------------------


def test_subclassed_optimizer_warning_in_poptorch_words(caplog):
    class MyAdam(torch.optim.Adam):
        pass

    class MyPoptorchSGD(poptorch.optim.SGD):
        pass

    model = Linear(training=True)
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        poptorch.trainingModel(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert "does not run Python optimizer code directly" not in caplog.text
    for cls in (MyAdam, MyPoptorchSGD):
        model = Linear(training=True)
        with caplog.at_level(logging.WARNING, logger="poptorch::python"):
            poptorch.trainingModel(model, optimizer=cls(model.parameters(), lr=0.1))
        assert (
            f"Optimizer `{cls.__name__}` subclassed from classes in poptorch.optim or "
            "torch.optim are unlikely to behave as intended. Poptorch does not run Python "
            "optimizer code directly" in caplog.text
        )


def test_attributes_added_after_the_wrap_are_warned_about_once(caplog):
    model = Linear(training=True)
    opt = poptorch.optim.SGD(model.parameters(), lr=0.1, loss_scaling=2.0)
    opt.before_wrap = 1  # present when the model is wrapped: never warned about
    train = poptorch.trainingModel(model, optimizer=opt)
    train(torch.ones(2, 1))
    opt.late = 0
    opt.param_groups[0]["initial_lr"] = 0.1
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        train.setOptimizer(opt)
        opt.loss_scaling = 3.0
        train.setOptimizer(opt)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "Ignoring unexpected optimizer attribute in SGD optimizer: ['late']",
        "Ignoring unexpected group 0 attribute in SGD optimizer: ['initial_lr']",
    ]
    relaxed = Linear(training=True)
    opt = poptorch.optim.SGD(relaxed.parameters(), lr=0.1)
    train = poptorch.trainingModel(
        relaxed, poptorch.Options().relaxOptimizerAttributesChecks(), optimizer=opt
    )
    opt.late = 0
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="poptorch::python"):
        train.setOptimizer(opt)
    assert caplog.text == ""


def test_log_levels_in_poptorch_words():
    for legacy in (0, 1, 2, 3, 4, 6):
        poptorch.setLogLevel(legacy)
    with pytest.raises(ValueError, match="Invalid log level integer"):
        poptorch.setLogLevel(5)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Unknown log level: wibble. Valid values are DEBUG, ERR, INFO, OFF, TRACE and WARN"
        ),
    ):
        poptorch.setLogLevel("wibble")
    poptorch.setLogLevel("WARN")
    assert logging.getLogger("poptorch::python").level == logging.WARNING


def test_for_loop_input_type_in_poptorch_words():
    with pytest.raises(
        ValueError,
        match=re.escape(
            "poptorch.for_loop expects input tensors (inputs) to be a list of tensors. "
            "(Object is not list)"
        ),
    ):
        poptorch.for_loop(2, lambda x: x, torch.ones(1))


@pytest.mark.parametrize("strategy, hint", [(None, True), ("sharded", False)])
def test_gradient_accumulation_in_inference_in_poptorch_words(strategy, hint):
    opts = poptorch.Options()
    if strategy == "sharded":
        opts.setExecutionStrategy(poptorch.ShardedExecution())
    opts.Training.gradientAccumulation(2)
    with pytest.raises(poptorch.Error) as info:
        poptorch.inferenceModel(Linear(), opts)
    message = str(info.value)
    assert message.startswith(
        "You must set poptorch.Options().Training.gradientAccumulation to 1 or leave it as its "
        "default value (1) when running a poptorch.inferenceModel()."
    )
    assert (
        "Use poptorch.Options().deviceIterations to process a sufficient number of batches "
        "each run for pipelined execution instead." in message
    ) is hint


def test_offline_device_in_poptorch_words():
    opts = poptorch.Options().useOfflineIpuTarget()
    model = poptorch.inferenceModel(Linear(), opts)
    model.compile(torch.ones(1, 1))
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "Trying to run a model on an offline device (ConnectionType.Never): use "
            "model.compile(inputs) instead of model(inputs)"
        ),
    ):
        model(torch.ones(1, 1))


def test_options_file_syntax_error_names_poptorch_line(tmp_path):
    path = tmp_path / "run.conf"
    path.write_text(
        "# header\n\ndeviceIterations(2)\n  replicationFactor(1)\n"
        "outputMode(poptorch.OutputMode.All\n"
    )
    with pytest.raises(poptorch.options.ConfigFileError) as info:
        poptorch.Options().loadFromFile(str(path))
    assert str(info.value).startswith("SyntaxError at line 3 of run.conf: ")
    assert str(info.value).endswith("\n> options.outputMode(poptorch.OutputMode.All")


# -- 9. public API -----------------------------------------------------------------------------


class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b


class PairParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.a
        yield struct.b

    def reconstruct(self, original_structure, tensor_iterator):
        return Pair(next(tensor_iterator), next(tensor_iterator))


@pytest.fixture
def pair_parser():
    poptorch.registerCustomArgParser(Pair, PairParser())
    yield
    poptorch.registerCustomArgParser(Pair, None)


def test_custom_arg_parser_for_inputs_outputs_and_batches(pair_parser):
    class Model(nn.Module):
        def forward(self, p):
            assert p.a.shape[0] == 2  # one micro-batch of the 2 * 3 rows
            return Pair(p.a + p.b, p.a * p.b)

    model = poptorch.inferenceModel(Model(), poptorch.Options().deviceIterations(3))
    for i in range(2):
        a, b = torch.full((6, 1), float(i)), torch.full((6, 1), 2.0)
        out = model(Pair(a, b))
        assert isinstance(out, Pair)
        assert torch.equal(out.a, a + b) and torch.equal(out.b, a * b)

    class Pairs(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            return torch.tensor([float(i)]), torch.tensor([-float(i)])

    def collate(items):
        return Pair(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))

    sampler = torch.utils.data.BatchSampler(
        torch.utils.data.SequentialSampler(range(8)), 2, drop_last=False
    )
    loader = DataLoader(
        poptorch.Options().deviceIterations(2), Pairs(), batch_sampler=sampler, collate_fn=collate
    )
    batches = list(loader)
    assert all(isinstance(b, Pair) for b in batches)
    assert [b.a.flatten().tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(poptorch.Error, match="must inherit from ICustomArgParser"):
        poptorch.registerCustomArgParser(Pair, object())


def test_pre_and_post_compile_hooks_run_in_order_and_can_be_removed():
    calls = []
    handles = [
        poptorch.registerPreCompileHook(lambda: calls.append("pre1")),
        poptorch.registerPreCompileHook(lambda: calls.append("pre2")),
        poptorch.registerPostCompileHook(lambda: calls.append("post")),
    ]
    try:
        model = poptorch.inferenceModel(Linear())
        model(torch.ones(1, 1))
        model(torch.ones(1, 1))  # compiled once
        assert calls == ["pre1", "pre2", "post"]
        handles[0].remove()
        calls.clear()
        poptorch.inferenceModel(Linear())(torch.ones(1, 1))
        assert calls == ["pre2", "post"]
    finally:
        for handle in handles:
            handle.remove()
    with pytest.raises(RuntimeError, match="must be callable"):
        poptorch.registerPreCompileHook(2)
    with pytest.raises(RuntimeError, match="must be callable"):
        poptorch.registerPostCompileHook(False)


def test_module_repr_shows_begin_blocks():
    inner = nn.Sequential(nn.ReLU(), nn.Linear(2, 1))
    model = nn.Sequential(nn.Linear(2, 2), inner)
    assert poptorch.module_repr(model) == repr(model)  # no hooks: torch's own repr
    poptorch.BeginBlock(inner, user_id="b", ipu_id=1)
    assert poptorch.module_repr(model) == repr(model).replace(
        "(1): Sequential(", "(1): BeginBlock(user_id=b, ipu_id=1) Sequential("
    )


def test_poptorch_optim_optimizer_is_the_base_of_poptorch_optimizers():
    params = [nn.Parameter(torch.ones(1))]
    for cls in (
        poptorch.optim.SGD,
        poptorch.optim.Adam,
        poptorch.optim.AdamW,
        poptorch.optim.RMSprop,
        poptorch.optim.LAMB,
    ):
        assert isinstance(cls(params, lr=0.1), poptorch.optim.Optimizer)
    assert not isinstance(torch.optim.SGD(params, lr=0.1), poptorch.optim.Optimizer)


def test_updatable_named_buffers_are_the_only_ones_copied():
    class Buffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("one", torch.ones(1))
            self.register_buffer("two", torch.ones(1))

        def forward(self, x):
            return (x + self.one + self.two).sum()

    opts = poptorch.Options().updatableNamedBuffers(["one"])
    model = poptorch.inferenceModel(Buffers(), opts)
    x = torch.ones(3)
    assert model(x) == 9
    model.one.add_(1)
    model.two.add_(1)
    model.copyNamedBuffersToDevice()
    assert model(x) == 12  # "one" reached the device, "two" did not
    plain = poptorch.inferenceModel(Buffers())
    with pytest.raises(poptorch.Error, match="No named buffers marked as updatable"):
        plain(x)
        plain.copyNamedBuffersToDevice()
    with pytest.raises(poptorch.Error, match="not been compiled"):
        poptorch.inferenceModel(Buffers(), opts).copyNamedBuffersToDevice()
    unknown = poptorch.Options().updatableNamedBuffers(["three"])
    with pytest.raises(poptorch.Error, match=r"updatableNamedBuffers names \['three'\]"):
        poptorch.inferenceModel(Buffers(), unknown)(x)  # PopTorch too fails at compilation


def test_compilation_time():
    model = poptorch.inferenceModel(Linear())
    with pytest.raises(
        poptorch.Error, match="Please compile the model before obtaining compilation time."
    ):
        model.compilationTime()
    model(torch.ones(1, 1))
    assert isinstance(model.compilationTime(), datetime.timedelta)
    quiet = poptorch.inferenceModel(Linear(), poptorch.Options().showCompilationProgressBar(False))
    quiet(torch.ones(1, 1))
    with pytest.raises(
        poptorch.Error,
        match="Please set showCompilationProgressBar option to obtain compilation time.",
    ):
        quiet.compilationTime()


@pytest.mark.parametrize("rewrap_executor", [True, False])
def test_destroy_reachable_from_the_model_and_after_rewrapping(rewrap_executor):
    model = Linear(training=True)
    train = poptorch.trainingModel(model)
    train(torch.ones(2, 1))
    model.destroy()  # on the user's module, as PopTorch's wrapper class offers
    train = poptorch.trainingModel(model)
    train(torch.ones(2, 1))
    with pytest.raises(
        RuntimeError,
        match=re.escape(
            "Model has already been wrapped in 'poptorch.trainingModel'. Call model.destroy() "
            "on the model to unwrap before wrapping again."
        ),
    ):
        poptorch.trainingModel(model)
    if rewrap_executor:
        train.destroy()
        train = poptorch.trainingModel(train)
    else:
        model.destroy()
        train = poptorch.trainingModel(model)
    train(torch.ones(2, 1))
    model.destroy()
    assert type(model) is Linear


# -- 10. DataLoader ----------------------------------------------------------------------------


def numbers(n):
    return torch.utils.data.TensorDataset(torch.arange(n, dtype=torch.float32).reshape(n, 1))


def test_async_loader_referenced_only_by_its_iterator_yields_every_batch():
    seen = [
        int(x) for (x,) in DataLoader(poptorch.Options(), numbers(12), mode=DataLoaderMode.Async)
    ]
    assert seen == list(range(12))
    gc.collect()


class Floats(torch.utils.data.Dataset):
    """(At module level, as ``RecordSizes``: the accessor's worker process gets them pickled.)"""

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor([float(i)])


class RecordSizes:
    """A collate function that appends each batch's size to ``path``."""

    def __init__(self, path) -> None:
        self.path = path

    def __call__(self, items):
        with open(self.path, "a") as f:
            f.write(f"{len(items)}\n")
        return torch.stack(items)


def test_async_rebatched_workers_read_the_combined_batch_size(tmp_path):
    record = tmp_path / "sizes"  # collate runs in the accessor's worker process
    opts = poptorch.Options().deviceIterations(4)
    loader = DataLoader(
        opts,
        Floats(),
        mode=DataLoaderMode.AsyncRebatched,
        drop_last=False,
        collate_fn=RecordSizes(record),
    )
    assert [x.flatten().tolist() for x in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    loader.terminate()
    sizes = [int(n) for n in record.read_text().split()]
    assert sizes[:3] == [4, 4, 2]  # PopTorch's worker batch: the combined batch size (the
    # next epoch may already be loading: load_indefinitely)


class NoSamples(torch.utils.data.Dataset):
    """(At module level: the accessor's worker process gets the dataset pickled.)"""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise KeyError("no samples here")


def test_async_dataset_failing_at_start_raises_poptorch_error():
    with pytest.raises(
        poptorch.Error, match="AsynchronousDataAccessor worker thread failed to start"
    ) as info:
        DataLoader(poptorch.Options(), NoSamples(), mode=DataLoaderMode.Async)
    assert isinstance(info.value.__cause__, KeyError)
    loader = DataLoader(poptorch.Options(), NoSamples())
    with pytest.raises(poptorch.Error, match="worker thread failed to start"):
        poptorch.AsynchronousDataAccessor(loader)


def distributed(shuffle_workers):
    opts = poptorch.Options().randomSeed(7)
    opts.Distributed.configureProcessId(0, 2)
    return DataLoader(
        opts,
        numbers(21),
        batch_size=2,
        shuffle=True,
        num_workers=shuffle_workers,
        persistent_workers=shuffle_workers > 0,
    )


def test_global_shuffle_reaches_persistent_workers():
    reference, workers = distributed(0), distributed(1)
    for _ in range(3):  # each epoch a new global order (and the left-over rotating in)
        expected = [x.flatten().tolist() for (x,) in reference]
        assert [x.flatten().tolist() for (x,) in workers] == expected
    epochs = [[x.flatten().tolist() for (x,) in reference] for _ in range(2)]
    assert epochs[0] != epochs[1]
