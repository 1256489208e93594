"""Policy and critic models and tokenizers: the built-in architectures as a plain PyTorch decoder
(``decoder.py``, no transformers import), Hugging Face checkpoints (``model.path``) through transformers.

Public interface: :func:`build_policy`, :func:`save_hf`, :class:`ValueModel`,
:func:`token_logprobs`, the tokenizers, and :class:`ModelError`.
"""

from runtime.models.configs import BUILTIN_CONFIGS, builtin_config
from runtime.models.loading import DTYPES, ModelError, build_policy, check_model_path, save_hf
from runtime.models.logprobs import logprobs_from_logits, positions_from_mask, token_logprobs
from runtime.models.tokenizer import CharTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from runtime.models.value import ValueModel

__all__ = [
    "BUILTIN_CONFIGS",
    "DTYPES",
    "CharTokenizer",
    "HFTokenizer",
    "ModelError",
    "Tokenizer",
    "ValueModel",
    "build_policy",
    "builtin_config",
    "check_model_path",
    "load_tokenizer",
    "logprobs_from_logits",
    "positions_from_mask",
    "save_hf",
    "token_logprobs",
]
