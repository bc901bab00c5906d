"""hpcrl.offload's trainer adapters without a GPU: the no-op adapter off CUDA, and the one-line refusal when
colocated GPU runs lack torch-memory-saver (seen on an H100 as a ModuleNotFoundError traceback before)."""

from __future__ import annotations

import importlib.util

import pytest

from hpcrl.config import ConfigError
from hpcrl.offload import TorchMemorySaverTrainerMemory, TrainerMemory, create_trainer_memory


def test_without_cuda_the_trainer_adapter_does_nothing():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU path")
    memory = create_trainer_memory(colocate=True)
    assert type(memory) is TrainerMemory
    memory.offload()
    memory.onload()


@pytest.mark.skipif(importlib.util.find_spec("torch_memory_saver") is not None,
                    reason="torch-memory-saver is installed here")
def test_missing_torch_memory_saver_is_one_config_line():
    with pytest.raises(ConfigError) as e:
        TorchMemorySaverTrainerMemory()
    text = str(e.value)
    assert e.value.field == "run.placement" and "\n" not in text
    assert "torch-memory-saver" in text and "run.placement=disaggregate" in text


def test_onloaded_brings_an_offloaded_trainer_back_for_the_block_only():
    """A checkpoint save between the weight sync and the next train step runs inside ``onloaded()``."""
    events = []

    class Recording(TrainerMemory):
        def offload(self):
            super().offload()
            events.append("offload")

        def onload(self):
            super().onload()
            events.append("onload")

    memory = Recording()
    with memory.onloaded():  # not offloaded: nothing to do
        assert not memory.offloaded
    assert events == []
    memory.offload()
    with memory.onloaded():
        assert not memory.offloaded
    assert memory.offloaded and events == ["offload", "onload", "offload"]
    with pytest.raises(RuntimeError), memory.onloaded():
        raise RuntimeError("save failed")
    assert memory.offloaded  # offloaded again even when the block raised


def test_hook_env_preloads_torch_memory_saver_once_and_keeps_the_users_settings():
    """`hpcrl run` colocated on CUDA restarts itself with this environment (the H200 run of 2026-11-26 used it
    by hand): the hook first in LD_PRELOAD, TMS_INIT_ENABLE(_CPU_BACKUP)=1 unless the user set them."""
    from hpcrl.offload import hook_env, restart_with_hook

    hook = "/site/torch_memory_saver_hook_mode_preload_cu13.abi3.so"
    env = hook_env(hook, {"PATH": "/bin"})
    assert env == {"PATH": "/bin", "LD_PRELOAD": hook, "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
    env = hook_env(hook, {"LD_PRELOAD": "/lib/libmine.so", "TMS_INIT_ENABLE_CPU_BACKUP": "0"})
    assert env["LD_PRELOAD"] == f"{hook}:/lib/libmine.so" and env["TMS_INIT_ENABLE_CPU_BACKUP"] == "0"
    assert hook_env(hook, {"LD_PRELOAD": env["LD_PRELOAD"]}) is None  # in place: no restart loop
    restart_with_hook(colocate=False)  # returns: nothing to do
