"""Where the built-ins are cached (~/.cache/rlhf-builtin, or under $XDG_CACHE_HOME), the lock that lets concurrent
processes build one once, and the check that a cached folder is whole before it is used: every file its build wrote
(listed with its size in MANIFEST) is there at that size, its JSON files parse and its weights' headers read. A cached
tokenizer is parsed once a process (`loaded_tokenizer`)."""

import contextlib
import fcntl
import glob
import json
import os
import pickle

from safetensors import safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

MANIFEST = ".rlhf-builtin.json"


class CacheError(OSError):
    """A damaged cached built-in that cannot be rebuilt (a read-only cache): the message names the folder to delete."""


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


def write_manifest(folder: str) -> None:
    """Record every file of a freshly built `folder` with its size (the last step of a build, before it is renamed into
    place)."""
    files = {
        os.path.relpath(path, folder): os.path.getsize(path)
        for path in glob.glob(os.path.join(folder, "**", "*"), recursive=True)
        if os.path.isfile(path)
    }
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(files, f, indent=1)


def damage(folder: str, required: tuple[str, ...] = ("config.json",)) -> str | None:
    """Why the cached `folder` cannot be used, or None when it is whole: a file of its manifest missing or of another size
    (a folder cached before manifests: one of `required` missing), a JSON file outside the manifest that does not parse
    (the listed ones are checked by their size: parsing a tokenizer.json of megabytes at every load would cost a run
    about a second), a safetensors file whose header or data is cut short."""
    try:
        with open(os.path.join(folder, MANIFEST)) as f:
            listed = json.load(f)
    except FileNotFoundError:
        listed = {name: None for name in required}
    except ValueError:
        return f"{MANIFEST} does not parse"
    for name, size in listed.items():
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"{name} is missing"
        if size is not None and os.path.getsize(path) != size:
            return f"{name} has {os.path.getsize(path)} bytes, not {size}"
    for path in glob.glob(os.path.join(folder, "*.json")):
        if listed.get(os.path.basename(path)) is not None:  # its size is the one its build wrote: cut, it would differ
            continue
        try:
            with open(path, encoding="utf-8") as f:
                json.load(f)
        except (ValueError, OSError) as error:
            return f"{os.path.basename(path)} does not parse ({type(error).__name__})"
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        try:
            with safe_open(path, "pt") as weights:  # reads the header and checks that the file holds all it lists
                weights.keys()
        except Exception as error:  # noqa: BLE001 - safetensors raises its own error types for a cut file
            return f"{os.path.basename(path)} cannot be read ({type(error).__name__})"
    return None


# The tokenizers this process loaded, pickled, by folder and the times its files were written
LOADED: dict[tuple, bytes] = {}


def loaded_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    """`AutoTokenizer.from_pretrained(folder)`, parsed once a process while its files stay as they are: each call gets
    a copy of its own, unpickled in 0.15 s where GPT-2's tokenizer takes 0.37 s to load (transformers parses its 3.5 MB
    tokenizer.json in Python, several times)."""
    key = (folder, *((f, os.stat(os.path.join(folder, f)).st_mtime_ns) for f in sorted(os.listdir(folder))))
    if key in LOADED:
        return pickle.loads(LOADED[key])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    LOADED[key] = pickle.dumps(tokenizer)
    return tokenizer
