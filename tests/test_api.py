"""The public Engine on the real default model: chat in and out, cancellation and queueing
across threads, close, engines sharing a target, and the README's example as written."""

import re
import threading
import time
from pathlib import Path

from mirror_mlx.api import Engine, EngineBusy, EngineClosed
from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.errors import InvalidParameter

import pytest

LONG = "Write a long essay about the history of rivers."


def until(condition, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def hold(engine: Engine) -> tuple[threading.Thread, dict]:
    """A long generation on another thread, holding the engine until cancelled."""
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=engine.generate(LONG, max_tokens=300)))
    thread.start()
    until(lambda: engine.busy)
    return thread, out


def test_chat_messages_in_and_out(target):
    engine = Engine(target, mode="ar")
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a color."}]
    first = engine.chat(messages, max_tokens=12)
    assert first.message == {"role": "assistant", "content": first.text} and first.text.strip()
    messages += [first.message, {"role": "user", "content": "Another one."}]
    second = engine.chat(messages, max_tokens=12)
    # The whole first exchange came from the cache.
    assert second.stats.cached_prompt_tokens > len(engine.encode(messages[:2])) - 1
    assert second.text.strip()

    for bad in ("Name a color.", [], [{"role": "robot", "content": "hi"}],
                [{"role": "user", "content": 3}], [{"role": "user"}], ["hello"]):
        with pytest.raises(InvalidParameter):
            engine.chat(bad)
    with pytest.raises(InvalidParameter, match="outside the vocabulary"):
        engine.generate([1, 2, target.vocab_size])


def test_cancel_from_another_thread_and_one_generation_at_a_time(target):
    engine = Engine(target, mode="ar")
    thread, out = hold(engine)
    with pytest.raises(EngineBusy):
        engine.generate("Hi.", max_tokens=4, wait=0)
    started = time.monotonic()
    with pytest.raises(EngineBusy, match="waited 0.2"):
        engine.generate("Hi.", max_tokens=4, wait=0.2)
    # Not before its time; after it, only as late as a busy machine wakes a thread (a call
    # that waited for the holder instead would not have raised: the holder runs until
    # cancelled below).
    assert 0.2 <= time.monotonic() - started < 10

    # Callers queue up and are served in arrival order.
    order, queued = [], []
    for name in ("first", "second", "third"):
        t = threading.Thread(target=lambda n=name: order.append(
            (n, engine.generate(f"Say {n}.", max_tokens=6).token_ids)))
        t.start()
        queued.append(t)
        until(lambda: engine.waiting == len(queued))
    # A queued call whose cancel is set leaves the line without running.
    cancel = threading.Event()
    gave_up = {}
    t = threading.Thread(target=lambda: gave_up.update(r=engine.generate(
        "Never mind.", max_tokens=6, cancel=cancel)))
    t.start()
    until(lambda: engine.waiting == 4)
    cancel.set()
    t.join(timeout=60)  # bounds a hang only: the assertions say what happened
    assert gave_up["r"].stats.finish_reason == "cancelled" and gave_up["r"].token_ids == []
    assert engine.waiting == 3

    engine.cancel()
    thread.join(timeout=60)
    assert out["r"].stats.finish_reason == "cancelled" and len(out["r"].token_ids) < 300
    for t in queued:
        t.join(timeout=60)
    assert [n for n, _ in order] == ["first", "second", "third"]
    fresh = Engine(target, mode="ar")
    assert order[2][1] == fresh.generate("Say third.", max_tokens=6).token_ids
    assert not engine.busy and engine.waiting == 0

    # A second stream on the thread that holds the engine would wait forever: refused.
    stream = engine.stream("Hello.", max_tokens=6)
    next(stream)
    with pytest.raises(EngineBusy, match="already generating"):
        engine.generate("Hi.", max_tokens=4)
    stream.close()
    assert not engine.busy


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads in /proc")
@pytest.mark.parametrize("mode", ["ar", "mirror"])
def test_callers_on_fresh_threads_leave_no_thread_behind(target, mode):
    """MLX keeps a thread for every thread that ever built an array: generating on each
    caller's thread, a server (a thread per request) gained a thread per reply."""
    def threads() -> int:
        return len(list(Path("/proc/self/task").iterdir()))

    def on_a_fresh_thread(n: int) -> None:
        for i in range(n):
            t = threading.Thread(target=lambda i=i: engine.generate(
                f"Say {i}.", max_tokens=3, sampling=SamplingParams(temperature=1.0, seed=i)))
            t.start()
            t.join()

    def settled_at_most(before: int) -> bool:
        # A leaked thread stays; a step's helper thread (mirror's landing) soon ends.
        end = time.monotonic() + 5
        while threads() > before and time.monotonic() < end:
            time.sleep(0.05)
        return threads() <= before

    with Engine(target, mode=mode) as engine:
        on_a_fresh_thread(1)  # the engine's own threads start
        before = threads()
        on_a_fresh_thread(4)
        assert settled_at_most(before)
    # Engine after engine (closed, or dropped) reuse the worker the first one started. (Not
    # the draft's: a speculative engine's draft worker leaves its MLX thread when it closes.)
    for _ in range(3):
        with Engine(target, mode="ar") as engine:
            on_a_fresh_thread(1)
        Engine(target, mode="ar").generate("Hi.", max_tokens=2)
    assert settled_at_most(before)


def test_close_stops_the_draft_worker_and_later_calls_fail(target):
    def drafting() -> bool:
        return any(t.name.startswith("mirror-draft") for t in threading.enumerate())

    engine = Engine(target, mode="sd")
    thread, out = hold(engine)
    until(drafting)
    engine.close()  # from another thread than the one generating
    thread.join(timeout=60)
    assert out["r"].stats.finish_reason == "cancelled"
    until(lambda: not drafting())
    engine.close()  # idempotent
    with pytest.raises(EngineClosed):
        engine.generate("Hi.", max_tokens=4)
    with Engine(target, mode="ar") as scoped:
        scoped.generate("Hi.", max_tokens=2)
    with pytest.raises(EngineClosed):
        scoped.stream("Hi.")


def test_engines_share_a_target_without_sharing_state(target):
    """A mode switch is a new Engine on the same loaded target; greedy SD gives the target's
    own tokens (lossless); each engine keeps its own conversation cache."""
    ar, sd = Engine(target, mode="ar"), Engine(target, mode="sd")
    with sd:
        prompt = [{"role": "user", "content": "Name three birds."}]
        a = ar.generate(prompt, max_tokens=6)
        s = sd.generate(prompt, max_tokens=6)
        assert s.token_ids == a.token_ids and s.stats.mode == "sd"
        assert s.stats.target_steps > 0
        assert s.stats.cached_prompt_tokens == 0  # its own cache, not the AR engine's
    again = ar.generate(prompt, max_tokens=6)
    assert again.token_ids == a.token_ids
    assert again.stats.cached_prompt_tokens == len(ar.encode(prompt)) - 1


def readme_example() -> str:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme.split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs(default_gguf, capsys):
    exec(compile(readme_example(), "README.md", "exec"), {})
    out = capsys.readouterr().out
    assert "cancelled | mode mirror" in out and "tok/s" in out, out
