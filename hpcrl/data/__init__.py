"""Prompt data: samples (``sample``), task generators with scorers (``tasks``), dataset files and the
train/eval split (``sources``), and the resumable source the rollout loop pulls groups from (``source``)."""
