"""``hpcrl sweep``: a hyperparameter sweep as one Slurm job array, its status, report and resubmission.

A sweep file is a normal run config with a ``sweep:`` section (:class:`hpcrl.config.SweepSection`)::

    run: {name: lr-sweep, output_dir: runs}
    ...                              # the base run, as for hpcrl submit
    sweep:
      grid: {train.lr: [3.0e-5, 1.0e-4], rollout.temperature: [0.8, 1.0]}   # cartesian product
      seeds: [1, 2, 3]                                                      # product over run.seed
      num_random: 4                  # random points drawn from random_space (without replacement)
      random_space: {algorithm.eps_clip: [0.1, 0.2, 0.3], train.weight_decay: [0.0, 0.01]}
      random_seed: 0
      array_parallelism: 8           # at most this many array tasks run at once

Points
    The points are the product *grid x random x seeds*, a missing factor counting as one empty assignment:
    every grid combination (keys in file order, the last key varying fastest), combined with each of the
    ``num_random`` random assignments, each run once per seed. Random assignments pick one value per
    ``random_space`` key; they are ``num_random`` distinct combinations drawn without replacement with
    ``random.Random(random_seed)``, so the same file gives the same points. ``random_space`` lists the
    choices of each key (for a log-uniform learning rate, list the values: ``[1.0e-5, 3.0e-5, 1.0e-4]``).
    A key may appear in only one of grid / random_space / seeds (``seeds`` is ``run.seed``); ``run.name``,
    ``run.output_dir`` and ``sweep.*`` cannot be swept.

Point names
    ``<key>=<value>`` for each swept key, joined with ``,`` in point order (grid keys, random keys, then
    ``seed``): ``lr=3e-05,seed=1``. ``<key>`` is the last part of the dotted key, or the whole dotted key
    where two swept keys share their last part (``train.lr`` and ``sft.lr``). Values: integers as is, floats
    as Python's shortest round-trip repr (``3e-05``, ``0.00015``), booleans ``true``/``false``, null ``null``,
    strings as is, lists/mappings as compact JSON. Characters outside ``[A-Za-z0-9._+=,@-]`` become ``_``; a
    name longer than :data:`MAX_POINT_NAME` is cut and ends with 8 hex digits of its SHA-1; a name equal to an
    earlier one after that gets ``-<point index>``. The point name is the run's ``run.name``.

Folders
    ``run.output_dir/<sweep name>/`` (``<sweep name>`` is the base ``run.name``) holds :data:`SWEEP_FILE`
    (the manifest), ``submission.sbatch`` (the array script as submitted; ``resubmission-K.sbatch`` for later
    submissions), ``submitit/`` (pickles and task logs ``<array id>_<index>_0_log.{out,err}``), and one run
    folder per point, ``<sweep name>/<point name>/``, with its resolved ``config.yaml`` (the base with the
    point's values; the ``sweep`` section emptied), ``logs/`` and, once submitted, ``job.json`` (job id
    ``<array id>_<index>``), so ``hpcrl status|logs|cancel POINT_FOLDER`` work on one point.

Order of :func:`submit_sweep` (nothing is written or queued until every check has passed): load the base
config with the overrides (its types and sweep section must be valid; a base that fails another check is
accepted when every point passes, since only the points run: e.g. ``train.lr_warmup_steps`` above the base's
``run.num_rollout`` with ``run.num_rollout`` swept); expand the points; validate every point as ``hpcrl
submit`` would (a bad point is a one-line :class:`~hpcrl.config.ConfigError` naming the point and the field;
a point failing on the field the base failed on gets the base's error, naming no point); check that every
point asks Slurm for the same resources (one array has one shape); then write the folders and the manifest
and submit one job array with submitit's ``executor.submit_array``
(``--array=0-<N-1>%<sweep.array_parallelism>``) whose task *i* runs :class:`~hpcrl.slurm.entry.SlurmEntry`
of point *i*'s ``config.yaml``: the very function job ``hpcrl submit`` pickles for that config, so each task
is preempted, requeued (``scontrol requeue <id>_<i>``, never the bare raw job id, which for the array's last
task requeues every task) and resumed like a single run. The array's parameters are those ``hpcrl submit``
would use for the first point (every point has the same, see above), with the job name ``<sweep name>``, a
per-task ``HPCRL_RUN_DIR`` and, with ``slurm.container``, the folders of every point bound into the
container.

Disaggregated runs (``run.placement: disaggregate``) are heterogeneous jobs, and Slurm cannot make a job array
of heterogeneous jobs. A sweep whose points are all disaggregated is submitted as **one het job per point**
(each exactly what ``hpcrl submit`` submits for that point); ``sweep.array_parallelism`` does not apply to
them (all are queued at once) and the manifest has ``"het": true`` and no array ids. A sweep mixing colocated
and disaggregated points is a ConfigError.

Manifest (``sweep.json``, rewritten atomically)::

    {"version": 1, "name": "lr-sweep", "sweep_dir": "/abs/runs/lr-sweep", "workdir": "/abs/submit/dir",
     "base_config": "/abs/lr-sweep.yaml", "overrides": ["run.num_rollout=50"],
     "sweep": {... the sweep section ...}, "het": false, "array_parallelism": 8,
     "created_at": "2026-...+00:00", "hpcrl_version": "...",
     "submissions": [{"kind": "array", "array_job_id": "123", "points": ["lr=3e-05,seed=1", ...],
                      "script": "/abs/.../submission.sbatch", "submitted_at": "..."}],
     "points": [{"index": 0, "name": "lr=3e-05,seed=1", "overrides": {"train.lr": 3e-05, "run.seed": 1},
                 "run_dir": "/abs/runs/lr-sweep/lr=3e-05,seed=1", "job_id": "123_0", "array_job_id": "123",
                 "task_index": 0, "previous_job_ids": []}, ...]}

``job_id``/``array_job_id``/``task_index`` are null after ``--dry-run`` (and ``submissions`` empty); for a het
sweep ``job_id`` is the point's het job id and ``array_job_id``/``task_index`` are null.

States: each point's state is its current job's (:func:`sweep_states`): squeue for live tasks, sacct for ended
ones, asked for the whole array since sacct folds tasks that never started into one row
(``3_[2-3%2]|CANCELLED`` after ``scancel 3``), which is expanded. A point whose job neither knows (Slurm 22.05
keeps no record of a pending task cancelled by its own id ``3_2``; accounting purged) is ``UNKNOWN``, and
``hpcrl status`` / the report's ``note`` column say why and whether it ever started.

Resubmission (:func:`resubmit_sweep`): points whose job ended FAILED, TIMEOUT, CANCELLED, NODE_FAIL,
OUT_OF_MEMORY, BOOT_FAIL, DEADLINE or PREEMPTED (:data:`RESUBMIT_STATES`), those whose job Slurm no longer
knows while their run has not logged every step (:func:`resubmittable`), or the points named, go into a new
job array of just those points (task *j* = the *j*-th of them; each run folder resumes from its newest
checkpoint, as a requeued job does); the manifest records the new ids, the old ones in ``previous_job_ids``.

Cancelling (:mod:`~hpcrl.slurm.sweep.cancel`): ``hpcrl cancel SWEEP_FOLDER`` prints, then cancels with one
``scancel``, every array (and het job) of the sweep with a point queued or running; ``--points`` only those
points' tasks.

Modules: :mod:`~hpcrl.slurm.sweep.points` (expansion and names, pure), :mod:`~hpcrl.slurm.sweep.plan`
(validate every point, one Slurm shape), :mod:`~hpcrl.slurm.sweep.manifest` (``sweep.json``),
:mod:`~hpcrl.slurm.sweep.submit` (array or het jobs, resubmission), :mod:`~hpcrl.slurm.sweep.cancel` (``hpcrl
cancel SWEEP``), :mod:`~hpcrl.slurm.sweep.report` (status table, ``report.csv`` / ``report.png``).
"""

from __future__ import annotations

from hpcrl.slurm.sweep.points import (MAX_POINT_NAME, SEED_KEY, SweepPoint, expand_points, format_value,
                                      key_labels, sanitize_name, point_names)
from hpcrl.slurm.sweep.plan import SweepPlan, point_error, check_one_shape, plan_sweep
from hpcrl.slurm.sweep.manifest import (SWEEP_FILE, MANIFEST_VERSION, RESUBMIT_STATES, SweepStates,
                                        write_manifest, find_sweep, read_manifest, sweep_states, point_states,
                                        resubmittable, check_no_live_jobs, resolve_point_names)
from hpcrl.slurm.sweep.submit import (run_dir_setup_line, make_array_executor, SweepResult, submit_sweep,
                                      resubmit_sweep)
from hpcrl.slurm.sweep.cancel import CancelPlan, plan_cancel, cancel_sweep, wait_ended
from hpcrl.slurm.sweep.report import (REPORT_CSV, REPORT_PNG, PointStatus, point_status, sweep_status,
                                      format_sweep_table, REPORT_COLUMNS, write_report, plot_report)

__all__ = [
    "MAX_POINT_NAME",
    "SEED_KEY",
    "SweepPoint",
    "expand_points",
    "format_value",
    "key_labels",
    "sanitize_name",
    "point_names",
    "SweepPlan",
    "point_error",
    "check_one_shape",
    "plan_sweep",
    "SWEEP_FILE",
    "MANIFEST_VERSION",
    "RESUBMIT_STATES",
    "write_manifest",
    "find_sweep",
    "read_manifest",
    "SweepStates",
    "sweep_states",
    "point_states",
    "resubmittable",
    "check_no_live_jobs",
    "resolve_point_names",
    "run_dir_setup_line",
    "make_array_executor",
    "SweepResult",
    "submit_sweep",
    "resubmit_sweep",
    "CancelPlan",
    "plan_cancel",
    "cancel_sweep",
    "wait_ended",
    "REPORT_CSV",
    "REPORT_PNG",
    "PointStatus",
    "point_status",
    "sweep_status",
    "format_sweep_table",
    "REPORT_COLUMNS",
    "write_report",
    "plot_report",
]
