"""Tandem runtime: the RL engine (rollout, reward, training, evaluation, weight sync).

Pure PyTorch; never imports the platform (Django). ``runtime.spec`` imports
without torch so the control plane can validate submissions with it.
"""

__version__ = "0.1.0"
