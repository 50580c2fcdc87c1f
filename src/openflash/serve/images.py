"""Image content parts of chat requests: where their bytes may come from, and the limits that apply.

Only `data:` URLs (base64) by default. A local file is read only when the server names a folder for them
(`--allowed-local-image-dir`) and the path (plain or `file://`) resolves inside it. The server never fetches from
the network: an http(s) URL is refused with a 400 that says so.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urlparse

from openflash.vision.preprocess import ImageError, ImageLimits


@dataclass(frozen=True)
class ImagePolicy:
    limits: ImageLimits = field(default_factory=ImageLimits)
    max_images: int = 8  # per request
    local_dir: Path | None = None  # where local image paths may point (None: no local files)


def image_bytes(url: str, where: str, policy: ImagePolicy) -> bytes:
    """The encoded bytes behind an image_url; ImageError naming `where` for anything refused."""
    if url.startswith("data:"):
        header, comma, payload = url.partition(",")
        if not comma or ";base64" not in header:
            raise ImageError(f"{where}: a data URL must be base64 (data:image/png;base64,...)", where)
        if len(payload) > (policy.limits.max_bytes * 4) // 3 + 4:
            raise ImageError(f"{where}: the image is over the limit of {policy.limits.max_bytes} bytes", where)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageError(f"{where}: the data URL is not valid base64 ({exc})", where) from None
    scheme = urlparse(url).scheme.lower()
    if scheme in ("http", "https", "ftp"):
        raise ImageError(f"{where}: this server does not fetch images from the network; send the image as a data "
                         f"URL (data:image/png;base64,...)", where)
    if scheme not in ("", "file"):
        raise ImageError(f"{where}: unsupported image URL scheme {scheme!r} (data URLs only)", where)
    if policy.local_dir is None:
        raise ImageError(f"{where}: local image paths are off on this server (it takes data URLs; start it with "
                         f"--allowed-local-image-dir DIR to allow files under DIR)", where)
    path = Path(unquote(urlparse(url).path) if scheme == "file" else url)
    root = policy.local_dir.resolve()
    try:
        resolved = path.resolve()
    except OSError as exc:
        raise ImageError(f"{where}: cannot resolve {path}: {exc}", where) from None
    if not resolved.is_relative_to(root):
        raise ImageError(f"{where}: {path} is outside the allowed image folder", where)
    if not resolved.is_file():
        raise ImageError(f"{where}: no such image file {path}", where)
    if resolved.stat().st_size > policy.limits.max_bytes:
        raise ImageError(f"{where}: the image is over the limit of {policy.limits.max_bytes} bytes", where)
    return resolved.read_bytes()
