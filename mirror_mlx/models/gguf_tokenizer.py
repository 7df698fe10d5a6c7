"""A Hugging Face tokenizer built from GGUF metadata alone (no network, no tokenizer files)."""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from ..errors import ModelLoadError
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
    meta = header.metadata
    kind = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{header.path}: tokenizer type '{kind}' is not supported (supported: gpt2 BPE)"
        )
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

    def special(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    bos = special("bos")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        chat_template=meta.get("tokenizer.chat_template"),
        model_max_length=int(header.arch_value("context_length", 2048)),
        clean_up_tokenization_spaces=False,
    )
