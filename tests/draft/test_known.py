"""`--draft auto` (draft/known.py): the table's matching of targets by repo name, the shipped
draft for the default model, the first layers with a line saying so for any other target, and
a hub draft fetched only for a target named by its hub id. Nothing is downloaded: a target
named by a hub id is the real default model under that name, and the fetch is recorded."""

from dataclasses import replace
from pathlib import Path

from mirror_mlx.api import Engine
from mirror_mlx.cli import build_parser
from mirror_mlx.draft.known import (
    GEMMA3_SMALLEST,
    HEAD_FILES,
    KNOWN,
    LLAMA_1B,
    QWEN3_SMALLEST,
    SELF,
    auto_draft,
    choose,
    known_drafts,
    repo_name,
)
from mirror_mlx.draft.load import load_draft
from mirror_mlx.draft.select import make_drafter
from mirror_mlx.errors import ModelLoadError

import huggingface_hub.constants
import mlx.core as mx
import numpy as np
import pytest

LLAMA31_HEAD = "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"


@pytest.mark.parametrize(("target", "draft"), [
    ("meta-llama/Llama-3.1-8B-Instruct", LLAMA31_HEAD),
    ("mlx-community/Llama-3.1-8B-Instruct-4bit", LLAMA31_HEAD),
    ("mlx-community/Meta-Llama-3.1-8B-Instruct-8bit", LLAMA31_HEAD),
    ("MLX-Community/LLAMA-3.1-8B-INSTRUCT-BF16", LLAMA31_HEAD),
    ("mlx-community/Llama-3.3-70B-Instruct-3bit", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B"),
    ("mlx-community/Llama-3.1-70B-Instruct-4bit", LLAMA_1B),
    ("meta-llama/Llama-3.2-3B-Instruct", LLAMA_1B),
    ("some-one/Llama-3.2-3B-Instruct-Q4_K_M.gguf", LLAMA_1B),
    ("Qwen/Qwen3-8B", "AngelSlim/Qwen3-8B_eagle3"),
    ("Qwen/Qwen3-8B-MLX-4bit", "AngelSlim/Qwen3-8B_eagle3"),
    ("mlx-community/Qwen3-1.7B-4bit", "AngelSlim/Qwen3-1.7B_eagle3"),
    ("mlx-community/Qwen3-32B-8bit", "AngelSlim/Qwen3-32B_eagle3"),
    ("mlx-community/Qwen3-4B-Instruct-2507-4bit", QWEN3_SMALLEST),
    ("google/gemma-3-1b-it", GEMMA3_SMALLEST),
    ("mlx-community/gemma-3-12b-it-qat-4bit", GEMMA3_SMALLEST),
    ("mlx-community/gemma-3-text-27b-it-4bit", GEMMA3_SMALLEST),
])
def test_the_table_matches_ids_and_their_conversions(target, draft):
    assert known_drafts(target)[0].draft == draft
    choice = choose(target, hub=True)
    assert (choice.spec, choice.fetch, choice.head) == (draft, True, draft not in (
        LLAMA_1B, QWEN3_SMALLEST, GEMMA3_SMALLEST))


@pytest.mark.parametrize("target", [
    "mlx-community/Llama-3.2-1B-Instruct-4bit",  # the family's smallest: nothing smaller
    "mlx-community/Qwen3-0.6B-4bit",
    "mlx-community/gemma-3-270m-it-4bit",
    "mlx-community/Meta-Llama-3-8B-Instruct-4bit",  # Llama 3.0: another vocabulary
    "mlx-community/Llama-3.1-8B-Instruct-abliterated-4bit",  # a fine-tune: not the same model
    "mlx-community/Qwen3-30B-A3B-4bit",
    "mlx-community/SmolLM2-360M-Instruct",
])
def test_other_targets_are_not_in_the_table(target):
    assert known_drafts(target) == []
    assert choose(target, hub=True).spec == SELF


def test_repo_names_drop_owner_case_and_conversion_suffixes():
    assert repo_name("mlx-community/Qwen3-8B-MLX-4bit") == "qwen3-8b"
    assert repo_name("/models/gemma-3-270m-it-qat-8-bit/") == "gemma-3-270m-it"
    assert repo_name("x/Llama-3.2-3B-Instruct-IQ4_XS.gguf") == "llama-3.2-3b-instruct"


def test_a_head_names_the_family_draft_as_the_other_choice():
    assert choose("mlx-community/Llama-3.1-8B-Instruct-4bit", hub=True).others == (LLAMA_1B,)
    assert choose("Qwen/Qwen3-14B", hub=True).others == (QWEN3_SMALLEST,)


def test_no_draft_in_the_table_is_itself_a_known_target():
    # A draft that matched a row would be told to draft with itself, or with a larger model.
    for known in KNOWN:
        assert known_drafts(known.draft) == [], known.draft


@pytest.fixture
def no_fetch():
    def fetch(repo, patterns):
        raise AssertionError(f"fetched {repo}")
    return fetch


def test_auto_for_the_default_model_is_the_shipped_draft(target, capsys, no_fetch):
    assert auto_draft(target, fetch=no_fetch) == "default"
    auto, shipped = load_draft("auto", target), load_draft("default", target)
    assert auto.config == shipped.config and auto.config.feature_layers
    assert np.array_equal(np.array(auto.head_ids), np.array(shipped.head_ids))
    assert mx.array_equal(auto.layers[0].mlp.down_proj.weight,
                          shipped.layers[0].mlp.down_proj.weight)
    assert load_draft(None, target).config == shipped.config
    assert capsys.readouterr().err == ""  # nothing to say where the choice is the obvious one


def test_an_engine_drafts_with_auto_by_default(target):
    with Engine(target, mode="sd") as engine:
        assert engine.drafter.inner.net.config == load_draft("default", target).config
    for command in ("generate --prompt x", "chat", "serve", "bench"):
        assert build_parser().parse_args(command.split()).draft == "auto"


def test_an_unknown_target_drafts_with_its_first_layers_and_says_so(target, capsys, no_fetch):
    other = replace(target, name="someone/unknown-model")
    assert auto_draft(other, fetch=no_fetch) == SELF
    assert "no known draft for someone/unknown-model" in capsys.readouterr().err
    drafter = make_drafter("auto", other)
    try:
        assert drafter.net.config.num_layers == 2 and not drafter.net.config.feature_layers
    finally:
        drafter.close()
    err = capsys.readouterr().err
    assert err.startswith("draft: no known draft") and "self:2" in err


def test_the_hosted_gemma_270m_drafts_with_its_first_layers(target, capsys, no_fetch):
    assert auto_draft(replace(target, name="gemma3-270m"), fetch=no_fetch) == SELF
    assert "smallest of its family" in capsys.readouterr().err


def record(calls: list, folder: Path):
    def fetch(repo, patterns):
        calls.append((repo, patterns))
        return folder
    return fetch


@pytest.mark.parametrize(("name", "repo", "patterns"), [
    ("mlx-community/Llama-3.1-8B-Instruct-4bit", LLAMA31_HEAD, HEAD_FILES),
    ("mlx-community/Llama-3.2-3B-Instruct-4bit", LLAMA_1B, None),  # mlx-lm's own patterns
    ("google/gemma-3-4b-it", GEMMA3_SMALLEST, None),
])
def test_a_known_target_named_by_its_hub_id_fetches_the_listed_draft(
        target, tmp_path, capsys, name, repo, patterns):
    calls = []
    assert auto_draft(replace(target, name=name), fetch=record(calls, tmp_path)) == str(tmp_path)
    assert calls == [(repo, patterns)]
    assert capsys.readouterr().err.startswith(f"draft: {repo}, the ")


def test_a_known_target_read_from_disk_fetches_nothing(target, tmp_path, capsys, no_fetch):
    folder = tmp_path / "mlx-community" / "Llama-3.1-8B-Instruct-4bit"
    folder.mkdir(parents=True)
    gguf = tmp_path / "Llama-3.2-3B-Instruct-Q4_K_M.gguf"
    gguf.write_bytes(b"")
    for path, draft in ((folder, LLAMA31_HEAD), (gguf, LLAMA_1B)):
        assert auto_draft(replace(target, name=str(path)), fetch=no_fetch) == SELF
        err = capsys.readouterr().err
        assert "read from disk" in err and f"--draft {draft} fetches" in err


def test_a_draft_that_cannot_be_fetched_says_which_and_what_to_pass(target, tmp_path,
                                                                    monkeypatch):
    # The hub client's own offline mode, over an empty cache: the real fetch, no network.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    named = replace(target, name="mlx-community/Llama-3.1-8B-Instruct-4bit")
    with pytest.raises(ModelLoadError) as e:
        load_draft("auto", named)
    message = str(e.value)
    assert f"--draft auto chose {LLAMA31_HEAD} for {named.name}" in message
    assert f"--draft {LLAMA_1B}, --draft self:2" in message
