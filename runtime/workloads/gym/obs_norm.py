"""Running observation normalisation, as the first layer of a network.

The statistics live in the network (buffers), not in the environment: sampling workers record raw
observations, the learner updates the statistics from the observations it trains on and publishes
them with the weights, so every worker and the evaluation agent normalise alike, and a checkpoint of
the learner holds them (``state_dict``).

Running mean and variance are combined batch by batch with the parallel formulae of Chan, Golub
and LeVeque 1979, *Updating Formulae and a Pairwise Algorithm for Computing Sample Variances*, in
float64. As in Gymnasium's ``RunningMeanStd`` the count starts at ``1e-4`` (mean 0, variance 1); as in
Stable-Baselines3's ``VecNormalize`` normalised values are clipped (at 10 by default).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ObservationNormalizer(nn.Module):
    """``clamp((obs - mean) / sqrt(var + eps), -clip, clip)``; statistics change only in :meth:`update`."""

    mean: Tensor
    var: Tensor
    count: Tensor

    def __init__(self, obs_dim: int, clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.clip = clip
        self.eps = eps
        self.register_buffer("mean", torch.zeros(obs_dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(obs_dim, dtype=torch.float64))
        self.register_buffer("count", torch.tensor(1e-4, dtype=torch.float64))

    def forward(self, obs: Tensor) -> Tensor:
        """``obs`` ``[..., D]`` float -> normalised ``[..., D]`` in ``obs``'s dtype."""
        scaled = (obs.to(torch.float64) - self.mean) / torch.sqrt(self.var + self.eps)
        return scaled.clamp(-self.clip, self.clip).to(obs.dtype)

    @torch.no_grad()
    def update(self, batch: Tensor) -> None:
        """Fold the observations ``batch`` ``[N, D]`` into the running mean and variance (Chan et al. 1979)."""
        batch = batch.reshape(-1, self.mean.shape[0]).to(torch.float64)
        n = batch.shape[0]
        if n == 0:
            return
        batch_mean = batch.mean(dim=0)
        batch_var = batch.var(dim=0, unbiased=False)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean.add_(delta * n / total)
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.var.copy_(m2 / total)
        self.count.copy_(total)
