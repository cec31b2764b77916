"""Fetching images: only from allowed hosts, never redirected to another, within the size cap;
files only under the allowed folder. A loopback HTTP server plays the remote host."""
from __future__ import annotations

import http.server
import io
import threading

import pytest

from runtime.multimodal.media import MediaError, MediaPolicy, load_image
from runtime.testing.tiny_vlm import random_image


def png_bytes() -> bytes:
    buffer = io.BytesIO()
    random_image(5).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def host():
    image = png_bytes()
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            if self.path == "/away":  # to a host not in the list
                self.send_response(302)
                self.send_header("Location", "http://localhost.invalid/cat.png")
                self.end_headers()
                return
            body = image if self.path == "/cat.png" else b"\0" * 4096
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}", requests
    server.shutdown()


def test_an_allowed_host_is_fetched(host):
    url, _ = host
    image = load_image(f"{url}/cat.png", MediaPolicy(allowed_domains=("127.0.0.1",)))
    assert image.size == random_image(5).size


def test_a_host_not_allowed_is_never_fetched(host):
    url, requests = host
    before = len(requests)
    with pytest.raises(MediaError, match="--allowed-media-domains"):
        load_image(f"{url}/cat.png", MediaPolicy())
    assert len(requests) == before


def test_a_redirect_to_another_host_is_refused(host):
    url, _ = host
    with pytest.raises(MediaError, match="redirects to .*localhost.invalid"):
        load_image(f"{url}/away", MediaPolicy(allowed_domains=("127.0.0.1",)))


def test_the_size_cap_is_a_413(host):
    url, _ = host
    with pytest.raises(MediaError, match="more than 1000 bytes") as info:
        load_image(f"{url}/big", MediaPolicy(allowed_domains=("127.0.0.1",), max_bytes=1000))
    assert info.value.status == 413


def test_files_only_under_the_allowed_folder(tmp_path):
    (tmp_path / "cat.png").write_bytes(png_bytes())
    policy = MediaPolicy(allowed_local_path=str(tmp_path))
    assert load_image(f"file://{tmp_path}/cat.png", policy).size == random_image(5).size
    with pytest.raises(MediaError, match="outside --allowed-local-media-path"):
        load_image(f"file://{tmp_path}/../etc/passwd", policy)
    with pytest.raises(MediaError, match="file:// image URLs are off"):
        load_image(f"file://{tmp_path}/cat.png", MediaPolicy())
