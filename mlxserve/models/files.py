"""Where converted models live, and how they get there without half-written files."""

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path


class ModelLoadError(ValueError):
    """A model could not be found, read or converted; the message says why."""


def cache_dir() -> Path:
    """The user cache: `$MLXSERVE_CACHE_DIR`, default `~/.cache/mlxserve`."""
    root = os.environ.get("MLXSERVE_CACHE_DIR")
    path = Path(root).expanduser() if root else Path.home() / ".cache" / "mlxserve"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_file(path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_dir(dest: Path):
    """Yield a scratch folder beside `dest`; rename it to `dest` on success.

    The scratch folder is on the same filesystem, so the rename is atomic: a
    reader sees either no `dest` or a complete one. On any error the scratch
    folder is removed and `dest` is left untouched.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        yield tmp
        try:
            os.rename(tmp, dest)
        except OSError:
            # Another process finished the same conversion first: keep theirs.
            if not dest.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(dest: Path):
    """Like `atomic_dir`, for one file: yield a scratch path, then rename it."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
