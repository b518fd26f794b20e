"""scripts/gpu/fetch_sdist.py against a package index served on 127.0.0.1: the JSON and the HTML simple page,
name normalization, the sha256 check, a version the index lacks; and fetch_parts.sh's prerequisite check."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import threading

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts", "gpu"))
import fetch_sdist  # noqa: E402

sys.path.pop(0)


def _sdist(name: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        data = b"from setuptools import setup\nimport torch  # building needs torch\n"
        info = tarfile.TarInfo(f"{name}/setup.py")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Index:
    """A simple index of one project: ``transformer-engine-torch`` with a wheel and two sdists."""

    def __init__(self, *, json_pages: bool, bad_hash: bool = False) -> None:
        self.blobs = {"transformer_engine_torch-2.20.2.tar.gz": _sdist("transformer_engine_torch-2.20.2"),
                      "transformer_engine_torch-2.19.0.tar.gz": _sdist("transformer_engine_torch-2.19.0"),
                      "transformer_engine_torch-2.20.2-cp312-cp312-linux_x86_64.whl": b"not this one"}
        self.json_pages, self.bad_hash, self.requests = json_pages, bad_hash, []
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                index.requests.append((self.path, self.headers.get("Accept", "")))
                if self.path == "/simple/transformer-engine-torch/":
                    body, ctype = index.page(self.headers.get("Accept", ""))
                elif self.path.startswith("/files/") and self.path[7:] in index.blobs:
                    body, ctype = index.blobs[self.path[7:]], "application/octet-stream"
                else:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def sha(self, name: str) -> str:
        return "0" * 64 if self.bad_hash else hashlib.sha256(self.blobs[name]).hexdigest()

    def page(self, accept: str) -> tuple[bytes, str]:
        if self.json_pages and fetch_sdist.JSON_TYPE in accept:
            files = [{"filename": n, "url": f"/files/{n}", "hashes": {"sha256": self.sha(n)}} for n in self.blobs]
            return json.dumps({"meta": {"api-version": "1.1"}, "files": files}).encode(), fetch_sdist.JSON_TYPE
        links = "".join(f'<a href="../../files/{n}#sha256={self.sha(n)}">{n}</a><br/>' for n in self.blobs)
        return f"<html><body>{links}</body></html>".encode(), "text/html"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(params=[True, False], ids=["json", "html"])
def index(request):
    idx = Index(json_pages=request.param)
    yield idx
    idx.close()


def test_fetches_the_sdist_of_the_version_without_building_it(index, tmp_path):
    path = fetch_sdist.fetch("Transformer_Engine.Torch", "2.20.2", str(tmp_path), index=index.url)
    assert os.path.basename(path) == "transformer_engine_torch-2.20.2.tar.gz"
    with open(path, "rb") as f:
        assert f.read() == index.blobs["transformer_engine_torch-2.20.2.tar.gz"]
    assert os.listdir(tmp_path) == ["transformer_engine_torch-2.20.2.tar.gz"]  # no partial file, no build
    assert index.requests[0][0] == "/simple/transformer-engine-torch/"


def test_a_version_the_index_lacks_names_what_it_has(index, tmp_path):
    with pytest.raises(LookupError, match=r"no sdist of version 9\.9\.9 .*transformer_engine_torch-2\.20\.2\.tar\.gz"):
        fetch_sdist.fetch("transformer-engine-torch", "9.9.9", str(tmp_path), index=index.url)


def test_a_hash_mismatch_fails_and_leaves_nothing(tmp_path):
    idx = Index(json_pages=True, bad_hash=True)
    try:
        with pytest.raises(ValueError, match="sha256 .* differs from the index's 0000"):
            fetch_sdist.fetch("transformer-engine-torch", "2.20.2", str(tmp_path), index=idx.url)
    finally:
        idx.close()
    assert os.listdir(tmp_path) == []


def test_command_line_reads_the_index_from_pip_index_url(index, tmp_path):
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu", "fetch_sdist.py"),
                        "transformer-engine-torch", "2.20.2", str(tmp_path)], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PIP_INDEX_URL=index.url))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == str(tmp_path / "transformer_engine_torch-2.20.2.tar.gz")
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu", "fetch_sdist.py"),
                        "transformer-engine-torch", "1.0", str(tmp_path), "--index-url", index.url],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and "transformer-engine-torch==1.0: no sdist of version 1.0" in p.stderr


def test_fetch_parts_names_a_missing_prerequisite_before_downloading(tmp_path):
    p = subprocess.run(["bash", os.path.join(REPO, "scripts", "gpu", "fetch_parts.sh"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHON=str(tmp_path / "no-python3")))
    assert p.returncode == 1
    assert "fetch_parts.sh: missing on this machine: " + str(tmp_path / "no-python3") in p.stderr
    assert not (tmp_path / "out").exists()
