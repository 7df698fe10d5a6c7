"""Every input file the CLI reads, fuzzed: each broken file goes through the real CLI in a child
process, which must end with a one-line `mirror-mlx: error:` and exit status 1 — never a
signal, a hang, a traceback, or output from a model it should have refused.

    python benchmarks/fuzz_files.py OUT [--kinds gguf,...] [--limit N] [--jobs 2] [--timeout 120]

Kinds: gguf (truncated at every structural boundary, flipped header and tensor-table bytes,
absurd counts and shapes, wrong dtypes and metadata, NaN/inf weights), mlx-lm (config.json,
safetensors), tokenizer (an mlx-lm folder's tokenizer files), draft (a `distill` draft folder),
exit-head, coreml (a draft package: manifest, spec, metadata, its draft) and prompts (the bench's
Spec-Bench files). The small valid files each case starts from are written here, from a tiny
random llama with the default model's tokenizer. Writes OUT/fuzz.json and OUT/fuzz.md: counts
per kind and outcome, and each case that was not clean with its stderr's last line.

Outcomes: clean (status 1, one `mirror-mlx: error:` line, nothing else on stderr but
warnings), accepted (status 0 where the file may well be valid: a flipped byte in a name),
silent (status 0 where the file is broken), traceback, crash (a signal), hang (the timeout),
unclear (any other failure).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import mirror_mlx  # noqa: F401  (before mlx: OpenBLAS)
from mirror_mlx.models.default import ensure_default_model
from mirror_mlx.models.gguf import read_header

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("gguf", "mlx-lm", "tokenizer", "draft", "exit-head", "coreml", "prompts")
TINY = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            vocab_size=49152, rope_theta=10000.0, max_position_embeddings=256,
            tie_word_embeddings=True)
GEN = ("generate", "--prompt", "hi", "--max-tokens", "2", "--no-chat-template")


@dataclass
class Case:
    kind: str
    name: str
    argv: tuple[str, ...]  # after `python -m mirror_mlx.cli`
    must_fail: bool = True


@dataclass
class Result:
    kind: str
    name: str
    outcome: str
    status: int | None
    seconds: float
    last_line: str


# ---------------------------------------------------------------- GGUF: writer with boundaries

U8, I32, U32, F32, BOOL, STR, ARR, U64 = 0, 5, 4, 6, 7, 8, 9, 10
_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
        11: "<q", 12: "<d"}


class GGUF:
    """A GGUF file as (metadata, tensors), serialized with the offset of every field."""

    def __init__(self, kvs: list, tensors: list, alignment: int = 32):
        self.kvs = kvs  # [(key, vtype, value)]; arrays: value = (item type, list)
        self.tensors = tensors  # [(name, gguf shape, ggml type, raw bytes)]
        self.alignment = alignment

    def serialize(self, n_tensors=None, n_kv=None, version=3) -> tuple[bytes, list]:
        out, marks = bytearray(), []

        def mark(label):
            marks.append((len(out), label))

        def s(text: str):
            raw = text.encode()
            out.extend(struct.pack("<Q", len(raw)) + raw)

        def value(vtype, v):
            if vtype == STR:
                s(v)
            elif vtype == ARR:
                itype, items = v
                out.extend(struct.pack("<IQ", itype, len(items)))
                if itype == STR:
                    for x in items:
                        s(x)
                else:
                    out.extend(struct.pack(f"<{len(items)}{_FMT[itype][1]}", *items))
            else:
                out.extend(struct.pack(_FMT[vtype], v))

        mark("magic")
        out.extend(b"GGUF")
        mark("version")
        out.extend(struct.pack("<I", version))
        mark("tensor count")
        out.extend(struct.pack("<Q", len(self.tensors) if n_tensors is None else n_tensors))
        mark("kv count")
        out.extend(struct.pack("<Q", len(self.kvs) if n_kv is None else n_kv))
        for key, vtype, v in self.kvs:
            mark(f"kv {key}")
            s(key)
            mark(f"kv {key} type")
            out.extend(struct.pack("<I", vtype))
            mark(f"kv {key} value")
            value(vtype, v)
        offset, offsets = 0, []
        for _, _, _, raw in self.tensors:
            offsets.append(offset)
            offset += -(-len(raw) // self.alignment) * self.alignment
        for (name, shape, ttype, _), off in zip(self.tensors, offsets):
            mark(f"tensor info {name}")
            s(name)
            mark(f"tensor info {name} dims")
            out.extend(struct.pack("<I", len(shape)))
            mark(f"tensor info {name} shape")
            out.extend(struct.pack(f"<{len(shape)}Q", *shape))
            mark(f"tensor info {name} type")
            out.extend(struct.pack("<I", ttype))
            mark(f"tensor info {name} offset")
            out.extend(struct.pack("<Q", off))
        mark("padding before data")
        out.extend(bytes(-len(out) % self.alignment))
        for name, _, _, raw in self.tensors:
            mark(f"data {name}")
            out.extend(raw)
            mark(f"data {name} middle") if len(raw) > 64 else None
            out.extend(bytes(-len(out) % self.alignment))
        return bytes(out), marks

    def with_kv(self, key: str, vtype=None, value=None, drop: bool = False) -> GGUF:
        kvs = [kv for kv in self.kvs if kv[0] != key]
        if not drop:
            kvs.append((key, vtype, value))
        return GGUF(kvs, self.tensors, self.alignment)

    def with_tensor(self, name: str, shape=None, ttype=None, raw=None, drop=False) -> GGUF:
        tensors = []
        for t in self.tensors:
            if t[0] != name:
                tensors.append(t)
            elif not drop:
                tensors.append((name, shape or t[1], t[2] if ttype is None else ttype,
                                t[3] if raw is None else raw))
        return GGUF(self.kvs, tensors, self.alignment)


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    from mlx_lm.models import llama

    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(TINY))
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def tiny_gguf(tokenizer_source: Path) -> GGUF:
    meta = read_header(tokenizer_source).metadata
    a = "llama"
    kvs = [
        ("general.architecture", STR, a),
        (f"{a}.block_count", U32, TINY["num_hidden_layers"]),
        (f"{a}.context_length", U32, TINY["max_position_embeddings"]),
        (f"{a}.embedding_length", U32, TINY["hidden_size"]),
        (f"{a}.feed_forward_length", U32, TINY["intermediate_size"]),
        (f"{a}.attention.head_count", U32, TINY["num_attention_heads"]),
        (f"{a}.attention.head_count_kv", U32, TINY["num_key_value_heads"]),
        (f"{a}.attention.layer_norm_rms_epsilon", F32, TINY["rms_norm_eps"]),
        (f"{a}.rope.freq_base", F32, TINY["rope_theta"]),
        ("tokenizer.ggml.model", STR, meta["tokenizer.ggml.model"]),
        ("tokenizer.ggml.pre", STR, meta["tokenizer.ggml.pre"]),
        ("tokenizer.ggml.tokens", ARR, (STR, list(meta["tokenizer.ggml.tokens"]))),
        ("tokenizer.ggml.token_type", ARR, (I32, list(meta["tokenizer.ggml.token_type"]))),
        ("tokenizer.ggml.merges", ARR, (STR, list(meta["tokenizer.ggml.merges"]))),
        ("tokenizer.ggml.bos_token_id", U32, meta["tokenizer.ggml.bos_token_id"]),
        ("tokenizer.ggml.eos_token_id", U32, meta["tokenizer.ggml.eos_token_id"]),
        ("tokenizer.chat_template", STR, meta["tokenizer.chat_template"]),
    ]
    tensors = []
    for key, w in tiny_weights().items():
        if key == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif key == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, i, rest = key.split(".", 3)
            name = f"blk.{i}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
        # F16 keeps the files small; the norms stay F32 (two tensor types in one file).
        dtype, ttype = (np.float32, 0) if w.ndim == 1 else (np.float16, 1)
        tensors.append((name, tuple(reversed(w.shape)), ttype, w.astype(dtype).tobytes()))
    return GGUF(kvs, tensors)


def gguf_cases(base: GGUF, work: Path, rng: random.Random) -> list[Case]:
    cases: list[Case] = []
    good, marks = base.serialize()

    def add(name: str, data: bytes, must_fail: bool = True, chat: bool = False):
        path = work / f"{len(cases):03d}.gguf"
        path.write_bytes(data)
        # A chat template is read only where it is used.
        gen = GEN[1:-1] if chat else GEN[1:]
        cases.append(Case("gguf", name, ("generate", "--model", str(path), *gen), must_fail))

    add("valid file", good, must_fail=False)
    # Truncated at every structural boundary (the tokens and merges arrays: at their start,
    # a few items in, and halfway), and one byte short of each.
    cuts = {}
    for at, label in marks:
        cuts.setdefault(at, f"cut at {label}")
        cuts.setdefault(at + 1, f"cut 1 byte into {label}")
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        start = next(at for at, label in marks if label == f"kv {key} value")
        end = next(at for at, label in marks if at > start)
        cuts[start + 13] = f"cut in {key}'s first item"
        cuts[(start + end) // 2] = f"cut halfway through {key}"
    cuts[len(good) - 1] = "last byte missing"
    for at, label in sorted(cuts.items()):
        if at < len(good):
            add(label, good[:at])
    header_end = next(at for at, label in marks if label == "padding before data")
    table_start = next(at for at, label in marks if label.startswith("tensor info"))
    # Random byte flips in the metadata and in the tensor table.
    for region, lo, hi, n in (("metadata", 4, table_start, 30),
                              ("tensor table", table_start, header_end, 30)):
        for i in range(n):
            blob = bytearray(good)
            for _ in range(rng.randint(1, 3)):
                blob[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
            add(f"{region} flip #{i}", bytes(blob), must_fail=False)
    # Absurd counts.
    for n in (0, len(base.tensors) + 1, 2**31, 2**63):
        add(f"tensor count {n}", base.serialize(n_tensors=n)[0])
    for n in (0, len(base.kvs) + 1, 2**40, 2**64 - 1):
        add(f"kv count {n}", base.serialize(n_kv=n)[0])
    for v in (1, 4, 2**32 - 1):
        add(f"version {v}", base.serialize(version=v)[0])
    # Absurd shapes and wrong types in the tensor table.
    emb = "token_embd.weight"
    shape = next(t[1] for t in base.tensors if t[0] == emb)
    for bad in ((0, shape[1]), (shape[0], 0), (2**40, 2**40), (2**63, 2), (2**64 - 1,),
                (shape[0] * 2, shape[1] // 2), (shape[1], shape[0]), (*shape, 1, 1, 1),
                (shape[0], shape[1] - 1), (shape[0],)):
        add(f"{emb} shape {bad}", base.with_tensor(emb, shape=bad).serialize()[0])
    for ttype, label in ((0, "F32 over F16 data"), (2, "Q4_0 over F16 data"),
                         (8, "Q8_0 over F16 data"), (99, "unknown type 99"),
                         (2**31, "type 2^31"), (16, "IQ2_XXS")):
        add(f"{emb} {label}", base.with_tensor(emb, ttype=ttype).serialize()[0])
    add("norm F16 over F32 data", base.with_tensor("output_norm.weight", ttype=1).serialize()[0])
    add("missing tensor blk.1.ffn_up", base.with_tensor("blk.1.ffn_up.weight", drop=True)
        .serialize()[0])
    add("missing token_embd", base.with_tensor(emb, drop=True).serialize()[0])
    extra = GGUF(base.kvs, base.tensors + [("blk.7.attn_q.weight", (64, 64), 1,
                                            bytes(64 * 64 * 2))])
    add("tensor for layer 7 of 2", extra.serialize()[0])
    dup = GGUF(base.kvs, base.tensors + [base.tensors[-1]])
    add("tensor listed twice", dup.serialize()[0])
    unknown = GGUF(base.kvs, base.tensors + [("mystery.weight", (4,), 0, bytes(16))])
    add("unknown tensor name", unknown.serialize()[0])
    for n_dims in (0, 5, 2**31):
        blob, m = base.serialize()
        at = next(a for a, label in m if label == f"tensor info {emb} dims")
        add(f"{emb} {n_dims} dims", blob[:at] + struct.pack("<I", n_dims) + blob[at + 4:])
    blob, m = base.serialize()
    at = next(a for a, label in m if label == f"tensor info {emb} offset")
    for off in (3, 2**40, 2**64 - 32):
        add(f"{emb} offset {off}", blob[:at] + struct.pack("<Q", off) + blob[at + 8:])
    at = next(a for a, label in m if label == f"tensor info {emb}")
    add(f"{emb} name length 2^62", blob[:at] + struct.pack("<Q", 2**62) + blob[at + 8:])
    add(f"{emb} name not UTF-8", blob[:at + 8] + b"\xff" + blob[at + 9:])
    # Metadata: missing keys, wrong value types, absurd values.
    a = "llama"
    for key in (f"{a}.block_count", f"{a}.embedding_length", f"{a}.feed_forward_length",
                f"{a}.attention.head_count", f"{a}.attention.layer_norm_rms_epsilon",
                "general.architecture", "tokenizer.ggml.tokens", "tokenizer.ggml.merges",
                "tokenizer.ggml.model", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.token_type", "tokenizer.chat_template"):
        add(f"missing {key}", base.with_kv(key, drop=True).serialize()[0],
            # A file may leave out its chat template, token types and end-of-text token.
            must_fail=key not in ("tokenizer.chat_template", "tokenizer.ggml.token_type",
                                  "tokenizer.ggml.eos_token_id"))
    for key, vtype, value in (
            (f"{a}.block_count", STR, "two"), (f"{a}.block_count", U32, 0),
            (f"{a}.block_count", U32, 3), (f"{a}.block_count", U64, 2**40),
            (f"{a}.block_count", I32, -2), (f"{a}.block_count", F32, float("nan")),
            (f"{a}.embedding_length", U32, 0), (f"{a}.embedding_length", U32, 65),
            (f"{a}.embedding_length", U64, 2**50),
            (f"{a}.feed_forward_length", U32, 0), (f"{a}.feed_forward_length", U64, 2**40),
            (f"{a}.attention.head_count", U32, 0), (f"{a}.attention.head_count", U32, 3),
            (f"{a}.attention.head_count", U32, 2**31),
            (f"{a}.attention.head_count_kv", U32, 0), (f"{a}.attention.head_count_kv", U32, 3),
            (f"{a}.attention.layer_norm_rms_epsilon", F32, float("nan")),
            (f"{a}.attention.layer_norm_rms_epsilon", F32, float("inf")),
            (f"{a}.attention.layer_norm_rms_epsilon", F32, -1.0),
            (f"{a}.attention.layer_norm_rms_epsilon", STR, "tiny"),
            (f"{a}.rope.freq_base", F32, float("nan")), (f"{a}.rope.freq_base", F32, 0.0),
            (f"{a}.rope.freq_base", F32, float("inf")), (f"{a}.rope.freq_base", F32, -5.0),
            (f"{a}.context_length", U32, 0), (f"{a}.context_length", U64, 2**62),
            (f"{a}.context_length", I32, -1),
            (f"{a}.rope.dimension_count", U32, 0), (f"{a}.rope.dimension_count", U32, 7),
            (f"{a}.vocab_size", U32, 10), (f"{a}.vocab_size", U64, 2**40),
            ("general.alignment", U32, 0), ("general.alignment", U32, 3),
            ("general.alignment", U64, 2**40), ("general.alignment", STR, "32"),
            ("general.architecture", STR, "mamba"), ("general.architecture", U32, 7),
            ("tokenizer.ggml.model", STR, "unigram"), ("tokenizer.ggml.model", U32, 1),
            ("tokenizer.ggml.pre", STR, "no-such-pre"),
            ("tokenizer.ggml.tokens", ARR, (U32, list(range(49152)))),
            ("tokenizer.ggml.tokens", ARR, (STR, ["a", "b"])),
            ("tokenizer.ggml.tokens", ARR, (STR, [])),
            ("tokenizer.ggml.merges", ARR, (STR, ["no-space-here"])),
            ("tokenizer.ggml.merges", ARR, (U32, [1, 2, 3])),
            ("tokenizer.ggml.token_type", ARR, (I32, [1, 2])),
            ("tokenizer.ggml.eos_token_id", U32, 2**31),
            ("tokenizer.ggml.eos_token_id", STR, "</s>"),
            ("tokenizer.ggml.bos_token_id", U64, 10**12),
            ("tokenizer.ggml.eot_token_id", U32, 10**9),
            ("tokenizer.chat_template", STR, "{% for %}"),
            ("tokenizer.chat_template", U32, 5),
            ("llama.rope.scaling.type", STR, "yarn"),
            ("llama.rope.scaling.type", STR, "linear"),
            ("llama.rope.scaling.factor", F32, float("nan")),
    ):
        fine = (key, value) in (("llama.rope.scaling.type", "linear"),
                                (f"{a}.context_length", 2**62))
        add(f"{key} = {value!r:.40}", base.with_kv(key, vtype, value).serialize()[0],
            must_fail=not fine and not (key == "llama.rope.scaling.factor"),
            chat=key == "tokenizer.chat_template")
    for vtype in (3, 13, 2**31):
        blob, m = base.serialize()
        at = next(x for x, label in m if label == f"kv {a}.block_count type")
        add(f"block_count value type {vtype}", blob[:at] + struct.pack("<I", vtype)
            + blob[at + 4:])
    blob, m = base.serialize()
    at = next(x for x, label in m if label == "kv tokenizer.ggml.tokens value")
    add("tokens array item type 77", blob[:at] + struct.pack("<I", 77) + blob[at + 4:])
    add("tokens array count 2^60", blob[:at + 4] + struct.pack("<Q", 2**60) + blob[at + 12:])
    at = next(x for x, label in m if label == "kv tokenizer.ggml.token_type value")
    add("token_type array count 2^61", blob[:at + 4] + struct.pack("<Q", 2**61) + blob[at + 12:])
    # Non-finite weights: NaN or inf in a matrix and in a norm.
    for name, bad in (("blk.0.attn_q.weight", np.nan), ("blk.1.ffn_down.weight", np.inf),
                      (emb, -np.inf), ("output_norm.weight", np.nan)):
        t = next(t for t in base.tensors if t[0] == name)
        w = np.frombuffer(t[3], np.float16 if t[2] == 1 else np.float32).copy()
        w[rng.randrange(w.size)] = bad
        add(f"{bad} in {name}", base.with_tensor(name, raw=w.tobytes()).serialize()[0])
    return cases


# ---------------------------------------------------------------- mlx-lm folder and tokenizer

def write_mlx_lm(folder: Path, tokenizer) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(TINY))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: mx.array(v) for k, v in tiny_weights().items()})
    tokenizer.save_pretrained(str(folder))


def _copy(base: Path, work: Path, n: int) -> Path:
    dest = work / f"{n:03d}"
    shutil.copytree(base, dest)
    return dest


def _safetensors_parts(path: Path) -> tuple[int, dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8:8 + n]), raw[8 + n:]


def _safetensors_bytes(header: dict, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def safetensors_mutations(path: Path, rng: random.Random, name: str
                          ) -> list[tuple[str, Callable[[Path], None], bool]]:
    """(label, mutate(path), must_fail) for one safetensors file and one tensor in it."""
    n, header, data = _safetensors_parts(path)
    entry = header[name]
    lo, hi = entry["data_offsets"]
    dtype = {"F32": np.float32, "F16": np.float16, "BF16": None}[entry["dtype"]]

    def rewrite(h=None, d=None):
        return lambda p: p.write_bytes(_safetensors_bytes(header if h is None else h,
                                                          data if d is None else d))

    def poke(value):
        def run(p):
            w = np.frombuffer(data[lo:hi], dtype).copy()
            w[rng.randrange(w.size)] = value
            p.write_bytes(_safetensors_bytes(header, data[:lo] + w.tobytes() + data[hi:]))
        return run

    def entry_with(**kw):
        return {**header, name: {**entry, **kw}}

    raw = path.read_bytes()
    out = [
        ("empty file", lambda p: p.write_bytes(b""), True),
        ("7 bytes", lambda p: p.write_bytes(raw[:7]), True),
        ("cut in the header", lambda p: p.write_bytes(raw[:8 + n // 2]), True),
        ("cut after the header", lambda p: p.write_bytes(raw[:8 + n]), True),
        ("cut halfway through the data", lambda p: p.write_bytes(raw[:8 + n + len(data) // 2]),
         True),
        ("last byte missing", lambda p: p.write_bytes(raw[:-1]), True),
        ("header length 2^62", lambda p: p.write_bytes(struct.pack("<Q", 2**62) + raw[8:]),
         True),
        ("header not JSON", lambda p: p.write_bytes(raw[:8] + b"{" * n + data), True),
        ("garbage", lambda p: p.write_bytes(bytes(rng.randrange(256) for _ in range(4096))),
         True),
        (f"{name} dtype I32", rewrite(entry_with(dtype="I32")), True),
        (f"{name} dtype BOGUS", rewrite(entry_with(dtype="BOGUS")), True),
        (f"{name} shape transposed", rewrite(entry_with(shape=entry["shape"][::-1])),
         len(set(entry["shape"])) > 1),
        (f"{name} shape too big for its bytes",
         rewrite(entry_with(shape=[x * 2 for x in entry["shape"]])), True),
        (f"{name} shape 2^40", rewrite(entry_with(shape=[2**40] * len(entry["shape"]))), True),
        (f"{name} offsets past the end", rewrite(entry_with(data_offsets=[lo, len(data) + 64])),
         True),
        (f"{name} offsets reversed", rewrite(entry_with(data_offsets=[hi, lo])), True),
        (f"{name} missing", rewrite({k: v for k, v in header.items() if k != name}), True),
        ("an extra tensor", rewrite({**header, "extra.weight": {
            "dtype": "F32", "shape": [4], "data_offsets": [len(data), len(data) + 16]}},
            data + bytes(16)), True),
        (f"NaN in {name}", poke(np.nan), True),
        (f"inf in {name}", poke(np.inf), True),
        (f"-inf in {name}", poke(-np.inf), True),
    ]
    return out


def mlx_lm_cases(base: Path, work: Path, rng: random.Random) -> list[Case]:
    cases: list[Case] = []

    def add(name, mutate: Callable[[Path], None], must_fail=True):
        folder = _copy(base, work, len(cases))
        mutate(folder)
        cases.append(Case("mlx-lm", name, ("generate", "--model", str(folder), *GEN[1:]),
                          must_fail))

    def config_is(text):
        return lambda f: (f / "config.json").write_text(text)

    add("valid folder", lambda f: None, must_fail=False)
    for key in ("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "rms_norm_eps", "vocab_size"):
        add(f"config.json without {key}",
            config_is(json.dumps({k: v for k, v in TINY.items() if k != key})))
    for key, value in (("model_type", "no-such-family"), ("model_type", 7),
                       ("hidden_size", "64"), ("hidden_size", 65), ("hidden_size", 0),
                       ("hidden_size", -64), ("num_hidden_layers", 10**9),
                       ("num_hidden_layers", 3), ("num_hidden_layers", 1),
                       ("num_hidden_layers", -1), ("num_hidden_layers", 2.5),
                       ("num_attention_heads", 0), ("num_attention_heads", 3),
                       ("num_key_value_heads", 0), ("num_key_value_heads", 3),
                       ("intermediate_size", 10**12), ("vocab_size", 10),
                       ("vocab_size", 10**12), ("rms_norm_eps", None),
                       ("rope_theta", 0), ("rope_theta", -1.0), ("rope_theta", "fast"),
                       ("max_position_embeddings", -5),
                       ("tie_word_embeddings", False), ("head_dim", 7),
                       ("rope_scaling", {"type": "yarn"}), ("rope_scaling", "linear")):
        add(f"config {key} = {value!r}", config_is(json.dumps({**TINY, key: value})))
    for text, label in (("", "empty"), ("{", "truncated"), ("[1, 2]", "a list"),
                        ("null", "null"), ('{"model_type": "llama"', "cut JSON"),
                        ('\xff\xfe', "not UTF-8")):
        add(f"config.json {label}", config_is(text))
    add("config.json NaN eps", config_is(json.dumps({**TINY, "rms_norm_eps": float("nan")})))
    add("config.json Infinity rope_theta",
        config_is(json.dumps({**TINY, "rope_theta": float("inf")})))
    add("no config.json", lambda f: (f / "config.json").unlink())
    add("no model.safetensors", lambda f: (f / "model.safetensors").unlink())
    add("config.json is a folder", lambda f: ((f / "config.json").unlink(),
                                              (f / "config.json").mkdir()))
    for label, mutate, must in safetensors_mutations(
            base / "model.safetensors", rng, "model.layers.0.self_attn.q_proj.weight"):
        add(f"safetensors: {label}", lambda f, m=mutate: m(f / "model.safetensors"), must)
    for label, mutate, must in safetensors_mutations(base / "model.safetensors", rng,
                                                     "model.norm.weight")[-3:]:
        add(f"safetensors: {label}", lambda f, m=mutate: m(f / "model.safetensors"), must)
    return cases


def tokenizer_cases(base: Path, work: Path, rng: random.Random) -> list[Case]:
    cases: list[Case] = []
    files = sorted(p.name for p in base.iterdir() if p.name.startswith(("tokenizer", "special",
                                                                         "vocab", "merges")))

    def add(name, mutate, must_fail=True):
        folder = _copy(base, work, len(cases))
        mutate(folder)
        cases.append(Case("tokenizer", name, ("generate", "--model", str(folder), *GEN[1:]),
                          must_fail))

    for name in files:
        raw = (base / name).read_bytes()
        add(f"{name} missing", lambda f, n=name: (f / n).unlink(),
            must_fail=name == "tokenizer.json")
        add(f"{name} empty", lambda f, n=name: (f / n).write_bytes(b""))
        add(f"{name} cut in half", lambda f, n=name, r=raw: (f / n).write_bytes(r[:len(r) // 2]))
        add(f"{name} garbage", lambda f, n=name: (f / n).write_bytes(
            bytes(rng.randrange(256) for _ in range(2048))))
        add(f"{name} a JSON list", lambda f, n=name: (f / n).write_text("[1, 2, 3]"))
    tok = json.loads((base / "tokenizer.json").read_text())

    def edit(fn):
        def run(f):
            t = json.loads(json.dumps(tok))
            fn(t)
            (f / "tokenizer.json").write_text(json.dumps(t))
        return run

    add("tokenizer.json without model", edit(lambda t: t.pop("model")))
    add("tokenizer.json model type Bogus", edit(lambda t: t["model"].update(type="Bogus")))
    add("tokenizer.json empty vocab", edit(lambda t: t["model"].update(vocab={})))
    add("tokenizer.json vocab of 10", edit(lambda t: t["model"].update(
        vocab=dict(list(t["model"]["vocab"].items())[:10]))))
    add("tokenizer.json merges not pairs", edit(lambda t: t["model"].update(merges=[[1]])))
    add("tokenizer.json ids past the model's vocabulary", edit(lambda t: t["model"].update(
        vocab={k: v + 10**6 for k, v in t["model"]["vocab"].items()})))
    add("tokenizer.json pre_tokenizer Bogus", edit(lambda t: t.update(
        pre_tokenizer={"type": "Bogus"})))
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    add("tokenizer_config chat_template broken", lambda f: (f / "tokenizer_config.json")
        .write_text(json.dumps({**cfg, "chat_template": "{% for %}"})), must_fail=False)
    add("tokenizer_config eos_token unknown", lambda f: (f / "tokenizer_config.json")
        .write_text(json.dumps({**cfg, "eos_token": "<no-such-token>"})), must_fail=False)
    # transformers falls back to the fast tokenizer that tokenizer.json describes.
    add("tokenizer_config tokenizer_class Bogus", lambda f: (f / "tokenizer_config.json")
        .write_text(json.dumps({**cfg, "tokenizer_class": "BogusTokenizer"})),
        must_fail=False)
    # With the chat template (the broken template is what generate then renders).
    folder = _copy(base, work, len(cases))
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template":
                                                              "{% for %}"}))
    if (folder / "chat_template.jinja").is_file():  # where newer transformers keep it
        (folder / "chat_template.jinja").write_text("{% for %}")
    cases.append(Case("tokenizer", "broken chat template, used",
                      ("generate", "--model", str(folder), "--prompt", "hi", "--max-tokens", "2")))
    return cases


# ---------------------------------------------------------------- drafts and exit heads

def draft_cases(target_spec: str, base: Path, work: Path, rng: random.Random) -> list[Case]:
    cases: list[Case] = []

    def add(name, mutate, must_fail=True):
        folder = _copy(base, work, len(cases))
        mutate(folder)
        cases.append(Case("draft", name, ("generate", "--model", target_spec, "--mode", "sd",
                                          "--gamma", "2", "--draft", str(folder), *GEN[1:]),
                          must_fail))

    cfg = json.loads((base / "config.json").read_text())

    def config(**kw):
        return lambda f: (f / "config.json").write_text(json.dumps({**cfg, **kw}))

    def without(key):
        return lambda f: (f / "config.json").write_text(
            json.dumps({k: v for k, v in cfg.items() if k != key}))

    add("valid draft", lambda f: None, must_fail=False)
    for key in ("hidden_size", "num_layers", "vocab_size", "head_dim", "embed_size"):
        add(f"config without {key}", without(key))
    add("config without format", without("format"))
    for key, value in (("num_layers", 0), ("num_layers", -1), ("num_layers", 10**9),
                       ("num_layers", 3), ("hidden_size", 65), ("hidden_size", "64"),
                       ("head_dim", 0), ("num_heads", 0), ("num_kv_heads", 3),
                       ("vocab_size", 10), ("vocab_size", 10**12), ("embed_size", 32),
                       ("head_tokens", [0, 1, 10**9]), ("head_tokens", [-1]),
                       ("head_tokens", "all"), ("feature_layers", [99]),
                       ("feature_layers", [0]), ("feature_layers", [1]),
                       ("stream_count", -1), ("stream_count", 10**6),
                       ("rms_norm_eps", -1.0), ("rope_theta", 0.0),
                       ("shared_embedding", False), ("unknown_key", 1),
                       ("quantization", {"bits": 3, "group_size": 64}),
                       ("quantization", {"bits": 4, "group_size": 7}), ("quantization", "yes"),
                       ("target", "a string")):
        add(f"config {key} = {value!r}", config(**{key: value}))
    add("config NaN eps", config(rms_norm_eps=float("nan")))
    add("config.json not JSON", lambda f: (f / "config.json").write_text("{"))
    add("config.json a list", lambda f: (f / "config.json").write_text("[]"))
    add("no weights", lambda f: (f / "weights.safetensors").unlink())
    names = sorted(_safetensors_parts(base / "weights.safetensors")[1])
    matrix = next(n for n in names if n.endswith("q_proj.weight"))
    for label, mutate, must in safetensors_mutations(base / "weights.safetensors", rng, matrix):
        add(f"weights: {label}", lambda f, m=mutate: m(f / "weights.safetensors"), must)
    norm = next(n for n in names if n.endswith("norm.weight"))
    for label, mutate, must in safetensors_mutations(base / "weights.safetensors", rng,
                                                     norm)[-3:]:
        add(f"weights: {label}", lambda f, m=mutate: m(f / "weights.safetensors"), must)
    return cases


def exit_head_cases(target_spec: str, base: Path, work: Path, rng: random.Random
                    ) -> list[Case]:
    cases: list[Case] = []
    hidden = TINY["hidden_size"]

    def add(name, write: Callable[[Path], None], must_fail=True):
        path = work / f"{len(cases):03d}.safetensors"
        shutil.copy(base, path)
        write(path)
        cases.append(Case("exit-head", name, ("generate", "--model", target_spec, "--mode",
                                              "mirror", "--exit-head", str(path), *GEN[1:]),
                          must_fail))

    def save(tensors: dict, meta: dict | None):
        return lambda p: mx.save_safetensors(str(p), tensors, metadata=meta)

    w, b = mx.zeros((hidden, hidden)), mx.zeros((hidden,))
    ok = {"layer": "1", "format": "mirror-mlx-exit"}
    add("valid head", lambda p: None, must_fail=False)
    add("no metadata", save({"weight": w, "bias": b}, None))
    for layer in ("0", "2", "-1", "99", "one", "1.5", ""):
        add(f"layer {layer!r}", save({"weight": w, "bias": b}, {**ok, "layer": layer}))
    add("no bias", save({"weight": w}, ok))
    add("no weight", save({"bias": b}, ok))
    add("weight for hidden 32", save({"weight": mx.zeros((32, 32)), "bias": b}, ok))
    add("weight not square", save({"weight": mx.zeros((hidden, 32)), "bias": b}, ok))
    add("weight 3-d", save({"weight": mx.zeros((1, hidden, hidden)), "bias": b}, ok))
    add("bias 2-d", save({"weight": w, "bias": mx.zeros((1, hidden))}, ok))
    add("weight int32", save({"weight": w.astype(mx.int32), "bias": b}, ok))
    add("weight bool", save({"weight": w.astype(mx.bool_), "bias": b}, ok))
    add("weight float16", save({"weight": w.astype(mx.float16), "bias": b}, ok),
        must_fail=False)
    for label, mutate, must in safetensors_mutations(base, rng, "weight"):
        add(label, mutate, must)
    nan_bias = np.zeros(hidden, np.float32)
    nan_bias[3] = np.nan
    add("NaN in bias", save({"weight": w, "bias": mx.array(nan_bias)}, ok))
    add("a folder", lambda p: (p.unlink(), p.mkdir()))
    return cases


# ---------------------------------------------------------------- Core ML packages

def write_package(path: Path, metadata: dict[str, str]) -> None:
    """A package holding a one-layer neural network with `metadata`: the metadata and the
    package's structure are what the reader checks; nothing here runs it."""
    import logging

    logging.getLogger("coremltools").setLevel(logging.ERROR)
    import coremltools as ct
    from coremltools.proto import Model_pb2

    spec = Model_pb2.Model()
    spec.specificationVersion = 9
    spec.description.metadata.userDefined.update(metadata)
    for io, name in ((spec.description.input, "x"), (spec.description.output, "y")):
        f = io.add()
        f.name = name
        f.type.multiArrayType.shape.extend([1])
        f.type.multiArrayType.dataType = Model_pb2.ArrayFeatureType.FLOAT32
    layer = spec.neuralNetwork.layers.add()
    layer.name, layer.activation.linear.alpha = "id", 1.0
    layer.input.append("x")
    layer.output.append("y")
    ct.utils.save_spec(spec, str(path))


def coreml_cases(target_spec: str, draft: Path, other_draft: Path, work: Path,
                 rng: random.Random) -> list[Case]:
    from mirror_mlx.draft.coreml_package import META, PackageSpec, source_sha256
    from mirror_mlx.draft.net import DraftConfig

    cfg = json.loads((draft / "config.json").read_text())
    cfg.pop("format")
    spec = PackageSpec(DraftConfig(**cfg), context=256, query_sizes=(1, 2, 4),
                       source=str(draft), source_sha256=source_sha256(draft))
    meta = spec.to_metadata()
    cases: list[Case] = []

    def add(name, metadata, mutate=None, must_fail=True, inspect=True):
        path = work / f"{len(cases):03d}.mlpackage"
        write_package(path, metadata)
        if mutate:
            mutate(path)
        for how, argv in (("generate", ("generate", "--model", target_spec, "--mode", "sd",
                                        "--gamma", "2", "--draft", str(path), *GEN[1:])),
                          ("inspect", ("inspect", str(path)))):
            if how == "generate" or inspect:
                cases.append(Case("coreml", f"{name} ({how})", argv,
                                  must_fail and not (how == "inspect" and not mutate)))

    model_file = "Data/com.apple.CoreML/model.mlmodel"
    add("valid package", meta, must_fail=False)
    add("no Manifest.json", meta, lambda p: (p / "Manifest.json").unlink())
    add("Manifest.json empty", meta, lambda p: (p / "Manifest.json").write_text(""))
    add("Manifest.json cut", meta, lambda p: (p / "Manifest.json").write_text(
        (p / "Manifest.json").read_text()[:100]))
    add("Manifest.json names no model", meta, lambda p: (p / "Manifest.json").write_text(
        json.dumps({"fileFormatVersion": "1.0.0", "itemInfoEntries": {},
                    "rootModelIdentifier": "x"})))
    add("Manifest.json foreign version", meta, lambda p: (p / "Manifest.json").write_text(
        (p / "Manifest.json").read_text().replace("1.0.0", "9.9.9")))
    add("no model.mlmodel", meta, lambda p: (p / model_file).unlink())
    add("model.mlmodel empty", meta, lambda p: (p / model_file).write_bytes(b""))
    add("model.mlmodel cut", meta, lambda p: (p / model_file).write_bytes(
        (p / model_file).read_bytes()[:40]))
    add("model.mlmodel garbage", meta, lambda p: (p / model_file).write_bytes(
        bytes(rng.randrange(256) for _ in range(512))))
    add("package is a file", meta, lambda p: (shutil.rmtree(p), p.write_text("x")))
    add("no metadata", {}, inspect=False)
    add("foreign format version", {**meta, META + "format": "mirror-mlx-coreml-draft/1"},
        inspect=False)
    add("another program's package", {**meta, META + "format": "someone-else/3"},
        inspect=False)
    for key in ("draft_config", "context", "query_sizes", "source", "source_sha256"):
        add(f"metadata without {key}", {k: v for k, v in meta.items() if k != META + key},
            inspect=False)
    for key, value in (("draft_config", "{"), ("draft_config", "[]"),
                       ("draft_config", json.dumps({"hidden_size": 64})),
                       ("context", "many"), ("query_sizes", "1,two"), ("query_sizes", ""),
                       ("compute_units", "WARP_DRIVE"),
                       ("source", str(work / "no-such-draft")),
                       ("source", str(other_draft)), ("source", "")):
        add(f"metadata {key} = {value!r:.30}", {**meta, META + key: value}, inspect=False,
            must_fail=not (key == "compute_units"))
    return cases


# ---------------------------------------------------------------- bench prompt files

def prompt_cases(target_spec: str, work: Path, rng: random.Random) -> list[Case]:
    cases: list[Case] = []
    good = {"question_id": 1, "category": "qa", "turns": ["Why is the sky blue?"]}

    def add(name, data: bytes | None, must_fail=True, extra=()):
        path = work / f"{len(cases):03d}.jsonl"
        if data is not None:
            path.write_bytes(data)
        out = work / f"out{len(cases):03d}"
        cases.append(Case("prompts", name, ("bench", "--target", target_spec, "--prompts",
                                            str(path), "--modes", "ar", "--max-tokens", "2",
                                            "--energy", "none", "--out", str(out), *extra),
                          must_fail))

    line = json.dumps(good).encode()
    add("missing file", None)
    add("empty file", b"")
    add("blank lines only", b"\n\n  \n")
    add("not JSON", b"why is the sky blue?\n")
    add("a line cut", line[: len(line) // 2])
    add("not UTF-8", b"\xff\xfe" + line)
    add("binary garbage", bytes(rng.randrange(256) for _ in range(1024)))
    add("a JSON list", b"[1, 2, 3]\n")
    add("JSON null", b"null\n")
    add("a number", b"42\n")
    for key in ("question_id", "category", "turns"):
        add(f"without {key}", json.dumps({k: v for k, v in good.items() if k != key}).encode())
    for key, value in (("turns", []), ("turns", "one string"), ("turns", [""]),
                       ("turns", [1, 2]), ("turns", [None]), ("turns", {"a": 1}),
                       ("category", None), ("category", ["x"]), ("question_id", None),
                       ("question_id", {"a": 1}), ("turns", ["   "])):
        add(f"{key} = {value!r}", json.dumps({**good, key: value}).encode(),
            must_fail=key == "turns")
    add("duplicate question_id", line + b"\n" + line)
    add("second line broken", line + b"\n{\n")
    add("a folder", None, extra=())
    (work / f"{len(cases) - 1:03d}.jsonl").mkdir()
    add("--per-category 0", line, extra=("--per-category", "0"))
    add("--per-category -3", line, extra=("--per-category", "-3"))
    add("a very long line", json.dumps({**good, "turns": ["x" * 2_000_000]}).encode(),
        must_fail=False)
    return cases


# ---------------------------------------------------------------- running and classifying

def run_case(case: Case, timeout: float) -> Result:
    """The case in a fresh interpreter (`--spawn`): what a user's shell runs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "mirror_mlx.cli", *case.argv],
                              capture_output=True, text=True, timeout=timeout, env=env,
                              cwd=ROOT, errors="replace")
    except subprocess.TimeoutExpired:
        return Result(case.kind, case.name, "hang", None, timeout, "")
    return result(case, done.returncode, done.stderr, time.perf_counter() - start)


def result(case: Case, status: int, stderr: str, seconds: float) -> Result:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    return Result(case.kind, case.name, classify(case, status, lines), status,
                  round(seconds, 2), last[:300])


def run_forked(cases: list[Case], timeout: float, jobs: int, work: Path) -> list[Result]:
    """Each case in a child forked from a process that has imported the CLI's modules but
    run nothing: a child process per case (a signal or a hang stays in it) without paying
    each interpreter's start and imports again, which on a loaded machine are most of a case.
    The forking process is itself a fresh interpreter: forking one that has run MLX could
    inherit its threads' locks."""
    listing = work / "forked-cases.json"
    listing.write_text(json.dumps([asdict(c) for c in cases]))
    out = work / "forked-results.json"
    subprocess.run([sys.executable, __file__, "--forker", str(listing), str(out),
                    "--timeout", str(timeout), "--jobs", str(jobs)], check=True, cwd=ROOT,
                   env={**os.environ, "PYTHONPATH": str(ROOT)})
    return [Result(**r) for r in json.loads(out.read_text())]


def forker(listing: Path, out: Path, timeout: float, jobs: int) -> None:
    import signal
    import traceback

    import mirror_mlx.api  # noqa: F401  (imported once, before forking)
    import mirror_mlx.bench.command  # noqa: F401
    import mirror_mlx.cli as cli

    import mlx_lm.utils  # noqa: F401

    cases = [Case(**{**c, "argv": tuple(c["argv"])}) for c in json.loads(listing.read_text())]
    logs = listing.parent / "logs"
    logs.mkdir(exist_ok=True)
    pending, running, results = list(enumerate(cases)), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            i, case = pending.pop(0)
            err = logs / f"{i}.err"
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                status = 1
                try:
                    os.dup2(os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
                    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                    status = cli.main(list(case.argv))
                except SystemExit as e:
                    status = e.code if isinstance(e.code, int) else 1
                except BaseException:
                    traceback.print_exc()
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(status)
            running[pid] = (i, case, time.perf_counter())
        time.sleep(0.05)
        for pid, (i, case, start) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            seconds = time.perf_counter() - start
            if done:
                del running[pid]
                text = (logs / f"{i}.err").read_text(errors="replace")
                results[i] = result(case, os.waitstatus_to_exitcode(status), text, seconds)
            elif seconds > timeout:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                del running[pid]
                results[i] = Result(case.kind, case.name, "hang", None, round(seconds, 2), "")
    out.write_text(json.dumps([asdict(results[i]) for i in range(len(cases))]))


def classify(case: Case, status: int, lines: list[str]) -> str:
    if status < 0:
        return "crash"
    if any(ln.startswith("Traceback") for ln in lines):
        return "traceback"
    if status == 0:
        return "silent" if case.must_fail else "accepted"
    errors = [ln for ln in lines if ln.startswith("mirror-mlx: error:")]
    if status == 1 and len(errors) == 1 and lines[-1] == errors[0]:
        return "clean"
    return "unclear"


OUTCOMES = ("clean", "accepted", "silent", "traceback", "crash", "hang", "unclear")


def table(results: list[Result]) -> str:
    counts = Counter((r.kind, r.outcome) for r in results)
    kinds = [k for k in KINDS if any(r.kind == k for r in results)]
    rows = ["| kind | cases | " + " | ".join(OUTCOMES) + " |",
            "|---|---:|" + "---:|" * len(OUTCOMES)]
    for k in kinds:
        rows.append(f"| {k} | {sum(r.kind == k for r in results)} | "
                    + " | ".join(str(counts[(k, o)]) for o in OUTCOMES) + " |")
    total = Counter(r.outcome for r in results)
    rows.append(f"| all | {len(results)} | " + " | ".join(str(total[o]) for o in OUTCOMES)
                + " |")
    return "\n".join(rows)


def build_cases(kinds: tuple[str, ...], work: Path, seed: int) -> list[Case]:
    from mirror_mlx.draft.load import target_info
    from mirror_mlx.draft.net import DraftNet
    from mirror_mlx.models.gguf_tokenizer import tokenizer_from_gguf
    from mirror_mlx.models.load import load
    from mirror_mlx.models.split import ExitHead

    rng = random.Random(seed)
    default = ensure_default_model(quiet=True)
    base_dir = work / "base"
    base_dir.mkdir(parents=True, exist_ok=True)
    gguf = tiny_gguf(default)
    target = base_dir / "tiny.gguf"
    target.write_bytes(gguf.serialize()[0])
    cases: list[Case] = []
    if "gguf" in kinds:
        (work / "gguf").mkdir()
        cases += gguf_cases(gguf, work / "gguf", rng)
    if {"mlx-lm", "tokenizer"} & set(kinds):
        folder = base_dir / "mlx-lm"
        write_mlx_lm(folder, tokenizer_from_gguf(read_header(target)))
        for kind, make in (("mlx-lm", mlx_lm_cases), ("tokenizer", tokenizer_cases)):
            if kind in kinds:
                (work / kind).mkdir()
                cases += make(folder, work / kind, rng)
    if {"draft", "exit-head", "coreml"} & set(kinds):
        loaded = load(str(target), dtype="float32")
        draft = base_dir / "draft"
        DraftNet.from_model(loaded.model, 1, target_info(loaded)).save(draft)
        other = base_dir / "draft-other"
        DraftNet.from_model(loaded.model, 2, {**target_info(loaded), "vocab": "0" * 16}
                            ).save(other)
        head = base_dir / "exit.safetensors"
        ExitHead(1, TINY["hidden_size"]).save(head)
        for kind in ("draft", "exit-head", "coreml"):
            if kind in kinds:
                (work / kind).mkdir()
        if "draft" in kinds:
            cases += draft_cases(str(target), draft, work / "draft", rng)
        if "exit-head" in kinds:
            cases += exit_head_cases(str(target), head, work / "exit-head", rng)
        if "coreml" in kinds:
            cases += coreml_cases(str(target), draft, other, work / "coreml", rng)
    if "prompts" in kinds:
        (work / "prompts").mkdir()
        cases += prompt_cases(str(target), work / "prompts", rng)
    return cases


def main() -> None:
    if sys.argv[1:2] == ["--forker"]:
        ap = argparse.ArgumentParser()
        ap.add_argument("--forker", nargs=2, type=Path)
        ap.add_argument("--timeout", type=float)
        ap.add_argument("--jobs", type=int)
        args = ap.parse_args()
        forker(*args.forker, args.timeout, args.jobs)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="folder for fuzz.json, fuzz.md and the case files")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--limit", type=int, default=None,
                    help="run at most this many cases of each kind (spread over its cases)")
    ap.add_argument("--jobs", type=int, default=2, help="cases run at once")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    ap.add_argument("--spawn", action="store_true",
                    help="a fresh interpreter per case (`python -m mirror_mlx.cli ...`) instead "
                         "of a child forked after the imports (same checks, slower)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the case files")
    args = ap.parse_args()
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = set(kinds) - set(KINDS)
    if unknown:
        ap.error(f"unknown kinds {sorted(unknown)} (from {', '.join(KINDS)})")
    work = args.out / "cases"
    shutil.rmtree(work, ignore_errors=True)
    cases = build_cases(kinds, work, args.seed)
    if args.limit:
        picked = []
        for k in kinds:
            mine = [c for c in cases if c.kind == k]
            step = max(1, math.ceil(len(mine) / args.limit))
            picked += mine[::step][: args.limit]
        cases = picked
    print(f"{len(cases)} cases: " + ", ".join(f"{k} {sum(c.kind == k for c in cases)}"
                                               for k in kinds), file=sys.stderr)
    start = time.perf_counter()
    if args.spawn:
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda c: run_case(c, args.timeout), cases))
    else:
        results = run_forked(cases, args.timeout, args.jobs, work)
    wall = time.perf_counter() - start
    bad = [r for r in results if r.outcome not in ("clean", "accepted")]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fuzz.json").write_text(json.dumps(
        {"seconds": round(wall, 1), "results": [asdict(r) for r in results]}, indent=1))
    md = [f"# File fuzzing: {len(results)} cases, {wall:.0f} s", "", table(results), ""]
    if bad:
        md += ["## Not clean", ""] + [f"- {r.kind} / {r.name}: **{r.outcome}** "
                                      f"(status {r.status}) `{r.last_line}`" for r in bad]
    (args.out / "fuzz.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
