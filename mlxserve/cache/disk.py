"""The cold tier: prefix-cache blocks as safetensors files, found again after a restart.

Every block the hot tier stores (full blocks, and finished requests' partial
last blocks) is also written here, one file per block named by its key and
its parent's key (keys hash the model fingerprint, so models never mix; the
parent in the name lets a lookup list a block's cached children without
opening a file). A block whose missing layers are filled in later in memory
(sliding-window KV, a recurrent state) is written again. Writing has two
halves. The engine thread copies a block's arrays to host memory (MLX arrays
are read on the thread that owns MLX): a few blocks after each step while it
is busy, any number while it is idle (`copy_pending`), and never more than the
writer's queue takes, so a busy hour is written as it goes, not only in the
pauses, and a disk slower than the engine never slows a step. A background
thread writes the file (to a temporary name, then renamed, so a crash leaves
no half file under a real name), within two budgets against SSD wear: bytes per
second (it waits) and bytes per day (past it, blocks are not written). Blocks
wait at most `MAX_WAITING` deep: past that the newest are skipped (a block is
found only through its parent, which was noted before it). Every block not
written is counted by why (`skipped`): the backlog was full, its parent was
not written, it left memory before its turn, or the day's budget was spent. At
start the index is rebuilt from the folder (a restart, or a crash, loses only
what was not written yet) and the temporary files of writers that died are
deleted.

A prefix lookup that runs past the hot tier's blocks reads the rest of the
chain from here back into the hot tier. Bounded in bytes: the least recently
used files go first (use is a file's modification time, so the order
survives restarts). Every file carries a checksum (cache/blockfile.py) that a
read checks: a file that fails it, cannot be parsed or predates checksums is
deleted and counted by reason (`dropped`), and the request runs with the
blocks before it.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np

from mlxserve.cache.blockfile import DROP_REASONS, BadBlockFile, decode_payload, peek_block, read_block, to_host
from mlxserve.cache.blockfile import write_block

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
ROOT = "root"  # the parent part of a prompt's first block's file name
MAX_WAITING = 1024  # blocks stored in memory, not yet copied for writing (references, no copies)
MAX_QUEUED = 16  # copied blocks waiting for the writer thread (host memory held)
COPIES_PER_STEP = 4  # blocks copied after a busy step: more than decoding stores, little time
SKIP_REASONS = ("backlog", "orphan", "evicted", "daily_budget")
STALE_TMP_S = 600  # a temporary file this old was left by a write that died (another host's too)
PEEKS = 4096  # tokens of files read from their headers, kept to choose partial matches
# Temporary files name their writer (host, pid), so a start deletes a dead writer's at once
# and never a live one's: a folder may be shared by servers, on this host or others.
_HOST = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()


class WriteBudget:
    """Bytes per second (a write waits for its turn) and bytes per day (a write past it is
    refused), as token buckets: a day's budget may be spent in a burst, then refills evenly."""

    DAY_S = 86400.0

    def __init__(self, per_second: int | None, per_day: int | None, clock=time.monotonic):
        self.per_second, self.per_day, self.clock = per_second, per_day, clock
        now = clock()
        self._second = (float(per_second or 0), now)  # (bytes available, when)
        self._day = (float(per_day or 0), now)
        self.waited_s = 0.0

    @staticmethod
    def _refill(bucket, rate: float, capacity: float, now: float) -> float:
        level, then = bucket
        return min(capacity, level + (now - then) * rate)

    def take(self, nbytes: int, sleep=time.sleep) -> bool:
        """Wait for the per-second budget, then spend `nbytes`; False (nothing spent) if the
        day's budget is short of it."""
        now = self.clock()
        if self.per_day:
            level = self._refill(self._day, self.per_day / self.DAY_S, self.per_day, now)
            if level < nbytes:
                self._day = (level, now)
                return False
            self._day = (level - nbytes, now)
        if self.per_second:
            # One second's worth of burst; a block larger than that waits until it is all paid.
            level = self._refill(self._second, self.per_second, self.per_second, now)
            if level < nbytes:
                wait = (nbytes - level) / self.per_second
                sleep(wait)
                self.waited_s += wait
                now, level = self.clock(), nbytes
            self._second = (level - nbytes, now)
        return True


class DiskTier:
    def __init__(self, folder, budget_bytes: int, *, write_rate: int | None = None, daily_writes: int | None = None):
        self.folder = Path(folder).expanduser()
        try:  # fail at start, with the reason, rather than on every block
            self.folder.mkdir(parents=True, exist_ok=True)
            probe = self.folder / _tmp_name(".write-test")
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as e:
            raise ValueError(f"disk cache folder {str(self.folder)!r} cannot be written: {e}") from None
        self.budget = int(budget_bytes)
        # The index, children, peeks and counters: the engine thread and the writer share them.
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, tuple[int, bytes | None]] = OrderedDict()  # key -> (file bytes, parent), LRU first
        self._children: dict[bytes | None, OrderedDict[bytes, None]] = {}  # parent -> keys, least recently used first
        self._peeks: OrderedDict[bytes, tuple] = OrderedDict()  # key -> (token ids, extra) from its header
        self._waiting: OrderedDict[bytes, object] = OrderedDict()  # blocks to copy (engine thread only)
        self._queued: set[bytes] = set()  # copied, not written yet
        self.bytes = 0
        self.reads = 0
        self.writes = 0
        self.evictions = 0
        self.faults = 0  # blocks that could not be copied or written
        self.skips = dict.fromkeys(SKIP_REASONS, 0)  # blocks never written, by why (the module's doc)
        self.written_bytes = 0
        self.budget_writes = WriteBudget(write_rate, daily_writes)
        self.dropped = dict.fromkeys(DROP_REASONS, 0)  # files deleted instead of served, by reason
        self.abandoned = 0  # temporary files of dead writers deleted at start
        self._warned = False
        self._scan()
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._writer = threading.Thread(target=self._write_loop, name="mlxserve-disk-cache", daemon=True)
        self._writer.start()

    def _scan(self) -> None:
        for tmp in self.folder.glob("*.tmp"):
            if _abandoned(tmp):
                tmp.unlink(missing_ok=True)
                self.abandoned += 1
        files = []
        for path in self.folder.glob("*" + SUFFIX):
            name = _parse_name(path.name)
            try:
                if name == "old":  # no checksum: it cannot be told from a damaged one (README)
                    path.unlink()
                    self.dropped["old_format"] += 1
                elif name is not None:
                    files.append((path.stat().st_mtime, *name, path.stat().st_size))
            except OSError:
                continue
        with self._lock:
            for _, key, parent, size in sorted(files, key=lambda f: f[0]):
                self._add(key, parent, size)
            self._evict_over_budget()

    def _path(self, key: bytes, parent: bytes | None) -> Path:
        return self.folder / f"{key.hex()}.{parent.hex() if parent is not None else ROOT}{SUFFIX}"

    def _add(self, key: bytes, parent: bytes | None, size: int) -> None:
        """Index a written file, as the most recently used (lock held)."""
        old = self._index.pop(key, None)
        if old is not None:  # written again (a block filled in later)
            self.bytes -= old[0]
        self._index[key] = (size, parent)
        self.bytes += size
        siblings = self._children.setdefault(parent, OrderedDict())
        siblings[key] = None
        siblings.move_to_end(key)

    def _remove(self, key: bytes) -> Path | None:
        """Forget a file; its path, for the caller to delete (lock held)."""
        entry = self._index.pop(key, None)
        if entry is None:
            return None
        size, parent = entry
        self.bytes -= size
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.pop(key, None)
            if not siblings:
                del self._children[parent]
        self._peeks.pop(key, None)
        return self._path(key, parent)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def count_present(self, keys) -> int:
        """How many of `keys` have a file (one lock for them all: /v1/cache/stats asks for
        every block in memory)."""
        with self._lock:
            return sum(key in self._index for key in keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def drops(self) -> int:
        return sum(self.dropped.values())

    @property
    def skipped(self) -> int:
        return sum(self.skips.values())

    # ---- write: save (engine thread), copy_pending (engine thread, idle), the writer thread ----

    def save(self, block, update: bool = False) -> None:
        """Note a hot-tier block for writing: a no-op if it is on disk or on its way, unless
        `update` (its payload has gained layers: the file must be written again)."""
        key = block.hash
        if key in self._waiting:  # its payload is read when it is copied: the newest one
            return
        parent = block.parent
        with self._lock:
            if not update and (key in self._index or key in self._queued):
                return
            # Reachable only through its parent: a chain's blocks are noted parent first, so when
            # too many wait the newest go, and a block whose parent went (or was never written)
            # goes too; the oldest going would leave every later block of a chain an orphan.
            reachable = parent is None or parent in self._index or parent in self._queued
        if not (reachable or parent in self._waiting):
            self.skips["orphan"] += 1
            return
        if len(self._waiting) >= MAX_WAITING:
            self.skips["backlog"] += 1
            return
        self._waiting[key] = block

    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def copy_pending(self, max_blocks: int = 1, block: bool = False) -> int:
        """Copy up to `max_blocks` waiting blocks to host memory and queue them for the writer
        (engine thread); returns how many. Without `block`, stop where the writer's queue is full."""
        copied = 0
        while self._waiting and copied < max_blocks and self._writer.is_alive():
            if not block and self._queue.full():
                break
            key, b = self._waiting.popitem(last=False)
            if not b.cached:  # evicted from memory meanwhile: too cold to be worth writing
                self.skips["evicted"] += 1
                continue
            try:
                host, meta = to_host(b)
            except Exception as e:  # noqa: BLE001 - never the engine's failure
                self._fail("copy", e)
                continue
            with self._lock:
                self._queued.add(key)
            self._queue.put((key, b.parent, host, meta))
            copied += 1
        return copied

    def copy_after_step(self) -> int:
        """The few blocks a busy engine copies between two steps (engine thread)."""
        return self.copy_pending(COPIES_PER_STEP)

    def _fail(self, what: str, error: Exception) -> None:
        with self._lock:
            self.faults += 1
            warn, self._warned = not self._warned, True
        (log.warning if warn else log.debug)("disk cache: could not %s a block: %s", what, error)

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:  # close()
                self._queue.task_done()
                return
            key, parent, host, meta = job
            tmp = self.folder / _tmp_name(key.hex())
            if not self.budget_writes.take(sum(a.nbytes for a in host.values())):
                with self._lock:
                    self.skips["daily_budget"] += 1
                    self._queued.discard(key)
                self._queue.task_done()
                continue
            try:
                write_block(tmp, host, meta)
                size = tmp.stat().st_size
                if size > self.budget:
                    tmp.unlink()
                    continue
                os.replace(tmp, self._path(key, parent))
                with self._lock:
                    self._add(key, parent, size)
                    self.writes += 1
                    self.written_bytes += size
                    self._evict_over_budget()
            except Exception as e:  # noqa: BLE001 - a full disk must not stop the server
                try:
                    tmp.unlink(missing_ok=True)
                except OSError:
                    pass
                self._fail("write", e)
            finally:
                with self._lock:
                    self._queued.discard(key)
                self._queue.task_done()

    def _evict_over_budget(self) -> None:
        while self._index and self.bytes > self.budget:
            self._remove(next(iter(self._index))).unlink(missing_ok=True)
            self.evictions += 1

    def flush(self) -> None:
        """Write every block noted so far (engine thread)."""
        self.copy_pending(len(self._waiting), block=True)
        if self._writer.is_alive():
            self._queue.join()

    def close(self) -> None:
        """Write what is noted, then stop the writer thread (engine thread)."""
        if self._writer.is_alive():
            self.flush()
            self._queue.put(None)
            self._writer.join()

    # ---- read (engine thread) ----

    def children(self, parent: bytes | None, limit: int) -> list[bytes]:
        """Keys of the `limit` most recently used files whose parent is `parent` (None: first blocks)."""
        with self._lock:
            return list(itertools.islice(reversed(self._children.get(parent, {})), limit))

    def peek(self, key: bytes):
        """(token ids, extra) of a file from its header, unchecked (`load` checks), or None."""
        with self._lock:
            got, entry = self._peeks.get(key), self._index.get(key)
        if got is not None or entry is None:
            return got
        try:
            meta = peek_block(self._path(key, entry[1]))
            got = np.asarray(meta["token_ids"], dtype=np.int32), _extra(meta["extra"])
        except Exception:  # noqa: BLE001 - a read of it will say why, and drop it
            return None
        with self._lock:
            if key in self._index:
                self._peeks[key] = got
                while len(self._peeks) > PEEKS:
                    self._peeks.popitem(last=False)
        return got

    def load(self, key: bytes):
        """(parent, payload, num_tokens, token_ids, extra) of a block on disk, or None."""
        with self._lock:
            entry = self._index.get(key)
            if entry is None:
                return None
            parent = entry[1]
            self._index.move_to_end(key)
            self._children[parent].move_to_end(key)
        path = self._path(key, parent)
        try:
            arrays, meta = read_block(path)
            if meta.get("key") != key.hex() or meta.get("parent") != (parent.hex() if parent else ""):
                raise BadBlockFile("unreadable", "its key or parent is not the one its name says")
            payload = decode_payload(arrays, meta)
            token_ids = np.asarray(meta["token_ids"], dtype=np.int32)
            num_tokens = int(meta["num_tokens"])
        except FileNotFoundError:  # deleted by hand (or another server's eviction): forget it
            with self._lock:
                self._remove(key)
            return None
        except OSError as e:  # out of file handles, say: not the file's fault
            log.debug("disk cache: cannot read %s: %s", path.name, e)
            return None
        except Exception as e:  # noqa: BLE001 - the request runs uncached from here
            reason = e.reason if isinstance(e, BadBlockFile) else "unreadable"
            log.warning("disk cache: dropping %s (%s): %s", path.name, reason, e)
            with self._lock:
                self.dropped[reason] += 1
                self._remove(key)
            path.unlink(missing_ok=True)
            return None
        try:
            os.utime(path)  # recently used, across restarts too
        except OSError:
            pass
        self.reads += 1
        return parent, payload, num_tokens, token_ids, _extra(meta["extra"])

    def clear(self) -> None:
        """Delete every file, and forget what was waiting to be written (engine thread)."""
        self._waiting.clear()
        if self._writer.is_alive():
            self._queue.join()
        with self._lock:
            for key in list(self._index):
                self._remove(key).unlink(missing_ok=True)

    def stats(self) -> dict:
        with self._lock:
            return {"folder": str(self.folder), "blocks": len(self._index), "bytes": self.bytes,
                    "budget": self.budget, "reads": self.reads, "writes": self.writes,
                    "evictions": self.evictions, "faults": self.faults, "skipped": self.skipped,
                    "skipped_by_reason": dict(self.skips), "written_bytes": self.written_bytes,
                    "write_wait_s": round(self.budget_writes.waited_s, 3),
                    "waiting": len(self._waiting), "queued": len(self._queued),
                    "dropped": dict(self.dropped), "abandoned_tmp": self.abandoned}


def _extra(extra):
    return tuple(tuple(e) for e in extra) if extra else None


def _tmp_name(stem: str) -> str:
    return f"{stem}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def _abandoned(path: Path) -> bool:
    """Whether a temporary file's write can no longer finish: its writer, on this host, has
    exited (a crash: nothing else leaves one), or it is STALE_TMP_S old."""
    parts = path.name.split(".")
    try:
        if len(parts) >= 5 and parts[-4] == _HOST and not _alive(int(parts[-3])):
            return True
        return time.time() - path.stat().st_mtime > STALE_TMP_S
    except (ValueError, OSError):
        return False


def _alive(pid: int) -> bool:
    if pid <= 0:  # 0 and negatives would name process groups
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _parse_name(name: str):
    """(key, parent) of a block file's name; "old" for the name of a block written before
    checksums (its key alone); None for a file that is not a block."""
    parts = name[: -len(SUFFIX)].split(".")
    try:
        if len(parts) == 1 and len(parts[0]) == 64:
            bytes.fromhex(parts[0])
            return "old"
        if len(parts) == 2 and len(parts[0]) == 64 and (parts[1] == ROOT or len(parts[1]) == 64):
            return bytes.fromhex(parts[0]), None if parts[1] == ROOT else bytes.fromhex(parts[1])
    except ValueError:
        pass
    return None
