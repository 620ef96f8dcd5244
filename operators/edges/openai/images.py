"""Image content parts -> :class:`~operators.contracts.llm.MultimodalItem`, safely.

Two URL forms reach us in OpenAI ``image_url`` parts:

* ``data:image/png;base64,...`` — decoded here, size-capped, and checked to really be an
  image of the declared kind; anything malformed is a 400 naming the content part.
* ``http(s)://host/...`` — refused unless :class:`ImagePolicy` allows that host. A server
  that fetches any URL a client names is a server-side request forgery waiting to happen
  (cloud metadata endpoints, internal services), so remote fetching is opt-in per host.
  An allowed URL is fetched with a time limit, no redirects and the same size cap.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from operators.contracts.llm import MultimodalItem
from pipeline import InvalidRequest

__all__ = ("ImagePolicy", "ImageRef", "load_images")

logger = logging.getLogger(__name__)

_MAGIC: dict[str, tuple[bytes, ...]] = {
    "image/png": (b"\x89PNG\r\n\x1a\n",),
    "image/jpeg": (b"\xff\xd8\xff",),
    "image/gif": (b"GIF87a", b"GIF89a"),
    "image/webp": (b"RIFF",),
}


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """Which images a server accepts.

    ``allowed_hosts``: hosts whose http(s) image URLs may be fetched (none by default);
    ``max_bytes``: the largest image accepted, decoded; ``fetch_timeout``: seconds.
    """

    allowed_hosts: frozenset[str] = field(default_factory=frozenset)
    max_bytes: int = 8 * 1024 * 1024
    fetch_timeout: float = 10.0


@dataclass(frozen=True, slots=True)
class ImageRef:
    """An image content part as the client sent it: where it was, and its URL."""

    param: str  #: the request field, e.g. ``messages.0.content.1``
    url: str


def _check_image(data: bytes, mime_type: str, param: str, policy: ImagePolicy) -> MultimodalItem:
    if len(data) > policy.max_bytes:
        raise InvalidRequest(
            f"image is {len(data)} bytes, over the limit of {policy.max_bytes}", param=param
        )
    magic = _MAGIC.get(mime_type)
    if magic is None:
        kinds = ", ".join(sorted(_MAGIC))
        raise InvalidRequest(
            f"unsupported image type {mime_type!r}; expected one of {kinds}", param=param
        )
    if not data.startswith(magic) or (mime_type == "image/webp" and data[8:12] != b"WEBP"):
        raise InvalidRequest(f"the image data is not a valid {mime_type} image", param=param)
    return MultimodalItem(kind="image", data=data, mime_type=mime_type)


def _decode_data_url(url: str, param: str, policy: ImagePolicy) -> MultimodalItem:
    header, comma, payload = url.partition(",")
    if not comma:
        raise InvalidRequest("malformed data URL: no ',' before the data", param=param)
    media = header[len("data:") :].split(";")
    mime_type = media[0].strip().lower()
    if "base64" not in (part.strip().lower() for part in media[1:]):
        raise InvalidRequest("data URLs for images must be base64-encoded", param=param)
    if len(payload) > (policy.max_bytes + 2) // 3 * 4 + 4:
        raise InvalidRequest(f"image is over the limit of {policy.max_bytes} bytes", param=param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRequest(f"malformed data URL: invalid base64 ({exc})", param=param) from exc
    return _check_image(data, mime_type, param, policy)


async def _fetch(url: str, param: str, policy: ImagePolicy) -> MultimodalItem:
    try:
        host = urlsplit(url).hostname or ""
    except ValueError as exc:  # "http://[::1", "https://[]/", "http://\u2100.com/" ...
        raise InvalidRequest(f"malformed image URL: {exc}", param=param) from exc
    if host not in policy.allowed_hosts:
        raise InvalidRequest(
            f"remote image URLs are not accepted from host {host!r}; send the image as a "
            "data: URL, or start the server with --allowed-image-hosts naming that host",
            param=param,
        )
    try:
        async with (
            httpx.AsyncClient(timeout=policy.fetch_timeout, follow_redirects=False) as client,
            client.stream("GET", url) as response,
        ):
            if response.status_code != 200:
                raise InvalidRequest(
                    f"fetching the image failed: HTTP {response.status_code}", param=param
                )
            chunks: list[bytes] = []
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > policy.max_bytes:
                    raise InvalidRequest(
                        f"image is over the limit of {policy.max_bytes} bytes", param=param
                    )
                chunks.append(chunk)
            mime_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    except (httpx.HTTPError, httpx.InvalidURL, ValueError) as exc:
        raise InvalidRequest(f"fetching the image failed: {exc}", param=param) from exc
    return _check_image(b"".join(chunks), mime_type, param, policy)


async def load_images(refs: Sequence[ImageRef], policy: ImagePolicy) -> tuple[MultimodalItem, ...]:
    """Decode or fetch every referenced image, in order.

    Raises:
        InvalidRequest: a malformed, oversized, non-image or disallowed image.
    """
    items = []
    for ref in refs:
        scheme = ref.url.split(":", 1)[0].lower()
        if scheme == "data":
            items.append(_decode_data_url(ref.url, ref.param, policy))
        elif scheme in ("http", "https"):
            items.append(await _fetch(ref.url, ref.param, policy))
        else:
            raise InvalidRequest(
                f"unsupported image URL scheme {scheme!r}; use data: or https:", param=ref.param
            )
    return tuple(items)
