"""Tokenizers for SFT: one protocol, two implementations.

* :class:`ByteChatTokenizer` is embedded: UTF-8 bytes plus a few special tokens and its own chat
  template (below). No download, vocab 264, so a tiny model trains on CPU.
* :class:`HFChatTokenizer` loads a local Hugging Face tokenizer directory and renders the
  conversation with its own chat template (Qwen3.5's for the real runs).

Both turn a conversation (a list of ``{"role", "content"}`` turns, roles :data:`ROLES`) into
``(input_ids, loss_mask)`` with :meth:`encode_messages`; :meth:`encode_sft` is the one-turn case
``[user: prompt, assistant: response]``. Convention of :class:`~relax_gdn.data.sample.Sample`:
``loss_mask[i]`` is True when the label of position ``i`` (token ``i + 1``) is trained on.

Masking rule (both tokenizers): an assistant turn is trained on from the end of the generation
prompt (what ``add_generation_prompt=True`` appends after the turns before it) up to and
including the first end-of-turn token after it, i.e. exactly what the model must generate when
asked to answer at that point. System and user turns and the template's scaffolding never carry
loss.

The embedded template, for ``[system, user, assistant, user, assistant]``::

    <|system|>S<|user|>U1<|assistant|>A1<|end|><|user|>U2<|assistant|>A2<|end|>

(each turn opens with its role token; only an assistant turn is closed, by ``<|end|>``; its
generation prompt is ``<|assistant|>``, so ``A1<|end|>`` and ``A2<|end|>`` are trained on).

:meth:`ByteChatTokenizer.save_pretrained` writes the embedded tokenizer as a Hugging Face one
(``tokenizer.json`` + this template as ``chat_template.jinja``) that gives the same ids: exports of
runs that used it ship it, and ``AutoTokenizer`` / :class:`HFChatTokenizer` load it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol, runtime_checkable

from relax_gdn.errors import DataError

BYTE_TOKENIZER_NAMES = ("byte", "embedded")  # spellings that select the embedded tokenizer
ROLES = ("system", "user", "assistant")  # the roles of a conversation turn


@runtime_checkable
class SFTTokenizer(Protocol):
    vocab_size: int
    pad_id: int
    eos_id: int

    def encode_messages(self, messages: list[dict]) -> tuple[list[int], list[bool]]: ...

    def encode_sft(self, prompt: str, response: str) -> tuple[list[int], list[bool]]: ...

    def decode(self, ids: list[int]) -> str: ...


def single_turn(prompt: str, response: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]


def next_token_loss_mask(is_target: list[bool]) -> list[bool]:
    """Per-token "this token is trained on" flags -> per-position "this position's label counts"
    flags: position i predicts token i + 1, and the last position predicts nothing."""
    return list(is_target[1:]) + [False]


class ByteChatTokenizer:
    """UTF-8 bytes 0..255, then special tokens; a few ids are reserved so vocab_size is a multiple of 8."""

    SPECIAL_TOKENS = ("<|pad|>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>")
    NUM_RESERVED = 3
    # the template of the module docstring, in the Jinja form of Hugging Face chat templates
    CHAT_TEMPLATE = (
        "{%- for message in messages -%}<|{{ message['role'] }}|>{{ message['content'] }}"
        "{%- if message['role'] == 'assistant' -%}<|end|>{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
    )

    def __init__(self) -> None:
        self.special_ids = {tok: 256 + i for i, tok in enumerate(self.SPECIAL_TOKENS)}
        self.pad_id = self.special_ids["<|pad|>"]
        self.user_id = self.special_ids["<|user|>"]
        self.assistant_id = self.special_ids["<|assistant|>"]
        self.eos_id = self.special_ids["<|end|>"]
        self.role_ids = {role: self.special_ids[f"<|{role}|>"] for role in ROLES}
        self.vocab_size = 256 + len(self.SPECIAL_TOKENS) + self.NUM_RESERVED
        self._special_names = {i: tok for tok, i in self.special_ids.items()}

    @staticmethod
    def encode_text(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_messages(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        ids: list[int] = []
        is_target: list[bool] = []
        for turn in messages:
            ids.append(self.role_ids[turn["role"]])  # the assistant's is its generation prompt
            is_target.append(False)
            body = self.encode_text(turn["content"])
            if turn["role"] == "assistant":
                body.append(self.eos_id)
            ids += body
            is_target += [turn["role"] == "assistant"] * len(body)
        return ids, next_token_loss_mask(is_target)

    def encode_sft(self, prompt: str, response: str) -> tuple[list[int], list[bool]]:
        return self.encode_messages(single_turn(prompt, response))

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

    def save_pretrained(self, directory: str | os.PathLike) -> list[str]:
        """Write this tokenizer as a Hugging Face tokenizer directory with the same ids: a byte-level
        BPE without merges (byte b is id b), the special and reserved tokens as added tokens, and
        :attr:`CHAT_TEMPLATE`. Text that spells a special token (``<|end|>``) inside a turn's content
        becomes that token there, as with any Hugging Face tokenizer, where this one keeps its bytes.
        Returns the files written."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        byte_chars = bytes_to_unicode()  # the printable stand-in of every byte, as byte-level BPE writes it
        backend = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        backend.decoder = decoders.ByteLevel()
        names = [self._special_names.get(i, f"<|reserved_{i}|>") for i in range(256, self.vocab_size)]
        backend.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
        hf = PreTrainedTokenizerFast(
            tokenizer_object=backend,
            eos_token="<|end|>",
            pad_token="<|pad|>",
            chat_template=self.CHAT_TEMPLATE,
        )
        return [Path(f).name for f in hf.save_pretrained(str(directory))]

    def __repr__(self) -> str:
        return f"ByteChatTokenizer(vocab_size={self.vocab_size})"


class HFChatTokenizer:
    """A local Hugging Face tokenizer directory, conversations rendered by its chat template.

    The conversation is rendered once as text. Each assistant turn's trained span starts where
    the rendering of the turns before it with the generation prompt ends (that rendering must be
    a prefix of the whole one, true for Qwen-style templates, which re-render nothing before the
    turn being answered) and ends after the first eos token text that follows (the template's
    end-of-turn; a trailing newline after it is not trained on); without one, it runs to the
    end of the text. The text is tokenized piece by piece at those boundaries, so every trained
    token is exactly a token of the assistant's span.
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
        self.eos_text = self.hf.convert_ids_to_tokens(self.eos_id)  # how the template writes it
        self.pad_id = int(self.hf.pad_token_id) if self.hf.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self.hf)  # includes added special tokens

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _ids(self, text: str) -> list[int]:
        # The template already writes every special token (BOS included, if any).
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the ``[start, end)`` character span of every assistant
        turn's trained text in it (see the class docstring)."""
        full = self._render(messages, generation_prompt=False)
        spans = []
        for k, turn in enumerate(messages):
            if turn["role"] != "assistant":
                continue
            prompt = self._render(messages[:k], generation_prompt=True) if k else ""
            if not full.startswith(prompt):
                raise DataError(
                    f"the chat template of {self.path!r} renders the turns before assistant turn {k} "
                    "differently when the conversation goes on, so its trained span cannot be located; use "
                    "a template that renders earlier turns the same (Qwen-style) or the embedded tokenizer"
                )
            start = max(len(prompt), spans[-1][1] if spans else 0)
            end_of_turn = full.find(self.eos_text, start)
            spans.append((start, len(full) if end_of_turn < 0 else end_of_turn + len(self.eos_text)))
        return full, spans

    def encode_messages(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        full, spans = self.assistant_spans(messages)
        ids: list[int] = []
        is_target: list[bool] = []
        done = 0
        for start, end in [*spans, (len(full), len(full))]:
            for piece, trained in ((full[done:start], False), (full[start:end], True)):
                piece_ids = self._ids(piece) if piece else []
                ids += piece_ids
                is_target += [trained] * len(piece_ids)
            done = end
        return ids, next_token_loss_mask(is_target)

    def encode_sft(self, prompt: str, response: str) -> tuple[list[int], list[bool]]:
        return self.encode_messages(single_turn(prompt, response))

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
