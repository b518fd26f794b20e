"""Engine announcements: an engine node writes ``<dir>/<name>.url`` (one line, ``http://host:port``) once
its server is healthy and removes it on stop; the trainer attaches to the engines it finds there."""

from __future__ import annotations

import os

SUFFIX = ".url"


def announce(url_dir: str, name: str, url: str) -> str:
    """Write the announcement atomically (a reader never sees a half-written URL); returns its path."""
    os.makedirs(url_dir, exist_ok=True)
    path = os.path.join(url_dir, name + SUFFIX)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(url + "\n")
    os.replace(tmp, path)
    return path


def withdraw(url_dir: str, name: str) -> None:
    try:
        os.remove(os.path.join(url_dir, name + SUFFIX))
    except FileNotFoundError:
        pass


def read_urls(url_dir: str) -> dict[str, str]:
    """``{name: url}`` of every engine announced in ``url_dir`` (empty when the directory is missing)."""
    if not os.path.isdir(url_dir):
        return {}
    out = {}
    for fname in sorted(os.listdir(url_dir)):
        if fname.endswith(SUFFIX):
            with open(os.path.join(url_dir, fname)) as f:
                url = f.read().strip()
            if url:
                out[fname[: -len(SUFFIX)]] = url
    return out
