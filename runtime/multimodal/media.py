"""Images from what users send: a PIL image, encoded bytes, a `data:` URL, an `http(s)://` URL
(only hosts the server allows) or a `file://` URL (only under the allowed folder).

Every failure is a `MediaError` (a ValueError) naming what was wrong; the server answers it
with a 400 (413 for size). Pillow is imported here only, when an image arrives.
"""
from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

MAX_IMAGE_PIXELS = 64 * 2**20  # larger images are refused (a decompression bomb guard)
MAX_FETCH_BYTES = 20 * 2**20  # the most an http(s) image may weigh
FETCH_TIMEOUT_S = 10.0


class MediaError(ValueError):
    """Media that cannot be used; `status` is the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class MediaPolicy:
    """Where URLs may point: `allowed_domains` for http(s) (none: no fetch), and
    `allowed_local_path` for file:// (None: none)."""

    allowed_domains: tuple[str, ...] = ()
    allowed_local_path: str | None = None
    timeout_s: float = FETCH_TIMEOUT_S
    max_bytes: int = MAX_FETCH_BYTES


def load_image(item: Any, policy: MediaPolicy = MediaPolicy()) -> Any:
    """A PIL image in RGB from a PIL image, bytes, or a URL string."""
    from PIL import Image
    if isinstance(item, Image.Image):
        _check_size(item.size)
        return item.convert("RGB") if item.mode != "RGB" else item
    if isinstance(item, (bytes, bytearray)):
        return decode_image(bytes(item))
    if isinstance(item, str):
        return decode_image(read_url(item, policy))
    raise MediaError(f"an image must be a PIL image, bytes or a URL string, "
                     f"got {type(item).__name__}")


def decode_image(data: bytes) -> Any:
    from PIL import Image, UnidentifiedImageError
    try:
        image = Image.open(io.BytesIO(data))
        _check_size(image.size)  # read from the header, before any pixel is decoded
        image.load()
    except MediaError:
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError,
            Image.DecompressionBombError) as e:
        raise MediaError(f"the image cannot be decoded ({type(e).__name__}: {e}); send a "
                         "complete PNG, JPEG, WebP, GIF or BMP file") from None
    return image.convert("RGB")


def _check_size(size: tuple[int, int]) -> None:
    if size[0] * size[1] > MAX_IMAGE_PIXELS:
        raise MediaError(f"the image is {size[0]}x{size[1]} pixels, more than the "
                         f"{MAX_IMAGE_PIXELS} allowed", status=413)


def read_url(url: str, policy: MediaPolicy) -> bytes:
    """The bytes a `data:`, `http(s)://` or `file://` URL names, within the policy."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _read_data_url(url)
    if scheme in ("http", "https"):
        return _fetch(url, policy)
    if scheme == "file":
        return _read_file(url, policy)
    raise MediaError(f"an image URL must be a data:, http(s):// or file:// URL, "
                     f"got {url[:40]!r}")


def _read_data_url(url: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64") or not header[5:].startswith("image/"):
        raise MediaError("a data URL image must be 'data:image/<type>;base64,<data>'")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL's base64 payload is not valid base64") from None


def _host_allowed(url: str, policy: MediaPolicy) -> bool:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    return any(host == d or host.endswith("." + d) for d in policy.allowed_domains)


class _SameAllowedHosts(urllib.request.HTTPRedirectHandler):
    def __init__(self, policy: MediaPolicy) -> None:
        self.policy = policy

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not _host_allowed(newurl, self.policy):
            raise MediaError(f"the image URL redirects to {newurl[:80]!r}, whose host is not "
                             "in --allowed-media-domains")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    if not _host_allowed(url, policy):
        raise MediaError(f"the image URL's host is not allowed: {url[:80]!r} (the server "
                         "fetches only from hosts in --allowed-media-domains; send a data: "
                         "URL instead)")
    opener = urllib.request.build_opener(_SameAllowedHosts(policy))
    try:
        with opener.open(url, timeout=policy.timeout_s) as response:
            data = response.read(policy.max_bytes + 1)
    except MediaError:
        raise
    except OSError as e:
        raise MediaError(f"the image URL could not be fetched: {e}") from None
    if len(data) > policy.max_bytes:
        raise MediaError(f"the image at {url[:80]!r} is more than {policy.max_bytes} bytes",
                         status=413)
    return data


def _read_file(url: str, policy: MediaPolicy) -> bytes:
    if policy.allowed_local_path is None:
        raise MediaError("file:// image URLs are off: start the server with "
                         "--allowed-local-media-path DIR")
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    root = os.path.realpath(policy.allowed_local_path)
    if os.path.commonpath([path, root]) != root:
        raise MediaError(f"the file {path!r} is outside --allowed-local-media-path")
    try:
        with open(path, "rb") as f:
            data = f.read(policy.max_bytes + 1)
    except OSError as e:
        raise MediaError(f"the image file cannot be read: {e}") from None
    if len(data) > policy.max_bytes:
        raise MediaError(f"the image file is more than {policy.max_bytes} bytes", status=413)
    return data
