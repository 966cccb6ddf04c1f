"""``python -m ipuloop.emulate SCRIPT [ARGS...]`` (or ``-m MODULE [ARGS...]``, each after
``--ipus N`` if given): run a PopTorch program (or a module, such as ``pytest``) on the emulator.

``import poptorch`` inside SCRIPT (and in everything it imports) gets ``ipuloop.emulator``
(``popdist`` and ``horovod.torch``, where they are not installed, the emulator's stand-ins),
and so it does in the Python processes SCRIPT starts: loader workers of any start method
(``multiprocessing_context="spawn"``, the default on macOS, or "forkserver") and subprocesses.
SCRIPT runs as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]`` (MODULE as ``python -m``
runs it); its exit status is ours.

The program sees an emulated system of N IPUs (``--ipus N``; default: ``IPULOOP_EMULATOR_IPUS``
if set, else 16), so that a program that asks ``poptorch.ipuHardwareIsAvailable()`` before it
runs, as Lightning's and optimum-graphcore's do, runs. ``--ipus 0`` gives PopTorch's answers
on a machine without IPUs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types
from typing import Sequence

__all__ = ["install", "main", "stand_in", "BINDING"]


# also importable as ``poptorch.<name>``
_SUBMODULES = ("optim", "enums", "options", "poptorch_core", "_logging", "_impl")
# A folder whose ``poptorch`` module binds the emulator when a new interpreter imports it; on
# the module path while the emulator is bound, it also presents a ``poptorch`` distribution of
# the emulated version (importlib.metadata), ``popart``'s enums, and where they are not
# installed ``popdist`` and ``horovod.torch`` (``stand_in``).
BINDING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_binding")


class _Bound(importlib.abc.Loader):
    """Loads ``poptorch`` and ``poptorch.<name>`` as the emulator's modules themselves."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


class _PoptorchFinder(importlib.abc.MetaPathFinder):
    """``import poptorch`` imports the emulator then, not before: as PopTorch, it reads its
    environment variables (``POPTORCH_LOG_LEVEL``, ...) when the program imports it."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "poptorch" and not fullname.startswith("poptorch."):
            return None
        real = "ipuloop.emulator" + fullname[len("poptorch") :]
        return importlib.util.spec_from_loader(fullname, _Bound(importlib.import_module(real)))


def install() -> None:
    """Bind ``poptorch`` (and ``poptorch.<name>``) to the emulator for this process, at once
    if a ``poptorch`` is already imported, else when the program imports it; and for the
    Python processes it starts.

    A spawned or forkserver child takes the parent's ``sys.path``, and a subprocess reads
    ``PYTHONPATH``: both get ``BINDING`` first, so ``import poptorch`` there (the script,
    imported again as ``__mp_main__``, or anything unpickled) binds the emulator too.
    """
    for name in [
        n
        for n, m in sys.modules.items()
        if m is None and (n == "poptorch" or n.startswith("poptorch."))
    ]:
        del sys.modules[name]  # an import blocked before: let it find the emulator
    if not any(isinstance(f, _PoptorchFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PoptorchFinder())
    if "poptorch" in sys.modules:  # another poptorch already imported: replace it now
        import ipuloop.emulator as emulator

        sys.modules["poptorch"] = emulator
        for name in _SUBMODULES:
            sys.modules[f"poptorch.{name}"] = getattr(emulator, name)
    os.environ["IPULOOP_BACKEND"] = "emulator"
    if BINDING not in sys.path:
        sys.path.insert(0, BINDING)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if BINDING not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([BINDING, *paths])


def stand_in(
    name: str,
    emulated: str | None,
    submodules: dict[str, str] | None = None,
    refused: str | None = None,
) -> None:
    """Make ``import NAME`` give the real package NAME where one is installed (anywhere on
    the module path but ``BINDING``), else the emulator's module ``emulated`` (a dotted
    name; None: an empty package), with ``NAME.SUB`` being each of ``submodules``' modules
    (``{SUB: dotted name}``, or ``{SUB: "module:attribute,..."}`` for a module of those
    attributes). With ``refused``, no real NAME is an import error saying it.

    Called by the binding folder's ``popdist`` and ``horovod`` packages while Python imports
    them: what it leaves in ``sys.modules[NAME]`` is what the import gives."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != BINDING]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is not None and spec.loader is not None:  # the real one
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return
    if refused is not None:
        del sys.modules[name]
        raise ModuleNotFoundError(refused, name=name)
    if emulated is None:
        module = types.ModuleType(name, sys.modules[name].__doc__)
        module.__path__ = []  # a package, whose submodules are those below
    else:
        module = importlib.import_module(emulated)
    sys.modules[name] = module
    for sub, target in (submodules or {}).items():
        if ":" in target:
            source, names = target.split(":")
            child = types.ModuleType(f"{name}.{sub}", importlib.import_module(source).__doc__)
            for attribute in names.split(","):
                setattr(child, attribute, getattr(importlib.import_module(source), attribute))
        else:
            child = importlib.import_module(target)
        sys.modules[f"{name}.{sub}"] = child
        setattr(module, sub, child)


PROG = "python -m ipuloop.emulate"
USAGE = f"{PROG} [-h] [--ipus N] (SCRIPT | -m MODULE) [ARGS ...]"


def parser() -> argparse.ArgumentParser:
    """The command line as ``--help`` shows it. ``main`` reads the options itself, only
    before SCRIPT (or -m MODULE): everything after belongs to the program, ``--help``
    included."""
    p = argparse.ArgumentParser(
        prog=PROG,
        usage=USAGE,
        description=(
            "Run a PopTorch program (or a module, such as pytest) on ipuloop's emulator: "
            "`import poptorch` in it, and in the Python processes it starts, gets the "
            "emulator. SCRIPT runs as __main__ with sys.argv = [SCRIPT, ARGS...]; its exit "
            "status is this command's."
        ),
        epilog=(
            f"example: {PROG} train.py --epochs 1   (train.py gets --epochs 1; "
            f"`{PROG} train.py --help` shows train.py's help)"
        ),
    )
    p.add_argument(
        "--ipus",
        metavar="N",
        help="IPUs of the emulated system, so that poptorch.ipuHardwareIsAvailable() answers "
        "as on a machine with them; 0: none (default: $IPULOOP_EMULATOR_IPUS, else 16)",
    )
    p.add_argument(
        "-m",
        metavar="MODULE",
        dest="module",
        help="run MODULE as `python -m MODULE` does, instead of a SCRIPT (default: none)",
    )
    p.add_argument("script", metavar="SCRIPT", nargs="?", help="the program's file")
    p.add_argument(
        "args",
        metavar="ARGS",
        nargs="*",
        help="the program's arguments, passed to it untouched (--help included)",
    )
    return p


def _usage(message: str) -> None:
    parser().error(message)  # the usage line and "PROG: error: MESSAGE" on stderr, status 2


def _options(argv: list[str]) -> tuple[str, list[str]]:
    """The IPUs and what runs (``[SCRIPT, ARGS...]`` or ``["-m", MODULE, ARGS...]``): the
    options are read up to SCRIPT or MODULE only."""
    ipus = os.environ.get("IPULOOP_EMULATOR_IPUS", "16")
    while argv and argv[0].startswith("-") and argv[0] != "-m":
        option, eq, value = argv[0].partition("=")
        if option in ("-h", "--help"):
            parser().print_help()
            raise SystemExit(0)
        if option == "--":
            argv = argv[1:]
            break
        if option != "--ipus":
            _usage(f"unrecognized option {argv[0]!r} before SCRIPT (options after it go to SCRIPT)")
        if not eq:
            value = (argv[1:2] or [""])[0]
        argv = argv[1:] if eq else argv[2:]
        if not value.isdigit():
            _usage(
                f"--ipus takes the number of IPUs of the emulated system (0: none); got {value!r}"
            )
        ipus = value
    if not argv:
        _usage("the following arguments are required: SCRIPT (or -m MODULE)")
    if argv[0] == "-m" and len(argv) < 2:
        _usage("argument -m: expected MODULE")
    if argv[0] != "-m" and not os.path.isfile(argv[0]):
        _usage(f"no such script: {argv[0]}")
    return ipus, argv


def main(argv: list[str] | None = None) -> None:
    ipus, argv = _options(list(sys.argv[1:] if argv is None else argv))
    os.environ["IPULOOP_EMULATOR_IPUS"] = ipus  # inherited by the processes it starts
    install()
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]  # run_module sets sys.argv[0] to the module's file, as python -m
            sys.path.insert(0, os.getcwd())
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except BaseException as e:
        if not (isinstance(e, SystemExit) and e.code in (None, 0)):
            _leave_at_once(e)
        raise


def _leave_at_once(error: BaseException) -> None:
    """A program that failed leaves its process group at once, not meeting the other
    instances at exit (they may be waiting in a collective for it): their waits then fail,
    and a launcher sees this instance end (the loop's instances leave so on an error too).
    First it leaves its error in the group's store as the run's first failure, unless an
    instance did before (``rules.tell_launcher``: ``python -m ipuloop.emulate.poprun`` names
    it)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        import datetime

        from ..group_teardown import destroy_group
        from ..rules import tell_launcher

        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=3))
        error_text = f"{type(error).__name__}: {error}"[:4000]
        tell_launcher(store, {"instance": dist.get_rank(), "error": error_text})
        destroy_group()
    except Exception:  # noqa: BLE001 (leaving a broken group: the exit is what matters)
        pass
