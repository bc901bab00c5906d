"""``hpcrl sweep`` without a cluster: points, names, validation, the array script, the sweep folder, fake
submissions (fake ``sbatch``/``srun`` on PATH, states from a fake squeue/sacct runner), resubmission, status,
the report and the command line. The real cluster is ``tests/integration/test_sweep_cluster.py``.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config import ConfigError, SweepSection, load_config
from hpcrl.slurm import SlurmCommandError, entry, state
from hpcrl.slurm import sweep as sw
from hpcrl.slurm.executor import HetSlurmExecutor
from hpcrl.slurm.submit import prepare_config, submit
from tests.unit.test_slurm_submit import fake_bin, write

REPO = Path(__file__).resolve().parents[2]
PY = "/opt/hpcrl/venv/bin/python"

BASE = """\
run: {name: lrs, num_rollout: 10}
model: {create: tiny-qwen2}
slurm:
  time: "01:00:00"
  cpus_per_task: 2
  extra_sbatch: ["--comment=sweep-test", "--mail-type=END"]
  setup: ["module load foo"]
"""
SWEEP = """\
sweep:
  grid: {train.lr: [1.0e-4, 3.0e-4]}
  seeds: [1, 2]
  array_parallelism: 2
"""
HET = """\
run: {name: hets, num_rollout: 10, placement: disaggregate}
model: {create: tiny-qwen2}
slurm: {gpus_per_node: 2, rollout: {nodes: 1, gpus_per_node: 2}}
sweep: {grid: {train.lr: [1.0e-4, 3.0e-4]}}
"""


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A clean submit directory with no Slurm variables around."""
    monkeypatch.chdir(tmp_path)
    for k in list(os.environ):
        if k.startswith(("SLURM_", "HPCRL_", "TMS_", "SUBMITIT_")):
            monkeypatch.delenv(k)
    return tmp_path


def dry(work: Path, text: str = BASE + SWEEP, *overrides: str, environ=None) -> sw.SweepResult:
    return sw.submit_sweep(write(work / "sweep.yaml", text), list(overrides), dry_run=True, python=PY,
                           environ={} if environ is None else environ)


def fake_sbatch(work: Path, monkeypatch, first: int = 4242) -> Path:
    """sbatch that logs its arguments and answers job ids first, first+1, ..."""
    log, counter = work / "sbatch.log", work / "sbatch.next"
    fake_bin(work, monkeypatch, sbatch=f'echo "$@" >> {log}; n=$(cat {counter} 2>/dev/null || echo {first}); '
                                       f'echo $((n + 1)) > {counter}; echo "Submitted batch job $n"')
    return log


def runner_for(states: dict[str, str]):
    """A squeue/sacct runner: live states from squeue, final ones from sacct (as the real commands)."""
    def run(argv):
        ids = argv[argv.index("-j") + 1].split(",")
        live = argv[0] == "squeue"
        return "".join(f"{j}|{s}\n" for j, s in states.items()
                       if j in ids and (s not in state.FINAL_STATES) == live)
    return run


# ------------------------------------------------------------------------------------------------------------
# Points and names
# ------------------------------------------------------------------------------------------------------------

def test_points_grid_then_random_then_seeds():
    s = SweepSection(grid={"train.lr": [1, 2], "rollout.temperature": [0.5, 1.0]}, seeds=[7, 8])
    pts = sw.expand_points(s)
    assert len(pts) == 8
    assert pts[:3] == [{"train.lr": 1, "rollout.temperature": 0.5, "run.seed": 7},
                       {"train.lr": 1, "rollout.temperature": 0.5, "run.seed": 8},
                       {"train.lr": 1, "rollout.temperature": 1.0, "run.seed": 7}]
    assert pts[-1] == {"train.lr": 2, "rollout.temperature": 1.0, "run.seed": 8}
    assert [list(p) for p in pts] == [["train.lr", "rollout.temperature", "run.seed"]] * 8  # point order
    space = {"algorithm.eps_clip": [0.1, 0.2, 0.3], "train.weight_decay": [0.0, 0.01]}
    s = SweepSection(grid={"train.lr": [1, 2]}, num_random=3, random_space=space, seeds=[1, 2])
    pts = sw.expand_points(s)
    assert len(pts) == 2 * 3 * 2
    assert [list(p) for p in pts][0] == ["train.lr", "algorithm.eps_clip", "train.weight_decay", "run.seed"]
    rand = [(p["algorithm.eps_clip"], p["train.weight_decay"]) for p in pts[:6:2]]
    assert len(set(rand)) == 3  # distinct random assignments, each once per grid point and seed
    assert [(p["algorithm.eps_clip"], p["train.weight_decay"]) for p in pts[6::2]] == rand
    assert sw.expand_points(SweepSection(seeds=[3])) == [{"run.seed": 3}]


def test_random_points_deterministic_distinct_without_replacement():
    space = {"a.b": [1, 2, 3], "c.d": ["x", "y"]}
    draw = [sw.expand_points(SweepSection(num_random=4, random_space=space, random_seed=seed))
            for seed in (0, 0, 1)]
    assert draw[0] == draw[1] and draw[0] != draw[2]
    assert len({tuple(p.items()) for p in draw[0]}) == 4
    every = sw.expand_points(SweepSection(num_random=6, random_space=space))
    assert sorted((p["a.b"], p["c.d"]) for p in every) == [(a, c) for a in (1, 2, 3) for c in ("x", "y")]
    with pytest.raises(ConfigError) as e:
        sw.expand_points(SweepSection(num_random=7, random_space=space))
    assert e.value.field == "sweep.num_random" and "6 combinations" in str(e.value)


@pytest.mark.parametrize("section,field,words", [
    (SweepSection(), "sweep", "nothing to sweep"),
    (SweepSection(grid={"train.lr": [1]}, num_random=1, random_space={"train.lr": [2]}),
     "sweep.random_space.train.lr", "also in sweep.grid"),
    (SweepSection(grid={"run.seed": [1]}, seeds=[1]), "sweep.seeds", "also in sweep.grid"),
    (SweepSection(grid={"run.name": ["a", "b"]}), "sweep.grid.run.name", "names the run folders"),
    (SweepSection(num_random=1, random_space={"run.output_dir": ["a"]}), "sweep.random_space.run.output_dir",
     "names the run folders"),
])
def test_expand_errors(section, field, words):
    with pytest.raises(ConfigError) as e:
        sw.expand_points(section)
    assert e.value.field == field and words in str(e.value) and "\n" not in str(e.value)


def test_point_names():
    assert sw.point_names([{"train.lr": 3e-5, "run.seed": 1}, {"train.lr": 0.00015, "run.seed": 2}]) == [
        "lr=3e-05,seed=1", "lr=0.00015,seed=2"]
    # last parts that clash: the whole dotted key
    assert sw.point_names([{"train.lr": 1.0, "sft.lr": 2, "rollout.temperature": 0.5}]) == [
        "train.lr=1.0,sft.lr=2,temperature=0.5"]
    values = [{"x.flag": True, "x.v": None, "x.l": [1, 2], "x.m": {"b": 1, "a": "s p"}}]
    assert sw.point_names(values) == ['flag=true,v=null,l=_1,2_,m=__a___s_p_,_b__1_']
    assert sw.point_names([{"x.s": "/abs/path with space"}]) == ["s=_abs_path_with_space"]
    assert sw.point_names([{"x.s": "-lead"}])[0] == "s=-lead" and sw.sanitize_name("-x") == "p-x"


def test_point_names_collisions_and_length():
    # "a/b" and "a_b" sanitize to the same name; 1 and "1" print the same: the later gets -<index>
    names = sw.point_names([{"x.s": "a/b"}, {"x.s": "a_b"}, {"x.s": 1}, {"x.s": "1"}])
    assert names == ["s=a_b", "s=a_b-1", "s=1", "s=1-3"] and len(set(names)) == 4
    long = [{"data.source": "d" * 300}, {"data.source": "d" * 299 + "e"}]
    names = sw.point_names(long)
    assert all(len(n) == sw.MAX_POINT_NAME for n in names) and names[0] != names[1]
    assert all(re.fullmatch(r"source=d+-[0-9a-f]{8}", n) for n in names)
    assert sw.point_names(long) == names  # deterministic


# ------------------------------------------------------------------------------------------------------------
# Planning and validation: nothing written on an error
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,overrides,field,words", [
    (BASE + "sweep: {grid: {train.lr_warmup_steps: [0, 50]}}\n", [], "train.lr_warmup_steps",
     "sweep point 'lr_warmup_steps=50'"),
    (BASE + "sweep: {grid: {rollout.batch_size: [8, 5]}}\n", [], "train.micro_batch_size",
     "sweep point 'batch_size=5': must divide the global batch of 40 samples"),
    (BASE + "sweep: {grid: {train.lrr: [1.0]}}\n", [], "sweep.grid.train.lrr", ""),
    (BASE + "sweep: {grid: {train.lr: [1.0, big]}}\n", [], "sweep.grid.train.lr[1]", ""),
    (BASE + "sweep: {grid: {slurm.cpus_per_task: [2, 4]}}\n", [], "sweep.grid.slurm.cpus_per_task",
     "sweep points 'cpus_per_task=2' and 'cpus_per_task=4' need different Slurm resources"),
    (BASE + "sweep: {grid: {slurm.nodes: [1, 2]}}\n", [], "train.nprocs", "sweep point 'nodes=2'"),
    (BASE + SWEEP, ["sweep.array_parallelism=0"], "sweep.array_parallelism", ""),
    (BASE + SWEEP, ["sweep.seeds=[1, 1]"], "sweep.seeds", "duplicate"),
    (BASE, [], "sweep", "nothing to sweep"),
    # sweeping the placement: the colocated points cannot have the rollout group the others need (the base,
    # colocated, has the same problem: its error is reported as is)
    ("run: {name: mix, num_rollout: 10}\nmodel: {create: tiny-qwen2}\n"
     "slurm: {gpus_per_node: 2, rollout: {nodes: 1, gpus_per_node: 2}}\n"
     "sweep: {grid: {run.placement: [colocate, disaggregate]}}\n", [], "slurm.rollout",
     "slurm.rollout={'nodes': 1, 'gpus_per_node': 2, 'cpus_per_task': 2, 'mem': None, 'partition': None, "
     "'gpu_memory_gb': None}: a rollout het group needs run.placement: disaggregate"),
    # a problem of the base that no point fixes: the base's error
    (BASE + SWEEP, ["train.lr_warmup_steps=50"], "train.lr_warmup_steps",
     "config error: train.lr_warmup_steps=50: must be smaller than train.lr_decay_steps=10"),
    ("run: {name: mix, num_rollout: 10}\nmodel: {create: tiny-qwen2}\n"
     "sweep: {grid: {run.placement: [colocate, disaggregate]}}\n", [], "slurm.rollout",
     "sweep point 'placement=disaggregate'"),
])
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry", "submit"])
def test_bad_sweep_rejected_before_anything_is_written(work, monkeypatch, text, overrides, field, words,
                                                       dry_run):
    log = fake_sbatch(work, monkeypatch)
    with pytest.raises(ConfigError) as e:
        sw.submit_sweep(write(work / "sweep.yaml", text), overrides, dry_run=dry_run, environ={})
    assert e.value.field == field and words in str(e.value) and "\n" not in str(e.value)
    assert not (work / "runs").exists() and not log.exists()


def test_invalid_base_is_fine_when_every_point_is_valid(work):
    text = BASE + SWEEP.replace("{train.lr: [1.0e-4, 3.0e-4]}", "{run.num_rollout: [100, 200]}")
    res = dry(work, text, "train.lr_warmup_steps=50")  # 50 warmup steps > the base's 10 rollouts
    assert res.points == ["num_rollout=100,seed=1", "num_rollout=100,seed=2", "num_rollout=200,seed=1",
                          "num_rollout=200,seed=2"]
    assert load_config(res.sweep_dir / res.points[3] / "config.yaml").run.num_rollout == 200


def test_mixed_placement_in_one_array_is_refused(work):
    """Colocated and disaggregated points that are each valid still cannot share one array."""
    colo = prepare_config(write(work / "c.yaml", BASE), ["slurm.gpus_per_node=2"])
    het = prepare_config(write(work / "h.yaml", HET.split("sweep:")[0]))
    points = [sw.SweepPoint(index=i, name=n, overrides={}, config=c, plan=p)
              for i, (n, (c, p)) in enumerate([("a", colo), ("b", het)])]
    with pytest.raises(ConfigError) as e:
        sw.check_one_shape(points)
    msg = str(e.value)
    assert e.value.field == "run.placement" and "\n" not in msg
    assert "sweep points 'a' and 'b' mix colocated and disaggregated" in msg


def test_point_config_is_base_plus_assignment_as_submit_would_write_it(work):
    res = dry(work, BASE + SWEEP, "rollout.batch_size=16")
    sdir = work / "runs" / "lrs"
    assert res.sweep_dir == sdir
    assert res.points == ["lr=0.0001,seed=1", "lr=0.0001,seed=2", "lr=0.0003,seed=1", "lr=0.0003,seed=2"]
    write(work / "base.yaml", BASE)
    for name in res.points:
        lr, seed = re.fullmatch(r"lr=(.*),seed=(.*)", name).groups()
        expected, _ = prepare_config(work / "base.yaml", ["rollout.batch_size=16", f"train.lr={lr}",
                                                          f"run.seed={seed}", f"run.name={name}",
                                                          f"run.output_dir={sdir}"])
        got = load_config(sdir / name / "config.yaml")
        assert got == expected
        assert got.train.lr == float(lr) and got.run.seed == int(seed) and got.sweep == SweepSection()
        assert (sdir / name / "logs").is_dir() and not (sdir / name / "job.json").exists()


def test_dry_run_folder_manifest_and_array_script(work):
    res = dry(work)
    sdir = res.sweep_dir
    assert res.dry_run and res.array_job_id is None and res.scripts == [sdir / "submission.sbatch"]
    assert sorted(p.name for p in sdir.iterdir()) == sorted(res.points + ["submission.sbatch", "sweep.json"])
    script = (sdir / "submission.sbatch").read_text()
    assert script == res.script
    lines = script.splitlines()
    assert "#SBATCH --array=0-3%2" in lines and "#SBATCH --job-name=lrs" in lines
    assert "#SBATCH --comment=sweep-test" in lines and "#SBATCH --mail-type=END" in lines
    assert f"#SBATCH --output={sdir}/submitit/%A_%a_0_log.out" in lines and "module load foo" in lines
    runs = " ".join(str(sdir / n) for n in res.points)
    assert f'_hpcrl_runs=({runs}); export HPCRL_RUN_DIR="${{_hpcrl_runs[$SLURM_ARRAY_TASK_ID]}}"' in lines
    assert not any(line.startswith("export HPCRL_RUN_DIR=") for line in lines)
    m = json.loads((sdir / "sweep.json").read_text())
    assert m["version"] == 1 and m["name"] == "lrs" and m["sweep_dir"] == str(sdir) and m["het"] is False
    assert m["workdir"] == str(work) and m["base_config"] == str(work / "sweep.yaml") and m["overrides"] == []
    assert m["array_parallelism"] == 2 and m["submissions"] == [] and m["sweep"]["seeds"] == [1, 2]
    assert m["points"][1] == {"index": 1, "name": "lr=0.0001,seed=2",
                              "overrides": {"train.lr": 1e-4, "run.seed": 2},
                              "run_dir": str(sdir / "lr=0.0001,seed=2"), "job_id": None, "array_job_id": None,
                              "task_index": None, "previous_job_ids": []}
    assert dry(work).script == script  # deterministic; a dry run may be repeated


def test_array_script_is_the_single_run_script_of_a_point(work):
    """Apart from the array and per-run names, each task gets exactly what ``hpcrl submit`` asks for."""
    res = dry(work)
    single = submit(write(work / "one.yaml", BASE), ["run.name=one"], dry_run=True, python=PY, environ={})

    def norm(text: str, folder: Path, name: str) -> list[str]:
        out = []
        for line in text.splitlines():
            line = line.replace(str(folder), "FOLDER").replace(f"--job-name={name}", "--job-name=NAME")
            line = line.replace("%A_%a", "%j")
            if not line.startswith(("#SBATCH --array=", "_hpcrl_runs=(", "export HPCRL_RUN_DIR=")):
                out.append(line)
        return out

    assert norm(res.script, res.sweep_dir, "lrs") == norm(single.script, single.run_dir, "one")


def test_one_point_is_an_array_too(work):
    res = dry(work, BASE + "sweep: {grid: {train.lr: [1.0e-4]}}\n")
    assert "#SBATCH --array=0-0%1" in res.script.splitlines()


def test_het_sweep_is_one_het_job_per_point(work):
    res = dry(work, HET)
    assert res.het and len(res.scripts) == 2
    m = json.loads((res.sweep_dir / "sweep.json").read_text())
    assert m["het"] is True and [p["job_id"] for p in m["points"]] == [None, None]
    for name, path in zip(res.points, res.scripts):
        assert path == res.sweep_dir / name / "submission.sbatch"
        text = path.read_text()
        assert "#SBATCH hetjob" in text and "--array" not in text and f"--job-name={name}" in text
    assert not (res.sweep_dir / "submission.sbatch").exists()


def test_het_sweep_submits_one_job_per_point_and_records_a_partial_refusal(work, monkeypatch):
    counter = work / "sbatch.n"
    fake_bin(work, monkeypatch, squeue="exit 0", sacct="printf '500|COMPLETED\\n501|FAILED\\n'",
             sbatch=f'n=$(cat {counter} 2>/dev/null || echo 0); echo $((n + 1)) > {counter}; '
                    'if [ "$n" = 2 ]; then echo "sbatch: error: QOSMaxJobsPerUser" >&2; exit 1; fi; '
                    'echo "Submitted batch job $((500 + n))"')  # the third call (n = 2) is refused
    res = sw.submit_sweep(write(work / "sweep.yaml", HET), environ={}, runner=runner_for({}))
    assert res.het and res.array_job_id is None and res.job_ids == {res.points[0]: "500", res.points[1]: "501"}
    for name, job_id in res.job_ids.items():
        job = json.loads((res.sweep_dir / name / "job.json").read_text())
        assert job["job_id"] == job_id and job["het"] is True  # exactly hpcrl submit's record
    states = {"500": "COMPLETED", "501": "FAILED"}
    with pytest.raises(SlurmCommandError, match="QOSMaxJobsPerUser") as e:
        sw.submit_sweep(work / "sweep.yaml", ["sweep.grid={train.lr: [1.0e-4, 3.0e-4, 1.0e-3]}"], environ={},
                        runner=runner_for(states))
    assert e.value.exit_code == 1
    m = sw.read_manifest(res.sweep_dir)
    assert [p["job_id"] for p in m["points"]] == [None, None, None]  # its first point was refused
    counter.write_text("1")  # next: point 0 queued as 501, point 1 refused
    with pytest.raises(SlurmCommandError, match="QOSMaxJobsPerUser"):
        sw.submit_sweep(work / "sweep.yaml", environ={}, runner=runner_for(states))
    m = sw.read_manifest(res.sweep_dir)
    assert [p["job_id"] for p in m["points"]] == ["501", None]
    assert m["submissions"][-1]["points"] == [res.points[0]] and m["points"][0]["previous_job_ids"] == ["500"]


def test_container_binds_every_points_files(work, tmp_path_factory):
    outside = tmp_path_factory.mktemp("models")
    (outside / "a").mkdir()
    (outside / "b").mkdir()
    text = BASE + f"sweep: {{grid: {{model.path: [{outside}/a/m, {outside}/b/m]}}}}\n"
    (work / "img.sif").write_text("image")
    res = dry(work, text, "slurm.container=img.sif")
    binds = re.search(r"--bind (\S+)", res.script).group(1).split(",")
    assert binds[:2] == [str(res.sweep_dir), str(work)] and {f"{outside}/a", f"{outside}/b"} <= set(binds)


def test_sweep_quickstart_config_dry_run(work):
    shutil.copytree(REPO / "configs", work / "configs")
    res = sw.submit_sweep("configs/sweep-quickstart.yaml", dry_run=True, environ={})
    assert len(res.points) == 4 and not res.het and "#SBATCH --array=0-3%2" in res.script.splitlines()
    assert res.points == ["lr=0.00015,seed=1", "lr=0.00015,seed=2", "lr=0.0005,seed=1", "lr=0.0005,seed=2"]


# ------------------------------------------------------------------------------------------------------------
# Submission with a fake sbatch; status; resubmission
# ------------------------------------------------------------------------------------------------------------

def test_submit_writes_job_json_per_point(work, monkeypatch):
    log = fake_sbatch(work, monkeypatch)
    res = sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={}, runner=runner_for({}))
    sdir = res.sweep_dir
    assert res.array_job_id == "4242" and not res.dry_run
    assert res.job_ids == {n: f"4242_{i}" for i, n in enumerate(res.points)}
    assert len(log.read_text().splitlines()) == 1  # one sbatch call for the whole array
    assert (sdir / "submitit" / "4242_submission.sh").read_text() == (sdir / "submission.sbatch").read_text()
    from submitit.core.utils import DelayedSubmission

    m = json.loads((sdir / "sweep.json").read_text())
    assert m["submissions"][0]["array_job_id"] == "4242" and m["submissions"][0]["points"] == res.points
    for i, (name, q) in enumerate(zip(res.points, m["points"])):
        run_dir = sdir / name
        assert (q["job_id"], q["array_job_id"], q["task_index"]) == (f"4242_{i}", "4242", i)
        job = json.loads((run_dir / "job.json").read_text())
        assert job["job_id"] == f"4242_{i}" and job["config"] == str(run_dir / "config.yaml")
        assert job["stdout"] == str(sdir / "submitit" / f"4242_{i}_0_log.out") and job["sweep"] == str(sdir)
        assert job["workdir"] == str(work) and job["script"] == str(sdir / "submission.sbatch")
        # the task's function job is hpcrl submit's own: SlurmEntry of the point's config
        delayed = DelayedSubmission.load(sdir / "submitit" / f"4242_{i}_submitted.pkl")
        assert isinstance(delayed.function, entry.SlurmEntry) and delayed.args == ()
        assert delayed.function.config_path == str(run_dir / "config.yaml") and delayed.function.requeue
    # hpcrl status of one point works like a run folder
    rows = state.collect_status([sdir / res.points[1]], runner_for({"4242_1": "RUNNING"}))
    assert rows[0].job_id == "4242_1" and rows[0].state == "RUNNING"


def test_live_points_block_a_new_submission_and_dry_run_keeps_ids(work, monkeypatch):
    fake_sbatch(work, monkeypatch)
    sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={}, runner=runner_for({}))
    before = (work / "runs" / "lrs" / "sweep.json").read_text()
    live = r"still queued or running: lr=0.0001,seed=1 \(PENDING\)"
    with pytest.raises(SlurmCommandError, match=live) as e:
        sw.submit_sweep(work / "sweep.yaml", environ={}, runner=runner_for({"4242_0": "PENDING"}))
    assert e.value.exit_code == 2
    with pytest.raises(SlurmCommandError, match="holds a submitted sweep"):
        sw.submit_sweep(work / "sweep.yaml", dry_run=True, environ={})
    assert (work / "runs" / "lrs" / "sweep.json").read_text() == before
    # all finished: a new array, the old ids remembered
    res = sw.submit_sweep(work / "sweep.yaml", environ={}, runner=runner_for({"4242_0": "COMPLETED"}))
    m = json.loads((res.manifest_path).read_text())
    assert res.array_job_id == "4243" and m["points"][0]["previous_job_ids"] == ["4242_0"]
    job = json.loads((res.sweep_dir / res.points[0] / "job.json").read_text())
    assert job["previous_job_ids"] == ["4242_0"]


def test_no_sbatch_nothing_written(work, monkeypatch):
    monkeypatch.setenv("PATH", str(work / "empty"))
    with pytest.raises(SlurmCommandError, match="sbatch not found") as e:
        sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={})
    assert e.value.exit_code == 2 and not (work / "runs").exists()


def test_sbatch_refusal_is_one_line_and_leaves_a_readable_sweep(work, monkeypatch):
    fake_bin(work, monkeypatch, sbatch='echo "sbatch: error: invalid partition specified: nope" >&2; exit 1')
    with pytest.raises(SlurmCommandError, match="invalid partition specified: nope") as e:
        sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={}, runner=runner_for({}))
    assert e.value.exit_code == 1 and "\n" not in str(e.value)
    m = sw.read_manifest(work / "runs" / "lrs")
    assert [p["job_id"] for p in m["points"]] == [None] * 4 and m["submissions"] == []


def test_resubmit_failed_points_as_a_new_array(work, monkeypatch):
    log = fake_sbatch(work, monkeypatch)
    res = sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={}, runner=runner_for({}))
    sdir = res.sweep_dir
    states = {"4242_0": "COMPLETED", "4242_1": "FAILED", "4242_2": "RUNNING", "4242_3": "CANCELLED"}
    assert sw.point_states(sw.read_manifest(sdir), runner_for(states)) == dict(zip(res.points,
                                                                                    states.values()))
    again = sw.resubmit_sweep(sdir, dry_run=True, runner=runner_for(states), environ={})
    assert again.points == [res.points[1], res.points[3]] and again.dry_run
    assert (sdir / "resubmission-1.sbatch").read_text() == again.script
    assert sw.read_manifest(sdir)["points"][1]["job_id"] == "4242_1"  # a dry run changes no record

    again = sw.resubmit_sweep(sdir, runner=runner_for(states), environ={})
    assert again.array_job_id == "4243"
    assert again.job_ids == {res.points[1]: "4243_0", res.points[3]: "4243_1"}
    script = (sdir / "submitit" / "4243_submission.sh").read_text()
    assert script == (sdir / "resubmission-1.sbatch").read_text() and "#SBATCH --array=0-1%2" in script
    assert f"_hpcrl_runs=({sdir / res.points[1]} {sdir / res.points[3]});" in script
    assert "#SBATCH --comment=sweep-test" in script
    from submitit.core.utils import DelayedSubmission

    delayed = DelayedSubmission.load(sdir / "submitit" / "4243_1_submitted.pkl")
    assert delayed.function.config_path == str(sdir / res.points[3] / "config.yaml")
    m = sw.read_manifest(sdir)
    p1, p3 = m["points"][1], m["points"][3]
    assert (p1["job_id"], p1["task_index"], p1["previous_job_ids"]) == ("4243_0", 0, ["4242_1"])
    assert (p3["job_id"], p3["task_index"], p3["previous_job_ids"]) == ("4243_1", 1, ["4242_3"])
    assert m["points"][0]["job_id"] == "4242_0"
    assert len(m["submissions"]) == 2 and m["submissions"][1]["resubmit"]
    job = json.loads((sdir / res.points[3] / "job.json").read_text())
    assert job["job_id"] == "4243_1" and job["previous_job_ids"] == ["4242_3"]
    assert job["script"] == str(sdir / "resubmission-1.sbatch")
    # named points; one still running is refused; unknown names list the known ones
    named = sw.resubmit_sweep(sdir, [res.points[0]], dry_run=True, runner=runner_for(states), environ={})
    assert named.points == [res.points[0]]
    with pytest.raises(SlurmCommandError, match="is still RUNNING"):
        sw.resubmit_sweep(sdir, [res.points[2]], runner=runner_for(states), environ={})
    with pytest.raises(SlurmCommandError, match="'nope' is not a point"):
        sw.resubmit_sweep(sdir, ["nope"], runner=runner_for(states), environ={})
    nothing = sw.resubmit_sweep(sdir, runner=runner_for({k: "COMPLETED" for k in ["4242_0", "4242_2",
                                                                                   "4243_0", "4243_1"]}),
                                environ={})
    assert nothing.points == [] and len(log.read_text().splitlines()) == 2


def test_resolve_point_names_rejoins_commas():
    m = {"sweep_dir": "/s", "points": [{"name": n} for n in ("lr=1,seed=1", "lr=1,seed=2", "lr=2,seed=1")]}
    assert sw.resolve_point_names(m, ["lr=1,seed=2,lr=2,seed=1", "lr=1,seed=1"]) == [
        "lr=1,seed=2", "lr=2,seed=1", "lr=1,seed=1"]
    with pytest.raises(SlurmCommandError, match="'lr=3,seed=1' is not a point"):
        sw.resolve_point_names(m, ["lr=1,seed=2,lr=3,seed=1"])


# ------------------------------------------------------------------------------------------------------------
# Status and report from real metrics files
# ------------------------------------------------------------------------------------------------------------

def write_metrics(run_dir: Path, rewards: list[float], evals: dict[int, float] | None = None,
                  attempts: int = 1) -> None:
    evals = evals or {}
    rows = [{"step": -1, "eval/accuracy": evals.get(-1, 0.1)}]
    for step, r in enumerate(rewards):
        rows.append({"step": step, "rollout/reward_mean": r, **({"eval/accuracy": evals[step]}
                                                                 if step in evals else {})})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for i in range(attempts):
        (run_dir / "logs" / f"attempt-{i}").mkdir(exist_ok=True)


def test_status_and_report(work, monkeypatch):
    fake_sbatch(work, monkeypatch)
    res = sw.submit_sweep(write(work / "sweep.yaml", BASE + SWEEP), environ={}, runner=runner_for({}))
    sdir = res.sweep_dir
    write_metrics(sdir / res.points[0], [0.1, 0.2, 0.4], {2: 0.5}, attempts=2)
    write_metrics(sdir / res.points[1], [0.3, 0.1])
    states = {"4242_0": "COMPLETED", "4242_1": "RUNNING", "4242_2": "PENDING", "4242_3": "FAILED"}
    manifest, rows = sw.sweep_status(sdir, runner_for(states))
    table = sw.format_sweep_table(manifest, rows).splitlines()
    assert table[0] == f"sweep lrs: 4 points, job array 4242 ({sdir})"
    assert table[1].split() == ["POINT", "JOB", "STATE", "ROLLOUT", "REWARD", "EVAL", "ATTEMPTS"]
    assert table[2].split() == [res.points[0], "4242_0", "COMPLETED", "3/10", "0.400", "0.500", "2"]
    assert table[3].split() == [res.points[1], "4242_1", "RUNNING", "2/10", "0.100", "0.100", "1"]
    assert table[4].split() == [res.points[2], "4242_2", "PENDING", "-/10", "-", "-", "0"]
    assert table[-1] == "1 COMPLETED, 1 FAILED, 1 PENDING, 1 RUNNING"

    csv_path, png = sw.write_report(sdir, runner_for(states))
    assert csv_path == sdir / "report.csv" and png == sdir / "report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(csv_path, newline="") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == ["point", "train.lr", "run.seed", "job_id", "state", "steps", "final_reward_mean",
                            "final_eval_accuracy", "run_dir", "note"]
    assert got[0] == {"point": res.points[0], "train.lr": "0.0001", "run.seed": "1", "job_id": "4242_0",
                      "state": "COMPLETED", "steps": "3", "final_reward_mean": "0.4",
                      "final_eval_accuracy": "0.5", "run_dir": str(sdir / res.points[0]), "note": ""}
    assert [got[1][k] for k in ("steps", "final_reward_mean", "final_eval_accuracy")] == ["2", "0.1", "0.1"]
    assert (got[3]["state"], got[3]["steps"], got[3]["final_reward_mean"], got[3]["final_eval_accuracy"]) == (
        "FAILED", "0", "", "")


def test_report_without_rewards_writes_no_png(work):
    res = dry(work)
    csv_path, png = sw.write_report(res.sweep_dir, runner_for({}))
    assert png is None and not (res.sweep_dir / "report.png").exists()
    assert [r[4] for r in csv.reader(open(csv_path))][1:] == ["NOT_SUBMITTED"] * 4


def test_not_a_sweep_folder(work):
    with pytest.raises(SlurmCommandError, match="not a sweep folder") as e:
        sw.read_manifest(work)
    assert e.value.exit_code == 2


# ------------------------------------------------------------------------------------------------------------
# Executor
# ------------------------------------------------------------------------------------------------------------

def test_het_executor_refuses_arrays(tmp_path):
    ex = HetSlurmExecutor(tmp_path, components=[{"nodes": 1}], render_only=True)
    with pytest.raises(ValueError, match="heterogeneous"):
        ex.render(map_count=2)
    ex.render_only = False
    ex.always_array = True
    from submitit.core.utils import DelayedSubmission

    with pytest.raises(ValueError, match="heterogeneous"):
        ex._internal_process_submissions([DelayedSubmission(print)])


# ------------------------------------------------------------------------------------------------------------
# The command line (real subprocesses of the console script)
# ------------------------------------------------------------------------------------------------------------

def hpcrl(args, cwd, env=None):
    script = Path(sys.executable).with_name("hpcrl")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "hpcrl"]
    full_env = dict(os.environ, PYTHONWARNINGS="ignore", **(env or {}))
    return subprocess.run(cmd + args, cwd=cwd, capture_output=True, text=True, timeout=120, env=full_env,
                          check=False)


def test_cli_dry_run_status_report(work):
    write(work / "sweep.yaml", BASE + SWEEP)
    out = hpcrl(["sweep", "sweep.yaml", "train.lr_warmup_steps=2", "--dry-run"], work)
    assert out.returncode == 0, out.stderr
    sdir = work / "runs" / "lrs"
    assert out.stdout == (sdir / "submission.sbatch").read_text()
    assert out.stderr.startswith(f"hpcrl sweep --dry-run: wrote {sdir} (sweep.json, 4 point folders:")
    assert load_config(sdir / "lr=0.0003,seed=2" / "config.yaml").train.lr_warmup_steps == 2
    bin_dir = work / "bin"
    bin_dir.mkdir()
    for name in ("squeue", "sacct"):
        (bin_dir / name).write_text("#!/bin/bash\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": str(bin_dir)}  # the fakes only: the local cluster's real sbatch must not be found
    for target in (str(sdir), "lrs", str(sdir / "sweep.json")):
        out = hpcrl(["status", target], work, env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines()[0] == f"sweep lrs: 4 points, not submitted ({sdir})"
        assert out.stdout.splitlines()[-1] == "4 NOT_SUBMITTED"
    write_metrics(sdir / "lr=0.0001,seed=1", [0.25])
    out = hpcrl(["sweep", "--report", "runs/lrs"], work, env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [f"wrote {sdir / 'report.csv'}", f"wrote {sdir / 'report.png'}"]
    out = hpcrl(["sweep", "--resubmit", "runs/lrs", "--points", "lr=0.0001,seed=1", "--dry-run"], work, env)
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --array=0-0%1" in out.stdout
    assert "would resubmit 1 points (lr=0.0001,seed=1)" in out.stderr
    out = hpcrl(["sweep", "--resubmit", "runs/lrs"], work, env)
    assert out.returncode == 0 and out.stdout.startswith("nothing to resubmit in")


@pytest.mark.parametrize("args,expect", [
    (["sweep", "runs/lrs", "--report", "--resubmit"], "hpcrl sweep: give --report or --resubmit, not both"),
    (["sweep", "runs/lrs", "--report", "--dry-run"], "hpcrl sweep --report: --dry-run does not apply"),
    (["sweep", "runs/lrs", "--resubmit", "--points", "nope"], "--points='nope': 'nope' is not a point of"),
    (["sweep", "runs/lrs"], "hpcrl sweep: runs/lrs is a sweep folder; use hpcrl sweep --report / --resubmit"),
    (["sweep", "runs/lrs/lr=0.0001,seed=1", "--report"],
     "SWEEP='runs/lrs/lr=0.0001,seed=1': not a sweep folder"),
    (["sweep", "sweep.yaml"], "hpcrl sweep: sbatch not found on PATH"),
    (["sweep", "sweep.yaml", "sweep.grid={train.lrr: [1]}"], "config error: sweep.grid.train.lrr="),
    (["sweep", "sweep.yaml", "run.name=bad", "sweep.grid={train.lr_warmup_steps: [50]}", "--dry-run"],
     "config error: train.lr_warmup_steps=50: sweep point 'lr_warmup_steps=50,seed=1': must be smaller"),
])
def test_cli_bad_input_exit_2_one_line(work, args, expect):
    write(work / "sweep.yaml", BASE + SWEEP)
    dry(work)
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    out = hpcrl(args, work, env={"PATH": str(work / "no-slurm-here")})
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(expect), out.stderr
    assert "Traceback" not in out.stderr and sorted(p.relative_to(work) for p in work.rglob("*")) == before
