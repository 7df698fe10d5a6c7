"""The OpenAI-compatible server on the real default model, through the `openai` package and a
raw HTTP client: replies equal the Engine's, malformed requests get 4xx errors, a client that
leaves cancels its generation, concurrent clients are served one after another."""

import contextlib
import http.client
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

from mirror_mlx.api import Engine
from mirror_mlx.errors import MirrorError

import openai
import pytest

from apps.server.app import Server, serve

CONTEXT = 512
CHAT = [{"role": "user", "content": "Name three colors."}]


def start(engine: Engine, **options) -> Server:
    server = Server(engine, "127.0.0.1", 0, **options)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@contextlib.contextmanager
def serving(engine: Engine, **options):
    """A server of its own, with `options` (short limits for a test), on a shared engine."""
    server = start(engine, **options)
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def engine(target):
    with Engine(target, context=CONTEXT, mode="ar") as engine:
        yield engine


@pytest.fixture(scope="module")
def server(engine):
    with serving(engine) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def raw(server: Server, method: str, path: str, body=None, headers=None):
    """One request with http.client; returns (status, decoded JSON body)."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json",
                                                   **(headers or {})})
    response = conn.getresponse()
    out = response.status, json.loads(response.read())
    conn.close()
    return out


def finished(caplog, timeout: float = 30) -> list[str]:
    """The server's per-request log lines (one per finished generation)."""
    end = time.monotonic() + timeout
    while True:
        lines = [r.getMessage() for r in caplog.records if r.name == "apps.server.app"
                 and " generated," in r.getMessage()]
        if lines or time.monotonic() > end:
            return lines
        time.sleep(0.02)


def released(engine: Engine, timeout: float = 10) -> bool:
    """Whether the engine lets go of its generation within `timeout`: the request's log line
    is written from the last chunk, a moment before the generator hands its turn back."""
    end = time.monotonic() + timeout
    while engine.busy and time.monotonic() < end:
        time.sleep(0.01)
    return not engine.busy


def test_models(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.model_id] and models[0].owned_by == "mirror-mlx"
    assert client.models.retrieve(server.model_id).id == server.model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_equals_engine_streaming_and_not(client, server, target):
    expected = Engine(target, mode="ar").generate(CHAT, max_tokens=16)
    reply = client.chat.completions.create(model=server.model_id, messages=CHAT, max_tokens=16,
                                           temperature=0)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].finish_reason == ("length" if len(expected.token_ids) == 16
                                              else "stop")
    assert reply.usage.prompt_tokens == expected.stats.prompt_tokens
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.mirror_stats["mode"] == "ar" and reply.mirror_stats["tokens_per_second"] > 0
    assert "cached_prompt_tokens" not in reply.mirror_stats  # says what others asked

    chunks = list(client.chat.completions.create(
        model=server.model_id, messages=CHAT, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    ends = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(ends) == 1 and ends[0].mirror_stats["generated_tokens"] == len(expected.token_ids)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(
        expected.token_ids)
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3


def test_completions_equal_engine(client, server, target):
    prompt = "The three primary colors are"
    expected = Engine(target, mode="ar").generate(prompt, max_tokens=6, chat_template=False)
    whole = client.completions.create(model=server.model_id, prompt=prompt, max_tokens=6,
                                      temperature=0)
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    streamed = list(client.completions.create(model=server.model_id, prompt=prompt,
                                              max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == "length"
    by_ids = client.completions.create(model=server.model_id, prompt=target.tokenizer.encode(
        prompt), max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_mirror_server_is_lossless(target):
    """Greedy Mirror-SD through HTTP gives exactly the target-only Engine's tokens."""
    expected = Engine(target, mode="ar").generate(CHAT, max_tokens=8)
    with Engine(target, mode="mirror") as engine:
        server = start(engine)
        try:
            client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
            reply = client.chat.completions.create(model="anything", messages=CHAT,
                                                   max_tokens=8, temperature=0)
        finally:
            server.shutdown()
            server.server_close()
    assert reply.choices[0].message.content == expected.text
    stats = reply.mirror_stats
    assert stats["mode"] == "mirror" and stats["target_steps"] > 0
    for key in ("acceptance_length", "acceptance_rate", "reuse_rate", "fallback_rate",
                "overlap_fraction", "tokens_per_second"):
        assert key in stats


MALFORMED = [
    # (body, status, param)
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b"[" * 200_000, 400, None),  # deeper than the parser recurses
    (b'{"messages": [], "seed": ' + b"7" * 5000 + b"}", 400, None),  # more digits than int()
    (b'{"messages": [], "temperature": NaN}', 400, None),
    ({"model": "m"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content"),
    ({"messages": CHAT, "temperature": "hot"}, 400, "temperature"),
    ({"messages": CHAT, "temperature": 2.5}, 400, "temperature"),
    ({"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ({"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": CHAT, "max_tokens": 1.5}, 400, "max_tokens"),
    ({"messages": CHAT, "n": 2}, 400, "n"),
    ({"messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"messages": CHAT, "stop": 7}, 400, "stop"),
    ({"messages": CHAT, "stop": ["x" * 257], "max_tokens": 1}, 400, "stop"),
    ({"messages": CHAT, "stream": "yes"}, 400, "stream"),
    ({"messages": CHAT, "seed": -1}, 400, "seed"),
    ({"messages": CHAT, "logprobs": True}, 400, "logprobs"),
    ({"messages": CHAT, "temprature": 0.5}, 400, "temprature"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, 400, "messages"),
    # An integer too large for a float (was a 500: OverflowError).
    ({"messages": CHAT, "temperature": 10**400}, 400, "temperature"),
    ({"messages": CHAT, "top_p": -10**400}, 400, "top_p"),
    # Valid JSON, not Unicode text: a lone surrogate (was a 500 from the tokenizer).
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', 400, None),
]


@pytest.mark.parametrize("body,status,param", MALFORMED,
                         ids=[f"{i}" for i in range(len(MALFORMED))])
def test_malformed_chat_requests(server, body, status, param):
    got, reply = raw(server, "POST", "/v1/chat/completions", body,
                     {"Content-Type": "application/json"})
    assert got == status, reply
    error = reply["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param, error


def test_malformed_http(server, client):
    assert raw(server, "POST", "/v1/completions", {"prompt": ["a", "b"]})[0] == 400
    assert raw(server, "POST", "/v1/completions", {"prompt": ""})[0] == 400
    assert raw(server, "POST", "/v1/completions", {"prompt": [1, 10**9]})[0] == 400
    assert raw(server, "POST", "/v1/completions", {"prompt": "a\udfffb"})[0] == 400
    # No stop sequences, as an empty list (was a 500: max() of nothing).
    assert raw(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1,
                                                   "stop": []})[0] == 200
    status, reply = raw(server, "POST", "/v1/completions", {"prompt": "x " * 1000})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    assert raw(server, "GET", "/v1/chat/completions")[0] == 405
    assert raw(server, "GET", "/v2/anything")[0] == 404
    assert raw(server, "POST", "/v1/embeddings", {"input": "x"})[0] == 404

    # By hand: http.client always sends a Content-Length. The size limit is judged from the
    # header, before a byte of the body is read.
    for headers, status in ((b"", b"411"),
                            (b"Content-Length: %d\r\n" % (server.limits.max_body + 1), b"413")):
        with socket.create_connection(server.server_address[:2], timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\n" + headers + b"\r\n")
            assert sock.recv(100).startswith(b"HTTP/1.1 " + status)

    # The openai package maps the 400 to its own exception; the server is still fine.
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="m", messages=CHAT, temperature=-1)
    ok = client.chat.completions.create(model="m", messages=CHAT, max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_a_refused_body_still_gets_its_reply(server):
    """A request refused before its body is read (413 here) while the client is still sending
    that body: the client gets the refusal, not a broken pipe (the server drains, then
    closes). Before, each of these got a BrokenPipeError or a reset instead."""
    body = b'{"messages": ' + b"[" * 5_000_000 + b"}"
    for path, content_type, status in (("/v1/chat/completions", "application/json", 413),
                                       ("/v1/nothing", "application/json", 404)):
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
        conn.request("POST", path, body, {"Content-Type": content_type})
        response = conn.getresponse()
        assert response.status == status and json.loads(response.read())["error"]
        conn.close()


def _request_bytes(server: Server, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            b"application/json\r\nContent-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)


def test_max_tokens_is_a_ceiling(engine):
    with serving(engine, max_tokens=4) as server:
        status, reply = raw(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 5})
        assert status == 400 and reply["error"]["param"] == "max_tokens", reply
        assert "at most 4" in reply["error"]["message"]
        status, reply = raw(server, "POST", "/v1/chat/completions",
                            {"messages": CHAT, "max_completion_tokens": 5})
        assert status == 400 and reply["error"]["param"] == "max_completion_tokens", reply
        status, reply = raw(server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4})
        assert status == 200 and reply["usage"]["completion_tokens"] <= 4


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streaming"])
def test_request_timeout_ends_the_reply(engine, stream):
    """Past --request-timeout the generation stops; the client gets what was generated, with
    finish_reason "length" (mirror_stats says "timeout")."""
    with serving(engine, request_timeout=0.5) as server:
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model="m", prompt="A long essay about rivers:",
                                          max_tokens=500, temperature=0, stream=stream)
        last = list(reply)[-1] if stream else reply
    assert last.choices[0].finish_reason == "length"
    assert last.mirror_stats["finish_reason"] == "timeout"
    assert last.mirror_stats["generated_tokens"] < 500


def test_a_request_that_times_out_waiting_for_its_turn_gets_a_503(engine):
    """Past --request-timeout before its first token (queued behind a generation that holds
    the engine): no reply was begun, so it is told the server is busy, with Retry-After, not
    given an empty 200."""
    with serving(engine, request_timeout=0.5) as server:
        holder = engine.stream("A long essay about rivers:", max_tokens=500)
        next(holder)  # the engine's turn is taken until the stream is closed
        try:
            conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
            conn.request("POST", "/v1/completions", body=json.dumps({"prompt": "Hi"}),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            status, body = response.status, json.loads(response.read())
            retry = response.getheader("Retry-After")
            conn.close()
        finally:
            holder.close()
    assert status == 503 and retry, body
    assert body["error"]["code"] == "request_timeout"
    assert "no token within --request-timeout (0.5 s)" in body["error"]["message"]


def _read_all(sock: socket.socket, timeout: float = 60) -> bytes:
    """Everything the server sends until it closes the connection (or `timeout` passes: a
    bound on a hang, not a measure; every caller expects the server to close)."""
    sock.settimeout(timeout)
    out = b""
    with contextlib.suppress(TimeoutError, ConnectionResetError):
        while data := sock.recv(65536):
            out += data
    return out


def test_connections_are_capped(engine):
    with serving(engine, max_connections=2) as server:
        address = server.server_address[:2]
        idle = [socket.create_connection(address, timeout=5) for _ in range(2)]
        with socket.create_connection(address, timeout=5) as third:
            busy = _read_all(third)
            assert busy.startswith(b"HTTP/1.1 503") and b"Retry-After: 1\r\n" in busy
        idle[0].close()  # frees a slot once its thread sees the close
        deadline, status = time.monotonic() + 60, 0
        while status != 200 and time.monotonic() < deadline:
            status = raw_status(server)
            time.sleep(0.05)
        assert status == 200
        idle[1].close()


def raw_status(server: Server) -> int:
    with socket.create_connection(server.server_address[:2], timeout=5) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        return int(_read_all(sock)[9:12] or 0)


def test_listen_backlog_holds_a_burst(engine):
    """Connections beyond the kernel's backlog wait for a SYN retry (a second or more); 5, the
    standard library's default, is too few for a burst of clients."""
    server = Server(engine, "127.0.0.1", 0)  # listening, not accepting yet
    try:
        socks = [socket.create_connection(server.server_address[:2], timeout=0.5)
                 for _ in range(20)]
        for sock in socks:
            sock.close()
    finally:
        server.server_close()


def test_one_deadline_for_headers_and_body(engine, caplog):
    """Headers trickled a byte at a time, each in time for a per-read timeout, a body shorter
    than its Content-Length and a request line that never ends all get 408 once read_timeout
    has passed. The trickle
    would last 17 s: a deadline per read would answer only after it, the one deadline
    after 0.5 s (the bound leaves a busy machine 10 s to answer)."""
    with serving(engine, read_timeout=0.5) as server:
        address = server.server_address[:2]
        with socket.create_connection(address, timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
            start = time.monotonic()
            for byte in b"Host: 127.0.0.1\r\nX-Slow: " + b"a" * 150:
                if select.select([sock], [], [], 0.1)[0]:
                    break
                sock.sendall(bytes([byte]))
            assert _read_all(sock).startswith(b"HTTP/1.1 408")
            assert time.monotonic() - start < 10
        with socket.create_connection(address, timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
            assert _read_all(sock).startswith(b"HTTP/1.1 408")
        with socket.create_connection(address, timeout=5) as sock:
            sock.sendall(b"POST /v1/compl")  # a request line that never ends
            assert _read_all(sock).startswith(b"HTTP/1.1 408")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_idle_keep_alive_is_short(engine):
    """Closed after 0.3 s idle; the default (15 s) would miss the bound, which leaves a busy
    machine 10 s to close."""
    with serving(engine, keep_alive=0.3) as server:
        with socket.create_connection(server.server_address[:2], timeout=5) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            start = time.monotonic()
            assert _read_all(sock).startswith(b"HTTP/1.1 200")  # then closed by the server
            assert time.monotonic() - start < 10


@pytest.mark.parametrize("stream,extra", [(True, b""), (False, b""), (False, b"x")],
                         ids=["streaming", "waiting", "waiting-after-an-extra-byte"])
def test_client_disconnect_cancels(server, caplog, stream, extra):
    """A client that closes its connection cancels its generation, also when it sent a byte
    more than its request first."""
    caplog.set_level(logging.INFO, logger="apps.server.app")
    engine = server.engine
    body = {"messages": [{"role": "user", "content": "Write a long essay about rivers."}],
            "max_tokens": 400, "temperature": 0, "stream": stream}
    sock = socket.create_connection(server.server_address[:2], timeout=60)
    sock.sendall(_request_bytes(server, body))
    if stream:
        seen = b""
        while seen.count(b"data: ") < 3:  # the opening chunk, then text
            seen += sock.recv(4096)
        assert seen.startswith(b"HTTP/1.1 200")
    else:
        deadline = time.monotonic() + 30
        while not engine.busy and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)
    sock.sendall(extra)  # after the body was read: beside the request, not in its buffer
    time.sleep(0.2)
    sock.close()
    [line] = finished(caplog)
    assert line.endswith("finish cancelled"), line
    generated = int(line.split(" generated,")[0].split()[-1])
    assert generated < 100
    assert released(engine)


def test_extra_bytes_close_the_connection(server):
    """Bytes after a request are dropped, so the connection closes after the reply instead of
    reading them as a request."""
    with socket.create_connection(server.server_address[:2], timeout=60) as sock:
        sock.sendall(_request_bytes(server, {"messages": CHAT, "max_tokens": 30}))
        deadline = time.monotonic() + 30
        while not server.engine.busy and time.monotonic() < deadline:
            time.sleep(0.005)  # the body is read: what comes next is beside the request
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        replies = _read_all(sock, 60)
    assert replies.startswith(b"HTTP/1.1 200") and replies.count(b"HTTP/1.1 ") == 1, replies


def test_half_closed_client_gets_its_reply(server):
    """A client that shuts its sending side after the request still waits for the reply."""
    with socket.create_connection(server.server_address[:2], timeout=60) as sock:
        sock.sendall(_request_bytes(server, {"messages": CHAT, "max_tokens": 3,
                                             "temperature": 0, "stream": True}))
        sock.shutdown(socket.SHUT_WR)
        replies = _read_all(sock, 60)
    final = replies[replies.rindex(b"HTTP/1.1 "):]  # after any interim 100 Continue
    assert final.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in final, replies
    assert b'"finish_reason": "length"' in final

    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hi", "max_tokens": 3}),
                 {"Content-Type": "application/json"})
    conn.sock.shutdown(socket.SHUT_WR)
    response = conn.getresponse()  # http.client skips the interim 100s
    reply = json.loads(response.read())
    conn.close()
    assert response.status == 200 and reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["text"]


def test_browser_pages_are_refused(server):
    """A page on another site can send a text/plain POST without a preflight, or rebind its
    own name to 127.0.0.1 and read replies: neither gets through."""
    port = server.server_address[1]
    chat = json.dumps({"messages": CHAT, "max_tokens": 1}).encode()
    assert raw(server, "POST", "/v1/chat/completions", chat,
               {"Content-Type": "text/plain"})[0] == 415
    assert raw(server, "POST", "/v1/chat/completions", chat,
               {"Origin": "http://evil.example"})[0] == 403
    assert raw(server, "GET", "/v1/models", headers={"Host": f"evil.example:{port}"})[0] == 403
    assert raw(server, "GET", "/v1/models", headers={"Origin": "https://evil.example"})[0] == 403
    assert raw(server, "OPTIONS", "/v1/chat/completions",
               headers={"Origin": "http://evil.example"})[0] == 403
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "[::1]"):
        assert raw(server, "GET", "/v1/models", headers={"Host": host})[0] == 200, host
    assert raw(server, "GET", "/v1/models", headers={  # the server's own page
        "Origin": f"http://127.0.0.1:{port}", "Host": f"127.0.0.1:{port}"})[0] == 200


def test_cors_only_for_allowed_origins(engine):
    with serving(engine, cors_origins=("http://app.example",),
                 allowed_hosts=("box.example",)) as server:
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
        conn.request("OPTIONS", "/v1/chat/completions", headers={
            "Origin": "http://app.example", "Access-Control-Request-Method": "POST"})
        response = conn.getresponse()
        response.read()
        assert response.status == 204
        assert response.headers["Access-Control-Allow-Origin"] == "http://app.example"
        assert "Content-Type" in response.headers["Access-Control-Allow-Headers"]
        conn.request("GET", "/v1/models", headers={"Origin": "http://app.example",
                                                   "Host": "box.example:8000"})
        response = conn.getresponse()
        response.read()
        assert response.status == 200
        assert response.headers["Access-Control-Allow-Origin"] == "http://app.example"
        conn.close()
        assert raw(server, "GET", "/v1/models", headers={"Origin": "http://other.example"})[0] \
            == 403


def test_api_key(engine):
    """With a key, every route wants it; a `model` field only labels the request."""
    with serving(engine, api_key="sekrit") as server:
        assert raw(server, "GET", "/v1/models")[0] == 401
        assert raw(server, "GET", "/v2/nothing")[0] == 401
        assert raw(server, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] \
            == 401
        status, reply = raw(server, "POST", "/v1/completions", {"prompt": "Hi"})
        assert status == 401 and reply["error"]["code"] == "invalid_api_key"
        client = openai.OpenAI(base_url=server.url, api_key="sekrit", max_retries=0)
        reply = client.completions.create(model="/etc/passwd", prompt="Hi", max_tokens=1)
        assert reply.model == server.model_id and reply.usage.completion_tokens == 1


def test_public_address_needs_a_key(engine):
    with pytest.raises(MirrorError, match="API key"):
        Server(engine, "0.0.0.0", 0)
    for options in ({"api_key": "sekrit"}, {"allow_no_auth": True}):
        Server(engine, "0.0.0.0", 0, **options).server_close()


def test_a_get_with_a_body_keeps_requests_apart(server):
    """A body where none is read is not taken for the next request: the connection closes."""
    inner = b"GET /v2/smuggled HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(server.server_address[:2], timeout=30) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n"
                     b"\r\n%s" % (len(inner), inner))
        replies = _read_all(sock)
    assert replies.startswith(b"HTTP/1.1 200") and replies.count(b"HTTP/1.1 ") == 1, replies
    assert b"Connection: close" in replies


def test_a_slow_stream_reader_is_cut_off(engine, caplog):
    """A streaming client that stops reading does not hold the engine: once the kernel's
    buffers (made small here) and the server's stream_buffer are full, its generation ends."""
    caplog.set_level(logging.INFO, logger="apps.server.app")
    with serving(engine, stream_buffer=1024) as server:
        server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1024)  # accepted inherit
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        sock.settimeout(30)
        sock.connect(server.server_address[:2])
        sock.sendall(_request_bytes(server, {
            "messages": [{"role": "user", "content": "Write a long essay about rivers."}],
            "max_tokens": 300, "temperature": 0, "stream": True}))
        assert sock.recv(12) == b"HTTP/1.1 200"  # then reads no more
        [line] = finished(caplog, 60)
        assert line.endswith("finish behind"), line
        assert int(line.split(" generated,")[0].split()[-1]) < 300
        assert released(engine)  # while the client is still connected
        sock.close()


def test_log_escapes_request_lines(server, caplog):
    caplog.set_level(logging.DEBUG, logger="apps.server.app")
    for line in (b"GET /v1/\x1b[2J\x1b[31mred\x07\x9b HTTP/1.1", b"\x1b[31mPATCH /v1 HTTP/1.1"):
        with socket.create_connection(server.server_address[:2], timeout=30) as sock:
            sock.sendall(line + b"\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert _read_all(sock)[9:12] in (b"404", b"501")
    logged = [r.getMessage() for r in caplog.records if r.name == "apps.server.app"]
    assert any("\\x1b[31m" in m for m in logged), logged
    assert not any(c in m for m in logged for c in "\x1b\x07\x9b")


def test_concurrent_clients_are_queued(server, target, caplog):
    caplog.set_level(logging.INFO, logger="apps.server.app")
    prompts = [f"Name a {thing}." for thing in ("fruit", "river", "planet")]
    results: dict[str, str] = {}

    def ask(prompt):
        client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": prompt}], max_tokens=4,
            temperature=0, stream=prompt.endswith("river."))
        results[prompt] = (reply.choices[0].message.content if not prompt.endswith("river.")
                           else "".join(c.choices[0].delta.content or "" for c in reply))

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    engine = Engine(target, mode="ar")
    for p in prompts:
        assert results[p] == engine.generate(p, max_tokens=4).text, p
    assert len(finished(caplog)) == len(prompts)


def test_queue_limit_gives_429(engine):
    with serving(engine, max_queue=1) as server:
        holder = threading.Thread(target=lambda: raw(server, "POST", "/v1/completions", {
            "prompt": "Once upon a time", "max_tokens": 300, "temperature": 0}))
        holder.start()
        while not engine.busy:
            time.sleep(0.01)
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hi"}),
                     {"Content-Type": "application/json"})
        response = conn.getresponse()
        reply = json.loads(response.read())
        conn.close()
        assert response.status == 429 and "try again" in reply["error"]["message"]
        assert response.headers["Retry-After"] == "1"  # when a client may try again
        engine.cancel()
        holder.join(timeout=30)


def test_stop_ends_streams_and_refuses_the_queue(engine):
    """A graceful stop: the running stream gets its final event, a waiting request 503."""
    server = start(engine)
    body = {"messages": [{"role": "user", "content": "Write a long essay about rivers."}],
            "max_tokens": 400, "temperature": 0, "stream": True}
    streamed, queued = [], []
    with socket.create_connection(server.server_address[:2], timeout=60) as sock:
        sock.sendall(_request_bytes(server, body))
        seen = b""
        while seen.count(b"data: ") < 3:  # the opening chunk, then text
            seen += sock.recv(4096)
        reader = threading.Thread(target=lambda: streamed.append(seen + _read_all(sock, 60)))
        reader.start()
        waiter = threading.Thread(target=lambda: queued.append(raw(
            server, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 2})))
        deadline = time.monotonic() + 30
        waiter.start()
        while not engine.waiting and time.monotonic() < deadline:
            time.sleep(0.01)
        server.shutdown()
        server.server_close()
        reader.join(60)
        waiter.join(60)
    assert queued[0][0] == 503 and queued[0][1]["error"]["type"] == "server_shutting_down"
    assert b'"finish_reason": "cancelled"' in streamed[0], streamed
    assert streamed[0].endswith(b"data: [DONE]\n\n")
    assert not engine.busy


def test_serve_command(default_gguf):
    """`mirror-mlx serve` as a user runs it: prints its address, serves, stops gracefully on
    SIGTERM."""
    with subprocess.Popen(
            [sys.executable, "-m", "mirror_mlx", "serve", "--model", str(default_gguf), "--port",
             "0", "--max-tokens", "3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1",
                            "MIRROR_MLX_API_KEY": "sekrit"}) as proc:
        try:
            line = proc.stdout.readline()
            assert " at http://127.0.0.1:" in line, line + proc.stderr.read()
            client = openai.OpenAI(base_url=line.split(" at ")[1].strip(), api_key="sekrit",
                                   max_retries=0)
            with pytest.raises(openai.AuthenticationError):  # the key from the environment
                client.with_options(api_key="wrong").models.list()
            reply = client.chat.completions.create(model="m", messages=CHAT)
            assert reply.usage.completion_tokens == 3  # the server's --max-tokens
            client.close()
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, proc.stderr.read()
            assert "stopping (SIGTERM)" in proc.stderr.read()
        finally:
            proc.kill()


def test_serve_reports_an_address_it_cannot_use(server):
    host, port = server.server_address[:2]
    with pytest.raises(MirrorError, match=f"cannot listen on {host}:{port}"):
        serve(server.engine, host, port)  # taken by the test's server
