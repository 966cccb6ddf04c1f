"""``python -m ipuloop.emulate.poprun``: poprun's command line read (options used, ignored,
refused by name), the environment each instance gets, the command it runs, and two instances of
a model-garden-like program trained in one process group; a failing instance ends the others."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from launch import clean_env, free_port
import warm

from ipuloop.emulate import BINDING, poprun


def test_defaults_one_instance_and_a_replica_each():
    top = poprun.parse(["python", "train.py", "--epochs", "1"])
    assert (top.instances, top.replicas, top.ipus_per_replica) == (1, 1, 1)
    assert top.command == ["python", "train.py", "--epochs", "1"]
    top = poprun.parse(["--num-instances=2", "python3", "train.py"])
    assert (top.instances, top.replicas, top.local_replicas) == (2, 2, 1)


def test_help_shows_the_usage_and_each_option_s_default(capsys):
    with pytest.raises(SystemExit) as e:
        poprun.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "usage: python -m ipuloop.emulate.poprun [-h] [OPTIONS] COMMAND [ARGS ...]\n"
    )
    assert '"""' not in out and "``" not in out  # argparse's help, not the module docstring
    actions = [a for a in poprun.parser()._actions if a.option_strings and a.dest != "help"]
    assert {o for a in actions for o in a.option_strings} == poprun._USED  # each it reads
    for a in actions:
        assert a.help and "(default: " in a.help, a.option_strings


def test_no_command_is_the_usage_and_exit_2_and_a_command_s_help_is_its_own(capsys):
    with pytest.raises(SystemExit) as e:
        poprun.main(["--num-instances", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("usage: python -m ipuloop.emulate.poprun")
        and "error: no command to run" in err
    )
    top = poprun.parse(["--num-instances", "2", "python", "train.py", "--help", "-H", "x"])
    assert top.command == ["python", "train.py", "--help", "-H", "x"] and top.instances == 2


def test_the_model_garden_s_options_are_read_or_taken():
    top = poprun.parse(
        [
            "-vv",
            "--num-instances=2",
            "--num-replicas",
            "8",
            "--ipus-per-replica=4",
            "--vipu-server-host=$HOST",
            "--vipu-partition=p",
            "--reset-partition=no",
            "--update-partition=yes",
            "--remove-partition",
            "no",
            "--numa-aware",
            "--sync-type=ST_POD_NATIVE_DEFAULT",
            "--executable-cache-path=/tmp/cache",
            "--mpi-global-args=--tag-output --mca btl_tcp_if_include eno1",
            "--mpi-local-args=-x OMPI_MCA_x=1 -x KEEP=yes",
            "--only-output-from-instance=0",
            "--host=localhost",
            "python",
            "train.py",
        ]
    )
    assert (top.instances, top.replicas, top.ipus_per_replica, top.local_replicas) == (2, 8, 4, 4)
    assert top.only_output_from == 0
    assert top.exports == {
        "POPTORCH_CACHE_DIR": "/tmp/cache",
        "OMPI_MCA_x": "1",
        "KEEP": "yes",
    }
    assert top.command == ["python", "train.py"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--offline-mode=yes", "python", "t.py"], "poprun's --offline-mode is not supported"),
        (["--frobnicate", "python", "t.py"], "poprun's --frobnicate is not supported"),
        (["--host=otherhost", "python", "t.py"], "not on otherhost"),
        (["--num-ilds=2", "python", "t.py"], "--num-ilds 2"),
        (["--num-instances=2", "--num-replicas=3", "python", "t.py"], "not a multiple"),
        (["--num-instances=0", "python", "t.py"], "positive integer"),
        (["--num-instances=2", "--only-output-from-instance=2", "python", "t.py"], "0..1"),
        (["--mpi-local-args=-np 2 oops", "python", "t.py"], "'oops' is no mpirun option"),
        (["--num-instances=2"], "no command to run"),
    ],
)
def test_what_it_cannot_run_is_refused_by_name(args, message):
    with pytest.raises(poprun.UsageError, match=message):
        poprun.parse(args)


def test_each_instance_gets_poprun_s_mpirun_s_and_the_group_s_environment():
    top = poprun.parse(["--num-instances=2", "--num-replicas=8", "--ipus-per-replica=2", "x"])
    env = poprun.instance_env(top, 1, {"PYTHONPATH": "/elsewhere"}, 12345)
    assert {k: v for k, v in env.items() if k.startswith("POPDIST_")} == {
        "POPDIST_NUM_TOTAL_REPLICAS": "8",
        "POPDIST_NUM_LOCAL_REPLICAS": "4",
        "POPDIST_NUM_IPUS_PER_REPLICA": "2",
        "POPDIST_REPLICA_INDEX_OFFSET": "4",
        "POPDIST_LOCAL_INSTANCE_INDEX": "1",
        "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE": "1",
    }
    assert (env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"]) == ("1", "2")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("1", "2", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "12345")
    assert env["IPULOOP_EMULATOR_IPUS"] == "16"  # the 16 IPUs hold 8 replicas x 2
    assert env["PYTHONPATH"].split(":") == [BINDING, "/elsewhere", poprun.ROOT]
    assert (Path(poprun.ROOT) / "ipuloop" / "__init__.py").is_file()  # ipuloop, where not installed
    big = poprun.parse(["--num-instances=2", "--num-replicas=16", "--ipus-per-replica=4", "x"])
    assert poprun.instance_env(big, 0, {}, 1)["IPULOOP_EMULATOR_IPUS"] == "64"


def test_a_python_command_runs_on_the_emulator_and_another_as_it_is():
    def cmd(*args: str) -> list[str]:
        return poprun.command_line(poprun.parse(list(args)))

    emulate = [sys.executable, "-m", "ipuloop.emulate"]
    assert cmd("python3", "train.py", "--x") == [*emulate, "train.py", "--x"]
    unbuffered = [sys.executable, "-u", *emulate[1:], "-m", "pkg.train"]
    assert cmd("python", "-u", "-m", "pkg.train") == unbuffered
    assert cmd("/usr/bin/python3.8", "t.py") == [*emulate, "t.py"]
    assert cmd("bash", "run.sh") == ["bash", "run.sh"]
    with pytest.raises(poprun.UsageError, match="python -c"):
        cmd("python", "-c", "print(1)")


# A program as the model garden writes one: popdist and Horovod imported at module level,
# popdist.poptorch.Options under poprun, the seed broadcast, logged values all-reduced.
GARDEN = textwrap.dedent(
    """
    import popdist
    import popdist.poptorch
    import horovod.torch as hvd
    import poptorch
    import torch

    if popdist.isPopdistEnvSet():
        popdist.init()
        hvd.init()
        opts = popdist.poptorch.Options()
    else:
        opts = poptorch.Options()
    seed = int(hvd.broadcast(torch.tensor([42 + popdist.getInstanceIndex()]), root_rank=0))
    opts.randomSeed(seed)
    torch.manual_seed(seed)


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x, y):
            out = self.fc(x)
            return out, torch.nn.functional.mse_loss(out, y)


    net = Net()
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    model = poptorch.trainingModel(net, opts, torch.optim.SGD(net.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(popdist.getInstanceIndex())  # each instance its data
    for step in range(3):
        _, loss = model(torch.randn(2 * opts.replication_factor, 4, generator=g),
                        torch.randn(2 * opts.replication_factor, 2, generator=g))
    model.copyWeightsToHost()
    mean_loss = hvd.allreduce(loss.mean().detach()).item()
    ranks = hvd.allreduce(torch.tensor(float(hvd.rank() + 1)), op=hvd.Sum).item()
    every = set(range(popdist.getNumInstances()))
    total = popdist.execute_on_instances(every, lambda: hvd.allreduce(torch.ones(1), op=hvd.Sum))
    last = popdist.execute_on_instances({max(every)}, lambda: hvd.allreduce(torch.ones(1) * 5))
    print(f"RANK {hvd.rank()} OF {hvd.size()} REPLICAS {opts.replication_factor} SEED {seed} "
          f"LOSS {mean_loss:.6f} SUM {ranks:g} WEIGHT {net.fc.weight.sum().item():.6f} "
          f"EVERY {total.item():g} LAST {'None' if last is None else format(last.item(), 'g')}")
    """
)


def _poprun(tmp_path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return warm.run(
        [sys.executable, "-m", "ipuloop.emulate.poprun", *args],
        cwd=tmp_path,
        env=clean_env(MASTER_PORT=str(free_port()), IPULOOP_DIST_TIMEOUT="60"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _results(out: str) -> dict[str, list[str]]:
    """Each instance's result line, by the tag poprun put before it."""
    found = {}
    for line in out.splitlines():
        tag, _, text = line.partition(":")
        if text.startswith("RANK"):
            found[tag] = text.split()
    return found


@pytest.mark.threads
def test_two_instances_of_a_model_garden_program_train_in_one_group(tmp_path):
    (tmp_path / "train.py").write_text(GARDEN)
    run = _poprun(tmp_path, "--num-instances", "2", "--num-replicas", "4", "python", "train.py")
    assert run.returncode == 0, run.stdout + run.stderr
    results = _results(run.stdout)
    assert sorted(results) == ["[1,0]<stdout>", "[1,1]<stdout>"], run.stdout
    first, second = results["[1,0]<stdout>"], results["[1,1]<stdout>"]
    assert first[:6] == ["RANK", "0", "OF", "2", "REPLICAS", "2"]
    assert second[:6] == ["RANK", "1", "OF", "2", "REPLICAS", "2"]
    assert first[first.index("SUM") + 1] == "3"  # 1 + 2: the two instances reduced together
    for key in ("SEED", "LOSS", "WEIGHT"):  # instance 0's seed; one mean; the same updates
        assert first[first.index(key) + 1] == second[second.index(key) + 1], key
    assert first[first.index("SEED") + 1] == "42"
    # execute_on_instances: on every instance, a collective spans them all; on one, that alone
    assert first[first.index("EVERY") + 1] == second[second.index("EVERY") + 1] == "2"
    assert (first[first.index("LAST") + 1], second[second.index("LAST") + 1]) == ("None", "5")
    assert "TCPStore" not in run.stderr  # the store outlives the instances leaving the group


@pytest.mark.threads
def test_an_instance_that_fails_ends_the_others_and_is_named(tmp_path):
    (tmp_path / "fail.py").write_text(
        textwrap.dedent(
            """
            import time
            import popdist, horovod.torch as hvd, torch
            popdist.init(); hvd.init()
            if hvd.rank() == 1:
                raise ValueError("instance 1 gives up")
            hvd.allreduce(torch.ones(1))  # waits for instance 1, which never comes
            time.sleep(120)
            """
        )
    )
    started = time.monotonic()
    run = _poprun(tmp_path, "--num-instances=2", "python", "fail.py", timeout=120)
    took = time.monotonic() - started
    assert run.returncode == 1, run.stdout + run.stderr
    # named from the store, where it left its error first: instance 0 may exit first (its
    # collective fails as soon as instance 1 leaves the group)
    assert (
        "poprun: instance 1 of 2 (PID " in run.stderr
        and ") failed with ValueError: instance 1 gives up and exited with status 1" in run.stderr
    )
    assert "[1,1]<stderr>:" in run.stderr and "ValueError: instance 1 gives up" in run.stderr
    assert took < 60, took  # not the 60 s the collective would wait


def test_the_first_failure_an_instance_tells_is_read_under_the_group_s_prefixes():
    import datetime

    import torch.distributed as dist

    from ipuloop.rules import tell_launcher

    port = free_port()
    served = dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=10), False)
    assert poprun.first_failure(served) is None and poprun.first_failure(None) is None
    client = dist.TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=10))
    group = dist.PrefixStore("default_pg", dist.PrefixStore("0/", client))  # as a group's
    tell_launcher(group, {"instance": 1, "error": "ValueError: first"})
    tell_launcher(group, {"instance": 0, "error": "RuntimeError: because of it"})
    assert poprun.first_failure(served) == (1, "ValueError: first")
    tell_launcher(object(), {"instance": 0, "error": "no store"})  # never raises
