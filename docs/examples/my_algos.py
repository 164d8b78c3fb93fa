"""A user's own algorithm, outside prefzoo: ``python train.py algo=custom algo.target=my_algos:ChosenNLL``.

Chosen-only maximum likelihood on preference pairs (supervised fine-tuning on the preferred answers, with an
optional length-normalisation), the usual baseline of preference optimisation. It declares what it needs
(no reference, offline pairs, per-example losses) and implements ``loss``; prefzoo's loop does the rest.
"""

from dataclasses import dataclass

import torch

from prefzoo.algos import AlgoConfig, Algorithm, Declaration
from prefzoo.errors import ConfigError
from prefzoo.objective import mean_logps, sequence_logps
from prefzoo.types import LossOutput


@dataclass
class ChosenNLLConfig(AlgoConfig):
    name: str = "chosen_nll"
    length_normalise: bool = True  # mean log-prob per token instead of the sum
    weight: float = 1.0


class ChosenNLL(Algorithm):
    config_class = ChosenNLLConfig  # its algo= name is the config's: chosen_nll

    @staticmethod
    def validate_settings(cfg, objective):
        if cfg.weight <= 0:
            raise ConfigError(f"algo.weight={cfg.weight} must be > 0.")

    def declare(self):
        return Declaration(reference=False, aggregation="example_mean", progress_keys=("loss", "nll"))

    def loss(self, policy, batch, step):
        logps, _ = policy.logps(batch.chosen)
        mask = batch.chosen.completion_mask
        score = mean_logps(logps, mask) if self.cfg.length_normalise else sequence_logps(logps, mask)
        losses = -self.cfg.weight * score
        return LossOutput(losses, None, {"nll": float(-score.detach().mean())})
