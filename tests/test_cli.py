"""The command line, run as a user runs it: real processes, real pipes, real signals."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time


def test_generate_json(default_gguf):
    done = subprocess.run(
        [sys.executable, "-m", "mirror_mlx", "generate", "--model", str(default_gguf),
         "--prompt", "Name three colors.", "--max-tokens", "12", "--json"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert set(out) == {"text", "token_ids", "stats"}
    assert 0 < len(out["token_ids"]) <= 12
    assert out["text"].strip()
    stats = out["stats"]
    for key in ("prompt_tokens", "ttft_s", "prompt_tokens_per_second", "tokens_per_second",
                "peak_memory_gb", "generated_tokens", "finish_reason"):
        assert key in stats
    assert stats["generated_tokens"] == len(out["token_ids"])


def test_doctor_names_blas_and_coreml():
    done = subprocess.run([sys.executable, "-m", "mirror_mlx", "doctor"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0
    keys = [line.split(":")[0] for line in done.stdout.splitlines()]
    for key in ("platform", "mlx device", "blas", "coreml", "cache dir"):
        assert key in keys
    if sys.platform == "linux" and os.path.exists("/usr/lib/x86_64-linux-gnu/libopenblas.so.0"):
        assert "OpenBLAS" in done.stdout


class Chat:
    """`mirror-mlx chat` in a child process, fed through a pipe."""

    def __init__(self, *args):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mirror_mlx", "chat", *args], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=0)
        self.out: queue.Queue[str] = queue.Queue()
        self.seen = ""
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        while ch := self.proc.stdout.read(1):
            self.out.put(ch)

    def send(self, line: str):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, text: str, timeout: float = 180) -> str:
        end = time.time() + timeout
        while text not in self.seen:
            try:
                self.seen += self.out.get(timeout=max(0.01, end - time.time()))
            except queue.Empty:
                raise AssertionError(f"timed out waiting for {text!r}; got:\n{self.seen}") from None
        return self.seen


def test_chat_commands_interrupt_and_eof(default_gguf):
    chat = Chat("--model", str(default_gguf), "--max-tokens", "300")
    chat.wait_for("/help for commands")
    chat.send("/help")
    before = len(chat.wait_for("the conversation goes on.\n>>> "))
    chat.send("Write a very long story about a lighthouse keeper and the sea.")
    # Wait until the reply is streaming, then press Ctrl-C.
    end = time.time() + 120
    while len(chat.seen) < before + 40 and time.time() < end:
        chat.seen += chat.out.get(timeout=120)
    chat.proc.send_signal(signal.SIGINT)
    chat.wait_for("[stopped]")
    assert chat.proc.poll() is None, "Ctrl-C must not end the session"
    chat.send("/stats")
    chat.wait_for("finish cancelled")
    prompts = chat.seen.count(">>> ")
    chat.send("In one sentence: what did I ask you about?")
    while chat.seen.count(">>> ") <= prompts:  # the second reply is complete
        chat.seen += chat.out.get(timeout=180)
    chat.send("/stats")
    chat.wait_for("cached)")  # the second reply reused the conversation's cache
    chat.send("/reset")
    chat.wait_for("[conversation reset]")
    chat.proc.stdin.close()  # end of input
    assert chat.proc.wait(timeout=60) == 0


def test_openblas_in_use_in_this_process():
    """Importing mirror_mlx before mlx (as conftest does) gives MLX OpenBLAS when installed."""
    from mirror_mlx.platform import OPENBLAS_PATH, blas_description

    installed = any(os.path.exists(f"/usr/lib/{arch}-linux-gnu/libopenblas.so.0")
                    for arch in ("x86_64", "aarch64"))
    if sys.platform != "linux" or not installed:
        import pytest

        pytest.skip("OpenBLAS applies to Linux with libopenblas installed")
    assert OPENBLAS_PATH and "OpenBLAS" in blas_description()
