"""Per-run engine keys: SGLang's ``--api-key`` (generation) and ``--admin-api-key`` (weights, flow control).

    secrets = ensure_run_secrets(cfg.run_dir)  # once per run, before engines and trainer ranks start
    Engine(model_path=..., secrets=secrets)   # SGLang reads the keys from the file (``--config``)
    EngineClient(url)                         # finds them through $MRL_ENGINE_KEYS_FILE

The keys exist only in memory and in one file of mode 0600 (``<run_dir>/secrets/engine_keys.yaml``, or a
private temp dir), which is also the SGLang ``--config`` YAML: the keys never appear on a command line
(``/proc/<pid>/cmdline`` is readable by every user of the host), in the Hydra config or in a rendered
script. Child processes (trainer ranks, sync jobs, Slurm steps) inherit only the file's *path*, in
``$MRL_ENGINE_KEYS_FILE``. ``repr``/``str`` never show the keys; ``redact`` scrubs them from text.

SGLang rules (0.5.10 and 0.5.14, ``sglang/srt/utils/auth.py``): with both keys set, normal endpoints (``/generate``,
``/model_info``, ``/server_info``, ``/v1/loads``) take only the api key, admin endpoints (every weight
update, ``/pause_generation``, ``/continue_generation``, ``/flush_cache``, ``/abort_request``,
``/update_weight_version``, memory release/resume) take only the admin key; ``/health*`` and
``/metrics`` are always open. Caveat: ``/server_info`` returns the server args, admin key included,
to any holder of the api key, so the split protects against mistakes, not against api-key holders.
"""

from __future__ import annotations

import atexit
import json
import os
import secrets as _secrets
import shutil
import stat
import tempfile
from dataclasses import dataclass, field, replace

import yaml

ENV_VAR = "MRL_ENGINE_KEYS_FILE"
FILENAME = "engine_keys.yaml"
REDACTED = "<redacted>"
# The file is an SGLang --config YAML: its keys are SGLang's CLI option names.
_API, _ADMIN = "api-key", "admin-api-key"


def _new_key() -> str:
    # The prefix keeps argparse from reading a key that starts with '-' as an option, and lets secret
    # scanners recognise the keys.
    return "mrl_" + _secrets.token_urlsafe(32)


@dataclass(frozen=True, repr=False)
class EngineSecrets:
    api_key: str = field(repr=False)
    """Generation and introspection (SGLang ``--api-key``)."""
    admin_api_key: str = field(repr=False)
    """Weight updates and flow control (SGLang ``--admin-api-key``)."""
    path: str | None = None
    """The 0600 file holding both keys (also the engines' ``--config``)."""

    def __post_init__(self) -> None:
        for name, key in ((_API, self.api_key), (_ADMIN, self.admin_api_key)):
            if not isinstance(key, str) or not key or key.startswith("-") or any(c.isspace() for c in key):
                raise ValueError(f"engine keys file {self.path}: '{name}' must be a non-empty string without "
                                 "whitespace that does not start with '-'")
        if self.api_key == self.admin_api_key:
            raise ValueError(f"engine keys file {self.path}: '{_API}' and '{_ADMIN}' must differ")

    def __repr__(self) -> str:
        return f"EngineSecrets(path={self.path!r}, keys={REDACTED})"

    __str__ = __repr__

    @classmethod
    def generate(cls) -> "EngineSecrets":
        return cls(api_key=_new_key(), admin_api_key=_new_key())

    def write(self, path: str) -> "EngineSecrets":
        """Create ``path`` (mode 0600, its directory 0700) atomically; fails if it exists. Returns a copy
        with ``path`` set."""
        path = os.path.abspath(path)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write("# mrl engine keys (SGLang --config file). Never print, copy or commit.\n")
                for name, key in ((_API, self.api_key), (_ADMIN, self.admin_api_key)):
                    f.write(f"{name}: {json.dumps(key)}\n")  # quoted: YAML must not read it as a number/bool
            os.link(tmp, path)  # atomic and exclusive: readers never see a half-written file
        finally:
            os.unlink(tmp)
        return replace(self, path=path)

    @classmethod
    def load(cls, path: str) -> "EngineSecrets":
        """Read a keys file; refuses one that other users could read or that another user owns."""
        path = os.path.abspath(path)
        st = os.stat(path)
        if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise PermissionError(f"engine keys file {path} must be owned by this user and have mode 0600 "
                                  f"(has {stat.filemode(st.st_mode)}, uid {st.st_uid})")
        with open(path) as f:
            data = yaml.safe_load(f)
        if not isinstance(data, dict) or _API not in data or _ADMIN not in data:
            raise ValueError(f"engine keys file {path}: expected the keys '{_API}' and '{_ADMIN}'")
        return cls(api_key=data[_API], admin_api_key=data[_ADMIN], path=path)

    @classmethod
    def from_env(cls) -> "EngineSecrets | None":
        """The run's keys if ``$MRL_ENGINE_KEYS_FILE`` names them, else None."""
        path = os.environ.get(ENV_VAR)
        return cls.load(path) if path else None

    def export(self) -> None:
        """Point ``$MRL_ENGINE_KEYS_FILE`` at this file, for this process and every child it starts."""
        assert self.path is not None, "write() the secrets before exporting them"
        os.environ[ENV_VAR] = self.path

    def redact(self, text: str) -> str:
        return text.replace(self.api_key, REDACTED).replace(self.admin_api_key, REDACTED)


def ensure_run_secrets(run_dir: str | None = None) -> EngineSecrets:
    """The run's keys, exported in ``$MRL_ENGINE_KEYS_FILE``: the file the variable already names (a parent
    process made them), else ``<run_dir>/secrets/engine_keys.yaml`` (created unless it exists, so every
    node and every restart of a run agrees), else fresh keys in a private temp dir removed at exit."""
    found = EngineSecrets.from_env()
    if found is not None:
        return found
    if run_dir is not None:
        path = os.path.join(os.path.abspath(run_dir), "secrets", FILENAME)
        try:
            found = EngineSecrets.generate().write(path)
        except FileExistsError:
            found = EngineSecrets.load(path)
    else:
        tmp = tempfile.mkdtemp(prefix="mrl-secrets-")  # mode 0700
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        found = EngineSecrets.generate().write(os.path.join(tmp, FILENAME))
    found.export()
    return found
