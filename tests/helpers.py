"""Test helpers: small real models written to disk in real formats."""

from __future__ import annotations

from pathlib import Path

from mirror_mlx.models.gguf import read_header

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten
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


TINY_GEMMA = dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6,
                  intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=256, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                  rope_local_base_freq=10_000.0, query_pre_attn_scalar=256.0,
                  sliding_window=4, sliding_window_pattern=6, max_position_embeddings=128)

# A SentencePiece vocabulary as Gemma's GGUF spells it: control tokens, byte fallbacks, pieces
# in merge order (the order transformers rebuilds Gemma's merges from).
_PIECES = ["▁", "t", "h", "e", "c", "a", "s", "o", "n", "▁t", "he", "▁the", "▁c", "at",
           "▁cat", "▁s", "on", "▁on", "at▁", "\n"]
GEMMA_TOKENS = (["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
                + _PIECES)
_GEMMA_TYPES = [3, 3, 3, 2] + [6] * 256 + [1] * len(_PIECES)


def write_tiny_gemma_gguf(path: Path, seed: int = 0):
    """Write a tiny random Gemma 3 as llama.cpp lays it out (norms stored as 1 + w, q and k
    rows unpermuted, the MLP's up projection in Q5_0) with the `gguf` package's writer.
    Returns the mlx-lm model it holds (the Q5_0 weight as stored, dequantized)."""
    import gguf
    import numpy as np
    from gguf import GGMLQuantizationType as Q
    from mlx.utils import tree_flatten
    from mlx_lm.models import gemma3_text

    mx.random.seed(seed)
    c = TINY_GEMMA
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(
        {**c, "vocab_size": len(GEMMA_TOKENS)}))
    model.sanitize({})  # tied embeddings: no lm_head
    # Norm weights near zero, as trained Gemma checkpoints have (the model adds 1 itself).
    model.update(tree_unflatten([(k, 0.1 * mx.random.normal(v.shape))
                                 for k, v in tree_flatten(model.parameters())
                                 if k.endswith("norm.weight")]))
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm",
             "post_feedforward_layernorm": "post_ffw_norm"}
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_sliding_window(c["sliding_window"])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(GEMMA_TOKENS)
    writer.add_token_scores([-float(i) for i in range(len(GEMMA_TOKENS))])
    writer.add_token_types(_GEMMA_TYPES)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_add_space_prefix(False)

    def f32(w: mx.array) -> np.ndarray:
        return np.array(w.astype(mx.float32))

    writer.add_tensor("token_embd.weight", f32(model.model.embed_tokens.weight))
    writer.add_tensor("output_norm.weight", f32(model.model.norm.weight) + 1.0)
    for i, layer in enumerate(model.model.layers):
        for ours, theirs in names.items():
            module = layer
            for part in ours.split("."):
                module = getattr(module, part)
            w = f32(module.weight)
            if theirs == "ffn_up":
                stored = gguf.quants.quantize(w, Q.Q5_0)
                module.weight = mx.array(gguf.quants.dequantize(stored, Q.Q5_0))
                writer.add_tensor(f"blk.{i}.{theirs}.weight", stored, raw_dtype=Q.Q5_0)
            else:
                writer.add_tensor(f"blk.{i}.{theirs}.weight",
                                  w + 1.0 if theirs.endswith("norm") else w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    mx.eval(model.parameters())
    return model


def assert_same_logits(ours, reference) -> None:
    """Equal up to float32 rounding, on any CPU: BLAS kernels and their blocking differ by
    processor, by library and by matrix shape (a tree forward against a contiguous one), and
    their rounding grows with the logits' size; a conversion or mapping error moves logits by
    whole units. The same best token at every position."""
    ours = np.array(ours, dtype=np.float32)
    reference = np.array(reference, dtype=np.float32)
    worst = float(np.abs(ours - reference).max())
    assert worst <= 1e-4 * float(np.abs(reference).max()), worst
    assert (ours.argmax(-1) == reference.argmax(-1)).all()
