"""The LLM workload's consistency probe, and :class:`PublishedPolicy`: the policy's module tree with no
weights of its own, through which the probe and the async evaluator read the weight service's kept
versions in place instead of building a policy copy each."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from runtime.models.lora import adapter_state
from runtime.samples import Sample
from runtime.spec import RunSpec

State = dict[str, torch.Tensor]


class PublishedPolicy:
    """The policy's modules with parameters on the ``meta`` device (no storage), on ``device``.

    :meth:`bind` makes a published version's tensors the parameters (``load_state_dict(assign=True)``):
    tensors already on ``device`` in the model's dtype are used as they are — the weight service's kept
    versions live in host memory, so a host-side reader copies nothing. Only non-persistent buffers
    (rotary frequencies: a few KB) are materialised, on ``device``. Bound tensors are read, never
    written; they stay alive while bound even when the service drops their version (reference counts).
    """

    def __init__(self, model_spec: Any, device: torch.device | str, seed: int = 0):
        self.device = torch.device(device)
        # With LoRA a version is its adapters: they are copied into a model of its own holding the frozen base
        # (built as the trainer built it, from ``seed``), a copy of the base rather than of every version.
        self.lora = model_spec.lora is not None
        self._slots: (
            State  # what a version fills: meta tensors (bound in place), or with LoRA the adapters (copied into)
        )
        if self.lora:
            from runtime.models import build_policy

            self.model = build_policy(model_spec, self.device, seed=seed)[0].eval().requires_grad_(False)
            self._slots = adapter_state(self.model.state_dict())
            return
        model = _skeleton(model_spec, self.device.type)
        _materialise_buffers(model, self.device)
        self.model = model.eval().requires_grad_(False)
        self._slots = dict(model.state_dict())  # meta tensors: what release() binds back

    def bind(self, state: State) -> Any:
        """Make ``state``'s tensors the model's parameters (with LoRA: copy its adapters in); returns the model."""
        missing, unknown = sorted(set(self._slots) - set(state)), sorted(set(state) - set(self._slots))
        if missing or unknown:
            raise ValueError(
                f"published weights do not fit model.builtin/model.path: missing {missing[:5]}, unknown {unknown[:5]}"
            )
        if self.lora:
            with torch.no_grad():
                for name, tensor in state.items():
                    self._slots[name].copy_(tensor)
            return self.model
        # .to() returns the tensor itself when device and dtype already match: no copy
        tensors = {k: state[k].to(device=self.device, dtype=meta.dtype) for k, meta in self._slots.items()}
        self.model.load_state_dict(tensors, assign=True)
        return self.model

    def release(self) -> None:
        """Let go of the bound tensors (the parameters are storage-less again; LoRA's copies stay)."""
        if not self.lora:
            self.model.load_state_dict(self._slots, assign=True)

    @contextmanager
    def bound(self, state: State) -> Iterator[Any]:
        """The model with ``state`` bound for the block; released after it."""
        try:
            yield self.bind(state)
        finally:
            self.release()


def _skeleton(model_spec: Any, device_type: str) -> Any:
    """The policy's module tree on the ``meta`` device, as ``runtime.models.build_policy`` builds it in the
    implementation ``model.implementation`` gives (``runtime.models.implementation``)."""
    from runtime.models import DTYPES, CharTokenizer, builtin_config, check_model_path
    from runtime.models.hf_files import plain_config
    from runtime.models.implementation import choose_implementation
    from runtime.models.loading import build_builtin, plain_decoder, transformers_builtin

    dtype = DTYPES[model_spec.dtype]
    transformers_ = choose_implementation(model_spec, device_type) == "transformers"
    attention = model_spec.attn_implementation
    if model_spec.path:
        path = check_model_path(model_spec.path)
        plain = None if transformers_ else plain_config(path)
        if plain is not None:  # as load_checkpoint builds it
            with torch.device("meta"):
                return plain_decoder(plain, dtype)
        from transformers import AutoConfig, AutoModelForCausalLM  # heavy import, only for transformers

        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        kwargs = {"attn_implementation": attention} if attention else {}
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    tok = CharTokenizer()  # a built-in architecture always takes the char vocabulary
    with torch.device("meta"):
        if transformers_:
            config = builtin_config(model_spec.builtin, tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id)
            return transformers_builtin(config.replace(dtype=str(dtype).removeprefix("torch.")), dtype, attention)
        return build_builtin(model_spec.builtin, dtype, tok)


def _materialise_buffers(model: Any, device: torch.device) -> None:
    """Rebuild, on ``device``, each module holding a non-persistent buffer (computed from the config, never
    saved: rotary frequencies); on ``meta`` they would have no values."""
    persistent = set(model.state_dict())
    owners = {name.rpartition(".")[0] for name, _ in model.named_buffers() if name not in persistent}
    for path in sorted(owners):
        meta = model.get_submodule(path)
        if not hasattr(meta, "config"):
            raise ValueError(f"model: cannot rebuild the buffers of {path} ({type(meta).__name__}) without its config")
        real = type(meta)(meta.config).to(device)
        for name, buf in meta.named_buffers(recurse=False):  # the dtype the full model gives them
            setattr(real, name, getattr(real, name).to(buf.dtype))
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, real)


class ConsistencyProbe:
    """Engine vs trainer log-probabilities on samples older than the trainer's weights.

    The trainer can compare its log-probs with the engine's only on samples generated by its
    current weights; in async mode nearly every sample is a version or more behind, so that
    comparison would mix numerical mismatch with policy drift. The probe re-scores up to
    ``max_samples`` samples of one version with *that version's* weights, read where the weight
    service keeps them (a :class:`PublishedPolicy` on ``device``: no policy copy), using the
    trainer's scoring function.

    A sample whose generation straddled a weight update has a prefix of tokens from its first
    version and the rest from newer ones (whose attention read cache entries the older weights
    wrote, which no single forward reproduces); only that prefix is compared — it was computed,
    prompt included, entirely by the first version.
    """

    def __init__(self, spec: RunSpec, device: torch.device, max_samples: int):
        self.policy = PublishedPolicy(spec.model, device, seed=spec.seed)
        self.device = self.policy.device
        self.max_samples = max_samples
        self.temperature = spec.rollout.temperature if spec.rollout.temperature > 0 else 1.0

    @torch.no_grad()
    def measure(self, samples: list[Sample], weights: Any) -> dict[str, float]:
        from runtime.metrics import consistency_metrics
        from runtime.models import token_logprobs

        kept = set(weights.versions())
        usable = [s for s in samples if s.versions and s.version in kept]
        if not usable:
            return {}
        version = max(s.version for s in usable)
        picked = [s for s in usable if s.version == version][: self.max_samples]
        # the first version's prefix of each response (versions never decrease along a response)
        prefix = [next((t for t, v in enumerate(s.versions) if v != version), len(s.versions)) for s in picked]
        # one right-padded forward; positions count real tokens, as in the trainer's scoring
        rows = [s.prompt_ids + s.response_ids[:n] for s, n in zip(picked, prefix, strict=True)]
        width = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        # released at once: a version the service drops later is not kept alive by the probe
        with self.policy.bound(weights.state(version)) as model:
            logp = token_logprobs(model, ids.to(self.device), mask.to(self.device), temperature=self.temperature)
        engine, trainer = [], []
        for i, (s, n) in enumerate(zip(picked, prefix, strict=True)):
            start = len(s.prompt_ids) - 1
            trainer.append(logp[i, start : start + n].tolist())
            engine.append(s.logprobs[:n])
        return consistency_metrics(engine, trainer)
