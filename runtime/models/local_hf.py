"""A small Hugging Face model directory built here, offline: a byte-level BPE tokenizer trained on a text
corpus, with a Qwen-style chat template, and a randomly initialised Qwen2 causal LM.

It is the "real tokenizer" counterpart of the built-in models (which use the character tokenizer): the
directory loads through ``model.path`` (:func:`runtime.models.build_policy`), through
``transformers.AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained(DIR, local_files_only=True)`` as a
downloaded Qwen2.5 directory does (vLLM should too; not tried here), so tests, demos and the accelerator smoke
test exercise the BPE + chat-template path without any download. CLI: ``python -m runtime make-model``.
:func:`build_local_model_dir` is imported by the smoke test: keep its name and signature.

The tokenizer uses Qwen2's own pipeline (NFC, Qwen2's pre-tokenisation regex, then byte-level symbols),
because transformers 5 rebuilds any tokenizer of a ``qwen2`` model directory as its ``Qwen2Tokenizer`` from
the saved vocabulary and merges: with the same pipeline, the rebuilt tokenizer gives the ids it was trained
with. Special tokens, as Qwen2.5-Instruct names them: ``<|endoftext|>`` (pad, id 0), ``<|im_start|>``
(id 1) and ``<|im_end|>`` (eos, id 2: the end of an assistant turn, where generation stops); no bos.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from runtime.models.configs import MAX_POSITIONS

PAD_TOKEN = "<|endoftext|>"
TURN_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"  # ends an assistant turn in the template, so generation stops where a reply ends
SPECIAL_TOKENS = (PAD_TOKEN, TURN_START, EOS_TOKEN)  # ids 0, 1, 2
BYTE_ALPHABET = 256  # a byte-level BPE starts from one symbol per byte
MIN_VOCAB_SIZE = BYTE_ALPHABET + len(SPECIAL_TOKENS)
ARCHITECTURES = ("qwen2",)
ROLES = ("system", "user", "assistant")

# Qwen's turn format: <|im_start|>role\ncontent<|im_end|>\n per message, then the opening of the assistant's
# turn when a generation prompt is asked for. Unlike Qwen2.5's own template, no default system message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SUMMARY_FILE = "local_model.json"  # what was built, for a reader of the directory


def task_corpus(task: Any) -> list[str]:
    """The texts a tokenizer for ``task`` (a runtime.tasks.Task) should know: its train and eval prompts and answers, and the role
    names the chat template writes."""
    prompts = [*task.train_prompts(), *task.eval_prompts()]
    return [*ROLES, *(p.text for p in prompts), *(p.answer for p in prompts)]


def _qwen2_pre_tokenizer() -> Any:
    from tokenizers import Regex, pre_tokenizers

    # transformers' own constant: the rebuilt Qwen2Tokenizer splits with it too
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def train_bpe_tokenizer(corpus: Iterable[str], vocab_size: int, chat_template: str | None = CHAT_TEMPLATE) -> Any:
    """A ``transformers.PreTrainedTokenizerFast``: byte-level BPE trained on ``corpus`` up to ``vocab_size``
    tokens (fewer when the corpus runs out of pairs to merge), with the special tokens above and
    ``chat_template`` (Jinja, as tokenizer files carry it; None: none)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size: must be an integer >= {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} special tokens),"
            f" got {vocab_size!r}"
        )
    texts = list(corpus)
    if not all(isinstance(t, str) for t in texts):
        raise ValueError("corpus: every item must be a string")
    texts = [t for t in texts if t]
    if not texts:
        raise ValueError("corpus: no text to train the tokenizer on")
    raw = Tokenizer(models.BPE())
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = _qwen2_pre_tokenizer()
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte, so no text is ever unknown
        show_progress=False,
    )
    raw.train_from_iterator(texts, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=raw, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, extra_special_tokens=[TURN_START]
    )
    if chat_template is not None:
        hf.chat_template = chat_template
    return hf


def qwen2_config(
    tokenizer: Any, *, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, vocab_multiple: int
) -> Any:
    """A small Qwen2 config for ``tokenizer``: embedding rows rounded up to ``vocab_multiple`` (as released
    models pad theirs, so the model has ids no token uses), tied input and output embeddings."""
    from transformers import Qwen2Config

    sizes = {"hidden_size": hidden_size, "num_layers": num_layers, "num_heads": num_heads, "num_kv_heads": num_kv_heads}
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:  # rotary embeddings need an even head size
        raise ValueError(f"num_heads: hidden_size {hidden_size} must split into {num_heads} heads of even size")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_kv_heads: must divide num_heads {num_heads}, got {num_kv_heads}")
    rows = -(-len(tokenizer) // vocab_multiple) * vocab_multiple
    return Qwen2Config(
        vocab_size=rows,
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
    )


def build_local_model_dir(
    directory: str | Path,
    *,
    corpus: Iterable[str],
    vocab_size: int = 512,
    chat_template: str | None = CHAT_TEMPLATE,
    architecture: str = "qwen2",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_multiple: int = 64,
    seed: int = 0,
) -> Path:
    """Write a loadable HF model directory into ``directory`` (new or empty) and return its path.

    The tokenizer is trained on ``corpus`` (e.g. :func:`task_corpus`); the model is a Qwen2 causal LM
    initialised from ``seed`` without touching the global RNG (defaults: about 0.12 M parameters with a
    512-token vocabulary). Bad arguments raise a ValueError naming the argument, before anything is written.
    The tokenizer is trained the same way from the same corpus every time.
    """
    from transformers import AutoModelForCausalLM

    if architecture not in ARCHITECTURES:
        # Another model type would make transformers rebuild the tokenizer with that family's own pipeline.
        raise ValueError(f"architecture: only {', '.join(ARCHITECTURES)} is supported, got {architecture!r}")
    if isinstance(vocab_multiple, bool) or not isinstance(vocab_multiple, int) or vocab_multiple < 1:
        raise ValueError(f"vocab_multiple: must be a positive integer, got {vocab_multiple!r}")
    out = Path(directory).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"directory: {out} exists and is not an empty directory")
    tokenizer = train_bpe_tokenizer(corpus, vocab_size, chat_template)
    config = qwen2_config(
        tokenizer,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        vocab_multiple=vocab_multiple,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    summary = {
        "architecture": architecture,
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_tokens": len(tokenizer),
        "model_vocab_rows": config.vocab_size,
        "special_tokens": {"pad": PAD_TOKEN, "eos": EOS_TOKEN, "turn_start": TURN_START},
        "chat_template": chat_template is not None,
        "seed": seed,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return out
