"""Benchmark prompts: Spec-Bench-format JSONL files, or a small built-in set.

A Spec-Bench line is `{"question_id": ..., "category": "...", "turns": ["...", ...]}`; a
question with several turns is a conversation: each later turn follows the model's own reply to
the one before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import PromptFileError


@dataclass(frozen=True)
class BenchPrompt:
    question_id: str
    category: str
    turns: tuple[str, ...]


# Written for this project: short requests of several kinds, one a two-turn conversation.
BUILTIN = [
    ("writing-1", "writing", ("Write a short, friendly note inviting neighbours to a street "
                              "picnic on Saturday.",
                              "Now rewrite it as a four-line rhyming poem.")),
    ("writing-2", "writing", ("Write the opening paragraph of a mystery story set in a "
                              "lighthouse.",)),
    ("coding-1", "coding", ("Write a Python function that returns the n-th Fibonacci number "
                            "iteratively, with a docstring.",)),
    ("coding-2", "coding", ("Explain what this SQL does: SELECT city, COUNT(*) FROM users "
                            "GROUP BY city HAVING COUNT(*) > 10;",)),
    ("math-1", "math", ("A train travels 180 km in 2 hours and then 120 km in 1.5 hours. What "
                        "is its average speed over the whole trip? Show your steps.",)),
    ("math-2", "math", ("What is 15% of 240? Explain how you got it.",)),
    ("qa-1", "qa", ("Why do leaves change colour in autumn?",)),
    ("qa-2", "qa", ("What is the difference between a virus and a bacterium?",)),
    ("extraction-1", "extraction", (
        "List every date and the event on it, one per line: The library opened on 3 May 1998. "
        "It was extended on 12 June 2005 and renamed on 1 January 2020.",)),
    ("summarization-1", "summarization", (
        "Summarize in two sentences: Community gardens turn empty city lots into shared plots "
        "where neighbours grow vegetables and flowers. Besides fresh food, they offer a place to "
        "meet, teach children where food comes from, and cool the streets around them in "
        "summer. Most are run by volunteers and rely on small donations of seeds and tools.",)),
    ("translation-1", "translation", ("Translate into French: The museum opens at nine and "
                                      "closes at six on weekdays.",)),
    ("reasoning-1", "reasoning", ("Anna is taller than Ben, and Ben is taller than Carl. Is "
                                  "Carl taller than Anna? Explain briefly.",)),
]


def builtin_prompts() -> list[BenchPrompt]:
    return [BenchPrompt(q, c, t) for q, c, t in BUILTIN]


def load_prompts(source: str, per_category: int | None = None) -> list[BenchPrompt]:
    """Prompts from `source` ("builtin" or a Spec-Bench JSONL path), keeping the first
    `per_category` of each category (all when None), in file order."""
    prompts = builtin_prompts() if source == "builtin" else read_jsonl(Path(source))
    if per_category is not None:
        if per_category < 1:
            raise PromptFileError(f"--per-category must be at least 1 (got {per_category})")
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    return prompts


def read_jsonl(path: Path) -> list[BenchPrompt]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{path}: cannot read the prompt file ({e})") from e
    prompts, ids = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            row = json.loads(line)
        except ValueError as e:
            raise PromptFileError(f"{where}: not JSON ({e})") from e
        if not isinstance(row, dict):
            raise PromptFileError(f"{where}: expected an object with question_id, category, "
                                  "turns")
        missing = [k for k in ("question_id", "category", "turns") if k not in row]
        if missing:
            raise PromptFileError(f"{where}: missing {', '.join(missing)}")
        turns = row["turns"]
        if not (isinstance(turns, list) and turns
                and all(isinstance(t, str) and t.strip() for t in turns)):
            raise PromptFileError(f"{where}: turns must be a non-empty list of non-empty strings")
        qid = str(row["question_id"])
        if qid in ids:
            raise PromptFileError(f"{where}: question_id {qid} appears twice")
        ids.add(qid)
        prompts.append(BenchPrompt(qid, str(row["category"]), tuple(turns)))
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts
