"""The wire format the NATS worker and client share: subjects, frames, errors, timeouts.

Subjects (``ns`` is the namespace, ``llm-pipeline`` by default)::

    {ns}.model.{model}.{role}     requests, load-balanced over a queue group of that name
    {ns}.worker.{worker_id}       requests for one worker (direct routing)
    {ns}.control.{worker_id}      control: [STOP|KILL, request id, reply inbox],
                                  [PING, inbox, next seq], [CREDIT, outputs granted in all,
                                  next seq, reply inbox] (next seq: see "Bus outages"),
                                  [DRAIN] (leave discovery and drain, as on SIGTERM;
                                  answered with True)

A request is ``{"id", "data", "timeout" (seconds left, or None), "metadata", "wire",
"window"}``, ``wire`` being the highest wire version the client reads (absent: 1) and
``window`` how many outputs the worker may send before the client grants more (absent:
no limit). Each request is published with a fresh reply inbox; the worker answers on it
with one frame per message, ``[seq, kind, body]``, ``seq`` counting the messages from 0
with no gaps::

    START  body: the worker id          first frame, sent before the engine runs
    DATA   body: one output
    BATCH  body: [output, ...]          two or more outputs, in order (wire version 2);
                                        [seq, BATCH, body, count]: merged (version 4)
    END    body: None                   the stream finished
    ERR    body: [class name, message, request id, param]
    HB     body: None                   the worker is alive but had nothing to send

Wire version 2 adds BATCH: outputs the engine had ready together share one message
(a NATS message costs more Python CPU on each side than a token's payload does), and
the client hands them on one by one, so what the stream yields is the same item
sequence whichever way the outputs were grouped. A worker sends BATCH only to a client
whose request says ``"wire": 2`` or more, so either side may be one version behind.

Wire version 3 adds flow control, because core NATS has none: a client that reads slowly
would otherwise buffer whatever the worker sends. The request's ``window`` is the
client's first credit, in outputs; as its consumer reads, the client raises the total
with CREDIT control messages (one per half window read, not one per token), and a
worker that has sent all it may stops pulling outputs from its engine until more credit
comes. So a stream's outputs received but not read never exceed ``window``. Heartbeats
to a wire-3 client are out of band (an empty message with the :data:`HEARTBEAT` header,
no sequence number): the client counts them as signs of life and never queues them, so a
paused stream's heartbeats do not pile up either. A worker one version behind ignores the
window and the CREDIT messages (no flow control, as before); a client one version behind
sends no window and gets HB frames.

Wire version 4 lets a worker merge the outputs of a BATCH (a worker given a ``coalesce``
function; the LLM layer merges consecutive token outputs of one choice into one burst):
a BATCH frame whose outputs were merged carries a fourth element, ``count``, the outputs
of the engine it holds, which is what flow control counts (CREDIT is in engine outputs
whichever way they travel). A token then costs its id on the wire, not a tagged record
to encode and decode. A worker merges only for a client whose request says ``"wire": 4``
or more.

Bus outages. Frames in flight when the NATS connection of either side breaks are lost (a
killed nats-server loses what it held). So a worker serving a flow-controlled stream
keeps the frames it sent until the client acknowledges them: PING and CREDIT carry the
sequence number the client expects next, and frames before it are dropped. Through an
outage the worker holds new frames back (:mod:`.outbox`); the client's first ping from
its re-established connection tells it where to resume, and it sends again from there,
so the stream goes on with no gap and no migration. (Senders of the older two-element
PING and three-element CREDIT are read as before: no resumption point, no retransmission.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Final, final

from pipeline import errors
from pipeline.errors import EngineError, InvalidRequest, RequestError
from pipeline.transports.codec import MsgpackCodec
from pipeline.transports.roles import ROLES

__all__ = (
    "BATCH",
    "CREDIT",
    "DATA",
    "DRAIN",
    "DEFAULT_NAMESPACE",
    "DEFAULT_WINDOW",
    "END",
    "ERR",
    "HB",
    "HEARTBEAT",
    "KILL",
    "KNOWN",
    "NatsTimeouts",
    "PING",
    "ROLES",
    "START",
    "STOP",
    "Subjects",
    "UNKNOWN",
    "WIRE_VERSION",
    "check_role",
    "check_token",
    "control_codec",
    "error_body",
    "error_from_body",
    "escape_token",
    "unescape_token",
)

#: the first token of every subject this transport uses
DEFAULT_NAMESPACE: Final = "llm-pipeline"

START: Final = 0
DATA: Final = 1
END: Final = 2
ERR: Final = 3
HB: Final = 4
BATCH: Final = 5

#: the wire version this side speaks (see the module docstring)
WIRE_VERSION: Final = 4

STOP: Final = "stop"
KILL: Final = "kill"
PING: Final = "ping"
CREDIT: Final = "credit"
DRAIN: Final = "drain"

#: the header of an out-of-band heartbeat (wire version 3)
HEARTBEAT: Final = "Llm-Pipeline-Heartbeat"
#: how many outputs a client lets a worker send ahead of its consumer, by default
DEFAULT_WINDOW: Final = 256


_TOKEN = re.compile(r"[A-Za-z0-9_-]+")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")

#: the request errors a worker can report by name, so the client raises the same type
_REQUEST_ERRORS: Final[dict[str, type[RequestError]]] = {
    name: cls
    for name in errors.__all__
    if isinstance(cls := getattr(errors, name), type) and issubclass(cls, RequestError)
}


def escape_token(text: str) -> str:
    """``text`` as one subject token and KV key token: ``[A-Za-z0-9_-]`` and ``=XX`` escapes.

    Raises:
        ValueError: for an empty ``text``.
    """
    if not text:
        raise ValueError("a model name must not be empty")
    if _TOKEN.fullmatch(text):
        return text
    return _UNSAFE.sub(lambda m: "".join(f"={b:02X}" for b in m.group().encode()), text)


def unescape_token(token: str) -> str:
    """The text :func:`escape_token` made ``token`` of (``=XX`` escapes decoded)."""
    if "=" not in token:
        return token
    return re.sub(
        r"(?:=[0-9A-F]{2})+",
        lambda m: bytes.fromhex(m.group().replace("=", "")).decode("utf-8", "replace"),
        token,
    )


def check_token(what: str, value: str) -> str:
    """Return ``value`` if it is usable as a subject token, else raise ValueError."""
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"{what} must match [A-Za-z0-9_-]+, got {value!r}")
    return value


@final
class Subjects:
    """The subject names of one namespace."""

    __slots__ = ("namespace",)

    def __init__(self, namespace: str) -> None:
        for part in namespace.split("."):
            check_token("each part of the namespace", part)
        self.namespace = namespace

    def model(self, model: str, role: str) -> str:
        """Where load-balanced requests for ``model`` in ``role`` go (also the queue group)."""
        return f"{self.namespace}.model.{escape_token(model)}.{role}"

    def worker(self, worker_id: str) -> str:
        """Where requests for one worker go."""
        return f"{self.namespace}.worker.{worker_id}"

    def control(self, worker_id: str) -> str:
        """A worker's control subject: stop, kill, ping."""
        return f"{self.namespace}.control.{worker_id}"


def error_body(exc: BaseException, request_id: str) -> list[Any]:
    """The ERR body for ``exc``: the nearest pipeline error class by name, and its message.

    An error from outside the hierarchy keeps its own class name, which the client does not
    know and reports as an EngineError.
    """
    param = None
    name = type(exc).__name__
    for cls in type(exc).__mro__:
        if _REQUEST_ERRORS.get(cls.__name__) is cls:
            name = cls.__name__
            break
    if isinstance(exc, RequestError):
        message, rid = exc.message, exc.request_id
        if isinstance(exc, InvalidRequest):
            param = exc.param
    else:
        message, rid = str(exc), request_id
    return [name, message, rid, param]


def error_from_body(body: Any, request_id: str) -> RequestError:
    """The exception an ERR body describes (EngineError for a class the client doesn't know)."""
    try:
        name, message, rid, param = body
        name, message = str(name), str(message)
    except (TypeError, ValueError):
        return EngineError(
            f"malformed error frame from the worker: {body!r}", request_id=request_id
        )
    cls = _REQUEST_ERRORS.get(name)
    rid = rid if isinstance(rid, str) else None
    if cls is None:
        return EngineError(f"{name}: {message}", request_id=rid or request_id)
    if cls is InvalidRequest:
        return InvalidRequest(message, param=param, request_id=rid)
    return cls(message, request_id=rid)


def check_role(role: str) -> str:
    """Return ``role`` if it is one of :data:`ROLES`, else raise ValueError."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
    return role


#: control messages and ping answers use their own codec, whatever the payload codec is
control_codec: Final = MsgpackCodec()
KNOWN: Final = control_codec.encode(True)
UNKNOWN: Final = control_codec.encode(False)


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class NatsTimeouts:
    """How the NATS transport tells a slow worker or client from a dead one. Seconds.

    Raises:
        ValueError: for a non-positive value, or a ``ttl`` under one second.
    """

    #: client: a stream silent this long gets a liveness ping to its worker
    idle: float = 0.5
    #: client: how long the worker has to answer that ping (then ResponseTimeout)
    ping: float = 1.0
    #: client, load-balanced requests: how long until some worker takes the request
    start: float = 5.0
    #: worker: a stream with nothing to send for this long gets a heartbeat frame
    heartbeat: float = 0.25
    #: worker: time-to-live of its discovery key (whole seconds, >= 1); refreshed at ttl/3
    ttl: float = 3.0
    #: worker: a graceful stop waits this long for in-flight requests, then cuts them off
    drain: float = 10.0
    #: all: after this process reconnects to the bus, how long its peers get to reconnect
    #: too before their silence counts against them again (they retry every 0.5 s)
    settle: float = 2.0
    #: all: how long a stream rides out its process's lost bus connection (never past the
    #: request's deadline) before it fails, and migrates
    outage: float = 60.0

    def __post_init__(self) -> None:
        for name in ("idle", "ping", "start", "heartbeat", "ttl", "drain", "settle", "outage"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"NatsTimeouts.{name} must be > 0, got {value!r}")
        if self.ttl < 1:
            raise ValueError(f"NatsTimeouts.ttl must be >= 1 (NATS message TTLs), got {self.ttl}")
