"""Workloads: what a step's samples are and how they are made. Today one, the LLM workload (llm.py)."""
