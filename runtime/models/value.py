"""The PPO critic: a copy of the policy's transformer backbone with a scalar value head."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from runtime.models.logprobs import positions_from_mask
from runtime.models.lora import is_adapter_key, is_lora


class ValueModel(nn.Module):
    """values[b, t] = estimated return after token t. The head starts at zero so early values do not mislead GAE."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        param = next(backbone.parameters())
        self.head = nn.Linear(hidden_size, 1, dtype=param.dtype, device=param.device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_policy(cls, policy: Any) -> ValueModel:
        """A critic initialised from the policy's backbone (an independent copy; the policy is untouched).
        A LoRA policy's critic trains the copy's adapters and its head; the copied base stays frozen."""
        backbone = copy.deepcopy(policy.base_model)
        lora = is_lora(policy)
        for name, param in backbone.named_parameters():  # with LoRA the copied backbone trains its adapters
            param.requires_grad_(not lora or is_adapter_key(name))
        return cls(backbone, policy.config.hidden_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [B, T] -> values [B, T] (float32). No ``attention_mask``: rows may be packed sequences
        (``position_ids`` restarting at 0, as the policy reads them)."""
        if position_ids is None:  # without a mask either: one sequence per row
            position_ids = positions_from_mask(torch.ones_like(input_ids) if attention_mask is None else attention_mask)
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).last_hidden_state
        return self.head(hidden).squeeze(-1).float()
