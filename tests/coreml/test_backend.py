"""The Core ML draft backend's own logic, on Linux through the reference executor: Mirror-SD
with the inline drafter is lossless, the inline queue keeps its order, errors reset the cache,
the reference holds callers to Core ML's input rules, and the backend is chosen as documented."""

import dataclasses
import importlib.util
import time
import warnings
from collections import Counter
from pathlib import Path

from mirror_mlx.api import Engine
from mirror_mlx.decode.mirror import MirrorConfig
from mirror_mlx.decode.schedule import draft_units
from mirror_mlx.draft.base import Job
from mirror_mlx.draft.coreml_draft import (
    CoreMLDrafter,
    CoreMLExecutor,
    check_target,
    mlx_embedding,
)
from mirror_mlx.draft.coreml_package import INPUT_HOLD_S, source_sha256
from mirror_mlx.draft.load import load_draft
from mirror_mlx.draft.mlx_draft import MLXDrafter
from mirror_mlx.draft.select import _open_or_mlx, beside, make_drafter
from mirror_mlx.errors import IncompatibleDraft, InvalidParameter, ModelLoadError, PromptTooLong
from mirror_mlx.platform import coreml_can_run, coremltools_problem
from mirror_mlx.session import DecodeSettings, Session

import mlx.core as mx
import numpy as np
import pytest

from coreml_export.convert import package_spec
from coreml_export.reference import ReferenceModel
from tests.prompts import PROMPTS

MAX_TOKENS = 16


def reference_drafter(net, context=512, max_branch_tokens=8) -> CoreMLDrafter:
    spec, weights = package_spec(net, context, max_branch_tokens)
    model = ReferenceModel(spec, weights)
    return CoreMLDrafter(CoreMLExecutor(model, spec, mlx_embedding(net.embed_tokens)))


@pytest.fixture(scope="module")
def reference_tokens(target):
    engine = Engine(target, mode="ar")
    return [(engine.encode(p), engine.generate(p, max_tokens=MAX_TOKENS).token_ids)
            for p in PROMPTS[:2]]


@pytest.fixture(scope="module")
def self4(target):
    return load_draft("self:4", target)


def test_mirror_through_coreml_backend_equals_greedy(target, reference_tokens, self4):
    """With the target's first 4 layers as the draft, steps end in branch reuse (the rolled-out
    branch's KV slots are moved inside the Core ML state) and in fallback."""
    drafter = reference_drafter(self4)
    settings = DecodeSettings("mirror", 4, MirrorConfig(kappa=8, exit_layer=25, budget=4))
    session = Session(target, None, drafter, settings)
    outcomes = Counter()
    for ids, expected in reference_tokens:
        session.reset()
        session.timeline = []
        out = [t for chunk in session.generate(ids, max_tokens=MAX_TOKENS)
               for t in chunk.token_ids]
        assert out == expected
        outcomes += Counter(label.split(":")[1] for label, _, _ in session.timeline
                            if label.startswith("outcome:"))
    assert outcomes["branch"] and outcomes["fallback"], outcomes
    drafter.close()


def test_feature_draft_through_coreml_backend_equals_greedy(target, reference_tokens):
    """The shipped draft reads the target's features: through the package contract, Mirror-SD
    feeds it the prefix's features, the exit layer's for branch rollouts, and its own; it
    drafts as well as the same draft in MLX (one fed wrong features would agree by chance)."""
    net = load_draft("default", target)
    settings = DecodeSettings("mirror", 4, MirrorConfig(kappa=8, exit_layer=25, budget=4))
    accepted = {}
    for name, drafter in (("mlx", MLXDrafter(net)), ("coreml", reference_drafter(net))):
        assert drafter.feature_layers == (3, 15, 25)
        session = Session(target, None, drafter, settings)
        accepted[name] = 0
        for ids, expected in reference_tokens:
            session.reset()
            chunks = list(session.generate(ids, max_tokens=MAX_TOKENS))
            assert [t for chunk in chunks for t in chunk.token_ids] == expected
            accepted[name] += chunks[-1].stats.accepted_tokens
        drafter.close()
    # 10 and 10 here. The package computes in float16 where MLX does float32, so where the
    # draft's two best tokens are close the two can draft differently, and one window drafted
    # otherwise moves the count by up to gamma (4): a draft fed wrong features agrees only by
    # chance, far below half.
    assert accepted["mlx"] > 0 and accepted["coreml"] >= 0.5 * accepted["mlx"], accepted


def test_inline_draft_runs_with_the_whole_target_forward_dispatched(target, reference_tokens,
                                                                    self4):
    """An inline drafter computes on the decoder's thread, so everything the target has to do
    for the step must be dispatched before it runs, or the GPU idles while the Neural Engine
    drafts. A layer's cache takes the window when the layer's graph is built: whenever a job
    runs beside the target, the last layer's cache must already hold what the first's does."""
    drafter = reference_drafter(self4)
    settings = DecodeSettings("mirror", 4, MirrorConfig(kappa=8, exit_layer=25, budget=4))
    session = Session(target, None, drafter, settings)
    seen = []
    run_pending = drafter.run_pending

    def observed() -> None:
        if drafter._pending:
            seen.append((session.cache[0].offset, session.cache[-1].offset))
        run_pending()

    drafter.run_pending = observed
    ids, expected = reference_tokens[0]
    out = [t for chunk in session.generate(ids, max_tokens=10) for t in chunk.token_ids]
    assert out == expected[:10]
    beside = [(first, last) for first, last in seen if first > len(ids)]
    assert beside and all(first == last for first, last in beside), seen
    drafter.close()


def test_an_inline_job_stops_when_the_landed_target_shows_it_useless(target, reference_tokens,
                                                                    self4, monkeypatch):
    """A slow inline draft must not hold the step once the target's verification has landed
    and rejected the window the early rollout continues; what it drafted stays in its cache.
    The output stays the target's. The overlap reported is the time the draft computed while
    the target did, not while the caller waited on it.

    The early rollout's forwards are made slow against the target on any machine: each
    waits until the target's step has landed (a fixed sleep raced the target's step, which
    takes longer on a slower or busier CPU), then sleeps a second plus twice that wait."""
    from mirror_mlx.decode import mirror

    verdicts = []
    result = mirror.Verdict.result
    monkeypatch.setattr(mirror.Verdict, "result", lambda self: verdicts.append(
        (result(self), len(self._judge.args[1]))) or verdicts[-1][0])
    drafter = reference_drafter(self4)
    early, running, run = [], [], drafter._run
    forward = drafter._executor.forward

    def slow_forward(*args, **kwargs):
        if early and early[-1] is None:
            start = time.perf_counter()
            assert running[-1].cancel.verdict._landing.landed.wait(60), "the target never landed"
            time.sleep(1.0 + 2 * (time.perf_counter() - start))
        return forward(*args, **kwargs)

    def observed(job):
        running.append(job)
        early.append(None if job.label == "early" else "other")
        done = run(job)
        if job.label == "early":
            early[-1] = (len(job.sequences[0]), done.forwards)
        return done

    drafter._executor.forward = slow_forward
    drafter._run = observed
    settings = DecodeSettings("mirror", 4, MirrorConfig(kappa=8, exit_layer=25, budget=0))
    session = Session(target, None, drafter, settings)
    ids, expected = reference_tokens[0]
    chunks = list(session.generate(ids, max_tokens=8))
    assert [t for chunk in chunks for t in chunk.token_ids] == expected[:8]
    assert chunks[-1].stats.overlap_fraction < 0.5, chunks[-1].stats.time_s
    jobs = [e for e in early if e not in (None, "other")]
    rejected = [forwards for (_, forwards), ((accepted, _), g) in zip(jobs, verdicts)
                if accepted < g]
    assert rejected and all(forwards <= 1 for forwards in rejected), (jobs, verdicts)
    drafter.close()


def test_an_input_set_is_given_again_only_a_hold_after_its_predict_returned(self4):
    """Core ML may read a predict's inputs for a while after it returns, so a set of input
    buffers is given again only INPUT_HOLD_S after that. Counted from when the set was taken
    instead, a fill that a busy CPU holds up (here, half a second) shortens the hold, and the
    reference refuses memory given to predict within it."""
    spec, weights = package_spec(self4, 512, 8)
    executor = CoreMLExecutor(ReferenceModel(spec, weights), spec,
                              mlx_embedding(self4.embed_tokens))
    take, delays = executor._take_inputs, [0.5]

    def held_up(s):
        inputs = take(s)
        time.sleep(delays.pop() if delays else 0.0)  # the first call's fill is held up
        return inputs

    executor._take_inputs = held_up
    executor.forward([1], 0, None, [0])
    time.sleep(INPUT_HOLD_S - 0.4)  # past the hold since the set was taken, not since predict
    assert executor.forward([2], 1, None, [0]).shape[0] == 1


def test_vanilla_sd_waits_on_futures_without_run_pending(target, reference_tokens, self4):
    """The vanilla decoder never calls run_pending: waiting on a job runs the queue."""
    drafter = reference_drafter(self4)
    session = Session(target, None, drafter, DecodeSettings("sd", 4))
    ids, expected = reference_tokens[0]
    out = [t for chunk in session.generate(ids, max_tokens=10) for t in chunk.token_ids]
    assert out == expected[:10]  # greedy: a shorter generation is a prefix of the longer one
    drafter.close()


def test_inline_queue_order_errors_and_close(target, small_draft):
    drafter = reference_drafter(small_draft, context=64)
    C = target.tokenizer.encode(PROMPTS[3])
    # Jobs wait for run_pending (or for a result), and run in order with reseeds.
    first = drafter.submit(Job([C], 3))
    assert not first.done()
    drafter.reseed(7)
    second = drafter.submit(Job([C], 3))
    drafter.run_pending()
    assert first.done() and second.done()
    assert first.result().rollouts[0].tokens == second.result().rollouts[0].tokens
    assert second.result().reused_tokens == len(C) - 1  # the cache held the context

    # Past the package's context: a clear error, and the cache starts afresh after it.
    too_long = drafter.submit(Job([C * 8], 2))
    with pytest.raises(PromptTooLong, match="holds 64 tokens"):
        too_long.result()
    again = drafter.submit(Job([C], 3)).result()
    assert again.reused_tokens == 0
    assert again.rollouts[0].tokens == first.result().rollouts[0].tokens

    pending = drafter.submit(Job([C], 3))
    drafter.close()
    assert pending.cancelled()
    drafter.close()


def test_reference_holds_callers_to_coreml_rules(small_draft):
    spec, weights = package_spec(small_draft, 64, 4)
    model = ReferenceModel(spec, weights)
    state = model.make_state()
    ok = {name: np.zeros(spec.input_shape(name, 2),
                         np.int32 if name == "write_pos" else np.float32)
          for name in ("embeds", "rope_cos", "rope_sin", "mask", "write_pos")}
    out = model.predict(ok, state)
    assert list(out) == ["logits_0", "logits_1"]
    assert out["logits_0"].dtype == np.float32 and out["logits_0"].shape == (1, 10000, 1, 2)
    with pytest.raises(RuntimeError, match="given to predict 0.0.* s ago"):
        model.predict(ok, state)  # too soon: Core ML may still hold these buffers
    for name, bad in [("mask", ok["mask"].astype(np.float16)),
                      ("write_pos", ok["write_pos"].astype(np.int64))]:
        with pytest.raises(RuntimeError, match="not convertible"):
            model.predict({**ok, name: bad}, state)
    with pytest.raises(RuntimeError, match="query length 3"):
        model.predict({n: np.zeros(spec.input_shape(n, 3), v.dtype) for n, v in ok.items()},
                      state)
    keys = state.read_state("k_cache")
    assert keys.dtype == np.float32 and keys.shape == spec.state_shape("k_cache")
    with pytest.raises(RuntimeError, match="not convertible"):
        state.write_state("k_cache", keys.astype(np.float16))
    state.write_state("k_cache", keys + 1)
    assert (state.read_state("k_cache") == keys + 1).all()


@pytest.mark.skipif(coreml_can_run(), reason="Core ML runs here: test_macos.py covers it")
def test_backend_choice_without_coreml(target, small_draft, small_draft_folder, package,
                                       package_spec):
    """Where Core ML cannot run, the MLX drafter runs the draft, whether the spec names the
    draft (with a package beside it) or the package (the draft it was exported from)."""
    assert beside(str(small_draft_folder), target) == (small_draft_folder, package)
    assert beside("self:2", target) is None
    # The package names the files it came from (not counting itself, inside the folder).
    assert package_spec.source_sha256 == source_sha256(small_draft_folder)
    C = target.tokenizer.encode(PROMPTS[4])
    expected = MLXDrafter(small_draft)
    want = expected.submit(Job([C], 4)).result().rollouts[0].tokens
    expected.close()
    drafters = [make_drafter(str(small_draft_folder), target)]
    with pytest.warns(UserWarning, match=r"Core ML cannot run here \(.*\): running .*small, "
                                         "the draft draft.mlpackage was exported from, with MLX"):
        drafters.append(make_drafter(str(package), target))
    # Where Core ML fails to load a package (coremltools raises a bare Exception), its draft
    # runs with MLX instead.
    with pytest.warns(UserWarning, match="Core ML could not load it .*; running its draft"):
        drafters.append(_open_or_mlx(package, target, str(small_draft_folder)))
    for drafter in drafters:
        assert isinstance(drafter, MLXDrafter)
        assert drafter.submit(Job([C], 4)).result().rollouts[0].tokens == want
        drafter.close()
    with pytest.raises(ModelLoadError, match="no such Core ML package"):
        make_drafter(str(small_draft_folder / "missing.mlpackage"), target)


def test_draft_device_runs_the_draft_with_mlx_there(target, small_draft, small_draft_folder,
                                                    package):
    """--draft-device cpu runs the draft with MLX on the CPU, on a Mac too: neither the
    package beside the draft nor a package named is opened with Core ML, and nothing warns."""
    C = target.tokenizer.encode(PROMPTS[4])
    expected = MLXDrafter(small_draft)
    want = expected.submit(Job([C], 4)).result().rollouts[0].tokens
    expected.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafters = [make_drafter(str(small_draft_folder), target, "cpu"),
                    make_drafter(str(package), target, "cpu")]
    for drafter in drafters:
        assert isinstance(drafter, MLXDrafter) and drafter.compute == "mlx:cpu"
        assert drafter.submit(Job([C], 4)).result().rollouts[0].tokens == want
        # Beside a target on the GPU, the scheduler counts the CPU as a unit of its own.
        assert draft_units(drafter)[0] == (mx.default_device() == mx.gpu)
        drafter.close()
    with pytest.raises(InvalidParameter, match="one of auto, cpu, gpu"):
        make_drafter(str(small_draft_folder), target, "npu")
    if not mx.is_available(mx.gpu):
        with pytest.raises(InvalidParameter, match="MLX has no gpu on this machine"):
            make_drafter(str(small_draft_folder), target, "gpu")
    with pytest.raises(InvalidParameter, match="a Drafter object runs where it was built"):
        Engine(target, mode="sd", draft=MLXDrafter(small_draft), draft_device="cpu")


def test_package_for_another_vocabulary_is_refused(package_spec, target):
    check_target(package_spec, target, "draft.mlpackage")  # the one it was made for passes
    config = dataclasses.replace(package_spec.config, target={"name": "other", "vocab": "0"})
    with pytest.raises(IncompatibleDraft, match="exported for another vocabulary"):
        check_target(dataclasses.replace(package_spec, config=config), target, "draft.mlpackage")


@pytest.mark.skipif(coreml_can_run(), reason="Core ML runs here")
def test_coremltools_without_its_bindings_is_not_core_ml():
    """coremltools imports and converts without its native module, which only its macOS wheels
    carry (for some Python versions): that is not a machine that runs Core ML."""
    if importlib.util.find_spec("coremltools") is None:
        pytest.skip("coremltools is not installed")
    folder = Path(importlib.util.find_spec("coremltools").origin).parent
    if list(folder.glob("libcoremlpython*")):
        pytest.skip("this coremltools has its Core ML bindings")
    assert "libcoremlpython is missing" in coremltools_problem()
