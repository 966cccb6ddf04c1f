"""PopDist's API as the emulator answers it (``ipuloop/emulator/popdist.py``): read from
poprun's environment (POPDIST_*), from mpirun's without it, and for one process alone when
neither is set; ``popdist.poptorch.Options`` built from it."""

from __future__ import annotations

import pytest

import ipuloop.emulator as poptorch
from ipuloop.emulator import popdist

ENV = (
    "POPDIST_NUM_TOTAL_REPLICAS",
    "POPDIST_NUM_LOCAL_REPLICAS",
    "POPDIST_NUM_IPUS_PER_REPLICA",
    "POPDIST_REPLICA_INDEX_OFFSET",
    "POPDIST_LOCAL_INSTANCE_INDEX",
    "POPDIST_UNIFORM_REPLICAS_PER_INSTANCE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "IPULOOP_EMULATOR_IPUS",
)


@pytest.fixture
def env(monkeypatch):
    """A clean launcher environment; returns a setter for it."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)

    def set_env(**values: object) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, str(value))

    return set_env


def poprun_instance(set_env, index: int, instances: int = 2, replicas: int = 8, ipus: int = 2):
    """What poprun --num-instances INSTANCES --num-replicas REPLICAS --ipus-per-replica IPUS
    gives instance INDEX."""
    local = replicas // instances
    set_env(
        POPDIST_NUM_TOTAL_REPLICAS=replicas,
        POPDIST_NUM_LOCAL_REPLICAS=local,
        POPDIST_NUM_IPUS_PER_REPLICA=ipus,
        POPDIST_REPLICA_INDEX_OFFSET=index * local,
        POPDIST_LOCAL_INSTANCE_INDEX=index,
        POPDIST_UNIFORM_REPLICAS_PER_INSTANCE=1,
        OMPI_COMM_WORLD_RANK=index,
        OMPI_COMM_WORLD_SIZE=instances,
    )


def answers() -> dict[str, object]:
    return {
        "set": popdist.isPopdistEnvSet(),
        "total": popdist.getNumTotalReplicas(),
        "local": popdist.getNumLocalReplicas(),
        "instances": popdist.getNumInstances(),
        "index": popdist.getInstanceIndex(),
        "offset": popdist.getReplicaIndexOffset(),
        "ipus": popdist.getNumIpusPerReplica(),
        "local index": popdist.getLocalInstanceIndex(),
    }


def test_alone_every_answer_is_one_process_s(env):
    assert answers() == {
        "set": False,
        "total": 1,
        "local": 1,
        "instances": 1,
        "index": 0,
        "offset": 0,
        "ipus": 1,
        "local index": 0,
    }


def test_under_poprun_the_answers_are_its_environment_s(env):
    poprun_instance(env, 1, instances=2, replicas=8, ipus=2)
    assert answers() == {
        "set": True,
        "total": 8,
        "local": 4,
        "instances": 2,  # total / local
        "index": 1,  # offset / local
        "offset": 4,
        "ipus": 2,
        "local index": 1,
    }


def test_the_ipus_per_replica_are_checked_against_poprun_s(env):
    assert popdist.checkNumIpusPerReplica(4)  # no poprun: any
    poprun_instance(env, 0, ipus=2)
    assert popdist.checkNumIpusPerReplica(2) and not popdist.checkNumIpusPerReplica(4)


def test_the_instance_is_read_from_the_replicas_not_from_mpirun(env):
    poprun_instance(env, 3, instances=4, replicas=4, ipus=1)
    env(OMPI_COMM_WORLD_RANK=0, OMPI_COMM_WORLD_SIZE=1)  # poprun's replicas decide
    assert (popdist.getInstanceIndex(), popdist.getNumInstances()) == (3, 4)


def test_under_mpirun_alone_its_rank_and_size_are_the_instance_s(env):
    env(OMPI_COMM_WORLD_RANK=2, OMPI_COMM_WORLD_SIZE=3, OMPI_COMM_WORLD_LOCAL_RANK=2)
    assert not popdist.isPopdistEnvSet()
    assert (popdist.getInstanceIndex(), popdist.getNumInstances()) == (2, 3)
    assert popdist.getLocalInstanceIndex() == 2
    assert popdist.getNumLocalReplicas() == 1


def test_a_value_that_is_no_integer_is_an_error_naming_it(env):
    env(POPDIST_NUM_TOTAL_REPLICAS="four")
    with pytest.raises(ValueError, match="POPDIST_NUM_TOTAL_REPLICAS='four'"):
        popdist.getNumTotalReplicas()


def test_the_device_id_numbers_a_pod_s_devices_as_it_does(env):
    env(IPULOOP_EMULATOR_IPUS=16)
    assert popdist.getDeviceId(1) == 0  # one replica of 1 IPU: the first single IPU
    poprun_instance(env, 1, instances=2, replicas=4, ipus=1)  # 2 IPUs each
    assert popdist.getDeviceId() == 16 + 1  # after the 16 singles, the second pair
    poprun_instance(env, 1, instances=2, replicas=4, ipus=2)  # 4 IPUs each
    assert popdist.getDeviceId() == 16 + 8 + 1  # after the singles and the pairs
    assert popdist.getDeviceId(4) == 16 + 8 + 4 + 1  # 8 IPUs: after the fours


def test_options_carry_the_instance_s_replicas_process_and_ipus(env):
    poprun_instance(env, 1, instances=2, replicas=8, ipus=2)
    opts = popdist.Options(ipus_per_replica=2)
    assert isinstance(opts, poptorch.Options)
    assert opts.replication_factor == 4
    assert (opts.Distributed.processId, opts.Distributed.numProcesses) == (1, 2)
    assert opts._values["ipu_id"] == popdist.getDeviceId(2)
    assert opts.clone().replication_factor == 4 and type(opts.clone()) is popdist.Options


def test_options_alone_are_poptorch_s_defaults(env):
    opts = popdist.Options()
    assert opts._values == poptorch.Options()._values


def test_execute_on_instances_runs_the_function_on_those_named(env):
    poprun_instance(env, 1, instances=2, replicas=2, ipus=1)
    seen = []

    def record(value, key=None):
        seen.append((value, key, popdist.only_instances()))
        return value * 2

    assert popdist.execute_on_instances({0}, record, 5) is None
    assert popdist.execute_on_instances({1}, record, 5, key="k") == 10
    assert seen == [(5, "k", frozenset({1}))]
    assert popdist.only_instances() is None


def test_init_alone_joins_no_group(env):
    import torch.distributed as dist

    popdist.init()
    assert popdist.isInitialised()
    assert not (dist.is_available() and dist.is_initialized())
