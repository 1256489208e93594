"""Tokenizers with one small interface: ``encode``, ``decode``, ``eos_id``, ``pad_id``, ``bos_id``,
``stop_ids``, ``vocab_size``, ``save``.

:class:`CharTokenizer` is the built-in one for the synthetic tasks: one token
per printable ASCII character plus newline, and four specials. It saves itself
both as ``char_tokenizer.json`` (read back by :func:`load_tokenizer`) and as a
Hugging Face fast tokenizer (``tokenizer.json``), so a checkpoint directory
loads in transformers and vLLM too. :class:`HFTokenizer` wraps a model
directory's own tokenizer behind the same interface; its ``stop_ids`` add the end-of-sequence ids of the
directory's ``generation_config.json`` to the tokenizer's eos (Qwen2.5 lists ``<|im_end|>`` and
``<|endoftext|>`` there, and a chat-templated reply ends with the first).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

CHAR_FILE = "char_tokenizer.json"
GENERATION_CONFIG = "generation_config.json"
SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


class Tokenizer(Protocol):
    eos_id: int
    pad_id: int
    bos_id: int | None
    stop_ids: tuple[int, ...]  # generation ends at any of these; eos_id first
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, directory: str | Path) -> None: ...


class CharTokenizer:
    """One id per character; ids 0-3 are pad, bos, eos, unk. Unknown characters map to unk."""

    def __init__(self, chars: str = _CHARS):
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: characters must be unique")
        self.chars = chars
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = 0, 1, 2, 3
        self.stop_ids = (self.eos_id,)
        self._ids = {ch: i + len(SPECIALS) for i, ch in enumerate(chars)}
        self.vocab_size = len(SPECIALS) + len(chars)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        ids = self._ids
        unk = self.unk_id
        return [ids.get(ch, unk) for ch in text]

    def encode_prompt(self, text: str) -> list[int]:
        """Ids of a prompt as the model sees it: bos, then the text."""
        return [self.bos_id, *self.encode(text)]

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens are dropped."""
        n = len(SPECIALS)
        chars = self.chars
        return "".join(chars[i - n] for i in ids if n <= i < self.vocab_size)

    def save(self, directory: str | Path) -> None:
        """Write char_tokenizer.json plus Hugging Face tokenizer files into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / CHAR_FILE).write_text(json.dumps({"type": "char", "chars": self.chars}))
        self.to_hf().save_pretrained(str(directory))

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        """The char tokenizer saved in ``directory``; any unreadable or malformed file is a ValueError naming it."""
        path = Path(directory) / CHAR_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"model.path: {path}: not a char tokenizer file ({exc})") from None
        if not isinstance(data, dict) or data.get("type") != "char" or not isinstance(data.get("chars"), str):
            raise ValueError(
                f'model.path: {path}: not a char tokenizer file (expected {{"type": "char", "chars": "..."}})'
            )
        try:
            return cls(data["chars"])
        except ValueError as exc:
            raise ValueError(f"model.path: {path}: not a char tokenizer file ({exc})") from None

    def to_hf(self) -> Any:
        """An equivalent transformers fast tokenizer: same ids for every character of the vocabulary.

        Written as a byte-level BPE without merges (GPT-2 byte symbols, e.g. space is "Ġ") rather than a
        word-level character split, because transformers 5 rebuilds Qwen2 tokenizers from vocab + merges
        with Qwen's own byte-level pre-tokenizer; this form survives that rebuild unchanged. Characters
        outside the vocabulary are dropped or become <unk> there (the char tokenizer maps them to <unk>).
        """
        from tokenizers import Tokenizer as RawTokenizer
        from tokenizers import decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {tok: i for i, tok in enumerate(SPECIALS)}
        vocab.update({_byte_symbol(ch): i for ch, i in self._ids.items()})
        raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        raw.decoder = decoders.ByteLevel()
        return PreTrainedTokenizerFast(
            tokenizer_object=raw, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
        )


def _byte_symbol(ch: str) -> str:
    """GPT-2 byte-level symbol of an ASCII character: printable ones are themselves, bytes 0-32 shift to 256+."""
    code = ord(ch)
    if code > 126:
        raise ValueError(f"CharTokenizer: only ASCII characters can be exported, got {ch!r}")
    return chr(256 + code) if code < 33 else ch


class HFTokenizer:
    """A transformers tokenizer behind the runtime's tokenizer interface.

    ``extra_stop_ids``: further ids that end generation besides the tokenizer's eos (a model directory's
    generation config names them); ids outside the tokenizer are ignored.
    """

    def __init__(self, hf: Any, extra_stop_ids: tuple[int, ...] = ()):
        self.hf = hf
        if hf.eos_token_id is None:
            raise ValueError("the model's tokenizer defines no eos token; generation could never stop")
        self.eos_id = int(hf.eos_token_id)
        self.pad_id = int(hf.pad_token_id) if hf.pad_token_id is not None else self.eos_id
        self.bos_id = int(hf.bos_token_id) if hf.bos_token_id is not None else None
        self.vocab_size = len(hf)
        extra = (i for i in extra_stop_ids if 0 <= i < self.vocab_size and i != self.eos_id)
        self.stop_ids = (self.eos_id, *dict.fromkeys(extra))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_prompt(self, text: str) -> list[int]:
        # The tokenizer's own rule decides whether a bos is prepended (Llama yes, Qwen no).
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; special tokens are dropped, and so are ids past the tokenizer's last one, which a
        model whose embedding is padded beyond the vocabulary (as released models' are) can sample."""
        size = self.vocab_size
        return self.hf.decode([i for i in ids if 0 <= i < size], skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        self.hf.save_pretrained(str(directory))


def generation_stop_ids(directory: str | Path) -> tuple[int, ...]:
    """The ``eos_token_id`` (one id or a list) of a model directory's generation_config.json; () without one."""
    path = Path(directory) / GENERATION_CONFIG
    if not path.is_file():
        return ()
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise ValueError(f"model.path: {path}: not a readable generation config ({exc})") from None
    ids = [value] if isinstance(value, int) else value if isinstance(value, list) else []
    if value is not None and (not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ValueError(f"model.path: {path}: eos_token_id must be an id or a list of ids, got {value!r}")
    return tuple(ids)


def load_tokenizer(directory: str | Path) -> CharTokenizer | HFTokenizer:
    """The tokenizer saved in a model directory: the char tokenizer when char_tokenizer.json is there."""
    directory = Path(directory)
    if (directory / CHAR_FILE).is_file():
        return CharTokenizer.load(directory)
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - tokenizers' parser raises bare Exception, transformers KeyError
        raise ValueError(f"model.path {directory}: no usable tokenizer ({type(exc).__name__}: {exc})") from None
    return HFTokenizer(hf, generation_stop_ids(directory))
