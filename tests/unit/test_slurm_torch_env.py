"""TrainerStepEnvironment: submitit's TorchDistributedEnvironment for hpcrl's trainer step (world = the step,
port below the ephemeral range, set variables win, a given mapping instead of os.environ).
``export_torch_env``'s own test is in ``test_slurm_submit.py``."""

from __future__ import annotations

import os

from submitit.helpers import TorchDistributedEnvironment

from hpcrl.slurm.torch_env import TrainerStepEnvironment, tasks_on_node, trainer_world_size

HET = {"SLURM_JOB_ID": "901", "SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
       "SLURM_NTASKS": "5", "SLURM_NTASKS_HET_GROUP_0": "3", "SLURM_JOB_NUM_NODES": "3",
       "SLURM_JOB_NODELIST": "t[1-2],r1", "SLURM_STEP_NODELIST": "t[1-2]", "SLURM_STEP_TASKS_PER_NODE": "2,1"}


def test_is_submitits_class_with_the_trainer_steps_world():
    before = dict(os.environ)
    env = dict(HET)
    t = TrainerStepEnvironment(env)
    assert isinstance(t, TorchDistributedEnvironment)
    assert (t.rank, t.world_size, t.local_rank, t.local_world_size) == (2, 3, 0, 1)  # group 0, node t2
    assert t.master_addr == "t1" and 20000 <= t.master_port < 32768
    assert t.export() is t and env["WORLD_SIZE"] == "3" and t.exported == t.variables()
    assert "LOCAL_WORLD_SIZE" not in env and "CUDA_VISIBLE_DEVICES" not in env
    assert dict(os.environ) == before  # the given mapping, not os.environ


def test_set_variables_win_unless_overwritten():
    env = dict(HET, MASTER_PORT="29500", RANK="7", CUDA_VISIBLE_DEVICES="0,1")
    t = TrainerStepEnvironment(env)
    assert t.master_port == 29500
    assert set(t.export().exported) == {"WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"} and env["RANK"] == "7"
    t.export(overwrite=True, set_cuda_visible_devices=True)
    assert env["RANK"] == "2" and env["CUDA_VISIBLE_DEVICES"] == "0"


def test_world_and_tasks_per_node():
    assert trainer_world_size({}) == 1 and trainer_world_size({"SLURM_NTASKS": "4"}) == 4
    assert trainer_world_size({"SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "4"}) == 2
    assert [tasks_on_node("2(x3),1", i) for i in range(5)] == [2, 2, 2, 1, None]
    assert tasks_on_node("", 0) is None and tasks_on_node("x", 0) is None
    t = TrainerStepEnvironment({"SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]"})
    assert t.local_world_size == 2 and t.master_addr == "n1"  # no per-node list: tasks / nodes
