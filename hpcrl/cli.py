"""The ``hpcrl`` command line: validate, run, eval, sft, submit, run-slurm, sweep, status, logs, cancel,
convert, serve.

Every subcommand that reads a config takes ``CONFIG [key=value ...]`` (dotted overrides, see
:func:`hpcrl.config.load_config`). A :class:`~hpcrl.config.ConfigError` anywhere is printed as its one line on
stderr with exit status 2, never as a traceback. Subcommands whose implementation does not exist yet say so
on stderr and exit 2; none of them pretends to succeed.

Implementations are imported lazily inside each handler, so ``hpcrl validate`` and ``hpcrl --help`` stay fast
and work without torch, SGLang or Megatron.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from hpcrl import __version__
from hpcrl.config import Config, ConfigError

EXIT_OK = 0
EXIT_ERROR = 2
"""Exit status for configuration errors, usage errors and subcommands that are not implemented yet."""


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _exit_code(result: object) -> int:
    """An implementation's return value as an exit status: an int as is, anything else means success."""
    if isinstance(result, int) and not isinstance(result, bool):
        return result
    return EXIT_OK


def summarize(cfg: Config) -> list[str]:
    """A few lines describing a resolved config (what ``hpcrl validate`` prints after ``OK``)."""
    r, t, a, m = cfg.rollout, cfg.train, cfg.algorithm, cfg.model
    model = m.path + (f" (created with {m.create} if missing)" if m.create else "")
    kl = f"kl {a.kl_loss_type} x {a.kl_loss_coef}" if a.use_kl_loss else "no kl"
    sft_run = cfg.run.mode == "sft"
    from hpcrl.config.train import sequence_parallel

    experts = t.expert_parallel_size > 1 or t.expert_tensor_parallel_size > 1
    layout = (f"tp{t.tensor_parallel_size}{' sp' if sequence_parallel(t) else ''} pp{t.pipeline_parallel_size} "
              f"cp{t.context_parallel_size} ep{t.expert_parallel_size}"
              f"{f' etp{t.expert_tensor_parallel_size}' if experts else ''}, nprocs {t.nprocs}")
    micro = (f"micro batch {t.micro_batch_size}" if t.max_tokens_per_microbatch is None else
             f"packed <= {t.max_tokens_per_microbatch} tokens per micro-batch"
             + (", shared prompts" if t.share_group_prompt and not sft_run else ""))
    lines = [
        (f"  run:       {cfg.run.name} ({cfg.run.mode}, {cfg.run.placement}), {cfg.run.num_rollout} "
         f"{'SFT steps' if sft_run else 'rollouts'} -> {cfg.run.output_dir}/{cfg.run.name}"),
        f"  model:     {model}, {m.dtype}"
        + (f"; LoRA rank {m.lora.rank}, alpha {m.lora.alpha:g} on {', '.join(m.lora.target_modules)} "
           f"(base frozen; {m.lora.sync} sync)" if m.lora is not None else ""),
        f"  data:      {(cfg.sft.data or cfg.data).source if sft_run else cfg.data.source}",
    ]
    if not sft_run:
        lines += [
            (f"  rollout:   {r.batch_size} prompts x {r.n_samples_per_prompt} samples, max_new_tokens "
             f"{r.max_new_tokens}, temperature {r.temperature}, engine {r.engine}"
             + (f", filter {r.dynamic_filter}" if r.dynamic_filter else "")),
            (f"  train:     global batch {t.global_batch_size}, {micro}"
             + (f", activation recompute {cfg.megatron['recompute_granularity']}"
                if cfg.megatron.get("recompute_granularity") else "")
             + f", lr {t.lr}, {layout}"),
            (f"  algorithm: {a.advantage_estimator}, {a.policy_loss} loss, eps_clip {a.eps_clip}/"
             f"{a.eps_clip_high}, {kl}" + (", tis" if a.use_tis else "")
             + (f", mis {a.mis_level} [{a.mis_low:g}, {a.mis_high:g}]" if a.mis_level else "")),
        ]
    else:
        lines.append(f"  train:     {micro}, {'bf16' if t.bf16 else 'fp32'}, {layout}")
    lines.append(f"  weights:   {cfg.weights.method}")
    for i, t in enumerate(a.opd.teachers):
        made = f" (made by SFT to {t.sft_target_accuracy} if missing)" if t.sft_target_accuracy is not None else ""
        lines.append(f"  teacher:   {t.name or f't{i}'}: {t.path}{made}, "
                     f"{t.num_engines} engine(s), opd coef {a.opd.coef}")
    if cfg.sft.enabled or sft_run:
        s = cfg.sft
        from hpcrl.sft import STORE_SUFFIX
        from hpcrl.sft_recipe import NEAR_TARGET_FRACTION

        near = (f", every {s.eval_interval_near_target} from {NEAR_TARGET_FRACTION * s.target_accuracy:g}"
                if s.eval_interval_near_target and s.target_accuracy is not None else "")
        mean = f" (mean of the last {s.target_window} evals)" if s.target_window > 1 else ""
        anneal = f" then {s.anneal_steps} steps of lr decay to 0," if s.anneal_steps else ""
        until = (f"until greedy accuracy{mean} >= {s.target_accuracy} (eval every {s.eval_interval} steps{near}),"
                 f"{anneal} "
                 "at most " if s.target_accuracy is not None else f"eval every {s.eval_interval} steps, ")
        where = ("this run (Megatron trainer)" if sft_run else
                 f"warm start on the Megatron trainer -> {s.output} (cached by key in {s.output}{STORE_SUFFIX})")
        lines.append(f"  sft:       {until}{s.steps} steps, batch {s.batch_size}, lr {s.lr}: {where}")
    e = cfg.eval
    default = (f"{cfg.data.eval_source}" if cfg.data.eval_source else f"{cfg.data.num_eval} held out"
               if cfg.data.num_eval else "")
    sets = ([f"default ({default})"] if default else []) + [f"{s.name} ({s.source})" for s in e.sets]
    lines.append(f"  eval:      every {(cfg.sft.eval_interval if sft_run else r.eval_interval) or 'last'} step(s): "
                 + (", ".join(sets) or "no eval set")
                 + f"; {e.n_samples} sample(s) per prompt at temperature {e.temperature}")
    if cfg.sweep.grid or cfg.sweep.num_random:
        grid = ", ".join(cfg.sweep.grid) or "-"
        lines.append(f"  sweep:     grid over {grid}; {cfg.sweep.num_random} random points")
    return lines


# ------------------------------------------------------------------------------------------------------------
# Handlers: each takes the parsed namespace and returns an exit status
# ------------------------------------------------------------------------------------------------------------

def _cmd_validate(ns: argparse.Namespace) -> int:
    from hpcrl.validate import load_and_check, memory_lines

    cfg = load_and_check(ns.config, ns.overrides, check_files=not ns.no_check_files, plan=ns.plan)
    if not ns.no_check_files:
        from hpcrl.data.datasets import check_data

        check_data(cfg)  # every row of every data file, as the run reads them; notes on stderr
    if ns.print_config:
        from hpcrl.config import config_to_yaml

        print(config_to_yaml(cfg), end="")
        return EXIT_OK
    print(f"OK: {ns.config}" + (" (plan: the model's weights not checked; the run checks them where it starts)"
                                if ns.plan else ""))
    for line in summarize(cfg) + memory_lines(cfg):
        print(line)
    return EXIT_OK


def _cmd_run(ns: argparse.Namespace) -> int:
    from hpcrl.validate import load_and_check

    cfg = load_and_check(ns.config, ns.overrides)
    from hpcrl import launch_local
    from hpcrl.run_setup import run_dir_of
    from hpcrl.errors import report_known

    launch_local.resolve_cpu_sets(cfg)  # this machine's CPUs (disaggregated): a config error before anything runs
    launch_local.check_local_engine(cfg)  # SGLang importable here when the engines are SGLang
    launch_local.check_local_trainer(cfg)  # the CPU optimizer offload needs a GPU here
    from hpcrl.offload import restart_with_hook

    restart_with_hook(cfg.run.placement == "colocate")  # colocated on CUDA: torch-memory-saver's hook preloaded
    # a known error (data, engine start, checkpoint, ...): one line + the log with its traceback (hpcrl.errors)
    return report_known("hpcrl run", run_dir_of(cfg), lambda: _exit_code(launch_local.main(cfg)))


def _cmd_eval(ns: argparse.Namespace) -> int:
    from hpcrl.errors import report_known
    from hpcrl.standalone_eval import evaluate_target, format_results, resolve_target

    config, overrides = ns.config, list(ns.overrides)
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]  # no CONFIG, the first word is an override
    target = resolve_target(ns.target, config, overrides, ns.output)

    def run() -> int:
        result = evaluate_target(target)
        print(format_results(result))
        print(f"wrote {target.output / 'eval.json'}")
        return EXIT_OK

    return report_known("hpcrl eval", target.output, run)


def _cmd_sft(ns: argparse.Namespace) -> int:
    from hpcrl.validate import load_and_check

    cfg = load_and_check(ns.config, [*ns.overrides, "sft.enabled=true"])
    if not cfg.sft.output:
        raise ConfigError("sft.output", cfg.sft.output, "hpcrl sft needs a folder to save the SFT model to",
                          "set sft.output, e.g. sft.output=.cache/models/my-sft")
    if cfg.run.mode == "sft":
        raise ConfigError("run.mode", cfg.run.mode, "is an SFT run of its own, not a warm start",
                          "start it with hpcrl run (or hpcrl submit), or set run.mode=sync")
    from pathlib import Path

    from hpcrl import launch_local
    from hpcrl.errors import report_known
    from hpcrl.sft import WarmStartStore

    def run() -> int:
        print(launch_local.starting_model(cfg))
        return EXIT_OK

    # the warm start on this machine: an SFT run of the Megatron trainer in <sft.output>.d (hpcrl.sft)
    return report_known("hpcrl sft", WarmStartStore(Path(cfg.sft.output)).root, run)


def _cmd_convert(ns: argparse.Namespace) -> int:
    if ns.kind in ("mcore-to-hf", "mcore-to-peft"):
        from hpcrl.convert import convert_run_checkpoint

        peft = ns.kind == "mcore-to-peft"
        try:
            print(convert_run_checkpoint(ns.src, ns.dst, hf_base=ns.hf_base, dtype=None if peft else ns.dtype,
                                         fp8=not peft and ns.fp8, peft=peft))
        except (FileNotFoundError, FileExistsError, ValueError) as e:
            _err(f"hpcrl convert {ns.kind}: {e}")
            return EXIT_ERROR
        return EXIT_OK
    from hpcrl.models import gguf

    result = gguf.convert_gguf_to_hf(ns.src, ns.dst)
    print(f"converted {ns.src} -> {result if result is not None else ns.dst}")
    return EXIT_OK


def _cmd_serve(argv: list[str]) -> int:
    """Pass every argument after ``serve`` untouched to ``hpcrl.engine.server.main``."""
    from hpcrl.engine import server

    return _exit_code(server.main(list(argv)))


def _slurm_errors(handler: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Report :class:`hpcrl.slurm.SlurmCommandError` as one line on stderr with its exit status."""

    def wrapped(ns: argparse.Namespace) -> int:
        from hpcrl.slurm import SlurmCommandError

        try:
            return handler(ns)
        except SlurmCommandError as e:
            _err(str(e))
            return e.exit_code

    return wrapped


@_slurm_errors
def _cmd_submit(ns: argparse.Namespace) -> int:
    from hpcrl.slurm.submit import submit

    result = submit(ns.config, ns.overrides, dry_run=ns.dry_run, plain=ns.plain)
    from hpcrl.validate import memory_lines

    for line in memory_lines(result.config):  # the per-GPU estimate, on stderr (stdout: the dry run's script)
        _err(line)
    if result.dry_run:
        print(result.script, end="" if result.script.endswith("\n") else "\n")
        _err(f"hpcrl submit --dry-run: wrote {result.run_dir} (config.yaml, {result.script_path.name}, "
             "logs/); nothing was submitted")
        return EXIT_OK
    kind = "heterogeneous job" if result.plan.het else "job"
    print(f"submitted {kind} {result.job_id} ({result.launcher}): {result.run_dir}")
    print(f"  hpcrl status {result.run_dir}\n  hpcrl logs {result.run_dir} --follow")
    return EXIT_OK


@_slurm_errors
def _cmd_status(ns: argparse.Namespace) -> int:
    from hpcrl.slurm.state import collect_status, find_runs, format_table

    if ns.run is not None:  # a sweep folder, or a sweep's name under --output-dir: the per-point table
        from pathlib import Path

        from hpcrl.slurm.sweep import find_sweep, format_sweep_table, sweep_status

        found = find_sweep(ns.run) or find_sweep(Path(ns.output_dir) / ns.run)
        if found is not None:
            print(format_sweep_table(*sweep_status(found)))
            return EXIT_OK
    runs = find_runs(ns.run, ns.output_dir)
    if not runs:
        _err(f"hpcrl status: no run folders under {ns.output_dir}")
        return EXIT_OK
    print(format_table(collect_status(runs)))
    return EXIT_OK


@_slurm_errors
def _cmd_logs(ns: argparse.Namespace) -> int:
    from hpcrl.slurm import SlurmCommandError
    from hpcrl.slurm.control import print_logs, wandb_sync
    from hpcrl.slurm.state import find_run

    if ns.wandb_sync and ns.follow:
        raise SlurmCommandError("hpcrl logs: --wandb-sync uploads the W&B files and prints no logs; drop "
                                "--follow (or run the two commands one after the other)")
    run_dir = find_run(ns.run, ns.output_dir)
    return wandb_sync(run_dir) if ns.wandb_sync else print_logs(run_dir, follow=ns.follow)


@_slurm_errors
def _cmd_cancel(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from hpcrl.slurm.control import cancel
    from hpcrl.slurm.state import find_run, read_job_file
    from hpcrl.slurm.sweep import find_sweep

    sweep = find_sweep(ns.run) or find_sweep(Path(ns.output_dir) / ns.run)
    if sweep is not None:
        return _cancel_sweep(sweep, ns)
    if ns.points:
        _err(f"hpcrl cancel --points: needs a sweep folder; {ns.run} is not one (no sweep.json)")
        return EXIT_ERROR
    run_dir = find_run(ns.run, ns.output_dir)
    if ns.dry_run:
        job = read_job_file(run_dir)
        print(f"would cancel job {job['job_id'] if job else '- (never submitted)'}: {run_dir}")
        return EXIT_OK
    print(f"cancelled job {cancel(run_dir)}: {run_dir}")
    return EXIT_OK


def _cancel_sweep(sweep, ns: argparse.Namespace) -> int:
    """``hpcrl cancel SWEEP_FOLDER``: print what will be cancelled, cancel it in one scancel, and wait (up to
    ``--wait`` seconds) for the tasks to end."""
    from hpcrl.slurm import sweep as sw
    from hpcrl.slurm.state import queued_or_running
    from hpcrl.slurm.sweep.report import state_counts

    manifest = sw.read_manifest(sweep)
    names = sw.resolve_point_names(manifest, ns.points) if ns.points else None
    plan = sw.plan_cancel(manifest, names)
    if not plan.job_ids:
        counts = state_counts(plan.states[name] for name in (names or plan.states))
        print(f"nothing to cancel in {manifest['sweep_dir']}: no point is queued or running ({counts})")
        return EXIT_OK
    verb = "would cancel" if ns.dry_run else "cancelling"
    print(f"{verb} {len(plan.points)} of {len(manifest['points'])} points of sweep {manifest['name']} "
          f"({manifest['sweep_dir']}):")
    for line in plan.lines:
        print(f"  {line}")
    if ns.dry_run:
        return EXIT_OK
    sys.stdout.flush()
    sw.cancel_sweep(plan)
    states = sw.wait_ended(manifest, plan.points, timeout_s=ns.wait)
    print(f"cancelled {' '.join(plan.job_ids)} ({state_counts(states.values())}); bring the points back "
          f"with: hpcrl sweep --resubmit {manifest['sweep_dir']}")
    ending = [f"{n} ({s})" for n, s in states.items() if queued_or_running(s)]
    if ending:
        print(f"still ending after {ns.wait:g} s: {', '.join(ending)}; --resubmit takes them once hpcrl "
              "status shows them ended")
    return EXIT_OK


@_slurm_errors
def _cmd_sweep(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from hpcrl.slurm import sweep as sw

    folder_mode = ns.report or ns.resubmit
    if ns.report and ns.resubmit:
        _err("hpcrl sweep: give --report or --resubmit, not both")
        return EXIT_ERROR
    if folder_mode and ns.overrides:
        flag = "--report" if ns.report else "--resubmit"
        _err(f"hpcrl sweep {flag}: takes a SWEEP_FOLDER and no key=value overrides (got {ns.overrides[0]!r})")
        return EXIT_ERROR
    if ns.points and not ns.resubmit:
        _err("hpcrl sweep: --points only goes with --resubmit")
        return EXIT_ERROR
    if ns.report:
        if ns.dry_run:
            _err("hpcrl sweep --report: --dry-run does not apply")
            return EXIT_ERROR
        csv_path, png = sw.write_report(ns.sweep)
        print(f"wrote {csv_path}")
        print(f"wrote {png}" if png else "report.png not written: no point has logged a reward yet")
        return EXIT_OK
    if ns.resubmit:
        manifest = sw.read_manifest(ns.sweep)
        names = sw.resolve_point_names(manifest, ns.points) if ns.points else None
        res = sw.resubmit_sweep(ns.sweep, names, dry_run=ns.dry_run)
        if res.still_live:
            _err(f"hpcrl sweep --resubmit: left out {len(res.still_live)} points still queued or running: "
                 + ", ".join(f"{n} ({s})" for n, s in res.still_live.items())
                 + "; resubmit them once hpcrl status shows them ended")
        if not res.points:
            print(f"nothing to resubmit in {res.sweep_dir}: no point ended "
                  f"{'/'.join(sorted(sw.RESUBMIT_STATES))} or is unknown to Slurm without having finished "
                  "(name points with --points)")
            return EXIT_OK
        if res.dry_run:
            print(res.script, end="" if res.script.endswith("\n") else "\n")
            _err(f"hpcrl sweep --resubmit --dry-run: would resubmit {len(res.points)} points "
                 f"({'; '.join(res.points)}); nothing was submitted")
            return EXIT_OK
        what = (f"{len(res.points)} heterogeneous jobs" if res.het
                else f"job array {res.array_job_id} with {len(res.points)} tasks")
        print(f"resubmitted {what}: {'; '.join(f'{n} -> {j}' for n, j in res.job_ids.items())}")
        print(f"  hpcrl status {res.sweep_dir}")
        return EXIT_OK
    if Path(ns.sweep).is_dir() and sw.find_sweep(ns.sweep):
        _err(f"hpcrl sweep: {ns.sweep} is a sweep folder; use hpcrl sweep --report / --resubmit {ns.sweep}, "
             f"or hpcrl status {ns.sweep}")
        return EXIT_ERROR
    res = sw.submit_sweep(ns.sweep, ns.overrides, dry_run=ns.dry_run)
    n = len(res.points)
    if res.het:
        _err("hpcrl sweep: the points are disaggregated runs (heterogeneous jobs), which Slurm cannot put in "
             f"a job array: {'writing' if res.dry_run else 'submitting'} one het job per point "
             "(sweep.array_parallelism does not apply)")
    if res.dry_run:
        print(res.script, end="" if res.script.endswith("\n") else "\n")
        _err(f"hpcrl sweep --dry-run: wrote {res.sweep_dir} ({sw.SWEEP_FILE}, {n} point folders: "
             f"{'; '.join(res.points)}); nothing was submitted")
        return EXIT_OK
    if res.het:
        print(f"submitted sweep {res.sweep_dir.name}: {n} heterogeneous jobs "
              f"{', '.join(str(j) for j in res.job_ids.values())}: {res.sweep_dir}")
    else:
        print(f"submitted sweep {res.sweep_dir.name}: job array {res.array_job_id} with {n} tasks "
              f"(at most {min(n, res.array_parallelism)} at once): {res.sweep_dir}")
    print(f"  hpcrl status {res.sweep_dir}\n  hpcrl sweep --report {res.sweep_dir}")
    return EXIT_OK


def _cmd_run_slurm(ns: argparse.Namespace) -> int:
    from hpcrl.slurm.entry import run_slurm

    return _exit_code(run_slurm(ns.config))


# ------------------------------------------------------------------------------------------------------------
# Parser
# ------------------------------------------------------------------------------------------------------------

def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="run config YAML")
    p.add_argument("overrides", metavar="key=value", nargs="*",
                   help="dotted overrides, e.g. rollout.batch_size=16 sglang.enable_memory_saver=true")


def _add_output_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-dir", default="runs", metavar="DIR",
                   help="where run names are looked up (run.output_dir; default: runs)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``hpcrl`` (``serve`` is listed here but its arguments bypass argparse)."""
    parser = argparse.ArgumentParser(
        prog="hpcrl", description="Slurm-first RL post-training of LLMs (Megatron trainer + SGLang engines).")
    parser.add_argument("--version", action="version", version=f"hpcrl {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("validate", help="check a config and print the resolved summary")
    _add_config_args(p)
    p.add_argument("--no-check-files", action="store_true",
                   help="skip environment checks (files exist, plug-ins import, reasoning-gym tasks)")
    p.add_argument("--print-config", action="store_true", help="print the whole resolved config as YAML")
    p.add_argument("--plan", action="store_true",
                   help="plan a layout before downloading the model: its folder needs only config.json (the "
                        "weights are not checked); prints the per-GPU memory estimate")
    p.set_defaults(handler=_cmd_validate)

    p = sub.add_parser("run", help="run RL locally (no Slurm)")
    _add_config_args(p)
    p.set_defaults(handler=_cmd_run)

    p = sub.add_parser("eval", help="evaluate a run's newest checkpoint, a checkpoint or an HF model on the "
                                    "run's eval sets, as a run evaluates",
                       description="hpcrl eval RUN_OR_CHECKPOINT [CONFIG] [key=value ...]: a run folder (its "
                                   "newest checkpoint), a checkpoint folder (iter_XXXXXXX) or an HF model "
                                   "folder (with CONFIG) on the eval sets of the config (data.eval_source / "
                                   "num_eval and eval.sets), through the rollout's path on rollout.engine; "
                                   "writes eval.json.")
    p.add_argument("target", metavar="RUN_OR_CHECKPOINT",
                   help="run folder, checkpoint folder or HF model folder")
    p.add_argument("config", metavar="CONFIG", nargs="?", default=None,
                   help="run config (default: the run's config.yaml; required for an HF model folder)")
    p.add_argument("overrides", metavar="key=value", nargs="*", help="dotted overrides of the config")
    p.add_argument("--output", default=None,
                   help="folder for eval.json and the engine logs (default RUN/eval/<checkpoint>)")
    p.set_defaults(handler=_cmd_eval)

    p = sub.add_parser("sft", help="the supervised warm start alone (an SFT run of the Megatron trainer on "
                                   "this machine, cached in <sft.output>.d, sft.output linked to it); prints "
                                   "its folder")
    _add_config_args(p)
    p.set_defaults(handler=_cmd_sft)

    p = sub.add_parser("submit", help="validate, write the run folder and submit to Slurm")
    _add_config_args(p)
    p.add_argument("--dry-run", action="store_true",
                   help="write the run folder and sbatch script and print the script; submit nothing")
    p.add_argument("--plain", action="store_true",
                   help="submit the plain sbatch template (sbatch/) with sbatch instead of submitit")
    p.set_defaults(handler=_cmd_submit)

    p = sub.add_parser("run-slurm", help="inside a Slurm allocation: run the job of a run folder "
                                         "(what hpcrl submit's job and the sbatch/ templates run)")
    p.add_argument("config", metavar="RUN/config.yaml", help="the run folder's resolved config")
    p.set_defaults(handler=_cmd_run_slurm)

    p = sub.add_parser("sweep", help="submit a sweep as one Slurm job array; --report / --resubmit a sweep "
                                     "folder",
                       description="hpcrl sweep SWEEP.yaml [key=value ...] [--dry-run]: validate every "
                                   "point, write one run folder per point under run.output_dir/<run.name>/ "
                                   "and submit one Slurm job array. hpcrl sweep --report SWEEP_FOLDER: write "
                                   "report.csv and report.png. hpcrl sweep --resubmit SWEEP_FOLDER [--points "
                                   "NAME ...]: resubmit failed (or the named) points as a new array.")
    p.add_argument("sweep", metavar="SWEEP.yaml|SWEEP_FOLDER",
                   help="a run config with a sweep: section; with --report/--resubmit the sweep folder")
    p.add_argument("overrides", metavar="key=value", nargs="*", help="dotted overrides of the base config")
    p.add_argument("--dry-run", action="store_true",
                   help="write the folders, sweep.json and the array script and print the script; submit "
                        "nothing")
    p.add_argument("--report", action="store_true",
                   help="write report.csv and report.png (reward curves) into SWEEP_FOLDER")
    p.add_argument("--resubmit", action="store_true",
                   help="resubmit the points of SWEEP_FOLDER that ended FAILED/TIMEOUT/CANCELLED/NODE_FAIL/"
                        "OUT_OF_MEMORY, or that Slurm no longer knows and did not finish (a task that never "
                        "started), or those of --points, as a new job array")
    p.add_argument("--points", metavar="NAME[,NAME...]", action="append",
                   help="with --resubmit: the points to resubmit (repeat the option or join names with ',')")
    p.set_defaults(handler=_cmd_sweep)

    p = sub.add_parser("status", help="table of runs: Slurm state, rollout id, last reward, attempts")
    p.add_argument("run", metavar="RUN", nargs="?",
                   help="run folder, run name, a folder of runs, or a sweep folder or name (one row per "
                        "point; default: every run under --output-dir)")
    _add_output_dir(p)
    p.set_defaults(handler=_cmd_status)

    p = sub.add_parser("logs", help="print the newest attempt's logs of a run (--wandb-sync: upload its "
                                    "offline W&B runs)")
    p.add_argument("run", metavar="RUN", help="run folder or run name")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing until the job ends")
    p.add_argument("--wandb-sync", action="store_true",
                   help="instead of printing logs, upload the run's offline W&B runs "
                        "(RUN/wandb/offline-run-*, wandb.mode=offline) with wandb sync, from a node with "
                        "internet")
    _add_output_dir(p)
    p.set_defaults(handler=_cmd_logs)

    p = sub.add_parser("cancel", help="cancel a run's Slurm job, or every job of a sweep (scancel)",
                       description="hpcrl cancel RUN: scancel the run's job. hpcrl cancel "
                                   "SWEEP_FOLDER [--points NAME ...]: print, then scancel, every job array "
                                   "(and het job) of the sweep with a point queued or running, or only the "
                                   "named points' jobs.")
    p.add_argument("run", metavar="RUN|SWEEP_FOLDER",
                   help="run folder or run name, or a sweep folder or name")
    p.add_argument("--points", metavar="NAME[,NAME...]", action="append",
                   help="with a sweep: the points to cancel (repeat the option or join names with ',')")
    p.add_argument("--dry-run", action="store_true", help="print what would be cancelled; cancel nothing")
    p.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                   help="with a sweep: wait up to this long for the cancelled tasks to end (default 60)")
    _add_output_dir(p)
    p.set_defaults(handler=_cmd_cancel)

    p = sub.add_parser("convert", help="convert model formats")
    conv = p.add_subparsers(dest="kind", metavar="KIND", required=True)
    c = conv.add_parser("gguf-to-hf", help="GGUF file (or the name 'smollm2') -> HF folder")
    c.add_argument("src", metavar="SRC")
    c.add_argument("dst", metavar="DST")
    c = conv.add_parser("mcore-to-hf", help="hpcrl (Megatron) checkpoint -> HF folder the engines can serve")
    c.add_argument("src", metavar="CHECKPOINT", help="an iter_XXXXXXX folder, or a run folder (its newest)")
    c.add_argument("dst", metavar="DST")
    c.add_argument("--hf-base", default=None,
                   help="HF folder with the base config + tokenizer (default: the run's model, from its config)")
    c.add_argument("--dtype", default=None, help="dtype of the written tensors (default: as trained)")
    c.add_argument("--fp8", action="store_true",
                   help="linear weights in block-fp8 (128x128, float32 scales: what weights.rollout_dtype=fp8 "
                        "engines serve); embeddings, norms and routers stay in --dtype")
    c = conv.add_parser("mcore-to-peft", help="a LoRA run's checkpoint -> PEFT adapter folder "
                        "(adapter_config.json + adapter_model.safetensors)")
    c.add_argument("src", metavar="CHECKPOINT", help="an iter_XXXXXXX folder, or a run folder (its newest)")
    c.add_argument("dst", metavar="DST")
    c.add_argument("--hf-base", default=None,
                   help="the base HF folder the adapters apply to (default: the run's model, from its config)")
    p.set_defaults(handler=_cmd_convert)

    sub.add_parser("serve", add_help=False,
                   help="start the rollout engine server (SGLang-style flags: --model-path, --port, ...)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``hpcrl``. Returns the exit status (0 success, 2 config/usage error or not implemented).

    ``argv`` defaults to ``sys.argv[1:]``. ConfigError is printed as one line on stderr (exit 2).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "serve":
            return _cmd_serve(argv[1:])
        parser = build_parser()
        try:
            ns = parser.parse_args(argv)
        except SystemExit as e:  # --help, --version, usage errors
            return e.code if isinstance(e.code, int) else (EXIT_OK if e.code is None else EXIT_ERROR)
        if ns.command is None:
            parser.print_help(sys.stderr)
            return EXIT_ERROR
        return ns.handler(ns)
    except ConfigError as e:
        _err(str(e))
        return EXIT_ERROR
    except KeyboardInterrupt:
        _err("hpcrl: interrupted")
        return 130


def console_main() -> None:
    """The ``hpcrl`` executable (console script and ``python -m hpcrl``): :func:`main`, then exit with its
    status without the interpreter's last full garbage collection (:func:`hpcrl.procs.skip_final_collection`:
    ~2 s at the end of a run)."""
    code = main()
    from hpcrl.procs import skip_final_collection

    skip_final_collection()
    sys.exit(code)


if __name__ == "__main__":
    console_main()
