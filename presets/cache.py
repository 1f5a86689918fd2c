"""Where the built-ins are cached (~/.cache/rlhf-builtin, or under $XDG_CACHE_HOME), and the lock that lets concurrent
processes build one once."""

import contextlib
import fcntl
import os


def cache_root() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rlhf-builtin")


@contextlib.contextmanager
def file_lock(path: str):
    """An exclusive lock on `path` (created if missing) for the block: a second process waits for the first."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
