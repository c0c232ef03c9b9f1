"""Tokenizers, loaded without torch: the orchestrator tokenizes, and its image has no torch.

transformers is imported only when an HF tokenizer is loaded (it works without torch installed).
"""
from __future__ import annotations

import hashlib
from typing import Any

from specdec.errors import InvalidRequest
from specdec.model_refs import TinySpec, resolve_path


class ByteTokenizer:
    """Byte-level tokenizer for the tiny test models: ids 0-255 are bytes, then specials."""

    BOS, EOS, PAD = 256, 257, 258
    SPECIALS = {BOS: "<s>", EOS: "</s>", PAD: "<pad>"}

    def __init__(self, vocab_size: int = 260) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = self.EOS

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Bytes; no special tokens either way (the tiny test models have no BOS)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        data = bytes(i for i in ids if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "<|assistant|>"
        return self.encode(text)

    def fingerprint(self) -> str:
        return f"bytes-{self.vocab_size}"

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        return [self.EOS]


class HFTokenizer:
    """Thin adapter so the orchestrator sees one tokenizer interface."""

    def __init__(self, tok: Any, eos_ids: list[int]) -> None:
        self._tok = tok
        self._eos = eos_ids
        self._fingerprint: str | None = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """add_special_tokens: the tokenizer's own (Llama's and Gemma's BOS; Qwen's none), for a
        sequence's start."""
        ids = list(self._tok.encode(text, add_special_tokens=add_special_tokens))
        bos = getattr(self._tok, "bos_token_id", None)
        if add_special_tokens and bos is not None and ids[:2] == [bos, bos]:
            ids = ids[1:]  # the text brought its own BOS (a chat template rendered by the client)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Without the clean-up of spaces some tokenizers turn on (Llama 3: " ." becomes "."): it
        rewrites text across the point where the orchestrator's incremental decoding joins two
        decodes (orchestrator/text.py), and a stream would lose characters."""
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """InvalidRequest where the template refuses the messages (its own raise_exception: roles not
        alternating, a role it does not support) or the tokenizer has no chat template."""
        try:
            out = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                tokenize=True)
        except Exception as exc:  # noqa: BLE001 - sorted below: the caller's messages, or a bug
            if isinstance(exc, ValueError) or type(exc).__module__.startswith("jinja2"):
                raise InvalidRequest(f"messages cannot be rendered by the model's chat template: {exc}") from exc
            raise
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def __len__(self) -> int:
        """Token ids the tokenizer knows, added tokens included (a model's vocab may have padding rows
        past them)."""
        return len(self._tok)

    def fingerprint(self) -> str:
        """Computed once: sorting and hashing a 150k-token vocabulary takes about 0.3 s on a CPU,
        and GetInfo (which the orchestrator also times as its startup RTT ping) reports it."""
        if self._fingerprint is None:
            vocab = sorted(self._tok.get_vocab().items(), key=lambda kv: kv[1])
            self._fingerprint = hashlib.sha256("\n".join(f"{t}\t{i}" for t, i in vocab).encode()).hexdigest()[:16]
        return self._fingerprint

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)


Tokenizer = ByteTokenizer | HFTokenizer

# Special tokens that end a generation wherever a tokenizer has them, beside its own eos: the chat and
# document ends llama.cpp also stops at. A GGUF names one eos (Qwen2.5's <|im_end|>), so the model
# converted from it had lost the <|endoftext|> its published generation config also stops at, and a
# completion ran on past the end of its document to max_new_tokens.
# (Not <|end|>: gpt-oss ends every message with it, its analysis before its answer among them.)
END_OF_GENERATION_TOKENS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
                            "<end_of_turn>")


def end_of_generation_ids(tok: Any) -> set[int]:
    """Ids of END_OF_GENERATION_TOKENS that tok marks special (added but not special: plain text)."""
    special = set(getattr(tok, "all_special_tokens", None) or [])
    ids: set[int] = set()
    for text in END_OF_GENERATION_TOKENS:
        if text in special:
            token_id = tok.convert_tokens_to_ids(text)
            if isinstance(token_id, int) and token_id >= 0 and token_id != getattr(tok, "unk_token_id", None):
                ids.add(token_id)
    return ids


def load_tokenizer(ref: str) -> Tokenizer:
    if ref.startswith("tiny"):
        return ByteTokenizer(TinySpec.parse(ref).vocab)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    path, gguf = resolve_path(ref)
    tok = AutoTokenizer.from_pretrained(path, gguf_file=gguf) if gguf else AutoTokenizer.from_pretrained(path)
    eos: set[int] = {int(tok.eos_token_id)} if tok.eos_token_id is not None else set()
    for loader in (GenerationConfig, AutoConfig):
        try:
            cfg = loader.from_pretrained(path, gguf_file=gguf) if gguf else loader.from_pretrained(path)
        except (OSError, ValueError):
            continue
        value = getattr(cfg, "eos_token_id", None)
        eos.update([value] if isinstance(value, int) else list(value or []))
    return HFTokenizer(tok, sorted(eos | end_of_generation_ids(tok)))
