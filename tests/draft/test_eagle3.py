"""Published EAGLE-3 heads as drafts (draft/eagle3.py): tiny heads written here in each
published layout for a tiny llama target; what the MLX drafter drafts with them equals a small
PyTorch reference written from the public definition (EAGLE's cnets.py, SpecForge's
llama3_eagle.py, speculators' eagle3 model); SD and Mirror-SD with them are lossless; heads made
for another target are refused by what differs."""

import importlib.util
import json
from pathlib import Path

from mirror_mlx.api import Engine
from mirror_mlx.draft.base import Features, Job
from mirror_mlx.draft.load import load_draft
from mirror_mlx.draft.mlx_draft import MLXDrafter
from mirror_mlx.errors import IncompatibleDraft, ModelLoadError
from mirror_mlx.models.load import LoadedModel

import mlx.core as mx
import numpy as np
import pytest
import torch

from coreml_export.convert import package_spec
from tests.families.tiny import VOCAB, tiny

LAYERS = 8  # EAGLE's default taps: the inputs of layers 2, 4 and 5
WIDTH, HEADS, KV, HEAD_DIM, FFN, DRAFT_VOCAB = 64, 4, 2, 16, 128, 512
EPS, THETA = 1e-5, 10000.0
PROMPT = [1, 504, 3125, 30, 7382, 281, 260, 3429, 28, 665, 1670, 314, 253, 5728, 30, 1115]


@pytest.fixture(scope="module")
def small(target):
    model = tiny("llama", layers=LAYERS)
    return LoadedModel(model=model, tokenizer=target.tokenizer, name="tiny", path=Path("tiny"),
                       context_length=256, eos_token_ids=frozenset(), dtype="float32")


# -- writing heads --

VARIANTS = {
    # SafeAILab's EAGLE-3 as published: default layers, safetensors or pytorch_model.bin, some
    # named as a plain one-layer LlamaForCausalLM.
    "eagle": dict(layout="eagle"),
    "eagle-bin": dict(layout="eagle", bin=True, arch="LlamaForCausalLM"),
    "eagle-bf16": dict(layout="eagle", bf16=True),
    # SpecForge: fc_norm, and capture layers named as layer outputs, out of order.
    "specforge-ids": dict(layout="eagle", fc_norm=True, eagle_config_ids=[4, 0, 2]),
    # SpecForge's norm_output false: the LM head reads the layer's output unnormed.
    "specforge-raw": dict(layout="eagle", raw_head=True),
    # vLLM speculators: its norm options, two layers, its embedding, layer inputs by id.
    "speculators": dict(layout="speculators", norm_before_residual=True, norm_output=True,
                        layers=2, embedding=True),
    "speculators-ids": dict(layout="speculators", norm_before_fc=True, ids=[1, 6, 3]),
    # speculators' qwen3 layers: qk-norm, here with attention biases.
    "speculators-qwen3": dict(layout="speculators", kind="qwen3", bias=True, fc_norm=True),
}


def head_weights(v: dict, seed: int) -> dict[str, np.ndarray]:
    """Random weights under the speculators names, scaled so that greedy choices have
    margins; d2t maps the head's 512 tokens onto a spread of the target's."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n):
        return (1 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    k, H = 3, v.get("width", WIDTH)
    w = {"fc.weight": normal(H, k * H, scale=2), "norm.weight": norm(H),
         "lm_head.weight": normal(DRAFT_VOCAB, H, scale=8)}
    for i in range(v.get("layers", 1)):
        wide = 2 * H if i == 0 else H
        p = f"layers.{i}."
        w |= {p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, wide, scale=3),
              p + "self_attn.k_proj.weight": normal(KV * HEAD_DIM, wide, scale=3),
              p + "self_attn.v_proj.weight": normal(KV * HEAD_DIM, wide),
              p + "self_attn.o_proj.weight": normal(H, HEADS * HEAD_DIM),
              p + "mlp.gate_proj.weight": normal(FFN, H), p + "mlp.up_proj.weight": normal(FFN, H),
              p + "mlp.down_proj.weight": normal(H, FFN),
              p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H)}
        if i == 0:
            w[p + "hidden_norm.weight"] = norm(H)
        if v.get("kind") == "qwen3":
            w |= {p + "self_attn.q_norm.weight": norm(HEAD_DIM),
                  p + "self_attn.k_norm.weight": norm(HEAD_DIM)}
        if v.get("bias"):
            w |= {p + f"self_attn.{n}_proj.bias": normal(w[p + f"self_attn.{n}_proj.weight"]
                                                         .shape[0], scale=0.3)
                  for n in "qkvo"}
    if v.get("fc_norm"):
        w |= {f"fc_norm.{i}.weight": norm(H) for i in range(k)}
    if v.get("norm_before_fc"):
        w["input_norm.weight"] = norm(k * H)
    if v.get("embedding"):
        w["embed_tokens.weight"] = normal(VOCAB, H, scale=H**0.5)
    ids = np.sort(rng.choice(VOCAB, DRAFT_VOCAB, replace=False))
    w["d2t"] = ids - np.arange(DRAFT_VOCAB)
    t2d = np.zeros(VOCAB, bool)
    t2d[ids] = True
    w["t2d"] = t2d
    return w


def layer_config(v: dict) -> dict:
    return dict(model_type=v.get("kind", "llama"), attention_bias=v.get("bias", False),
                hidden_size=v.get("width", WIDTH), intermediate_size=FFN,
                num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM,
                num_hidden_layers=v.get("layers", 1), rms_norm_eps=EPS, rope_theta=THETA,
                vocab_size=VOCAB, hidden_act="silu", max_position_embeddings=2048)


def write_head(folder: Path, v: dict, seed: int = 0, **override) -> dict[str, np.ndarray]:
    """A head folder as each project publishes it; returns its weights (speculators names)."""
    w = head_weights(v, seed)
    if v.get("bf16"):  # as most heads are published; the reference reads the rounded values
        w = {k: np.array(mx.array(a).astype(mx.bfloat16).astype(mx.float32))
             if a.dtype == np.float32 else a for k, a in w.items()}
    folder.mkdir(parents=True)
    if v["layout"] == "speculators":
        cfg = dict(speculators_model_type="eagle3", architectures=["Eagle3Speculator"],
                   transformer_layer_config=layer_config(v), draft_vocab_size=DRAFT_VOCAB,
                   norm_before_residual=v.get("norm_before_residual", False),
                   norm_before_fc=v.get("norm_before_fc", False),
                   fc_norm=v.get("fc_norm", False), norm_output=v.get("norm_output", False),
                   speculators_config={"algorithm": "eagle3"})
        if "ids" in v:
            cfg["eagle_aux_hidden_state_layer_ids"] = v["ids"]
        names = w
    else:
        cfg = dict(layer_config(v), architectures=[v.get("arch", "LlamaForCausalLMEagle3")],
                   draft_vocab_size=DRAFT_VOCAB, fc_norm=v.get("fc_norm", False))
        if v.get("raw_head"):
            cfg["norm_output"] = False
        if "eagle_config_ids" in v:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": v["eagle_config_ids"]}
        names = {k.replace("layers.0.", "midlayer."): a for k, a in w.items()}
    cfg.update(override)
    (folder / "config.json").write_text(json.dumps(cfg))
    if v.get("bin"):
        torch.save({k: torch.from_numpy(a.copy()) for k, a in names.items()},
                   folder / "pytorch_model.bin")
    else:
        dtype = mx.bfloat16 if v.get("bf16") else mx.float32
        mx.save_safetensors(str(folder / "model.safetensors"), {
            k: mx.array(a).astype(dtype) if a.dtype == np.float32 else mx.array(a)
            for k, a in names.items()})
    return w


# -- the PyTorch reference, from the public definition --


def rms(x, weight):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rotate(x, positions):
    """Rotary embedding (rotate-half form) at the given positions, x (heads, T, head_dim)."""
    inv = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angles = torch.cat([positions[:, None].double() * inv] * 2, dim=-1)
    half = HEAD_DIM // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * angles.cos() + turned * angles.sin()).float()


def linear(w, name, x):
    y = x @ w[name + ".weight"].T
    return y + w[name + ".bias"] if name + ".bias" in w else y


def attention(w, p, x, positions):
    """Causal grouped-query attention over the whole sequence x (T, width); qwen3's qk-norm
    norms each head's query and key before the rotation."""
    T = x.shape[0]
    q = linear(w, p + "self_attn.q_proj", x).view(T, HEADS, HEAD_DIM)
    k = linear(w, p + "self_attn.k_proj", x).view(T, KV, HEAD_DIM)
    v = linear(w, p + "self_attn.v_proj", x).view(T, KV, HEAD_DIM).transpose(0, 1)
    if p + "self_attn.q_norm.weight" in w:
        q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
    q, k = rotate(q.transpose(0, 1), positions), rotate(k.transpose(0, 1), positions)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
    scores = q @ k.transpose(1, 2) / HEAD_DIM**0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, HEADS * HEAD_DIM)
    return linear(w, p + "self_attn.o_proj", out)


def mlp(w, p, x):
    gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T


def head_forward(w, v, embeds, hidden, positions):
    """The head over a sequence of (embedding, hidden) pairs: its outputs before the final
    norm (what it feeds itself), after it for speculators' norm_output."""
    p = "layers.0."
    normed = rms(hidden, w[p + "hidden_norm.weight"])
    residual = normed if v.get("norm_before_residual") else hidden
    x = torch.cat([rms(embeds, w[p + "input_layernorm.weight"]), normed], dim=-1)
    h = residual + attention(w, p, x, positions)
    h = h + mlp(w, p, rms(h, w[p + "post_attention_layernorm.weight"]))
    for i in range(1, v.get("layers", 1)):
        p = f"layers.{i}."
        h = h + attention(w, p, rms(h, w[p + "input_layernorm.weight"]), positions)
        h = h + mlp(w, p, rms(h, w[p + "post_attention_layernorm.weight"]))
    return rms(h, w["norm.weight"]) if v.get("norm_output") else h


def reference_drafts(w, v, embedding, tokens, states, n):
    """EAGLE's drafting loop, greedy: pair j is (the target's fused states after token j,
    token j + 1) at position j; each drafted token is paired with the head's own output for
    the token before it. `states` (T - 1, 3 * WIDTH): the target's states in the order fc reads
    them. Returns each drafted position's distribution over the target's tokens."""
    w = {k: torch.from_numpy(np.asarray(a)) for k, a in w.items()}
    table = w.get("embed_tokens.weight", torch.from_numpy(embedding))
    x = torch.from_numpy(states)
    if v.get("norm_before_fc"):
        x = rms(x, w["input_norm.weight"])
    if v.get("fc_norm"):
        x = torch.cat([rms(c, w[f"fc_norm.{i}.weight"]) for i, c in enumerate(x.chunk(3, -1))],
                      -1)
    hidden = x @ w["fc.weight"].T
    ids = list(tokens[1:])
    head_ids = torch.arange(DRAFT_VOCAB) + w["d2t"]
    dists = []
    for _ in range(n):
        out = head_forward(w, v, table[ids], hidden, torch.arange(len(ids)))
        raw = v.get("norm_output") or v.get("raw_head")
        last = out[-1] if raw else rms(out[-1], w["norm.weight"])
        p = (last @ w["lm_head.weight"].T).softmax(-1)
        full = torch.zeros(VOCAB)
        full[head_ids] = p
        dists.append(full.numpy())
        ids.append(int(head_ids[p.argmax()]))
        hidden = torch.cat([hidden, out[-1:]])
    return dists


def target_states(model, tokens, taps_by_input) -> np.ndarray:
    """The inputs of the target's layers `taps_by_input` (0-based) after each token, run
    through mlx-lm's own layers; HF's hidden_states[i] is the input of layer i."""
    h = model.model.embed_tokens(mx.array([tokens]))
    inputs = []
    for layer in model.model.layers:
        inputs.append(h)
        h = layer(h, "causal", cache=None)
    return np.array(mx.concatenate([inputs[i] for i in taps_by_input], axis=-1)[0])


# The states each variant's fc reads, in its order, as inputs of the target's layers: EAGLE's
# default (2, N // 2, N - 3) unless its config names them.
READS = {"specforge-ids": [5, 1, 3], "speculators-ids": [1, 6, 3]}


@pytest.mark.parametrize("name", VARIANTS)
def test_drafts_equal_the_reference(name, small, tmp_path):
    """Three greedy drafted tokens through the MLX drafter: the first reads the target's
    states, the next ones the head's own outputs; each position's top tokens and
    probabilities are the reference's."""
    v = VARIANTS[name]
    w = write_head(tmp_path / name, v)
    net = load_draft(str(tmp_path / name), small)
    assert net.reads_features and net.config.feature_layers == sorted(READS.get(name, [2, 4, 5]))
    n, T = 3, len(PROMPT)
    drafter = MLXDrafter(net, top_k=4)
    try:
        rows = target_states(small.model, PROMPT, sorted(READS.get(name, [2, 4, 5])))
        job = Job([PROMPT], n, features=[Features(PROMPT, 0, rows[: T - 1])])
        rollout = drafter.submit(job).result().rollouts[0]
    finally:
        drafter.close()
    states = target_states(small.model, PROMPT, READS.get(name, [2, 4, 5]))[: T - 1]
    embedding = np.array(small.model.model.embed_tokens.weight)
    dists = reference_drafts(w, v, embedding, PROMPT, states, n)
    assert len(rollout.tokens) == n
    for k, p in enumerate(dists):
        top = np.argsort(-p)[:4]
        assert rollout.top_ids[k].tolist() == top.tolist(), (name, k)
        # Float32 rounding (MLX here, torch there), fed back through the head's own outputs,
        # reaches 1.6e-4 of a probability by the third token here ("speculators", two
        # layers), and other CPUs' kernels round differently. A wrong variant moves the
        # probabilities by far more, and the order of the top tokens is exact above.
        np.testing.assert_allclose(rollout.top_probs[k], p[top], rtol=2e-3, atol=1e-6)
        assert rollout.tokens[k] == top[0]


@pytest.mark.parametrize("name", ["eagle", "speculators", "specforge-raw"])
def test_the_unroll_over_text_drafts_as_the_drafter_does(name, small, tmp_path):
    """benchmarks/acceptance.py scores a draft by unrolling it over a reply (train/feature.py:
    pass k at position t stands for the k-th token of a step at t - k). Over a reply that is
    the head's own greedy chain, pass k at position k guesses the chain's k-th token, as the
    drafter drafted it: the unroll reads the target's states unnormed, as the head's fc does,
    and hides position 0's key as the drafter does."""
    spec = importlib.util.spec_from_file_location(
        "acceptance", Path(__file__).resolve().parents[2] / "benchmarks" / "acceptance.py")
    acceptance = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(acceptance)
    write_head(tmp_path / name, VARIANTS[name])
    net = load_draft(str(tmp_path / name), small)
    n, T = 4, len(PROMPT)
    drafter = MLXDrafter(net)
    try:
        rows = target_states(small.model, PROMPT, sorted(READS.get(name, [2, 4, 5])))
        job = Job([PROMPT], n, features=[Features(PROMPT, 0, rows[: T - 1])])
        chain = list(drafter.submit(job).result().rollouts[0].tokens)
    finally:
        drafter.close()
    right = acceptance.correct(small, net, PROMPT, chain, n)
    assert [bool(right[k, k]) for k in range(n)] == [True] * n, (name, chain)


@pytest.mark.parametrize("name", ["eagle", "speculators"])
def test_sd_and_mirror_sd_with_a_head_are_lossless(name, small, tmp_path):
    """Greedy SD and Mirror-SD equal the target alone, with the fused layers below the exit
    (the branches read the exit's states) and above it (they read the head's own)."""
    write_head(tmp_path / name, VARIANTS[name], seed=1)
    reference = Engine(small, mode="ar").generate(PROMPT, max_tokens=12).token_ids
    for mode in (dict(mode="sd", gamma=3),
                 dict(mode="mirror", gamma=3, kappa=4, branch_budget=2, exit_layer=6),
                 dict(mode="mirror", gamma=3, kappa=4, branch_budget=2, exit_layer=3)):
        with Engine(small, draft=str(tmp_path / name), lookup=False, **mode) as engine:
            result = engine.generate(PROMPT, max_tokens=12)
        assert result.token_ids == reference, mode
        assert result.stats.draft_tokens > 0


def test_a_head_for_the_default_target_is_lossless(target, tmp_path):
    """The real default target (30 layers): the head fuses its states after layers 2, 15 and
    27, the last above Mirror-SD's default exit (25), so the branches read the head's own."""
    write_head(tmp_path / "head", dict(layout="eagle", width=target.model.args.hidden_size))
    assert load_draft(str(tmp_path / "head"), target).config.feature_layers == [2, 15, 27]
    prompt = target.tokenizer.encode("The capital of France is")
    reference = Engine(target, mode="ar").generate(prompt, max_tokens=12).token_ids
    for mode in (dict(mode="sd", gamma=3), dict(mode="mirror", gamma=3, kappa=4)):
        with Engine(target, draft=str(tmp_path / "head"), lookup=False, **mode) as engine:
            assert engine.generate(prompt, max_tokens=12).token_ids == reference, mode


@pytest.mark.parametrize("override, says", [
    (dict(hidden_size=32, intermediate_size=64), "32 wide"),
    (dict(vocab_size=32000), "32000-token vocabulary"),
    (dict(target_hidden_size=128), "128 wide"),
    (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 8]}), "8 layers"),
])
def test_a_head_for_another_target_is_refused(override, says, small, tmp_path):
    write_head(tmp_path / "head", VARIANTS["eagle"], **override)
    with pytest.raises(IncompatibleDraft, match=says):
        load_draft(str(tmp_path / "head"), small)


def test_weights_that_do_not_match_the_config_are_refused(small, tmp_path):
    write_head(tmp_path / "head", VARIANTS["eagle"], num_hidden_layers=2)
    with pytest.raises(ModelLoadError, match="missing"):
        load_draft(str(tmp_path / "head"), small)


def test_core_ml_export_refuses_a_head_with_its_own_embedding(small, tmp_path):
    """Heads export to Core ML (tests/coreml/test_eagle3_export.py) where the host's rows of the
    target's embedding are theirs."""
    write_head(tmp_path / "head", VARIANTS["speculators"])
    with pytest.raises(IncompatibleDraft, match="input embedding of its own"):
        package_spec(load_draft(str(tmp_path / "head"), small), context=256,
                     max_branch_tokens=8)
