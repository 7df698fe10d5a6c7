"""Every family mirror-mlx runs, as target and as draft, with tiny random-weight models built
from mlx-lm's own classes (tiny.py): greedy AR, SD and Mirror-SD agree token for token; the
split target is the target itself; a converted draft is the model it came from; what can't
work is refused by name."""

import importlib
from pathlib import Path

from mirror_mlx.api import Engine
from mirror_mlx.draft.load import load_draft
from mirror_mlx.draft.net import DraftNet, llama_source
from mirror_mlx.errors import IncompatibleDraft, ModelLoadError
from mirror_mlx.models import split
from mirror_mlx.models.load import LoadedModel
from mirror_mlx.train.distill import Example
from mirror_mlx.train.exit_head import choose_exit, collect
from mirror_mlx.train.feature import target_features

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gemma3
from mlx_lm.models.cache import KVCache

from coreml_export.convert import package_spec
from tests.families.tiny import FAMILIES, VOCAB, config, save, tiny
from tests.helpers import assert_same_logits

# Longer than the tiny models' sliding windows (6 tokens), so windows matter.
PROMPT = [1, 504, 3125, 30, 7382, 281, 260, 3429, 28, 665, 1670, 314, 253, 5728, 30, 1115]
MAX_TOKENS = 12
SD = dict(mode="sd", gamma=3)
MIRROR = dict(mode="mirror", gamma=3, kappa=4, branch_budget=2, exit_layer=2)


def loaded(model, tokenizer, name: str) -> LoadedModel:
    # No end-of-sequence token: every run makes MAX_TOKENS tokens.
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, path=Path(name),
                       context_length=256, eos_token_ids=frozenset(), dtype="float32")


@pytest.fixture(scope="module")
def tokenizer(target):
    return target.tokenizer


@pytest.mark.parametrize("family", FAMILIES)
def test_family_decoders_agree(family, tokenizer, tmp_path):
    """As target, with its own first layers as draft: two (a random model's first layers
    guess wrong: every draft is rejected) and all four (the target itself: drafts are
    accepted); and as draft: a separate two-layer model of the family read from an mlx-lm
    folder, as a user gives it."""
    target = loaded(tiny(family), tokenizer, family)
    reference = Engine(target, mode="ar").generate(PROMPT, max_tokens=MAX_TOKENS).token_ids
    assert len(reference) == MAX_TOKENS
    folder = save(tiny(family, layers=2, seed=1), family, tmp_path / "draft", tokenizer)
    for draft, mode in (("self:2", SD), ("self:4", MIRROR), (str(folder), MIRROR)):
        with Engine(target, draft=draft, lookup=False, **mode) as engine:
            result = engine.generate(PROMPT, max_tokens=MAX_TOKENS)
        assert result.token_ids == reference, (family, draft, mode)
        if draft == "self:4":
            assert result.stats.target_steps < MAX_TOKENS / 2, family


@pytest.mark.parametrize("family", FAMILIES)
def test_split_forward_is_the_model(family):
    """Through a prefill and steps, on a cache that crosses the sliding windows."""
    model = tiny(family)
    tokens = mx.array([PROMPT])
    ours, theirs = split.make_cache(model), split.make_cache(model)
    for a, b in ((0, 9), (9, 10), (10, 16)):
        logits, _ = split.forward(model, tokens[:, a:b], ours)
        assert mx.array_equal(logits, model(tokens[:, a:b], cache=theirs))


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_draft_is_the_model(family):
    """All layers converted, past the sliding windows: the draft computes what the model does,
    at contiguous positions and as a branch of a tree (explicit positions and mask, beside a
    sibling branch it must not see)."""
    model = tiny(family)
    net = DraftNet.from_model(model)
    reference = model(mx.array([PROMPT]))
    assert_same_logits(net(mx.array([PROMPT])), reference)
    cache = [KVCache() for _ in net.layers]
    net(mx.array([PROMPT[:10]]), 0, "causal", cache)
    # Tree: the sibling PROMPT[12] at position 10, then the branch PROMPT[10:] at 10, 11, ...
    tokens = mx.array([PROMPT[12:13] + PROMPT[10:]])
    positions = mx.array([[10] + list(range(10, 16))], dtype=mx.int32)
    mask = np.zeros((7, 17), bool)  # keys: the 10 cached, the sibling, the branch
    mask[:, :10] = True
    mask[0, 10] = True
    mask[1:, 11:] = np.tril(np.ones((6, 6), bool))
    out = net(tokens, positions, mx.array(mask)[None, None], cache)
    assert_same_logits(out[:, 1:], reference[:, 10:])


def test_gemma3_target_from_a_folder(tokenizer, tmp_path):
    """Gemma 3 as mlx-community ships 4B and up (model type gemma3: the text model inside a
    wrapper), read from an mlx-lm folder as a user gives it: Mirror-SD equals AR."""
    settings = dict(model_type="gemma3", vocab_size=VOCAB, text_config=config("gemma3_text"))
    model = gemma3.Model(gemma3.ModelArgs.from_dict(settings))
    model.language_model = tiny("gemma3_text")
    folder = save(model, "gemma3", tmp_path / "gemma3", tokenizer, settings)
    reference = Engine(str(folder), mode="ar").generate(PROMPT, max_tokens=MAX_TOKENS).token_ids
    with Engine(str(folder), mode="mirror", draft="self:2", exit_layer=2) as engine:
        assert engine.generate(PROMPT, max_tokens=MAX_TOKENS).token_ids == reference


def test_core_ml_export_takes_the_families_and_names_what_it_cannot(tokenizer):
    """Drafts of llama (rope scalings, windows), qwen2, qwen3, gemma 2 and gemma 3 export (their
    parity: tests/coreml/test_families_parity.py); phi3 is refused with what differs."""
    for family in ("llama", "llama3-rope", "mistral-yarn", "llama-sliding", "qwen2", "qwen3",
                   "gemma2", "gemma3_text"):
        # head_dim 32: the Neural Engine runs states whose sizes are multiples of 32 only.
        module = importlib.import_module(f"mlx_lm.models.{FAMILIES[family][0]}")
        args = {**config(family), "hidden_size": 128, "head_dim": 32}
        target = loaded(module.Model(module.ModelArgs.from_dict(args)), tokenizer, family)
        spec, _ = package_spec(load_draft("self:2", target), context=256, max_branch_tokens=8)
        assert spec.config.num_layers == 2
    net = load_draft("self:2", loaded(tiny("phi3"), tokenizer, "phi3"))
    with pytest.raises(IncompatibleDraft, match="partial rope .* a fused qkv projection"):
        package_spec(net, context=256, max_branch_tokens=8)


def test_unknown_family_runs_alone_and_is_refused_by_name(tokenizer, capsys):
    """olmo2: AR runs the model as it is; Mirror-SD and drafts name the model type. The
    default mode, finding no draft that serves it, runs AR and says why once."""
    from mlx_lm.models import olmo2

    args = olmo2.ModelArgs(model_type="olmo2", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=49152, max_position_embeddings=256)
    target = loaded(olmo2.Model(args), tokenizer, "olmo2")
    assert len(Engine(target, mode="ar").generate(PROMPT, max_tokens=4).token_ids) == 4
    capsys.readouterr()
    with Engine(target) as engine:
        assert engine.mode == "ar" and "'olmo2'" in engine.mode_note
        assert len(engine.generate(PROMPT, max_tokens=4).token_ids) == 4
        engine.generate(PROMPT, max_tokens=2)
    assert capsys.readouterr().err.count("running target-only (AR)") == 1
    with pytest.raises(ModelLoadError, match="'olmo2'"):
        Engine(target, mode="mirror", draft="self:1")
    with pytest.raises(ModelLoadError, match="'olmo2'"):
        Engine(target, mode="sd", draft="self:1")


def test_dynamic_rope_draft_is_refused(tokenizer):
    from mlx_lm.models import llama

    args = llama.ModelArgs.from_dict({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "rms_norm_eps": 1e-5,
        "vocab_size": 49152, "max_position_embeddings": 256,
        "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match="dynamic"):
        load_draft("self:1", loaded(llama.Model(args), tokenizer, "dynamic"))


def test_distill_starts_from_the_plain_llama_form_only():
    assert not llama_source(tiny("llama"), 2).unlike_llama
    with pytest.raises(ModelLoadError, match="qk-norm"):
        llama_source(tiny("qwen3"), 2)


def test_training_reads_hidden_states_past_float16(tokenizer):
    """Gemma's residual stream outgrows float16 (Gemma 3 270M's passes 65,504 from its 8th
    layer): the exit head's data keeps such states as they are, and a feature draft's stored
    features keep their direction (the draft reads them through an RMS norm), never inf."""
    model = tiny("gemma3_text")
    model.model.embed_tokens.weight = model.model.embed_tokens.weight * 1e6
    target = loaded(model, tokenizer, "gemma-large")
    tokens = np.array(PROMPT)
    p = split.start(model, mx.array(tokens[None]), [None] * len(model.layers), [1, 3])
    split.run_layers(model, p, 0, 3)
    raw = [np.array(f[0]) for f in p.features]
    assert min(np.abs(f).max() for f in raw) > 65504  # past float16 at both layers

    item = Example(tokens, 4, np.zeros((len(PROMPT) - 4, 1), np.int32),
                   np.zeros((len(PROMPT) - 4, 1), np.float32))
    acts = collect(target, [item], [1, 3], 100)
    np.testing.assert_allclose(acts.hidden[3], raw[1][3:-1], rtol=1e-5)
    assert np.isfinite(acts.top_logp).all()

    stored = target_features(target, [tokens], [1, 3])[0].astype(np.float32)
    assert np.isfinite(stored).all()
    for f, s in zip(raw, np.split(stored, 2, axis=-1)):
        unit = f / np.sqrt((f * f).mean(-1, keepdims=True))
        np.testing.assert_allclose(s, unit, atol=5e-3)


def test_exit_head_never_costs_coverage(tokenizer):
    """distill-exit keeps the raw logit lens (a zero head) where training ends below it, as
    with hidden states as large as Gemma's, and the trained head where it does better."""
    rng = np.random.default_rng(0)
    items = [Example(rng.integers(0, VOCAB, 64), 4, None, None) for _ in range(14)]
    for scale, kept in ((1e6, "raw"), (1.0, "trained")):
        model = tiny("gemma3_text")
        model.model.embed_tokens.weight = model.model.embed_tokens.weight * scale
        head, rows = choose_exit(loaded(model, tokenizer, "gemma"), items, 2, kappa=1, goal=1.0,
                                 positions=800)
        row = next(r for r in rows if r["layer"] == 2)
        assert row["kept"] == kept and head.layer == 2
        better = row["tuned"][1] > row["raw"][1]
        assert better == (kept == "trained")
        assert bool(mx.any(head.proj.weight != 0)) == better
