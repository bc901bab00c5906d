"""A data source plug-in (``rollout.data_source: plugins.data_source.ShortPromptsFirst``).

Called as ``cls(items, n_samples_per_prompt, seed=, shuffle=)``; the loop then asks it for groups
(``get_samples``), pushes held-back groups to it (``add_samples``) and checkpoints it (``state_dict`` /
``load_state_dict``), as slime's ``--data-source-path``. Subclassing the built-in keeps all of that, the exact
resume included, and changes only the order.
"""

from __future__ import annotations

import numpy as np

from hpcrl.data.source import DataSource


class ShortPromptsFirst(DataSource):
    """A one-line curriculum: the first epoch visits the prompts shortest first (ties in data order), later
    epochs in the built-in's seeded shuffle. The order depends only on the items, so a resumed run continues
    it exactly."""

    def epoch_order(self, epoch: int) -> np.ndarray:
        if epoch > 0:
            return super().epoch_order(epoch)
        return np.argsort([len(str(item["prompt"])) for item in self.items], kind="stable")
