"""Peak resident memory per phase of a GRPO step, hpcrl (and TRL beside it), issue #13 point 4.

Each layout runs in a fresh worker process: hpcrl's own loop (``hpcrl.loop.train_main``, CPU engine and
sglang-router as subprocesses, as always) on the work of ``benchmarks/vs_trl.py`` (8 prompts x 8 samples,
<= 16 new tokens, one optimizer step per rollout step, the same starting checkpoint), or TRL's
``GRPOTrainer`` on the same work (``--layouts trl``). The worker tracks its own peak RSS phase by phase:
at every phase boundary it reads the kernel's high-water mark (``VmHWM`` in ``/proc/self/status``), charges
it to the phase that just ended and resets it to the current RSS (``echo 5 > /proc/self/clear_refs``), so a
phase's figure is the most memory the process held at any moment of that phase. On a kernel that ignores the
reset (a probe at start tells), it samples ``VmRSS`` every millisecond instead; the table's header says which. Phases (hpcrl, trainer
process):

- ``set-up``: imports, model build from the HF checkpoint, optimizer, first weight sync, start eval;
- ``rollout``: the trainer waiting while the engine generates (and the rewards);
- ``log-probs (no grad)``: recomputed old (and reference) log-probs, when the config asks for them;
- ``forward``: each micro-batch's forward and loss (activations held for backward);
- ``backward``: each micro-batch's backward (``torch.autograd.backward``);
- ``optimizer``: gradient reduction, clipping and the Adam step;
- ``weight sync``: exporting the HF tensors and sending them to the engine;
- ``metrics log``: the step's metrics (``metrics.jsonl``, TensorBoard, progress bar);
- ``run end (curves.png)``: the last step's summary and the curves figure;
- ``other``: the rest (between the phases above: micro-batch building, checkpoints, engine calls).

The engine's row is the peak of the engine process (``VmHWM``, read just before it stops). TRL has no engine
or weight sync; its ``rollout`` is ``model.generate`` and the reward.

Layouts (``--layouts``, any of): ``padded`` (``train.micro_batch_size``, ``--micro-batch``, default the whole
batch of 64), ``packed`` (``train.max_tokens_per_microbatch`` = ``--max-tokens``, ``share_group_prompt`` on),
``packed-noshare`` (packing without prompt sharing), ``packed-recompute`` (packed, with megatron's full
activation recomputation, ``vs_trl.RECOMPUTE``), ``trl`` (TRL at ``--micro-batch``, with its defaults, which
include ``gradient_checkpointing=True``).

    python benchmarks/memory.py --model tiny --steps 3
    python benchmarks/memory.py --model smollm2 --steps 2 --layouts "trl padded packed" --micro-batch 16

Needs the ``bench`` extra for the ``trl`` layout: ``bash .ci/install --bench``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

LAYOUTS = ("padded", "packed", "packed-noshare", "packed-recompute", "trl")
PHASES = ("set-up", "rollout", "log-probs (no grad)", "forward", "backward", "optimizer", "weight sync",
          "metrics log", "run end (curves.png)", "other")
MiB = 2**20


# ------------------------------------------------------------------------------------------------------------
# Worker side: the phase tracker
# ------------------------------------------------------------------------------------------------------------


def _status_bytes(key: str, pid: str = "self") -> int:
    """A ``/proc/PID/status`` memory field (``VmHWM``, ``VmRSS``), bytes; 0 if the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_hwm() -> None:
    """Reset this process's ``VmHWM`` to its current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _hwm_reset_works(probe: int = 64 * MiB) -> bool:
    """Whether resetting ``VmHWM`` takes effect here: raise the mark by touching ``probe`` bytes of a fresh
    anonymous mapping, unmap it, reset, and see the mark fall back near the RSS. False where the write is
    refused or ignored."""
    import mmap

    with mmap.mmap(-1, probe) as m:
        m.write(b"\1" * probe)
    try:
        _reset_hwm()
    except OSError:
        return False
    return _status_bytes("VmHWM") - _status_bytes("VmRSS") < probe // 2


class PhasePeaks:
    """Peak RSS of this process per phase (bytes). :meth:`enter` ends the current phase and charges its peak.

    Two ways to see a phase's peak, chosen at construction (``method``):

    - ``"VmHWM"``: the kernel's high-water mark, reset to the current RSS at each boundary
      (``echo 5 > /proc/self/clear_refs``) - exact, every page counted. Used when a probe shows the kernel
      honours the reset (some sandboxed kernels accept the write and keep the old mark).
    - ``"sampled"``: a daemon thread reads ``VmRSS`` every ``interval`` seconds (default 1 ms) and keeps the
      largest value of the current phase - a spike shorter than the interval can be missed.

    ``method="auto"`` (the default) takes ``VmHWM`` where it works, else ``sampled``; :attr:`method` says which.

    Raises ValueError for an unknown ``method``; OSError for ``method="VmHWM"`` on a kernel that does not reset
    the high-water mark."""

    def __init__(self, first: str, method: str = "auto", interval: float = 0.001) -> None:
        if method not in ("auto", "VmHWM", "sampled"):
            raise ValueError(f"PhasePeaks method={method!r}: use 'auto', 'VmHWM' or 'sampled'")
        self.peaks: dict[str, int] = {}
        self.current = first
        self._lock = threading.Lock()
        if method != "sampled" and not _hwm_reset_works():
            if method == "VmHWM":
                raise OSError("this kernel does not reset VmHWM through /proc/self/clear_refs; use method='sampled'")
            method = "sampled"
        self.method = "VmHWM" if method == "auto" else method
        if method == "sampled":
            self._max = _status_bytes("VmRSS")  # the current phase's largest sample
            self._interval = interval
            threading.Thread(target=self._sample, name="phase-peaks", daemon=True).start()
        else:
            _reset_hwm()

    def _sample(self) -> None:
        while True:
            rss = _status_bytes("VmRSS")
            with self._lock:
                self._max = max(self._max, rss)
            time.sleep(self._interval)

    def _phase_peak(self) -> int:
        """The current phase's peak so far, then restart the count from the current RSS (lock held)."""
        if self.method == "VmHWM":
            peak = _status_bytes("VmHWM")
            _reset_hwm()
        else:
            rss = _status_bytes("VmRSS")
            peak, self._max = max(self._max, rss), rss
        return peak

    def enter(self, name: str) -> None:
        with self._lock:
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), self._phase_peak())
            self.current = name

    def during(self, name: str, after: Optional[str] = None) -> Callable:
        """Decorator: the wrapped call is phase ``name``; afterwards ``after`` (default: the phase before)."""

        def deco(fn):
            @functools.wraps(fn)
            def wrapped(*a, **k):
                back = after or self.current
                self.enter(name)
                try:
                    return fn(*a, **k)
                finally:
                    self.enter(back)

            return wrapped

        return deco


def _patch_backward(phases: PhasePeaks) -> None:
    """``Tensor.backward`` calls ``torch.autograd.backward`` by attribute: wrapping it sees every backward."""
    import torch.autograd

    torch.autograd.backward = phases.during("backward", after="other")(torch.autograd.backward)


def hpcrl_worker(spec: dict) -> dict:
    """One hpcrl run of ``spec["steps"]`` steps with the phase tracker installed; returns the peaks and the
    loop's token counts."""
    import torch

    torch.set_num_threads(spec["threads"])
    phases = PhasePeaks("set-up")
    _patch_backward(phases)

    import hpcrl.loop as loop
    import hpcrl.rollout.manager as rollout_manager
    import hpcrl.run_session as run_session
    from hpcrl.names import DEFAULT_ROLLOUT_FUNCTION
    from hpcrl.train.actor import Actor
    from vs_trl import RECOMPUTE, build_config

    cfg = build_config(spec["model"], spec["start"], spec["out_dir"], spec["seed"], "fp32", spec["micro_batch"])
    cfg.rollout.rollout_function = DEFAULT_ROLLOUT_FUNCTION
    cfg.run.num_rollout = spec["steps"]
    if spec["layout"].startswith("packed"):
        cfg.train.max_tokens_per_microbatch = spec["max_tokens"]
        cfg.train.share_group_prompt = spec["layout"] != "packed-noshare"
    if spec["layout"] == "packed-recompute":
        cfg.megatron.update(RECOMPUTE)

    actor_init = Actor.__init__

    def init(self, *a, **k):
        actor_init(self, *a, **k)
        self.optimizer.step = phases.during("optimizer", after="other")(self.optimizer.step)

    Actor.__init__ = init
    Actor._forward_only = phases.during("log-probs (no grad)")(Actor._forward_only)
    actor_forward = Actor._forward

    def forward(self, *a, **k):  # the grad-enabled forward of a micro-batch; its loss follows, then backward
        if torch.is_grad_enabled():
            phases.enter("forward")
        return actor_forward(self, *a, **k)

    Actor._forward = forward
    # the first sync (run_session) and each step's (loop)
    synced = phases.during("weight sync", after="other")(loop.sync_weights)
    run_session.sync_weights = loop.sync_weights = synced
    run_session.RunLog.log = phases.during("metrics log")(run_session.RunLog.log)
    run_session.RunLog.finish = phases.during("run end (curves.png)")(run_session.RunLog.finish)
    engine_peak = {"bytes": 0}
    make_manager = rollout_manager.rollout_manager

    def manager(*a, **k):
        m = make_manager(*a, **k)
        m.generate = phases.during("rollout", after="other")(m.generate)
        stop = m.stop

        def stop_after_reading_engines():
            import psutil

            for p in psutil.Process().children(recursive=True):
                try:
                    if "hpcrl.engine" in " ".join(p.cmdline()):
                        engine_peak["bytes"] = max(engine_peak["bytes"], _status_bytes("VmHWM", str(p.pid)))
                except psutil.Error:
                    pass
            return stop()

        m.stop = stop_after_reading_engines
        return m

    rollout_manager.rollout_manager = manager  # RunSession imports it when it builds the rollout side
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    loop.train_main(cfg, run_dir, Path(spec["start"]))
    phases.enter("other")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in lines if m.get("step", -1) >= 0]
    return {"peaks": phases.peaks, "peak_method": phases.method, "engine": engine_peak["bytes"],
            "forward_tokens": [m.get("train/forward_tokens") for m in steps],
            "padded_tokens": [m.get("train/padded_tokens") for m in steps],
            "train_seconds": [m.get("train/seconds") for m in steps]}


def trl_worker(spec: dict) -> dict:
    """TRL's ``GRPOTrainer`` on the same work for ``spec["steps"]`` steps, phases tracked the same way."""
    import torch

    torch.set_num_threads(spec["threads"])
    phases = PhasePeaks("set-up")
    _patch_backward(phases)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpcrl.data.datasets import load_datasets
    from hpcrl.models.hf import load_hf_model
    from vs_trl import (ADAM_BETA2, BATCH_PROMPTS, CLIP_GRAD, EPS_CLIP, GROUP_SIZE, LR, MAX_NEW_TOKENS,
                        TEMPERATURE, build_config)

    cfg = build_config(spec["model"], spec["start"], spec["out_dir"], spec["seed"], "fp32", spec["micro_batch"])
    data = load_datasets(cfg)
    model, tok = load_hf_model(spec["start"], dtype="float32")
    if cfg.rollout.stop:  # as in vs_trl.py: the stop string's first token ends generation
        extra = [i for s in cfg.rollout.stop for i in tok(s, add_special_tokens=False)["input_ids"][:1]]
        eos = model.generation_config.eos_token_id
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        model.generation_config.eos_token_id = list(dict.fromkeys([*eos, *extra]))
    by_prompt = {it["prompt"]: it for it in data.train}
    tokens = {"real": [], "padded": []}

    def exact_match(prompts, completions, **kwargs):
        return [float(data.task.score(c, by_prompt[p])) for p, c in zip(prompts, completions)]

    torch.optim.AdamW.step = phases.during("optimizer", after="other")(torch.optim.AdamW.step)

    def pre_forward(module, args):
        if torch.is_grad_enabled():
            phases.enter("forward")

    model.register_forward_pre_hook(pre_forward)

    class Phases(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if phases.current == "set-up":
                phases.enter("other")

    class TrackedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, *a, **k):
            out = phases.during("rollout", after="other")(super()._generate_and_score_completions)(*a, **k)
            real = int(out["prompt_mask"].sum() + out["completion_mask"].sum())
            padded = out["prompt_ids"].numel() + out["completion_ids"].numel()
            tokens["real"].append(real)
            tokens["padded"].append(padded)
            return out

    micro = spec["micro_batch"]
    args = GRPOConfig(
        output_dir=os.path.join(spec["out_dir"], "trl"), use_cpu=True, seed=spec["seed"], bf16=False, fp16=False,
        per_device_train_batch_size=micro, num_generations=GROUP_SIZE,
        gradient_accumulation_steps=BATCH_PROMPTS * GROUP_SIZE // micro, max_completion_length=MAX_NEW_TOKENS,
        temperature=TEMPERATURE, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0,
        adam_beta2=ADAM_BETA2, weight_decay=0.0, max_grad_norm=CLIP_GRAD, beta=0.0, epsilon=EPS_CLIP,
        loss_type="grpo", scale_rewards="group", num_iterations=1, max_steps=spec["steps"], report_to="none",
        save_strategy="no", logging_steps=10**6, disable_tqdm=True, dataloader_num_workers=0,
    )
    train = Dataset.from_list([{"prompt": it["prompt"]} for it in data.train])
    trainer = TrackedGRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=train,
                                 processing_class=tok, callbacks=[Phases()])
    trainer.train()
    phases.enter("other")
    # TRL's training forward runs over the padded [micro, prompt + completion] rows of each step
    return {"peaks": phases.peaks, "peak_method": phases.method, "engine": 0, "forward_tokens": tokens["padded"], "padded_tokens": tokens["padded"],
            "real_tokens": tokens["real"]}


# ------------------------------------------------------------------------------------------------------------
# Orchestrator
# ------------------------------------------------------------------------------------------------------------


def run_layout(layout: str, spec: dict, log: Path) -> dict:
    """Run one worker process; its last stdout line is its JSON result. Raises RuntimeError (with the log's
    tail) if it fails."""
    spec = dict(spec, layout=layout)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{layout} worker failed (exit {proc.returncode}):\n{log.read_text()[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median(xs: list) -> Optional[float]:
    xs = sorted(x for x in xs if x is not None)
    return xs[len(xs) // 2] if xs else None


def table(results: dict[str, dict]) -> str:
    names = list(results)
    width = max(14, *(len(n) for n in names))
    head = f"| {'peak RSS (MiB)':32} | " + " | ".join(f"{n:>{width}}" for n in names) + " |"
    lines = [head, "|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|"]

    def row(label: str, values: list) -> None:
        cells = [("" if v is None else (f"{v:,.0f}" if isinstance(v, (int, float)) else str(v))) for v in values]
        lines.append(f"| {label:32} | " + " | ".join(f"{c:>{width}}" for c in cells) + " |")

    for ph in PHASES:
        vals = [results[n]["peaks"].get(ph) for n in names]
        if any(v is not None for v in vals):
            row(f"trainer: {ph}", [None if v is None else v / MiB for v in vals])
    row("trainer: whole run", [max(results[n]["peaks"].values()) / MiB for n in names])
    row("engine (whole run)", [results[n]["engine"] / MiB if results[n]["engine"] else None for n in names])
    row("tokens through the model / step", [_median(results[n]["forward_tokens"]) for n in names])
    row("tokens as padded / step", [_median(results[n]["padded_tokens"]) for n in names])
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps per layout (default 3)")
    p.add_argument("--layouts", default="padded packed", help=f"any of {' '.join(LAYOUTS)}")
    p.add_argument("--micro-batch", type=int, default=64, help="samples per micro-batch: padded layout and TRL")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="train.max_tokens_per_microbatch of the packed layouts (default: 512 tiny, 2048 smollm2)")
    p.add_argument("--threads", type=int, default=1, help="torch/OpenMP threads per process (default 1)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        result = (trl_worker if spec["layout"] == "trl" else hpcrl_worker)(spec)
        sys.stdout.flush()
        print(json.dumps(result), flush=True)
        os._exit(0)  # TRL/accelerate and the loop's daemon threads: nothing left to wait for

    layouts = args.layouts.split()
    for lay in layouts:
        if lay not in LAYOUTS:
            p.error(f"--layouts: unknown layout {lay!r}; use any of {' '.join(LAYOUTS)}")
    if args.micro_batch <= 0 or 64 % args.micro_batch:
        p.error(f"--micro-batch={args.micro_batch}: must divide the 64 samples of a step; use e.g. 16 or 32")
    from machine import machine_header
    from vs_trl import prepare_start

    start, how = prepare_start(args.model)
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="hpcrl-memory-"))
    out.mkdir(parents=True, exist_ok=True)
    spec = {"model": args.model, "start": str(start), "seed": args.seed, "threads": args.threads,
            "steps": args.steps, "micro_batch": args.micro_batch,
            "max_tokens": args.max_tokens or (512 if args.model == "tiny" else 2048)}
    results = {}
    t0 = time.perf_counter()
    for lay in layouts:
        print(f"[{lay}] running {args.steps} steps ...", file=sys.stderr, flush=True)
        results[lay] = run_layout(lay, dict(spec, out_dir=str(out / lay)), out / f"{lay}.log")
    print(machine_header(threads=args.threads, precision="fp32"))
    print(f"# peak RSS per phase, model {args.model}, {args.steps} GRPO steps of 8 prompts x 8 samples "
          f"(<= 16 new tokens); padded and trl: micro-batch {args.micro_batch}; packed: "
          f"max_tokens_per_microbatch {spec['max_tokens']}; start: {how}; {time.strftime('%Y-%m-%d %H:%M %Z')}")
    methods = sorted({r.get("peak_method", "VmHWM") for r in results.values()})
    print("# phase peaks from: " + ", ".join("the kernel's VmHWM, reset at each boundary" if m == "VmHWM"
                                            else "VmRSS sampled every 1 ms" for m in methods))
    print(table(results))
    print(f"\n(logs in {out}; {time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
