"""Tokenizers for SFT: one protocol, two implementations.

* :class:`ByteChatTokenizer` is embedded: UTF-8 bytes plus a few special tokens and the chat
  format ``<|user|>prompt<|assistant|>response<|end|>``. No download, vocab 264, so a tiny model
  trains on CPU.
* :class:`HFChatTokenizer` loads a local Hugging Face tokenizer directory and renders the
  conversation with its own chat template (Qwen3.5's for the real runs).

Both return ``(input_ids, loss_mask)`` from :meth:`encode_sft` with the convention of
:class:`~relax_gdn.data.sample.Sample`: ``loss_mask[i]`` is True when the label of position ``i``
(token ``i + 1``) is a response token or the end-of-turn token. The prompt and the template's
scaffolding never carry loss.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, runtime_checkable

from relax_gdn.errors import DataError

BYTE_TOKENIZER_NAMES = ("byte", "embedded")  # spellings that select the embedded tokenizer


@runtime_checkable
class SFTTokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int

    def encode_sft(self, prompt: str, response: str) -> tuple[list[int], list[bool]]: ...

    def decode(self, ids: list[int]) -> str: ...


def next_token_loss_mask(is_target: list[bool]) -> list[bool]:
    """Per-token "this token is trained on" flags -> per-position "this position's label counts"
    flags: position i predicts token i + 1, and the last position predicts nothing."""
    return list(is_target[1:]) + [False]


class ByteChatTokenizer:
    """UTF-8 bytes 0..255, then special tokens; a few ids are reserved so vocab_size is a multiple of 8."""

    SPECIAL_TOKENS = ("<|pad|>", "<|user|>", "<|assistant|>", "<|end|>")
    NUM_RESERVED = 4

    def __init__(self) -> None:
        self.special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIAL_TOKENS)}
        self.pad_id = self.special_ids["<|pad|>"]
        self.user_id = self.special_ids["<|user|>"]
        self.assistant_id = self.special_ids["<|assistant|>"]
        self.eos_id = self.special_ids["<|end|>"]
        self.vocab_size = 256 + len(self.SPECIAL_TOKENS) + self.NUM_RESERVED
        self._special_names = {i: tok for tok, i in self.special_ids.items()}

    @staticmethod
    def encode_text(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_sft(self, prompt: str, response: str) -> tuple[list[int], list[bool]]:
        prompt_ids = [self.user_id, *self.encode_text(prompt), self.assistant_id]
        response_ids = [*self.encode_text(response), self.eos_id]
        is_target = [False] * len(prompt_ids) + [True] * len(response_ids)
        return prompt_ids + response_ids, next_token_loss_mask(is_target)

    def decode(self, ids: list[int]) -> str:
        out, pending = [], bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                pending.append(i)
                continue
            out.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
            out.append(self._special_names.get(i, f"<|reserved_{i}|>"))
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def __repr__(self) -> str:
        return f"ByteChatTokenizer(vocab_size={self.vocab_size})"


class HFChatTokenizer:
    """A local Hugging Face tokenizer directory, conversations rendered by its chat template.

    The response span is found on the rendered TEXT: the prompt rendered with the generation
    prompt is a prefix of the full conversation (true for Qwen-style templates; otherwise the
    longest common prefix is used), and the two parts are tokenized separately so the boundary
    is exact. Loss stops after the last end-of-turn token (a template's trailing newline is not
    trained on).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path).expanduser()
        if not path.is_dir():
            raise DataError(
                f"tokenizer directory {str(path)!r} does not exist (or is not a directory): point the "
                "tokenizer setting (data.tokenizer) at a local Hugging Face tokenizer directory "
                "(tokenizer.json + tokenizer_config.json), or use 'byte' for the embedded tokenizer"
            )
        from transformers import AutoTokenizer  # heavy import, only when a directory is used

        try:
            self.hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - re-raised with the path and the fix
            raise DataError(
                f"could not load a Hugging Face tokenizer from {str(path)!r}: {exc}; the directory needs "
                "tokenizer.json (or the slow-tokenizer files) and tokenizer_config.json"
            ) from exc
        if not getattr(self.hf, "chat_template", None):
            raise DataError(
                f"tokenizer in {str(path)!r} has no chat template: SFT renders prompt/response with "
                "apply_chat_template; use an instruct/chat tokenizer (its tokenizer_config.json or "
                "chat_template.jinja holds the template) or the embedded 'byte' tokenizer"
            )
        eos = self.hf.eos_token_id
        if eos is None:
            raise DataError(
                f"tokenizer in {str(path)!r} defines no eos token; set eos_token in its tokenizer_config.json"
            )
        self.path = str(path)
        self.eos_id = int(eos)
        self.pad_id = int(self.hf.pad_token_id) if self.hf.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self.hf)  # includes added special tokens

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        # The template already writes every special token (BOS included, if any).
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def encode_sft(self, prompt: str, response: str) -> tuple[list[int], list[bool]]:
        user = {"role": "user", "content": prompt}
        prefix_text = self._render([user], generation_prompt=True)
        full_text = self._render([user, {"role": "assistant", "content": response}], generation_prompt=False)
        split = len(prefix_text) if full_text.startswith(prefix_text) else len(
            os.path.commonprefix([prefix_text, full_text])
        )
        prompt_ids, response_ids = self._ids(full_text[:split]), self._ids(full_text[split:])
        trained = len(response_ids)
        if self.eos_id in response_ids:
            trained = len(response_ids) - response_ids[::-1].index(self.eos_id)
        is_target = [False] * len(prompt_ids) + [True] * trained + [False] * (len(response_ids) - trained)
        return prompt_ids + response_ids, next_token_loss_mask(is_target)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(list(ids))

    def __repr__(self) -> str:
        return f"HFChatTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(name_or_path: str | os.PathLike | None = None) -> SFTTokenizer:
    """``None`` / ``"byte"`` / ``"embedded"``: the embedded byte tokenizer; anything else: a local
    Hugging Face tokenizer directory (never downloaded)."""
    if name_or_path is None or str(name_or_path) in BYTE_TOKENIZER_NAMES:
        return ByteChatTokenizer()
    return HFChatTokenizer(name_or_path)
