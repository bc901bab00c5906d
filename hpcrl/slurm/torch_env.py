"""torch.distributed's environment for the trainer step, as a subclass of submitit's
:class:`~submitit.helpers.TorchDistributedEnvironment`.

submitit's class gives the names (``master_addr``, ``master_port``, ``rank``, ``world_size``, ``local_rank``,
``local_world_size``) and ``export()``; :class:`TrainerStepEnvironment` keeps them and changes what hpcrl's
jobs need changed:

* it reads a given mapping (default ``os.environ``) and works under the plain sbatch templates too. submitit's
  ``__init__`` asks its ``JobEnvironment``, which reads ``os.environ`` only and exists only inside a submitit
  job (elsewhere it raises RuntimeError), so the fields are set here instead of by ``super().__init__()``;
* the world is the trainer step, not the job: ``WORLD_SIZE`` is :func:`trainer_world_size` and
  ``MASTER_ADDR`` the step's first node (in a het job the job's tasks and nodes include the rollout group);
* ``MASTER_PORT`` is drawn from the job id in [20000, 32768), not submitit's [20000, 60000] (why: the
  docstring of :meth:`TrainerStepEnvironment._get_master_port`);
* variables already set win (a site's launcher, torchrun), where submitit's ``export()`` raises or overwrites,
  and ``CUDA_VISIBLE_DEVICES`` is left as Slurm set it unless asked (each rank picks device ``LOCAL_RANK``).
"""

from __future__ import annotations

import os
import random
import socket
from typing import MutableMapping, Optional

from submitit.helpers import TorchDistributedEnvironment
from submitit.slurm.slurm import _parse_node_list

from hpcrl.procs import SERVICE_PORT_LOW

MIN_MASTER_PORT = SERVICE_PORT_LOW
MAX_MASTER_PORT = 32767
"""``MASTER_PORT`` is drawn from [MIN_MASTER_PORT, MAX_MASTER_PORT], below Linux's ephemeral port range."""


def trainer_world_size(environ: Optional[MutableMapping[str, str]] = None) -> int:
    """Tasks of the trainer step (``SLURM_STEP_NUM_TASKS``, else group 0's ``SLURM_NTASKS``) in ``environ``
    (default ``os.environ``); 1 outside Slurm. Raises ValueError for a variable that is not an integer."""
    environ = os.environ if environ is None else environ
    return int(environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS_HET_GROUP_0")
               or environ.get("SLURM_NTASKS") or 1)


def tasks_on_node(tasks_per_node: str, node: int) -> Optional[int]:
    """Tasks on node index ``node`` (0-based, ``SLURM_NODEID``) from Slurm's compressed list (``2(x3),1``:
    2 tasks on each of 3 nodes, then 1); None when the list is empty, malformed or too short."""
    counts: list[int] = []
    for part in filter(None, tasks_per_node.split(",")):
        n, _, times = part.partition("(x")
        try:
            counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
        except ValueError:
            return None
    return counts[node] if 0 <= node < len(counts) else None


class TrainerStepEnvironment(TorchDistributedEnvironment):
    """submitit's torch.distributed environment, for one task of hpcrl's trainer step (see the module doc).

    Args:
        environ: the task's environment (default ``os.environ``); read here, written by :meth:`export`.

    Attributes (submitit's): ``master_addr`` (host name), ``master_port`` (TCP port), ``rank``,
    ``world_size``, ``local_rank``, ``local_world_size`` (tasks); and ``exported``: the variables the last
    :meth:`export` set.

    Raises:
        ValueError: a Slurm variable that should be an integer is not.
    """

    def __init__(self, environ: Optional[MutableMapping[str, str]] = None) -> None:
        # no super().__init__(): submitit's JobEnvironment reads os.environ and exists only in a submitit job
        self.environ = os.environ if environ is None else environ
        env = self.environ
        nodes = _parse_node_list(env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                                 or socket.gethostname())
        self.master_addr = nodes[0]
        self.master_port = self._get_master_port()
        self.rank = int(env.get("SLURM_PROCID", "0"))
        self.world_size = trainer_world_size(env)
        self.local_rank = int(env.get("SLURM_LOCALID", "0"))
        local = tasks_on_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "",
                              int(env.get("SLURM_NODEID", "0")))
        self.local_world_size = local if local is not None else max(1, self.world_size // len(nodes))
        self.exported: dict[str, str] = {}

    def _get_master_port(self) -> int:
        """``MASTER_PORT`` of the environment if set, else a port in [20000, 32768) drawn from
        ``SLURM_JOB_ID`` (the same on every task, and again after a requeue). It stays below Linux's ephemeral
        range, 32768-60999 by default, where outgoing connections - srun's own included - take their local
        ports: submitit's [20000, 60000] collided (EADDRINUSE)."""
        if self.environ.get("MASTER_PORT"):
            return int(self.environ["MASTER_PORT"])
        return random.Random(self.environ.get("SLURM_JOB_ID", "0")).randint(MIN_MASTER_PORT, MAX_MASTER_PORT)

    def variables(self) -> dict[str, str]:
        """What :meth:`export` writes: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
        ``MASTER_PORT`` (``LOCAL_WORLD_SIZE`` is not exported: torch does not need it)."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_RANK": str(self.local_rank), "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port)}

    def export(self, set_cuda_visible_devices: bool = False,
               overwrite: bool = False) -> "TrainerStepEnvironment":
        """Write :meth:`variables` into the environment given at construction and return self; what was set is
        in ``exported``.

        Args:
            set_cuda_visible_devices: also set ``CUDA_VISIBLE_DEVICES`` to ``LOCAL_RANK``, replacing Slurm's
                (submitit's default; hpcrl leaves Slurm's value).
            overwrite: replace variables already set; by default they win (submitit's ``export()`` raises).
        """
        self.exported = {k: v for k, v in self.variables().items() if overwrite or k not in self.environ}
        if set_cuda_visible_devices:  # as submitit: always, whatever Slurm set
            self.exported["CUDA_VISIBLE_DEVICES"] = str(self.local_rank)
        self.environ.update(self.exported)
        return self
