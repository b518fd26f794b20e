"""The run directory is the job's control surface: its config, engine URL files, checkpoints and loop state
steer what every process runs and loads. Only the user running the job may write it.

    secure_run_dir("runs/tiny-tp1")   # created 0700; refused when another user owns it or others can write it
"""

from __future__ import annotations

import os
import stat


class UnsafeRunDir(PermissionError):
    """A run directory that someone other than this user could write."""


def secure_run_dir(path: str) -> str:
    """Create ``path`` 0700 (parents as the umask says), or check an existing one: owned by this user and not
    group- or world-writable. Returns ``path``."""
    if not os.path.isdir(path):
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.chmod(path, 0o700)  # makedirs' mode passes through the umask
    check_run_dir(path)
    return path


def check_run_dir(path: str) -> None:
    """Raise ``UnsafeRunDir`` when the existing directory ``path`` is another user's or others can write it."""
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise UnsafeRunDir(f"run_dir={path} is owned by {_user(st.st_uid)}, not by {_user(os.getuid())} who runs "
                           "this job: its files (config, engine URLs, checkpoints) would steer the run; use a "
                           "directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeRunDir(f"run_dir={path} is writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                           f"(mode {stat.S_IMODE(st.st_mode):04o}): anyone who can write it controls the run "
                           f"(config, engine URLs, checkpoints); run `chmod go-w {path}` or use another directory")


def _user(uid: int) -> str:
    import pwd

    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
