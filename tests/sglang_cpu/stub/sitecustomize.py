"""Workaround 6 of :mod:`tests.sglang_cpu` (imported at start-up by every SGLang server process of the tests, whose
``PYTHONPATH`` holds this folder): pinned host memory becomes ordinary memory where torch has no accelerator.

SGLang 0.5.23's LoRA layers and its ``torch_native`` LoRA backend allocate their index tensors with
``pin_memory=True`` (``srt/lora/layers.py``, ``srt/lora/backend/torch_backend.py``), which torch refuses on a
machine without CUDA (``RuntimeError: pin_memory=True requires a CUDA or other accelerator backend``): an engine
launched with ``--enable-lora`` dies at start. Pinning only speeds host-to-device copies, of which a CPU server
makes none, so here ``Tensor.pin_memory`` returns the tensor and the factories drop the keyword. Nothing changes
where CUDA is present (this file is test infrastructure and never reaches a GPU node anyway).
"""

import torch

if not torch.cuda.is_available():
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

    def _unpinned(factory):
        def make(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)
        return make

    for _name in ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like", "zeros_like"):
        setattr(torch, _name, _unpinned(getattr(torch, _name)))
