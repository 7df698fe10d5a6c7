"""Test helpers: small real models written to disk in real formats."""

from __future__ import annotations

from pathlib import Path

from mirror_mlx.models.gguf import read_header

import mlx.core as mx
from mlx_lm.models import llama

TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            vocab_size=49152, rope_theta=10000.0, max_position_embeddings=256,
            tie_word_embeddings=True)


def tiny_llama(seed: int = 0) -> llama.Model:
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(TINY))
    mx.eval(model.parameters())
    return model


def _permute(w: mx.array, n_heads: int) -> mx.array:
    """llama.cpp's q/k row order (the inverse of the loader's unpermute)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, -1).swapaxes(1, 2).reshape(rows, -1)


def write_tiny_gguf(path: Path, tokenizer_source: Path, architecture: str = "llama",
                    seed: int = 0, swap_tokens: tuple[int, int] | None = None) -> llama.Model:
    """Write a tiny random llama as a GGUF file with the tokenizer of `tokenizer_source`
    (a real GGUF), as llama.cpp lays it out; `swap_tokens` exchanges two vocabulary entries
    (another tokenizer of the same size). Returns the model it holds."""
    model = tiny_llama(seed)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    tensors = {"token_embd.weight": model.model.embed_tokens.weight,
               "output_norm.weight": model.model.norm.weight}
    for i, layer in enumerate(model.model.layers):
        for ours, theirs in names.items():
            module = layer
            for part in ours.split("."):
                module = getattr(module, part)
            w = module.weight
            if theirs == "attn_q":
                w = _permute(w, TINY["num_attention_heads"])
            elif theirs == "attn_k":
                w = _permute(w, TINY["num_key_value_heads"])
            tensors[f"blk.{i}.{theirs}.weight"] = w
    source = dict(read_header(tokenizer_source).metadata)
    if swap_tokens:
        vocab = list(source["tokenizer.ggml.tokens"])
        a, b = swap_tokens
        vocab[a], vocab[b] = vocab[b], vocab[a]
        source["tokenizer.ggml.tokens"] = vocab
    u32 = lambda v: mx.array(v, dtype=mx.uint32)  # noqa: E731
    meta = {
        "general.architecture": architecture,
        f"{architecture}.block_count": u32(TINY["num_hidden_layers"]),
        f"{architecture}.context_length": u32(TINY["max_position_embeddings"]),
        f"{architecture}.embedding_length": u32(TINY["hidden_size"]),
        f"{architecture}.feed_forward_length": u32(TINY["intermediate_size"]),
        f"{architecture}.attention.head_count": u32(TINY["num_attention_heads"]),
        f"{architecture}.attention.head_count_kv": u32(TINY["num_key_value_heads"]),
        f"{architecture}.attention.layer_norm_rms_epsilon": mx.array(TINY["rms_norm_eps"]),
        f"{architecture}.rope.freq_base": mx.array(TINY["rope_theta"]),
        "tokenizer.ggml.model": source["tokenizer.ggml.model"],
        "tokenizer.ggml.pre": source["tokenizer.ggml.pre"],
        "tokenizer.ggml.tokens": source["tokenizer.ggml.tokens"],
        "tokenizer.ggml.merges": source["tokenizer.ggml.merges"],
        "tokenizer.ggml.token_type": mx.array(source["tokenizer.ggml.token_type"], dtype=mx.int32),
        "tokenizer.ggml.bos_token_id": u32(source["tokenizer.ggml.bos_token_id"]),
        "tokenizer.ggml.eos_token_id": u32(source["tokenizer.ggml.eos_token_id"]),
        "tokenizer.chat_template": source["tokenizer.chat_template"],
    }
    mx.save_gguf(str(path), tensors, meta)
    return model
