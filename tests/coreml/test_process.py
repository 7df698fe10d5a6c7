"""The package in a process of its own (draft/coreml_process.py), on Linux through the
reference executor: its answers are the in-process reference's, bit for bit, and a predict that
hangs, crashes its process or raises costs the generation its draft and nothing more."""

import os
import signal
import time
from functools import partial

from mirror_mlx.decode.mirror import MirrorConfig
from mirror_mlx.draft.base import DraftLost, Job
from mirror_mlx.draft.coreml_draft import CoreMLDrafter, CoreMLExecutor, mlx_embedding
from mirror_mlx.draft.coreml_package import draft_weights
from mirror_mlx.draft.coreml_process import ProcessRuntime
from mirror_mlx.draft.load import load_draft
from mirror_mlx.session import DecodeSettings, Session

import numpy as np
import pytest

from coreml_export.convert import package_spec
from coreml_export.reference import ReferenceModel
from tests.prompts import PROMPTS

SETTINGS = DecodeSettings("mirror", 4, MirrorConfig(kappa=8, exit_layer=25, budget=4))
MAX_TOKENS = 16


class Faulty(ReferenceModel):
    """The reference, but its `at`-th predict hangs, kills its process, or raises."""

    def __init__(self, spec, weights, at: int, fault: str):
        super().__init__(spec, weights)
        self.at, self.fault, self.calls = at, fault, 0

    def predict(self, inputs, state):
        self.calls += 1
        if self.calls == self.at:
            if self.fault == "hang":
                time.sleep(3600)
            if self.fault == "crash":
                os.kill(os.getpid(), signal.SIGSEGV)
            raise RuntimeError("the Neural Engine went away")
        return super().predict(inputs, state)


@pytest.fixture(scope="module")
def self4(target):
    return load_draft("self:4", target)


@pytest.fixture(scope="module")
def expected(target):
    ids = target.tokenizer.encode(PROMPTS[0])
    session = Session(target, None, None, DecodeSettings("ar", 4))
    return ids, [t for c in session.generate(ids, max_tokens=MAX_TOKENS) for t in c.token_ids]


def drafter(net, runtime_of) -> CoreMLDrafter:
    spec, weights = package_spec(net, 512, 8)
    return CoreMLDrafter(CoreMLExecutor(runtime_of(spec, weights), spec,
                                        mlx_embedding(net.embed_tokens)))


def test_answers_are_the_in_process_references(target, self4, expected):
    """The same jobs, in and out of process: equal rollouts and probabilities (float32, bit
    for bit), a branch's KV slots moved inside the child's state, and a lossless generation."""
    ids, tokens = expected
    here = drafter(self4, ReferenceModel)
    there = drafter(self4, lambda spec, weights: ProcessRuntime(
        partial(ReferenceModel, spec, weights)))
    jobs = [Job([ids], 3), Job([ids + tokens[:2], ids + tokens[:1] + [tokens[3]]], 2)]
    for job in jobs:
        a, b = here.submit(job).result(), there.submit(job).result()
        for x, y in zip(a.rollouts, b.rollouts, strict=True):
            assert x.tokens == y.tokens and np.array_equal(x.top_ids, y.top_ids)
            assert np.array_equal(x.top_probs, y.top_probs)
    session = Session(target, None, there, SETTINGS)
    chunks = list(session.generate(ids, max_tokens=MAX_TOKENS))
    assert [t for c in chunks for t in c.token_ids] == tokens
    assert chunks[-1].stats.accepted_tokens > 0
    runtime = there._executor.runtime
    there.close()
    assert runtime._child.poll() is not None  # closing the drafter ends its process
    with pytest.raises(DraftLost, match="closed"):
        runtime.make_state()


@pytest.mark.parametrize("fault, why, lost", [
    ("hang", "did not return within 3 s", True),
    ("crash", "signal SIGSEGV", True),
    ("raise", "the Neural Engine went away", False),
])
def test_a_predict_that_fails_costs_the_draft_only(target, self4, expected, fault, why, lost):
    """Mid-generation, the child's predict hangs (stopped after the bound), kills its process,
    or raises: the generation finishes with the target alone, losslessly. After a hang or a
    crash the session stops asking the draft (it says why); after an error it drafts again."""
    ids, tokens = expected
    faulty = drafter(self4, lambda spec, weights: ProcessRuntime(
        partial(Faulty, spec, weights, 12, fault), wait_s=3.0))
    session = Session(target, None, faulty, SETTINGS)
    with pytest.warns(UserWarning, match=why):
        chunks = list(session.generate(ids, max_tokens=MAX_TOKENS))
    stats = chunks[-1].stats
    assert [t for c in chunks for t in c.token_ids] == tokens
    assert why in stats.draft_fault
    assert (faulty._executor.runtime._child.poll() is not None) == lost
    session.reset()
    again = list(session.generate(ids, max_tokens=MAX_TOKENS))
    assert [t for c in again for t in c.token_ids] == tokens
    assert (again[-1].stats.draft_tokens == 0) == lost
    assert (why in again[-1].stats.draft_fault) == lost
    faulty.close()


def test_a_model_that_cannot_load_is_a_clear_error(small_draft, package):
    """What the child raised while loading the model reaches the caller."""
    weights = {k: v + 1 for k, v in draft_weights(small_draft).items()}
    with pytest.raises(RuntimeError, match="ModelLoadError: .* not exported from these weights"):
        ProcessRuntime(partial(ReferenceModel.for_package, package, weights))


def test_a_call_interrupted_while_it_waits_keeps_the_draft_in_step(small_draft):
    """Ctrl-C while the parent waits for a reply: the next call reads that reply first and
    then its own, so the draft is not left one reply behind for the rest of the session."""
    spec, weights = package_spec(small_draft, 64, 4)
    runtime = ProcessRuntime(partial(ReferenceModel, spec, weights))
    state = runtime.make_state()
    poll = runtime._conn.poll

    def interrupted(timeout):
        runtime._conn.poll = poll
        raise KeyboardInterrupt

    runtime._conn.poll = interrupted
    with pytest.raises(KeyboardInterrupt):
        runtime.predict(inputs(spec, 1), state)
    out = runtime.predict(inputs(spec, 2), state)
    assert out["logits_0"].shape[-1] == 2  # its own reply, not the interrupted call's
    assert state.read_state("k_cache").shape == spec.state_shape("k_cache")
    runtime.close()


def inputs(spec, s: int) -> dict:
    return {n: np.zeros(spec.input_shape(n, s), spec.input_dtype(n)) for n in spec.inputs}
