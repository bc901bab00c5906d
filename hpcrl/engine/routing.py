"""Routed experts of a MoE model's forward passes, for SGLang's ``return_routed_experts``.

SGLang (``--enable-return-routed-experts``, request field ``return_routed_experts``) returns, per request,
``meta_info["routed_experts"]``: the base64 of an int32 array ``[len(prompt) + len(output) - 1, num_layers,
top_k]``, the experts each fed token was routed to in every MoE layer (every token the model saw: the prompt
and all output tokens but the last, which is never fed back). Rollout routing replay (R3, slime
``--use-rollout-routing-replay``) hands these to the trainer so that its forward routes like the engine did.

:class:`RoutedExperts` finds the routers of an HF model (transformers' ``*TopKRouter`` modules, which return
``(logits, weights, indices)``), records their ``indices`` while :meth:`RoutedExperts.recording` is active
and gives them back per batch position.
"""

from __future__ import annotations

import base64
import contextlib
from typing import Iterator, Optional

import numpy as np
import torch


class RoutedExperts:
    """Records the top-k expert ids of every MoE router of ``model`` during a forward pass.

    ``layers``: the number of MoE layers found (0 for a dense model: nothing is recorded). Use::

        with recorder.recording():
            model(input_ids=ids, ...)          # ids [batch, seq]
        experts = recorder.take(batch, seq)    # int32 [batch, seq, layers, top_k]
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = [m for name, m in model.named_modules()
                        if name.endswith("mlp.gate") and hasattr(m, "top_k") and hasattr(m, "num_experts")]
        self.layers = len(self.routers)
        self.top_k = int(self.routers[0].top_k) if self.routers else 0
        self._active = False
        self._seen: list[torch.Tensor] = []
        for router in self.routers:
            router.register_forward_hook(self._hook)

    def _hook(self, module, args, output) -> None:
        if self._active:
            self._seen.append(output[2].detach())  # indices [batch * seq, top_k]

    @contextlib.contextmanager
    def recording(self, enabled: bool = True) -> Iterator[None]:
        """Record the routers' choices within the block (a dense model or ``enabled=False``: nothing)."""
        self._seen = []
        self._active = enabled and self.layers > 0
        try:
            yield
        finally:
            self._active = False

    def take(self, batch: int, seq: int) -> Optional[torch.Tensor]:
        """The recorded choices as int32 ``[batch, seq, layers, top_k]`` (layer order), or None when nothing
        was recorded. Raises RuntimeError when a forward did not pass every router once."""
        seen, self._seen = self._seen, []
        if not seen:
            return None
        if len(seen) != self.layers:
            raise RuntimeError(f"recorded {len(seen)} router outputs for {self.layers} MoE layers")
        return torch.stack([s.reshape(batch, seq, self.top_k) for s in seen], dim=2).to(torch.int32)


def encode(rows: list[torch.Tensor], fed: int) -> str:
    """SGLang's ``meta_info["routed_experts"]``: the first ``fed`` of ``rows`` (each int32 ``[layers, top_k]``,
    one per fed token in order) as base64 of a C-ordered int32 array ``[fed, layers, top_k]``."""
    if fed <= 0:
        return ""
    arr = np.ascontiguousarray(torch.stack(rows[:fed]).numpy().astype(np.int32))
    return base64.b64encode(arr.tobytes()).decode("ascii")


def decode(text: str, tokens: int, layers: int, top_k: int) -> np.ndarray:
    """Inverse of :func:`encode` as slime reads it: int32 ``[tokens - 1, layers, top_k]`` for a sample of
    ``tokens`` tokens. Raises ValueError when the size does not match."""
    arr = np.frombuffer(base64.b64decode(text.encode("ascii")), dtype=np.int32)
    return arr.reshape(tokens - 1, layers, top_k)
