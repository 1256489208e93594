"""Experiment trackers a run reports to beside its own reporters (``metrics.reporters``): TensorBoard,
MLflow, Weights & Biases.

One module per tracker (``tensorboard``, ``mlflow``, ``wandb``), each importing its library only when a run
asks for it; ``availability`` (what the spec checks at submit), ``params`` (the resolved spec as flat
parameters), ``background`` (a tracker on a thread of its own, whose failures become run events) and
``factory`` (the trackers a ``MetricsSpec`` names). Nothing here imports a tracker's library at import time.
"""
