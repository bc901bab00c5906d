"""Which loop a run runs: :func:`loop_of`, shared by both launchers (``hpcrl run``: :mod:`hpcrl.launch_local`;
the Slurm job: :mod:`hpcrl.slurm.entry`), so that neither imports the other."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from hpcrl.config import Config


def loop_of(cfg: "Config") -> Callable[..., dict[str, Any]]:
    """The loop function of ``run.mode``: :func:`hpcrl.loop.train_main` (sync) or
    :func:`hpcrl.loop_async.train_async_main` (async); both take ``(cfg, run_dir, model_path, ...)`` and
    return the last step's metrics (``"preempted"`` when stopped early with a checkpoint)."""
    if cfg.run.mode == "async":
        from hpcrl.loop_async import train_async_main

        return train_async_main
    from hpcrl.loop import train_main

    return train_main
