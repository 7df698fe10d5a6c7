"""The real `mirror-mlx serve` (a child process on loopback) under load and abuse, per decoding
mode: what it served, what it refused, what it lost, and whether it leaked.

    python benchmarks/reliability.py OUT [--modes ar,mirror] [--clients 32] [--minutes 10]
        [--malformed 3000] [--disconnects 3] [--read-timeout 30] [--max-tokens 24]
        [--phases load,malformed,disconnects,broken] [--model SPEC] [--seed 0]

Phases, in this order on one server per mode:
- load: `--clients` clients for `--minutes`, half streaming, chat and completion requests in
  turn, all greedy; each reply is compared with the reply to the same request sent alone
  first. A 429 must carry Retry-After; the client waits that long before its next request.
- malformed: `--malformed` bodies drawn by Hypothesis over the request schema (wrong types,
  missing and unknown fields, out-of-range and huge numbers, deep nesting, invalid UTF-8,
  random bytes), sent right after the load: each must get a 4xx with an OpenAI-style error
  (a few valid-but-odd ones may be served), never a 5xx, a dropped connection or a hang.
- disconnects: clients that leave mid-stream, mid-generation and while queued: each ends its
  generation (the server's log says "finish cancelled"), and threads, descriptors, sockets and
  memory come back to what they were (TOLERANCE).
- broken clients: a body a byte a second, headers never finished, a Content-Length that lies,
  pipelined requests, HTTP/1.0: each is answered or dropped within --read-timeout, while a good
  request sent meanwhile is served promptly.
After each phase a good request must still be served, with the lone request's reply; and
the lone replies of every mode must be the same (greedy speculative decoding is lossless).

Writes OUT/reliability.json, OUT/reliability.md and OUT/server-MODE.log (the server's log).
Needs hypothesis (pip install 'mirror-mlx[test]'). Linux counts threads and descriptors from
/proc; elsewhere only memory is reported.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings
from malformed import Malformed, malformed
from procstats import ProcStats, proc_stats

ROOT = Path(__file__).resolve().parent.parent
PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}
PROMPTS = ("Name three colors.", "What is the capital of France?", "Write a haiku about rain.",
           "Count from one to five.", "Why is the sky blue?", "Give me a word that rhymes "
           "with cat.")
LONG_PROMPT = "Write a long essay about rivers."
CLIENT_TIMEOUT = 300.0  # s a client waits for a reply before it counts as lost
# After a phase the server may hold a little more memory (allocator arenas, MLX's buffer
# cache); threads, descriptors and sockets must come back exactly.
TOLERANCE = {"rss": 0.05, "threads": 0, "fds": 0, "sockets": 0}
SETTLE_S = 15.0  # s for handler threads to end after their clients left


# ------------------------------------------------------------------ the server, a child process

@dataclass
class ServerProcess:
    proc: subprocess.Popen
    host: str
    port: int
    log: Path

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def stats(self) -> ProcStats:
        return proc_stats(self.proc.pid)

    def log_size(self) -> int:
        return self.log.stat().st_size

    def finished_since(self, offset: int) -> list[tuple[int, str]]:
        """(generated tokens, finish reason) of each generation the log reports after
        `offset` (the server logs one line per generation as it ends)."""
        with self.log.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        return [(int(m[1]), m[2]) for m in re.finditer(
            r"prompt \d+ tok, (\d+) generated, .*finish (\w+)", text)]

    def stop(self) -> int | None:
        """SIGTERM, as a service manager stops it; the exit status (None: it had to be
        killed)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def start_server(mode: str, model: str | None, log: Path, extra: list[str]) -> ServerProcess:
    argv = [sys.executable, "-m", "mirror_mlx", "serve", "--port", "0", "--mode", mode,
            *(["--model", model] if model else []), *extra]
    # This checkout's code, whatever is installed.
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    env.pop("MIRROR_MLX_API_KEY", None)
    with log.open("wb") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                cwd=ROOT)
    line = proc.stdout.readline()  # "mirror-mlx: serving ... at http://HOST:PORT/v1"
    found = re.search(r" at http://([\d.]+):(\d+)/v1", line)
    if not found:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the server did not start: {line!r}\n{log.read_text()[-2000:]}")
    return ServerProcess(proc, found[1], int(found[2]), log)


def settled(server: ServerProcess, baseline: ProcStats | None = None) -> ProcStats:
    """The server's counts once its connection threads have ended: as soon as they are back
    to `baseline`'s (or have not changed for a second), at most SETTLE_S."""
    end, last, steady_since = time.monotonic() + SETTLE_S, server.stats(), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.2)
        now = server.stats()
        if baseline is not None and _within(baseline, now):
            return now
        if (now.threads, now.fds) != (last.threads, last.fds):
            last, steady_since = now, time.monotonic()
        elif baseline is None and time.monotonic() - steady_since > 1.0:
            return now
    return server.stats()


def _within(before: ProcStats, after: ProcStats) -> bool:
    return not leaks(before, after)


def leaks(before: ProcStats, after: ProcStats) -> list[str]:
    """What grew beyond TOLERANCE from `before` to `after`."""
    out = []
    if after.rss_mib > before.rss_mib * (1 + TOLERANCE["rss"]):
        out.append(f"memory {before.rss_mib:.0f} -> {after.rss_mib:.0f} MiB")
    for name in ("threads", "fds", "sockets"):
        a, b = getattr(before, name), getattr(after, name)
        if a is not None and b > a + TOLERANCE[name]:
            out.append(f"{name} {a} -> {b}")
    return out


# ------------------------------------------------------------------ requests and replies

@dataclass(frozen=True)
class Ask:
    kind: str  # "chat" | "completion"
    prompt: str

    @property
    def path(self) -> str:
        return PATHS[self.kind]

    def body(self, stream: bool, max_tokens: int) -> bytes:
        body = {"max_tokens": max_tokens, "temperature": 0, "stream": stream}
        if self.kind == "chat":
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return json.dumps(body).encode()


@dataclass
class Reply:
    status: int | None  # None: no answer (a connection error or CLIENT_TIMEOUT)
    text: str = ""
    finish: str | None = None
    error: dict | None = None  # a refusal's JSON body
    problem: str = ""  # why there was no answer, or what was wrong with it
    retry_after: str | None = None
    latency: float = 0.0
    ttft: float | None = None  # a stream's first text


def post(address: tuple[str, int], path: str, body: bytes, stream: bool = False,
         timeout: float = CLIENT_TIMEOUT, content_type: str = "application/json") -> Reply:
    start = time.monotonic()
    conn = http.client.HTTPConnection(*address, timeout=timeout)
    try:
        conn.request("POST", path, body, {"Content-Type": content_type})
        response = conn.getresponse()  # after any interim 100 Continue
        if response.status == 200 and stream:
            reply = _read_events(response, start)
        else:
            reply = _read_whole(response)
        reply.retry_after = response.headers.get("Retry-After")
    except (OSError, http.client.HTTPException) as e:
        reply = Reply(None, problem=f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    reply.latency = time.monotonic() - start
    return reply


def _read_whole(response: http.client.HTTPResponse) -> Reply:
    data = response.read()
    try:
        obj = json.loads(data)
    except ValueError:
        return Reply(response.status, problem=f"not JSON: {data[:80]!r}")
    if response.status != 200:
        return Reply(response.status, error=obj, problem=error_shape(obj))
    choice = obj["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return Reply(200, text, choice["finish_reason"])


def _read_events(response: http.client.HTTPResponse, start: float) -> Reply:
    reply, parts = Reply(200, problem="no [DONE]"), []
    for line in response:
        if not line.startswith(b"data: "):
            continue
        if line.strip() == b"data: [DONE]":
            reply.problem = ""
            break
        event = json.loads(line[6:])
        if not event["choices"]:
            continue  # the usage chunk
        choice = event["choices"][0]
        text = choice["delta"].get("content") if "delta" in choice else choice["text"]
        if text:
            parts.append(text)
            if reply.ttft is None:
                reply.ttft = time.monotonic() - start
        reply.finish = choice["finish_reason"] or reply.finish
    reply.text = "".join(parts)
    return reply


def error_shape(obj) -> str:
    """'' when `obj` is an OpenAI-style error body, else what is wrong with it."""
    error = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(error, dict):
        return "no 'error' object"
    if not isinstance(error.get("message"), str) or not error["message"]:
        return "no error message"
    if not isinstance(error.get("type"), str) or not {"param", "code"} <= set(error):
        return "error without type, param or code"
    return ""


def references(server: ServerProcess, asks: list[Ask], max_tokens: int) -> dict[Ask, Reply]:
    """Each request's reply when it is sent alone (greedy: the one right reply)."""
    out = {}
    for ask in asks:
        reply = post(server.address, ask.path, ask.body(False, max_tokens))
        if reply.status != 200:
            raise RuntimeError(f"a lone request failed: {reply}")
        out[ask] = reply
    return out


def good_request(server: ServerProcess, ask: Ask, reference: Reply, max_tokens: int) -> dict:
    """A plain request: is it served, with the lone reply, and how fast."""
    reply = post(server.address, ask.path, ask.body(False, max_tokens))
    ok = reply.status == 200 and (reply.text, reply.finish) == (reference.text,
                                                                  reference.finish)
    return {"ok": ok, "status": reply.status, "seconds": round(reply.latency, 2),
            "problem": reply.problem}


# ------------------------------------------------------------------ load

@dataclass
class LoadRecord:
    kind: str
    stream: bool
    outcome: str  # equal | unequal | 429 | 4xx | 5xx | error
    latency: float
    ttft: float | None
    retry_after: bool = True


def outcome(reply: Reply, reference: Reply) -> str:
    if reply.status is None:
        return "error"
    if reply.status >= 500:
        return "5xx"
    if reply.status == 429:
        return "429"
    if reply.status != 200:
        return "4xx"
    same = (reply.text, reply.finish) == (reference.text, reference.finish)
    return "equal" if same and not reply.problem else "unequal"


def client(server: ServerProcess, index: int, asks: list[Ask], refs: dict[Ask, Reply],
           until: float, max_tokens: int, records: list[LoadRecord]) -> None:
    stream = index % 2 == 1
    turn = index
    while time.monotonic() < until:
        ask = asks[turn % len(asks)]
        turn += 1
        reply = post(server.address, ask.path, ask.body(stream, max_tokens), stream)
        got = outcome(reply, refs[ask])
        records.append(LoadRecord(ask.kind, stream, got, reply.latency, reply.ttft,
                                  reply.retry_after is not None))
        if got == "429":
            time.sleep(min(float(reply.retry_after or 1), 5.0))
        elif got == "error":
            time.sleep(1.0)  # a refused connection would otherwise spin


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ranked = sorted(values)
    return round(ranked[min(len(ranked) - 1, int(q / 100 * len(ranked)))], 3)


def run_load(server: ServerProcess, asks: list[Ask], refs: dict[Ask, Reply], clients: int,
             seconds: float, max_tokens: int) -> dict:
    before = settled(server)
    records: list[LoadRecord] = []
    until = time.monotonic() + seconds
    threads = [threading.Thread(target=client, args=(server, i, asks, refs, until, max_tokens,
                                                     records)) for i in range(clients)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    after = settled(server, before)
    served = [r for r in records if r.outcome in ("equal", "unequal")]
    count = {k: sum(r.outcome == k for r in records)
             for k in ("equal", "unequal", "429", "4xx", "5xx", "error")}
    return {
        "clients": clients, "seconds": round(wall, 1), "requests": len(records),
        "served": len(served), **count,
        "429_without_retry_after": sum(r.outcome == "429" and not r.retry_after
                                       for r in records),
        "latency_p50": percentile([r.latency for r in served], 50),
        "latency_p99": percentile([r.latency for r in served], 99),
        "ttft_p50": percentile([r.ttft for r in served if r.ttft is not None], 50),
        "ttft_p99": percentile([r.ttft for r in served if r.ttft is not None], 99),
        "before": asdict(before), "after": asdict(after), "leaks": leaks(before, after)}


# ------------------------------------------------------------------ disconnects

def _request_bytes(ask: Ask, stream: bool, max_tokens: int, version: str = "HTTP/1.1",
                   headers: str = "") -> bytes:
    body = ask.body(stream, max_tokens)
    return (f"POST {ask.path} {version}\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n{headers}\r\n").encode() + body


def _connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection(server.address, timeout=CLIENT_TIMEOUT)


def leave_mid_stream(server: ServerProcess, ask: Ask, max_tokens: int) -> socket.socket:
    """A stream whose client has read its first events: returned open, to be closed."""
    sock = _connect(server)
    sock.sendall(_request_bytes(ask, True, max_tokens))
    seen = b""
    while seen.count(b"data: ") < 3:  # the opening chunk, then text
        data = sock.recv(4096)
        if not data:
            break
        seen += data
    return sock


def run_disconnects(server: ServerProcess, each: int, max_tokens: int, good: Ask,
                    reference: Reply, good_tokens: int) -> dict:
    """`each` clients leave mid-stream, `each` mid-generation (waiting for a whole reply), and
    `each` while queued behind a stream that then leaves too."""
    before = settled(server)
    mark = server.log_size()
    long = Ask("chat", LONG_PROMPT)
    for _ in range(each):
        leave_mid_stream(server, long, max_tokens).close()
    for _ in range(each):
        sock = _connect(server)
        sock.sendall(_request_bytes(long, False, max_tokens))
        time.sleep(1.0)  # the engine is free: generating by now
        sock.close()
    holder = leave_mid_stream(server, long, max_tokens)
    queued = [_connect(server) for _ in range(each)]
    for sock in queued:
        sock.sendall(_request_bytes(long, False, max_tokens))
    time.sleep(0.5)
    for sock in queued:
        sock.close()
    time.sleep(0.5)  # the watchers see them leave before the engine is free
    holder.close()
    after_good = good_request(server, good, reference, good_tokens)
    after = settled(server, before)
    ends = server.finished_since(mark)
    cancelled = [n for n, why in ends if why == "cancelled"]
    expected = 3 * each + 1
    return {
        "clients_left": expected, "cancelled": len(cancelled),
        "cancelled_while_queued": sum(n == 0 for n in cancelled),
        "most_generated_by_a_cancelled": max(cancelled, default=0), "max_tokens": max_tokens,
        "good_request": after_good, "before": asdict(before), "after": asdict(after),
        "leaks": leaks(before, after),
        "ok": len(cancelled) == expected and sum(n == 0 for n in cancelled) >= each
        and max(cancelled, default=0) < max_tokens and after_good["ok"]
        and not leaks(before, after)}


# ------------------------------------------------------------------ slow and broken clients

def read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, bool]:
    """What the server sends until it closes the connection (True) or `limit` s pass."""
    data, end = b"", time.monotonic() + limit
    while (left := end - time.monotonic()) > 0:
        if not select.select([sock], [], [], left)[0]:
            break
        try:
            chunk = sock.recv(65536)
        except OSError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def statuses(data: bytes) -> list[int]:
    return [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) ", data) if s != b"100"]


def _trickle(sock: socket.socket, data: bytes, every: float) -> None:
    """Sends `data` a byte every `every` seconds until the server answers or closes."""
    for byte in data:
        if select.select([sock], [], [], every)[0]:
            return
        sock.sendall(bytes([byte]))


def broken_cases(ask: Ask) -> dict[str, Callable[[socket.socket], object]]:
    """Each misbehaves on a connected socket; what the server sends is read after it. The
    last request of each asks for the connection to close, so that no case waits out the
    keep-alive."""
    body = ask.body(False, 2)
    head = (f"POST {ask.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            "\r\n").encode()
    get = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    close = get[:-2] + b"Connection: close\r\n\r\n"
    return {
        "body a byte a second": lambda s: (
            s.sendall(head + b"Content-Length: %d\r\n\r\n" % len(body)), _trickle(s, body, 1.0)),
        "headers never finished": lambda s: s.sendall(head),
        "request line never finished": lambda s: s.sendall(b"POST /v1/compl"),
        "Content-Length longer than the body": lambda s: s.sendall(
            head + b"Content-Length: %d\r\n\r\n" % (len(body) + 50) + body),
        "Content-Length shorter than the body": lambda s: s.sendall(
            head + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % (len(body) - 5)
            + body),
        "pipelined GET, GET, POST": lambda s: s.sendall(
            get + get + _request_bytes(ask, False, 2, headers="Connection: close\r\n")),
        "pipelined POST, GET": lambda s: s.sendall(_request_bytes(ask, False, 2) + close),
        "HTTP/1.0": lambda s: s.sendall(_request_bytes(ask, False, 2, "HTTP/1.0")),
        "HTTP/1.0 streaming": lambda s: s.sendall(_request_bytes(ask, True, 2, "HTTP/1.0")),
    }


def run_broken(server: ServerProcess, read_timeout: float, good: Ask, reference: Reply,
               good_tokens: int, lone_seconds: float) -> dict:
    """All cases at once; a good request a second later must be served within
    2 x its lone time + 2 s (not after the broken clients time out)."""
    before = settled(server)
    limit = read_timeout + 10.0
    results: dict[str, dict] = {}

    def run(name, misbehave):
        start = time.monotonic()
        with _connect(server) as sock:
            misbehave(sock)
            data, closed = read_until_closed(sock, limit)
        got = statuses(data)
        results[name] = {"statuses": got, "seconds": round(time.monotonic() - start, 1),
                         "ended": "answered" if got else "dropped" if closed else "open"}

    threads = [threading.Thread(target=run, args=item)
               for item in broken_cases(Ask("completion", PROMPTS[0])).items()]
    for t in threads:
        t.start()
    time.sleep(1.0)
    meanwhile = good_request(server, good, reference, good_tokens)
    meanwhile["bound_s"] = round(2 * lone_seconds + 2, 2)
    meanwhile["ok"] = meanwhile["ok"] and meanwhile["seconds"] <= meanwhile["bound_s"]
    for t in threads:
        t.join()
    after = settled(server, before)
    ok = all(r["ended"] != "open" and r["seconds"] <= read_timeout + 5
             and not any(s >= 500 for s in r["statuses"]) for r in results.values())
    return {"cases": results, "good_request_meanwhile": meanwhile, "read_timeout": read_timeout,
            "before": asdict(before), "after": asdict(after), "leaks": leaks(before, after),
            "ok": ok and meanwhile["ok"] and not leaks(before, after)}


# ------------------------------------------------------------------ malformed bodies

def judge(case: Malformed, reply: Reply) -> str:
    if reply.status is None:
        return "no answer"
    if reply.status >= 500:
        return "5xx"
    if 400 <= reply.status < 500:
        return "4xx" if not reply.problem else "4xx, not an OpenAI error"
    if reply.status == 200 and not case.must_fail:
        return "served"
    return f"{reply.status} (must fail)"


def run_malformed(server: ServerProcess, cases: int, max_tokens: int, rng_seed: int) -> dict:
    results: dict[str, int] = {}
    families: dict[str, int] = {}
    bad: list[dict] = []

    @seed(rng_seed)
    @settings(max_examples=cases, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(malformed(max_tokens))
    def probe(case: Malformed) -> None:
        reply = post(server.address, PATHS[case.kind], case.body, timeout=30.0)
        verdict = judge(case, reply)
        results[verdict] = results.get(verdict, 0) + 1
        families[case.family] = families.get(case.family, 0) + 1
        if verdict not in ("4xx", "served"):
            bad.append({"kind": case.kind, "family": case.family, "verdict": verdict,
                        "status": reply.status, "problem": reply.problem,
                        "body": case.body[:300].decode(errors="replace")})

    start = time.monotonic()
    probe()
    return {"cases": sum(results.values()), "seconds": round(time.monotonic() - start, 1),
            "outcomes": results, "families": families, "failures": bad[:50],
            "ok": not bad}


# ------------------------------------------------------------------ one mode, the report

@dataclass
class Config:
    clients: int = 32
    seconds: float = 600.0
    max_tokens: int = 24
    malformed: int = 3000
    disconnects: int = 3
    read_timeout: float = 30.0
    model: str | None = None
    seed: int = 0
    phases: tuple[str, ...] = ("load", "malformed", "disconnects", "broken")


@dataclass
class ModeReport:
    mode: str
    start: dict = field(default_factory=dict)
    end: dict = field(default_factory=dict)
    lone_seconds: float = 0.0
    phases: dict = field(default_factory=dict)
    good_after: dict = field(default_factory=dict)  # a good request after each phase
    lone: dict = field(default_factory=dict)  # "kind: prompt" -> the lone greedy reply
    exit_status: int | None = None


def run_mode(mode: str, config: Config, out: Path) -> ModeReport:
    asks = [Ask(kind, p) for p in PROMPTS for kind in ("chat", "completion")]
    server = start_server(mode, config.model, out / f"server-{mode}.log",
                          ["--read-timeout", str(config.read_timeout)])
    report = ModeReport(mode)
    try:
        refs = references(server, asks, config.max_tokens)
        report.lone = {f"{a.kind}: {a.prompt}": r.text for a, r in refs.items()}
        good = asks[0]
        timed = good_request(server, good, refs[good], config.max_tokens)
        report.lone_seconds = timed["seconds"]
        report.start = asdict(settled(server))
        for phase in config.phases:
            print(f"[{mode}] {phase}", file=sys.stderr, flush=True)
            if phase == "load":
                result = run_load(server, asks, refs, config.clients, config.seconds,
                                  config.max_tokens)
            elif phase == "malformed":
                result = run_malformed(server, config.malformed, 512, config.seed)
            elif phase == "disconnects":
                result = run_disconnects(server, config.disconnects, 400, good, refs[good],
                                         config.max_tokens)
            else:
                result = run_broken(server, config.read_timeout, good, refs[good],
                                    config.max_tokens, report.lone_seconds)
            report.phases[phase] = result
            report.good_after[phase] = good_request(server, good, refs[good],
                                                    config.max_tokens)
        report.end = asdict(settled(server))
    finally:
        report.exit_status = server.stop()
    return report


def verdict(report: ModeReport) -> list[str]:
    """What went wrong in one mode (empty: nothing)."""
    problems = []
    load = report.phases.get("load")
    if load:
        for key in ("unequal", "5xx", "error", "4xx", "429_without_retry_after"):
            if load[key]:
                problems.append(f"load: {load[key]} {key}")
        problems += [f"load: {x}" for x in load["leaks"]]
    for phase in ("malformed", "disconnects", "broken"):
        if phase in report.phases and not report.phases[phase]["ok"]:
            problems.append(f"{phase}: failed")
    problems += [f"no good reply after {p}" for p, g in report.good_after.items() if not g["ok"]]
    if report.exit_status != 0:
        problems.append(f"the server exited with {report.exit_status} on SIGTERM")
    return problems


def _mib(stats: dict) -> str:
    return f"{stats['rss_mib']:.0f}"


def markdown(reports: list[ModeReport], config: Config) -> str:
    lines = [f"# Server reliability: {config.clients} clients x {config.seconds / 60:g} min, "
             f"{config.malformed} malformed bodies", ""]
    loads = [r for r in reports if "load" in r.phases]
    if loads:
        lines += ["| mode | requests | served | = lone reply | 429 (Retry-After) | 4xx | 5xx "
                  "| errors | latency p50 / p99 s | TTFT p50 / p99 s | RSS MiB start / end "
                  "| threads | fds |", "|---|" + "---:|" * 12]
        for r in loads:
            x = r.phases["load"]
            b, a = x["before"], x["after"]
            lines.append(
                f"| {r.mode} | {x['requests']} | {x['served']} | {x['equal']} | {x['429']} "
                f"({x['429'] - x['429_without_retry_after']}) | {x['4xx']} | {x['5xx']} | "
                f"{x['error']} | {x['latency_p50']} / {x['latency_p99']} | {x['ttft_p50']} / "
                f"{x['ttft_p99']} | {_mib(r.start)} / {_mib(r.end)} | {b['threads']} -> "
                f"{a['threads']} | {b['fds']} -> {a['fds']} |")
        lines.append("")
    for r in reports:
        lines += [f"## {r.mode}", ""]
        m = r.phases.get("malformed")
        if m:
            lines.append(f"- malformed: {m['cases']} cases in {m['seconds']} s: "
                         + ", ".join(f"{k} {v}" for k, v in sorted(m["outcomes"].items()))
                         + " (by family: " + ", ".join(f"{k} {v}" for k, v in
                                                       sorted(m["families"].items())) + ")")
            lines += [f"  - {f['family']} ({f['kind']}): {f['verdict']} {f['problem']} "
                      f"`{f['body'][:120]!r}`" for f in m["failures"][:10]]
        d = r.phases.get("disconnects")
        if d:
            lines.append(
                f"- disconnects: {d['clients_left']} clients left (mid-stream, "
                f"mid-generation, queued), {d['cancelled']} generations cancelled "
                f"({d['cancelled_while_queued']} while queued; at most "
                f"{d['most_generated_by_a_cancelled']} of {d['max_tokens']} tokens generated); "
                f"threads {d['before']['threads']} -> {d['after']['threads']}, fds "
                f"{d['before']['fds']} -> {d['after']['fds']}, sockets {d['before']['sockets']}"
                f" -> {d['after']['sockets']}, RSS {_mib(d['before'])} -> {_mib(d['after'])} "
                f"MiB; a good request after: {d['good_request']['seconds']} s"
                + ("" if d["ok"] else " **FAILED** " + "; ".join(d["leaks"])))
        b = r.phases.get("broken")
        if b:
            g = b["good_request_meanwhile"]
            lines.append(f"- broken clients (read timeout {b['read_timeout']:g} s); a good "
                         f"request meanwhile: {g['status']} in {g['seconds']} s (bound "
                         f"{g['bound_s']} s)" + ("" if b["ok"] else " **FAILED**"))
            lines += [f"  - {name}: {c['ended']} {c['statuses']} after {c['seconds']} s"
                      for name, c in b["cases"].items()]
        problems = verdict(r)
        lines += [f"- verdict: {'; '.join(problems) if problems else 'ok'}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--modes", default="ar,mirror")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=24, help="tokens per load request")
    ap.add_argument("--malformed", type=int, default=3000, help="malformed bodies per mode")
    ap.add_argument("--disconnects", type=int, default=3,
                    help="clients that leave, of each kind (mid-stream, -generation, queued)")
    ap.add_argument("--read-timeout", type=float, default=30.0,
                    help="the server's --read-timeout (the broken clients wait it out)")
    ap.add_argument("--phases", default="load,malformed,disconnects,broken")
    ap.add_argument("--model", default=None, help="the server's --model (default: its default)")
    ap.add_argument("--seed", type=int, default=0, help="Hypothesis's seed")
    args = ap.parse_args(argv)
    config = Config(args.clients, args.minutes * 60, args.max_tokens, args.malformed,
                    args.disconnects, args.read_timeout, args.model, args.seed,
                    tuple(p.strip() for p in args.phases.split(",") if p.strip()))
    args.out.mkdir(parents=True, exist_ok=True)
    reports = [run_mode(m.strip(), config, args.out) for m in args.modes.split(",")]
    problems = {r.mode: verdict(r) for r in reports}
    for r in reports[1:]:  # greedy speculative decoding is lossless: the same lone replies
        differ = [k for k in r.lone if r.lone[k] != reports[0].lone.get(k)]
        if differ:
            problems[r.mode].append(f"{len(differ)} lone replies differ from "
                                    f"{reports[0].mode}'s, e.g. {differ[0]!r}")
    (args.out / "reliability.json").write_text(json.dumps(
        {"config": asdict(config), "tolerance": TOLERANCE, "problems": problems,
         "modes": [asdict(r) for r in reports]}, indent=1))
    text = markdown(reports, config) + "\n".join(
        f"- {mode}: {'; '.join(p) if p else 'ok'}" for mode, p in problems.items())
    (args.out / "reliability.md").write_text(text + "\n")
    print(text)
    return 1 if any(problems.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
