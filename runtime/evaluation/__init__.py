"""Evaluation: the in-process background evaluator and the remote evaluator role."""
