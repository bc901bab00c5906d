"""``hpcrl submit`` / status / logs / cancel without a cluster: rendering, mapping, het jobs, containers and
errors.

Dry-run scripts are compared with the golden files in ``tests/unit/golden/`` after the run's working directory
is replaced by ``{CWD}`` (regenerate them with ``HPCRL_UPDATE_GOLDEN=1``). Slurm commands are fake scripts on
PATH (``sbatch``, ``srun``, ``squeue``, ``sacct``, ``scancel``) where a test needs them.
"""

from __future__ import annotations

import json
import itertools
import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from hpcrl.config import ConfigError, load_config
from hpcrl.slurm import SlurmCommandError
from hpcrl.slurm import container as ct
from hpcrl.slurm import entry, requeue, state
from hpcrl.slurm.control import cancel, print_logs
from hpcrl.slurm.executor import HETJOB_LINE, HetSlurmExecutor, HetSlurmInfoWatcher, insert_after_last_sbatch
from hpcrl.slurm.resources import plan_job, slurm_config
from hpcrl.slurm.submit import prepare_config, submit, submitit_parameters
from hpcrl.validate import load_and_check

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).parent / "golden"
PY = "/opt/hpcrl/venv/bin/python"
"""The job's python in every rendered script here (the default is this interpreter: not reproducible)."""

COLOCATE = """\
run: {name: golden-colocate, num_rollout: 10}
model: {create: tiny-qwen2}
train: {tensor_parallel_size: 2}
slurm:
  partition: gpu
  account: rl
  qos: high
  time: "04:00:00"
  nodes: 2
  gpus_per_node: 4
  cpus_per_task: 8
  mem: 256G
  constraint: h100
  exclusive: true
  signal: USR2@300
  extra_sbatch: ["--reservation=rl-week", "--mail-type=END"]
  setup: ["module purge", "module load cuda/12.8"]
"""

DISAGGREGATE = """\
run: {name: golden-disaggregate, placement: disaggregate, num_rollout: 10}
model: {create: tiny-qwen2}
slurm:
  partition: gpu
  time: "1-00:00:00"
  nodes: 1
  gpus_per_node: 8
  cpus_per_task: 4
  mem: 512G
  setup: ["module load cuda/12.8"]
  rollout: {nodes: 2, gpus_per_node: 8, cpus_per_task: 16, mem: 512G, partition: gpu-inference}
"""

CPU = "run: {name: cpu}\nmodel: {create: tiny-qwen2}\n"


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A clean working directory (the submit directory) with no Slurm variables around."""
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k.startswith(("SLURM_", "HPCRL_", "TMS_", "SUBMITIT_")) and k != "HPCRL_UPDATE_GOLDEN":
            monkeypatch.delenv(k)
    return tmp_path


def normalize(text: str, cwd: Path) -> str:
    return text.replace(os.path.realpath(cwd), "{CWD}").replace(str(cwd), "{CWD}")


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("HPCRL_UPDATE_GOLDEN"):
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), f"golden file {path} missing (run with HPCRL_UPDATE_GOLDEN=1)"
    assert text == path.read_text(), f"{name} differs from the golden file"


def dry(work: Path, text: str, *overrides: str, plain: bool = False, environ=None):
    cfg = write(work / "run.yaml", text)
    return submit(cfg, list(overrides), dry_run=True, plain=plain, python=PY,
                  environ={} if environ is None else environ)


def fake_bin(tmp_path: Path, monkeypatch, **scripts: str) -> Path:
    """Executables on PATH (first): name -> bash body. ``srun`` always exists (submitit looks for it)."""
    d = tmp_path / "fakebin"
    d.mkdir(exist_ok=True)
    scripts.setdefault("srun", "exit 0")
    for name, body in scripts.items():
        p = d / name
        p.write_text("#!/bin/bash\n" + body + "\n")
        p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    monkeypatch.setenv("PATH", f"{d}:{os.environ['PATH']}")
    return d


# ------------------------------------------------------------------------------------------------------------
# Golden dry-run scripts
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,text,plain", [
    ("colocate.sbatch", COLOCATE, False),
    ("disaggregate.sbatch", DISAGGREGATE, False),
    ("plain-colocate.sbatch", COLOCATE, True),
    ("plain-disaggregate.sbatch", DISAGGREGATE, True),
])
def test_dry_run_matches_golden(work, name, text, plain):
    res = dry(work, text, plain=plain)
    assert res.job_id is None and res.dry_run
    assert res.script_path == res.run_dir / "submission.sbatch"
    assert res.script_path.read_text() == res.script
    check_golden(name, normalize(res.script, work))


def test_dry_run_writes_run_folder_and_nothing_else(work):
    res = dry(work, COLOCATE)
    run_dir = work / "runs" / "golden-colocate"
    assert res.run_dir == run_dir and run_dir.is_absolute()
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "logs", "submission.sbatch"]
    assert not (run_dir / "job.json").exists() and not (run_dir / "submitit").exists()
    saved = load_config(run_dir / "config.yaml")
    assert saved.run.output_dir == str(work / "runs")  # absolute: the job may start anywhere
    assert saved.train.nprocs == 8  # 2 nodes x 4 GPUs: the trainer's Slurm ranks
    assert saved == res.config


def test_dry_run_is_deterministic(work):
    a = dry(work, DISAGGREGATE).script
    b = dry(work, DISAGGREGATE).script
    assert a == b


# ------------------------------------------------------------------------------------------------------------
# slurm: section -> submitit parameters
# ------------------------------------------------------------------------------------------------------------

def params_for(work: Path, text: str, *overrides: str) -> dict:
    cfg, plan = prepare_config(write(work / "run.yaml", text), overrides)
    return submitit_parameters(plan, "/r", "/w")


def test_mapping_colocated_gpu(work):
    p = params_for(work, COLOCATE)
    extra = p.pop("additional_parameters")
    setup = p.pop("setup")
    assert p == dict(job_name="golden-colocate", time=240, nodes=2, ntasks_per_node=4, cpus_per_task=8,
                     signal_delay_s=300, gpus_per_node=4, partition="gpu", account="rl", qos="high",
                     mem="256G", constraint="h100", exclusive=True)
    assert extra == {"signal": "USR2@300", "chdir": "/w", "requeue": True}
    assert setup == ["module purge", "module load cuda/12.8", "export SUBMITIT_PREEMPT_SIGNAL=USR2",
                     "export SLURM_KILL_BAD_EXIT=1",
                     "export HPCRL_RUN_DIR=/r"]


@pytest.mark.parametrize("time,minutes", [("00:30:30", 31), ("90", 90), ("1-00:00:00", 1440), ("2-03", 3060),
                                          ("00:00:59", 1)])
def test_time_in_whole_minutes_rounded_up(work, time, minutes):
    p = params_for(work, CPU, f"slurm.time='{time}'", "slurm.signal=USR2@30")
    assert p["time"] == minutes and "time" not in p["additional_parameters"]


def test_unlimited_time(work):
    p = params_for(work, CPU, "slurm.time=UNLIMITED")
    assert p["additional_parameters"]["time"] == "UNLIMITED"
    assert p["time"] > 10 ** 6  # submitit's timeout bookkeeping never fires


def test_signal_requeue_and_optional_fields(work):
    p = params_for(work, CPU, "slurm.signal=SIGUSR1@200", "slurm.requeue=false")
    assert p["signal_delay_s"] == 200
    assert p["additional_parameters"] == {"signal": "USR1@200", "chdir": "/w", "no_requeue": True}
    assert "export SUBMITIT_PREEMPT_SIGNAL=USR1" in p["setup"]
    for key in ("partition", "account", "qos", "mem", "constraint", "exclusive", "gpus_per_node",
                "srun_args"):
        assert key not in p


def test_cpu_trainer_tasks_from_nprocs(work):
    p = params_for(work, CPU, "train.nprocs=4", "slurm.nodes=2", "train.micro_batch_size=16")
    assert (p["nodes"], p["ntasks_per_node"]) == (2, 2)


def test_gpu_count_comes_from_config_never_cuda_visible_devices(work):
    res = dry(work, COLOCATE, "slurm.gpus_per_node=3", "slurm.nodes=1", "train.tensor_parallel_size=1")
    assert "#SBATCH --gpus-per-node=3" in res.script and "#SBATCH --ntasks-per-node=3" in res.script
    assert "CUDA_VISIBLE_DEVICES" not in res.script
    assert res.config.train.nprocs == 3


def test_rollout_group_partition_defaults_to_main(work):
    cfg, plan = prepare_config(write(work / "run.yaml", DISAGGREGATE), ["slurm.rollout.partition=null"])
    assert plan.het and plan.rollout.partition == "gpu"
    assert (plan.trainer.role, plan.rollout.role, plan.rollout.ntasks_per_node) == ("trainer", "rollout", 1)


# ------------------------------------------------------------------------------------------------------------
# Het-job text structure and sacct ids
# ------------------------------------------------------------------------------------------------------------

def test_het_job_text_structure(work):
    script = dry(work, DISAGGREGATE, "slurm.extra_sbatch=[--reservation=r1]").script
    lines = script.splitlines()
    assert lines.count(HETJOB_LINE) == 1
    sep = lines.index(HETJOB_LINE)
    head = [line for line in lines[:sep] if line.startswith("#SBATCH")]
    comp1 = []
    for line in lines[sep + 1:]:
        if not line.startswith("#SBATCH"):
            break
        comp1.append(line)
    assert head[-1] == "#SBATCH --reservation=r1"  # extra lines belong to group 0, before the separator
    assert "#SBATCH --signal=USR2@120" in head and "#SBATCH --output=" in "\n".join(head)
    assert comp1 == ["#SBATCH --cpus-per-task=16", "#SBATCH --gpus-per-node=8", "#SBATCH --mem=512G",
                     "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu-inference",
                     "#SBATCH --time=1440"]
    assert not any(line.startswith("#SBATCH") for line in lines[sep + 1 + len(comp1):])
    assert "srun --unbuffered" in script and "--het-group=0" in script  # submitit's step is the trainer


def test_critic_het_group(work):
    """PPO's critic on ranks of its own is the last het group: after the rollout's when disaggregated, group 1
    of a colocated run (which becomes a het job, its trainer step in group 0); on GPU nodes ``critic.nprocs``
    is its GPUs (nodes x gpus_per_node); the plain template gets the same group."""
    critic = ["algorithm.advantage_estimator=gae", "slurm.critic={nodes: 2, gpus_per_node: 4, cpus_per_task: 6}"]
    cfg, plan = prepare_config(write(work / "run.yaml", DISAGGREGATE), critic)
    assert cfg.critic.nprocs == 8 and plan.critic_het_group == 2 and plan.het
    assert [g.role for g in plan.components] == ["rollout", "critic"]
    assert (plan.critic.nodes, plan.critic.ntasks_per_node, plan.critic.partition) == (2, 4, "gpu")
    for text, group in ((DISAGGREGATE, 2), (COLOCATE, 1)):
        for plain in (False, True):
            lines = dry(work, text, *critic, plain=plain).script.splitlines()
            assert lines.count(HETJOB_LINE) == group
            after = lines[max(i for i, line in enumerate(lines) if line == HETJOB_LINE) + 1:]
            flags = set(itertools.takewhile(lambda line: line.startswith("#SBATCH"), after))
            assert {"#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --cpus-per-task=6",
                    "#SBATCH --gpus-per-node=4"} <= flags, flags
            assert "--het-group=0" in "\n".join(lines)  # the trainer step is group 0's
    cfg, plan = prepare_config(write(work / "run.yaml", CPU),
                               ["algorithm.advantage_estimator=gae", "slurm.critic={nodes: 2}", "critic.nprocs=4"])
    assert (plan.critic_het_group, plan.critic.ntasks_per_node, plan.critic.gpus_per_node) == (1, 2, 0)
    assert prepare_config(write(work / "run.yaml", CPU), [])[1].critic is None


def test_critic_step_command(work, tmp_path):
    """The controller starts the critic's ranks in their het group, one task per GPU, in the container."""
    from hpcrl.slurm.critic_step import srun_command

    cfg, _ = prepare_config(write(work / "run.yaml", DISAGGREGATE),
                            ["algorithm.advantage_estimator=gae",
                             "slurm.critic={nodes: 2, gpus_per_node: 4, cpus_per_task: 6}",
                             "slurm.container=docker://hpcrl"])
    cmd = srun_command(cfg, tmp_path / "attempt-0", tmp_path, ["--link", "h:1"], environ={"SLURM_JOB_ID": "7"},
                       python="python3")
    assert cmd[:2] == ["srun", "--mem=0"]
    for flag in ("--het-group=2", "--nodes=2", "--ntasks=8", "--ntasks-per-node=4", "--cpus-per-task=6",
                 "--kill-on-bad-exit=1", "--jobid=7", "--gres=gpu:4", f"--output={tmp_path}/attempt-0/critic-%t.log"):
        assert flag in cmd, flag
    assert cmd[cmd.index("exec") + 1] == "--nv"  # its group has GPUs
    assert cmd[-5:] == ["python3", "-m", "hpcrl.train.critic_worker", "--link", "h:1"]


def test_without_components_the_script_is_submitits(tmp_path):
    from submitit.slurm.slurm import _make_sbatch_string

    ex = HetSlurmExecutor(tmp_path, render_only=True, python="python3")
    ex.update_parameters(time=5, nodes=1)
    assert ex.render() == _make_sbatch_string(command=ex._submitit_command_str, folder=ex.folder, time=5,
                                              nodes=1)
    ex.components = [{"nodes": 2, "gpus_per_node": 4, "exclusive": False, "mem": None}]
    assert ex.render().splitlines().count(HETJOB_LINE) == 1
    assert "#SBATCH --exclusive" not in ex.render() and "#SBATCH --mem" not in ex.render()


def test_render_only_executor_cannot_submit(tmp_path):
    ex = HetSlurmExecutor(tmp_path, render_only=True)
    with pytest.raises(RuntimeError, match="render_only"):
        ex.submit(print, "x")


def test_insert_after_last_sbatch():
    text = "#!/bin/bash\n#SBATCH --a=1\n#SBATCH --b=2\n\necho hi\n"
    assert insert_after_last_sbatch(text, ["#SBATCH hetjob"]) == \
        "#!/bin/bash\n#SBATCH --a=1\n#SBATCH --b=2\n#SBATCH hetjob\n\necho hi\n"
    with pytest.raises(ValueError):
        insert_after_last_sbatch("echo hi\n", ["x"])


SACCT_HET = ("JobID|State|NodeList\n26+0|RUNNING|n1\n26+0.batch|RUNNING|n1\n26+0.0|RUNNING|n1\n"
             "26+1|RUNNING|n2\n30|COMPLETED|n1\n30.batch|COMPLETED|n1\n")


def test_het_watcher_maps_plus_zero_to_the_job_id():
    info = HetSlurmInfoWatcher().read_info(SACCT_HET)
    assert info["26"]["State"] == "RUNNING" and info["26"]["NodeList"] == "n1"
    assert info["26+1"]["NodeList"] == "n2" and info["30"]["State"] == "COMPLETED"
    assert HetSlurmExecutor.job_class.watcher.__class__ is HetSlurmInfoWatcher


def test_het_base_id_and_state_parsing():
    assert [state.het_base_id(j) for j in ("123+1", "123+0", "123", "123_4", "x+y")] == \
        ["123", "123", "123", "123_4", "x+y"]
    assert state.parse_sacct("26+0|RUNNING\n26+0.batch|RUNNING\n26+1|RUNNING\n30|CANCELLED by 0\n") == \
        {"26": "RUNNING", "30": "CANCELLED"}
    assert state.parse_sacct("40+0|RUNNING\n40+1|FAILED\n") == {"40": "FAILED"}  # a dead rollout group shows
    assert state.parse_squeue("26+1|PENDING\n26+0|PENDING\n7|RUNNING\n") == {"26": "PENDING", "7": "RUNNING"}


def test_query_states_squeue_then_sacct():
    calls = []

    def runner(argv):
        calls.append(argv)
        return {"squeue": "26+0|RUNNING\n26+1|RUNNING\n", "sacct": "30|COMPLETED\n"}[argv[0]]

    assert state.query_states(["26", "30", "31"], runner) == {"26": "RUNNING", "30": "COMPLETED",
                                                              "31": state.UNKNOWN}
    assert calls[0][-1] == "26,30,31" and calls[1][-1] == "30,31"
    assert state.query_states(["5"], lambda argv: None) == {"5": state.UNKNOWN}  # no Slurm here


# ------------------------------------------------------------------------------------------------------------
# Containers
# ------------------------------------------------------------------------------------------------------------

def test_container_wraps_the_step(work):
    image = work / "hpcrl.sif"
    image.write_text("")
    env = {"TMS_INIT_ENABLE_CPU_BACKUP": "0", "TMS_DEBUG": "1",
           "HPCRL_CONTAINER_BINDS": "/scratch, /etc/slurm"}
    res = dry(work, COLOCATE, f"slurm.container={image}", "model.path=/nonexistent-hpcrl/models/m",
              environ=env)
    run_dir = str(work / "runs" / "golden-colocate")
    prefix = ct.container_prefix(res.config, run_dir, "trainer", cwd=str(work), environ=env)
    assert prefix == ["apptainer", "exec", "--nv", "--bind", f"{run_dir},{work},/scratch,/etc/slurm",
                      "--env", f"LD_PRELOAD={ct.TMS_PRELOAD_IN_IMAGE}", "--env", "TMS_DEBUG=1",
                      "--env", "TMS_INIT_ENABLE=1", "--env", "TMS_INIT_ENABLE_CPU_BACKUP=0", str(image)]
    srun = [line for line in res.script.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1
    assert ct.shell_join(prefix + ["python3"]) + " -u -m submitit.core._submit" in srun[0]
    assert not any(line.startswith("export LD_PRELOAD") for line in res.script.splitlines())  # host: clean
    plain = dry(work, COLOCATE, f"slurm.container={image}", plain=True, environ=env).script
    assert ct.shell_join(prefix + ["python3", "-m", "hpcrl"]) + ' run-slurm "$RUN_DIR/config.yaml"' in plain


def test_container_binds_outside_paths_and_roles(work, tmp_path_factory):
    outside = tmp_path_factory.mktemp("models")
    cfg = load_config(None, ["model.create=tiny-qwen2", f"model.path={outside}/tiny",
                             "slurm.container=docker://x/y:1", "run.placement=disaggregate",
                             "slurm.rollout={gpus_per_node: 2}"])
    binds = ct.container_binds(cfg, "/runs/r", str(work), {})
    assert binds == ["/runs/r", str(work), str(outside)]  # nearest existing folder of a path not yet made
    trainer = ct.container_prefix(cfg, "/runs/r", "trainer", cwd=str(work), environ={})
    rollout = ct.container_prefix(cfg, "/runs/r", "rollout", cwd=str(work),
                                  environ={"HPCRL_CONTAINER_RUNTIME": "singularity"})
    assert "--nv" not in trainer and "--env" not in trainer and trainer[-1] == "docker://x/y:1"
    assert rollout[:3] == ["singularity", "exec", "--nv"] and "--env" not in rollout
    assert ct.container_prefix(load_config(None, ["model.create=tiny-qwen2"]), "/r") == []
    teachers = tmp_path_factory.mktemp("teachers")
    cfg = load_config(None, ["model.create=tiny-qwen2", f"model.path={outside}/tiny",
                             f"algorithm.opd.teachers=[{{path: {teachers}/t, sft_target_accuracy: 0.5}}]"])
    assert ct.container_binds(cfg, "/runs/r", str(work), {}) == ["/runs/r", str(work), str(outside), str(teachers)]


def test_tms_preload_override(work):
    cfg = load_config(None, ["model.create=tiny-qwen2", "slurm.gpus_per_node=2"])
    env = ct.container_env(cfg, "trainer", {"HPCRL_TMS_PRELOAD": "/x/tms.so"})
    assert env == {"LD_PRELOAD": "/x/tms.so", "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
    assert ct.container_env(cfg, "rollout", {}) == {}


# ------------------------------------------------------------------------------------------------------------
# Bad input: rejected before anything is written or queued
# ------------------------------------------------------------------------------------------------------------

BAD = [
    (CPU + "run: {placement: disaggregate}\n", [], "slurm.rollout"),
    (CPU, ["slurm.extra_sbatch=[--time=10]"], "slurm.extra_sbatch[0]"),
    (CPU, ["slurm.extra_sbatch=[--reservation=a, -p debug]"], "slurm.extra_sbatch[1]"),
    (CPU, ["train.nprocs=3", "slurm.nodes=2"], "train.nprocs"),
    (CPU, ["slurm.gpus_per_node=3", "train.tensor_parallel_size=2"], "slurm.gpus_per_node"),
    (CPU, ["slurm.gpus_per_node=2", "train.expert_parallel_size=4"], "train.expert_parallel_size"),
    (CPU, ["slurm.time=1:2:3:4"], "slurm.time"),
    (CPU, ["slurm.signal=USR2@7200"], "slurm.signal"),
    (CPU, ["slurm.container=/nonexistent/hpcrl.sif"], "slurm.container"),
    (CPU, ["slurm.rollout={nodes: 1}"], "slurm.rollout"),
    (CPU, ["algorithm.advantage_estimator=gae", "critic.nprocs=2"], "critic.nprocs"),
    (CPU, ["algorithm.advantage_estimator=gae", "slurm.critic={nodes: 1}"], "critic.nprocs"),
    (CPU, ["algorithm.advantage_estimator=gae", "slurm.critic={nodes: 2}", "critic.nprocs=3"], "critic.nprocs"),
    (CPU, ["slurm.critic={nodes: 1, gpus_per_node: 2}"], "slurm.critic"),
]


@pytest.mark.parametrize("text,overrides,field", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
@pytest.mark.parametrize("dry_run", [True, False])
def test_bad_config_rejected_before_anything_is_written(work, monkeypatch, text, overrides, field, dry_run):
    text = text.replace("run: {name: cpu}\n", "") if "run: {placement" in text else text
    log = work / "sbatch.log"
    fake_bin(work, monkeypatch, sbatch=f'echo "$@" >> {log}; echo "Submitted batch job 1"')
    with pytest.raises(ConfigError) as e:
        submit(write(work / "run.yaml", text), overrides, dry_run=dry_run, environ={})
    assert e.value.field == field, str(e.value)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"config error: {field}=")
    assert not (work / "runs").exists() and not log.exists()


def test_no_sbatch_on_path(work, monkeypatch):
    monkeypatch.setenv("PATH", str(work / "empty"))
    with pytest.raises(SlurmCommandError, match="sbatch not found") as e:
        submit(write(work / "run.yaml", CPU), environ={})
    assert e.value.exit_code == 2 and not (work / "runs").exists()


def test_live_job_in_run_folder_is_refused(work, monkeypatch):
    run_dir = work / "runs" / "cpu"
    run_dir.mkdir(parents=True)
    state.write_job_file(run_dir, {"job_id": "77"})
    fake_bin(work, monkeypatch, sbatch="echo 'Submitted batch job 78'", squeue="echo '77|RUNNING'")
    with pytest.raises(SlurmCommandError, match="already has job 77 .RUNNING.") as e:
        submit(write(work / "run.yaml", CPU), environ={})
    assert e.value.exit_code == 2 and not (run_dir / "config.yaml").exists()


# ------------------------------------------------------------------------------------------------------------
# Submission with fake Slurm commands: job.json
# ------------------------------------------------------------------------------------------------------------

def test_submit_with_submitit_writes_job_json(work, monkeypatch):
    log = work / "sbatch.log"
    fake_bin(work, monkeypatch, sbatch=f'echo "$@" >> {log}; echo "Submitted batch job 4242"',
             sacct="echo '4242|COMPLETED'")
    res = submit(write(work / "run.yaml", DISAGGREGATE), environ={})
    run_dir = res.run_dir
    job = json.loads((run_dir / "job.json").read_text())
    assert res.job_id == job["job_id"] == "4242" and job["launcher"] == "submitit" and job["het"] is True
    assert job["stdout"] == str(run_dir / "submitit" / "4242_0_log.out")
    assert job["stderr"] == str(run_dir / "submitit" / "4242_0_log.err")
    assert job["config"] == str(run_dir / "config.yaml") and job["previous_job_ids"] == []
    submitted = (run_dir / "submitit" / "4242_submission.sh").read_text()
    assert submitted == (run_dir / "submission.sbatch").read_text() and HETJOB_LINE in submitted
    from submitit.core.utils import DelayedSubmission

    delayed = DelayedSubmission.load(run_dir / "submitit" / "4242_submitted.pkl")
    assert isinstance(delayed.function, entry.SlurmEntry)
    assert delayed.function.config_path == str(run_dir / "config.yaml") and delayed.function.requeue
    # the finished job is replaced by a new one on resubmission, and remembered
    res2 = submit(write(work / "run.yaml", DISAGGREGATE), environ={})
    assert json.loads((res2.run_dir / "job.json").read_text())["previous_job_ids"] == ["4242"]


def test_submit_plain_uses_sbatch_directly(work, monkeypatch):
    log = work / "sbatch.log"
    fake_bin(work, monkeypatch, sbatch=f'echo "$@" >> {log}; echo "515;cluster"')
    res = submit(write(work / "run.yaml", CPU), plain=True, environ={})
    assert res.job_id == "515" and res.launcher == "sbatch"
    assert log.read_text().split() == ["--parsable", str(res.run_dir / "submission.sbatch")]
    job = json.loads((res.run_dir / "job.json").read_text())
    assert job["stdout"] == str(res.run_dir / "logs" / "slurm-515.out") and job["stderr"] is None


def test_sbatch_refusal_is_one_line(work, monkeypatch):
    fake_bin(work, monkeypatch, sbatch='echo "sbatch: error: invalid partition specified: nope" >&2; exit 1')
    for plain in (False, True):
        with pytest.raises(SlurmCommandError, match="invalid partition specified: nope") as e:
            submit(write(work / "run.yaml", CPU), plain=plain, environ={})
        assert e.value.exit_code == 1 and "\n" not in str(e.value)
        assert not (work / "runs" / "cpu" / "job.json").exists()


# ------------------------------------------------------------------------------------------------------------
# status / logs / cancel
# ------------------------------------------------------------------------------------------------------------

def make_run(base: Path, name: str, job_id=None, steps=(), attempts=0, num_rollout=10) -> Path:
    run_dir = base / name
    (run_dir / "logs").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump({"run": {"name": name, "num_rollout": num_rollout}}))
    if job_id:
        state.write_job_file(run_dir, {"job_id": job_id, "stdout": str(run_dir / "job.out"), "stderr": None})
    rows = [{"step": -1, "eval/accuracy": 0.1}] + [{"step": s, "rollout/reward_mean": r} for s, r in steps]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for i in range(attempts):
        (run_dir / "logs" / f"attempt-{i}").mkdir()
    return run_dir


def test_status_table(work):
    base = work / "runs"
    make_run(base, "a", "26", steps=[(0, 0.25), (1, 0.5)], attempts=2)
    make_run(base, "b", "30", attempts=1)
    make_run(base, "c")
    (base / "not-a-run").mkdir()
    runs = state.find_runs(None, str(base))
    assert [r.name for r in runs] == ["a", "b", "c"]
    rows = state.collect_status(runs, lambda argv: {"squeue": "26+0|RUNNING\n26+1|RUNNING\n",
                                                    "sacct": "30|TIMEOUT\n"}[argv[0]])
    assert [(r.run, r.job_id, r.state, r.rollout_id, r.last_reward, r.attempts) for r in rows] == [
        ("a", "26", "RUNNING", 1, 0.5, 2), ("b", "30", "TIMEOUT", None, None, 1),
        ("c", None, state.NOT_SUBMITTED, None, None, 0)]
    table = state.format_table(rows).splitlines()
    assert table[0].split() == ["RUN", "JOB", "STATE", "ROLLOUT", "REWARD", "ATTEMPTS", "PATH"]
    assert table[1].split()[:6] == ["a", "26", "RUNNING", "2/10", "0.500", "2"]  # steps 0 and 1 done
    assert table[3].split()[:6] == ["c", "-", "NOT_SUBMITTED", "-/10", "-", "0"]
    assert state.find_runs(str(base / "a")) == [base / "a"] and state.find_runs(str(base)) == runs
    assert state.find_run("b", str(base)) == base / "b"
    with pytest.raises(SlurmCommandError, match="RUN='zzz'"):
        state.find_run("zzz", str(base))


def test_status_of_local_runs(work):
    """Issue #9 point 11: a local ``hpcrl run`` (no job.json) reads RUNNING while its process lives, then its
    outcome; killed without one, FAILED; NOT_SUBMITTED only for a folder never run."""
    base = work / "runs"
    ten = [(i, 0.1 * i) for i in range(10)]

    def status(name):
        row = state.collect_status([base / name], lambda argv: None)[0]
        return row.state, state.format_table([row]).splitlines()[1].split()[3]

    make_run(base, "never")
    assert status("never") == (state.NOT_SUBMITTED, "-/10")
    done = make_run(base, "done", steps=ten)
    with state.local_run_record(done) as rec:
        assert status("done") == ("RUNNING", "10/10")  # this process is the run, alive
        rec.exit_code = 0
    assert status("done") == ("COMPLETED", "10/10")
    stopped = make_run(base, "stopped", steps=ten[:4])
    with state.local_run_record(stopped, stopped_codes=(75,)) as rec:
        rec.exit_code = 75
    assert status("stopped") == ("STOPPED", "4/10")
    with pytest.raises(KeyboardInterrupt), state.local_run_record(stopped):
        raise KeyboardInterrupt
    assert status("stopped")[0] == "STOPPED"
    failed = make_run(base, "failed", steps=ten[:3])
    with pytest.raises(ValueError), state.local_run_record(failed):
        raise ValueError("boom")
    rec = json.loads((failed / state.LOCAL_RUN_FILE).read_text())
    assert rec["state"] == "FAILED" and rec["pid"] == os.getpid() and rec["ended"] >= rec["started"]
    assert status("failed") == ("FAILED", "3/10")
    # killed: the record still says RUNNING, its process is gone (or its pid now belongs to another process)
    killed = make_run(base, "killed", steps=ten[:2])
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    for pid, ticks in ((child.pid, None), (os.getpid(), -1)):
        state.atomic_write_text(killed / state.LOCAL_RUN_FILE, json.dumps(
            {"state": "RUNNING", "pid": pid, "host": os.uname().nodename, "start_ticks": ticks}))
        assert status("killed") == ("FAILED", "2/10")
    elsewhere = make_run(base, "elsewhere", steps=ten[:2])
    state.atomic_write_text(elsewhere / state.LOCAL_RUN_FILE, json.dumps(
        {"state": "RUNNING", "pid": os.getpid(), "host": "some-other-node", "start_ticks": None}))
    assert status("elsewhere")[0] == state.UNKNOWN
    # folders from before local_run.json: told by their steps
    make_run(base, "old-done", steps=ten)
    make_run(base, "old-part", steps=ten[:5])
    assert status("old-done")[0] == "COMPLETED" and status("old-part")[0] == "STOPPED"
    # a live local run wins over an old Slurm job of the same folder; a finished one does not
    both = make_run(base, "both", job_id="40", steps=ten[:2])
    with state.local_run_record(both) as rec:
        assert state.collect_status([both], lambda argv: "40|CANCELLED\n")[0].state == "RUNNING"
        rec.exit_code = 0
    assert state.collect_status([both], lambda argv: "40|CANCELLED\n")[0].state == "CANCELLED"


def test_logs_newest_attempt(work):
    run_dir = make_run(work / "runs", "r", "9", attempts=2)
    (run_dir / "job.out").write_text(f"old\n{entry.ATTEMPT_MARKER} job 9 restart 0\nfirst\n"
                                     f"{entry.ATTEMPT_MARKER} job 9 restart 1\nsecond\n")
    (run_dir / "logs" / "attempt-0" / "engine-0.log").write_text("old engine\n")
    (run_dir / "logs" / "attempt-1" / "engine-0.log").write_text("new engine\n")
    (run_dir / "logs" / "attempt-1" / "router.log").write_text("router\n")
    import io

    out = io.StringIO()
    assert print_logs(run_dir, out=out) == 0
    text = out.getvalue()
    assert "first" not in text and "old" not in text
    assert text.index("restart 1") < text.index("second") < text.index("new engine") < text.index("router")
    assert f"==> {run_dir / 'logs' / 'attempt-1' / 'router.log'} <==" in text

    # --follow: prints what is appended, stops once the job is in a final state
    states = iter(["RUNNING", "COMPLETED"])
    out = io.StringIO()

    def job_state(job_id):
        with open(run_dir / "job.out", "a") as f:
            f.write("more\n")
        return next(states)

    assert print_logs(run_dir, follow=True, out=out, poll_s=0.01, state_every_s=0.0, job_state=job_state,
                      max_s=30) == 0
    assert out.getvalue().count("more") == 2


def test_cancel(work, monkeypatch):
    log = work / "scancel.log"
    fake_bin(work, monkeypatch, scancel=f'echo "$@" >> {log}')
    run_dir = make_run(work / "runs", "r", "26+0")
    assert cancel(run_dir) == "26" and log.read_text().split() == ["26"]
    with pytest.raises(SlurmCommandError, match="never submitted") as e:
        cancel(make_run(work / "runs", "s"))
    assert e.value.exit_code == 2
    fake_bin(work, monkeypatch,
             scancel='echo "scancel: error: Kill job error on job id 26: Invalid" >&2; exit 1')
    with pytest.raises(SlurmCommandError, match="Kill job error") as e:
        cancel(run_dir)
    assert e.value.exit_code == 1


# ------------------------------------------------------------------------------------------------------------
# The entry point inside the allocation
# ------------------------------------------------------------------------------------------------------------

def test_run_slurm_calls_the_bootstrap(work, capsys):
    res = dry(work, CPU)
    seen = {}

    def boot(cfg, run_dir):
        seen.update(cfg=cfg, run_dir=run_dir, env=os.environ.get("HPCRL_RUN_DIR"))
        return 0

    assert entry.run_slurm(res.run_dir / "config.yaml", bootstrap=boot) == 0
    assert seen["cfg"] == res.config and seen["run_dir"] == res.run_dir and seen["env"] == str(res.run_dir)
    assert capsys.readouterr().out.startswith(entry.ATTEMPT_MARKER)


def test_bootstrap_from_environment(work, monkeypatch):
    res = dry(work, CPU)
    (work / "hpcrl_test_boot.py").write_text("def boot(cfg, run_dir):\n    return 3\n")
    monkeypatch.syspath_prepend(str(work))
    monkeypatch.setenv(entry.BOOTSTRAP_ENV, "hpcrl_test_boot.boot")
    assert entry.run_slurm(res.run_dir / "config.yaml") == 3
    with pytest.raises(RuntimeError, match="exited with status 3"):
        entry.SlurmEntry(res.run_dir / "config.yaml")()


def test_export_torch_env_from_slurm_variables():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_ID": "77",
           "SLURM_STEP_NODELIST": "n[2-3]", "SLURM_JOB_NODELIST": "n[1-3]"}
    added = entry.export_torch_env(dict(env))
    assert added == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n2",
                     "MASTER_PORT": added["MASTER_PORT"]}
    assert 20000 <= int(added["MASTER_PORT"]) < 32768
    assert entry.export_torch_env(dict(env))["MASTER_PORT"] == added["MASTER_PORT"]  # same job, same port
    assert entry.export_torch_env(dict(env, MASTER_PORT="1234")).get("MASTER_PORT") is None  # set ones win


def test_plain_sbatch_preemption_exits_for_requeue(work, monkeypatch):
    res = dry(work, CPU, plain=True)
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    monkeypatch.setenv("HPCRL_PREEMPT_SIGNAL", "USR1")
    old = signal.getsignal(signal.SIGUSR1)

    def boot(cfg, run_dir):
        os.kill(os.getpid(), signal.SIGUSR1)
        import time

        time.sleep(5)
        return 0

    try:
        assert entry.run_slurm(res.run_dir / "config.yaml", bootstrap=boot) == requeue.EXIT_REQUEUE
    finally:
        signal.signal(signal.SIGUSR1, old)


@pytest.mark.parametrize("submitit", [True, False], ids=["submitit", "plain"])
def test_signal_after_the_run_finished_does_not_fail_the_task(work, submitit):
    """The time limit's ``--signal`` may land while a finished task exits (CI of f8db1fa: 'Job completed
    successfully', then 'srun: error: task 0: User defined signal 2', job FAILED). A real process runs the
    entry to its end, then gets the preemption signal: it must still exit 0."""
    res = dry(work, CPU, plain=not submitit)
    (work / "hpcrl_test_done.py").write_text("def boot(cfg, run_dir):\n    return 0\n")
    script = textwrap.dedent(f"""
        import os, signal, time
        from hpcrl.slurm import entry
        code = entry.SlurmEntry({str(res.run_dir / "config.yaml")!r})() if {submitit} else \\
            entry.run_slurm({str(res.run_dir / "config.yaml")!r})
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        print("alive", code)
    """)
    env = dict(os.environ, SLURM_JOB_ID="1", HPCRL_PREEMPT_SIGNAL="USR1", PYTHONPATH=str(work) + os.pathsep +
               os.environ.get("PYTHONPATH", ""), **{entry.BOOTSTRAP_ENV: "hpcrl_test_done.boot"})
    env.pop("SUBMITIT_FOLDER", None)
    if submitit:
        env["SUBMITIT_FOLDER"] = str(work)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert (out.returncode, out.stdout.split()[-2:]) == (0, ["alive", "0"]), out.stderr[-2000:]


def test_slurm_entry_checkpoint():
    e = entry.SlurmEntry("/r/config.yaml")
    d = e.checkpoint()
    assert isinstance(d.function, entry.SlurmEntry) and d.function.config_path == "/r/config.yaml"
    assert entry.SlurmEntry("/r/config.yaml", requeue=False).checkpoint() is None


def test_slurm_config_keeps_cpu_nprocs(work):
    cfg = load_config(None, ["model.create=tiny-qwen2", "train.nprocs=2", "train.micro_batch_size=16"])
    assert slurm_config(cfg).train.nprocs == 2 and plan_job(cfg).trainer.ntasks_per_node == 2


# ------------------------------------------------------------------------------------------------------------
# The command line (real subprocesses of the console script)
# ------------------------------------------------------------------------------------------------------------

def hpcrl(args, cwd, env=None):
    script = Path(sys.executable).with_name("hpcrl")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "hpcrl"]
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run(cmd + args, cwd=cwd, capture_output=True, text=True, timeout=120, env=full_env,
                          check=False)


def test_cli_submit_dry_run(work):
    write(work / "run.yaml", COLOCATE)
    out = hpcrl(["submit", "run.yaml", "slurm.nodes=1", "--dry-run"], work)
    assert out.returncode == 0, out.stderr
    script = (work / "runs" / "golden-colocate" / "submission.sbatch").read_text()
    assert out.stdout == script and script.startswith("#!/bin/bash\n")
    assert "nothing was submitted" in out.stderr
    out = hpcrl(["submit", "run.yaml", "--dry-run", "--plain"], work)
    assert out.returncode == 0 and 'run-slurm "$RUN_DIR/config.yaml"' in out.stdout


@pytest.mark.parametrize("args,text,expect", [
    (["submit", "run.yaml", "--dry-run"], CPU + "run: {placement: disaggregate}\n",
     "config error: slurm.rollout="),
    (["submit", "run.yaml", "slurm.extra_sbatch=[--nodes=2]"], CPU, "config error: slurm.extra_sbatch[0]="),
    (["submit", "run.yaml"], CPU, "hpcrl submit: sbatch not found on PATH"),
    (["status", "nope"], CPU, "RUN='nope': no run folder"),
    (["status"], CPU, "--output-dir='runs': no such folder"),
    (["logs", "nope"], CPU, "RUN='nope': no run folder"),
    (["cancel", "nope"], CPU, "RUN='nope': no run folder"),
])
def test_cli_bad_input_exit_2_one_line(work, args, text, expect):
    write(work / "run.yaml", text.replace("run: {name: cpu}\n", "") if "placement" in text else text)
    out = hpcrl(args, work, env={"PATH": str(work / "no-slurm-here")})
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(expect), out.stderr
    assert "Traceback" not in out.stderr and not (work / "runs" / "cpu").exists()


def test_cli_status_logs_cancel(work):
    make_run(work / "runs", "a", "26", steps=[(0, 0.75)], attempts=1)
    (work / "runs" / "a" / "job.out").write_text(f"{entry.ATTEMPT_MARKER} x\nhello\n")
    bin_dir = work / "bin"
    bin_dir.mkdir()
    scripts = {"squeue": "echo '26+0|RUNNING'", "scancel": f"echo \"$@\" > {work}/scancel.args"}
    for name, body in scripts.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    out = hpcrl(["status"], work, env)
    assert out.returncode == 0 and out.stdout.splitlines()[1].split()[:6] == ["a", "26", "RUNNING", "1/10",
                                                                              "0.750", "1"]
    out = hpcrl(["logs", "a"], work, env)
    assert out.returncode == 0 and "hello" in out.stdout
    out = hpcrl(["cancel", "runs/a"], work, env)
    assert out.returncode == 0 and "cancelled job 26" in out.stdout
    assert (work / "scancel.args").read_text().split() == ["26"]
    out = hpcrl(["cancel", "a"], work, {"PATH": "/nonexistent"})
    assert out.returncode == 2 and "scancel not found" in out.stderr


def test_cli_run_slurm_help():
    out = hpcrl(["run-slurm", "--help"], REPO)
    assert out.returncode == 0 and "config.yaml" in out.stdout


# ------------------------------------------------------------------------------------------------------------
# The image definition, the modulefile and the templates agree with the code
# ------------------------------------------------------------------------------------------------------------

def test_image_definition_matches_the_container_wrapping():
    text = (REPO / "singularity" / "hpcrl.def").read_text()
    assert ct.TMS_PRELOAD_IN_IMAGE in text and "HPCRL_HOME=/opt/hpcrl" in text
    files = text.split("\n%files\n", 1)[1].split("\n%", 1)[0]
    for line in filter(None, (row.strip() for row in files.splitlines())):
        assert (REPO / line.split()[0]).exists(), line
    for pkg in ("megatron-core", "sglang", "sgl-deep-ep", "flashinfer-python", "torch-memory-saver"):
        assert pkg in text
    assert "untested in CI" in (REPO / "singularity" / "README.md").read_text()


def test_modulefile_sets_home_and_path():
    text = (REPO / "modules" / "hpcrl.lua").read_text()
    assert 'pushenv("HPCRL_HOME", root)' in text and 'prepend_path("PATH", bin)' in text and "help([[" in text


def test_templates_found_through_hpcrl_home(tmp_path):
    from hpcrl.slurm.templates import template_dir

    assert template_dir({}) == REPO / "sbatch"
    (tmp_path / "sbatch").mkdir()
    (tmp_path / "sbatch" / "colocate.sbatch").write_text("#!/bin/bash\n")
    assert template_dir({"HPCRL_HOME": str(tmp_path)}) == tmp_path / "sbatch"


def test_templates_are_strict_jinja(tmp_path, work):
    """A variable a template uses and the code does not give is an error, not an empty string."""
    import jinja2

    from hpcrl.slurm.templates import render_template

    cfg = load_config(None, ["model.create=tiny-qwen2"])
    (tmp_path / "sbatch").mkdir()
    (tmp_path / "sbatch" / "colocate.sbatch").write_text("#SBATCH --nodes={{ nodes }}\n{{ no_such_variable }}\n")
    with pytest.raises(jinja2.UndefinedError, match="no_such_variable"):
        render_template(cfg, tmp_path / "run", cwd=tmp_path, environ={"HPCRL_HOME": str(tmp_path)}, python="py")
    text = (REPO / "sbatch" / "colocate.sbatch").read_text() + (REPO / "sbatch" / "disaggregate.sbatch").read_text()
    assert "@@" not in text  # no token of the old engine is left unrendered


def test_rollout_step_srun_command_colocated_and_het(tmp_path):
    from hpcrl.slurm.rollout_step import num_engines, srun_command

    cfg = load_and_check(None, ["model.create=tiny-qwen2", "rollout.num_engines=2", "slurm.gpus_per_node=4"])
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "1"}
    cmd = srun_command(cfg, tmp_path, tmp_path / "logs/attempt-0", tmp_path / "m", tmp_path / "secret", env,
                       python="py")
    assert cmd[:4] == ["srun", "--overlap", "--mem=0", "--ntasks=2"] and "--jobid=42" in cmd
    assert "--nodes=1" in cmd and "--gres=gpu:4" in cmd and not any("het-group" in a for a in cmd)
    assert not any("CUDA_VISIBLE_DEVICES" in a for a in cmd)  # Slurm sets it for the step
    assert cmd[cmd.index("py"):] == ["py", "-m", "hpcrl.slurm.rollout_step", "--config",
                                     str(tmp_path / "config.yaml"), "--model-path", str(tmp_path / "m"),
                                     "--attempt-dir", str(tmp_path / "logs/attempt-0"), "--secret",
                                     str(tmp_path / "secret"), "--preempt-signal", "SIGUSR2"]
    het = load_and_check(None, ["model.create=tiny-qwen2", "run.placement=disaggregate",
                                "slurm.rollout={nodes: 3, gpus_per_node: 8}"])
    cmd = srun_command(het, tmp_path, tmp_path, tmp_path / "m", tmp_path / "secret", env, python="py")
    assert num_engines(het) == 3
    assert {"--het-group=1", "--nodes=3", "--ntasks-per-node=1", "--ntasks=3", "--gres=gpu:8"} <= set(cmd)
    image = tmp_path / "hpcrl.sif"
    image.write_bytes(b"")
    boxed = load_and_check(None, ["model.create=tiny-qwen2", f"slurm.container={image}"])
    cmd = srun_command(boxed, tmp_path, tmp_path, tmp_path / "m", tmp_path / "secret", env, python="py")
    assert cmd[cmd.index("apptainer"):cmd.index("py")][-1] == str(image)


def test_the_rollout_task_blocks_the_preemption_signal_before_its_imports(tmp_path):
    """The task blocks ``--preempt-signal`` as the module's first act, before ``hpcrl.config`` is imported (a
    USR2 during a loaded step's start-up killed it: 2026-12-06); a real ``python -m`` of the module, stopped at
    that import, reports its blocked mask."""
    stub = tmp_path / "stub" / "hpcrl"
    (stub / "slurm").mkdir(parents=True)
    (stub / "__init__.py").write_text("")
    (stub / "slurm" / "__init__.py").write_text("")
    (stub / "slurm" / "rollout_step.py").write_text((REPO / "hpcrl/slurm/rollout_step.py").read_text())
    (stub / "config.py").write_text(  # the first hpcrl import of the module: report the mask and stop
        "import signal, sys\nprint(sorted(s.name for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))\n"
        "sys.exit(0)\n")
    out = subprocess.run([sys.executable, "-m", "hpcrl.slurm.rollout_step", "--config", "x",
                          "--preempt-signal", "SIGUSR2"], cwd=tmp_path / "stub", capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(tmp_path / "stub")})
    assert out.returncode == 0, out.stderr
    assert "SIGUSR2" in out.stdout, out.stdout


def test_rollout_step_srun_command_of_a_replacement_engine(tmp_path):
    """Issue #12: a dead engine is replaced by a one-engine step on its node, from the weight snapshot at the
    current version, with its own log and address file."""
    from hpcrl.slurm.rollout_step import srun_command

    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NUM_NODES": "1"}
    het = load_and_check(None, ["model.create=tiny-qwen2", "run.placement=disaggregate",
                                "slurm.rollout={nodes: 3, gpus_per_node: 8}"])
    cmd = srun_command(het, tmp_path, tmp_path / "a", tmp_path / "snap", tmp_path / "secret", env, python="py",
                       restart=(2, 1, "n4", "17"))
    assert {"--het-group=1", "--nodes=1", "--ntasks=1", "--nodelist=n4", "--gres=gpu:8",
            f"--output={tmp_path / 'a'}/engine-2.restart-1.log"} <= set(cmd)
    tail = cmd[cmd.index("py"):]
    assert tail[tail.index("--model-path") + 1] == str(tmp_path / "snap")
    assert tail[-4:] == ["--address-file", "engine-2.restart-1.json", "--weight-version", "17"]
    colo = load_and_check(None, ["model.create=tiny-qwen2", "rollout.num_engines=2"])
    cmd = srun_command(colo, tmp_path, tmp_path, tmp_path / "m", tmp_path / "secret", env, python="py",
                       restart=(0, 3, "n1", None))
    assert {"--ntasks=1", "--nodes=1", "--nodelist=n1"} <= set(cmd) and "--weight-version" not in cmd


def test_rollout_step_engine_command_passes_gpu_sglang_flags(tmp_path, monkeypatch):
    """Point 4: GPU-only SGLang flags of the ``sglang:`` section reach the real ``sglang.launch_server`` command
    line the rollout step execs on a GPU node; colocated adds ``--enable-memory-saver``, deterministic runs
    SGLang's deterministic inference. (Without a GPU the CPU line is built: test_rollout_unit.py.)"""
    from hpcrl.rollout import engines
    from hpcrl.rollout.engines import engine_command

    monkeypatch.setattr(engines, "on_gpu", lambda: True)
    from hpcrl.rollout.secret import create_run_secret
    from hpcrl.rollout.engines import engine_sglang_args

    (tmp_path / "c.yaml").write_text(textwrap.dedent(f"""
        model: {{path: {tmp_path}/m, create: tiny-qwen2}}
        run: {{placement: colocate, deterministic: true}}
        rollout: {{engine: sglang}}
        sglang: {{moe_a2a_backend: deepep, deepep_mode: low_latency, attention_backend: flashinfer,
                 quantization: fp8, tp_size: 4}}
        """))
    cfg = load_and_check(tmp_path / "c.yaml")
    cmd = engine_command(cfg.rollout, engine_sglang_args(cfg), "/m", "0.0.0.0", 30000, create_run_secret(tmp_path),
                         key_via="config")
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    flags = " ".join(cmd)
    for flag in ("--moe-a2a-backend deepep", "--deepep-mode low_latency", "--attention-backend flashinfer",
                 "--quantization fp8", "--tp-size 4", "--enable-memory-saver",
                 "--enable-deterministic-inference"):
        assert flag in flags, flag
    assert "--dtype" not in flags  # model.dtype float32 (default): the engine's own default


def test_engine_gets_model_dtype(tmp_path):
    """``model.dtype: bfloat16`` reaches the CPU engine's command line (``--dtype bfloat16``)."""
    from hpcrl.rollout.engines import engine_command
    from hpcrl.rollout.engines import engine_sglang_args

    (tmp_path / "c.yaml").write_text(f"model: {{path: {tmp_path}/m, create: tiny-qwen2, dtype: bfloat16}}\n"
                                     "rollout: {engine: cpu}\n")
    cmd = engine_command(load_and_check(tmp_path / "c.yaml").rollout, engine_sglang_args(load_and_check(
           tmp_path / "c.yaml")), "/m", "127.0.0.1", 30000, None)
    assert cmd[1:3] == ["-m", "hpcrl.engine.server"] and " --dtype bfloat16" in " ".join(cmd)


def test_rollout_step_check_waits_for_a_dying_step(tmp_path):
    """A request can fail on a killed engine before ``srun`` has exited: check(grace_s) waits for the step and
    reports it (RolloutStepError with its log), while a step that stays up lets the caller's own error stand."""
    from hpcrl.slurm.rollout_step import RolloutStep, RolloutStepError

    (tmp_path / "rollout-step.log").write_text("srun: error: task 0: Killed\n")
    dying = RolloutStep(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"]), tmp_path,
                        ["srun", "x"])
    dying.check()  # still running: nothing to report yet
    with pytest.raises(RolloutStepError, match="task 0: Killed"):
        dying.check(grace_s=30.0)
    alive = RolloutStep(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]), tmp_path,
                        ["srun", "y"])
    try:
        alive.check(grace_s=0.2)
    finally:
        alive.stop(grace_s=1.0)
