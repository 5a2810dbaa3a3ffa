"""The durable checkpoint's file: a format that can be checked, written so that it can be trusted.

A file is, in this order:

    MAGIC (8 bytes) | format version (uint32, little-endian) | flags (uint32, LE)
    | content length (uint64, LE) | tag (32 bytes) | content

The content is kungfu/elastic/_checkpoint_content.py's: a numpy .npz archive of plain arrays
and a JSON document, which loads without running code (no pickle: np.load with
allow_pickle=False, json.loads). The tag covers the header before it and the content: with an
authenticity key (flags bit 0, KEYED) it is their HMAC-SHA256 under the key, else their SHA-256.
The SHA-256 finds a file damaged by accident; only the HMAC finds one changed on purpose (anyone
who can write the file can recompute a SHA-256), so with a key only files with the key's HMAC
are loaded: an unkeyed file is refused too (a forger would write one).

Reading (`read`) checks all of it before the content is parsed: an empty, truncated,
corrupted, forged or foreign file is a CheckpointError that names the file and what is wrong,
never "no checkpoint" (a missing file is that). Format version 1 (a pickle behind a SHA-256,
which runs code when loaded) is refused, saying how to go on (convert_v1 below, for a file one
trusts).

Writing (`write`): the folder is created if it is missing (as Keras's ModelCheckpoint does), a
temporary file with an unpredictable name in it (mode 0600: the model is nobody else's),
written, flushed to disk, renamed over the file, and the folder flushed so that the rename
survives a crash. A crash leaves the previous checkpoint whole; a failed write leaves no
temporary file behind.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
import tempfile
from typing import Optional, Union

MAGIC = b"KFCKPT\r\n"  # \r\n: a file mangled by a text-mode copy does not pass for one
VERSION = 2
KEYED = 1  # flags: the tag is an HMAC under the user's key
_START = struct.Struct("<8sI")  # magic, version: what every version begins with
_HEADER = struct.Struct("<8sIIQ32s")  # ... flags, content length, tag
_V1_HEADER = struct.Struct("<8sIQ32s")  # version 1: magic, version, length, SHA-256

Key = Union[str, bytes, None]


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used (empty, truncated, corrupted, forged, foreign), or
    a checkpoint path that cannot be written."""


def _key_bytes(key: Key) -> Optional[bytes]:
    return key.encode() if isinstance(key, str) else key


def _tag(head: bytes, content: bytes, key: Key) -> bytes:
    k = _key_bytes(key)
    if k is None:
        return hashlib.sha256(head + content).digest()
    mac = hmac.new(k, head, hashlib.sha256)
    mac.update(content)
    return mac.digest()


def _head(flags: int, length: int) -> bytes:
    """The header before the tag (what the tag covers, with the content)."""
    return _HEADER.pack(MAGIC, VERSION, flags, length, b"")[:_HEADER.size - 32]


def encode(content: bytes, key: Key = None) -> bytes:
    """`content` as a checkpoint file's bytes (header, then the content), tagged with an HMAC
    under `key` when one is given."""
    head = _head(KEYED if key is not None else 0, len(content))
    return head + _tag(head, content, key) + content


def decode(blob: bytes, path: str, key: Key = None) -> bytes:
    """The content of a checkpoint file's bytes, checked (and authenticated, with `key`);
    CheckpointError naming `path` and what is wrong otherwise."""
    def bad(why: str, fix: str = "delete or move it to start training from scratch, or put a "
                                 "good checkpoint there") -> CheckpointError:
        return CheckpointError(f"kungfu: the checkpoint {path} {why}; it is not loaded ({fix})")

    if not blob:
        raise bad("is empty (0 bytes)")
    if not blob.startswith(MAGIC[:min(len(blob), len(MAGIC))]):
        raise bad(f"is not a kungfu checkpoint (it starts with {blob[:8]!r}, not {MAGIC!r})")
    if len(blob) >= _START.size and _START.unpack_from(blob)[1] == 1:
        raise bad("has format version 1: a pickle, which runs code when it is loaded, so kungfu "
                  "no longer loads it",
                  "if you wrote it and trust it, convert it once with: python -m "
                  f"kungfu.elastic.convert_checkpoint {path}; else delete or move it to start "
                  "training from scratch")
    if len(blob) < _HEADER.size:
        raise bad(f"is truncated: {len(blob)} bytes, shorter than its {_HEADER.size}-byte "
                  "header")
    _, version, flags, length, tag = _HEADER.unpack_from(blob)
    if version != VERSION:
        raise bad(f"has format version {version}; this kungfu reads version {VERSION}")
    have = len(blob) - _HEADER.size
    if have < length:
        raise bad(f"is truncated: {have} bytes of content, its header says {length}")
    if have > length:
        raise bad(f"has {have - length} bytes more than its header says ({length})")
    head, content = blob[:_HEADER.size - 32], blob[_HEADER.size:]
    keyed = bool(flags & KEYED)
    if keyed and key is None:
        raise bad("is signed with an authenticity key, and none is set",
                  "give the key it was written with: checkpoint_key= or KUNGFU_CHECKPOINT_KEY")
    if not keyed and key is not None:
        raise bad("is not signed, and an authenticity key is set: with a key only checkpoints "
                  "signed with it are loaded (anyone can write an unsigned one)",
                  "delete or move it to start training from scratch; or, if you trust it, resume "
                  "from it once without the key, and the checkpoints written then are signed")
    if not hmac.compare_digest(_tag(head, content, key), tag):
        if keyed:
            raise bad("does not match the authenticity key: it was changed after it was "
                      "written, or written with another key")
        raise bad("is corrupted: the SHA-256 of its content does not match its header")
    return content


def read(path: str, key: Key = None) -> bytes:
    """The checked content of the checkpoint file at `path` (CheckpointError: see decode;
    FileNotFoundError: no checkpoint)."""
    with open(path, "rb") as f:
        blob = f.read()
    return decode(blob, path, key)


def write(path: str, content: bytes, key: Key = None) -> None:
    """Writes `content` to `path` atomically (see the module doc), tagged under `key` if given.
    Raises OSError when it cannot (no temporary file is left)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(folder):
        os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:  # mkstemp: mode 0600, O_EXCL
            f.write(encode(content, key))
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


def read_v1_trusted(path: str) -> object:
    """The pickled commit of a format-version-1 file, checked against its SHA-256 and then
    UNPICKLED: only for a file one wrote and trusts (convert_checkpoint), never on resume."""
    import pickle

    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < _V1_HEADER.size or _V1_HEADER.unpack_from(blob)[:2] != (MAGIC, 1):
        raise CheckpointError(f"kungfu: {path} is not a version-1 kungfu checkpoint")
    _, _, length, digest = _V1_HEADER.unpack_from(blob)
    content = blob[_V1_HEADER.size:]
    if len(content) != length or hashlib.sha256(content).digest() != digest:
        raise CheckpointError(f"kungfu: the checkpoint {path} is truncated or corrupted")
    return pickle.loads(content)  # noqa: S301 - the caller vouches for the file


def _fsync_folder(folder: str) -> None:
    """The rename reaches the disk (POSIX: a directory's entries are synced through it)."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(path: str) -> None:
    """Whether a checkpoint can be written at `path`: its folder exists (it is created if it is
    missing, with its parents, as Keras's ModelCheckpoint does) and takes a new file (tried: a
    file is made and removed, which a read-only file system or missing rights refuse, also for
    root), and `path` is not a folder. CheckpointError naming the path otherwise."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise CheckpointError(f"kungfu: the checkpoint path {path} is a folder: give a file "
                              "name in it")
    if not os.path.exists(folder):
        try:
            os.makedirs(folder, exist_ok=True)  # every worker may: exist_ok
        except OSError as e:
            raise CheckpointError(f"kungfu: cannot write the checkpoint {path}: its folder "
                                  f"{folder} cannot be created ({e.strerror or e})") from None
    if not os.path.isdir(folder):
        raise CheckpointError(f"kungfu: cannot write the checkpoint {path}: its folder {folder} "
                              "is not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.",
                                     suffix=".tmp")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CheckpointError(f"kungfu: cannot write the checkpoint {path}: a file cannot be "
                              f"made in {folder} ({e.strerror or e})") from None
