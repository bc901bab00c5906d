"""Rollout: generation against the engines, dynamic filters and the rollout loop (slime ``slime/rollout``)."""
