"""Workloads: what a step's samples are and how they are made, scored, packed, trained on and evaluated.

The pipeline reaches a workload through the ``Workload`` protocol (:mod:`runtime.workloads.base`,
with :func:`~runtime.workloads.base.workload_for`). Today one, the LLM workload (``llm/``).
"""
