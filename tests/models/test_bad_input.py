"""Bad model files and parameters: a clear one-line error, never a crash or a traceback."""

import random
import shutil
import struct
import subprocess
import sys

from mirror_mlx.decode.sampling import SamplingParams
from mirror_mlx.errors import InvalidParameter, ModelLoadError
from mirror_mlx.models.gguf import read_header
from mirror_mlx.models.load import load

import pytest

from tests.helpers import write_tiny_gguf


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mirror_mlx", *args], capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(done, *needles):
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("mirror-mlx: error:")
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, default_gguf):
    path = tmp_path_factory.mktemp("tiny") / "tiny.gguf"
    write_tiny_gguf(path, default_gguf)
    return path


def test_missing_paths(tmp_path):
    for spec in ("/nonexistent/model.gguf", "missing-dir/model.gguf", str(tmp_path / "nope")):
        with pytest.raises(ModelLoadError, match="no such file"):
            load(spec)
    with pytest.raises(ModelLoadError, match="config.json or a single .gguf"):
        load(str(tmp_path))


def test_not_gguf(tmp_path):
    for name, data in (("model.gguf", b"hello, I am text"), ("zeros.gguf", bytes(4096)),
                       ("weights.bin", b"GGUX" + bytes(100))):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(ModelLoadError, match="not a GGUF file"):
            load(str(path))


def test_truncated_files(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    header_end = 0
    for info in read_header(tiny_gguf).tensors.values():
        header_end = max(header_end, info.offset)
    for cut in (5, 17, 30, 200, 5000, 400_000, len(data) // 2, len(data) - 1):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated|not a GGUF"):
            load(str(path))


def _with_patch(data: bytes, at: int, raw: bytes) -> bytes:
    return data[:at] + raw + data[at + len(raw):]


def test_corrupt_headers(tmp_path, tiny_gguf):
    data = tiny_gguf.read_bytes()
    cases = {
        "magic": _with_patch(data, 0, b"GGML"),
        "version": _with_patch(data, 4, struct.pack("<I", 99)),
        "tensor count": _with_patch(data, 8, struct.pack("<Q", 2**40)),
        "kv count": _with_patch(data, 16, struct.pack("<Q", 2**50)),
        "first key length": _with_patch(data, 24, struct.pack("<Q", 2**62)),
    }
    for what, blob in cases.items():
        path = tmp_path / "bad.gguf"
        path.write_bytes(blob)
        with pytest.raises(ModelLoadError) as caught:
            load(str(path))
        assert str(path) in str(caught.value), what


def test_random_header_corruption_never_escapes(tmp_path, tiny_gguf):
    """Random byte flips in the header: read_header either accepts the file or raises
    ModelLoadError; a file it accepts then loads, or fails cleanly, in a child process."""
    data = tiny_gguf.read_bytes()
    header = read_header(tiny_gguf)
    header_len = len(data) - sum(t.nbytes for t in header.tensors.values())
    rng = random.Random(1234)
    accepted = []
    for i in range(300):
        blob = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            blob[rng.randrange(0, header_len)] = rng.randrange(256)
        path = tmp_path / f"fuzz{i}.gguf"
        path.write_bytes(bytes(blob))
        try:
            read_header(path)
            accepted.append(path)
        except ModelLoadError:
            path.unlink()
    assert accepted, "no corruption passed validation: the child-process check ran on nothing"
    code = ("import sys, mirror_mlx\nfrom mirror_mlx.models.load import load\n"
            "from mirror_mlx.errors import MirrorError\n"
            "for p in sys.argv[1:]:\n"
            "    try: load(p)\n"
            "    except MirrorError: pass\n")
    done = subprocess.run([sys.executable, "-c", code, *map(str, accepted[:12])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_unsupported_architecture(tmp_path, default_gguf):
    path = tmp_path / "mamba.gguf"
    write_tiny_gguf(path, default_gguf, architecture="mamba")
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not supported"):
        load(str(path))


@pytest.mark.parametrize("kwargs, needle", [
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top-p"),
    ({"top_p": 1.5}, "top-p"),
    ({"top_k": -3}, "top-k"),
    ({"min_p": 1.0}, "min-p"),
    ({"seed": -1}, "seed"),
])
def test_invalid_sampling_parameters(kwargs, needle):
    with pytest.raises(InvalidParameter, match=needle):
        SamplingParams(**kwargs)


def test_cli_errors_are_one_line(tmp_path, default_gguf):
    assert_one_line_error(cli("generate", "--prompt", "hi", "--model", "/no/such.gguf"),
                          "/no/such.gguf", "no such file")
    assert_one_line_error(cli("generate", "--prompt", "hi", "--temp", "-1"), "temperature")
    assert_one_line_error(cli("generate", "--prompt", "hi", "--top-p", "2"), "top-p")
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    assert_one_line_error(cli("generate", "--prompt", "hi", "--model", str(text)),
                          "not a GGUF file")


def test_cli_prompt_longer_than_context(default_gguf):
    long_prompt = "word " * 200
    done = cli("generate", "--model", str(default_gguf), "--context", "64",
               "--prompt", long_prompt)
    assert_one_line_error(done, "context holds 64")


def test_tiny_gguf_copy_loads_from_folder(tmp_path, tiny_gguf):
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copy(tiny_gguf, folder / "m.gguf")
    assert load(str(folder)).num_layers == 2
