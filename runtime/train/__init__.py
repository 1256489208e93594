"""Training: the trainer, the trainer group across ranks, the RL algorithms and SFT."""
