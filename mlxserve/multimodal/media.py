"""Fetching and decoding images named in requests.

Sources: `data:` URLs (base64), `file://` URLs under the directories the
server allows, and `http(s)://` URLs (size and time limits, redirects
followed at most MAX_REDIRECTS times, each hop's address checked: private,
loopback and link-local addresses are refused unless allowed, so a request
cannot make the server read its own network).

Every failure is a `MediaError` naming what went wrong; the API turns it into
a 400. Runs off the event loop (`asyncio.to_thread`): downloads and decoding
block.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import ipaddress
import socket
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

MAX_REDIRECTS = 5


class MediaError(ValueError):
    """An image that cannot be used; the message says why."""


@dataclass
class MediaLimits:
    allowed_local_paths: tuple[Path, ...] = ()
    allow_private_urls: bool = False
    timeout: float = 10.0
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 25_000_000
    video_fps: float = 2.0
    max_video_frames: int = 32

    @classmethod
    def from_config(cls, server_config) -> "MediaLimits":
        paths = server_config.allowed_local_media_path or ""
        return cls(
            allowed_local_paths=tuple(Path(p).expanduser().resolve() for p in paths.split(",") if p.strip()),
            allow_private_urls=server_config.allow_private_media_urls,
            timeout=server_config.media_fetch_timeout,
            max_bytes=server_config.max_media_bytes,
            max_pixels=server_config.max_image_pixels,
            video_fps=server_config.video_fps,
            max_video_frames=server_config.max_video_frames,
        )


@dataclass
class LoadedImage:
    image: object  # a decoded PIL image, RGB
    content_hash: str  # sha256 of the decoded pixels (see pixel_hash)


def pixel_hash(image) -> str:
    """Content identity: sha256 over size, mode and the decoded pixels.

    The same picture as a URL, a data URL or a file decodes to the same
    pixels, so it is one entry in the caches; file bytes would differ with
    every re-encode.
    """
    h = hashlib.sha256(f"{image.mode}:{image.width}x{image.height}:".encode())
    h.update(image.tobytes())
    return h.hexdigest()


def load_image(url: str, limits: MediaLimits) -> LoadedImage:
    data = read_source(url, limits)
    image = decode_image(data, limits)
    return LoadedImage(image, pixel_hash(image))


class VideoClip(list):
    """A video's frames (PIL, RGB), and when each was shown: `times[i]` in seconds from the first
    frame (Qwen3-VL writes each frame group's time into the prompt). A plain list of frames
    (the Python API's "video" parts) has no times."""

    def __init__(self, frames, times: list[float]):
        super().__init__(frames)
        self.times = times


def load_video(url: str, limits: MediaLimits) -> VideoClip:
    """A video's frames (PIL, RGB), sampled at `video_fps` up to `max_video_frames`, an even count."""
    return decode_video(read_source(url, limits), limits)


def decode_video(data: bytes, limits: MediaLimits) -> VideoClip:
    try:
        import av
    except ImportError:
        raise MediaError("video needs PyAV (pip install av), which this server lacks") from None
    try:
        container = av.open(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - PyAV raises its own error classes per codec
        raise MediaError(f"the data is not a video this server can decode: {e}") from None
    with container:
        if not container.streams.video:
            raise MediaError("the file has no video stream")
        stream = container.streams.video[0]
        if stream.width * stream.height > limits.max_pixels:
            raise MediaError(f"the video's frames have {stream.width}x{stream.height} pixels, more than "
                             f"the {limits.max_pixels} this server accepts")
        # One frame per 1/fps seconds: the first frame at or after each sample time.
        frames, times, next_time = [], [], 0.0
        try:
            for frame in container.decode(stream):
                if frame.time is None or frame.time + 1e-6 >= next_time:
                    frames.append(frame.to_image().convert("RGB"))
                    times.append(frame.time)
                    next_time = (frame.time or 0.0) + 1.0 / limits.video_fps
                    if len(frames) >= limits.max_video_frames:
                        break
        except Exception as e:  # noqa: BLE001 - a corrupt stream
            if not frames:
                raise MediaError(f"the video cannot be decoded: {e}") from None
    if not frames:
        raise MediaError("the video has no frames")
    frames = frames[: limits.max_video_frames - limits.max_video_frames % 2 or None]
    # Seconds from the first frame, as Hugging Face's processors count them (source frame
    # index / fps); where the stream gives no times, the sampling rate's.
    if any(t is None for t in times):
        times = [i / limits.video_fps for i in range(len(frames))]
    times = [t - times[0] for t in times[: len(frames)]]
    if len(frames) % 2:  # the tower takes frames in pairs: repeat the last one
        frames.append(frames[-1])
        times.append(times[-1])
    return VideoClip(frames, times)


def read_source(url: str, limits: MediaLimits) -> bytes:
    if not isinstance(url, str) or not url:
        raise MediaError("the image URL is empty")
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return _read_data_url(url, limits)
    if scheme == "file":
        return _read_file(url, limits)
    if scheme in ("http", "https"):
        return _download(url, limits)
    raise MediaError(f"unsupported URL scheme {scheme!r}: use https://, http://, data: or file://")


def _read_data_url(url: str, limits: MediaLimits) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep or ";base64" not in head:
        raise MediaError("a data URL must be base64-encoded: data:image/png;base64,...")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise MediaError(f"the image is larger than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError("the data URL's base64 payload is not valid") from None


def _read_file(url: str, limits: MediaLimits) -> bytes:
    parsed = urllib.parse.urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError("file URLs must name a local path (file:///path)")
    if not limits.allowed_local_paths:
        raise MediaError("file URLs are not allowed on this server (see --allowed-local-media-path)")
    path = Path(urllib.parse.unquote(parsed.path)).resolve()  # resolves .. and symlinks
    if not any(path.is_relative_to(root) for root in limits.allowed_local_paths):
        raise MediaError(f"{path} is outside the directories this server allows")
    try:
        size = path.stat().st_size
        if size > limits.max_bytes:
            raise MediaError(f"the image is larger than {limits.max_bytes} bytes")
        return path.read_bytes()
    except OSError as e:
        raise MediaError(f"cannot read {path}: {e.strerror or e}") from None


def _check_host(host: str | None, port: int, limits: MediaLimits) -> None:
    if not host:
        raise MediaError("the image URL has no host")
    if limits.allow_private_urls:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise MediaError(f"cannot resolve {host}: {e.strerror}") from None
    for info in infos:
        addr = ipaddress.ip_address(info[4][0].split("%")[0])
        if not addr.is_global:
            raise MediaError(f"{host} resolves to a non-public address ({addr}); this server does not "
                             "fetch from private networks (see --allow-private-media-urls)")


def _download(url: str, limits: MediaLimits) -> bytes:
    import httpx

    deadline = time.monotonic() + limits.timeout
    with httpx.Client(follow_redirects=False, timeout=limits.timeout) as client:
        for _ in range(MAX_REDIRECTS + 1):
            parsed = urllib.parse.urlparse(url)
            if parsed.scheme not in ("http", "https"):
                raise MediaError(f"redirected to an unsupported URL scheme {parsed.scheme!r}")
            _check_host(parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80), limits)
            try:
                with client.stream("GET", url) as response:
                    if response.is_redirect:
                        url = urllib.parse.urljoin(url, response.headers.get("location", ""))
                        continue
                    if response.status_code != 200:
                        raise MediaError(f"fetching the image failed: HTTP {response.status_code}")
                    declared = response.headers.get("content-length")
                    if declared and declared.isdigit() and int(declared) > limits.max_bytes:
                        raise MediaError(f"the image is larger than {limits.max_bytes} bytes")
                    chunks, total = [], 0
                    for chunk in response.iter_bytes():
                        total += len(chunk)
                        if total > limits.max_bytes:
                            raise MediaError(f"the image is larger than {limits.max_bytes} bytes")
                        if time.monotonic() > deadline:
                            raise MediaError(f"fetching the image took longer than {limits.timeout:g} s")
                        chunks.append(chunk)
                    return b"".join(chunks)
            except httpx.TimeoutException:
                raise MediaError(f"fetching the image took longer than {limits.timeout:g} s") from None
            except httpx.HTTPError as e:
                raise MediaError(f"fetching the image failed: {e}") from None
    raise MediaError(f"more than {MAX_REDIRECTS} redirects")


def decode_image(data: bytes, limits: MediaLimits):
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise MediaError("the data is not an image in a format this server can decode") from None
    except Exception as e:  # noqa: BLE001 - PIL raises many kinds on corrupt headers
        raise MediaError(f"the image cannot be decoded: {e}") from None
    # The header's size, before any pixel is decoded: a decompression bomb stops here.
    if image.width * image.height > limits.max_pixels:
        raise MediaError(f"the image has {image.width}x{image.height} pixels, more than the "
                         f"{limits.max_pixels} this server accepts")
    try:
        image.load()
        return image.convert("RGB")
    except Exception as e:  # noqa: BLE001 - truncated or corrupt data
        raise MediaError(f"the image cannot be decoded: {e}") from None
