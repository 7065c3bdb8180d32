"""The one path layer every workdir touch goes through: local folders and `gs://` (any
fsspec URL) alike.

Lives here: `is_remote`, `join`, `absolute`, `exists`, `isdir`, `makedirs`, `listdir`,
`read_text`, `write_text` (whole-file, atomic), `append_text`, `replace`, `remove`, and
the local staging that libraries which only write local files need (`staging`,
`upload_tree`, `download_tree`). Not here: the workdir lock (workdir_lock.py), deciding
what goes where (train.py, metrics.py, build.py, plot.py, cli.py).

A local path behaves exactly as with `os` (the functions below are `os` calls for it). A
remote path (`scheme://...`) goes through fsspec (`gs://`: gcsfs; what etils `epath`, Orbax's
path library, uses too), its listings cache dropped before each call: another process may
have written since. Object stores have no append and no atomic rename of folders, so
`append_text` rewrites the object (callers append rarely: error.log), `write_text` writes
one object (atomic on GCS: a reader sees the old or the new object), and `replace` is a
copy then delete. Orbax and TensorStore are given the `gs://` path itself.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile

SCHEME = "://"


def is_remote(path: str) -> bool:
    """Whether `path` is a URL (`gs://bucket/run`) rather than a local path."""
    return SCHEME in str(path)


def _fs(path: str):
    """(fsspec file system, its path) for a URL, its listings cache dropped: another process
    (a resumed run, another host) may have written since (gcsfs caches listings)."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(str(path))
    fs.invalidate_cache()
    return fs, p.rstrip("/")


def join(path: str, *parts: str) -> str:
    """`os.path.join` for local paths; '/'-joined for URLs."""
    if not is_remote(path):
        return os.path.join(path, *parts)
    return "/".join([str(path).rstrip("/"), *(p.strip("/") for p in parts)])


def absolute(path: str) -> str:
    """A local path made absolute; a URL as it is."""
    return str(path).rstrip("/") if is_remote(path) else os.path.abspath(path)


def parent(path: str) -> str:
    return str(path).rstrip("/").rpartition("/")[0] if is_remote(path) else os.path.dirname(path)


def exists(path: str) -> bool:
    if not is_remote(path):
        return os.path.exists(path)
    fs, p = _fs(path)
    return fs.exists(p)


def isdir(path: str) -> bool:
    if not is_remote(path):
        return os.path.isdir(path)
    fs, p = _fs(path)
    return fs.isdir(p)


def makedirs(path: str) -> None:
    """Create the folder and its parents (a URL: a no-op on stores without folders)."""
    if is_remote(path):
        fs, p = _fs(path)
        fs.makedirs(p, exist_ok=True)
    else:
        os.makedirs(path, exist_ok=True)


def listdir(path: str) -> list[str]:
    """Names in the folder (FileNotFoundError where there is none)."""
    if not is_remote(path):
        return os.listdir(path)
    fs, p = _fs(path)
    if not fs.isdir(p):
        raise FileNotFoundError(f"no folder {path}")
    return [name.rstrip("/").rpartition("/")[2] for name in fs.ls(p, detail=False)]


def read_text(path: str) -> str:
    if is_remote(path):
        fs, p = _fs(path)
        return fs.cat_file(p).decode()
    with open(path) as f:
        return f.read()


def write_text(path: str, text: str) -> None:
    """Replace the file's whole content at once: a reader sees the old or the new one
    (local: a temporary file renamed over it; a URL: one object write)."""
    if is_remote(path):
        _write_bytes(path, text.encode())
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def append_text(path: str, text: str) -> None:
    """Append `text` (a URL: read, then rewrite the object; not for frequent appends)."""
    if not is_remote(path):
        with open(path, "a") as f:
            f.write(text)
        return
    old = read_text(path) if exists(path) else ""
    _write_bytes(path, (old + text).encode())


def replace(src: str, dst: str) -> None:
    """Move a file or folder (a URL: copy, then delete the source)."""
    if is_remote(src) or is_remote(dst):
        fs, p = _fs(src)
        fs.mv(p, _fs(dst)[1], recursive=True)
    else:
        os.replace(src, dst)


def remove(path: str) -> None:
    if is_remote(path):
        fs, p = _fs(path)
        fs.rm_file(p)
    else:
        os.remove(path)


def _write_bytes(path: str, data: bytes) -> None:
    if is_remote(path):
        fs, p = _fs(path)
        fs.pipe_file(p, data)
    else:
        with open(path, "wb") as f:
            f.write(data)


def check_writable(path: str) -> None:
    """A URL folder: its file system's library installed and the folder writable (a probe
    object written and removed); OSError saying what is missing or why, in a line."""
    if str(path).startswith("gs://"):
        for module, package in (("gcsfs", "gcsfs"), ("google.cloud.storage",
                                                     "google-cloud-storage")):
            try:
                importlib.import_module(module)
            except ImportError:
                raise OSError(f"a gs:// workdir needs the {package} package: pip install "
                              f"{package}, or use a local --workdir") from None
    probe = join(path, ".write_probe_" + str(os.getpid()))
    try:
        makedirs(path)
        write_text(probe, "ok")
        remove(probe)
    except Exception as e:  # noqa: BLE001 - gcsfs and fsspec raise their own types too
        text = (str(e).strip().splitlines() or [""])[0][:300]
        raise OSError(f"{type(e).__name__}: {text}") from e


# ------------------------------------------------------------------ local staging


def staging(path: str, name: str) -> str:
    """A local folder standing for `path` for libraries that write or read local files only
    (tokenizer `save_pretrained`/`from_pretrained`, the `datasets` reader, matplotlib,
    tensorboardX): `path` itself when local, else a fresh temporary folder (the caller
    uploads or downloads with `upload_tree` / `download_tree`)."""
    if not is_remote(path):
        return path
    return tempfile.mkdtemp(prefix=f"ba_jax_{name}_")


def upload_tree(local: str, remote: str) -> None:
    """Copy every file under the local folder to the same names under `remote` (a no-op
    when they are the same folder)."""
    if local == remote:
        return
    for root, _, files in os.walk(local):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), local).replace(os.sep, "/")
            dst = join(remote, rel)
            if not is_remote(dst):
                os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(os.path.join(root, f), "rb") as src:
                _write_bytes(dst, src.read())


def download_tree(remote: str, local: str) -> None:
    """Copy every file under `remote` into the local folder (a no-op when the same)."""
    if local == remote:
        return
    fs, root = _fs(remote)
    for name in fs.find(root):
        dst = os.path.join(local, *name[len(root):].strip("/").split("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(fs.cat_file(name))


def remove_staging(local: str, path: str) -> None:
    """Delete a staging folder made by `staging` (never `path` itself)."""
    if local != path:
        shutil.rmtree(local, ignore_errors=True)
