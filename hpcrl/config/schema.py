"""The root of the schema: :class:`Config`, one field per section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpcrl.config.run import DataSection, ModelSection, RunSection, SFTSection
from hpcrl.config.rollout import RolloutSection
from hpcrl.config.critic import CriticSection
from hpcrl.config.train import AlgorithmSection, CheckpointSection, TrainSection
from hpcrl.config.weights import WeightsSection
from hpcrl.config.slurm import SlurmSection, SweepSection
from hpcrl.config.evaluation import EvalSection
from hpcrl.config.tracking import WandbSection


@dataclass
class Config:
    """A whole run. Section names are the YAML top-level keys."""

    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    sglang: dict[str, Any] = field(default_factory=dict)
    sft: SFTSection = field(default_factory=SFTSection)
    train: TrainSection = field(default_factory=TrainSection)
    megatron: dict[str, Any] = field(default_factory=dict)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    critic: CriticSection = field(default_factory=CriticSection)
    weights: WeightsSection = field(default_factory=WeightsSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    slurm: SlurmSection = field(default_factory=SlurmSection)
    sweep: SweepSection = field(default_factory=SweepSection)
    eval: EvalSection = field(default_factory=EvalSection)
    wandb: WandbSection = field(default_factory=WandbSection)
