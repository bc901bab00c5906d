"""SGLang 0.5.23's engine state rules, as the CPU engine enforces them: the weight-update session, idleness.

Read from SGLang's own server code (``srt/managers/scheduler_components/weight_updater.py``,
``scheduler_components/flush_wrapper.py``, ``srt/managers/scheduler.py``, ``srt/entrypoints/http_server.py``);
``tests/unit/test_sglang_conformance.py`` reads the same files from the installed wheel and fails when a rule
or a message here no longer matches, or SGLang gates another update.

The rules (each refusal is SGLang's status code and body):

1. **Weight-update session.** ``/update_weights_from_tensor`` and ``/update_weights_from_distributed``
   (:data:`SESSION_GATED`) run only between ``/begin_weight_update`` and ``/end_weight_update``; outside one
   they answer 400 ``{"success": false, "message": "<endpoint> must run between begin_weight_update() and
   end_weight_update()"}`` without touching the weights (the distributed one without receiving the
   broadcast). ``/update_weights_from_disk`` is not gated. A second begin while a session is open, and an end
   without one, are refused (400, :data:`NESTED_BEGIN`, :data:`END_WITHOUT_BEGIN`).
2. **Idle.** The engine is *fully idle* when no request runs (holds KV cache) and, unless generation is
   paused, none waits (SGLang's ``is_fully_idle(ignore_waiting=paused)``). ``/release_memory_occupation``
   needs it (SGLang asserts it, :data:`RELEASE_NOT_IDLE`: on SGLang a failed assertion kills the scheduler;
   the CPU engine answers 400 ``{"error": {"message": ...}}``, the body SGLang's handler would give).
3. **Flush.** ``/flush_cache`` needs the engine fully idle: 400 with :data:`FLUSH_FAILED` (or, with
   ``?timeout=``, after waiting that long for idleness, :data:`FLUSH_TIMED_OUT`). So does the flush that ends
   a weight update with ``flush_cache: true`` (the default): after a pause in mode ``in_place`` the running
   requests keep their KV cache, the flush fails, and the update answers 400 with :data:`UPDATE_NOT_FLUSHED`
   although the weights were loaded (the weight version is not changed then). A sync under ``in_place``
   therefore sends ``flush_cache: false``.
4. **Resume.** ``/resume_memory_occupation`` of a tag that was not released is refused (SGLang removes the tag
   from its set of released ones: a ``KeyError`` that kills its scheduler), :func:`resume_not_released`.
"""

from __future__ import annotations

from dataclasses import dataclass

SESSION_GATED = ("update_weights_from_tensor", "update_weights_from_distributed")
"""Update endpoints (without the slash) that SGLang refuses outside a weight-update session."""

SELECTORS = ("target", "draft", "all")
"""``selector`` of ``/begin_weight_update`` (and of the updates): which model runners a session covers."""

NESTED_BEGIN = "a weight-update session is already open; call end_weight_update() first"
END_WITHOUT_BEGIN = "no weight-update session is open; call begin_weight_update() first"
RELEASE_NOT_IDLE = "release_memory_occupation should be called only when server is idle."
FLUSH_FAILED = "Flush cache failed.\n"
FLUSH_TIMED_OUT = "Timed out waiting for idle state."
UPDATE_NOT_FLUSHED = ("Weights were updated, but the cache was not flushed because requests are still "
                      "running or queued. Retract or finish them, then call /flush_cache.")


def outside_session(endpoint: str) -> str:
    """SGLang's message for a gated update (``endpoint`` without the slash) outside a session."""
    return f"{endpoint} must run between begin_weight_update() and end_weight_update()"


def resume_not_released(tags: list[str]) -> str:
    """The CPU engine's message for resuming ``tags`` that are not released (SGLang raises KeyError)."""
    return (f"resume_memory_occupation: {tags} not released (SGLang 0.5.23 raises KeyError in its scheduler "
            "and dies here); release them first")


class SessionError(ValueError):
    """A session rule refused the call (``message`` is SGLang's text); nothing was changed."""


@dataclass
class WeightUpdateSession:
    """The engine's weight-update session (SGLang's ``_WeightUpdateSession``), owned by the scheduler thread.

    ``selector``: what ``begin`` named while open, else None (SGLang also records whether an update ran
    inside it, to finalise packed weights at the end; this engine has none). ``opened`` / ``closed``: counts
    over the engine's life (``/get_server_info``), so tests see that every sync opened and closed one.
    """

    selector: str | None = None
    opened: int = 0
    closed: int = 0

    @property
    def is_open(self) -> bool:
        return self.selector is not None

    def begin(self, selector: str = "all") -> None:
        """Open the session. Raises SessionError when one is open, ValueError for an unknown selector."""
        if selector not in SELECTORS:
            raise ValueError(f"invalid selector {selector!r}; expected 'target', 'draft', or 'all'")
        if self.is_open:
            raise SessionError(NESTED_BEGIN)
        self.selector = selector
        self.opened += 1

    def end(self) -> None:
        """Close the session. Raises SessionError when none is open."""
        if not self.is_open:
            raise SessionError(END_WITHOUT_BEGIN)
        self.selector = None
        self.closed += 1

    def require(self, endpoint: str) -> None:
        """Raise SessionError (SGLang's text) if ``endpoint`` is gated and no session is open."""
        if endpoint in SESSION_GATED and not self.is_open:
            raise SessionError(outside_session(endpoint))

    def state(self) -> dict:
        """``{"weight_update_session_open", "weight_update_sessions_opened",
        "weight_update_sessions_closed"}``."""
        return {"weight_update_session_open": self.is_open, "weight_update_sessions_opened": self.opened,
                "weight_update_sessions_closed": self.closed}
