"""What one client may ask of the server, and for how long: the knobs of `mirror-mlx serve`."""

from __future__ import annotations

from dataclasses import dataclass, fields

from mirror_mlx.errors import InvalidParameter


@dataclass(frozen=True)
class Limits:
    max_tokens: int = 512  # a request's default reply length, and the most it may ask for
    max_body: int = 1 << 20  # bytes; a long chat fits many times over
    max_queue: int = 16  # requests running or waiting for the engine (beyond: 429)
    max_connections: int = 64  # open connections (beyond: 503 and closed at once)
    request_timeout: float = 600.0  # s from a request's first byte to its reply's end
    read_timeout: float = 30.0  # s for a request's headers and body, together
    # s an idle connection stays open between requests: longer than clients keep theirs
    # (httpx, so the openai package: 5 s), or a client may send on a connection being closed
    keep_alive: float = 15.0
    write_timeout: float = 30.0  # s a client may stall a reply it does not read
    stream_buffer: int = 1 << 20  # bytes of events a streaming client may fall behind

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or \
                    not value > 0 or (f.type == "int" and not isinstance(value, int)):
                flag = f.name.replace("_", "-")
                raise InvalidParameter(f"{flag} must be a positive {f.type} (got {value!r})")
