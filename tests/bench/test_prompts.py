"""Bench prompts: Spec-Bench-format JSONL, the built-in set, and clear errors for bad files."""

import json

from mirror_mlx.api import Engine
from mirror_mlx.bench.harness import ar_turns
from mirror_mlx.bench.prompts import BenchPrompt, builtin_prompts, load_prompts
from mirror_mlx.errors import MirrorError

import pytest


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_reads_spec_bench_format_and_keeps_n_per_category(tmp_path):
    rows = [{"question_id": 81, "category": "writing", "turns": ["a", "b"]},
            {"question_id": 82, "category": "writing", "turns": ["c"]},
            {"question_id": 83, "category": "writing", "turns": ["d"]},
            {"question_id": "qa-1", "category": "qa", "turns": ["e"], "extra": 1}]
    path = _write(tmp_path / "q.jsonl", rows)
    prompts = load_prompts(str(path))
    assert prompts[0] == BenchPrompt("81", "writing", ("a", "b"))
    assert [p.question_id for p in prompts] == ["81", "82", "83", "qa-1"]
    assert [p.question_id for p in load_prompts(str(path), per_category=2)] == \
        ["81", "82", "qa-1"]


@pytest.mark.parametrize("row, message", [
    ("{not json", "q.jsonl:2: not JSON"),
    ('["a list"]', "q.jsonl:2: expected an object"),
    ({"question_id": 2, "turns": ["x"]}, "q.jsonl:2: missing category"),
    ({"question_id": 2, "category": "qa", "turns": []}, "turns must be a non-empty list"),
    ({"question_id": 2, "category": "qa", "turns": ["ok", " "]}, "non-empty strings"),
    ({"question_id": 1, "category": "qa", "turns": ["x"]}, "question_id 1 appears twice"),
])
def test_bad_lines_name_the_line(tmp_path, row, message):
    path = _write(tmp_path / "q.jsonl", [{"question_id": 1, "category": "qa", "turns": ["x"]},
                                         row])
    with pytest.raises(MirrorError, match=message):
        load_prompts(str(path))


def test_missing_or_empty_file_and_bad_count(tmp_path):
    with pytest.raises(MirrorError, match="cannot read the prompt file"):
        load_prompts(str(tmp_path / "absent.jsonl"))
    with pytest.raises(MirrorError, match="no prompts"):
        load_prompts(str(_write(tmp_path / "empty.jsonl", [""])))
    with pytest.raises(MirrorError, match="--per-category must be at least 1"):
        load_prompts("builtin", per_category=0)


def test_builtin_set_covers_several_categories():
    prompts = builtin_prompts()
    assert load_prompts("builtin") == prompts
    categories = {p.category for p in prompts}
    assert len(categories) >= 6
    assert any(len(p.turns) > 1 for p in prompts)
    assert len({p.question_id for p in prompts}) == len(prompts)


def test_ar_turns_give_each_reply_the_conversation_it_answered(target):
    """What the teacher-forcing benchmarks read from a bench run: a second turn's prompt holds
    the first turn's reply; a turn whose earlier reply is missing is not given."""
    prompts = [BenchPrompt("1", "writing", ("Name a colour.", "And another?")),
               BenchPrompt("2", "qa", ("a", "b"))]
    first = target.tokenizer.encode("Blue.")
    runs = [{"mode": "ar", "question_id": "1", "turn": 0, "token_ids": first},
            {"mode": "ar", "question_id": "1", "turn": 1, "token_ids": [7]},
            {"mode": "sd", "question_id": "2", "turn": 0, "token_ids": [7]},
            {"mode": "ar", "question_id": "2", "turn": 1, "token_ids": [7]}]
    with Engine(target, mode="ar") as engine:
        turns = list(ar_turns(runs, prompts, engine))
        assert [(c, r) for c, _, r in turns] == [("writing", first), ("writing", [7])]
        assert turns[0][1] == engine.encode("Name a colour.")
        assert turns[1][1] == engine.encode([
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And another?"}])
