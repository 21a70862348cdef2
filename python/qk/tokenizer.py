"""The text ↔ token-id codec of a GGUF model, built from its ``tokenizer.ggml.*`` metadata alone.

The byte-level BPE itself runs in HF ``tokenizers`` (a BPE model behind the model's pre-tokenizer
regex and a ByteLevel byte→char mapping); this module turns the GGUF vocabulary into that pipeline
and adds what llama.cpp derives on top of it: token attributes, the end-of-generation set, raw
byte pieces per token and a streaming detokeniser.

Example::

    tok = Tokenizer.from_gguf("model.gguf")
    ids = tok.encode("<|im_start|>user\\nHi<|im_end|>\\n", special=True)
    assert tok.decode(ids) == "<|im_start|>user\\nHi<|im_end|>\\n"
"""

from __future__ import annotations

import codecs
import enum
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HfTokenizer

__all__ = ["IncrementalDecoder", "TokenType", "Tokenizer", "TokenizerError"]


class TokenizerError(ValueError):
    """The GGUF's tokenizer metadata is missing, inconsistent or of a kind qk does not serve."""


class TokenType(enum.IntEnum):
    """``tokenizer.ggml.token_type`` values (gguf-py ``TokenType``)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# The pre-tokenizer regexes of the HF tokenizer.json files, as quoted in llama.cpp's
# src/llama-vocab.cpp for each `tokenizer.ggml.pre` value (docs/numerics.md "Vocabulary"). qwen35 adds combining
# marks (\p{M}) to letter runs and removes them from punctuation runs.
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp maps these `tokenizer.ggml.pre` names onto the two Qwen pre-tokenizers.
PRE_TOKENIZER_REGEXES: Mapping[str, str] = {
    "qwen2": _QWEN2_REGEX,
    "deepseek-r1-qwen": _QWEN2_REGEX,
    "megrez": _QWEN2_REGEX,
    "qwen35": _QWEN35_REGEX,
}

# Token texts llama.cpp treats as end of generation whatever their ids (llama-vocab.cpp, EOG
# auto-detection, "determined based on the token text", llama.cpp issue 9606). The FIM padding,
# repository and file-separator tokens join them: a model emitting one has left the chat format.
_EOG_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    }
)
_FIM_EOG_TEXTS = {
    "tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "tokenizer.ggml.fim_rep_token_id": (
        "<|fim_repo|>",
        "<|repo_name|>",
        "<fim-repo>",
        "<REPO>",
        "<reponame>",
    ),
    "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",),
}
_EOG_ID_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's reversible byte→printable-char table, inverted: char → byte.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to U+0100 and up in
    byte order, so that no BPE token holds whitespace or control characters.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    char_to_byte = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in char_to_byte.values():
            char_to_byte[chr(256 + shifted)] = b
            shifted += 1
    return char_to_byte


_BYTE_OF_CHAR = _byte_level_alphabet()


def _metadata_list(md: Mapping[str, Any], key: str, required: bool = True) -> list[Any]:
    value = md.get(key)
    if value is None:
        if required:
            raise TokenizerError(f"GGUF metadata has no {key!r}")
        return []
    if not isinstance(value, Sequence) or isinstance(value, str | bytes):
        raise TokenizerError(f"GGUF metadata {key!r} must be an array, got {type(value).__name__}")
    return list(value)


def _metadata_token_id(md: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    """An optional token-id key; out-of-range ids are dropped, as llama.cpp does ("bad special token")."""
    value = md.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TokenizerError(f"GGUF metadata {key!r} must be an integer, got {value!r}")
    return value if 0 <= value < n_vocab else None


class Tokenizer:
    """A GGUF model's tokenizer (byte-level BPE, ``tokenizer.ggml.model == "gpt2"``).

    Ids are llama.cpp's: ``encode(text, special)`` equals ``llama_tokenize(text, add_special=False,
    parse_special=special)`` except that with ``special=False`` user-defined tokens (``<think>``,
    ``<tool_call>``…) are spelled out as text too, where llama.cpp would still match them: text that
    came from a user must not turn into control structure unless the caller asks for it.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        token_types: Sequence[int],
        merges: Sequence[str],
        pre: str,
        *,
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        add_bos: bool = False,
        eog_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        if not tokens:
            raise TokenizerError("the vocabulary is empty")
        if len(token_types) not in (0, len(tokens)):
            raise TokenizerError(f"{len(token_types)} token types for {len(tokens)} tokens")
        regex = PRE_TOKENIZER_REGEXES.get(pre)
        if regex is None:
            known = ", ".join(sorted(PRE_TOKENIZER_REGEXES))
            raise TokenizerError(f"pre-tokenizer {pre!r} is not supported (known: {known})")
        self.tokens: list[str] = list(tokens)
        self.token_types: list[TokenType] = [_token_type(t) for t in token_types] or [TokenType.NORMAL] * len(
            tokens
        )
        self.pre = pre
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.add_bos = add_bos
        self.chat_template = chat_template
        # llama.cpp's token_to_id keeps the last id of a duplicated text.
        self._id_of: dict[str, int] = {text: i for i, text in enumerate(self.tokens)}
        # An EOG token that is not typed CONTROL is forced to CONTROL by llama.cpp ("control-looking
        # token"), so it is never spelled out by detokenisation without special=True.
        self.eog_ids: frozenset[int] = frozenset(eog_ids)
        if any(not 0 <= i < len(self.tokens) for i in self.eog_ids):
            raise TokenizerError(f"end-of-generation ids {sorted(self.eog_ids)} reach outside the vocabulary")
        for i in self.eog_ids:
            if self.token_types[i] not in (TokenType.CONTROL, TokenType.UNKNOWN):
                self.token_types[i] = TokenType.CONTROL

        ranked_merges: list[tuple[str, str]] = []
        for i, merge in enumerate(merges):
            # A merge is "left right"; the separator is the first space after the first character.
            cut = merge.find(" ", 1)
            if cut < 0:
                raise TokenizerError(f"merge {i} ({merge!r}) has no separating space")
            left, right = merge[:cut], merge[cut + 1 :]
            # HF's BPE builder panics (not raises) on a merge outside the vocabulary.
            if left not in self._id_of or right not in self._id_of or left + right not in self._id_of:
                raise TokenizerError(f"merge {i} ({merge!r}) joins or makes a token not in the vocabulary")
            ranked_merges.append((left, right))
        self._special_texts = [
            text
            for text, kind in zip(self.tokens, self.token_types, strict=True)
            if kind in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN) and text
        ]
        self._split = pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False)
        bpe = models.BPE(vocab=dict(self._id_of), merges=ranked_merges, fuse_unk=False, byte_fallback=False)
        self._with_specials = self._build_hf(bpe, regex, split_specials=False)
        # A second front end on the same BPE model rather than toggling `encode_special_tokens` per
        # call: that flag is tokenizer-wide state and encode calls can come from several threads.
        self._text_only = self._build_hf(bpe, regex, split_specials=True)
        self._pieces: list[bytes | None] = [None] * len(self.tokens)

    def _build_hf(self, bpe: models.BPE, regex: str, *, split_specials: bool) -> HfTokenizer:
        hf = HfTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
            ]
        )
        hf.decoder = decoders.ByteLevel()
        # All of them count as "special" for HF, so that `encode_special_tokens` spells every one out;
        # llama.cpp matches the longest token first, like HF's leftmost-longest added-token matcher.
        hf.add_special_tokens(
            [
                AddedToken(
                    text, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True
                )
                for text in self._special_texts
            ]
        )
        hf.encode_special_tokens = split_specials
        return hf

    # -- construction from GGUF -------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> Tokenizer:
        """Build from a GGUF metadata mapping (key → int/float/bool/str/list), as ``qk.Gguf.metadata``."""
        model = md.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise TokenizerError(
                f"tokenizer model {model!r} is not supported (qk serves byte-level BPE, 'gpt2')"
            )
        tokens = _metadata_list(md, "tokenizer.ggml.tokens")
        if not all(isinstance(t, str) for t in tokens):
            raise TokenizerError("tokenizer.ggml.tokens must hold strings")
        token_types = _metadata_list(md, "tokenizer.ggml.token_type", required=False)
        merges = _metadata_list(md, "tokenizer.ggml.merges")
        if not all(isinstance(m, str) for m in merges):
            raise TokenizerError("tokenizer.ggml.merges must hold strings")
        pre = md.get("tokenizer.ggml.pre", "default")
        n_vocab = len(tokens)
        bos_id = _metadata_token_id(md, "tokenizer.ggml.bos_token_id", n_vocab)
        eos_id = _metadata_token_id(md, "tokenizer.ggml.eos_token_id", n_vocab)
        pad_id = _metadata_token_id(md, "tokenizer.ggml.padding_token_id", n_vocab)
        add_bos = md.get("tokenizer.ggml.add_bos_token", False)
        template = md.get("tokenizer.chat_template")
        return cls(
            tokens,
            token_types,
            merges,
            str(pre),
            bos_id=bos_id,
            eos_id=eos_id,
            pad_id=pad_id,
            add_bos=bool(add_bos),
            eog_ids=_derive_eog_ids(md, tokens),
            chat_template=template if isinstance(template, str) else None,
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Build from a GGUF file's header (tensor data is not read)."""
        from qk import Gguf

        return cls.from_metadata(Gguf(os.fspath(path), header_only=True).metadata)

    # -- vocabulary ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def token_to_id(self, text: str) -> int | None:
        """The id whose vocabulary text is exactly ``text`` (e.g. ``"<|im_end|>"``), or None."""
        return self._id_of.get(text)

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.eog_ids

    @property
    def special_tokens(self) -> dict[str, int]:
        """Text → id of every control and user-defined token (the ones ``special=True`` matches)."""
        return {text: self._id_of[text] for text in self._special_texts}

    def is_special(self, token_id: int) -> bool:
        """Control and user-defined tokens: the ones ``encode(special=True)`` matches as a whole."""
        return self.token_types[token_id] in (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)

    # -- encode / decode ----------------------------------------------------------------------------

    def encode(
        self, text: str, special: bool = False, literal_spans: Sequence[tuple[int, int]] = ()
    ) -> list[int]:
        """Token ids of ``text``; with ``special=True`` control/user-defined token spellings become
        their single ids (for rendered chat prompts), otherwise everything is plain text. No BOS is
        added (Qwen GGUFs set ``add_bos_token = false``; see ``add_bos``).

        ``literal_spans`` (character ranges, with ``special=True``) are parts that came from
        message text: a special-token spelling inside one is spelled out as text, so a user
        cannot close a turn by typing ``<|im_end|>``. The rest tokenises as without them.
        """
        if not special:
            return self._text_only.encode(text, add_special_tokens=False).ids
        encoding = self._with_specials.encode(text, add_special_tokens=False)
        if not literal_spans:
            return encoding.ids
        ids: list[int] = []
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
            if self.is_special(token_id) and any(a <= start and end <= b for a, b in literal_spans):
                ids.extend(self._text_only.encode(text[start:end], add_special_tokens=False).ids)
            else:
                ids.append(token_id)
        return ids

    def pre_tokenize(self, text: str) -> list[str]:
        """The pieces the pre-tokenizer regex cuts ``text`` into (BPE never merges across them)."""
        return [piece for piece, _span in self._split.pre_tokenize_str(text)]

    def token_to_piece(self, token_id: int, special: bool = True) -> bytes:
        """The bytes one token stands for; a piece can be part of a UTF-8 sequence.

        Control tokens give their text only when ``special`` (llama.cpp's rule); user-defined ones
        always do; unused/padding ids give nothing.
        """
        if not 0 <= token_id < len(self.tokens):
            raise IndexError(f"token id {token_id} is outside the vocabulary (size {len(self.tokens)})")
        kind = self.token_types[token_id]
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
            return self.tokens[token_id].encode() if special else b""
        piece = self._pieces[token_id]
        if piece is None:
            piece = self._piece_of(token_id)
            self._pieces[token_id] = piece
        return piece

    def _piece_of(self, token_id: int) -> bytes:
        text = self.tokens[token_id]
        kind = self.token_types[token_id]
        if kind == TokenType.USER_DEFINED:
            return text.encode()
        if kind == TokenType.NORMAL:
            try:
                return bytes(_BYTE_OF_CHAR[c] for c in text)
            except KeyError:
                # Not a byte-level token (a malformed vocabulary): its UTF-8 is the best reading.
                return text.encode()
        return b""

    def decode(self, ids: Iterable[int], special: bool = True) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD. ``special=False`` drops
        control tokens (``<|im_end|>``…) but keeps user-defined ones (``<think>``…)."""
        data = b"".join(self.token_to_piece(i, special) for i in ids)
        return data.decode("utf-8", errors="replace")

    def incremental_decoder(self, special: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, special)


class IncrementalDecoder:
    """Streaming detokeniser: push ids, get text that never ends in a broken UTF-8 sequence.

    A multi-byte character split across tokens is held back until it completes; ``"".join`` of
    every ``push`` result plus ``flush()`` equals ``Tokenizer.decode`` of all the ids.

    Example::

        dec = tok.incremental_decoder()
        text = "".join(dec.push(i) for i in ids) + dec.flush()
    """

    def __init__(self, tokenizer: Tokenizer, special: bool = True) -> None:
        self._tokenizer = tokenizer
        self._special = special
        # CPython's incremental UTF-8 decoder replaces invalid bytes exactly as bytes.decode does.
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self._tokenizer.token_to_piece(token_id, self._special))

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        """Whatever is still held back (an unfinished sequence becomes U+FFFD); the decoder resets."""
        return self._utf8.decode(b"", final=True)

    @property
    def pending(self) -> bool:
        """Whether bytes of an unfinished character are held back."""
        return bool(self._utf8.getstate()[0])


_TOKEN_TYPES = {kind.value: kind for kind in TokenType}


def _token_type(value: Any) -> TokenType:
    # llama.cpp reads unknown type numbers as "undefined" and treats them like normal text.
    return _TOKEN_TYPES.get(value, TokenType.NORMAL) if isinstance(value, int) else TokenType.NORMAL


def _derive_eog_ids(md: Mapping[str, Any], tokens: Sequence[str]) -> set[int]:
    """End-of-generation ids as llama.cpp derives them: the FIM pad/repo/separator tokens (from
    their metadata keys, else found by text), every token whose text is an end marker, and the
    eos/eot/eom ids of the metadata."""
    n_vocab = len(tokens)
    id_of = {text: i for i, text in enumerate(tokens)}
    eog: set[int] = set()
    for key, texts in _FIM_EOG_TEXTS.items():
        found = _metadata_token_id(md, key, n_vocab)
        if found is None:
            found = next((id_of[t] for t in texts if t in id_of), None)
        if found is not None:
            eog.add(found)
    eog.update(i for text, i in id_of.items() if text in _EOG_TEXTS)
    for key in _EOG_ID_KEYS:
        found = _metadata_token_id(md, key, n_vocab)
        if found is not None:
            eog.add(found)
    return eog
