"""Request bodies the server must refuse, drawn by Hypothesis over the OpenAI request schema
(benchmarks/reliability.py sends them): wrong types, missing and unknown fields, out-of-range
and huge numbers, deep nesting, invalid UTF-8, random bytes, non-objects; and a few valid but
odd ones (lone surrogates, control characters, empty stop lists) that may be served.

The schema is written out here, not taken from apps/server/request.py: a check should not
share the code it checks."""

from __future__ import annotations

import json
from dataclasses import dataclass

from hypothesis import strategies as st


@dataclass(frozen=True)
class Malformed:
    kind: str
    family: str
    body: bytes
    must_fail: bool = True  # False: valid but odd (a huge seed), may be served


def _unlike(*neutral):
    """A JSON value that is none of `neutral` (True is not 1 here, as in request.py)."""
    return lambda v: not any(v == n and isinstance(v, bool) == isinstance(n, bool)
                             for n in neutral)


SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12))
ANY = st.recursive(SCALAR, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
NOT_INT = st.one_of(st.floats(), st.text(max_size=6), st.booleans(), st.lists(SCALAR,
                                                                            max_size=2))
NOT_NUMBER = st.one_of(st.text(max_size=6), st.booleans(), st.lists(SCALAR, max_size=2),
                       st.dictionaries(st.text(max_size=3), SCALAR, max_size=2))
NON_STRING = st.one_of(st.integers(), st.floats(), st.booleans(), st.lists(SCALAR, max_size=2))
MISSING = object()


def bad_message():
    role = st.sampled_from(["system", "user", "assistant"])
    return st.one_of(
        SCALAR, st.lists(SCALAR, max_size=2),
        st.fixed_dictionaries({"role": st.text(max_size=10).filter(
            lambda r: r not in ("system", "user", "assistant")), "content": st.text()}),
        st.fixed_dictionaries({"role": role, "content": st.one_of(
            st.none(), st.integers(), st.booleans(), st.just([]),
            st.dictionaries(st.text(max_size=3), SCALAR, max_size=2),
            st.lists(st.fixed_dictionaries({"type": st.text(max_size=9).filter(
                lambda t: t != "text"), "image_url": SCALAR}), min_size=1, max_size=2))}),
        st.fixed_dictionaries({"role": role, "content": st.text(), "tool_calls": ANY}))


def bad_fields(max_tokens: int) -> dict[str, st.SearchStrategy]:
    """Per field, values the server must refuse (MISSING: the field left out)."""
    neutral = {"n": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
               "logprobs": (None, False), "top_logprobs": (None, 0), "logit_bias": (None, {}),
               "echo": (False,), "best_of": (1,), "suffix": (None, ""), "tools": (None, []),
               "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
               "parallel_tool_calls": (None, False, True)}
    tokens = st.one_of(st.integers(max_value=0), st.integers(min_value=max_tokens + 1), NOT_INT)
    return {
        "messages": st.one_of(st.just(MISSING), st.none(), st.just([]), NON_STRING.filter(
            lambda v: not isinstance(v, list)), st.text(), st.lists(bad_message(), min_size=1,
                                                                   max_size=3)),
        "prompt": st.one_of(
            st.just(MISSING), st.none(), st.just(""), st.just([]), st.just([""]), st.integers(),
            st.floats(), st.booleans(), st.lists(st.text(), min_size=2, max_size=3),
            st.lists(st.one_of(st.integers(max_value=-1), st.integers(min_value=10**7)),
                     min_size=1, max_size=3),
            st.lists(st.one_of(st.booleans(), st.floats(), st.none()), min_size=1, max_size=3),
            st.dictionaries(st.text(max_size=4), SCALAR, max_size=2)),
        "max_tokens": tokens, "max_completion_tokens": tokens,
        "temperature": st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=2.0,
                                                                       exclude_min=True),
                                 NOT_NUMBER),
        "top_p": st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0, exclude_min=True),
                           NOT_NUMBER),
        "top_k": st.one_of(st.integers(max_value=-1), NOT_INT),
        "min_p": st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=0.999999,
                                                                 exclude_min=True), NOT_NUMBER),
        "seed": st.one_of(st.integers(max_value=-1), NOT_INT),
        "stop": st.one_of(st.integers(), st.booleans(), st.just(""), st.just([""]),
                          st.lists(st.text(min_size=1, max_size=4), min_size=5, max_size=8),
                          st.lists(NON_STRING, min_size=1, max_size=3),
                          st.text(min_size=257, max_size=400),
                          st.dictionaries(st.text(max_size=3), SCALAR, min_size=1,
                                          max_size=2)),
        "stream": st.one_of(st.integers(), st.floats(), st.text(max_size=5),
                            st.lists(SCALAR, min_size=1, max_size=2)),
        "stream_options": st.one_of(
            st.integers().filter(bool), st.text(min_size=1, max_size=5),
            st.lists(SCALAR, min_size=1, max_size=2),
            st.fixed_dictionaries({"include_usage": st.one_of(st.none(), st.integers(),
                                                              st.text(max_size=3))})),
        "model": NON_STRING, "user": NON_STRING,
        **{name: ANY.filter(_unlike(*values)) for name, values in neutral.items()},
    }


ALLOWED = {  # request.py's fields per route; any other is refused
    "chat": {"messages", "max_completion_tokens", "tools", "tool_choice", "response_format",
             "parallel_tool_calls", "top_logprobs"},
    "completion": {"prompt", "echo", "best_of", "suffix"},
}
COMMON = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream",
          "stream_options", "model", "user", "metadata", "store", "service_tier", "n",
          "presence_penalty", "frequency_penalty", "logprobs", "logit_bias"}
VALID = {"chat": {"messages": [{"role": "user", "content": "Hi"}]}, "completion": {"prompt": "Hi"}}
VALID_OPTIONS = {"stream": st.booleans(), "temperature": st.floats(0, 2),
                 "top_p": st.floats(0.01, 1), "seed": st.integers(0, 2**31),
                 "stop": st.lists(st.text(min_size=1, max_size=5), max_size=4),
                 "user": st.text(max_size=8), "n": st.just(1),
                 "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}


def _dump(body) -> bytes:
    return json.dumps(body).encode()  # NaN and Infinity as such: refused as not JSON


@st.composite
def broken_body(draw, kind: str, max_tokens: int) -> Malformed:
    """A valid request with one to three fields made wrong (or unknown to the route)."""
    bad = bad_fields(max_tokens)
    names = sorted(n for n in bad if n in COMMON | ALLOWED[kind])
    body = {**VALID[kind], "max_tokens": 1,
            **draw(st.fixed_dictionaries({}, optional=VALID_OPTIONS))}
    for name in draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True)):
        value = draw(bad[name])
        if value is MISSING:
            body.pop(name, None)
        else:
            body[name] = value
    if draw(st.booleans()):
        unknown = draw(st.text(min_size=1, max_size=12).filter(
            lambda k: k not in COMMON | ALLOWED[kind]))
        body[unknown] = draw(ANY)
    return Malformed(kind, "wrong fields", _dump(body))


@st.composite
def deep(draw, kind: str) -> Malformed:
    n = draw(st.integers(2, 300_000))
    open_, close = draw(st.sampled_from([(b"[", b"]"), (b'{"a": ', b"}")]))
    inner = open_ * n + (close * n if draw(st.booleans()) else b"")
    field_ = b'"messages"' if kind == "chat" else b'"prompt"'
    return Malformed(kind, "deep nesting", b"{" + field_ + b": " + inner + b"}")


@st.composite
def huge_number(draw, kind: str, max_tokens: int) -> Malformed:
    name = draw(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "min_p",
                                 "seed"]))
    digits = draw(st.integers(19, 6000))
    number = (b"-" if draw(st.booleans()) else b"") + b"9" * digits
    if draw(st.booleans()):
        number += b".5e" + str(draw(st.integers(0, 400))).encode()  # never small
    body = _dump({**VALID[kind], "max_tokens": 1, name: 0})[:-1] + b", \"" + \
        name.encode() + b"\": " + number + b"}"
    # More digits than int() takes are refused; within that, a huge seed or top_k is valid.
    valid = name in ("seed", "top_k") and not number.startswith(b"-") and \
        b"." not in number and digits <= 4300
    return Malformed(kind, "huge number", body, must_fail=not valid)


@st.composite
def bad_utf8(draw, kind: str) -> Malformed:
    raw = draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80", b"\xf8\x88\x80",
                                b"\xe2\x82"]))
    text = b'"H' + raw + b'i"'
    inner = b'[{"role": "user", "content": ' + text + b"}]" if kind == "chat" else text
    field_ = b'"messages"' if kind == "chat" else b'"prompt"'
    return Malformed(kind, "invalid UTF-8", b"{" + field_ + b": " + inner + b', "max_tokens": 1}')


@st.composite
def odd_but_valid(draw, kind: str) -> Malformed:
    """Valid JSON of the schema that is unusual: lone surrogates, control characters, empty
    stop lists. A 4xx or a reply; never a 5xx."""
    text = draw(st.text(alphabet=st.characters(codec=None, exclude_categories=()),
                        min_size=1, max_size=20))
    body = {**VALID[kind], "max_tokens": 1, "stop": draw(st.sampled_from([[], None, ["\x00"]]))}
    if kind == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    return Malformed(kind, "odd text", _dump(body), must_fail=False)


def malformed(max_tokens: int) -> st.SearchStrategy[Malformed]:
    def of_kind(kind):
        return st.one_of(
            broken_body(kind, max_tokens), deep(kind), huge_number(kind, max_tokens),
            bad_utf8(kind), odd_but_valid(kind),
            st.binary(max_size=300).map(lambda b: Malformed(kind, "random bytes", b)),
            ANY.filter(lambda v: not isinstance(v, dict)).map(
                lambda v: Malformed(kind, "not an object", _dump(v))))
    return st.sampled_from(["chat", "completion"]).flatmap(of_kind)
