"""PPO's critic on ranks of its own (``critic.nprocs > 0``; slime's ``--critic-num-nodes`` x
``--critic-num-gpus-per-node``): a second Megatron world beside the actor's, which trains while the actor trains.

hpcrl's trainer is one torch.distributed world whose megatron-core ``parallel_state`` groups are global, so a
critic with another layout cannot share it. Its ranks are processes of their own instead (local ``hpcrl run``:
``critic.nprocs`` processes on this machine, :class:`LocalCriticLaunch`; a Slurm job: a job step in het group
``slurm.critic``, :class:`hpcrl.slurm.critic_step.CriticStep`), each running
:mod:`hpcrl.train.critic_worker`: a :class:`~hpcrl.train.critic.Critic` with its own tensor- and
data-parallel layout (``critic.tensor_parallel_size``), Adam and learning-rate schedule.

The actor's controller (trainer rank 0) drives them over one link (:class:`CriticGroup`): a
``multiprocessing.connection`` socket authenticated with the run secret (HMAC challenge, no key on a command
line), on which it sends requests to the critic's rank 0 and gets its replies; the critic's rank 0 broadcasts
each request to its ranks. The critic world's own rendezvous is a ``TCPStore`` the controller hosts on a port
the OS picks as it binds (no port can be taken between a pick and the bind, the same on one machine and across
a het job). Per rollout (:meth:`RemoteCritic.begin` ... :meth:`RemoteCritic.end_train`, what
:meth:`hpcrl.train.actor.Actor.train` asks of any critic)::

    actor ranks                                   critic ranks
    begin: samples ---------------------------->  values forward (its own micro-batches)
    old and reference log-probs                     ...
    sample_values  <----------------------------  every sample's values
    GAE (every actor rank, as before)
    begin_train: returns ---------------------->  the critic's optimizer steps
    the actor's optimizer steps                     ...
    end_train      <----------------------------  the critic's metrics

so the critic's values forward overlaps the actor's log-prob recompute and its optimizer steps the actor's.
Which samples each optimizer step trains on does not depend on the data-parallel size
(:func:`hpcrl.train.actor.plan_steps`), so the critic's steps are the same whether it shares the actor's ranks
or has its own (equal up to rounding).

Checkpoints: the critic world writes its model and Adam states into the checkpoint being staged
(``dist_critic/``) while the actor writes ``dist/``, and returns the listing of its files (sizes, CRC-32) and
its ``COMPLETE`` entry, so the one atomic save holds both (:func:`hpcrl.checkpoint.save_checkpoint`'s
``remote``); a resume loads it on the critic's ranks (its layout may differ from the saved one: megatron-core
reshards). The critic draws no random numbers (no dropout in these models, a zero or loaded head), so its
ranks have no RNG state to save.

Failures: every wait on the link also watches the critic's processes; one that exits (or a link that closes)
raises :class:`CriticError` on every actor rank with its exit status and log tail instead of hanging. The
critic's processes die with the controller (``PR_SET_PDEATHSIG`` locally; ``--kill-on-bad-exit`` and the job's
end on Slurm) and outlive the preemption signal until the controller has checkpointed and stops them.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import pickle
import socket
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Sequence

import numpy as np

if TYPE_CHECKING:
    import torch

    from hpcrl.config import Config
    from hpcrl.data.sample import Sample

log = logging.getLogger("hpcrl.critic")

START_TIMEOUT_S = 600.0
"""How long the controller waits for every critic rank to connect (each loads a model first)."""


class CriticError(RuntimeError):
    """The critic's ranks failed, exited or stopped answering; the message says which on its first line, then
    ``--- log tail ---`` and their log tail or traceback (a known error: :mod:`hpcrl.errors` prints the first
    part as one line)."""


# ------------------------------------------------------------------------------------------------ wire format


def pack_samples(samples: Sequence["Sample"]) -> dict[str, Any]:
    """What the critic needs of a rollout's samples, as flat numpy arrays (one pickle, no Python int per
    token): token ids, response lengths, loss masks, segments, sample and group indices. Inverse:
    :func:`unpack_samples`."""
    lengths = np.array([len(s.tokens) for s in samples], dtype=np.int64)
    responses = np.array([s.response_length for s in samples], dtype=np.int64)
    tokens = np.fromiter((t for s in samples for t in s.tokens), dtype=np.int64, count=int(lengths.sum()))
    masks = np.fromiter((m for s in samples for m in s.loss_mask), dtype=np.int8, count=int(responses.sum()))
    return {"lengths": lengths, "responses": responses, "tokens": tokens, "masks": masks,
            "segments": [list(s.segments) for s in samples], "index": [s.index for s in samples],
            "group_index": [s.group_index for s in samples]}


def unpack_samples(packed: Mapping[str, Any]) -> list["Sample"]:
    """The :class:`~hpcrl.data.sample.Sample` objects of :func:`pack_samples` (only the fields it carries set;
    no reward, no log-probs)."""
    from hpcrl.data.sample import Sample

    tok_ends = np.cumsum(packed["lengths"]).tolist()
    mask_ends = np.cumsum(packed["responses"]).tolist()
    out = []
    for i, (t_end, m_end) in enumerate(zip(tok_ends, mask_ends, strict=True)):
        n, r = int(packed["lengths"][i]), int(packed["responses"][i])
        out.append(Sample(index=packed["index"][i], group_index=packed["group_index"][i],
                          tokens=packed["tokens"][t_end - n: t_end].tolist(), response_length=r,
                          loss_mask=packed["masks"][m_end - r: m_end].tolist(), segments=packed["segments"][i]))
    return out


def pack_rows(rows: Sequence["torch.Tensor"]) -> dict[str, np.ndarray]:
    """``[len_i]`` float32 rows (values, returns) as one array and their lengths. Inverse: :func:`unpack_rows`."""
    import torch

    lengths = np.array([int(r.numel()) for r in rows], dtype=np.int64)
    flat = torch.cat([r.detach().float().cpu().reshape(-1) for r in rows]) if rows else torch.zeros(0)
    return {"lengths": lengths, "data": flat.numpy()}


def unpack_rows(packed: Mapping[str, np.ndarray]) -> list["torch.Tensor"]:
    """The ``[len_i]`` float32 CPU tensors of :func:`pack_rows` (bitwise the sent values)."""
    import torch

    data = torch.from_numpy(np.array(packed["data"], dtype=np.float32))
    return list(torch.split(data, [int(n) for n in packed["lengths"]]))


def send(conn: Connection, obj: Any) -> None:
    """Send ``obj`` with the standard pickle (protocol 5), never ``multiprocessing``'s pickler: with torch
    imported that one would hand tensors over as shared-memory handles, which a process on another node (or
    not forked from this one) cannot open."""
    conn.send_bytes(pickle.dumps(obj, protocol=5))


def receive(conn: Connection, ready: Callable[[], Optional[str]], what: str, timeout_s: Optional[float] = None,
            poll_s: float = 0.2) -> Any:
    """The next object on ``conn``; while waiting, ``ready()`` is asked every ``poll_s`` seconds and a
    non-None answer (why the other side cannot answer: a process exited) raises :class:`CriticError`, as
    do a closed link and ``timeout_s`` (None: none). ``what`` names the wait in the error."""
    start = time.monotonic()
    while True:
        try:
            if conn.poll(poll_s):
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError) as e:
            problem = ready()
            raise CriticError(f"the critic's link closed while waiting for {what}"
                              + (f": {problem}" if problem else f" ({type(e).__name__})")) from None
        problem = ready()
        if problem is not None:
            raise CriticError(f"while waiting for {what}: {problem}")
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            raise CriticError(f"no answer from the critic's ranks for {timeout_s:.0f} s while waiting for {what}")


def connect(address: str, authkey: bytes, timeout_s: float = 60.0) -> Connection:
    """The critic rank's side of the link: connect to ``host:port`` (retried for ``timeout_s`` seconds while
    refused). Raises ConnectionError after that, ``multiprocessing.AuthenticationError`` for another key."""
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return Client((host.strip("[]"), int(port)), authkey=authkey)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach the actor's controller at {address}") from None
            time.sleep(0.1)


# ------------------------------------------------------------------------------------------------ processes


class CriticProcesses(Protocol):
    """The critic's running ranks as the controller sees them (:class:`LocalCriticLaunch`,
    :class:`hpcrl.slurm.critic_step.CriticStep`)."""

    def failure(self) -> Optional[str]:
        """None while every rank runs; else one line on which exited how, with the log tail."""

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the ranks (SIGTERM, SIGKILL after ``grace_s``); idempotent."""


CriticLauncher = Callable[["Config", Path, list[str]], CriticProcesses]
"""How the critic's ranks start: ``launcher(cfg, attempt_dir, args)`` runs ``critic.nprocs`` ranks of
``python -m hpcrl.train.critic_worker ARGS`` (:func:`worker_args`), each knowing its ``RANK``, ``WORLD_SIZE``
and ``LOCAL_RANK`` (or Slurm's ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``); logs go to
``attempt_dir/critic-<rank>.log``."""


def worker_args(link: str, secret: Path, preempt_signal: str) -> list[str]:
    """The arguments of ``python -m hpcrl.train.critic_worker``: the link's ``host:port``, the run secret's
    path (the key never on a command line) and the preemption signal's name (blocked in the critic's ranks)."""
    return ["--link", link, "--secret", str(secret), "--block-signal", preempt_signal]


def local_threads(cfg: "Config") -> int:
    """Torch threads of each process of a local run whose critic has ranks of its own: this machine's CPUs (the
    trainer's CPU set when disaggregated) shared by the trainer's and the critic's processes, at least 1
    (each process would otherwise take every core, and they thrash)."""
    from hpcrl.placement import parse_cpu_list

    cpus = len(parse_cpu_list(cfg.train.cpus)) if cfg.train.cpus else (os.cpu_count() or 1)
    return max(1, cpus // (cfg.train.nprocs + cfg.critic.nprocs))


class LocalCriticLaunch:
    """``critic.nprocs`` critic ranks as child processes of the controller on this machine (``hpcrl run``).

    Rank ``r`` gets ``RANK=r``, ``WORLD_SIZE=critic.nprocs``, ``LOCAL_RANK=train.nprocs + r`` (the device
    after the trainer's when there are GPUs) and :func:`local_threads` threads; it is pinned to the trainer's
    CPU set when there is one, dies with the controller (``PR_SET_PDEATHSIG``) and logs to
    ``attempt_dir/critic-<r>.log``.
    """

    def __init__(self, cfg: "Config", attempt_dir: Path, args: list[str]) -> None:
        import subprocess

        from hpcrl.placement import parse_cpu_list
        from hpcrl.procs import child_preexec

        n, offset = cfg.critic.nprocs, cfg.train.nprocs
        threads = str(local_threads(cfg))
        cpus = parse_cpu_list(cfg.train.cpus) if cfg.train.cpus else None
        self.logs = [attempt_dir / f"critic-{r}.log" for r in range(n)]
        self.procs: list[subprocess.Popen] = []
        for r in range(n):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(offset + r),
                       OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads))
            self.logs[r].parent.mkdir(parents=True, exist_ok=True)
            with open(self.logs[r], "ab") as out:
                self.procs.append(subprocess.Popen([sys.executable, "-m", "hpcrl.train.critic_worker", *args],
                                                   stdout=out, stderr=subprocess.STDOUT, env=env,
                                                   preexec_fn=child_preexec(cpus)))

    def failure(self) -> Optional[str]:
        from hpcrl.procs import log_tail

        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                return (f"critic rank {r} (pid {p.pid}) exited with status {p.returncode} (its log: "
                        f"{self.logs[r]})\n--- log tail ---\n{log_tail(self.logs[r])}")
        return None

    def stop(self, grace_s: float = 10.0) -> None:
        from hpcrl.procs import stop_process

        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            stop_process(p, grace_s)


def launch_local_critic(cfg: "Config", attempt_dir: Path, args: list[str]) -> CriticProcesses:
    """The default :data:`CriticLauncher`: :class:`LocalCriticLaunch`."""
    return LocalCriticLaunch(cfg, attempt_dir, args)


# ------------------------------------------------------------------------------------------------ controller


@dataclasses.dataclass
class Setup:
    """What the controller sends each critic rank once it connected: the run's config, the actor's HF folder
    (the critic's when ``critic.path`` is null) and the critic world's rendezvous."""

    cfg: "Config"
    model_path: str
    store: tuple[str, int]
    """The ``TCPStore`` (host, port) the critic world rendezvouses on."""
    world_size: int


class CriticGroup:
    """The controller's handle on the critic's ranks: their processes, the link to their rank 0, the store.

    Built with :meth:`launch` (returns at once: the ranks load while the actor builds its model); :meth:`ready`
    waits for every rank to connect and for the critic to be built. :meth:`request` sends an operation to
    the critic's rank 0, :meth:`reply` waits for its answer (watching the processes); :meth:`stop` ends them.
    """

    def __init__(self, cfg: "Config", procs: CriticProcesses, listener: Listener, store: Any,
                 store_address: tuple[str, int]) -> None:
        self.cfg, self.procs, self._listener, self._store = cfg, procs, listener, store
        self.store_address = store_address
        self._accepted: list[Connection] = []
        self._accept_error: Optional[BaseException] = None
        self._conn: Optional[Connection] = None
        self._pending: Optional[str] = None
        self._unsent: Optional[str] = None
        self.info: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._accept_all, name="critic-link", daemon=True)
        self._thread.start()

    @classmethod
    def launch(cls, cfg: "Config", run_dir: Path, attempt_dir: Path,
               launcher: Optional[CriticLauncher] = None) -> "CriticGroup":
        """Listen, host the critic world's store and start ``critic.nprocs`` ranks with ``launcher`` (default
        :func:`launch_local_critic`). On one machine (a local run) the link and the store listen on loopback;
        in a Slurm job on every interface, announced by this node's address. Raises OSError when a socket
        cannot be bound, and what the launcher raises."""
        from hpcrl.preempt import signal_from_config
        from hpcrl.rollout.secret import create_run_secret, read_secret
        from hpcrl.weights.distributed import host_store

        secret = create_run_secret(run_dir)
        local = launcher is None
        bind = "127.0.0.1" if local else ""
        public = "127.0.0.1" if local else socket.gethostbyname(socket.gethostname())
        listener = Listener((bind, 0), authkey=read_secret(secret).encode())
        store = host_store(bind or "0.0.0.0", cfg.critic.nprocs + 1,
                           datetime.timedelta(seconds=START_TIMEOUT_S))
        link = f"{public}:{listener.address[1]}"
        args = worker_args(link, secret, signal_from_config(cfg.slurm.signal).name)
        try:
            procs = (launcher or launch_local_critic)(cfg, attempt_dir, args)
        except BaseException:
            listener.close()
            raise
        return cls(cfg, procs, listener, store, (public, int(store.port)))

    def _accept_all(self) -> None:
        try:
            while len(self._accepted) < self.cfg.critic.nprocs:
                self._accepted.append(self._listener.accept())
        except BaseException as e:  # noqa: BLE001 - reported by ready()
            self._accept_error = e

    def ready(self, model_path: Path, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        """Wait until every rank connected, send each its :class:`Setup`, and wait for rank 0's report that the
        critic is built (``{"dp_size", "tp_size", "path"}``, kept as :attr:`info`). Raises
        :class:`CriticError` when a rank exits, the link fails or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive():
            self._thread.join(0.2)
            problem = self.procs.failure()
            if problem is not None:
                raise CriticError(f"the critic's ranks did not start: {problem}")
            if time.monotonic() > deadline:
                raise CriticError(f"only {len(self._accepted)} of {self.cfg.critic.nprocs} critic ranks "
                                  f"connected within {timeout_s:.0f} s")
        if self._accept_error is not None:
            raise CriticError(f"the critic's link failed: {self._accept_error}")
        hellos = [receive(c, self.procs.failure, "the critic ranks' hello", timeout_s) for c in self._accepted]
        by_rank = {int(h["rank"]): c for h, c in zip(hellos, self._accepted, strict=True)}
        n = self.cfg.critic.nprocs
        if sorted(by_rank) != list(range(n)):
            raise CriticError(f"the critic's ranks reported ranks {sorted(by_rank)}, expected 0..{n - 1}")
        setup = Setup(self.cfg, str(model_path), self.store_address, n)
        for c in by_rank.values():
            send(c, setup)
        for r, c in by_rank.items():
            if r != 0:
                c.close()
        self._conn = by_rank[0]
        self._listener.close()
        self.info = self._answer(receive(self._conn, self.procs.failure, "the critic to be built", timeout_s))
        return self.info

    def request(self, op: str, **payload: Any) -> None:
        """Send operation ``op`` to the critic's rank 0; its answer, or why it could not be sent (not ready,
        an answer still owed: one operation at a time, a failed link), comes from :meth:`reply`. Raises
        nothing: the controller must not fail alone where the other actor ranks go on to a collective."""
        problem = None
        if self._conn is None:
            problem = "the critic's ranks are not ready (or stopped)"
        elif self._pending is not None:
            problem = f"request {op!r} while the answer to {self._pending!r} is owed"
        else:
            try:
                send(self._conn, {"op": op, **payload})
            except OSError as e:
                failure = self.procs.failure()
                problem = f"cannot send {op!r} to the critic's ranks: {e}" + (f": {failure}" if failure else "")
        self._pending, self._unsent = op, problem

    def reply(self) -> dict[str, Any]:
        """The answer to the last :meth:`request` (a dict). Raises :class:`CriticError` with the critic's own
        error line (and traceback) when the operation failed there, when it could not be sent, when a rank
        exits, or the link closes."""
        op, self._pending = self._pending, None
        if self._unsent is not None:
            raise CriticError(self._unsent)
        if op is None or self._conn is None:
            raise CriticError("no request is waiting for an answer")
        return self._answer(receive(self._conn, self.procs.failure, f"the critic's {op!r}"))

    @staticmethod
    def _answer(message: Mapping[str, Any]) -> dict[str, Any]:
        if "error" in message:
            raise CriticError(f"the critic's ranks failed: {message['error']}\n--- log tail ---\n"
                              f"{message.get('traceback', '')}")
        return dict(message)

    def stop(self, grace_s: float = 10.0) -> None:
        """Ask the critic's ranks to exit (they finish what they do first), then terminate what still runs after
        ``grace_s`` seconds; idempotent."""
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                if self._pending is None or self._unsent is not None:
                    send(conn, {"op": "stop"})
                    receive(conn, self.procs.failure, "the critic to stop", timeout_s=grace_s)
            except (CriticError, OSError):
                pass
            conn.close()
        self._listener.close()
        self.procs.stop(grace_s)


# ------------------------------------------------------------------------------------------------ actor side


@dataclasses.dataclass
class _Failed:
    """What the controller broadcasts instead of a result when the critic failed (every rank raises)."""

    message: str


def _shared(controller: bool, fn: Callable[[], Any]) -> Any:
    """``fn()`` on the controller, its result (or its :class:`CriticError`) on every actor rank."""
    import torch.distributed as dist

    value: Any = None
    if controller:
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - every rank must learn of it, or the others wait forever
            value = _Failed(str(e) if isinstance(e, CriticError) else f"{type(e).__name__}: {e}")
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        value = box[0]
    if isinstance(value, _Failed):
        raise CriticError(value.message)
    return value


class RemoteCritic:
    """The critic on ranks of its own, as every actor rank sees it: what :meth:`hpcrl.train.actor.Actor.train`
    asks of a critic (``begin``, ``sample_values``, ``begin_train``, ``end_train``; the same calls as
    :class:`~hpcrl.train.critic.Critic` on the actor's ranks) and what a checkpoint does with it
    (:meth:`start_save` / :meth:`finish_save`, :meth:`start_load` / :meth:`finish_load`). The controller
    (``group`` given) talks to the critic's ranks; the other actor ranks get its results by broadcast. Every
    call is collective over the actor's ranks; each raises :class:`CriticError` on every rank when the critic
    failed.

    Attributes:
        dp_size: the critic's data-parallel size (a rollout's samples must split over it too).
        remote: True (the checkpoint manager saves it through :meth:`start_save`, not as a local model).
    """

    remote = True

    def __init__(self, cfg: "Config", group: Optional[CriticGroup], info: Mapping[str, Any]) -> None:
        self.cfg, self.group = cfg, group
        self.controller = group is not None
        self.dp_size = int(info["dp_size"])
        self.wait_seconds = 0.0

    def _wait(self, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return _shared(self.controller, fn)
        finally:
            self.wait_seconds += time.perf_counter() - t0

    # -- one rollout -------------------------------------------------------------------------------------

    def begin(self, rollout_id: int, samples: Sequence["Sample"], steps: Sequence[Any] = (),
              step_sums: Sequence[Any] = ()) -> None:
        """Send the rollout's samples; the critic's ranks start its values forward at once (their own
        micro-batches: ``steps`` and ``step_sums`` are the actor's and not used)."""
        self.wait_seconds = 0.0
        if self.controller:
            self.group.request("values", rollout_id=rollout_id, samples=pack_samples(samples))

    def sample_values(self, num_samples: int) -> list["torch.Tensor"]:
        """Every sample's ``[response_length]`` values before this rollout's critic steps, on every actor
        rank (float32 CPU). Raises :class:`CriticError` (also for a count other than ``num_samples``)."""
        def get() -> list:
            rows = unpack_rows(self.group.reply()["values"])
            if len(rows) != num_samples:
                raise CriticError(f"the critic sent values of {len(rows)} samples for {num_samples}")
            return rows

        return self._wait(get)

    def begin_train(self, returns: Sequence["torch.Tensor"]) -> None:
        """Send every sample's GAE returns; the critic's ranks start their optimizer steps at once."""
        if self.controller:
            self.group.request("train", returns=pack_rows(returns))

    def end_train(self) -> dict[str, float]:
        """The critic's metrics of this rollout (``critic/{value_loss, value_clipfrac, grad_norm, lr,
        seconds}``, ``seconds`` its ranks' time on values and steps) plus ``critic/wait_seconds``: how long
        the actor waited for its critic in this rollout (0 when the critic kept up)."""
        metrics = dict(self._wait(lambda: self.group.reply()["metrics"]))
        metrics["critic/wait_seconds"] = self.wait_seconds
        return metrics

    # -- checkpoints -------------------------------------------------------------------------------------

    def start_save(self, folder: Path) -> None:
        """Ask the critic's ranks to write their model and optimizer into the checkpoint being staged in
        ``folder`` (``dist_critic/``, which must exist) while the actor writes its own."""
        if self.controller:
            self.group.request("save", folder=str(folder))

    def finish_save(self) -> tuple[dict[str, Any], dict[str, tuple]]:
        """``(COMPLETE entry, {file: (size, CRC-32)})`` of the critic's part once written and fsynced, on
        every actor rank."""
        answer = _shared(self.controller, self.group.reply if self.controller else lambda: None)
        return answer["marker"], {k: tuple(v) for k, v in answer["files"].items()}

    def start_load(self, path: Path, entry: Mapping[str, Any]) -> None:
        """Ask the critic's ranks to load checkpoint ``path``'s critic as its ``COMPLETE`` ``entry`` says."""
        if self.controller:
            self.group.request("load", path=str(path), entry=dict(entry))

    def finish_load(self) -> None:
        """Wait until the critic's ranks loaded it (every actor rank)."""
        _shared(self.controller, self.group.reply if self.controller else lambda: None)


def remote_critic(controller: bool, cfg: "Config", group: Optional[CriticGroup], model_path: Path
                  ) -> RemoteCritic:
    """The :class:`RemoteCritic` of every actor rank: the controller waits for ``group`` to be ready
    (:meth:`CriticGroup.ready`) and shares what it reported. Collective over the actor's ranks; raises
    :class:`CriticError` on every rank when the critic did not start."""
    info = _shared(controller, lambda: group.ready(model_path))
    return RemoteCritic(cfg, group if controller else None, info)
