"""hpcrl's CPU rollout engine: a small HTTP server on transformers that speaks SGLang's native protocol.

This is a *reference engine for CPUs and tests, not a fast server*. It serves the same endpoints, JSON fields
and semantics as SGLang's HTTP server (``/generate``, weight updates from disk / tensors / a torch.distributed
group, memory release and resume, pause and continue, abort, flush, health and info; see
``/work/shared/reference/cpu-stack.md`` section 3), so the rollout client, the router, weight sync and fault
handling are the same code on a laptop as on a GPU cluster running real SGLang. Generation is a plain
KV-cached batched decode with HF transformers in fp32 (or bf16): no paged attention, no CUDA graphs, no prefix
cache.

Modules, one job each:

- :mod:`hpcrl.engine.args`: command line flags (SGLang's names) and the resolved server arguments.
- :mod:`hpcrl.engine.protocol`: parsing ``/generate`` requests and building SGLang-shaped responses.
- :mod:`hpcrl.engine.sampling`: log-probs and sampling (temperature, top-k, top-p, min-p, seeded generators).
- :mod:`hpcrl.engine.scheduler`: the batching thread that owns the model (continuous batching over a KV
  cache).
- :mod:`hpcrl.engine.weights`: in-place weight updates and the torch.distributed weight-update groups.
- :mod:`hpcrl.engine.serialize`: the ``update_weights_from_tensor`` payload format (SGLang's
  ``MultiprocessingSerializer``), used by both sender and engine.
- :mod:`hpcrl.engine.memory`: the memory-saver adapter (no-op on CPU, torch-memory-saver on GPU).
- :mod:`hpcrl.engine.state`: SGLang's state rules (the weight-update session, idleness, the flush rule).
- :mod:`hpcrl.engine.generation`: generation as both front ends use it (read and parse a request, submit it,
  collect or stream its rows, abort them).
- :mod:`hpcrl.engine.native_server`: SGLang's native endpoints (``/generate``, weights, memory, health, info).
- :mod:`hpcrl.engine.openai_server`: OpenAI's endpoints (:mod:`hpcrl.engine.openai_api`: their shapes).
- :mod:`hpcrl.engine.server`: loads the model, assembles the aiohttp application from both front ends with
  authentication (:mod:`hpcrl.engine.auth`), serves it, and ``main``
  (:mod:`hpcrl.engine.httplog`: aiohttp's log of refused requests).

Start it with ``python -m hpcrl.engine.server --model-path DIR --port 30000`` (or ``hpcrl serve ...``).
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the engine server (see :func:`hpcrl.engine.server.main`)."""
    from hpcrl.engine.server import main as _main

    return _main(argv)
