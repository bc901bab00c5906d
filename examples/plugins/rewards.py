"""A reward function plug-in (``rollout.reward_function: plugins.rewards.partial_credit``).

Signature: ``[async] def rm(cfg, sample) -> float | dict``; a dict needs a ``"reward"`` entry (the number the
filter, metrics and advantages read), its other entries are kept with the sample.
"""

from __future__ import annotations


def partial_credit(cfg, sample) -> dict:
    """1.0 for the exact answer, 0.25 when only its last digit is right, else 0.0; ``"exact"`` says which.

    ``sample.response`` is the decoded response text, ``sample.label`` the data row's label (a string)."""
    answer = sample.response.strip()
    label = str(sample.label).strip()
    if answer == label:
        return {"reward": 1.0, "exact": 1.0}
    last_digit_right = bool(answer) and answer[-1:] == label[-1:]
    return {"reward": 0.25 if last_digit_right else 0.0, "exact": 0.0}
