"""What PopTorch prints and what programs reach besides the model API: ``poptorch.logger`` and
its levels, ``poptorch.poptorch_core``'s error classes, the log lines PopTorch's users and
tests match on, and the AsynchronousDataAccessor / Block details PopTorch's tests check.

Each test names the PopTorch 3.4 source (graphcore/poptorch) whose behaviour it pins.
"""

from __future__ import annotations

import re

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
import warm

import ipuloop.emulator as poptorch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _warn_level():
    """Each test starts at PopTorch's default level (WARN) and leaves it there."""
    poptorch.setLogLevel("WARN")
    yield
    poptorch.setLogLevel("WARN")


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=ROOT, **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


# -- 4. poptorch.logger and poptorch.poptorch_core -----------------------------------------


def test_logger_is_poptorchs_console_logger(capfd):
    """python/_logging.py (``logger = logging.getLogger("poptorch::python")`` with a console
    handler and ``_PoptorchFormatter``: ``[time] [name] [level] message``, level in lower
    case) and python/__init__.py (``from ._logging import logger``)."""
    assert isinstance(poptorch.logger, logging.Logger)
    assert poptorch.logger.name == "poptorch::python"
    poptorch.logger.warning("from a user program %d", 7)
    poptorch.logger.info("not shown at WARN")
    err = capfd.readouterr().err
    assert "[poptorch::python] [warning] from a user program 7" in err
    assert "not shown at WARN" not in err


@pytest.mark.parametrize(
    "level, shown",
    [
        ("OFF", []),
        ("ERR", ["error"]),
        ("WARN", ["error", "warning"]),
        ("INFO", ["error", "warning", "info"]),
        ("DEBUG", ["error", "warning", "info", "debug"]),
        ("TRACE", ["error", "warning", "info", "debug"]),
        (1, ["error", "warning", "info", "debug"]),
        (4, ["error"]),
    ],
)
def test_set_log_level_filters_the_logger(capfd, level, shown):
    """python/_logging.py ``setLogLevel``: each name (or legacy integer) maps to a Python
    level; TRACE is DEBUG on the Python side."""
    poptorch.setLogLevel(level)
    for name in ("error", "warning", "info", "debug"):
        getattr(poptorch.logger, name)(f"message at {name}")
    err = capfd.readouterr().err
    assert [n for n in ("error", "warning", "info", "debug") if f"message at {n}" in err] == shown


def test_poptorch_log_level_is_read_at_import():
    """python/_logging.py: ``setLogLevel(os.environ.get("POPTORCH_LOG_LEVEL", "WARN"))`` at
    import; an unknown value fails the import."""
    code = """
        import logging, poptorch
        print(logging.getLevelName(poptorch.logger.level))
        poptorch.logger.debug("debug line shown")
    """
    emulated = "import ipuloop.emulate; ipuloop.emulate.install()\n"
    r = _run_python(emulated + textwrap.dedent(code), POPTORCH_LOG_LEVEL="DEBUG")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["DEBUG"] and "debug line shown" in r.stderr
    r = _run_python(emulated + textwrap.dedent(code), POPTORCH_LOG_LEVEL="LOUD")
    assert r.returncode != 0
    assert "Unknown log level: LOUD" in r.stderr and "POPTORCH_LOG_LEVEL" in r.stderr


def test_poptorch_core_error_classes():
    """python/__init__.py: ``from poptorch.poptorch_core import Error, RecoverableError,
    UnrecoverableError``; python/poptorch.cpp ``initialiseExceptionHandling`` makes both
    subclasses of ``Error``."""
    core = poptorch.poptorch_core
    assert core.Error is poptorch.Error
    assert poptorch.RecoverableError is core.RecoverableError
    assert poptorch.UnrecoverableError is core.UnrecoverableError
    for cls in (core.RecoverableError, core.UnrecoverableError):
        assert issubclass(cls, poptorch.Error)
    with pytest.raises(poptorch.Error):
        raise core.RecoverableError("Reboot needed")


def test_poptorch_core_hooks_are_refused_clearly():
    """python/poptorch.cpp binds compiler hooks (``_validateOptions``, ``_throwTestError``,
    ...) that need the Poplar compiler: they raise ``poptorch.Error`` naming the hook, and
    ``hasattr`` sees them missing. ``TestErrorType`` (poptorch.cpp) exists so modules that
    parametrize over it import."""
    core = poptorch.poptorch_core
    with pytest.raises(
        poptorch.Error, match="poptorch_core._validateOptions belongs to PopTorch's compiled core"
    ):
        core._validateOptions({})
    assert not hasattr(core, "getTracedGraph")
    assert [m.name for m in core.TestErrorType][-2:] == [
        "PoplarRecoverableFullReset",
        "PoplarLinkError",
    ]


def test_import_poptorch_submodules_under_emulate():
    """python/__init__.py imports ``poptorch.poptorch_core`` and ``poptorch._logging`` as
    submodules: under ``python -m ipuloop.emulate`` both import paths give the one module
    (one ``Error`` class, one logger)."""
    r = _run_python("""
        import ipuloop.emulate; ipuloop.emulate.install()
        import poptorch
        import poptorch.poptorch_core as core
        from poptorch import _logging
        assert core is poptorch.poptorch_core and core.Error is poptorch.Error
        assert _logging.logger is poptorch.logger
        poptorch._logging.setPopartLogLevel("INFO")
        try:
            poptorch._logging.setPopartLogLevel("LOUD")
        except ValueError as e:
            print(e)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Level must be one of TRACE, DEBUG, INFO, WARN, ERR, OFF")


# -- 5. the log lines PopTorch prints ------------------------------------------------------


class _Add(nn.Module):
    def forward(self, x, y):
        return x + y


class _Weighted(nn.Module):
    """x * w, trained towards 0 (an identity loss on its square)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x):
        out = x * self.w
        return out, poptorch.identity_loss((out**2).sum(), reduction="none")


def test_graph_compilation_says_once_what_the_emulator_does(capfd, monkeypatch):
    """python/_options_impl.py ``ProgressBar``: a tqdm bar "Graph compilation" on stderr
    while the model compiles, unless ``Options.showCompilationProgressBar(False)``. The
    emulator's compilation is a trace, over in a moment: where the bar would be, it says so
    once per process, with the device and the time it took, instead of a bar at 100% each
    time."""
    from ipuloop.emulator import _logging

    monkeypatch.setattr(_logging, "_compilation_told", [False])  # a fresh process
    opts = poptorch.Options().showCompilationProgressBar(False)
    poptorch.inferenceModel(_Add(), opts)(torch.ones(2), torch.ones(2))
    assert "Graph compilation" not in capfd.readouterr().err  # switched off: nothing
    model = poptorch.inferenceModel(_Add())
    model(torch.ones(2), torch.ones(2))
    err = capfd.readouterr().err
    assert re.fullmatch(
        r"Graph compilation \(emulated\): the model was traced and checked on cpu in "
        r"\d+\.\d\ds; there is no Poplar graph to compile, and later compilations of this "
        r"process say nothing\.\n",
        err,
    ), err
    model(torch.ones(2), torch.ones(2))  # no compilation
    poptorch.inferenceModel(_Add())(torch.ones(2), torch.ones(2))  # another one
    assert "Graph compilation" not in capfd.readouterr().err
    assert "%|" not in err  # no bar


def test_options_from_a_file_are_logged_at_compile(capfd, tmp_path):
    """popart_compiler/source/SessionOptions.cpp ``Setter``: each option the compiler receives
    is logged at DEBUG as "poptorch.Options set NAME to value VALUE" (tests/options_test.py
    ``test_set_options_from_file``)."""
    conf = tmp_path / "opts.conf"
    conf.write_text(
        "deviceIterations(1)\nsetExecutionStrategy(poptorch.ShardedExecution())\n"
        "  replicationFactor(1)\nenableSyntheticData(True) # comment\n"
    )
    wanted = [
        "poptorch.Options set replication_factor to value 1",
        "poptorch.Options set device_iterations to value 1",
        "poptorch.Options set execution_mode to value 1",
        "poptorch.Options set syntheticDataMode to value 2",
    ]
    opts = poptorch.Options()
    opts.loadFromFile(str(conf))
    poptorch.inferenceModel(_Add(), opts)(torch.ones(2), torch.ones(2))
    err = capfd.readouterr().err
    assert not any(w in err for w in wanted)  # DEBUG lines: not shown at WARN
    poptorch.setLogLevel("DEBUG")
    opts = poptorch.Options()
    opts.loadFromFile(str(conf))
    poptorch.inferenceModel(_Add(), opts)(torch.ones(2), torch.ones(2))
    err = capfd.readouterr().err
    for line in wanted:
        assert f"[poptorch::python] [debug] {line}\n" in err


def test_backend_options_are_logged_as_popart_receives_them(capfd):
    """popart_compiler/source/SessionOptions.cpp: a dict option's entries as "set NAME[KEY]
    to VALUE", a list's items as "added ITEM to NAME", booleans as true/false
    (tests/options_test.py ``test_set_popart_options``)."""
    poptorch.setLogLevel("DEBUG")
    opts = poptorch.Options()
    opts._Popart.set("engineOptions", {"debug.allowOutOfMemory": "true"})
    opts._Popart.set("dotChecks", ["FINAL", "ALL"])
    opts._Popart.set("enableOutlining", True)
    opts._Popart.set("batchSerializationSettings.factor", 1)
    poptorch.inferenceModel(_Add(), opts)(torch.ones(2), torch.ones(2))
    err = capfd.readouterr().err
    for line in (
        "poptorch.Options set engineOptions[debug.allowOutOfMemory] to true",
        "poptorch.Options added FINAL to dotChecks",
        "poptorch.Options added ALL to dotChecks",
        "poptorch.Options set enableOutlining to value true",
        "poptorch.Options set batchSerializationSettings.factor to value 1",
    ):
        assert line in err
    # the user set engineOptions without debug.retainDebugInformation: the compiler adds it
    assert "engineOptions[debug.retainDebugInformation] set to value false" in err


class _TwoStages(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x):
        with poptorch.Block(ipu_id=0):
            x = self.a(x)
        with poptorch.Block(ipu_id=1):
            x = self.b(x)
        return x


@pytest.mark.parametrize(
    "strategy, two_ipus, expected",
    [("pipelined", True, 1), ("pipelined", False, 0), ("sharded", True, 0)],
)
def test_enable_pipelining_is_logged(capfd, strategy, two_ipus, expected):
    """popart_compiler/source/Compiler.cpp ``initSession``: PipelinedExecution sets
    enablePipelining when the model uses more than one IPU, ShardedExecution never; logged as
    "enablePipelining set to value N" (tests/pipelining_test.py, sharding_test.py)."""
    poptorch.setLogLevel("DEBUG")
    opts = poptorch.Options().deviceIterations(2)
    opts.setExecutionStrategy(
        poptorch.PipelinedExecution() if strategy == "pipelined" else poptorch.ShardedExecution()
    )
    model = _TwoStages() if two_ipus else nn.Linear(2, 2)
    poptorch.inferenceModel(model, opts)(torch.ones(4, 2))
    err = capfd.readouterr().err
    assert f"enablePipelining set to value {expected}\n" in err
    assert f"enablePipelining set to value {1 - expected}" not in err


def test_optimizer_warnings_go_through_poptorch_logger(capfd):
    """python/_optimizer_attributes.py ``_toPoptorchOptimizer`` (subclass warning) and
    ``OptimizerAttrTracker._check`` ("Ignoring unexpected optimizer attribute", WARNING; DEBUG
    after ``relaxOptimizerAttributesChecks``), both on ``poptorch.logger``."""

    class MySGD(torch.optim.SGD):
        pass

    model = _Weighted()
    opt = MySGD(model.parameters(), lr=0.1)
    train = poptorch.trainingModel(model, optimizer=opt)
    train(torch.ones(3))
    opt.extra = 1
    train.setOptimizer(opt)
    err = capfd.readouterr().err
    assert (
        "[poptorch::python] [warning] Optimizer `MySGD` subclassed from classes in "
        "poptorch.optim or torch.optim are unlikely to behave as intended. Poptorch does "
        "not run Python optimizer code directly" in err
    )
    assert (
        "[poptorch::python] [warning] Ignoring unexpected optimizer attribute in SGD "
        "optimizer: ['extra']" in err
    )
    relaxed = _Weighted()
    opt = torch.optim.SGD(relaxed.parameters(), lr=0.1)
    opts = poptorch.Options().relaxOptimizerAttributesChecks()
    train = poptorch.trainingModel(relaxed, opts, optimizer=opt)
    train(torch.ones(3))
    opt.extra = 1
    train.setOptimizer(opt)
    assert "unexpected optimizer attribute" not in capfd.readouterr().err
    poptorch.setLogLevel("DEBUG")
    opt.other = 2
    train.setOptimizer(opt)
    assert (
        "[debug] Ignoring unexpected optimizer attribute in SGD optimizer: ['extra', 'other']"
        in capfd.readouterr().err
    )


@pytest.mark.parametrize("optim", [poptorch.optim.SGD, torch.optim.SGD])
def test_optimizer_state_read_back_is_logged(capfd, optim):
    """python/_poplar_executor.py ``_read_optim_state_dict_if_needed`` ("Using cached optimiser
    state dict", DEBUG) and popart_compiler/source/Compiler.cpp ("Writing optimiser state
    tensors from IPU to host." / "... from host to IPU memory.", INFO): a poptorch.optim
    optimizer's state is read back after compile, after a run and on detach, and written on
    attach after ``load_state_dict`` (tests/optimizers_test.py ``test_read_ipu_state_*``)."""
    poptorch.setLogLevel("DEBUG")
    model = _Weighted()
    optimizer = optim(model.parameters(), lr=0.0)
    train = poptorch.trainingModel(model, optimizer=optimizer)
    train.compile(torch.ones(3))
    capfd.readouterr()
    ours = isinstance(optimizer, poptorch.optim.Optimizer)
    optimizer.state_dict()
    err = capfd.readouterr().err
    assert ("[info] Writing optimiser state tensors from IPU to host." in err) == ours
    optimizer.state_dict()
    assert ("Using cached optimiser state dict" in capfd.readouterr().err) == ours
    train(torch.ones(3))
    train.detachFromDevice()
    assert ("Writing optimiser state tensors from IPU to host." in capfd.readouterr().err) == ours
    state = optimizer.state_dict()
    assert ("Using cached optimiser state dict" in capfd.readouterr().err) == ours
    optimizer.load_state_dict(state)
    train.attachToDevice()
    assert (
        "[info] Writing optimiser state tensors from host to IPU memory." in capfd.readouterr().err
    ) == ours


def test_is_compiling_with_dispatcher_only_while_compiling():
    """python/poptorch.cpp ``isCompilingWithDispatcher``: True while PopTorch traces the model
    to compile it, False before and after, also after a failed compilation (tests/
    tensor_ops_test.py ``op_harness`` checks that)."""
    seen = []

    class Spy(nn.Module):
        def forward(self, x):
            seen.append(poptorch.poptorch_core.isCompilingWithDispatcher())
            if x.shape[0] == 3:
                raise ValueError("refused")
            return x * 2

    model = poptorch.inferenceModel(Spy())
    assert not poptorch.poptorch_core.isCompilingWithDispatcher()
    model(torch.ones(2))
    model(torch.ones(2))
    assert seen == [True, False, False]  # the trace, then the two runs
    with pytest.raises(ValueError, match="refused"):
        poptorch.inferenceModel(Spy())(torch.ones(3))
    assert not poptorch.poptorch_core.isCompilingWithDispatcher()


def test_poptorch_reads_its_environment_when_the_program_imports_it(tmp_path):
    """python/_logging.py reads POPTORCH_LOG_LEVEL when ``poptorch`` is imported: a program
    run with ``python -m ipuloop.emulate`` that sets it before ``import poptorch`` gets that
    level (PopTorch's tests/dataloader_test.py sets it so)."""
    script = tmp_path / "prog.py"
    script.write_text(
        textwrap.dedent("""
        import os
        os.environ["POPTORCH_LOG_LEVEL"] = "INFO"
        import logging, poptorch
        import poptorch.data
        print(logging.getLevelName(poptorch.logger.level), poptorch.__name__,
              poptorch.data is poptorch.DataLoader.__module__ and False or
              poptorch.data.DataLoader is poptorch.DataLoader)
    """)
    )
    r = subprocess.run(
        [sys.executable, "-m", "ipuloop.emulate", str(script)],
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["INFO", "ipuloop.emulator", "True"]


# -- 8. AsynchronousDataAccessor's worker process, Block details ----------------------------


class _Pids(torch.utils.data.Dataset):
    """Each sample: the id of the process that read it."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([os.getpid(), i])


def test_accessor_reads_in_a_worker_process_whose_pid_is_logged(capfd):
    """python/_dataloader.py ``_AsynchronousWorker._start`` / ``_mainLoopNoInterrupt``: the
    dataset is read in a worker process; at DEBUG PopTorch logs "AsynchronousDataAccessor
    parent process: PID" and "... worker process: PID" (tests/dataloader_test.py finds the
    worker's PID there to Ctrl-C it)."""
    poptorch.setLogLevel("DEBUG")
    loader = poptorch.DataLoader(
        poptorch.Options(), _Pids(), batch_size=2, mode=poptorch.DataLoaderMode.Async
    )
    worker = loader._accessor._worker
    assert worker.pid != os.getpid() and worker.isAlive()
    batches = list(loader)
    assert [int(i) for b in batches for i in b[:, 1]] == list(range(8))
    assert {int(p) for b in batches for p in b[:, 0]} == {worker.pid}
    loader.terminate()
    assert not worker.isAlive()
    err = capfd.readouterr().err
    assert f"[debug] AsynchronousDataAccessor parent process: {os.getpid()}" in err
    assert f"[debug] AsynchronousDataAccessor worker process: {worker.pid}" in err


def _ready_slots(loader) -> int:
    return sum(loader._accessor._worker._data_buffers.indices_mem)


def test_early_preload_fills_the_buffers_before_iterating():
    """python/_dataloader.py ``_mainLoopNoInterrupt``: the worker reads the first batch at once
    and, with ``early_preload``, goes on filling its ``buffer_size`` buffers before the first
    ``iter()`` (tests/dataloader_test.py ``test_early_preload``)."""
    import time

    def loader(preload: bool):
        return poptorch.DataLoader(
            poptorch.Options(),
            _Pids(),
            batch_size=1,
            num_workers=1,
            mode=poptorch.DataLoaderMode.Async,
            async_options={"early_preload": preload, "buffer_size": 5},
        )

    preload, no_preload = loader(True), loader(False)
    deadline = time.monotonic() + 60
    while _ready_slots(preload) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _ready_slots(preload) == 5
    assert _ready_slots(no_preload) == 1
    assert len(list(no_preload)) == 8 and len(list(preload)) == 8
    preload.terminate()
    no_preload.terminate()


@pytest.mark.slow  # (a child program whose accessor's worker process is interrupted)
def test_ctrl_c_in_the_accessor_prints_nothing():
    """python/_dataloader.py ``_mainLoop``: a worker interrupted by SIGINT ends quietly, and
    so does the program interrupted after it (tests/dataloader_test.py
    ``test_KeyboardInterrupt_in_async_data_accessor``: only [debug] and the program's lines)."""
    import re
    import signal

    code = textwrap.dedent("""
        import os, signal, time
        # Ctrl-C raises KeyboardInterrupt here (and in the forked worker) also when this test
        # runs with SIGINT ignored (nohup, a background job): Python then installs no handler.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ["POPTORCH_LOG_LEVEL"] = "DEBUG"
        import ipuloop.emulate; ipuloop.emulate.install()
        import poptorch, torch
        data = torch.utils.data.TensorDataset(torch.randn(64, 3), torch.arange(64))
        loader = poptorch.DataLoader(poptorch.Options(), data, batch_size=4, num_workers=2,
                                     mode=poptorch.DataLoaderMode.Async)
        for _ in loader:
            pass
        try:
            print("[control] ready", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("[control] interrupted", flush=True)
    """)
    proc = warm.Popen(
        [sys.executable, "-u", "-c", code],
        env=dict(os.environ, PYTHONPATH=ROOT),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, worker = [], None
    for line in proc.stdout:
        lines.append(line)
        found = re.match(r".*AsynchronousDataAccessor worker process: (\d+)", line)
        worker = int(found.group(1)) if found else worker
        if line.startswith("[control] ready"):
            break
    assert worker is not None, "".join(lines)
    os.kill(worker, signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    lines += list(proc.stdout)
    assert proc.wait(timeout=60) == 0
    assert "[control] interrupted\n" in lines
    unexpected = [x for x in lines if "[debug]" not in x and "[control]" not in x]
    assert not unexpected, "".join(lines)


class BrokenDataset(torch.utils.data.Dataset):
    """(At module level: the accessor's worker process gets the dataset pickled.)"""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        assert False, "Broken dataset"


def test_broken_dataset_worker_prints_its_traceback(capfd):
    """python/_dataloader.py: a dataset that fails in the worker process prints its traceback
    there ("worker thread failed to start (Check above for details)"; tests/dataloader_test.py
    ``test_subprocess_broken_dataset`` looks for "AssertionError: Broken dataset")."""

    data = poptorch.DataLoader(poptorch.Options(), BrokenDataset(), batch_size=1)
    with pytest.raises(poptorch.Error, match="worker thread failed to start"):
        poptorch.AsynchronousDataAccessor(data)
    err = capfd.readouterr().err
    assert "Traceback" in err and "AssertionError: Broken dataset" in err


class BlockFnModel(nn.Module):
    """tests/pipelining_test.py's model of two block functions."""

    def forward(self, x):
        poptorch.Block.useAutoId()
        return self.mult_2(self.mult_4(x))

    @poptorch.BlockFunction(ipu_id=0)
    def mult_4(self, x):
        return x * 4

    @poptorch.BlockFunction(ipu_id=1)
    def mult_2(self, x):
        return x * 2


def test_pickling_a_wrapped_model_with_block_functions():
    """tests/pipelining_test.py ``test_block_function_saving``: ``torch.save`` of an
    inferenceModel whose model has block functions; loaded, it runs as a new wrapper."""
    import io

    opts = poptorch.Options().deviceIterations(2)
    model = poptorch.inferenceModel(BlockFnModel(), opts)
    model(torch.ones(2, 2))
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = (
        torch.load(buf, weights_only=False)
        if "weights_only" in torch.load.__code__.co_varnames
        else torch.load(buf)
    )
    assert torch.equal(loaded(torch.ones(2, 2)), torch.full((2, 2), 8.0))


def model_fn(x):
    return x * 3


def test_legacy_begin_block_on_a_function():
    """python/ops.py ``BeginBlock`` / ``LegacyBeginBlockFn``: a plain callable gets a wrapper
    with ``_user_id`` and ``_ipu_id`` that pickles (tests/pipelining_test.py
    ``test_begin_block_with_function``)."""
    import io

    block = poptorch.BeginBlock(model_fn, 1, 2)
    assert (block._user_id, block._ipu_id) == (1, 2)
    assert torch.equal(block(torch.ones(2)), torch.full((2,), 3.0))
    torch.save(block, io.BytesIO())


def test_wrapper_repr_shows_begin_blocks():
    """python/_poplar_executor.py ``PoplarExecutor.__repr__``: the model as
    ``module_repr`` shows it, each BeginBlock before its module (tests/pipelining_test.py
    ``test_begin_block_printing``)."""
    model = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
    poptorch.BeginBlock(model[0], ipu_id=1)
    text = repr(poptorch.inferenceModel(model))
    assert text == poptorch.module_repr(model)
    assert "(0): BeginBlock(user_id=None, ipu_id=1) Linear(" in text


class _GrowingBatches(torch.utils.data.Sampler):
    """Batches of 1, 2, 3 ... indices: no length known in advance (no ``__len__``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        start, size = 0, 1
        while start + size <= self.n:
            yield list(range(start, start + size))
            start, size = start + size, size + 1


@pytest.mark.parametrize("mode", [poptorch.DataLoaderMode.Sync, poptorch.DataLoaderMode.Async])
def test_batch_sampler_without_length(mode):
    """python/__init__.py ``_batch_sampler_len`` (a batch sampler may have no length) and
    ``AsynchronousDataAccessor.__init__`` (no drop_last check with a user's batch_sampler):
    tests/dataloader_test.py ``test_custom_batch_sampler*``. Two batches per model call
    (deviceIterations(2)) are concatenated."""
    data = torch.utils.data.TensorDataset(torch.arange(10.0))
    loader = poptorch.DataLoader(
        poptorch.Options().deviceIterations(2), data, batch_sampler=_GrowingBatches(10), mode=mode
    )
    got = [b[0].tolist() for b in loader]
    assert got == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]]
    loader.terminate()


def test_input_and_compile_warnings_in_poptorch_words(capfd):
    """python/_poplar_executor.py ``_preprocessGraph`` ("Input tensor has requires_grad=True
    set. This tensor will be detached because backward pass via inputs is not supported.") and
    ``compile`` ("Call to compile() ignored: the executable is already compiled"), both
    warnings on ``poptorch.logger``, the first at each compilation (tests/tensor_ops_test.py
    ``test_requires_grad_true``)."""
    model = poptorch.inferenceModel(nn.Linear(1, 1))
    model(torch.tensor([0.0], requires_grad=True))
    model.compile(torch.tensor([0.0]))
    err = capfd.readouterr().err
    assert (
        "[warning] Input tensor has requires_grad=True set. This tensor will be detached "
        "because backward pass via inputs is not supported.\n" in err
    )
    assert "[warning] Call to compile() ignored: the executable is already compiled\n" in err
    model(torch.tensor([0.0], requires_grad=True))  # compiled: not said again
    poptorch.inferenceModel(nn.Linear(1, 1))(torch.tensor([0.0], requires_grad=True))
    assert capfd.readouterr().err.count("Input tensor has requires_grad=True set") == 1
