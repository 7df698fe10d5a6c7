"""Draft specs -> a DraftNet for a given target.

- "auto" (also None): the draft known.py picks for the target: the shipped one for the
  default model, a published EAGLE-3 head or the family's smallest model for a well-known
  target named by its hub id (fetched), else "self:2";
- "default": the draft shipped for the default target when the target is the default model
  (it reads the target's features), else the target's first layers ("self:2");
- "default-tokens": the shipped draft that reads tokens only (what mlx-lm's speculative
  decoding and a Core ML package can run), else "self:2";
- "self:N": the target's first N layers with its final norm and LM head (shared weights);
- a folder written by `mirror-mlx distill` (config.json with format "mirror-mlx-draft");
- a published EAGLE-3 head for the target (SafeAILab EAGLE / SpecForge or vLLM speculators
  layout: eagle3.py);
- anything `models.load` reads (GGUF, mlx-lm folder, hub id): a model of a family
  models/split.py knows, whose tokenizer must equal the target's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..errors import IncompatibleDraft, InvalidParameter, ModelLoadError
from ..models.load import LoadedModel, load, resolve_dtype
from ..models.split import ExitHead, check_splittable
from .eagle3 import is_eagle3_folder, load_eagle3
from .known import AUTO, DEFAULT_SELF_LAYERS, auto_draft
from .net import DraftNet

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED_DRAFT = ASSETS / "draft-smollm2-135m"
SHIPPED_TOKEN_DRAFT = ASSETS / "draft-smollm2-135m-tokens"
SHIPPED_DRAFTS = {"default": SHIPPED_DRAFT, "default-tokens": SHIPPED_TOKEN_DRAFT}
SHIPPED_EXIT_HEAD = ASSETS / "exit-smollm2-135m.safetensors"


def vocab_fingerprint(tokenizer) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]


def target_info(target: LoadedModel) -> dict:
    return {"name": str(target.path.name), "vocab_size": target.vocab_size,
            "vocab": vocab_fingerprint(target.tokenizer)}


def load_draft(spec: str | None, target: LoadedModel) -> DraftNet:
    spec = spec or AUTO
    if spec == AUTO:
        spec = auto_draft(target)
    shipped = SHIPPED_DRAFTS.get(spec)
    if shipped is not None:
        if target.name == "default" and DraftNet.is_draft_folder(shipped):
            return load_folder(shipped, target)
        spec = f"self:{DEFAULT_SELF_LAYERS}"
    if spec.startswith("self:"):
        try:
            n = int(spec.split(":", 1)[1])
        except ValueError:
            n = 0
        if not 0 < n <= target.num_layers:
            raise ModelLoadError(f"draft '{spec}': N must be in 1..{target.num_layers}")
        if target.parallel:
            # Its layers run (in part) on the other ranks: the draft would join their
            # collectives from its own thread.
            raise ModelLoadError(f"draft '{spec}' shares the target's layers, which are split "
                                 f"over {target.ranks} ranks here ({target.parallel}); give a "
                                 "draft of its own (--draft FOLDER or MODEL)")
        return DraftNet.from_model(target.model, n, target_info(target))
    if Path(spec).is_dir() and DraftNet.is_draft_folder(Path(spec)):
        return load_folder(Path(spec), target)
    if Path(spec).is_dir() and is_eagle3_folder(Path(spec)):
        return load_eagle3(Path(spec), target, target_info(target))
    model = load(spec)
    check_same_vocabulary(model, target)
    try:
        return DraftNet.from_model(model.model, target_info=target_info(target))
    except ModelLoadError as e:
        raise ModelLoadError(f"draft '{spec}': {e}") from e


def load_folder(folder: Path, target: LoadedModel, dtype: str = "auto") -> DraftNet:
    """A draft written by `mirror-mlx distill`, checked against the target's vocabulary."""
    net = DraftNet.load(folder, embedding=target.model.model.embed_tokens,
                        dtype=resolve_dtype(dtype))
    made_for = net.config.target.get("vocab")
    if made_for and made_for != vocab_fingerprint(target.tokenizer):
        raise IncompatibleDraft(
            f"{folder}: this draft was trained for another vocabulary "
            f"({net.config.target.get('name', '?')}), not {target.path.name}'s")
    if net.config.vocab_size != target.vocab_size:
        raise IncompatibleDraft(f"{folder}: draft vocabulary {net.config.vocab_size} tokens, "
                                f"target {target.vocab_size}")
    return net


def check_same_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    a, b = draft.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:1]
        raise IncompatibleDraft(
            f"the draft's vocabulary ({len(a)} tokens) differs from the target's "
            f"({len(b)} tokens), e.g. at {differ[0] if differ else '?'}: speculative decoding "
            "needs the same tokenizer")


def load_exit_head(spec: str | None, target: LoadedModel,
                   layer: int | None = None) -> ExitHead | None:
    """An exit head for Mirror-SD: a file, "none" (the raw logit lens), or "default" (the
    shipped head when the target is the default model, else none). `layer`, when given, is
    the exit layer asked for: the shipped head yields to the raw lens at another layer; a
    named head must have been trained there."""
    check_splittable(target.model)
    spec = spec or "default"
    if spec == "none" or (spec == "default" and not (
            target.name == "default" and SHIPPED_EXIT_HEAD.is_file())):
        return None
    path = SHIPPED_EXIT_HEAD if spec == "default" else Path(spec)
    if not path.is_file():
        raise ModelLoadError(f"{spec}: no such exit head file")
    head = ExitHead.load(path, target.model.args.hidden_size, target.num_layers)
    if layer and layer != head.layer:
        if spec != "default":
            raise InvalidParameter(f"the exit head was trained at layer {head.layer}, "
                                   f"not at --exit-layer {layer}")
        return None
    return head
