"""A generate function plug-in (``rollout.generate_function: plugins.generate.short_answers``).

Signature: ``async def generate(client, sample, sampling_params) -> Sample``: generate (or continue) one
sample's response in place (slime ``--custom-generate-function-path``). This one changes the sampling
parameters and hands over to the built-in :func:`hpcrl.rollout.generate.generate`.
"""

from __future__ import annotations

from hpcrl.rollout.generate import generate

MAX_ANSWER_TOKENS = 6
"""An addition answer is at most 4 digits and EOS: a budget of 6 tokens is plenty."""


async def short_answers(client, sample, sampling_params: dict):
    """The built-in generate with ``max_new_tokens`` capped at :data:`MAX_ANSWER_TOKENS`."""
    params = dict(sampling_params, max_new_tokens=min(sampling_params["max_new_tokens"], MAX_ANSWER_TOKENS))
    return await generate(client, sample, params)
