"""A Hugging Face tokenizer built from GGUF metadata alone (no network, no tokenizer files)."""

from __future__ import annotations

import hashlib
import os
import struct

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from ..errors import ModelLoadError
from ..platform import cache_dir
from .gguf import GGUFHeader

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str):
    """llama.cpp's pre-tokenizer names -> the equivalent `tokenizers` pipeline."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre in ("smollm", "starcoder"):
        # Digits are split one by one before GPT-2's byte-level regex.
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    if pre in ("llama-bpe", "llama3", "llama-v3"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    return None


_CONTROL, _USER_DEFINED = 3, 4


def _strings(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def tokenizer_from_gguf(header: GGUFHeader) -> PreTrainedTokenizerFast:
    kind = header.metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend = _bpe_backend(header)
    elif kind == "llama":
        backend = _sentencepiece_backend(header)
    else:
        raise ModelLoadError(
            f"{header.path}: tokenizer type '{kind}' is not supported "
            f"(supported: gpt2 BPE, llama SentencePiece)"
        )
    return _wrap(header, backend)


def _sentencepiece_backend(header: GGUFHeader) -> Tokenizer:
    """SentencePiece vocabularies (Gemma's, llama 2's) come without merges; transformers'
    GGUF converter rebuilds them from the vocabulary, which takes about 20 s for Gemma's 262,144
    tokens, so its result is cached under the vocabulary's digest."""
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if not _strings(tokens):
        raise ModelLoadError(f"{header.path}: tokenizer metadata is missing or malformed")
    cached = cache_dir() / "tokenizers" / f"{_vocabulary_digest(header)}.json"
    if cached.is_file():
        return Tokenizer.from_file(str(cached))
    from transformers import AutoTokenizer

    try:
        built = AutoTokenizer.from_pretrained(header.path.parent, gguf_file=header.path.name,
                                              local_files_only=True)
    except Exception as e:  # transformers raises many types; all mean "cannot build this"
        raise ModelLoadError(
            f"{header.path}: cannot build its SentencePiece tokenizer ({type(e).__name__}: {e})"
        ) from e
    backend = built.backend_tokenizer
    cached.parent.mkdir(parents=True, exist_ok=True)
    part = cached.with_name(f".{cached.name}.{os.getpid()}")
    backend.save(str(part))
    os.replace(part, cached)
    return backend


def _vocabulary_digest(header: GGUFHeader) -> str:
    """What the converter reads: the architecture (it picks the builder) and the vocabulary."""
    meta = header.metadata
    digest = hashlib.sha256()
    for key in ("general.architecture", "tokenizer.ggml.model", "tokenizer.ggml.pre",
                "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token",
                "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
                "tokenizer.ggml.padding_token_id"):
        digest.update(f"{key}={meta.get(key)!r}\n".encode())
    digest.update("\0".join(meta["tokenizer.ggml.tokens"]).encode())
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        values = meta.get(key) or []
        digest.update(struct.pack(f"<{len(values)}d", *values))
    return digest.hexdigest()[:32]


def _bpe_backend(header: GGUFHeader) -> Tokenizer:
    meta = header.metadata
    pre = meta.get("tokenizer.ggml.pre", "default")
    pre_tokenizer = _pre_tokenizer(pre)
    if pre_tokenizer is None:
        raise ModelLoadError(f"{header.path}: tokenizer pre-tokenizer '{pre}' is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    types = meta.get("tokenizer.ggml.token_type", [1] * len(tokens or []))
    if not (_strings(tokens) and _strings(merges) and isinstance(types, list)
            and len(types) == len(tokens)):
        raise ModelLoadError(f"{header.path}: tokenizer metadata is missing or malformed")
    try:
        backend = Tokenizer(
            models.BPE(
                vocab={t: i for i, t in enumerate(tokens)},
                merges=[tuple(m.split(" ", 1)) for m in merges],
                fuse_unk=False,
            )
        )
    except Exception as e:  # the tokenizers library raises a bare Exception
        raise ModelLoadError(f"{header.path}: tokenizer metadata is corrupt ({e})") from e
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, types)
            if kind in (_CONTROL, _USER_DEFINED)
        ]
    )
    bos = _special(header, "bos")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    return backend


def _special(header: GGUFHeader, key: str) -> str | None:
    tokens = header.metadata["tokenizer.ggml.tokens"]
    index = header.metadata.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None


def _wrap(header: GGUFHeader, backend: Tokenizer) -> PreTrainedTokenizerFast:
    meta = header.metadata
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=_special(header, "bos"),
        eos_token=_special(header, "eos"),
        unk_token=_special(header, "unknown"),
        pad_token=_special(header, "padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=int(header.arch_value("context_length", 2048)),
        clean_up_tokenization_spaces=False,
    )
