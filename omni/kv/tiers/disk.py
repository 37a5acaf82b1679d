"""The disk tier: one sparse file of fixed-size slots, each a checksummed header and a page.

A slot is ``[header | payload | padding]``, `slot_bytes` long (header + page rounded up to 4 KiB)::

    magic  b"OMNIKV\\x00\\x01"  8 bytes
    key                         16 bytes
    payload length              u64, little-endian
    xxh3_128(payload)           16 bytes

A write is one ``pwritev`` of header and payload; a read is one ``preadv`` straight into the
destination tensor, then the header is checked. A torn or corrupted slot, a truncated file, a
header naming another key or a failed read reads as a miss (False), never as wrong KV.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import struct
import weakref
from pathlib import Path

import torch
import xxhash

from omni.kv.keys import check_keys
from omni.kv.layout import KVLayout
from omni.kv.tiers.memory import check_page

__all__ = ["DiskTier", "default_directory"]

log = logging.getLogger("omni.kv")

MAGIC = b"OMNIKV\x00\x01"
HEADER = struct.Struct("<8s16sQ16s")  # magic, key, payload length, xxh3_128 digest of payload
BLOCK = 4096
DATA_FILE = "pages.bin"


def default_directory() -> Path:
    """``$XDG_CACHE_HOME/omni/kv``, or ``~/.cache/omni/kv``."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "omni" / "kv"


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The tensor's own memory as a flat byte view (CPU, contiguous; no copy)."""
    flat = tensor.detach().reshape(-1).view(torch.uint8)  # numpy has no bfloat16 / float8
    return memoryview(flat.numpy())


def _os_error_to_construction(exc: OSError, what: str, path: Path) -> Exception:
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return PermissionError(exc.errno, f"disk tier: cannot {what} {path}: {exc.strerror}")
    return ValueError(f"disk tier: cannot {what} {path}: {exc.strerror or exc}")


def _prepare_parent(path: Path) -> None:
    """Make sure `path` is a directory we can write to; create it (0700) if it is missing."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"disk tier path {path} is not a directory")
    if not path.exists():
        try:
            _make_private_directories(path)
        except OSError as exc:
            raise _os_error_to_construction(exc, "create directory", path) from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, f"disk tier directory {path} is not writable")


def _make_private_directories(path: Path) -> None:
    """Create `path` and its missing parents, each 0700. Why not `os.makedirs`: it gives the
    parents the umask's mode (0777 under umask 000)."""
    missing = []
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            continue  # another store created it meanwhile
        os.chmod(folder, 0o700)  # mkdir's mode is filtered by the umask


def _prepare_store_directory(path: Path) -> None:
    """Create (or reclaim) the per-store directory, owned by this user, mode 0700."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        info = os.lstat(path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise ValueError(f"disk tier: {path} exists and is not this user's directory") from None
    except OSError as exc:
        raise _os_error_to_construction(exc, "create directory", path) from exc
    os.chmod(path, 0o700)


def _remove_files(fd: int, data_file: str, directory: str) -> None:
    """Close and delete what a disk tier made; run by `close()` or at garbage collection."""
    os.close(fd)
    for remove, target in ((os.unlink, data_file), (os.rmdir, directory)):
        try:
            remove(target)
        except OSError:
            pass  # already gone, or the directory holds someone else's files


class DiskTier:
    """`num_slots` page slots in one file ``store-{store_id}/pages.bin``.

    Why one pre-sized file rather than a file per page: a slot is an offset, so a write or a
    read is a single positioned system call with no open/close or directory churn, and the file
    is sparse, so unused slots cost no disk. Each slot carries its own key and checksum, which is
    what lets a torn or stale slot read as a miss.
    """

    name = "disk"

    def __init__(self, layout: KVLayout, num_slots: int, directory: Path, fd: int) -> None:
        """Use `DiskTier.create`."""
        self.layout = layout
        self.num_slots = num_slots
        self.slot_bytes = self.slot_bytes_for(layout)
        self._directory = directory
        self._path = directory / DATA_FILE
        self._fd: int | None = fd
        self._finalizer = weakref.finalize(self, _remove_files, fd, str(self._path),
                                           str(directory))

    @staticmethod
    def slot_bytes_for(layout: KVLayout) -> int:
        """Bytes one slot takes on disk: header + page, rounded up to 4 KiB."""
        return -(-(HEADER.size + layout.page_bytes) // BLOCK) * BLOCK

    @classmethod
    def create(cls, layout: KVLayout, num_slots: int, path: str | os.PathLike[str] | None,
               store_id: str) -> DiskTier:
        """A disk tier in ``{path}/store-{store_id}/pages.bin`` (path default: `default_directory`).

        Raises:
            ValueError: no slot, an invalid store id, a path that is not a directory or cannot
                be created, or a store of that id using it already.
            PermissionError: a directory this user may not write to.
        """
        if num_slots < 1:
            raise ValueError(f"tier 'disk' holds no page: num_slots={num_slots}")
        if not isinstance(store_id, str) or re.fullmatch(r"[0-9a-f]{8,32}", store_id) is None:
            raise ValueError(f"invalid store id {store_id!r}: expected 8 to 32 hex digits")
        parent = default_directory() if path is None else Path(path).expanduser()
        _prepare_parent(parent)
        directory = parent / f"store-{store_id}"
        _prepare_store_directory(directory)
        data_file = directory / DATA_FILE
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(data_file, flags, 0o600)
        except FileExistsError:
            raise ValueError(f"disk tier: {data_file} exists: another store with id "
                             f"{store_id} is using it") from None
        except OSError as exc:
            raise _os_error_to_construction(exc, "create", data_file) from exc
        try:
            os.ftruncate(fd, num_slots * cls.slot_bytes_for(layout))  # sparse: no blocks yet
        except OSError as exc:
            _remove_files(fd, str(data_file), str(directory))
            raise _os_error_to_construction(exc, "size", data_file) from exc
        return cls(layout, num_slots, directory, fd)

    @property
    def path(self) -> Path:
        """The data file."""
        return self._path

    @property
    def directory(self) -> Path:
        """The per-store directory that holds the data file (removed by `close()`)."""
        return self._directory

    def write(self, slot: int, page: torch.Tensor, key: bytes) -> None:
        """Store `page` (any device) with `key` in `slot`: one ``pwritev`` of header + payload.

        Raises:
            OSError: the bytes could not all be written (a full disk); the slot holds nothing
                valid.
            ValueError: a page of another shape or dtype, or a key that is not 16 bytes.
            IndexError: no such slot.
        """
        fd = self._open_fd()
        offset = self._offset(slot)
        check_keys((key,))
        check_page(self.name, self.layout, page)
        if page.device.type != "cpu":
            page = page.to("cpu")
        payload = _bytes_of(page.contiguous())
        header = HEADER.pack(MAGIC, key, len(payload), xxhash.xxh3_128_digest(payload))
        written = os.pwritev(fd, [header, payload], offset)
        if written != len(header) + len(payload):
            raise OSError(errno.EIO, f"disk tier: short write to slot {slot}: {written} of "
                                     f"{len(header) + len(payload)} bytes")

    def read_into(self, slot: int, out: torch.Tensor, key: bytes) -> bool:
        """Read the page in `slot` into `out` and verify it; False (and a warning) if it is not
        the page `key` wrote intact. One ``preadv`` straight into `out` when it is a contiguous
        CPU tensor (else through a temporary). `out` is undefined after False.

        Raises:
            ValueError: `out` of another shape or dtype, or a key that is not 16 bytes.
            IndexError: no such slot.
        """
        fd = self._open_fd()
        offset = self._offset(slot)
        check_keys((key,))
        check_page(self.name, self.layout, out, "destination")
        if out.device.type != "cpu" or not out.is_contiguous():
            staged = torch.empty(self.layout.page_shape, dtype=self.layout.dtype)
            if not self.read_into(slot, staged, key):
                return False
            out.copy_(staged)
            return True
        header = bytearray(HEADER.size)
        payload = _bytes_of(out)
        try:
            got = os.preadv(fd, [header, payload], offset)
        except OSError as exc:  # EIO from a failing disk: a miss too, not a failed request
            got, problem = 0, f"read error: {exc}"
        else:
            problem = None
        problem = problem or self._verify(got, header, payload, key)
        if problem is not None:
            log.warning("disk tier slot %d of %s failed verification (%s): treated as a miss",
                        slot, self._path, problem)
            return False
        return True

    def _verify(self, got: int, header: bytearray, payload: memoryview, key: bytes) -> str | None:
        """Why the slot is not `key`'s intact page, or None if it is."""
        if got < len(header) + len(payload):
            return f"short read: {got} of {len(header) + len(payload)} bytes"
        magic, stored_key, length, digest = HEADER.unpack(header)
        if magic != MAGIC:
            return "no page header"
        if stored_key != key:
            return f"holds key {stored_key.hex()}, not {key.hex()}"
        if length != len(payload):
            return f"payload of {length} bytes, expected {len(payload)}"
        if xxhash.xxh3_128_digest(payload) != digest:
            return "checksum mismatch"
        return None

    def flush(self) -> None:
        """Push written pages to the device (``fdatasync``)."""
        os.fdatasync(self._open_fd())

    def close(self) -> None:
        """Close the file and delete it and the per-store directory. Idempotent."""
        self._fd = None
        self._finalizer()

    def _open_fd(self) -> int:
        if self._fd is None:
            raise ValueError(f"disk tier {self._path} is closed")
        return self._fd

    def _offset(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"tier 'disk' has no slot {slot} (0..{self.num_slots - 1})")
        return slot * self.slot_bytes

    def __repr__(self) -> str:
        state = " closed" if self._fd is None else ""
        return (f"<DiskTier {self._path} slots={self.num_slots} "
                f"slot={self.slot_bytes}B{state}>")
