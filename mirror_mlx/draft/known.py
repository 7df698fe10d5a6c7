"""`--draft auto`: the draft a user would pick for a well-known target.

A table maps targets, by their Hugging Face repo name (the original's or a conversion's such as
mlx-community's: case and quantization suffixes do not matter), to a published EAGLE-3 head
made for that exact model where one is public, otherwise to the smallest model of the family
that shares its tokenizer. That draft is fetched from the Hugging Face Hub the way mlx-lm
fetches a target named by its repo id, and only for a target named that way: a target read
from a local file or folder never starts a download. The default target gets the draft shipped
for it; every other target its own first layers (`self:2`), with a line that says so.

Every repo id below was checked to exist on the Hub when the table was written.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from ..models.load import LoadedModel

AUTO = "auto"
# What a target without a draft of its own drafts with: its first layers, sharing its weights.
DEFAULT_SELF_LAYERS = 2
SELF = f"self:{DEFAULT_SELF_LAYERS}"
# A head's files: EAGLE's own heads are pytorch_model.bin (read through torch), others
# safetensors; mlx-lm's own patterns would skip the .bin.
HEAD_FILES = ("*.json", "*.safetensors", "pytorch_model*.bin")

LLAMA_1B = "mlx-community/Llama-3.2-1B-Instruct-4bit"
QWEN3_SMALLEST = "mlx-community/Qwen3-0.6B-4bit"
GEMMA3_SMALLEST = "mlx-community/gemma-3-270m-it-4bit"


@dataclass(frozen=True)
class KnownDraft:
    targets: str  # a regular expression that repo_name(target) matches whole
    draft: str  # a Hugging Face repo id
    head: bool  # an EAGLE-3 head trained for these targets (else a model with their tokenizer)


def _qwen3_heads() -> tuple[KnownDraft, ...]:
    # Trained for the Qwen3 release (thinking and not), not for the 2507 Instruct/Thinking
    # updates, which take the sibling below.
    sizes = ("1.7B", "4B", "8B", "14B", "32B")
    return tuple(KnownDraft(re.escape(f"qwen3-{s.lower()}"), f"AngelSlim/Qwen3-{s}_eagle3", True)
                 for s in sizes)


# The first entry a target matches is its draft; the later ones it matches are named when that
# one cannot be fetched. Llama 3 (3.0) is left out: it names reserved special tokens that 3.1
# renamed, so its vocabulary differs from Llama 3.2 1B's and the pair is refused.
KNOWN: tuple[KnownDraft, ...] = (
    KnownDraft(r"(meta-)?llama-3\.1-8b-instruct", "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", True),
    KnownDraft(r"llama-3\.3-70b-instruct", "yuhuili/EAGLE3-LLaMA3.3-Instruct-70B", True),
    *_qwen3_heads(),
    KnownDraft(r"(meta-)?llama-3\.[123]-(3b|8b|70b)-instruct", LLAMA_1B, False),
    KnownDraft(r"qwen3-(1\.7b|4b|8b|14b|32b)(-instruct-2507|-thinking-2507)?", QWEN3_SMALLEST,
               False),
    # Gemma 3 4B and up are image-text models whose text model runs here (models/load.py); the
    # draft's vocabulary is checked against the target's when it loads.
    KnownDraft(r"gemma-3-(text-)?(1b|4b|12b|27b)-it", GEMMA3_SMALLEST, False),
)

# Quantization and format suffixes of conversions: -4bit, -8-bit, -bf16, -MLX, -qat, -Q4_K_M...
_SUFFIX = re.compile(r"[-_.](\d+-?bits?|bf16|fp16|f16|fp32|f32|fp8|mlx|dwq|qat|awq|gguf"
                     r"|i?q\d(_k)?(_[a-z0-9]+)*)$")


def repo_name(spec: str) -> str:
    """The model a spec names, as the table matches it: a hub id's or path's last part in
    lower case, without the suffixes conversions add."""
    name = spec.rstrip("/").rsplit("/", 1)[-1].lower().removesuffix(".gguf")
    while (shorter := _SUFFIX.sub("", name)) != name:
        name = shorter
    return name


def known_drafts(spec: str) -> list[KnownDraft]:
    """The table's drafts for a target, best first (empty for an unknown target)."""
    name = repo_name(spec)
    return [k for k in KNOWN if re.fullmatch(k.targets, name)]


@dataclass(frozen=True)
class Choice:
    spec: str  # what load_draft reads: "default", "self:N", or a hub repo id to fetch first
    reason: str  # one line: which draft, and why
    fetch: bool = False  # the spec is a hub repo id
    head: bool = False  # ... of an EAGLE-3 head
    others: tuple[str, ...] = ()  # other drafts for the target, should this one not come


def named_on_hub(target: LoadedModel) -> bool:
    """The target was named by a hub repo id: a name of the form owner/name that is no path
    here (models/load.py reads everything else from disk, or refuses it)."""
    return "/" in target.name and not Path(target.name).expanduser().exists()


def choose(name: str, hub: bool) -> Choice:
    """The draft `--draft auto` stands for, for a target named `name` (`hub`: by a repo id)."""
    if name == "default":
        return Choice("default", "the draft trained for the default model (shipped)")
    if name == "gemma3-270m":
        return Choice(SELF, "Gemma 3 270M is the smallest of its family and no EAGLE-3 head is "
                            f"published for it: drafting with its first {DEFAULT_SELF_LAYERS} "
                            f"layers ({SELF}); `mirror-mlx distill` trains a better draft")
    drafts = known_drafts(name)
    if not drafts:
        return Choice(SELF, f"no known draft for {name}: drafting with its first "
                            f"{DEFAULT_SELF_LAYERS} layers ({SELF}); name a better one with "
                            "--draft")
    best = drafts[0]
    what = "EAGLE-3 head" if best.head else "family's smallest model (same tokenizer)"
    if not hub:
        return Choice(SELF, f"{name} is read from disk, so --draft auto fetches nothing: "
                            f"drafting with its first {DEFAULT_SELF_LAYERS} layers ({SELF}); "
                            f"--draft {best.draft} fetches its {what}")
    return Choice(best.draft, f"{best.draft}, the {what} for {repo_name(name)}",
                  fetch=True, head=best.head, others=tuple(k.draft for k in drafts[1:]))


def fetch_repo(repo: str, patterns: Sequence[str] | None) -> Path:
    """A hub repo's files in the local cache, downloaded as mlx-lm downloads a hub target
    (`patterns`: which files; None: mlx-lm's, those of a model)."""
    from mlx_lm.utils import _download  # what mlx_lm.load runs for a repo id

    return Path(_download(repo, allow_patterns=list(patterns) if patterns else None))


Fetch = Callable[[str, Sequence[str] | None], Path]


def auto_draft(target: LoadedModel, fetch: Fetch = fetch_repo) -> str:
    """The draft spec `--draft auto` resolves to for `target`, said on stderr where it is not
    the default model's own; a hub draft is fetched and its local folder returned."""
    choice = choose(target.name, named_on_hub(target))
    if choice.spec != "default":
        print(f"draft: {choice.reason}", file=sys.stderr, flush=True)
    if not choice.fetch:
        return choice.spec
    try:
        return str(fetch(choice.spec, HEAD_FILES if choice.head else None))
    except Exception as e:  # the hub client raises many types; all mean "not fetched"
        others = ", ".join(f"--draft {d}" for d in (*choice.others, SELF))
        raise ModelLoadError(
            f"--draft auto chose {choice.spec} for {target.name}, but it cannot be fetched from "
            f"the Hugging Face Hub ({type(e).__name__}: {e}); pass another draft: {others} (or "
            "a local draft folder)") from e
