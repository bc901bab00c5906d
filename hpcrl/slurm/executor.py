"""Heterogeneous Slurm jobs with submitit (which has none: facebookincubator/submitit#1741), by extension.

:class:`HetSlurmExecutor` is submitit's own :class:`~submitit.slurm.slurm.SlurmExecutor` with two additions:

* the sbatch script gets extra ``#SBATCH`` lines (``extra_sbatch``) after submitit's parameters, then per
  extra het component one ``#SBATCH hetjob`` separator followed by that component's ``#SBATCH --flag=value``
  lines.
  submitit's parameters describe het group 0, where the batch script and submitit's ``srun`` step run.
* sacct lists the components of het job ``<id>`` as ``<id>+0``, ``<id>+1``, ...; :class:`HetSlurmInfoWatcher`
  maps ``<id>+0`` back to ``<id>`` so the job's state (``job.state``, ``job.wait()``) is group 0's.

Slurm refuses job arrays of het jobs, so a het executor submits one job at a time. Without components it
submits job arrays (``map_array``, ``submit_array``, ``batch()``; ``hpcrl sweep``) with the extra ``#SBATCH``
lines kept (submitit's own array path copies the parameters into a plain ``SlurmExecutor``, dropping them);
``always_array`` makes even a one-element array submission an array (``--array=0-0%1``), so array task ids are
always ``<id>_<index>``.

With ``forward_signal`` (the preemption signal's name, ``USR2``) the batch shell survives that signal and passes
it on (:func:`forward_signal_lines`): submitit's ``srun`` step runs in the background under a ``trap``, because
``scancel --signal=USR2 --full`` / ``--batch`` and ``--signal=B:USR2@N`` signal the batch shell, and a bash
without a trap dies of USR2 (and takes the job with it). With no extra component, no extra line and no
``forward_signal`` the script is byte-for-byte submitit's.

:meth:`HetSlurmExecutor.render` returns the script text without calling sbatch (``--dry-run``); it is the same
text :meth:`submit` writes and submits (``render(map_count=n)``: the script of an array of ``n`` tasks).
"""

from __future__ import annotations

import shlex
import sys
import typing as tp
import uuid
from pathlib import Path

from submitit.core import core, utils
from submitit.slurm import slurm as _slurm

from hpcrl.slurm.state import het_base_id

HETJOB_LINE = "#SBATCH hetjob"
SUBMITIT_COMMAND_MARK = "export SUBMITIT_EXECUTOR=slurm"
"""The line of submitit's script right before its ``srun`` command."""


def forward_signal_lines(command: str, signal_name: str) -> list[str]:
    """Shell lines that run ``command`` (the job step's ``srun ...``) so that the batch shell neither dies of
    ``signal_name`` (``USR2``) nor sits on it: a trap passes it on to ``srun``, which forwards it to the step's
    tasks (the trainer, whose handler sets the checkpoint flag); after the lines ``$hpcrl_rc`` is the step's exit
    status.

    bash runs a trap only after its foreground command returns, so the step runs in the background and the shell
    waits; a trap cuts ``wait`` short (status > 128), so it waits again (bash keeps the step's own status until it
    has been reported). Raises ValueError for a signal name that is not a plain word.
    """
    if not signal_name.isalnum():
        raise ValueError(f"signal name {signal_name!r}: expected a name such as USR2")
    return [
        f"# The batch shell may get {signal_name} too (scancel --signal={signal_name} --full or --batch, "
        f"--signal=B:{signal_name}@N): pass it on",
        "# to the step instead of dying of it. A trap runs only between commands: the step runs in the background.",
        "hpcrl_step=",
        f"trap 'hpcrl_sig=1; echo \"hpcrl: the batch shell got SIG{signal_name}; passing it on to the job step\"; "
        f"kill -s {signal_name} \"$hpcrl_step\" 2>/dev/null' {signal_name}",
        f"{command} &",
        "hpcrl_step=$!",
        "while :; do  # a trap cuts wait short (status > 128): wait again for the step's own status",
        '    hpcrl_sig=0; wait "$hpcrl_step"; hpcrl_rc=$?',
        '    if [ "$hpcrl_sig" = 0 ] || [ "$hpcrl_rc" -le 128 ]; then break; fi',
        "done",
    ]


def sbatch_flag(key: str, value: tp.Any) -> str:
    """One ``#SBATCH`` line in submitit's spelling (``cpus_per_task`` -> ``--cpus-per-task``; True: bare)."""
    return _slurm._as_sbatch_flag(key, value)


def insert_after_last_sbatch(text: str, lines: tp.Sequence[str]) -> str:
    """``text`` with ``lines`` inserted right after its last ``#SBATCH`` line.

    Raises ValueError when ``text`` has no ``#SBATCH`` line.
    """
    rows = text.split("\n")
    last = max((i for i, row in enumerate(rows) if row.startswith("#SBATCH")), default=None)
    if last is None:
        raise ValueError("the script has no #SBATCH line")
    return "\n".join(rows[: last + 1] + list(lines) + rows[last + 1:])


def het_lines(components: tp.Sequence[tp.Mapping[str, tp.Any]]) -> list[str]:
    """``#SBATCH hetjob`` plus the sorted flags of each extra component (``None``/``False`` skipped)."""
    out: list[str] = []
    for comp in components:
        out.append(HETJOB_LINE)
        out += [sbatch_flag(k, v) for k, v in sorted(comp.items()) if v is not None and v is not False]
    return out


class HetSlurmInfoWatcher(_slurm.SlurmInfoWatcher):
    """submitit's sacct watcher that also knows het jobs: ``<id>+0``'s row is reported as ``<id>``."""

    def read_info(self, string: tp.Union[bytes, str]) -> tp.Dict[str, tp.Dict[str, str]]:
        info = super().read_info(string)
        for key, stats in list(info.items()):
            base = het_base_id(key)
            if base != key and key.endswith("+0"):
                info[base] = stats
        return info


class HetSlurmJob(_slurm.SlurmJob[core.R]):
    """A submitit Slurm job whose state is read with :class:`HetSlurmInfoWatcher`."""

    watcher = HetSlurmInfoWatcher(delay_s=600)


class HetSlurmExecutor(_slurm.SlurmExecutor):
    """submitit's SlurmExecutor plus het-job components and verbatim extra ``#SBATCH`` lines.

    Args:
        folder: submitit's folder (pickles and task logs ``%j_%t_log.out``/``.err``).
        components: sbatch flags of het groups 1, 2, ... as ``{name: value}`` in submitit's spelling
            (``{"nodes": 1, "gpus_per_node": 4, "partition": "gpu"}``); empty for a normal job.
        extra_sbatch: extra options for group 0, written as ``#SBATCH <line>`` (``--reservation=foo``).
        max_num_timeout: requeues allowed after time-limit signals (submitit's; preemptions do not count).
        python: command that runs python in the job (e.g. an ``apptainer exec ... IMAGE python3`` prefix);
            default the current interpreter.
        render_only: skip submitit's check that ``srun`` is on PATH, for rendering the script on a machine
            without Slurm (:meth:`render`); such an executor must not submit.
        forward_signal: name of the preemption signal (``USR2``) the batch shell traps and passes on to the
            step (:func:`forward_signal_lines`); None: submitit's plain foreground ``srun``.
    """

    job_class = HetSlurmJob

    def __init__(self, folder: tp.Union[str, Path], components: tp.Sequence[tp.Mapping[str, tp.Any]] = (),
                 extra_sbatch: tp.Sequence[str] = (), max_num_timeout: int = 3,
                 python: tp.Optional[str] = None, render_only: bool = False,
                 forward_signal: tp.Optional[str] = None) -> None:
        if render_only:  # SlurmExecutor.__init__ minus its "is srun on PATH" check
            core.PicklingExecutor.__init__(self, folder, max_num_timeout=max_num_timeout)
            self.python = shlex.quote(sys.executable) if python is None else python
        else:
            super().__init__(folder, max_num_timeout=max_num_timeout, python=python)
        self.render_only = render_only
        self.components = [dict(c) for c in components]
        self.extra_sbatch = list(extra_sbatch)
        self.forward_signal = forward_signal
        self.always_array = False
        """Submit an array submission of one item as a one-task array too (``hpcrl sweep`` sets it)."""

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        text = super()._make_submission_file_text(command, uid)
        if self.forward_signal is not None:
            text = self._with_forwarding(text)
        lines = [f"#SBATCH {line}" for line in self.extra_sbatch] + het_lines(self.components)
        return insert_after_last_sbatch(text, lines) if lines else text

    def _with_forwarding(self, text: str) -> str:
        """submitit's script with its ``srun`` line run under :func:`forward_signal_lines`."""
        rows = text.split("\n")
        if SUBMITIT_COMMAND_MARK not in rows or "teardown" in self.parameters:
            raise ValueError("cannot forward the signal: submitit's script has no single srun command "
                             "(or has a teardown)")
        i = rows.index(SUBMITIT_COMMAND_MARK) + 1
        rows[i:i + 1] = forward_signal_lines(rows[i], self.forward_signal) + ['exit "$hpcrl_rc"']
        return "\n".join(rows)

    def _internal_process_submissions(self, delayed_submissions: tp.List[utils.DelayedSubmission]
                                      ) -> tp.List[core.Job[tp.Any]]:
        if self.render_only:
            raise RuntimeError("this HetSlurmExecutor was made with render_only=True and cannot submit")
        as_array = len(delayed_submissions) > 1 or (self.always_array and bool(delayed_submissions))
        if as_array and self.components:
            raise ValueError("Slurm cannot run a job array of heterogeneous jobs; submit them one by one")
        if as_array:
            return self._submit_array(delayed_submissions)
        return super()._internal_process_submissions(delayed_submissions)

    def _submit_array(self, delayed_submissions: tp.List[utils.DelayedSubmission]
                      ) -> tp.List[core.Job[tp.Any]]:
        """submitit's array submission (``SlurmExecutor._internal_process_submissions``) with a copy of this
        executor, so the extra ``#SBATCH`` lines stay in the array's script. Job ids ``<id>_<index>``."""
        folder = utils.JobPaths.get_first_id_independent_folder(self.folder)
        folder.mkdir(parents=True, exist_ok=True)
        timeout_min = self.parameters.get("time", 5)
        pickle_paths = []
        for d in delayed_submissions:
            pickle_path = folder / f"{uuid.uuid4().hex}.pkl"
            d.set_timeout(timeout_min, self.max_num_timeout)
            d.dump(pickle_path)
            pickle_paths.append(pickle_path)
        n = len(delayed_submissions)
        array_ex = type(self)(self.folder, extra_sbatch=self.extra_sbatch,
                              max_num_timeout=self.max_num_timeout, python=self.python,
                              forward_signal=self.forward_signal)
        array_ex.update_parameters(**self.parameters)
        array_ex.parameters["map_count"] = n
        self._throttle()
        first_job: core.Job[tp.Any] = array_ex._submit_command(self._submitit_command_str)
        tasks_ids = list(range(first_job.num_tasks))
        jobs: tp.List[core.Job[tp.Any]] = [
            self.job_class(folder=self.folder, job_id=f"{first_job.job_id}_{a}", tasks=tasks_ids)
            for a in range(n)]
        for job, pickle_path in zip(jobs, pickle_paths):
            job.paths.move_temporary_file(pickle_path, "submitted_pickle")
        return jobs

    def render(self, map_count: tp.Optional[int] = None) -> str:
        """The sbatch script a submission would use, without calling sbatch (the text of ``--dry-run``).

        ``map_count``: render the script of a job array of that many tasks (``--array=0-<N-1>%P`` with ``P`` =
        ``min(N, array_parallelism)``; log names ``%A_%a``); None: a single job's script.
        """
        if map_count is None:
            return self._make_submission_file_text(self._submitit_command_str, "render")
        if self.components:
            raise ValueError("Slurm cannot run a job array of heterogeneous jobs")
        saved = dict(self.parameters)
        try:
            self.parameters["map_count"] = map_count
            return self._make_submission_file_text(self._submitit_command_str, "render")
        finally:
            self.parameters.clear()
            self.parameters.update(saved)
