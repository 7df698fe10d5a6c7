"""`mirror-mlx doctor --selftest`: the real paths, end to end, in about a minute, and a report a
user can paste into an issue.

On a Mac: the default draft (it reads the target's features) exported to Core ML and its
predictions against the MLX draft, Mirror-SD greedy output with the Core ML draft against
target-only decoding (identical, or differing only at a tie of the target's own two best
tokens, which measure/identity.py tells from a failure), how much drafting the target's
forward hid, where Core ML runs each op, and a few seconds of energy. Elsewhere
the same Core ML checks run the package's reference executor (the PyTorch module it was
converted from) where torch is installed, and say so; what cannot run is reported as skipped,
with the reason. Each check reports ok, FAIL or skipped, never a number it did not measure.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from importlib.metadata import version
from pathlib import Path

import numpy as np

from .api import Engine
from .bench.identity import Identity, compare, summary
from .draft.coreml_draft import (
    CoreMLDrafter,
    CoreMLExecutor,
    compiled_model,
    compiled_package,
    mlx_embedding,
    read_package_spec,
)
from .draft.coreml_package import FORMAT, draft_weights, weights_sha256
from .draft.coreml_process import ProcessRuntime
from .draft.load import load_draft
from .draft.mlx_draft import MLXExecutor
from .draft.rollout import OWN, TARGET, ZERO, FeatureRefs
from .energy.meter import measure
from .energy.select import open_meter
from .models.load import load
from .platform import cache_dir, coreml_status, machine_info
from .train.feature import target_features

PROMPTS = ("Write one sentence about the sea.", "List three prime numbers and explain why.")
MAX_TOKENS = 24
CONTEXT = 512  # of the exported package: a multiple of 32 (coreml_package.STATE_ALIGN)
MAX_BRANCH_TOKENS = 8
ENERGY_S = 3.0  # IOReport publishes about every 2 s: a shorter window may read zero
# Top-1 agreement between the package (fp16 on the Neural Engine) and MLX (float32) over all
# positions: the trained draft has near-ties that fp16 may flip.
MIN_AGREEMENT = 0.9


class Skip(Exception):
    """The check cannot run here; the message says why."""


@dataclass
class Check:
    name: str
    status: str  # ok | FAIL | skipped
    detail: str
    seconds: float = 0.0

    def line(self) -> str:
        took = f" ({self.seconds:.1f} s)" if self.status != "skipped" else ""
        return f"[{self.status}] {self.name}{took}: {self.detail}"


def run_check(name: str, check: Callable[[], str]) -> Check:
    start = time.perf_counter()
    try:
        detail, status = check(), "ok"
    except Skip as e:
        detail, status = str(e), "skipped"
    except AssertionError as e:
        detail, status = str(e), "FAIL"
    except Exception as e:  # a selftest reports every failure and goes on
        detail = f"{type(e).__name__}: {e}\n" + traceback.format_exc(limit=3)
        status = "FAIL"
    return Check(name, status, detail, time.perf_counter() - start)


class Selftest:
    """The checks, in order, sharing what they build (the target, the package)."""

    def __init__(self, progress: Callable[[str], None] = lambda _: None):
        self.progress = progress
        self.target = None
        self.prompt_ids: list[list[int]] = []
        self.expected: list[list[int]] = []
        self.package: Path | None = None
        self.runtime_name = ""
        self.make_runtime = None

    def run(self) -> list[Check]:
        checks = []
        for name, check in (
            ("target-only greedy (MLX)", self.target_only),
            ("Mirror-SD greedy identity, MLX draft", self.mirror_mlx_draft),
            ("Core ML export of the default draft", self.export),
            ("Core ML draft predictions vs MLX draft", self.parity),
            ("Mirror-SD greedy identity, Core ML draft", self.mirror_coreml_draft),
            ("Core ML op placement", self.placement),
            ("energy meter", self.energy),
        ):
            self.progress(name)
            checks.append(run_check(name, check))
        return checks

    def target_only(self) -> str:
        self.target = load(None, quiet=True)
        engine = Engine(self.target, mode="ar")
        self.prompt_ids = [engine.encode(p) for p in PROMPTS]
        results = [engine.generate(p, max_tokens=MAX_TOKENS) for p in self.prompt_ids]
        self.expected = [r.token_ids for r in results]
        rate = sum(r.stats.generated_tokens for r in results) / sum(
            r.stats.decode_s for r in results)
        return f"{len(PROMPTS)} prompts, {rate:.1f} tok/s decoding"

    def _mirror(self, draft) -> str:
        if self.target is None:
            raise Skip("the target did not load")
        engine = Engine(self.target, mode="mirror", draft=draft)
        steps = tokens = 0
        hidden = []
        verdicts = []
        plans: dict[str, int] = {}
        try:
            inline = engine.drafter.inline
            for prompt, want in zip(self.prompt_ids, self.expected):
                got = engine.generate(prompt, max_tokens=MAX_TOKENS)
                verdicts.append(compare(self.target, prompt, want, got.token_ids))
                steps += got.stats.target_steps
                tokens += got.stats.committed_tokens
                hidden.append(got.stats.overlap_fraction)
                for plan, n in got.stats.plan_steps.items():
                    plans[plan] = plans.get(plan, 0) + n
            schedule = got.stats.schedule
        finally:
            engine.close()
        # How the overlap was measured matters as much as its value: an inline drafter runs
        # on the decoder's thread, so the target's span there is when its dispatched work
        # completed, seen by a thread that waits on it.
        how = ("each draft job's own span against the target's, from dispatch to when its "
               "work completed" + (" (seen by a thread waiting on it while the draft ran on "
                                   "the decoder's thread)" if inline else ""))
        return (f"{identity_check(verdicts)}; {tokens / steps:.2f} tokens per target step; "
                f"steps by plan: {', '.join(f'{k} {v}' for k, v in sorted(plans.items()))}; "
                f"scheduler: {schedule}; drafting hidden under the target's work: "
                f"{100 * float(np.mean(hidden)):.0f}% ({how})")

    def mirror_mlx_draft(self) -> str:
        return self._mirror(None)

    def export(self) -> str:
        ok, why = coreml_status()
        try:
            from coreml_export.convert import export_draft
            from coreml_export.reference import ReferenceModel
        except ImportError as e:
            raise Skip(f"needs the export extra: pip install 'mirror-mlx[export]' ({e})") from e
        if self.target is None:
            raise Skip("the target did not load")
        net = load_draft("default", self.target)
        weights = draft_weights(net)
        digest = weights_sha256(weights)[:16]
        layout = FORMAT.rsplit("/", 1)[1]  # a package of another layout is made again
        out = cache_dir() / "selftest" / f"default-{digest}-{CONTEXT}-{layout}.mlpackage"
        made = "reused"
        if not out.is_dir():
            out.parent.mkdir(parents=True, exist_ok=True)
            part = out.with_name(f"{out.stem}.part.mlpackage")  # an interrupted export is not kept
            export_draft(net, part, source="default", context=CONTEXT,
                         max_branch_tokens=MAX_BRANCH_TOKENS, quiet=True)
            part.rename(out)
            made = "exported"
        self.package = out
        spec = read_package_spec(out)
        # In its own process, as open_package runs a package.
        if ok:
            self.runtime_name = "Core ML (CPU_AND_NE)"
            model = partial(compiled_model, compiled_package(out), spec.compute_units)
        else:
            self.runtime_name = f"the reference executor, not Core ML ({why})"
            model = partial(ReferenceModel, spec, weights)
        self.make_runtime = lambda: ProcessRuntime(model)
        return f"{made} {out}"

    def _executor(self):
        if self.make_runtime is None:
            raise Skip("no package (see the export check)")
        spec = read_package_spec(self.package)
        embed = mlx_embedding(self.target.model.model.embed_tokens)
        return CoreMLExecutor(self.make_runtime(), spec, embed)

    def parity(self) -> str:
        coreml = self._executor()
        net = load_draft("default", self.target)
        tokens = self.target.tokenizer.encode(" ".join(PROMPTS))
        n = len(tokens)
        prompt = last = None
        if net.reads_features:  # token p reads the target's features after p - 1, then its own
            rows = target_features(self.target, [np.array(tokens)], net.config.feature_layers)
            prompt = FeatureRefs([ZERO] + [TARGET] * (n - 1), [0, *range(n - 1)],
                                 list(rows[0][: n - 1].astype(np.float32)))
            last = FeatureRefs([OWN], [n - 1], [])
        pairs = []
        try:
            for ex in (MLXExecutor(net), coreml):
                whole = ex.forward(tokens, 0, None, list(range(n)), prompt)  # several predicts
                one = ex.forward(tokens[-1:], n, None, [0], last)  # then one token
                pairs.append(np.concatenate([whole, one])[:, 0])
        finally:
            coreml.runtime.close()
        a, b = pairs
        diff = float(np.abs(a - b).max())
        agree = float((a.argmax(-1) == b.argmax(-1)).mean())
        detail = (f"{len(a)} positions through {self.runtime_name}: best token agrees at "
                  f"{100 * agree:.1f}%, max |logit difference| {diff:.3f} "
                  f"(largest |logit| {np.abs(a).max():.1f})")
        assert agree >= MIN_AGREEMENT, detail
        return detail

    def mirror_coreml_draft(self) -> str:
        return self._mirror(CoreMLDrafter(self._executor())) + f" (through {self.runtime_name})"

    def placement(self) -> str:
        ok, why = coreml_status()
        if not ok:
            raise Skip(why)
        if self.package is None:
            raise Skip("no package (see the export check)")
        from coreml_export.inspect import placement

        plan = placement(self.package)
        share = plan.cost.get("NE", 0.0)
        detail = "\n".join(plan.lines())
        assert share >= 0.9 and not plan.off_ne, (
            f"{100 * share:.0f}% of the estimated cost on the Neural Engine\n{detail}")
        return detail

    def energy(self) -> str:
        choice = open_meter("auto")
        if not choice.available:
            raise Skip(choice.note)
        if self.target is None:
            raise Skip("the target did not load")
        engine = Engine(self.target, mode="ar")
        try:
            def work():
                end, tokens = time.perf_counter() + ENERGY_S, 0
                while time.perf_counter() < end:
                    tokens += engine.generate(PROMPTS[0], max_tokens=MAX_TOKENS).stats \
                        .generated_tokens
                return tokens

            reading, tokens = measure(choice.meter, work)
        finally:
            choice.close()
        rails = ", ".join(f"{rail} {j:.2f} J" for rail, j in sorted(reading.joules.items()))
        assert reading.total_j > 0, f"{choice.backend} read no energy over {reading.seconds:.1f} s"
        return (f"{choice.backend}: {rails} over {reading.seconds:.1f} s of decoding "
                f"({reading.watts:.1f} W, {reading.total_j / max(tokens, 1):.3f} J/token)")


def identity_check(verdicts: list[Identity]) -> str:
    """Greedy Mirror-SD against target-only decoding, prompt by prompt: a difference at a tie
    of the target's own two best tokens is rounding (a window and one token take different
    kernels on a GPU) and passes, stated with its position and gap; any other fails."""
    identity = summary(verdicts)
    assert all(v.passed for v in verdicts), \
        f"greedy output differs from target-only decoding: {identity}"
    return identity


def report(checks: list[Check]) -> str:
    """The text to paste into an issue."""
    lines = [f"mirror-mlx {version('mirror-mlx')} selftest", ""]
    lines += machine_info().lines()
    lines.append("")
    lines += [c.line() for c in checks]
    failed = sum(c.status == "FAIL" for c in checks)
    skipped = sum(c.status == "skipped" for c in checks)
    lines += ["", f"{len(checks) - failed - skipped} ok, {failed} failed, {skipped} skipped"]
    return "\n".join(lines)
