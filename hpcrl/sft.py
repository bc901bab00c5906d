"""Supervised warm start (``sft.enabled``, ``hpcrl sft``): teach the base model the task's answer format
before RL, on the Megatron trainer, as an SFT run of its own (:func:`hpcrl.loop_sft.train_sft_main`).

RL from a random-init model gets no reward signal, so the CI model (and any model that does not yet answer in
the task's format) first learns from demonstrations (:mod:`hpcrl.data.demonstrations`: prompt + label, or chat
conversations with the loss on the assistant's tokens). The warm start is an ``run.mode: sft`` run
(:func:`warm_start_config`) on the same trainer ranks, devices, parallel layout, engines (its evals) and Slurm
job step as the RL run after it, so it checkpoints, survives preemption (a requeued job resumes it bitwise)
and logs like any run. Its result is an ordinary HF folder that RL then starts from, and it is a cache.

**The cache is content-addressed** (:class:`WarmStartStore`): the key (:func:`cache_key`: the base model's
files, the demonstrations, the seed, the recipe, the eval limits, the trainer's layout and precision) names a
folder of its own, ``<sft.output>.d/<digest>/`` (the SFT run that made it beside it as ``<digest>.run/``), so
different seeds and recipes never share one; the RL run starts from that folder. ``sft.output`` itself is a
symbolic link to the newest one, a stable name that other configs can point at (``configs/smollm2-agent.yaml``).
Concurrent runs with the same key (a sweep's array tasks) train it once: each takes the key's lock
(``<digest>.lock``, ``fcntl.lockf``) before training and the others wait for it, then find the folder made.

The warm start ends on accuracy, not on a step count: learning 3-digit addition from scratch is a sharp phase
transition (greedy accuracy goes from ~1% to ~40% within 50-100 steps) whose step moves with the seed *and*
with the CPU's rounding (seed 1234 gave 39.4% at step 600 on one machine and 12.3% on an AVX2-only EPYC).
With ``sft.target_accuracy`` the eval runs every ``sft.eval_interval`` steps and training stops at the first
eval at or above the target; ``sft.steps`` is only a cap, and the lr (warmup, then cosine over the cap) is still
near its peak when the target is reached. The rise near the target is steep (seed 1 on an Intel Xeon: 6.5%,
14.9%, 31.4%, 50.6% at steps 270-300), so every 10 steps can overshoot a 35% target by 15 points; with
``sft.eval_interval_near_target`` the eval runs that often once it has reached a quarter of the target
(:data:`hpcrl.sft_recipe.NEAR_TARGET_FRACTION`).

Measured with the earlier HF + AdamW loop (AMD EPYC, AVX2 only, 1 thread, 3-digit addition, the tiny Qwen2
(hidden 128, 4 layers, tied embeddings), lr 3e-3, batch 256, eval every 20 steps): seed 1 went 0.067, 0.134,
0.340 at steps 180-220 and then hovered at 0.33-0.43; seed 2 went 0.143, 0.338, 0.444 at steps 360-400. The recipe
below (AdamW betas 0.9/0.999, no weight decay, clip 1.0, warmup then cosine to 10%) beat betas 0.9/0.95 (27%),
weight decay 0.1 (5%) and a constant lr (40%) at seed 1234.

What RL can do from the warm start depends on more than its greedy accuracy: GRPO only sharpens answers the
model already samples (a group whose samples are all wrong carries no signal), so the fraction of problems with
at least one right answer in 8 samples bounds where RL ends. At lr 3e-3 some seeds stop SFT with a model that
never samples the answer to ~45% of the problems (seed 1: 0.383 greedy, 55% of problems covered; GRPO then
stalled at 0.50); at lr 1e-3 the same seeds cross the target as a more complete model (seed 1: 0.388 greedy, 68%
covered; GRPO reached 0.75), after about as many steps. The quickstart uses 1e-3 (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

if TYPE_CHECKING:
    from hpcrl.config import Config
    from hpcrl.rollout.manager import EngineLauncher

log = logging.getLogger(__name__)

METRICS_FILENAME = "sft_metrics.jsonl"
"""The warm start's curve, in its cached folder: one JSON object per line, ``step`` (optimizer steps done),
then ``loss`` (nats per trained token), ``lr``, ``grad_norm``, ``elapsed_s`` (seconds since the SFT run
started), or ``eval_accuracy`` (greedy, the eval before the first step is step 0) and ``elapsed_s``."""
KEY_FILENAME = "sft_key.json"
"""The cache key (:func:`cache_key`) of a cached warm start, in its folder."""
STORE_SUFFIX = ".d"
"""The store of ``sft.output`` is the folder ``<sft.output>.d`` beside it."""
LOCK_POLL_SECONDS = 5.0
"""How often a run waiting for another run's warm start of the same key tries its lock (seconds)."""


def _sha256_files(paths: Sequence[Path], root: Optional[Path] = None) -> str:
    """sha256 over the relative names and the bytes of ``paths`` (in the given order)."""
    h = hashlib.sha256()
    for f in paths:
        h.update((f.relative_to(root) if root else f).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def cache_key(cfg: "Config", base: Path) -> dict[str, Any]:
    """What determines the warm start, as a JSON-able dict: the sha256 of the base model folder's files, the
    demonstrations (``sft.data`` or ``data``: source, sizes, keys, task arguments, and the sha256 of file
    sources), ``run.seed``, the recipe (``sft.*`` but ``enabled``/``output``/``data``), the eval's response
    limits (they decide where a target stops training), ``model.dtype`` and the trainer's layout and precision
    (parallel sizes, sequence and expert-tensor parallelism where they apply, ranks, micro-batching,
    ``train.bf16``, the ``megatron:`` overrides: they change the rounding). Two configs with equal keys train
    bitwise-equal models on one machine."""
    from hpcrl.config.train import sequence_parallel

    d = cfg.sft.data if cfg.sft.data is not None else cfg.data
    t = cfg.train
    files = [Path(p) for p in (d.source, d.eval_source or "") if p and Path(p).is_file()]
    return {
        "trainer": "megatron",
        "base_model_sha256": _sha256_files(sorted(f for f in base.rglob("*") if f.is_file()), root=base),
        "data": {"source": d.source, "eval_source": d.eval_source, "num_train": d.num_train,
                 "num_eval": d.num_eval, "task_kwargs": d.task_kwargs, "prompt_key": d.prompt_key,
                 "label_key": d.label_key, "apply_chat_template": d.apply_chat_template,
                 "system_key": d.system_key, "tools_key": d.tools_key,
                 "files_sha256": _sha256_files(files) if files else None},
        "seed": cfg.run.seed,
        "sft": {k: getattr(cfg.sft, k) for k in ("steps", "batch_size", "lr", "target_accuracy",
                                                  "eval_interval", "eval_interval_near_target")}
        | ({"target_window": cfg.sft.target_window} if cfg.sft.target_window != 1 else {})  # 1: earlier keys
        | ({"anneal_steps": cfg.sft.anneal_steps} if cfg.sft.anneal_steps else {}),  # 0: earlier keys
        "eval": {"max_new_tokens": cfg.eval.max_new_tokens or cfg.rollout.max_new_tokens,
                 "stop": list(cfg.rollout.stop), "temperature": cfg.eval.temperature},
        "dtype": cfg.model.dtype,
        "train": {"nprocs": t.nprocs, "tensor_parallel_size": t.tensor_parallel_size,
                  "expert_parallel_size": t.expert_parallel_size, "micro_batch_size": t.micro_batch_size,
                  "max_tokens_per_microbatch": t.max_tokens_per_microbatch, "bf16": t.bf16,
                  "megatron": dict(cfg.megatron or {})}
        # sequence parallelism (TP > 1 only) and expert-tensor parallelism sum gradients in another order;
        # absent at TP=1 / ETP 1, so the keys made before they existed stay valid
        | ({"sequence_parallel": sequence_parallel(t)} if t.tensor_parallel_size > 1 else {})
        | ({"expert_tensor_parallel_size": t.expert_tensor_parallel_size}
           if t.expert_tensor_parallel_size != 1 else {})
        # pipeline stages sum the tied embedding's gradient over the stages (absent at PP=1, as above)
        | ({"pipeline_parallel_size": t.pipeline_parallel_size} if t.pipeline_parallel_size != 1 else {}),
    }


def key_digest(key: dict[str, Any]) -> str:
    """The 16 hex digits naming a key's folder in the store (sha256 of its canonical JSON)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class WarmStartStore:
    """The content-addressed cache behind one ``sft.output`` name (module doc).

    ``output``: the ``sft.output`` path (a link to the newest entry). Layout of :attr:`root`
    (``<output>.d``): ``<digest>/`` a finished warm start (HF folder, ``sft_key.json``,
    ``sft_metrics.jsonl``), ``<digest>.run/`` the SFT run that makes or made it (its checkpoints resume an
    interrupted warm start), ``<digest>.lock`` the lock its trainer holds."""

    output: Path

    @property
    def root(self) -> Path:
        return self.output.with_name(self.output.name + STORE_SUFFIX)

    def folder(self, digest: str) -> Path:
        """The HF folder of key ``digest``."""
        return self.root / digest

    def run_dir(self, digest: str) -> Path:
        """The SFT run folder of key ``digest``."""
        return self.root / f"{digest}.run"

    def cached(self, digest: str, key: dict[str, Any]) -> bool:
        """True when the folder of ``digest`` holds a finished warm start made with ``key``."""
        try:
            return json.loads((self.folder(digest) / KEY_FILENAME).read_text()) == json.loads(json.dumps(key))
        except (OSError, ValueError):
            return False

    def link(self, digest: str) -> None:
        """Point ``output`` at the folder of ``digest`` (a relative symbolic link, replaced atomically). A
        real folder at ``output`` (a cache written before the store) is moved into the store as
        ``legacy-<its key's digest>`` first, not deleted. Raises OSError."""
        self.root.mkdir(parents=True, exist_ok=True)
        out = self.output
        if out.is_dir() and not out.is_symlink():
            try:
                old = key_digest(json.loads((out / KEY_FILENAME).read_text()))
            except (OSError, ValueError):
                old = f"{os.getpid()}-{time.time_ns()}"
            os.replace(out, self.root / f"legacy-{old}")
            log.info("sft: moved the earlier cache %s to %s", out, self.root / f"legacy-{old}")
        tmp = out.with_name(f".{out.name}.link-{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        os.symlink(os.path.relpath(self.folder(digest), out.parent), tmp)
        os.replace(tmp, out)

    @contextlib.contextmanager
    def lock(self, digest: str, controller: bool, poll_s: float = LOCK_POLL_SECONDS,
             group: Any = None) -> Iterator[None]:
        """Hold the lock of ``digest`` (``fcntl.lockf`` on ``<digest>.lock``) for the block. The controller
        tries it every ``poll_s`` seconds and tells the other trainer ranks each time (a broadcast over
        ``group``, the hand-off group of :func:`hpcrl.train.parallel.handoff_group` where given: they wait
        with it, not in one collective that could time out). Raises OSError other than "held elsewhere"."""
        import fcntl

        from hpcrl.run_session import broadcast

        fd = None
        if controller:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / f"{digest}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            waited = False
            while True:
                got = None
                if fd is not None:
                    try:
                        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        got = True
                    except OSError as e:
                        if e.errno not in (errno.EAGAIN, errno.EACCES):
                            raise
                        got = False
                if broadcast(got, group):
                    break
                if not waited and controller:
                    log.info("sft: another run is training the warm start %s: waiting for it", self.folder(digest))
                waited = True
                time.sleep(poll_s)
            yield
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock


def warm_start_folder(cfg: "Config", base: Path) -> Path:
    """The store folder of ``cfg``'s warm start from ``base`` (made or not): ``<sft.output>.d/<digest>``."""
    return WarmStartStore(Path(cfg.sft.output)).folder(key_digest(cache_key(cfg, Path(base))))


def warm_start_config(cfg: "Config", run_dir: Path) -> "Config":
    """The config of the SFT run of ``cfg``'s warm start, in ``run_dir``: ``run.mode: sft`` with
    ``sft.steps`` steps, ``sft.data`` (when set) as ``data``, no critic, no agent (``rollout.agent``) and no
    extra eval sets (the target is the demonstrations' eval accuracy), full fine-tuning (no ``model.lora``: the
    RL run's adapters go on the model it makes), W&B (when on) in the RL run's project and group; everything
    else (model, layout, engines, Slurm, checkpoints) is the run's. Does not modify ``cfg``."""
    from hpcrl.config.rollout import AgentSection

    c = copy.deepcopy(cfg)
    c.run.mode = "sft"
    c.run.output_dir, c.run.name = str(run_dir.parent), run_dir.name
    c.run.num_rollout = c.sft.steps
    if c.sft.data is not None:
        c.data, c.sft.data = c.sft.data, None
    c.sft.enabled = False
    c.model.lora = None  # the warm start trains the whole model (its cache serves LoRA and full runs alike)
    c.critic.nprocs = 0
    c.eval.sets = []
    c.algorithm.opd.teachers = []
    c.rollout.agent = AgentSection()  # SFT trains on demonstrations: no agent episodes, so no gateway
    c.rollout.agent_step = False
    c.wandb.project = c.wandb.project or cfg.run.name
    c.wandb.group = c.wandb.group or cfg.run.name
    c.wandb.tags = [*c.wandb.tags, "sft-warm-start"]
    return c


def _write_curve(run_dir: Path, dest: Path) -> None:
    """The SFT run's ``metrics.jsonl`` as :data:`METRICS_FILENAME` in ``dest`` (steps counted as optimizer
    steps done)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    t0 = rows[0]["time"] if rows else 0.0
    out = []
    for r in rows:
        step = r["step"] + 1
        if "train/loss" in r:
            out.append({"step": step, "loss": r["train/loss"], "lr": r["train/lr"],
                        "grad_norm": r.get("train/grad_norm"), "elapsed_s": round(r["time"] - t0, 3)})
        if "eval/accuracy" in r:
            out.append({"step": step, "eval_accuracy": r["eval/accuracy"], "elapsed_s": round(r["time"] - t0, 3)})
    (dest / METRICS_FILENAME).write_text("".join(json.dumps(o) + "\n" for o in out))


def warm_start(cfg: "Config", base: Path, launch_engines: Optional["EngineLauncher"] = None,
               ci_checks: Optional[bool] = None) -> Optional[Path]:
    """The warm start of ``cfg`` (``sft.output``'s recipe) from the HF folder ``base``, on every trainer
    rank (collective; rank 0 the controller): returns the cached folder (module doc) after linking
    ``sft.output`` to it, training it first when the store has none for the key; None when the SFT run
    stopped early with a checkpoint (preemption: the caller exits for requeue, and the next attempt resumes
    it). ``launch_engines``: the engines' launcher (the Slurm job step's; default local processes).

    Raises ValueError when ``sft.output`` is empty, and what the SFT run raises."""
    if not cfg.sft.output:
        raise ValueError("sft.output is empty; set it to the folder the SFT model is saved to")
    from hpcrl.train.parallel import destroy_group, handoff_group

    # the other ranks wait for the controller's hashing of the base model (minutes for hundreds of GB) and
    # store look-ups under train.rollout_wait_timeout_s, not the trainer's collective bound
    handoff = handoff_group(cfg.train.collective_timeout_s, cfg.train.rollout_wait_timeout_s)
    try:
        return _warm_start(cfg, base, launch_engines, ci_checks, handoff)
    finally:
        destroy_group(handoff)


def _warm_start(cfg: "Config", base: Path, launch_engines: Optional["EngineLauncher"], ci_checks: Optional[bool],
                handoff: Any) -> Optional[Path]:
    """:func:`warm_start` with the hand-off group ``handoff`` made."""
    from hpcrl.loop_sft import train_sft_main
    from hpcrl.procs import env_rank
    from hpcrl.run_session import broadcast

    store = WarmStartStore(Path(cfg.sft.output))
    controller = env_rank() == 0
    key = cache_key(cfg, Path(base)) if controller else None
    digest = broadcast(key_digest(key) if key is not None else None, handoff)
    folder = store.folder(digest)

    def cached() -> bool:
        return bool(broadcast(store.cached(digest, key) if controller else None, handoff))

    if not cached():
        with store.lock(digest, controller, group=handoff):
            if not cached():  # (another run may have made it while this one waited for the lock)
                t0 = time.perf_counter()
                run_dir = store.run_dir(digest)
                sub = warm_start_config(cfg, run_dir)
                if controller:
                    from hpcrl.validate import save_resolved

                    log.info("sft: training the warm start %s (run folder %s)", folder, run_dir)
                    save_resolved(sub, run_dir)
                result = train_sft_main(sub, run_dir, Path(base), ci_checks, launch_engines, export=folder)
                if result.get("preempted"):
                    return None
                if controller:
                    _write_curve(run_dir, folder)
                    tmp = folder / f".{KEY_FILENAME}.tmp"
                    tmp.write_text(json.dumps(key, indent=1, sort_keys=True) + "\n")
                    os.replace(tmp, folder / KEY_FILENAME)  # the key last: the folder is whole
                    log.info("sft: saved %s (%.1f s)", folder, time.perf_counter() - t0)
    elif controller:
        log.info("sft: %s was made from the same base model, data, seed, recipe and layout: using it", folder)
    if controller:
        store.link(digest)
    return folder


def warm_start_plan(cfg: "Config") -> list[tuple[Optional[int], "Config"]]:
    """Every warm start ``cfg`` needs before RL, in the order they are made, as ``(teacher, config)`` pairs
    whose ``config.sft`` is the recipe that makes it and ``config.sft.output`` its store: the policy's own
    (``teacher`` None; ``sft.enabled``, not in ``run.mode: sft``, where the run itself is the SFT), then each
    on-policy distillation teacher with ``sft_target_accuracy`` (``teacher`` its index: the run's recipe to that
    accuracy, stored behind the teacher's ``path``). Its cache key is ``cache_key(config, base)``. Does not
    modify ``cfg``."""
    import dataclasses

    plan: list[tuple[Optional[int], "Config"]] = []
    if cfg.sft.enabled and cfg.run.mode != "sft":
        plan.append((None, cfg))
    for i, t in enumerate(cfg.algorithm.opd.teachers):
        if t.sft_target_accuracy is not None:
            sft = dataclasses.replace(cfg.sft, enabled=True, output=t.path, target_accuracy=t.sft_target_accuracy)
            plan.append((i, dataclasses.replace(cfg, sft=sft)))
    return plan


def warm_starts(cfg: "Config", base: Path, launch_engines: Optional["EngineLauncher"] = None,
                ci_checks: Optional[bool] = None) -> Optional[Path]:
    """Every warm start a run needs before RL (:func:`warm_start_plan`), on every trainer rank; a teacher's
    ``path`` in ``cfg`` is pointed at the folder made for it. Returns the folder RL starts from (``base``
    without a warm start of its own), or None when one stopped early with a checkpoint (preempted). Raises what
    :func:`warm_start` raises and ConfigError from the teachers' checks."""
    from hpcrl.config import ConfigError
    from hpcrl.validate import check_teacher_tokenizers

    model = Path(base)
    for teacher, c in warm_start_plan(cfg):
        made = warm_start(c, Path(base), launch_engines, ci_checks)
        if made is None:
            return None
        if teacher is None:
            model = made
        else:
            cfg.algorithm.opd.teachers[teacher].path = str(made)
    for i, t in enumerate(cfg.algorithm.opd.teachers):
        if t.sft_target_accuracy is None and not (Path(t.path) / "config.json").is_file():
            raise ConfigError(f"algorithm.opd.teachers[{i}].path", t.path, "is not an HF model folder",
                              "fix the path, or set sft_target_accuracy to make it by SFT")
    check_teacher_tokenizers(cfg)
    return model
