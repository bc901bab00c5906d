"""The rollout job step: the engines of a run started by the controller (trainer rank 0) with ``srun``.

Colocated (one allocation): ``srun --overlap --ntasks=E --nodes=min(E, nodes)`` on the allocation's own nodes,
sharing CPUs, memory and GPUs with the trainer step (``--gres=gpu:G`` with ``slurm.gpus_per_node`` G > 0, so
Slurm, not hpcrl, sets ``CUDA_VISIBLE_DEVICES``). Disaggregated (het job): ``srun --het-group=1`` with one engine
per node of group 1. Every task runs :func:`task_main` (``python -m hpcrl.slurm.rollout_step``), which picks a
free port on its node, writes ``ATTEMPT/engines/engine-<SLURM_PROCID>.json`` (``{"url", "node", "pid"}``,
atomically) and runs the engine (hpcrl's CPU engine, or ``python -m sglang.launch_server`` with the
``sglang:`` flags on GPU nodes) as its child, bound to all interfaces and protected by the run's secret; an
engine whose port another process took before it could bind it is started again on a new port, with a new
address file (:func:`supervise_engine`). The controller
reads the addresses from the shared run folder, waits for ``/health`` on each, and stops the step at the end.

If the step dies (a task fails: ``--kill-on-bad-exit``, which takes the step's other engines with it), the
controller's health monitor (:mod:`hpcrl.rollout.health`) replaces each dead engine with a one-engine step on
its node (:meth:`RolloutStepLaunch.restart`); with ``rollout.max_engine_restarts: 0``,
:meth:`RolloutStep.check` raises with the step's log tail, so the run fails fast instead of hanging on requests
to dead engines.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Optional

PREEMPT_SIGNAL_FLAG = "--preempt-signal"
"""The task's argument naming the preemption signal (``USR2``), blocked before anything else it does."""


def block_preemption_signal_early(argv: list[str]) -> None:
    """Block the signal ``--preempt-signal NAME`` in ``argv`` names, before the task imports anything slow.

    Slurm sends the preemption signal to every step of the job (USR2 by default, which terminates); the task
    blocks it once it has read the config, and the blocked mask is inherited by its engine. In the seconds
    before that (imports, config checks) it killed the task: seen in CI on loaded cores (2026-12-06), a time
    limit's USR2 during the step's start-up failed the job with RolloutStepError instead of requeueing it."""
    if PREEMPT_SIGNAL_FLAG in argv[:-1]:
        name = argv[argv.index(PREEMPT_SIGNAL_FLAG) + 1].upper()
        sig = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
        if isinstance(sig, signal.Signals):
            signal.pthread_sigmask(signal.SIG_BLOCK, {sig})


if __name__ == "__main__":
    block_preemption_signal_early(sys.argv)

from hpcrl.config import Config  # noqa: E402 - after the signal is blocked (above)

log = logging.getLogger("hpcrl.slurm")

ENGINES_DIR = "engines"
"""Folder of the attempt where each engine task writes its address (``engine-<procid>.json``)."""


class RolloutStepError(RuntimeError):
    """The rollout step did not start, or died; the message carries the step's log tail."""


def num_engines(cfg: Config) -> int:
    """Engines of the rollout step: ``rollout.num_engines`` colocated; one per node of het group 1 when
    disaggregated (``slurm.rollout.nodes``)."""
    if cfg.run.placement == "disaggregate" and cfg.slurm.rollout is not None:
        return int(cfg.slurm.rollout.nodes)
    return int(cfg.rollout.num_engines)


def srun_command(cfg: Config, run_dir: Path, attempt_dir: Path, model_path: Path, secret_path: Path,
                 environ: Optional[dict] = None, python: str = sys.executable,
                 restart: Optional[tuple[int, int, str, Optional[str]]] = None) -> list[str]:
    """The ``srun`` command line of the rollout step (see the module doc). ``environ`` defaults to
    ``os.environ`` (``SLURM_JOB_NUM_NODES``, ``SLURM_JOB_ID``). ``restart``: ``(index, attempt, node,
    weight_version)`` for the one-engine step that replaces engine ``index`` on ``node`` (``model_path`` then
    the weight snapshot, :mod:`hpcrl.weights.snapshot`)."""
    from hpcrl.slurm.container import container_prefix

    environ = os.environ if environ is None else environ
    n = num_engines(cfg) if restart is None else 1
    # --overlap and --mem=0: share the CPUs, memory and GPUs the trainer step holds (colocated), or take group
    # 1 whole (disaggregated); without --mem=0 Slurm 22.05 refuses the step ("Memory required by task is not
    # available") because the trainer step holds all of the job's memory.
    log = f"{attempt_dir}/engine-%t.log" if restart is None else \
        f"{attempt_dir}/engine-{restart[0]}.restart-{restart[1]}.log"
    cmd = ["srun", "--overlap", "--mem=0", f"--ntasks={n}", "--kill-on-bad-exit=1", "--unbuffered",
           f"--job-name={cfg.run.name}-rollout", f"--output={log}"]
    if environ.get("SLURM_JOB_ID"):
        cmd.append(f"--jobid={environ['SLURM_JOB_ID']}")
    if cfg.run.placement == "disaggregate" and cfg.slurm.rollout is not None:
        nodes = cfg.slurm.rollout.nodes if restart is None else 1
        cmd += ["--het-group=1", f"--nodes={nodes}", "--ntasks-per-node=1"]
        gpus = cfg.slurm.rollout.gpus_per_node
    else:
        nodes = int(environ.get("SLURM_JOB_NUM_NODES_HET_GROUP_0") or environ.get("SLURM_JOB_NUM_NODES") or 1)
        cmd.append(f"--nodes={max(1, min(n, nodes))}")
        gpus = cfg.slurm.gpus_per_node
    if restart is not None:
        cmd.append(f"--nodelist={restart[2]}")  # where the dead engine ran (its GPUs are free again)
    if gpus:
        cmd.append(f"--gres=gpu:{gpus}")
    cmd += container_prefix(cfg, run_dir, "rollout")
    from hpcrl.preempt import signal_from_config

    cmd += [python, "-m", "hpcrl.slurm.rollout_step", "--config", str(run_dir / "config.yaml"),
            "--model-path", str(model_path), "--attempt-dir", str(attempt_dir), "--secret", str(secret_path),
            PREEMPT_SIGNAL_FLAG, signal_from_config(cfg.slurm.signal).name]
    if restart is not None:
        cmd += ["--address-file", f"engine-{restart[0]}.restart-{restart[1]}.json"]
        if restart[3] is not None:
            cmd += ["--weight-version", str(restart[3])]
    return cmd


@dataclass
class EngineAddress:
    """One engine of the step as the controller sees it (``url`` reachable from the trainer nodes)."""

    url: str
    node: str
    pid: int
    step: Optional["RolloutStep"] = field(default=None, repr=False, compare=False)

    def alive(self) -> bool:
        """False once its step has exited (a task that dies takes the step with it: ``--kill-on-bad-exit``)."""
        return self.step is None or self.step.alive()

    @property
    def process(self):
        """The step's ``srun`` process (its ``returncode`` says how it ended)."""
        return self.step.process if self.step is not None else None

    def stop(self, grace_s: float = 10.0) -> None:
        """A replacement's own step is stopped; the engines of the run's first step stop with it
        (:meth:`RolloutStep.stop`)."""
        if self.step is not None and self.step.owned_by_engine:
            self.step.stop(grace_s)


@dataclass
class RolloutStep:
    """A running rollout job step: the ``srun`` process on the controller and its engines' addresses."""

    process: subprocess.Popen
    attempt_dir: Path
    command: list[str]
    engines: list[EngineAddress] = field(default_factory=list)
    _log: Optional[IO[bytes]] = field(default=None, repr=False)
    owned_by_engine: bool = False
    """A one-engine step started to replace a dead engine (stopped with that engine)."""

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def alive(self) -> bool:
        """True while ``srun`` runs (it exits when any engine task fails: ``--kill-on-bad-exit``)."""
        return self.process.poll() is None

    def log_tail(self, max_bytes: int = 3000) -> str:
        """The last bytes of the step's own log and of each engine task's log."""
        from hpcrl.procs import log_tail

        parts = [f"--- {p.name} ---\n{log_tail(p, max_bytes)}"
                 for p in [self.attempt_dir / "rollout-step.log", *sorted(self.attempt_dir.glob("engine-*.log"))]
                 if p.exists()]
        return "\n".join(parts)

    def check(self, grace_s: float = 0.0) -> None:
        """Raise RolloutStepError with the log tail if the step has exited, or exits within ``grace_s``
        seconds (a request can fail on a dead engine before ``srun`` has noticed its task is gone)."""
        if grace_s > 0 and self.alive():
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if not self.alive():
            raise RolloutStepError(f"the rollout step ({' '.join(self.command[:6])} ...) exited with status "
                                   f"{self.process.returncode}; its logs:\n{self.log_tail()}")

    def stop(self, grace_s: float = 15.0) -> Optional[int]:
        """SIGTERM ``srun`` (it forwards the signal to the engines), SIGKILL after ``grace_s`` seconds.
        Idempotent; returns ``srun``'s exit status."""
        from hpcrl.procs import stop_process

        rc = stop_process(self.process, grace_s)
        if self._log is not None:
            self._log.close()
            self._log = None
        return rc


def spawn_rollout_step(cfg: Config, run_dir: Path, attempt_dir: Path, model_path: Path,
                       secret_path: Path) -> RolloutStep:
    """Start the rollout step with ``srun`` without waiting for its engines (:func:`wait_rollout_step`)."""
    from hpcrl.procs import die_with_parent

    (attempt_dir / ENGINES_DIR).mkdir(parents=True, exist_ok=True)
    cmd = srun_command(cfg, run_dir, attempt_dir, model_path, secret_path)
    log_file = open(attempt_dir / "rollout-step.log", "ab")
    log.info("starting the rollout step: %s", " ".join(cmd))
    process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               preexec_fn=die_with_parent)
    return RolloutStep(process, attempt_dir, cmd, _log=log_file)


def wait_rollout_step(step: RolloutStep, cfg: Config, secret_path: Path, timeout_s: float = 600.0,
                      pattern: str = "engine-*.json", n: Optional[int] = None) -> RolloutStep:
    """Wait until every engine of ``step`` has reported its address and answers ``/health`` (seconds:
    ``timeout_s``, model loading included); returns ``step`` with ``engines`` set.

    Raises RolloutStepError with the step's log tail if ``srun`` exits first or the engines are not all up in
    time (the step is stopped first).
    """
    from hpcrl.rollout.secret import read_secret

    engines_dir = step.attempt_dir / ENGINES_DIR
    n = num_engines(cfg) if n is None else n
    key = read_secret(secret_path)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            step.check()
            found = sorted(p for p in engines_dir.glob(pattern)
                           if ".restart-" in pattern or ".restart-" not in p.name)  # the first step: its own
            if len(found) == n:  # read again each time: an engine started on a new port rewrites its file
                engines = [EngineAddress(**json.loads(p.read_text()), step=step) for p in found]
                if all(_is_ours(e.url, key) for e in engines):
                    step.engines = engines
                    log.info("rollout step up: %s", ", ".join(step.urls))
                    return step
            if time.monotonic() > deadline:
                raise RolloutStepError(f"the rollout step's {n} engine(s) were not healthy within "
                                       f"{timeout_s:.0f} s "
                                       f"({len(found)} reported an address); its logs:\n{step.log_tail()}")
            time.sleep(0.5)
    except BaseException:
        step.stop(grace_s=5.0)
        raise


def _is_ours(url: str, key: str) -> bool:
    """Whether the engine at ``url`` is up and is this run's: ``/health`` answers 200 (open on every engine,
    also on another run's that took the port first) and ``/get_model_info`` answers 200 to this run's key."""
    from hpcrl.procs import http_status

    return http_status(url + "/health", key, timeout_s=2.0) == 200 and \
        http_status(url + "/get_model_info", key, timeout_s=2.0) == 200


# ------------------------------------------------------------------------------------------ inside a task
@dataclass
class RolloutStepLaunch:
    """The rollout step started and still loading (:data:`hpcrl.rollout.fleet.EngineLauncher`'s result
    inside a Slurm job): ``wait()`` returns ``(engine addresses, the step)``; ``stop()`` stops the step."""

    step: RolloutStep
    cfg: Config
    secret_path: Path
    replacements: list = field(default_factory=list)

    def wait(self) -> tuple[list, RolloutStep]:
        """Raises RolloutStepError as :func:`wait_rollout_step` does."""
        wait_rollout_step(self.step, self.cfg, self.secret_path)
        return list(self.step.engines), self.step

    def stop(self) -> None:
        self.step.stop()
        for s in self.replacements:
            s.stop()

    def restart(self, index: int, model_path, weight_version: Optional[str], attempt: int) -> EngineAddress:
        """Replace engine ``index`` (dead) with a new one-engine job step on the node it ran on, from the HF
        folder ``model_path`` serving ``weight_version`` (:data:`hpcrl.rollout.health.RestartEngine`); its log
        is ``engine-<index>.restart-<attempt>.log``. Waits until it answers ``/health``. Raises
        RolloutStepError with the step's log tail (e.g. the node is down)."""
        from hpcrl.procs import die_with_parent

        node = self.step.engines[index].node if index < len(self.step.engines) else ""
        attempt_dir, run_dir = self.step.attempt_dir, self.step.attempt_dir.parent.parent
        cmd = srun_command(self.cfg, run_dir, attempt_dir, Path(model_path).absolute(), self.secret_path,
                           restart=(index, attempt, node, weight_version))
        log_file = open(attempt_dir / "rollout-step.log", "ab")
        log.info("replacing engine %d: %s", index, " ".join(cmd))
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   preexec_fn=die_with_parent)
        step = RolloutStep(process, attempt_dir, cmd, _log=log_file, owned_by_engine=True)
        self.replacements.append(step)
        wait_rollout_step(step, self.cfg, self.secret_path, pattern=f"engine-{index}.restart-{attempt}.json",
                          n=1)
        return step.engines[0]


def launch_engine_step(cfg: Config, run_dir: Path, attempt_dir: Path, model_path: Path,
                       secret_path: Path) -> RolloutStepLaunch:
    """The engine launcher of a run inside a Slurm job (:data:`hpcrl.rollout.fleet.EngineLauncher`): starts
    the engines as the rollout job step (:func:`spawn_rollout_step`) and returns at once; ``wait()`` on the
    result waits until they are healthy."""
    step = spawn_rollout_step(cfg, run_dir, attempt_dir, Path(model_path).absolute(), secret_path)
    return RolloutStepLaunch(step, cfg, Path(secret_path))


def task_main(argv: Optional[list[str]] = None) -> int:
    """One engine task of the rollout step: a free port outside the ephemeral range, the address file, then
    the engine as a child process (:func:`supervise_engine`: started again on a new port if another process
    took this one before the engine bound it). Returns the engine's exit status."""
    import argparse

    from hpcrl.validate import load_and_check
    from hpcrl.procs import find_free_service_port
    from hpcrl.rollout.engines import engine_command, engine_env, engine_sglang_args

    p = argparse.ArgumentParser(prog="python -m hpcrl.slurm.rollout_step")
    p.add_argument("--config", required=True)
    p.add_argument("--model-path", required=True)
    p.add_argument("--attempt-dir", required=True)
    p.add_argument("--secret", required=True)
    p.add_argument("--address-file", default=None, help="default engine-<SLURM_PROCID>.json")
    p.add_argument("--weight-version", default=None, help="the engine's weight version (a replacement's)")
    p.add_argument("--port", type=int, default=None,
                   help="the first port to try (default: a free one below the ephemeral range)")
    p.add_argument(PREEMPT_SIGNAL_FLAG, default=None,
                   help="the preemption signal, blocked first thing (block_preemption_signal_early)")
    args = p.parse_args(argv)
    cfg = load_and_check(args.config)
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    sglang_args = engine_sglang_args(cfg)
    if args.weight_version is not None:
        sglang_args["weight_version"] = args.weight_version
    procid = os.environ.get("SLURM_PROCID", "0")
    out = Path(args.attempt_dir) / ENGINES_DIR / (args.address_file or f"engine-{procid}.json")
    # Slurm sends the preemption signal (USR2 by default, which terminates) to every step; the engines must
    # outlive it until the trainer has checkpointed and stops them. A blocked mask is inherited by the engine.
    from hpcrl.preempt import signal_from_config

    preempt = signal_from_config(cfg.slurm.signal)
    signal.pthread_sigmask(signal.SIG_BLOCK, {preempt})

    # SGLang: the key in a 0600 file, not in ps (the CPU engine reads it)
    def command(port: int) -> list[str]:
        return engine_command(cfg.rollout, sglang_args, args.model_path, "0.0.0.0", port, args.secret,
                              key_via="config")

    # below the ephemeral range: the engine binds it seconds later
    port = args.port or find_free_service_port("")
    return supervise_engine(command, port, out, node, f"rollout task {procid}", skip_signals={preempt},
                            env=dict(os.environ, **engine_env(cfg.rollout)))


def supervise_engine(command, port: int, address_file: Path, node: str, what: str,
                     skip_signals: frozenset | set = frozenset(), env: Optional[dict] = None) -> int:
    """Run the engine ``command(port)`` as a child of this task (environment ``env``, default this task's), its
    output passed through, and write its address (``{"url", "node", "pid"}``) to ``address_file`` atomically;
    return its exit status (128 + N for signal N).

    The engine binds its port only once its model is loaded, seconds after the port was picked; another
    process on the node (a sweep's other array task, a trainer's connections) may take it in between. Until
    the engine listens on the port itself (:func:`hpcrl.procs.listens_on`), an exit whose output says
    ``address already in use`` starts it again on a new port (:func:`hpcrl.procs.find_free_service_port`),
    with a new address file the controller reads, logged, up to :data:`hpcrl.procs.PORT_ATTEMPTS` starts.
    Signals the task gets (SIGTERM from ``srun`` at the end of the step...) are passed on to the engine,
    except ``skip_signals``; the engine dies with this task (``PR_SET_PDEATHSIG``)."""
    import collections
    import threading

    from hpcrl.fsutil import atomic_write_text
    from hpcrl.procs import (PORT_ATTEMPTS, die_with_parent, find_free_service_port, listens_on, port_taken,
                             url_for)

    current: list[subprocess.Popen] = []

    def forward(signum, frame) -> None:
        if current and current[-1].poll() is None:
            current[-1].send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        if sig not in skip_signals:
            signal.signal(sig, forward)
    for attempt in range(1, PORT_ATTEMPTS + 1):
        atomic_write_text(address_file,
                          json.dumps({"url": url_for(node, port), "node": node, "pid": os.getpid()}))
        print(f"[hpcrl] {what} on {node}: engine at {url_for(node, port)}", flush=True)
        child = subprocess.Popen(command(port), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, preexec_fn=die_with_parent, env=env)
        current.append(child)
        tail: collections.deque[str] = collections.deque(maxlen=400)
        pump = threading.Thread(target=_pass_through, args=(child.stdout, tail), daemon=True)
        pump.start()
        bound = False
        while child.poll() is None and not bound:
            bound = listens_on(child.pid, port)
            if not bound:
                time.sleep(0.25)
        rc = child.wait()
        pump.join(timeout=10)
        if bound or rc == 0 or not port_taken("".join(tail)) or attempt == PORT_ATTEMPTS:
            return rc if rc >= 0 else 128 - rc
        taken, port = port, find_free_service_port("")
        print(f"[hpcrl] {what}: port {taken} was taken before the engine could bind it; starting it again on "
              f"{port} (attempt {attempt + 1} of {PORT_ATTEMPTS})", flush=True)
    raise AssertionError("unreachable")


def _pass_through(stream, tail) -> None:
    """Copy ``stream`` (the engine's output) line by line to this task's stdout, keeping the last lines in
    ``tail``."""
    out = sys.stdout.buffer
    for line in iter(stream.readline, b""):
        out.write(line)
        out.flush()
        tail.append(line.decode("utf-8", "replace"))
    stream.close()


if __name__ == "__main__":
    sys.exit(task_main())
