"""The HTTP side: routes, body limits, server-sent events, the request queue, connections and
a graceful stop. Beside it: who may call (guard.py), the knobs (limits.py), a request's read
deadline (reading.py), why it stops early (watch.py), slow stream readers (sending.py).

The standard library's ThreadingHTTPServer is enough: one engine generates one reply at a
time, so an asynchronous framework would buy nothing and add dependencies. Each request has
its own thread; the Engine queues them in arrival order."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import logging
import signal
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from itertools import chain
from urllib.parse import urlsplit

from mirror_mlx.api import Engine, EngineClosed, model_name
from mirror_mlx.decode.stats import GenerationStats
from mirror_mlx.errors import InvalidParameter, MirrorError, PromptTooLong

from .guard import PREFLIGHT_HEADERS, Access, check_host, check_key, check_origin, is_loopback
from .limits import Limits
from .reading import DeadlineReader
from .request import Request, RequestError, parse
from .response import Reply, model_card
from .sending import EventSender
from .watch import Stop, watch

log = logging.getLogger(__name__)

GRACE_S = 5.0  # how long server_close waits for handlers to finish their replies
# Seconds a client told "busy" (429, 503) should wait before it tries again (Retry-After): a
# request of the default model's length is done by then, and clients that honour it (the
# openai package does) do not spin on a full queue.
RETRY_AFTER_S = 1
# How long a connection closed with its request's body unread goes on reading (and dropping)
# what the client still sends, so that the client, still sending, gets the reply (a 413) and
# not a reset.
LINGER_S = 2.0
ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


class Server(ThreadingHTTPServer):
    """Serves one Engine within `limits` (Limits' fields, as keywords) to the clients `access`
    lets in (Access's fields, as keywords). Listening beyond loopback takes an API key or
    `allow_no_auth`. `server_close()` ends every connection and joins its thread: a thread
    still winding down MLX while the process exits can abort it."""

    daemon_threads = False
    block_on_close = True
    request_queue_size = 128  # connections the kernel holds before accept (the default: 5)

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 8000, *,
                 model_id: str | None = None, api_key: str | None = None,
                 allow_no_auth: bool = False, allowed_hosts: tuple[str, ...] = (),
                 cors_origins: tuple[str, ...] = (), **limits):
        self.limits = Limits(**limits)
        if api_key is not None and not api_key.strip():
            raise InvalidParameter("the API key is empty")
        self.access = Access(api_key, tuple(h.lower() for h in allowed_hosts),
                             tuple(cors_origins))
        self.bound_host = host
        self.engine = engine
        self.model_id = model_id or model_name(engine.target)
        self.slots = threading.BoundedSemaphore(self.limits.max_queue)
        self.open_slots = threading.BoundedSemaphore(self.limits.max_connections)
        self.created = int(time.time())
        self.stopping = False
        self._connections: set[socket.socket] = set()
        self._idle: set[socket.socket] = set()  # connections waiting for their next request
        self._requests: set[Stop] = set()  # requests waiting for the engine or generating
        self._handlers = 0  # connection threads running
        self._connections_lock = threading.Lock()
        self._changed = threading.Condition(self._connections_lock)
        super().__init__((host, port), Handler)
        if not (api_key or allow_no_auth or is_loopback(self.server_address[0])):
            self.socket.close()
            raise InvalidParameter(
                f"{host} is reachable from other machines: give an API key (--api-key or "
                "MIRROR_MLX_API_KEY), or --allow-no-auth to serve anyone who can connect")

    def track(self, sock: socket.socket, is_open: bool) -> None:
        with self._connections_lock:
            if is_open:
                self._connections.add(sock)
            else:
                self._connections.discard(sock)

    def idle(self, sock: socket.socket, is_idle: bool) -> bool:
        """Marks a connection waiting for a request (or not); False when stopping."""
        with self._connections_lock:
            (self._idle.add if is_idle else self._idle.discard)(sock)
            return not self.stopping

    def enlist(self, stop: Stop, is_running: bool) -> bool:
        """Registers a request the server stops on shutdown; False when stopping."""
        with self._connections_lock:
            (self._requests.add if is_running else self._requests.discard)(stop)
            return not self.stopping

    def stop(self) -> None:
        """The start of a graceful shutdown (idempotent): waiting requests get 503, the running
        one ends now (a stream with its final event), idle connections close, and a request
        arriving on an open one gets 503. Call it once serve_forever has returned."""
        with self._connections_lock:
            self.stopping = True
            for stop in self._requests:
                stop.set("shutdown")
            for sock in self._idle:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RD)  # its handler reads end-of-file

    def get_request(self):
        try:
            return super().get_request()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                # Out of descriptors: the listening socket stays readable, so returning at
                # once would spin the accept loop. Wait for a connection to end.
                log.warning("out of file descriptors: not accepting for a moment")
                time.sleep(0.1)
            raise

    def process_request(self, request, client_address) -> None:
        """One thread per connection, at most `max_connections`; beyond: 503, closed."""
        if not self.open_slots.acquire(blocking=False):
            with contextlib.suppress(OSError):
                request.setblocking(False)
                request.send(_BUSY)
            self.shutdown_request(request)
            return
        with self._changed:
            self._handlers += 1
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._handler_done()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._handler_done()

    def _handler_done(self) -> None:
        with self._changed:
            self._handlers -= 1
            self._changed.notify_all()
        self.open_slots.release()

    def handle_error(self, request, client_address) -> None:
        """A connection's thread failed outside a request's own handling (the standard
        library prints a traceback for a client that reset its connection)."""
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.debug("connection from %s ended: %s", client_address[0], error)
        else:
            log.exception("connection from %s failed", client_address[0])

    def server_close(self) -> None:
        """stop(), then up to GRACE_S for the replies to go out; then every connection ends."""
        self.stop()
        with self._changed:
            self._changed.wait_for(lambda: not self._handlers, GRACE_S)
            for sock in self._connections:
                # Wakes a handler blocked on a client that does not read.
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        super().server_close()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"


def _plain(status: int, reason: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nRetry-After: {RETRY_AFTER_S}\r\n"
            "Connection: close\r\n\r\n").encode() + data


_BUSY = _plain(503, "Service Unavailable", RequestError(
    503, "too many open connections; try again later", type="server_busy").body())


class Handler(BaseHTTPRequestHandler):
    server: Server
    protocol_version = "HTTP/1.1"

    _replied = False  # a status line went out for the current request
    _cors: str | None = None  # the origin the reply's CORS headers allow
    _body_read = False  # the request's body was read
    _served = 0  # requests answered on this connection
    _linger = False  # the connection closes with a request body unread

    def setup(self) -> None:
        super().setup()
        # Reads go through one deadline per request (reading.py); writes have their own.
        self._reader = DeadlineReader(self.connection)
        self._sending = threading.Lock()  # the reply's start vs the watcher's probe
        self.rfile = io.BufferedReader(self._reader)
        self.server.track(self.connection, True)

    def finish(self) -> None:
        self.server.track(self.connection, False)
        super().finish()
        if self._linger:
            _drain(self.connection, LINGER_S)

    def handle_one_request(self) -> None:
        self._replied, self._cors, self._body_read = False, None, False
        limits = self.server.limits
        # A new connection's first request may take as long as reading one does; later ones
        # keep an idle connection open only briefly.
        self._reader.expect(limits.keep_alive if self._served else limits.read_timeout,
                            limits.read_timeout)
        if not self.server.idle(self.connection, True):
            self.close_connection = True
            return
        self.raw_requestline = b""
        try:
            super().handle_one_request()
        finally:
            self.server.idle(self.connection, False)
        if not self.raw_requestline and self._reader.began is not None:
            # The standard library closes without a word when the request line times out
            # (a client that began one and stalled): say why, as for its headers.
            self.command, self.requestline, self.request_version = None, "", "HTTP/1.1"
            self._timed_out("request line")
        self._served += 1

    @property
    def _started(self) -> float:
        """When the request's first byte came (its time budget counts from there)."""
        return self._reader.began or time.monotonic()

    def parse_request(self) -> bool:
        self.server.idle(self.connection, False)  # the request line is in
        try:
            parsed = super().parse_request()
        except TimeoutError:
            self._timed_out("headers")
            return False
        if parsed and self.server.stopping:
            self.close_connection = True
            self._error(RequestError(503, "the server is shutting down",
                                     type="server_shutting_down"))
            return False
        return parsed

    def _timed_out(self, what: str) -> None:
        self.close_connection = True
        with contextlib.suppress(OSError):
            self._error(RequestError(408, f"the request's {what} did not arrive within "
                                     f"{self.server.limits.read_timeout:g} s",
                                     code="request_timeout"))

    def log_message(self, format, *args) -> None:
        log.debug("%s %s", self.address_string(), printable(format % args))

    # ---- routes
    @property
    def _line(self) -> str:
        """The request's method and path as the log shows them."""
        return printable(f"{self.command} {self.path}")

    def _admit(self) -> bool:
        """The Host, Origin and API key checks (guard.py); False once a refusal is sent."""
        try:
            check_host(self.headers, self.server.access, self.server.bound_host)
            self._cors = check_origin(self.headers, self.server.access)
            check_key(self.headers, self.server.access)
        except RequestError as e:
            self.close_connection = True  # a body stays unread
            self._error(e)
            return False
        return True

    def do_OPTIONS(self) -> None:
        """A browser's CORS preflight (it carries no API key): allowed origins only."""
        try:
            check_host(self.headers, self.server.access, self.server.bound_host)
            self._cors = check_origin(self.headers, self.server.access)
        except RequestError as e:
            self.close_connection = True
            self._error(e)
            return
        self._begin(204)
        for name, value in PREFLIGHT_HEADERS.items():
            self.send_header(name, value)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        if not self._admit():
            return
        path = urlsplit(self.path).path.rstrip("/")
        if path == "/v1/models":
            self._json(200, {"object": "list",
                             "data": [model_card(self.server.model_id, self.server.created)]})
        elif path == f"/v1/models/{self.server.model_id}":
            self._json(200, model_card(self.server.model_id, self.server.created))
        elif path.startswith("/v1/models/"):
            self._error(RequestError(404, f"no model '{path[len('/v1/models/'):]}'; this server "
                                     f"serves '{self.server.model_id}'", "model",
                                     "model_not_found"))
        elif path in ROUTES:
            self._error(RequestError(405, f"{path} takes POST"))
        else:
            self._error(RequestError(404, f"no route GET {path}", code="not_found"))

    def do_POST(self) -> None:
        if not self._admit():
            return
        path = urlsplit(self.path).path.rstrip("/")
        try:
            if path not in ROUTES:
                self.close_connection = True  # the body stays unread
                raise RequestError(404, f"no route POST {path}", code="not_found")
            if self.headers.get_content_type() != "application/json":
                # A web page can send text/plain anywhere without asking (no preflight).
                self.close_connection = True
                raise RequestError(415, "send the body as JSON with Content-Type: "
                                   "application/json", code="unsupported_media_type")
            request = parse(ROUTES[path], self._body(), self.server.limits.max_tokens)
            if not self.server.slots.acquire(blocking=False):
                raise RequestError(429, "too many requests are waiting; try again later",
                                   type="server_busy")
            try:
                self._generate(request)
            finally:
                self.server.slots.release()
        except RequestError as e:
            self._error(e)
        except _Answered:
            pass
        except Exception:
            log.exception("%s failed", self._line)
            self.close_connection = True
            if not self._replied:
                self._error(RequestError(500, "internal error; the server's log has the details",
                                         type="server_error"))

    def _body(self):
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise RequestError(411, "send the body with a Content-Length, not chunked")
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            raise RequestError(411, "a Content-Length header is required")
        if int(length) > self.server.limits.max_body:
            self.close_connection = True
            raise RequestError(413, f"the body is {length} bytes; the limit is "
                               f"{self.server.limits.max_body}", code="request_too_large")
        try:
            raw = self.rfile.read(int(length))
        except TimeoutError:
            self._timed_out("body")
            raise _Answered() from None
        if len(raw) < int(length):
            self.close_connection = True
            raise RequestError(400, f"the body ended after {len(raw)} of its {length} bytes")
        self._body_read = True
        self.connection.settimeout(self.server.limits.write_timeout)  # for the watcher's probe
        try:
            return json.loads(raw, parse_constant=_not_json)
        except RecursionError:
            raise RequestError(400, "the body's JSON nests too deeply") from None
        except ValueError as e:  # also integers of more digits than int() takes
            raise RequestError(400, f"the body is not valid JSON: {e}") from None

    # ---- generation
    def _generate(self, request: Request) -> None:
        engine = self.server.engine
        deadline = self._started + self.server.limits.request_timeout
        with watch(self.connection, deadline, self._probe, self.server.limits.max_body) as stop, \
                self._enlisted(stop):
            try:
                stream = _ended(engine.stream(
                    request.prompt, chat_template=request.kind == "chat",
                    max_tokens=request.max_tokens, sampling=request.sampling, stop=request.stop,
                    cancel=stop.event), stop)
                # The first chunk comes after the turn and the prefill: a bad prompt still gets
                # a plain JSON error, before any event is sent.
                first = next(stream)
                if stop.reason in ("shutdown", "timeout") and first.stats and \
                        not first.stats.generated_tokens:
                    stream.close()  # a generation stopped in its prefill gives up its turn
                    if stop.reason == "shutdown":
                        raise EngineClosed("the server is shutting down")
                    # Waiting for its turn (or in its prefill) the whole time: a busy server,
                    # not a reply; a client may try again (Retry-After), unlike after a 200.
                    raise RequestError(503, f"no token within --request-timeout ("
                                       f"{self.server.limits.request_timeout:g} s): the "
                                       "request waited for its turn behind others or for its "
                                       "prefill", type="server_busy", code="request_timeout")
            except PromptTooLong as e:
                raise RequestError(400, str(e), "messages" if request.kind == "chat"
                                   else "prompt", "context_length_exceeded") from e
            except EngineClosed as e:
                raise RequestError(503, str(e), type="server_shutting_down") from e
            except MirrorError as e:
                raise RequestError(400, str(e)) from e
            reply = Reply(request, self.server.model_id)
            with contextlib.closing(stream):
                if request.stream:
                    self._stream(reply, first, stream, stop)
                else:
                    whole = self._whole(reply, first, stream)
        if stop.extra:
            self.close_connection = True  # dropped bytes: what follows is out of step
        if not request.stream:
            # Sent once the watcher has stopped: it would take the client's next request
            # for bytes beside this one.
            with contextlib.suppress(OSError):  # the client may be gone
                self._json(200, whole)

    @contextlib.contextmanager
    def _enlisted(self, stop: Stop):
        try:
            if not self.server.enlist(stop, True):
                stop.set("shutdown")
            yield
        finally:
            self.server.enlist(stop, False)

    def _probe(self) -> bool:
        """Sends an interim `100 Continue` while the reply has not begun (HTTP/1.1 clients
        skip any number of them): a client that closed answers it with a reset, one that only
        half-closed takes no harm. False when it cannot be sent."""
        if self.request_version != "HTTP/1.1":
            return False
        with self._sending:
            if not self._replied:
                try:
                    self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                except OSError:
                    return False
        return True

    def _finished(self, reply: Reply, stats: GenerationStats) -> None:
        """The request log's line, written when the generation ends (before the reply's end
        reaches the client)."""
        log.info("%s %s: prompt %d tok, %d generated, %.1f tok/s, %.2f tok/step, finish %s",
                 reply.id, reply.request.kind, stats.prompt_tokens, stats.generated_tokens,
                 stats.tokens_per_second, stats.acceptance_length, stats.finish_reason)

    def _whole(self, reply: Reply, first, stream) -> dict:
        text, stats = [first.text], first.stats
        for chunk in stream:
            text.append(chunk.text)
            stats = chunk.stats or stats
        self._finished(reply, stats)
        return reply.whole("".join(text), stats)

    def _stream(self, reply: Reply, first, stream, stop: Stop) -> None:
        """Server-sent events, sent by an EventSender: a client that left or fell behind
        stops the generation (it ends within a step)."""
        self.close_connection = True  # the stream's end is the connection's end
        self._begin(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        try:
            self.end_headers()
        except OSError:
            stop.set("gone")
        limits = self.server.limits
        sender = EventSender(self.wfile.write, limits.stream_buffer, stop)
        try:
            if reply.request.kind == "chat":
                sender.put(_event(reply.chunk("")))
            for chunk in chain([first], stream):
                if chunk.text:
                    sender.put(_event(reply.chunk(chunk.text)))
                if chunk.stats:
                    self._finished(reply, chunk.stats)
                    sender.put(_event(reply.chunk(None, chunk.stats)), closing=True)
                    if reply.request.include_usage:
                        sender.put(_event(reply.usage_chunk(chunk.stats)), closing=True)
                    sender.put(b"data: [DONE]\n\n", closing=True)
        finally:
            if not sender.close(limits.write_timeout):
                with contextlib.suppress(OSError):  # unblocks the sender's write
                    self.connection.shutdown(socket.SHUT_RDWR)

    # ---- plain replies
    def _begin(self, status: int) -> None:
        """The status line of the reply; from here on, writes have write_timeout each."""
        with self._sending:  # after a probe that is under way, never amid one
            self._replied = True
        self.connection.settimeout(self.server.limits.write_timeout)
        self.send_response(status)
        headers = getattr(self, "headers", None)  # none when the request line was bad
        if headers and not self._body_read and (
                headers.get("Transfer-Encoding") or headers.get("Content-Length", "0") != "0"):
            # A body left unread (a GET's, a refused POST's) would be read as the next request.
            self.close_connection = self._linger = True
        if self.close_connection:
            # Said, so that the client does not send its next request into a closing socket.
            self.send_header("Connection", "close")
        if self._cors:
            self.send_header("Access-Control-Allow-Origin", self._cors)
            self.send_header("Vary", "Origin")

    def _json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self._begin(status)
        if status in (429, 503):
            self.send_header("Retry-After", str(RETRY_AFTER_S))
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error(self, code: int, message: str | None = None, explain=None) -> None:
        """The standard library's errors (a malformed request line, an unknown method), in
        the same JSON shape as ours."""
        self.close_connection = True
        self._error(RequestError(code, message or HTTPStatus(code).phrase))

    def _error(self, e: RequestError) -> None:
        if e.status >= 500 or e.status == 429:
            log.warning("%s: %s", self._line, printable(e.message))
        self._json(e.status, e.body())


def _drain(sock: socket.socket, seconds: float) -> None:
    """Half-closes `sock`, then reads and drops what the client still sends, for at most
    `seconds`. Closing a socket with unread bytes sends a reset: a client still sending the
    body of a request refused before it was read (413, 415, 404) would get a broken pipe
    instead of the refusal (benchmarks/reliability.py: 5 of 5 bodies of 5 MB lost theirs)."""
    end = time.monotonic() + seconds
    with contextlib.suppress(OSError):  # a timeout too
        sock.shutdown(socket.SHUT_WR)
        while (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            if not sock.recv(1 << 16):
                return


def _not_json(name: str):
    raise ValueError(f"{name} is not JSON")


# C0 and C1 control characters, as \xNN.
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x20), *range(0x7F, 0xA0))}


def printable(text: str) -> str:
    """`text` with its control characters escaped: a request's path must not write escape
    sequences (colours, cursor moves, made-up lines) into a terminal or a log file."""
    return text.translate(_CONTROL)


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class _Answered(Exception):
    """The request was answered already (e.g. a 408): nothing more to send."""


def _ended(stream, stop: Stop):
    """The engine's chunks, the last one's finish reason naming why the server stopped it (a
    timeout, a shutdown) where that was not its client leaving."""
    with contextlib.closing(stream):
        for chunk in stream:
            if chunk.stats and chunk.stats.finish_reason == "cancelled" and \
                    stop.reason not in (None, "gone"):
                chunk = dataclasses.replace(chunk, stats=dataclasses.replace(
                    chunk.stats, finish_reason=stop.reason))
            yield chunk


class _Terminated(Exception):
    """SIGTERM, turned into an exception in the main thread like Ctrl-C's KeyboardInterrupt."""


def _terminated(signum, frame):
    raise _Terminated()


def serve(engine: Engine, host: str = "127.0.0.1", port: int = 8000, **options) -> None:
    """Serve until Ctrl-C or SIGTERM, then stop gracefully (the `mirror-mlx serve` command)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    try:
        server = Server(engine, host, port, **options)
    except OSError as e:
        raise MirrorError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    print(f"mirror-mlx: serving {server.model_id} ({engine.mode}) at {server.url}", flush=True)
    if not is_loopback(server.server_address[0]):
        log.warning("listening on %s: %s", host, "requests need the API key"
                    if server.access.api_key else "anyone who can reach it can use the model")
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminated) if in_main else None
    why = "stopped"
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        why = "Ctrl-C"
    except _Terminated:
        why = "SIGTERM"
    finally:
        if in_main:
            # A second SIGTERM ends the process at once.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        log.info("stopping (%s): %s running, %d waiting", why,
                 "a request" if engine.busy else "nothing", engine.waiting)
        server.server_close()
        log.info("stopped")
