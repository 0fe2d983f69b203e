"""The small shared file through which consumers tell a producer what they hold.

One file per producer process, named after its random token, in ``/dev/shm``
(or the temporary directory where that is missing). It starts with the
words that the producer's GPU writes when an export's work is done (see
``_words``), followed by one 16-byte record per export slot: ``export_id``
(u64), ``opens`` (u32), ``state`` (u32).

Liveness and "still in use" are open-file-description locks (Linux
``F_OFD_SETLK``), never counters alone, because the kernel drops a lock when
its holder dies: a consumer killed mid-read cannot leave memory pinned, and a
producer killed with SIGKILL is seen as gone at once.

- the producer holds a read lock on :data:`ALIVE` for its whole life;
- a consumer holds a read lock on ``in_use(slot)`` from open until its GPU work
  on the memory has finished (:meth:`Segment.hold`); the producer frees a slot
  only after marking it ``REVOKED`` and then seeing no lock there
  (:meth:`Segment.try_free`). A consumer checks the state only once it holds
  its lock, so either the producer sees the lock or the consumer sees the mark;
- a consumer counts its open in ``opens`` only once the open has succeeded
  (:meth:`Segment.count_open`), still holding the lock: an open that fails
  leaves no count, so the producer does not take it for one of the export's
  consumers and the open may be retried;
- ``mutex(slot)`` serialises the count of opens of an export that admits
  several consumers; one that admits a single consumer (``ONE_CONSUMER``) is
  counted without it, since any count above zero says the same.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import multiprocessing.util
import os
import stat
import struct
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Iterator

from ._errors import IpcError, ProducerExitedError, warn_quietly
from ._words import BYTES as _WORDS_BYTES

__all__ = ["Segment", "attach", "found_exited", "own_segment", "remove_stale", "segment_path", "when_exited",
           "FREE", "PINNED", "REVOKED", "ONE_CONSUMER", "READ", "WRITE"]

FREE, PINNED, REVOKED = 0, 1, 2
STATE = 0xFF  # the state's bits of a record's state field
ONE_CONSUMER = 0x100  # with PINNED: the export admits one consumer

_RECORD = struct.Struct("<QII")
MAX_OPENS = 0xFFFFFFFF  # a record's count of opens is a u32: an export admits at most as many consumers
_U32 = struct.Struct("<I")
_DATA_START = _WORDS_BYTES  # the records, after the words
_INITIAL_SLOTS = 1024
_LOCK_BASE = 1 << 40  # lock bytes live far past the data; locks need no backing bytes
ALIVE = _LOCK_BASE
_FLOCK = struct.Struct("hhqqi4x")  # struct flock on 64-bit Linux
READ, WRITE, _UNLOCK = fcntl.F_RDLCK, fcntl.F_WRLCK, fcntl.F_UNLCK
_ALIVE_QUERY = _FLOCK.pack(WRITE, os.SEEK_SET, ALIVE, 1, 0)  # held_by_other(ALIVE)'s argument
_OFD = hasattr(fcntl, "F_OFD_SETLK")


_PREFIX = "cupy_ipc-"
_NEW = ".new"  # a segment's file while it is set up
# A file being set up is unlocked from its creation until its producer locks it, microseconds later: one
# unlocked this long after it was made was left by a producer killed then. Generous, for a live producer
# stopped or starved meanwhile, whose export would fail if its file went.
_SETUP_ABANDONED_AFTER = 60.0  # s


def _dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def segment_path(token: bytes) -> str:
    """Where the producer with ``token`` keeps its segment."""
    return os.path.join(_dir(), f"{_PREFIX}{token.hex()}")


def remove_stale() -> int:
    """Remove the segments of producers that died without removing theirs; returns how many went.

    A producer removes its segment at exit, and a consumer removes one it
    finds dead, but when producer and consumers are all killed (a job
    cancelled, the out-of-memory killer) the file stays: in a container's
    small ``/dev/shm``, enough of them would leave no room for new ones. A
    file under a segment's name whose liveness lock nobody holds is such a
    leftover (see :meth:`Segment.create`), and so is a file still under the
    name a segment is set up under (``.new``) if unlocked and untouched for
    a minute: its producer was killed while it set it up. Files of other
    users cannot be opened here, and stay.

    Example:
        >>> import secrets
        >>> Segment.create(secrets.token_bytes(16)).close()   # its producer "died": the file stays
        >>> remove_stale() >= 1
        True
    """
    removed = 0
    now = time.time()  # (a file's time is the wall clock's)
    for entry in os.scandir(_dir()):
        name = entry.name.removesuffix(_NEW)
        try:
            token = bytes.fromhex(name.removeprefix(_PREFIX))  # (not a segment's name: ValueError)
            if len(token) != 16 or name != _PREFIX + token.hex():  # (a token is 16 bytes: _identity)
                continue
            # Not blocking, nor following a link: a FIFO under a segment's name (anyone can make one here) would
            # wait for a writer, and this process, its first export, for ever.
            flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW
            seg = Segment(os.open(entry.path, flags), token, entry.path, owner=False)
        except (ValueError, OSError):  # not a segment; another user's, or gone meanwhile
            continue
        try:
            st = os.fstat(seg.fd)
            if stat.S_ISREG(st.st_mode) and not seg.producer_alive() and (
                    name == entry.name or st.st_mtime < now - _SETUP_ABANDONED_AFTER):
                os.unlink(entry.path)
                removed += 1
        except OSError:
            pass
        finally:
            seg.close()
    return removed


def in_use(slot: int) -> int:
    return _LOCK_BASE + 1 + 2 * slot


def mutex(slot: int) -> int:
    return _LOCK_BASE + 2 + 2 * slot


class Segment:
    """An open segment file: the producer's own, or a consumer's view of one.

    Example:
        >>> import secrets
        >>> token = secrets.token_bytes(16)
        >>> seg = Segment.create(token)
        >>> seg.write(0, 7, PINNED)
        >>> seg.read(0)
        (7, 0, 1)
        >>> Segment.attach(token, pid=os.getpid()).producer_alive()
        True
        >>> seg.close(unlink=True)
    """

    def __init__(self, fd: int, token: bytes, path: str, *, owner: bool) -> None:
        self.fd = fd
        self.token = token  # the producer's
        self.path = path
        self.owner = owner  # only the producer grows its file
        self.mm: mmap.mmap | None = None  # a shared view of the records
        self.words: Any = None  # the words, mapped and registered with CUDA once needed (False: they cannot be)
        _every.add(self)

    @classmethod
    def create(cls, token: bytes) -> "Segment":
        if not _OFD:
            raise IpcError("cupy_ipc needs Linux open-file-description locks (F_OFD_SETLK)")
        path = segment_path(token)
        # Set up under another name, and given its own once its liveness lock is held: a file under a
        # segment's name without that lock is then always one whose producer has gone (see remove_stale).
        new = path + _NEW
        try:
            fd = os.open(new, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise IpcError(f"cannot create the segment {path}: {e.strerror}") from e
        seg = cls(fd, token, new, owner=True)
        # Unlinked if this fails, or every later export would find the file there and fail.
        with seg._closed_on_failure(f"set up the segment {path}", unlink=True):
            seg.lock(ALIVE, READ)
            seg._grow(_DATA_START + _INITIAL_SLOTS * _RECORD.size)
            seg._remap()
            try:
                os.link(seg.path, path)  # (a rename would replace a segment already there)
            except FileExistsError as e:
                raise IpcError(f"cannot create the segment {path}: {e.strerror}") from e
            except BaseException:
                # An interrupt raised as the link returns, the link made: the file would stay under the name,
                # and every later create of this process's segment (its token is for life) fail.
                seg._unlink_if_ours(path)
                raise
            seg.path = path
            os.unlink(new)
        return seg

    def _unlink_if_ours(self, path: str) -> None:
        """Remove ``path`` if it names this segment's file (not another's made there meanwhile)."""
        try:
            here, ours = os.stat(path, follow_symlinks=False), os.fstat(self.fd)
            if (here.st_dev, here.st_ino) == (ours.st_dev, ours.st_ino):
                os.unlink(path)
        except OSError:
            pass

    @contextlib.contextmanager
    def _closed_on_failure(self, what: str, *, unlink: bool = False) -> Iterator[None]:
        """Close (and ``unlink``) this segment if the block raises; an ``OSError`` becomes an :class:`IpcError`
        saying it could not ``what``."""
        try:
            yield
        except BaseException as e:
            self.close(unlink=unlink)
            if isinstance(e, OSError):
                raise IpcError(f"cannot {what}: {e.strerror}") from e
            raise

    def _grow(self, size: int) -> None:
        # Allocated, not only sized: a full /dev/shm then fails here with ENOSPC, where a sparse file would
        # kill the process with SIGBUS on its first write through the mapping.
        try:
            os.posix_fallocate(self.fd, 0, size)
        except OSError as e:
            raise IpcError(f"cannot grow the segment {self.path} to {size} bytes: {os.strerror(e.errno or 0)} "
                           f"(is {os.path.dirname(self.path)} full?)") from e

    def _remap(self) -> None:
        # The new view first: if mapping fails (no memory, or too many maps), the old one stays usable.
        size = os.fstat(self.fd).st_size
        old, self.mm = self.mm, mmap.mmap(self.fd, size) if size else None
        if old is not None:
            old.close()

    def _reach(self, at: int) -> bool:
        """Whether the mapped view covers the record at ``at``, growing or remapping it if needed.

        Raises:
            IpcError: The file could not grow, or its view could not be remapped (the old view stays).
        """
        if self.mm is not None and at + _RECORD.size <= len(self.mm):
            return True
        if self.owner:
            self._grow(2 * at + _RECORD.size)
        try:
            self._remap()
        except OSError as e:  # (create and attach, its other callers, say so in their own words)
            raise IpcError(f"cannot remap the segment {self.path}: {e.strerror}") from e
        return self.mm is not None and at + _RECORD.size <= len(self.mm)

    @classmethod
    def attach(cls, token: bytes, *, pid: int) -> "Segment":
        """Open another process's segment.

        Raises:
            ProducerExitedError: The producer has exited (its segment is gone).
        """
        path = segment_path(token)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)  # (a link there is anyone's: not ours)
        except FileNotFoundError:
            raise ProducerExitedError(
                f"the producer process (pid {pid}) has exited: its segment {path} is gone (or it was made where "
                "this process does not look: in another container that does not share /dev/shm, or in the "
                "temporary directory of a producer without a writable /dev/shm; see `python -m cupy_ipc doctor`)",
                pid=pid,
            ) from None
        except OSError as e:  # too many open files, say
            raise IpcError(f"cannot open the segment of the producer process (pid {pid}): {e.strerror}") from e
        seg = cls(fd, token, path, owner=False)
        with seg._closed_on_failure(f"map the segment of the producer process (pid {pid})"):
            seg._remap()
        return seg

    def close(self, *, unlink: bool = False) -> None:
        if self.fd < 0:
            return
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        fd, self.fd = self.fd, -1
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        words, self.words = self.words, None
        if words and not self.owner:
            # A consumer's, closed with the last claim or wait on this producer's memory, each held until the
            # stream work queued after it (a wait on a word among them) was done. The producer's own stay: its
            # GPU may still have writes to them queued (it closes its segment at exit).
            words.release()
        os.close(fd)

    def __del__(self) -> None:
        # A consumer's view of a producer that has gone is dropped from the
        # table, not closed: a thread may still be using it; the last user closes it.
        if getattr(self, "fd", -1) >= 0:
            try:
                self.close()
            except Exception:
                pass

    # --- locks -------------------------------------------------------------
    def lock(self, offset: int, kind: int, *, wait: bool = True) -> bool:
        """Take (or with ``F_UNLCK`` drop) a one-byte lock; False if ``wait`` is off and it is held."""
        cmd = fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK
        try:
            fcntl.fcntl(self.fd, cmd, _FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0))
        except (BlockingIOError, PermissionError):
            return False
        return True

    def unlock(self, offset: int) -> None:
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, _FLOCK.pack(_UNLOCK, os.SEEK_SET, offset, 1, 0))  # never waits

    def held_by_other(self, offset: int) -> bool:
        """Whether another open file holds a lock that conflicts with a write lock here."""
        got = fcntl.fcntl(self.fd, fcntl.F_OFD_GETLK, _FLOCK.pack(WRITE, os.SEEK_SET, offset, 1, 0))
        return _FLOCK.unpack(got)[0] != _UNLOCK

    def producer_alive(self) -> bool:
        return self.held_by_other(ALIVE)

    # --- records -----------------------------------------------------------
    def read(self, slot: int) -> tuple[int, int, int]:
        at = _DATA_START + slot * _RECORD.size
        if not self._reach(at):
            return 0, 0, FREE  # past the end: never written
        return _RECORD.unpack_from(self.mm, at)  # type: ignore[arg-type]

    def opens(self, slot: int) -> int:
        """The ``opens`` count of a slot."""
        at = _DATA_START + slot * _RECORD.size
        mm = self.mm
        if mm is not None and at + _RECORD.size <= len(mm):  # the common case, written out: every export
            return _U32.unpack_from(mm, at + 8)[0]
        return self.read(slot)[1]

    def write(self, slot: int, export_id: int, state: int, opens: int = 0) -> None:
        at = _DATA_START + slot * _RECORD.size
        if not self._reach(at):
            raise IpcError(f"slot {slot} lies past the end of the producer's segment {self.path}")
        _RECORD.pack_into(self.mm, at, export_id, opens, state)  # type: ignore[arg-type]

    # Consumers write only ``opens`` and the producer's revoke only ``state``:
    # neither can undo the other's write.
    def write_opens(self, slot: int, opens: int) -> None:
        _U32.pack_into(self.mm, _DATA_START + slot * _RECORD.size + 8, opens)  # type: ignore[arg-type]

    def write_state(self, slot: int, state: int) -> None:
        _U32.pack_into(self.mm, _DATA_START + slot * _RECORD.size + 12, state)  # type: ignore[arg-type]

    # --- the protocol --------------------------------------------------------
    def hold(self, slot: int, export_id: int) -> bool:
        """Consumer: hold ``slot``'s in-use lock if the slot still shares ``export_id``; False, holding nothing,
        if not. One lock call.

        Counts nothing: an open is counted (:meth:`count_open`) only once it
        has succeeded, so that one that fails leaves the export as it found
        it. Counted at once, a failed open would count as one of the
        export's consumers, and the producer could let the memory go before
        the open is retried. The caller must not hold the slot's lock
        already (for another export): a refusal drops it.
        """
        held = in_use(slot)
        at = _DATA_START + slot * _RECORD.size
        mm = self.mm
        if (mm is None or at + _RECORD.size > len(mm)) and not self._reach(at):
            return False  # past the end: never written
        mm = self.mm
        try:
            # self.lock(held, READ), written out: it runs on every open. No consumer takes a write lock there,
            # so it does not wait. In the try: an interrupt just after it must not leave it held.
            fcntl.fcntl(self.fd, fcntl.F_OFD_SETLKW, _FLOCK.pack(READ, os.SEEK_SET, held, 1, 0))
            seen, _, state = _RECORD.unpack_from(mm, at)  # type: ignore[arg-type]
            if seen == export_id and state & STATE == PINNED:
                # The id read again, after the state: the record is read a field at a time, and a read
                # preempted between the two could pair this export's id with the state the producer wrote for
                # the next export of the slot, once it saw no lock here and freed the slot (see try_free). A pin
                # writes the id before the state: a state read PINNED since is followed by another id.
                seen = _RECORD.unpack_from(mm, at)[0]  # type: ignore[arg-type]
        except BaseException:
            self.unlock(held)  # (not held by this process before: the caller's rule)
            raise
        if seen == export_id and state & STATE == PINNED:
            return True
        self.unlock(held)
        return False

    def count_open(self, slot: int) -> None:
        """Consumer, holding ``slot``'s in-use lock (:meth:`hold`): count an open of its export.

        Counted even if the export was revoked since the lock was taken: the
        producer frees the slot only once that lock goes. No lock call for an
        export that admits one consumer; two, through the slot's mutex, for
        one that admits several, whose count must be exact.
        """
        at = _DATA_START + slot * _RECORD.size
        mm = self.mm
        _, opens, state = _RECORD.unpack_from(mm, at)  # type: ignore[arg-type]
        if state & ONE_CONSUMER:
            _U32.pack_into(mm, at + 8, min(opens + 1, MAX_OPENS))  # type: ignore[arg-type]
            return
        try:
            # Locked in the try: an interrupt raised as the lock call returns, the lock taken, must not leave it
            # held, or every other consumer's count would wait for it (dropped untaken, it changes nothing).
            # At most as many as an export may admit (reopens count too): counted on, the count could only
            # wrap; all it tells then is that every consumer has opened.
            self.lock(mutex(slot), WRITE)
            self.write_opens(slot, min(self.opens(slot) + 1, MAX_OPENS))
        finally:
            self.unlock(mutex(slot))

    def try_free(self, slot: int) -> bool:
        """Producer: end new claims of ``slot``'s export, and free the slot if no consumer holds it.

        One lock call. Once marked, a slot that is still held stays marked until a later call frees it.
        """
        self.write_state(slot, REVOKED)
        got = fcntl.fcntl(self.fd, fcntl.F_OFD_GETLK, _FLOCK.pack(WRITE, os.SEEK_SET, in_use(slot), 1, 0))
        if _FLOCK.unpack(got)[0] != _UNLOCK:  # held_by_other(in_use(slot)), written out: every export
            return False
        _RECORD.pack_into(self.mm, _DATA_START + slot * _RECORD.size, 0, 0, FREE)  # type: ignore[arg-type]
        return True


# --- this process's own segment, and the segments of producers it opened from ---
# Every segment open here, in the tables or not (being set up, or dropped from them but still used): a forked
# child closes its copies of all of them, whose locks would otherwise outlive this process's death.
_every: "weakref.WeakSet[Segment]" = weakref.WeakSet()
_own: Segment | None = None
_attached: dict[bytes, Segment] = {}
_create_lock = threading.Lock()
_making: str | None = None  # the path of this process's segment while it is being created
_attaching: str | None = None  # the path of another's segment while this process opens it
_attach_lock = threading.Lock()
_PRUNE_FROM = 16  # segments attached before those of exited producers are looked for
_prune_at = _PRUNE_FROM


def _close_own_at_exit(seg: Segment) -> None:
    if seg is _own:  # not in a forked child, whose parent's segment this is
        seg.close(unlink=True)


# Removed at exit, after what multiprocessing does there: it joins this process's children and its queues'
# feeder threads, which may still open and send arrays meanwhile, and a consumer told then that we exited
# would be told wrong. Its finalizers run last of its exit work, lowest priority last (a queue's feeder is
# joined at -5), and also in its children, which end without running atexit's functions.
_EXIT_PRIORITY = -100


def own_segment(token: bytes) -> Segment:
    """This process's segment, created on first use and removed at exit."""
    global _own, _making
    if _own is None:
        with _create_lock:  # multiprocessing pickles on its own threads
            if _own is None:
                _making = segment_path(token)
                try:
                    seg = Segment.create(token)
                    multiprocessing.util.Finalize(None, _close_own_at_exit, args=(seg,),
                                                  exitpriority=_EXIT_PRIORITY)
                    _own = seg
                finally:
                    _making = None
                try:  # once a process, with ours in place: the leftovers of killed producers go
                    remove_stale()
                except OSError:
                    pass
    if _own.fd < 0:
        raise IpcError("this process is exiting, and no longer shares memory or events")
    return _own


def attach(token: bytes, pid: int) -> Segment:
    """The segment of a live producer, opened once per process.

    Raises:
        ProducerExitedError: The producer has exited; its stale file is removed.
    """
    global _attaching
    with _attach_lock:  # threads open handles concurrently
        seg = _attached.get(token)
        opened = seg is None
        if opened:
            _attaching = segment_path(token)
            try:
                seg = _attached[token] = Segment.attach(token, pid=pid)
            finally:
                _attaching = None
            if len(_attached) >= _prune_at:
                _prune()
        # seg.producer_alive(), written out: it runs on every open.
        if _FLOCK.unpack(fcntl.fcntl(seg.fd, fcntl.F_OFD_GETLK, _ALIVE_QUERY))[0] == _UNLOCK:
            _drop(token, seg)
            if opened:  # nobody else has it yet
                seg.close()
            raise ProducerExitedError(f"the producer process (pid {pid}) has exited", pid=pid)
    return seg


# What other tables keep of a producer (the ordering events opened from its handles) and let go of once
# it is seen to have exited: functions of its token.
_on_exit: list[Callable[[bytes], None]] = []


def when_exited(forget: Callable[[bytes], None]) -> None:
    """Have ``forget(token)`` called whenever a producer is found to have exited."""
    _on_exit.append(forget)


def found_exited(seg: Segment) -> None:
    """``seg``'s producer was found to have exited by another table that keeps it (an idle mapping's): forget
    the producer as :func:`attach` does when it finds one gone."""
    with _attach_lock:
        if _attached.get(seg.token) is seg:  # (else a prune or an attach dropped it already)
            _drop(seg.token, seg)


def _drop(token: bytes, seg: Segment) -> None:
    # Out of the table and its stale file removed; the descriptors close with
    # the last reference (a claim, or a thread between attach and claim).
    _attached.pop(token, None)  # (a prune may have dropped it already)
    try:
        os.unlink(seg.path)
    except OSError:
        pass
    for forget in _on_exit:
        try:
            forget(token)
        except Exception as e:  # the caller is reporting the exit: that must not fail
            warn_quietly(f"could not let go of what was kept of an exited producer: {e}")


def _prune() -> None:
    """Forget the segments of producers that have exited, so that a long-lived consumer of many short-lived
    producers keeps no descriptors for them; looked for again once the table has doubled (amortized)."""
    global _prune_at
    for token, seg in list(_attached.items()):
        if not seg.producer_alive():
            _drop(token, seg)
    _prune_at = max(_PRUNE_FROM, 2 * len(_attached))


def _forget_after_fork() -> None:
    # The child shares the parent's open file descriptions: keeping them would
    # make the parent look alive after it died. Closing our copies drops no lock.
    global _own, _making, _attaching, _create_lock, _attach_lock, _prune_at
    _create_lock = threading.Lock()  # another thread may have held one at the fork
    _attach_lock = threading.Lock()
    for seg in list(_every):
        words, seg.words = seg.words, None  # the parent's registration with CUDA: no CUDA call here
        if words:  # its view holds a descriptor of its own (mmap's copy), which would keep the file open
            try:
                words.mm.close()
            except (BufferError, ValueError):  # (a view of it still exported: it goes with its last user)
                pass
        try:
            seg.close()  # our copies (descriptors, and views, which keep the open file too), never used again
        except Exception:  # noqa: BLE001 - the others must still be closed
            pass
    for path in (_making, _attaching):
        if path is not None:
            # Another thread was creating our segment, or opening another's: a descriptor not yet a segment's,
            # whose locks (our liveness, a consumer's in-use) would outlive the parent's death.
            _close_copies_of(path)
    _making = _attaching = None
    _own = None
    _attached.clear()
    _prune_at = _PRUNE_FROM


def _close_copies_of(path: str) -> None:
    """Close this process's descriptors of the file at ``path`` (or of a segment's there, set up under its
    other name: see :meth:`Segment.create`)."""
    target = os.path.realpath(path)
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") in (target, target + _NEW):
                os.close(int(name))
        except OSError:  # closed meanwhile, or the listing's own descriptor
            pass


os.register_at_fork(after_in_child=_forget_after_fork)
