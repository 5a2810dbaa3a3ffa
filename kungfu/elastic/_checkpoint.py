"""The durable checkpoint's file: a format that can be checked, written so that it can be trusted.

A file is, in this order:

    MAGIC (8 bytes) | format version (uint32, little-endian) | content length (uint64, LE)
    | SHA-256 of the content (32 bytes) | content (a pickle of the commit: Membership)

Reading (`read`) checks all of it before the content is unpickled: an empty, truncated,
corrupted or foreign file is a CheckpointError that names the file and what is wrong, never
"no checkpoint" (a missing file is that). The pickle is loaded only once its checksum matches,
so only files written whole by kungfu are loaded; a file of someone else's is still a pickle:
load only checkpoints you wrote.

Writing (`write`): a temporary file with an unpredictable name in the same folder (mode 0600:
the model is nobody else's), written, flushed to disk, renamed over the file, and the folder
flushed so that the rename survives a crash. A crash leaves the previous checkpoint whole; a
failed write leaves no temporary file behind.
"""
from __future__ import annotations

import hashlib
import os
import struct
import tempfile

MAGIC = b"KFCKPT\r\n"  # \r\n: a file mangled by a text-mode copy does not pass for one
VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used (empty, truncated, corrupted, foreign), or a
    checkpoint path that cannot be written."""


def encode(content: bytes) -> bytes:
    """`content` as a checkpoint file's bytes (header, then the content)."""
    return _HEADER.pack(MAGIC, VERSION, len(content), hashlib.sha256(content).digest()) + content


def decode(blob: bytes, path: str) -> bytes:
    """The content of a checkpoint file's bytes, checked; CheckpointError naming `path` and
    what is wrong otherwise."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(
            f"kungfu: the checkpoint {path} {why}; it is not loaded (delete or move it to start "
            "training from scratch, or put a good checkpoint there)")

    if not blob:
        raise bad("is empty (0 bytes)")
    if not blob.startswith(MAGIC[:min(len(blob), len(MAGIC))]):
        raise bad(f"is not a kungfu checkpoint (it starts with {blob[:8]!r}, not {MAGIC!r})")
    if len(blob) < _HEADER.size:
        raise bad(f"is truncated: {len(blob)} bytes, shorter than its {_HEADER.size}-byte "
                   "header")
    _, version, length, digest = _HEADER.unpack_from(blob)
    if version != VERSION:
        raise bad(f"has format version {version}; this kungfu reads version {VERSION}")
    have = len(blob) - _HEADER.size
    if have < length:
        raise bad(f"is truncated: {have} bytes of content, its header says {length}")
    if have > length:
        raise bad(f"has {have - length} bytes more than its header says ({length})")
    content = blob[_HEADER.size:]
    if hashlib.sha256(content).digest() != digest:
        raise bad("is corrupted: the SHA-256 of its content does not match its header")
    return content


def read(path: str) -> bytes:
    """The checked content of the checkpoint file at `path` (CheckpointError: see decode;
    FileNotFoundError: no checkpoint)."""
    with open(path, "rb") as f:
        blob = f.read()
    return decode(blob, path)


def write(path: str, content: bytes) -> None:
    """Writes `content` to `path` atomically (see the module doc). Raises OSError when it
    cannot (no temporary file is left)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:  # mkstemp: mode 0600, O_EXCL
            f.write(encode(content))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_folder(folder)


def _fsync_folder(folder: str) -> None:
    """The rename reaches the disk (POSIX: a directory's entries are synced through it)."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(path: str) -> None:
    """Whether a checkpoint can be written at `path`: its folder exists and takes a new file
    (tried: a file is made and removed, which a read-only file system or missing rights refuse,
    also for root), and `path` is not a folder. CheckpointError naming the path otherwise."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CheckpointError(f"kungfu: the checkpoint path {path} is a folder: give a file "
                              "name in it")
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise CheckpointError(f"kungfu: cannot write the checkpoint {path}: its folder {folder} "
                              f"{what} (create it before training)")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.",
                                     suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointError(f"kungfu: cannot write the checkpoint {path}: a file cannot be "
                              f"made in {folder} ({e.strerror or e})") from None
