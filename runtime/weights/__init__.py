"""Weights: the trainer's versioned publication of policy weights and their broadcast to rollout processes."""
