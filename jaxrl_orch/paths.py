"""Every path of a run, local or on object storage (``gs://``), through one type.

What it owns
- ``as_path(p)``: an ``etils.epath.Path``. A URL stays a URL (``pathlib.Path("gs://b/run")``
  would silently become the local directory ``gs:/b/run``); a local path stays as given. Its
  ``/``, ``exists``, ``mkdir``, ``read_text``, ``write_text``, ``iterdir``, ``glob``, ``unlink``
  and ``rmtree`` work alike for both (``gs://`` through ``gcsfs``: the ``gcs`` extra; orbax and
  tensorstore read and write ``gs://`` themselves).
- ``is_url(p)``: whether ``p`` names object storage rather than the local filesystem.
- ``write_atomic(path, data)``: local: a temporary file, fsync, rename, directory fsync (a
  crash leaves the old file or the new one); object storage: one object write, which replaces
  the object whole or not at all.
- ``JsonlAppender``: one JSON row per ``append``, durable when it returns. Local files are
  appended to; an object cannot be appended to, so its text is kept and the object rewritten
  (small files: metrics, gauges, error records). Opened at the first append, so a resume may
  trim the file first.
- ``copy_tree(src, dst)``: a directory copied file by file between any two of them.

Why epath: it is the path layer orbax already uses (the same ``gs://`` code path for the
checkpoints and for everything else), and it keeps ``pathlib``'s interface.

The lowest layer: imports nothing of the package.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from etils import epath

Pathish = str | os.PathLike
_URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)


def is_url(p: Pathish) -> bool:
    return bool(_URL.match(os.fspath(p)))


def as_path(p: Pathish) -> epath.Path:
    text = os.fspath(p)
    if text.startswith("gs://"):
        try:
            import gcsfs  # noqa: F401 - epath's gs:// backend
        except ImportError as exc:
            raise ValueError(
                f"{text!r} is on Google Cloud Storage, which needs gcsfs: "
                "pip install 'jaxrl-orch[gcs]'"
            ) from exc
    elif is_url(text):
        # Only gs:// is tested end to end (checkpoints, metrics, TensorBoard, resume); another
        # scheme would fail deep inside fsspec or tensorstore, minutes into a run.
        raise ValueError(f"unsupported URL {text!r}: use a local path or gs://")
    return epath.Path(text)


def write_atomic(path: Pathish, data: bytes | str) -> None:
    path = as_path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if is_url(path):
        path.write_bytes(raw)
        return
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.fspath(path))
    # The rename is only durable once the directory entry is.
    dir_fd = os.open(os.path.dirname(os.path.abspath(os.fspath(path))), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class JsonlAppender:
    """See the module docstring."""

    def __init__(self, path: Pathish) -> None:
        self.path = as_path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f: Any = None
        self._text: str | None = None  # object storage: the object's text so far

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, allow_nan=False, default=str) + "\n"
        if is_url(self.path):
            if self._text is None:
                self._text = self.path.read_text() if self.path.exists() else ""
            self._text += line
            self.path.write_text(self._text)
            return
        if self._f is None:
            self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - see close()
        self._f.write(line)
        self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self._text = None


def copy_tree(src: Pathish, dst: Pathish) -> None:
    """Copy the files under ``src`` to the same relative paths under ``dst``."""
    src = as_path(src)
    dst = as_path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_dir():
            copy_tree(item, dst / item.name)
        else:
            (dst / item.name).write_bytes(item.read_bytes())
