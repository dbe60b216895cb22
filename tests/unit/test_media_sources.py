"""The media room (frontend/media): data:, file: and http(s): image sources under a MediaPolicy,
Pillow decoding with a pixel cap, --limit-mm-per-prompt, and the media flags of `tern launch`.
Every refusal is a 400 naming the request part. http(s) runs against a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import base64
import datetime
import http.server
import io
import os
import ssl
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from PIL import Image

from enginecore.config import Config, ModelConfig
from frontend.cli.launch import make_parser
from frontend.cli.server import frontend_config_from_args
from frontend.common.errors import APIError
from frontend.media import remote
from frontend.media.images import decode_image
from frontend.media.limits import check_limits, parse_limit_mm_per_prompt
from frontend.media.policy import MediaPolicy
from frontend.media.remote import is_public_address
from frontend.media.sources import load_media_bytes

PARAM = "messages[0].content[1]"
RED, BLUE = (255, 0, 0), (0, 0, 255)


def encode(image: Image.Image, fmt: str, **kwargs: object) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


PNG = encode(Image.new("RGB", (4, 3), RED), "PNG")


def load(url: str, policy: MediaPolicy) -> bytes:
    return asyncio.run(load_media_bytes(url, policy, PARAM))


def refusal(call, *args: object) -> str:
    """The message of the 400 `call(*args)` raises, after checking it names PARAM."""
    with pytest.raises(APIError) as info:
        result = call(*args)
        if asyncio.iscoroutine(result):
            asyncio.run(result)
    assert info.value.status == 400 and info.value.param == PARAM
    return info.value.message


# --- data: URLs ---------------------------------------------------------------------------------


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def test_data_url_gives_its_bytes() -> None:
    assert load(data_url(PNG), MediaPolicy()) == PNG


def test_data_url_refusals() -> None:
    policy = MediaPolicy()
    assert "not valid base64" in refusal(load, "data:image/png;base64,not*base64!", policy)
    assert "only base64" in refusal(load, "data:image/png,%89PNG", policy)
    assert "no ','" in refusal(load, "data:image/png;base64", policy)
    small = MediaPolicy(max_image_bytes=len(PNG) - 1)
    assert f"larger than {len(PNG) - 1} bytes" in refusal(load, data_url(PNG), small)


def test_other_schemes_are_refused() -> None:
    assert "scheme 'ftp'" in refusal(load, "ftp://example.com/a.png", MediaPolicy())
    assert "no scheme" in refusal(load, "a.png", MediaPolicy())


# --- file: URLs ---------------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "media"
    folder.mkdir()
    (folder / "red image.png").write_bytes(PNG)
    (tmp_path / "secret.png").write_bytes(b"secret")
    (folder / "escape.png").symlink_to(tmp_path / "secret.png")
    (folder / "inside.png").symlink_to(folder / "red image.png")
    (folder / "sub").mkdir()
    os.mkfifo(folder / "fifo.png")  # opening it blocking would wait for a writer forever
    return folder


def test_file_url_under_the_folder(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=media_dir)
    assert load(f"file://{media_dir}/red%20image.png", policy) == PNG
    assert load(f"file://localhost{media_dir}/inside.png", policy) == PNG  # a symlink inside
    assert load(f"file://{media_dir}/sub/../red%20image.png", policy) == PNG


def test_file_url_refusals(media_dir: Path) -> None:
    policy = MediaPolicy(allowed_local_media_path=media_dir)
    outside = "is outside the allowed local media folder"
    assert outside in refusal(load, f"file://{media_dir}/escape.png", policy)  # symlink out
    assert outside in refusal(load, f"file://{media_dir}/../secret.png", policy)
    assert outside in refusal(load, f"file://{media_dir.parent}/secret.png", policy)
    assert outside in refusal(load, "file:///etc/passwd", policy)
    assert "no such file" in refusal(load, f"file://{media_dir}/missing.png", policy)
    assert "not a regular file" in refusal(load, f"file://{media_dir}/sub", policy)
    assert "not a regular file" in refusal(load, f"file://{media_dir}/fifo.png", policy)
    assert "local path" in refusal(load, f"file://otherhost{media_dir}/red%20image.png", policy)
    assert "--allowed-local-media-path" in refusal(
        load, f"file://{media_dir}/red%20image.png", MediaPolicy()
    )
    small = MediaPolicy(allowed_local_media_path=media_dir, max_image_bytes=10)
    assert "larger than 10 bytes" in refusal(load, f"file://{media_dir}/red%20image.png", small)


# --- http(s): URLs ------------------------------------------------------------------------------


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        port = self.server.server_address[1]
        routes = {
            "/img.png": lambda: self.reply(200, PNG),
            "/echo-host": lambda: self.reply(200, self.headers["Host"].encode()),
            "/to-same": lambda: self.redirect("/img.png"),
            "/to-other": lambda: self.redirect(f"http://localhost:{port}/img.png"),
            "/loop": lambda: self.redirect("/loop"),
            "/big": lambda: self.reply(200, bytes(5000)),
            "/big-stream": self.stream_without_length,
            "/slow": self.slow,
        }
        routes.get(self.path, lambda: self.reply(404, b"no"))()

    def reply(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def stream_without_length(self) -> None:
        self.send_response(200)  # HTTP/1.0: the body ends when the connection closes
        self.end_headers()
        for _ in range(10):
            self.wfile.write(bytes(500))

    def slow(self) -> None:
        time.sleep(1.0)
        try:
            self.reply(200, PNG)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up first, as it should

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server_port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    yield from serve(server)


def serve(server: http.server.ThreadingHTTPServer) -> Iterator[int]:
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def web(*hosts: str, **kwargs: object) -> MediaPolicy:
    return MediaPolicy(allowed_media_domains=hosts, **kwargs)


def test_http_fetch_from_a_named_address(server_port: int) -> None:
    base = f"http://127.0.0.1:{server_port}"
    assert load(f"{base}/img.png", web("127.0.0.1")) == PNG
    assert load(f"{base}/to-same", web("127.0.0.1")) == PNG  # a redirect on the same host


def test_http_is_off_unless_domains_are_named(server_port: int) -> None:
    url = f"http://127.0.0.1:{server_port}/img.png"
    assert "--allowed-media-domains" in refusal(load, url, MediaPolicy())
    assert "'127.0.0.1' is not in --allowed-media-domains" in refusal(load, url, web("example.com"))
    assert "credentials" in refusal(
        load, f"http://user:pw@127.0.0.1:{server_port}/img.png", web("127.0.0.1")
    )


def test_loopback_through_an_allowed_name_is_refused(server_port: int) -> None:
    url = f"http://localhost:{server_port}/echo-host"
    assert "non-public" in refusal(load, url, web("localhost"))
    # Named too, the loopback addresses are allowed; the connection goes to a checked address
    # (localhost may resolve to ::1 first, where nothing listens: the next one is tried) and the
    # Host header keeps the name.
    assert load(url, web("localhost", "127.0.0.1", "::1")) == f"localhost:{server_port}".encode()


def test_http_refusals(server_port: int) -> None:
    base = f"http://127.0.0.1:{server_port}"
    both = web("127.0.0.1", "localhost", "::1")
    assert "another host" in refusal(load, f"{base}/to-other", both)
    assert "more than 3 times" in refusal(load, f"{base}/loop", both)
    assert "HTTP 404" in refusal(load, f"{base}/missing", both)
    capped = web("127.0.0.1", max_image_bytes=1000)
    assert "larger than 1000 bytes" in refusal(load, f"{base}/big", capped)
    assert "larger than 1000 bytes" in refusal(load, f"{base}/big-stream", capped)
    start = time.monotonic()
    slow = web("127.0.0.1", fetch_timeout_s=0.2)
    assert "longer than 0.2 s" in refusal(load, f"{base}/slow", slow)
    assert time.monotonic() - start < 0.9


def self_signed_localhost(folder: Path) -> tuple[Path, Path]:
    """(certificate, key) files of a self-signed certificate for the name localhost."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_file, key_file


def test_https_pinned_to_a_checked_address_still_verifies_the_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert_file, key_file = self_signed_localhost(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert_file, key_file)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    client_tls = ssl.create_default_context(cafile=str(cert_file))
    monkeypatch.setattr(remote, "_ssl_context", lambda: client_tls)
    for port in serve(server):
        policy = web("localhost", "127.0.0.1", "::1")
        # The connection goes to 127.0.0.1; SNI and the certificate check use the name.
        assert load(f"https://localhost:{port}/img.png", policy) == PNG
        # By address, the certificate (issued to localhost) does not match: refused.
        assert "could not connect" in refusal(load, f"https://127.0.0.1:{port}/img.png", policy)


@pytest.mark.parametrize(
    "address",
    ["10.1.2.3", "127.0.0.1", "169.254.169.254", "224.0.0.1", "0.0.0.0", "100.64.0.1",
     "192.168.1.1", "::1", "fe80::1", "fc00::1", "::ffff:127.0.0.1", "2002:7f00:1::1"],
)  # fmt: skip
def test_non_public_addresses(address: str) -> None:
    assert not is_public_address(address)


def test_public_addresses() -> None:
    assert is_public_address("8.8.8.8") and is_public_address("2606:4700:4700::1111")


# --- decoding -----------------------------------------------------------------------------------


def test_decodes_png_jpeg_webp_to_rgb() -> None:
    for fmt in ("PNG", "JPEG", "WEBP"):
        image = decode_image(encode(Image.new("RGB", (8, 6), RED), fmt), MediaPolicy(), PARAM)
        assert image.mode == "RGB" and image.size == (8, 6)
        r, g, b = image.getpixel((4, 3))
        assert r > 240 and g < 16 and b < 16, fmt


def test_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (5, 5), RED), Image.new("RGB", (5, 5), BLUE)]
    gif = encode(frames[0], "GIF", save_all=True, append_images=frames[1:])
    assert Image.open(io.BytesIO(gif)).n_frames == 2
    image = decode_image(gif, MediaPolicy(), PARAM)
    assert image.mode == "RGB" and image.getpixel((2, 2)) == RED


def test_transparent_pixels_become_white() -> None:
    rgba = Image.new("RGBA", (2, 2), (0, 0, 0, 0))
    image = decode_image(encode(rgba, "PNG"), MediaPolicy(), PARAM)
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 255, 255)


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_header(width: int, height: int) -> bytes:
    """A 60-byte PNG declaring a width x height RGB canvas, with one row's worth of pixel data."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(bytes(1 + 3 * min(width, 16)))
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + png_chunk(b"IDAT", idat)
        + png_chunk(b"IEND", b"")
    )


def test_too_many_pixels_is_refused_from_the_header() -> None:
    assert "7000x7000 above the limit of 36000000 pixels" in refusal(
        decode_image, png_header(7000, 7000), MediaPolicy(), PARAM
    )
    # Past Pillow's own bomb guard (2x its 89 MP warning), Pillow refuses first: a 400 all the same.
    assert "too large" in refusal(decode_image, png_header(100_000, 100_000), MediaPolicy(), PARAM)
    small = MediaPolicy(max_image_pixels=99)
    assert "10x10 above the limit of 99" in refusal(decode_image, png_header(10, 10), small, PARAM)


def test_what_is_not_an_image_is_refused() -> None:
    assert "not a PNG, JPEG, WEBP or GIF" in refusal(decode_image, b"hello", MediaPolicy(), PARAM)
    bmp = encode(Image.new("RGB", (2, 2)), "BMP")  # Pillow reads it; the API does not take it
    assert "not a PNG" in refusal(decode_image, bmp, MediaPolicy(), PARAM)
    truncated = encode(Image.new("RGB", (64, 64), RED), "PNG")[:-30]
    assert "could not be decoded" in refusal(decode_image, truncated, MediaPolicy(), PARAM)


# --- limits -------------------------------------------------------------------------------------


def test_parse_limit_mm_per_prompt() -> None:
    assert parse_limit_mm_per_prompt('{"image": 2, "video": 0}') == {"image": 2, "video": 0}
    assert parse_limit_mm_per_prompt('{"image": {"count": 3}}') == {"image": 3}
    for text, message in [
        ("{image: 2}", "not JSON"),
        ("[1]", "JSON object"),
        ('{"document": 1}', "unknown modality 'document'"),
        ('{"image": -1}', "non-negative integer"),
        ('{"image": 1.5}', "non-negative integer"),
        ('{"image": true}', "non-negative integer"),
        ('{"image": {"count": 1, "width": 9}}', "non-negative integer"),
    ]:
        with pytest.raises(ValueError, match=message):
            parse_limit_mm_per_prompt(text)


def test_check_limits() -> None:
    policy = MediaPolicy(limit_per_prompt={"image": 2, "video": 999, "audio": 999})
    check_limits({"image": 2, "video": 5}, policy, PARAM)
    assert refusal(check_limits, {"image": 3}, policy, PARAM) == (
        "At most 2 image(s) may be provided in one prompt. "
        "Set `--limit-mm-per-prompt` to increase this limit."
    )
    # The model's own limits, as vLLM: a modality it does not take has 0, with no hint to raise.
    assert refusal(check_limits, {"video": 1}, policy, PARAM, {"image": None}) == (
        "At most 0 video(s) may be provided in one prompt."
    )
    check_limits({"image": 2}, policy, PARAM, {"image": None})


# --- flags --------------------------------------------------------------------------------------

CONFIG = Config(model=ModelConfig(path="/m", served_model_name="m"))


def media_flags(*argv: str) -> MediaPolicy:
    return frontend_config_from_args(make_parser().parse_args(["launch", *argv]), CONFIG).media


def test_media_flag_defaults() -> None:
    policy = media_flags()
    assert policy.allowed_local_media_path is None and policy.allowed_media_domains == ()
    assert policy.limit_per_prompt == {"image": 999, "video": 999, "audio": 999}
    assert policy.max_image_bytes == 20 * 2**20 and policy.max_image_pixels == 36_000_000


def test_media_flags(tmp_path: Path) -> None:
    policy = media_flags(
        "--allowed-local-media-path", str(tmp_path / "." / ""),
        "--allowed-media-domains", "Images.Example.com.", "[::1]", "10.0.0.7",
        "--limit-mm-per-prompt", '{"image": 4}',
    )  # fmt: skip
    assert policy.allowed_local_media_path == tmp_path.resolve()
    assert policy.allowed_media_domains == ("images.example.com", "::1", "10.0.0.7")
    assert policy.limit_per_prompt == {"image": 4, "video": 999, "audio": 999}


def test_bad_media_flags_are_start_up_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--allowed-local-media-path .*not an existing folder"):
        media_flags("--allowed-local-media-path", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="--allowed-media-domains: 'https://a.com'"):
        media_flags("--allowed-media-domains", "https://a.com")
    with pytest.raises(ValueError, match="--allowed-media-domains: 'a.com:8080'"):
        media_flags("--allowed-media-domains", "a.com:8080")
    with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
        media_flags("--limit-mm-per-prompt", '{"image": "two"}')
