"""The ``hpcrl`` command line: validate, version, error reporting, and the wiring of every subcommand."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hpcrl
from hpcrl import cli

REPO = Path(__file__).resolve().parents[2]
M = "model: {create: tiny-qwen2}\n"


def hpcrl_cmd() -> list[str]:
    """The installed console script next to the interpreter, else ``python -m hpcrl``."""
    script = Path(sys.executable).with_name("hpcrl")
    return [str(script)] if script.exists() else [sys.executable, "-m", "hpcrl"]


def run_cli(args: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(hpcrl_cmd() + args, cwd=cwd, capture_output=True, text=True, timeout=120, env=env,
                          check=False)


# ------------------------------------------------------------------------------------------------------------
# Real subprocesses: the console script
# ------------------------------------------------------------------------------------------------------------

def test_version_subprocess():
    out = run_cli(["--version"])
    assert out.returncode == 0 and out.stdout.strip() == f"hpcrl {hpcrl.__version__}"


def test_python_dash_m_hpcrl():
    out = subprocess.run([sys.executable, "-m", "hpcrl", "--version"], capture_output=True, text=True,
                         timeout=60, cwd=REPO, check=False)
    assert out.returncode == 0 and out.stdout.strip() == f"hpcrl {hpcrl.__version__}"


@pytest.mark.parametrize("name", ["quickstart.yaml", "smollm2-arith.yaml"])
def test_validate_shipped_configs_subprocess(name):
    out = run_cli(["validate", f"configs/{name}"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"OK: configs/{name}"
    prompts = {"quickstart.yaml": 16, "smollm2-arith.yaml": 8}[name]
    assert any(line.strip().startswith("rollout:") and f" {prompts} prompts x 8 samples" in line for line in lines)


CLI_BAD = [
    (M + "rollout: {batch_sise: 8}\n", [], "rollout.batch_sise"),
    (M + "rollout: {batch_size: '8'}\n", [], "rollout.batch_size"),
    (M + "run: {mode: async}\n", [], "run.mode"),
    ("model: {path: /nonexistent/hpcrl-model}\n", [], "model.path"),
    (M + "slurm: {signal: USR2-120}\n", [], "slurm.signal"),
    ("rollout:\n  batch_size: [8\n", [], "<file>"),
    (M, ["rollout.top_p=1.5"], "rollout.top_p"),
    (M, ["slurm.extra_sbatch=[a,b"], "slurm.extra_sbatch"),
    (M + "rollout: {reward_function: nonexistent_hpcrl_pkg.rm.score}\n", [], "rollout.reward_function"),
]


@pytest.mark.parametrize("text,overrides,field", CLI_BAD, ids=[c[2] for c in CLI_BAD])
def test_validate_bad_config_subprocess(tmp_path, text, overrides, field):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    out = run_cli(["validate", str(cfg), *overrides], cwd=tmp_path)
    assert out.returncode == 2
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: {field}="), out.stderr


def test_run_with_bad_config_subprocess(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(M + "train: {global_batch_size: 60}\n")
    out = run_cli(["run", str(cfg)], cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().startswith("config error: train.global_batch_size=60:")


# ------------------------------------------------------------------------------------------------------------
# In process: main(argv)
# ------------------------------------------------------------------------------------------------------------

def test_version_in_process(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"hpcrl {hpcrl.__version__}"


def test_no_command_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "validate" in capsys.readouterr().err


def test_usage_error_returns_2(capsys):
    assert cli.main(["validate"]) == 2
    assert "CONFIG" in capsys.readouterr().err


def test_validate_ok_with_overrides(tmp_path, capsys):
    cfg = tmp_path / "ok.yaml"
    cfg.write_text(M)
    assert cli.main(["validate", str(cfg), "rollout.batch_size=16", "sglang.enable_memory_saver=true"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: {cfg}\n") and "16 prompts x 8 samples" in out and "global batch 128" in out


@pytest.mark.parametrize("target, window, line", [
    ("0.4", 3, "sft:       until greedy accuracy (mean of the last 3 evals) >= 0.4 (eval every 10 steps, every 2 "
     "from 0.1), at most 3000 steps"),
    ("0.4", 1, "sft:       until greedy accuracy >= 0.4 (eval every 10 steps, every 2 from 0.1), at most 3000 steps"),
    ("null", 1, "sft:       eval every 10 steps, 3000 steps, batch 256"),  # the near-target interval needs a target
])
def test_validate_summarizes_the_sft_stop(capsys, target, window, line):
    argv = ["validate", str(REPO / "configs" / "quickstart.yaml"), f"sft.target_accuracy={target}",
            f"sft.target_window={window}"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert line in out and "warm start on the Megatron trainer" in out


def test_validate_summarizes_an_sft_run(capsys):
    """``run.mode: sft``: the run is the SFT recipe (its steps, data and layout), no rollout or algorithm."""
    argv = ["validate", str(REPO / "configs" / "quickstart.yaml"), "run.mode=sft", "sft.steps=40"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "(sft, colocate), 40 SFT steps" in out and "train:     micro batch 64, fp32, tp1" in out
    assert "rollout:" not in out and "algorithm:" not in out and ": this run (Megatron trainer)" in out


def test_validate_print_config_is_loadable(tmp_path, capsys):
    from hpcrl.validate import load_and_check

    assert cli.main(["validate", str(REPO / "configs" / "quickstart.yaml"), "--print-config"]) == 0
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(capsys.readouterr().out)
    assert load_and_check(dumped) == load_and_check(REPO / "configs" / "quickstart.yaml")


def test_validate_no_check_files(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {path: /nonexistent/hpcrl-model}\n")
    assert cli.main(["validate", str(cfg)]) == 2
    assert cli.main(["validate", "--no-check-files", str(cfg)]) == 0
    assert capsys.readouterr().out.startswith("OK:")


@pytest.mark.parametrize("argv,msg", [
    (["sweep", "configs/nope.yaml"], "config error: <file>='configs/nope.yaml': no such config file"),
    (["sweep", "configs/nope", "--report"], "not a sweep folder"),
    (["sweep", "some/folder", "train.lr=1.0", "--report"], "no key=value overrides"),
    (["sweep", "configs/quickstart.yaml", "--points", "a"], "--points only goes with --resubmit"),
])
def test_sweep_usage_errors_exit_2(argv, msg, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and len(err.strip().splitlines()) == 1


def test_sft_needs_output(capsys):
    argv = ["sft", str(REPO / "configs" / "quickstart.yaml"), "sft.enabled=false", "sft.output="]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith("config error: sft.output=''")


def test_serve_passes_argv_through_to_the_engine(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--model-path", "m", "--port", "30001", "--enable-memory-saver", "-h"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--model-path" in out and "--api-key-file" in out and "--enable-deterministic-inference" in out


def test_convert_mcore_to_hf_without_checkpoint_fails_cleanly(tmp_path, capsys):
    out = run_cli(["convert", "mcore-to-hf", str(tmp_path), str(tmp_path / "hf")])
    assert out.returncode != 0 and "neither a checkpoint nor a run folder" in out.stderr


def test_convert_needs_a_kind(capsys):
    assert cli.main(["convert"]) == 2


def test_convert_finds_a_relative_base_from_the_folder_the_run_started_in(tmp_path, monkeypatch):
    """A run config's ``model.path: .cache/models/x`` is relative to where ``hpcrl run`` ran; ``convert`` run
    from another folder finds it through the checkpoint's place (``LAUNCH/runs/NAME/checkpoints/iter_N``)."""
    from hpcrl.convert import _launch_relative

    launch = tmp_path / "launch"
    (launch / ".cache" / "models" / "x").mkdir(parents=True)
    ckpt = launch / "out" / "runs" / "q" / "checkpoints" / "iter_0000003"
    ckpt.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    base = Path(".cache/models/x")
    assert _launch_relative(base, ckpt, "out/runs") == launch / base
    assert _launch_relative(base, ckpt, str(launch / "out" / "runs")) == base  # absolute output_dir: unknown
    assert _launch_relative(launch / base, ckpt, "out/runs") == launch / base  # absolute: kept
    monkeypatch.chdir(launch)
    assert _launch_relative(base, ckpt, "out/runs") == base  # exists from here: kept as given


def test_run_refuses_sglang_engines_where_sglang_does_not_import():
    """`hpcrl run` starts its engines on this machine: SGLang engines whose server cannot import (in the
    engines' environment, ``rollout.engine_env``) are one config line before anything starts (seen on an
    H200: "engine exited with code 1", the reason in the engine's log)."""
    from hpcrl.config import Config, ConfigError
    from hpcrl.launch_local import check_local_engine
    from tests import sglang_cpu

    cfg = Config()
    cfg.rollout.engine = "cpu"
    check_local_engine(cfg)
    cfg.rollout.engine = "sglang"
    cfg.rollout.engine_env = {"PYTHONPATH": "/nonexistent"}  # .venv has SGLang's wheel, not its CPU runtime
    with pytest.raises(ConfigError) as e:
        check_local_engine(cfg)
    assert e.value.field == "rollout.engine" and "\n" not in str(e.value)
    assert "cannot import" in str(e.value) and "pybase64" in str(e.value) and "rollout.engine=cpu" in str(e.value)
    if sglang_cpu.available():  # with the runtime tests/sglang_cpu installs: nothing to say
        cfg.rollout.engine_env = sglang_cpu.engine_env()
        check_local_engine(cfg)


def test_run_refuses_fp8_sglang_engines_on_a_cpu_without_amx(monkeypatch):
    """SGLang's fp8 method on a CPU asserts AMX ('Fp8LinearMethod on CPU requires that CPU has AMX support',
    seen at its start on this AVX2 EPYC) and takes no float32 activations: one line before anything starts."""
    from hpcrl.config import Config, ConfigError
    from hpcrl.launch_local import check_local_engine
    from hpcrl.rollout import engines

    cfg = Config()
    cfg.rollout.engine, cfg.weights.rollout_dtype = "sglang", "fp8"
    monkeypatch.setattr(engines, "on_gpu", lambda: False)
    monkeypatch.setattr(engines, "amx_tile_supported", lambda: False)
    with pytest.raises(ConfigError, match="this CPU has no AMX") as e:
        check_local_engine(cfg)
    assert e.value.field == "weights.rollout_dtype"
    monkeypatch.setattr(engines, "amx_tile_supported", lambda: True)
    with pytest.raises(ConfigError, match="would run float32") as e:
        check_local_engine(cfg)
    assert e.value.field == "model.dtype"


def test_run_refuses_the_cpu_optimizer_offload_on_a_machine_without_a_gpu(monkeypatch):
    """megatron-core's CPU optimizer offload opens CUDA streams when the trainer is built: a local run with it
    on a CPU machine is one config line before anything starts (it failed at the trainer's build with "Torch
    not compiled with CUDA enabled"); where a GPU device node exists nothing is said."""
    from hpcrl import procs
    from hpcrl.config import Config, ConfigError
    from hpcrl.launch_local import check_local_trainer

    cfg = Config()
    check_local_trainer(cfg)  # no offload: nothing to say
    cfg.megatron = {"optimizer_cpu_offload": True}
    monkeypatch.setattr(procs, "cuda_possible", lambda *a: False)
    with pytest.raises(ConfigError) as e:
        check_local_trainer(cfg)
    assert e.value.field == "megatron.optimizer_cpu_offload" and "\n" not in str(e.value)
    assert "megatron.optimizer_cpu_offload=false" in str(e.value)
    monkeypatch.setattr(procs, "cuda_possible", lambda *a: True)
    check_local_trainer(cfg)


def test_the_hpcrl_process_exits_without_a_last_full_collection():
    """``hpcrl`` (``python -m hpcrl`` and the console script) freezes the heap once its command returned
    (:func:`hpcrl.procs.skip_final_collection`), its exit status unchanged; ``cli.main`` called in a process
    that goes on (this one) does not."""
    probe = ("import atexit, gc, sys; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0)); "
             "sys.argv = ['hpcrl', '{}']; import hpcrl.__main__")
    for command, code in (("--version", 0), ("no-such-command", 2)):
        out = subprocess.run([sys.executable, "-c", probe.format(command)], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == code and "frozen True" in out.stdout, (out.stdout, out.stderr[-500:])
    import gc

    assert cli.main(["--version"]) == 0 and gc.get_freeze_count() == 0
    console = Path(sys.executable).with_name("hpcrl").read_text()
    assert "console_main" in console  # the installed script goes through it too


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "glm-4.5-air", "glm-4.5", "deepseek-v3"])
def test_validate_plan_estimates_a_layout_from_config_json_alone(name, capsys):
    """Issue #54 point 6: with only the model's published ``config.json`` (``configs/cluster/models/``, no
    weights), ``hpcrl validate`` stops at "no weights"; ``--plan`` checks the rest and prints the layout's
    per-GPU estimate, so a layout can be planned before hundreds of GB are fetched."""
    cluster = Path(__file__).resolve().parents[2] / "configs" / "cluster"
    args = ["validate", str(cluster / f"{name}.yaml"), f"model.path={cluster / 'models' / name}"]
    assert cli.main(args) == 2
    assert "no weights (no *.safetensors file)" in capsys.readouterr().err
    assert cli.main([*args, "--plan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"OK: {cluster / name}.yaml (plan: the model's weights not checked")
    assert "  trainer:   tp" in out and " sp pp" in out and "parameters per GPU" in out
    assert "  engine:    " in out
