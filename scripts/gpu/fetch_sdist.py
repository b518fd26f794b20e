"""Download one source distribution from a package index by name and version, without building it.

    python3 scripts/gpu/fetch_sdist.py transformer-engine-torch 2.20.2 DEST

``pip download --no-binary :all:`` prepares the sdist's metadata, which runs its build backend: for
transformer-engine-torch that needs torch (and ``wheel``) on the download machine. This reads the index's
simple page instead (PEP 691 JSON, else PEP 503 HTML), picks the ``.tar.gz`` of that version and checks the
sha256 the index gives. Standard library only. The index: ``--index-url``, else ``PIP_INDEX_URL``, else PyPI;
a TLS-inspecting proxy's CA bundle: ``PIP_CERT`` or ``SSL_CERT_FILE``.
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import json
import os
import re
import ssl
import sys
import urllib.parse
import urllib.request

DEFAULT_INDEX = "https://pypi.org/simple"
JSON_TYPE = "application/vnd.pypi.simple.v1+json"


def normalize(name: str) -> str:
    """PEP 503 project name normalization (the index's page of ``name``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")

    def handle_data(self, data):
        if self._href is not None:
            self.links.append((data.strip(), self._href))
            self._href = None


def _context() -> ssl.SSLContext:
    ca = os.environ.get("PIP_CERT") or os.environ.get("SSL_CERT_FILE")
    return ssl.create_default_context(cafile=ca if ca and os.path.isfile(ca) else None)


def list_files(index: str, name: str) -> list[dict]:
    """``[{"filename", "url", "sha256"}]`` of the project's page on ``index``."""
    page = f"{index.rstrip('/')}/{normalize(name)}/"
    req = urllib.request.Request(page, headers={"Accept": f"{JSON_TYPE}, text/html;q=0.1"})
    with urllib.request.urlopen(req, timeout=60, context=_context()) as r:
        body, ctype, base = r.read(), r.headers.get("Content-Type", ""), r.geturl()
    if ctype.startswith(JSON_TYPE):
        files = json.loads(body)["files"]
        return [{"filename": f["filename"], "url": urllib.parse.urljoin(base, f["url"]),
                 "sha256": f.get("hashes", {}).get("sha256")} for f in files]
    parser = _Links()
    parser.feed(body.decode("utf-8", "replace"))
    out = []
    for text, href in parser.links:
        url, _, frag = urllib.parse.urljoin(base, href).partition("#")
        sha = frag.split("=", 1)[1] if frag.startswith("sha256=") else None
        out.append({"filename": text or os.path.basename(urllib.parse.urlparse(url).path), "url": url, "sha256": sha})
    return out


def pick_sdist(files: list[dict], name: str, version: str) -> dict:
    """The ``NAME-VERSION.tar.gz`` among ``files`` (the name compared normalized: ``-``, ``_``, ``.``, case)."""
    for f in files:
        if f["filename"].endswith(".tar.gz"):
            proj, _, ver = f["filename"][:-len(".tar.gz")].rpartition("-")
            if normalize(proj) == normalize(name) and ver == version:
                return f
    have = sorted(f["filename"] for f in files if f["filename"].endswith(".tar.gz"))
    raise LookupError(f"no sdist of version {version} on the index (its newest: {', '.join(have[-3:]) or 'none'})")


def fetch(name: str, version: str, dest: str, index: str | None = None) -> str:
    """Download the sdist of ``name==version`` into ``dest``; returns its path. Raises on a hash mismatch."""
    index = index or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX
    f = pick_sdist(list_files(index, name), name, version)
    os.makedirs(dest, exist_ok=True)
    path = os.path.join(dest, f["filename"])
    h = hashlib.sha256()
    with urllib.request.urlopen(f["url"], timeout=600, context=_context()) as r, open(path + ".part", "wb") as out:
        while chunk := r.read(1 << 20):
            h.update(chunk)
            out.write(chunk)
    if f["sha256"] and h.hexdigest() != f["sha256"]:
        os.remove(path + ".part")
        raise ValueError(f"{f['filename']}: sha256 {h.hexdigest()} differs from the index's {f['sha256']}")
    os.replace(path + ".part", path)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name")
    ap.add_argument("version")
    ap.add_argument("dest")
    ap.add_argument("--index-url", default=None, help=f"simple index (default: PIP_INDEX_URL or {DEFAULT_INDEX})")
    args = ap.parse_args(argv)
    try:
        print(fetch(args.name, args.version, args.dest, args.index_url))
    except (LookupError, ValueError, OSError) as e:
        print(f"fetch_sdist.py: {args.name}=={args.version}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
