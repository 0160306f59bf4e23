# cython: language_level=3
"""Python face of the C ring (csrc/shmring.h).

Ring owns one mapping of the segment; SlotMemory exposes one slot's bytes
through the buffer protocol and keeps the Ring (hence the mapping) alive;
SlotLease is the consumer's SlotMemory for a READY slot and gives the slot
back to the ring when the last object viewing it is gone.  _check is the one
place where a C return code becomes a Python exception.
"""
import _thread
import gc
import os
import time

cimport cython

from cpython.buffer cimport PyBUF_WRITABLE
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport EAGAIN, EINTR, ESTALE, ETIMEDOUT
from libc.limits cimport INT_MAX
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy
from posix.stdlib cimport posix_memalign
from posix.types cimport pid_t
from posix.unistd cimport getpid as _getpid

FREE = SHMRING_FREE
CLAIMED = SHMRING_CLAIMED
READY = SHMRING_READY
READING = SHMRING_READING
MAX_SLOTS = SHMRING_MAX_SLOTS
MAX_WORKERS = SHMRING_MAX_WORKERS
WORKER_COUNTERS = SHMRING_WORKER_COUNTERS


cdef extern from "<pthread.h>":
    int pthread_atfork(void (*prepare)() noexcept nogil, void (*parent)() noexcept nogil,
                       void (*child)() noexcept nogil)

# This process's pid, kept by a fork handler: getpid() is a system call, and
# a lease asks whether it is this process's as it is acquired and as it dies,
# once a batch each (and an iterator before each batch: current_pid).
# (Every fork that can run Python runs the handlers.)
cdef pid_t _pid = _getpid()


cdef void _after_fork_in_child() noexcept nogil:
    global _pid
    _pid = _getpid()


pthread_atfork(NULL, NULL, _after_fork_in_child)


cdef inline pid_t _this_pid() noexcept nogil:
    return _pid


def current_pid():
    """This process's pid, as os.getpid() gives it, without its system call
    (kept by the fork handler above)."""
    return _pid


cdef int _check(int rc, str what) except -1:
    """Raise the OSError subclass that matches -rc (FileExistsError,
    PermissionError, ...), naming the operation that failed."""
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")
    return rc


ctypedef int (*create_fn)(const char *, uint32_t, uint64_t, shmring_t **) noexcept nogil


cdef Ring _create(create_fn create, str where, uint32_t nslots, uint64_t slot_bytes):
    cdef Ring ring = Ring.__new__(Ring)
    ring._owner = _this_pid()
    cdef bytes path = where.encode()
    cdef const char *cpath = path
    cdef int rc
    with nogil:
        rc = create(cpath, nslots, slot_bytes, &ring._r)
    _check(rc, f"creating a shared-memory ring at {where} ({nslots} x {slot_bytes} bytes)")
    return ring


@cython.no_gc_clear
cdef class Ring:
    cdef shmring_t *_r
    # Consumer-side policy hooks (see _cuda.py, and _poison.py for one-off
    # segments), None unless set:
    # release_hook(slot) is called instead of releasing a lease's slot (the
    # hook releases it later with release()); on_destroy() runs before the
    # mapping goes.
    cdef public object release_hook
    cdef public object on_destroy
    cdef pid_t _owner  # on_destroy runs only here, never in a forked child
    cdef set _held     # slots this process's live leases hold
    cdef set _private  # of those, the ones it holds a private copy of
    cdef bint _retired  # no worker writes it again: released slots give back their pages
    cdef object __weakref__

    def __cinit__(self):
        self._held = set()
        self._private = set()

    def __dealloc__(self):
        if self.on_destroy is not None and _this_pid() == self._owner:
            try:
                self.on_destroy()
            except Exception:
                pass  # the process is exiting or the device is gone: unmap anyway
        if self._r is not NULL:
            shmring_destroy(self._r)
            self._r = NULL

    @staticmethod
    def create_memfd(str name, uint32_t nslots, uint64_t slot_bytes):
        """A new mapped segment in anonymous memory, its size sealed (each
        slot reserved by its first writer); `name` labels it in /proc."""
        return _create(shmring_create_memfd, name, nslots, slot_bytes)

    @staticmethod
    def create_in(str directory, uint32_t nslots, uint64_t slot_bytes):
        """As create_memfd, where memfd_create is refused: an unnamed file in
        the tmpfs `directory`, which must have room for all of it now."""
        return _create(shmring_create_in, directory, nslots, slot_bytes)

    @staticmethod
    def attach(int fd, int efd):
        """Map a ring received as file descriptors; verifies owner and header."""
        cdef Ring ring = Ring.__new__(Ring)
        ring._owner = _this_pid()
        cdef int rc
        with nogil:
            rc = shmring_attach(fd, efd, &ring._r)
        _check(rc, "attaching shared-memory ring")
        return ring

    @property
    def owned_here(self):
        """Whether this process made or attached this ring; False in a child
        forked since, whose copy views its parent's slots and batches."""
        return _this_pid() == self._owner

    @property
    def nslots(self):
        return shmring_nslots(self._r)

    @property
    def slot_bytes(self):
        return shmring_slot_bytes(self._r)

    @property
    def total_bytes(self):
        return shmring_total_bytes(self._r)

    @property
    def data_address(self):
        """Address of slot 0's data in this process; all slots follow it."""
        return <size_t>shmring_slot_data(self._r, 0)

    @property
    def data_bytes(self):
        return <uint64_t>shmring_nslots(self._r) * shmring_slot_bytes(self._r)

    @property
    def fds(self):
        """(segment fd, eventfd), to be passed to producer processes."""
        return shmring_fd(self._r), shmring_eventfd(self._r)

    def close_fds(self):
        """Close this handle's fds (idempotent); the mapping stays."""
        shmring_close_fds(self._r)

    def slot_state(self, uint32_t slot):
        return _check(shmring_slot_state(self._r, slot), f"reading state of slot {slot}")

    def claim(self):
        """A FREE slot's index, now CLAIMED, or None when every slot is taken."""
        cdef uint32_t slot
        cdef int rc = shmring_claim(self._r, &slot)
        if rc == -EAGAIN:
            return None
        _check(rc, "claiming a slot")
        return slot

    def reserve(self, uint32_t slot):
        """Reserve `slot`'s pages before writing to it (once per slot, for
        every process): OSError (ENOSPC) when shared memory has no room."""
        cdef int rc
        with nogil:
            rc = shmring_reserve(self._r, slot)
        _check(rc, f"reserving the {shmring_slot_bytes(self._r)} bytes of slot {slot}")

    def reserve_all(self):
        """Reserve every slot's pages now (OSError if there is no room)."""
        cdef int rc
        with nogil:
            rc = shmring_reserve_all(self._r)
        _check(rc, "reserving the ring's shared memory")

    def publish(self, uint32_t slot, uint64_t seq, uint64_t meta_off, uint64_t meta_len):
        _check(shmring_publish(self._r, slot, seq, meta_off, meta_len),
               f"publishing slot {slot} (must be CLAIMED)")

    def abandon(self, uint32_t slot):
        _check(shmring_abandon(self._r, slot), f"abandoning slot {slot} (must be CLAIMED)")

    def acquire(self):
        """The lease of a READY slot (now READING), or None when none is ready."""
        cdef uint32_t slot
        cdef uint64_t seq, meta_off, meta_len
        cdef int rc = shmring_acquire(self._r, &slot, &seq, &meta_off, &meta_len)
        if rc == -EAGAIN:
            return None
        _check(rc, "acquiring a slot")
        cdef SlotLease lease = SlotLease.__new__(SlotLease)
        lease._bind(self, slot)
        lease._owner = _this_pid()
        self._held.add(slot)
        lease.seq = seq
        lease.meta_off = meta_off
        lease.meta_len = meta_len
        _check(shmring_slot_rows(self._r, slot, &lease.rows, &lease.failed_rows),
               f"reading the rows of slot {slot}")
        return lease

    def rows_begin(self, uint32_t slot, uint64_t seq, uint32_t nrows, uint32_t first_row=0):
        """Make CLAIMED `slot` a batch of `nrows` rows that producers fill
        (rows below first_row are already someone's)."""
        _check(shmring_rows_begin(self._r, slot, seq, nrows, first_row),
               f"starting rows of slot {slot} (must be CLAIMED, 0 <= first_row <= nrows)")

    def row_claim(self, uint32_t slot, uint64_t seq):
        """The next unclaimed row of batch `seq` in `slot`, or None when all are
        taken or the slot has moved on to another batch."""
        cdef uint32_t row
        cdef int rc = shmring_row_claim(self._r, slot, seq, &row)
        if rc == -EAGAIN or rc == -ESTALE:
            return None
        _check(rc, f"claiming a row of slot {slot}")
        return row

    def row_done(self, uint32_t slot, bint failed=False):
        """One row written (or failed); True when that published the slot."""
        return _check(shmring_row_done(self._r, slot, failed),
                      f"finishing a row of slot {slot}") == 1

    def count_free(self):
        return shmring_count_free(self._r)

    def worker_add(self, uint32_t worker, uint64_t a, uint64_t b, uint64_t c, uint64_t d):
        """Add to worker `worker`'s counters (ignored past MAX_WORKERS)."""
        cdef uint64_t add[SHMRING_WORKER_COUNTERS]
        if worker < SHMRING_MAX_WORKERS:
            add[0], add[1], add[2], add[3] = a, b, c, d
            _check(shmring_worker_add(self._r, worker, add), f"counting for worker {worker}")

    def worker_read(self, uint32_t worker):
        """Worker `worker`'s counters, a tuple (zeros past MAX_WORKERS)."""
        cdef uint64_t out[SHMRING_WORKER_COUNTERS]
        if worker >= SHMRING_MAX_WORKERS:
            return (0,) * SHMRING_WORKER_COUNTERS
        _check(shmring_worker_read(self._r, worker, out), f"reading worker {worker}'s counts")
        return tuple(out[i] for i in range(SHMRING_WORKER_COUNTERS))

    @property
    def poison(self):
        """The byte each slot's data is overwritten with when it is released,
        before it is FREE again; -1: none (see _poison.py)."""
        return shmring_poison(self._r)

    def set_poison(self, int byte, bint private_view=False):
        """Overwrite each released slot's data with `byte` (-1: stop);
        `private_view`: this process's view of it only (see shmring.h)."""
        _check(shmring_set_poison(self._r, byte, private_view), f"setting poison byte {byte}")

    def release(self, uint32_t slot):
        _check(self._give_back(slot), f"releasing slot {slot} (must be READING)")

    cdef int _give_back(self, uint32_t slot):
        """READING -> FREE, mapping the segment's slot back first if this
        process held a private copy of it.  If that fails the slot stays
        READING: this process could not see what a worker writes there."""
        self._held.discard(slot)
        cdef int rc
        if slot in self._private:
            rc = shmring_slot_share(self._r, slot)
            if rc < 0:
                return rc
            self._private.discard(slot)
        if shmring_poison(self._r) < 0:
            rc = shmring_release(self._r, slot)
        else:  # the slot's bytes overwritten first: no GIL held meanwhile
            with nogil:
                rc = shmring_release(self._r, slot)
        if rc == 0 and self._retired:
            shmring_slot_drop_pages(self._r, slot)  # memory only: nothing to report
        return rc

    def retire(self):
        """No worker will write this ring again (its loader is gone), but
        batches the user keeps may hold slots: give back the pages of the free
        slots now and of each held one when it is released, so a kept batch
        keeps its own slot's memory, not the whole ring's (and one fd: the
        wake-up eventfd goes).  Not for a ring pinned with CUDA (its
        registration covers the pages)."""
        if self.release_hook is not None or _this_pid() != self._owner:
            return
        self._retired = True
        shmring_close_wakeup(self._r)
        for slot in range(shmring_nslots(self._r)):
            if shmring_slot_state(self._r, slot) == SHMRING_FREE:
                _check(shmring_slot_drop_pages(self._r, slot),
                       f"giving back slot {slot}'s memory")

    def privatize_held(self):
        """Give this process a private copy of every slot its leases hold
        (see shmring_slot_privatize): called before a fork, so that a child
        keeps the batches it inherits, as with torch's shared memory, while
        their slots are reused here.  Not for a ring pinned with CUDA (its
        registration covers the shared pages)."""
        if self.release_hook is not None or _this_pid() != self._owner:
            return
        # No garbage collection meanwhile: it could release a lease whose
        # slot is on the list (FREE then, and refilled by a worker), which
        # would then be copied and read here as that batch.
        collecting = gc.isenabled()
        gc.disable()
        try:
            for slot in sorted(self._held - self._private):
                rc = shmring_slot_privatize(self._r, slot)
                # Failed, it may have left the slot partly private: its release
                # maps it back shared (harmless where nothing changed).
                self._private.add(slot)
                _check(rc, f"copying slot {slot} before a fork")
        finally:
            if collecting:
                gc.enable()

    def memory(self, uint32_t slot):
        """A writable buffer over slot `slot`'s data (producer side)."""
        if slot >= shmring_nslots(self._r):
            raise IndexError(f"slot {slot} out of range for a ring of {self.nslots}")
        cdef SlotMemory mem = SlotMemory.__new__(SlotMemory)
        mem._bind(self, slot)
        return mem

    def wait(self, timeout, fds=()):
        """Sleep until a slot may be READY, one of `fds` is readable (or hung
        up), or `timeout` seconds pass (None: forever).  Returns the list of
        `fds` that fired, or None on timeout.  Signals are handled between
        sleeps, so Ctrl-C raises KeyboardInterrupt here."""
        cdef int n = len(fds)
        cdef pollfd *pfds = <pollfd *>malloc(max(n, 1) * sizeof(pollfd))
        if pfds is NULL:
            raise MemoryError()
        cdef int i, rc, ms
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for i in range(n):
                pfds[i].fd = fds[i]
                pfds[i].events = POLLIN
            while True:
                if deadline is None:
                    ms = -1
                else:  # (a timeout beyond an int's milliseconds, 24.8 days, in parts)
                    ms = int(min(INT_MAX, max(0.0, (deadline - time.monotonic()) * 1000 + 0.999)))
                with nogil:
                    rc = shmring_wait(self._r, ms, pfds, n)
                if rc == -EINTR:
                    PyErr_CheckSignals()
                    continue
                if rc == -ETIMEDOUT:
                    if ms == INT_MAX:
                        continue
                    return None
                _check(rc, "waiting on the ring")
                return [fds[i] for i in range(n) if pfds[i].revents]
        finally:
            free(pfds)


@cython.no_gc_clear
cdef class SlotMemory:
    """One slot's bytes as a writable buffer; keeps its Ring mapped."""
    cdef readonly Ring ring
    cdef readonly uint32_t slot
    cdef char *_data
    cdef Py_ssize_t _size
    cdef Py_ssize_t _shape[1]

    cdef _bind(self, Ring ring, uint32_t slot):
        self.ring = ring
        self.slot = slot
        self._data = shmring_slot_data(ring._r, slot)
        self._size = <Py_ssize_t>shmring_slot_bytes(ring._r)
        self._shape[0] = self._size

    def __len__(self):
        return self._size

    def __getbuffer__(self, Py_buffer *view, int flags):
        view.buf = self._data
        view.obj = self
        view.len = self._size
        view.readonly = 0
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = self._shape
        view.strides = &view.itemsize
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer *view):
        pass

    def read(self, uint64_t offset, uint64_t length):
        """A bytes copy of [offset, offset + length), bounds-checked."""
        if offset > <uint64_t>self._size or length > <uint64_t>self._size - offset:
            raise ValueError(
                f"range [{offset}, {offset}+{length}) lies outside slot {self.slot} "
                f"of {self._size} bytes")
        return self._data[offset:offset + length]

    def leaf_capsule(self, uint64_t offset, uint64_t nbytes, uint8_t code, uint8_t bits,
                     tuple shape, tuple stride, bint copy):
        """A DLPack capsule of the leaf whose bytes are [offset, offset +
        nbytes) of this slot, of `shape` and `stride` (in elements; the
        caller checks they stay within those bytes): a view that keeps this
        object alive, or (copy) over a private, 64-byte aligned copy of the
        bytes, as torch's allocator aligns.  Bounds-checked on the slot's side."""
        if offset > <uint64_t>self._size or nbytes > <uint64_t>self._size - offset:
            raise ValueError(
                f"range [{offset}, {offset}+{nbytes}) lies outside slot {self.slot} "
                f"of {self._size} bytes")
        cdef Py_ssize_t i, ndim = len(shape)
        if len(stride) != ndim:
            raise ValueError(f"shape {shape} and stride {stride} differ in length")
        cdef size_t head = sizeof(DLManagedTensor) + 2 * ndim * sizeof(int64_t)
        head = (head + 63) & ~(<size_t>63)
        cdef void *block = NULL
        if posix_memalign(&block, 64, head + (nbytes if copy else 0)) != 0:
            raise MemoryError()
        cdef DLManagedTensor *m = <DLManagedTensor *>block
        m.manager_ctx = NULL
        m.deleter = _dl_delete
        m.dl_tensor.shape = <int64_t *>(<char *>block + sizeof(DLManagedTensor))
        m.dl_tensor.strides = m.dl_tensor.shape + ndim
        try:
            for i in range(ndim):
                m.dl_tensor.shape[i] = shape[i]
                m.dl_tensor.strides[i] = stride[i]
            capsule = PyCapsule_New(block, b"dltensor", _dl_capsule_gone)
        except BaseException:
            free(block)
            raise
        m.dl_tensor.device.device_type = 1
        m.dl_tensor.device.device_id = 0
        m.dl_tensor.ndim = <int32_t>ndim
        m.dl_tensor.dtype.code = code
        m.dl_tensor.dtype.bits = bits
        m.dl_tensor.dtype.lanes = 1
        m.dl_tensor.byte_offset = 0
        if copy:
            m.dl_tensor.data = <char *>block + head
            memcpy(m.dl_tensor.data, self._data + offset, nbytes)
        else:
            m.dl_tensor.data = self._data + offset
            Py_INCREF(self)
            m.manager_ctx = <void *>self
        return capsule

    def write(self, uint64_t offset, const unsigned char[::1] data):
        """Copy `data` to `offset`, bounds-checked."""
        cdef uint64_t n = data.shape[0]
        if offset > <uint64_t>self._size or n > <uint64_t>self._size - offset:
            raise ValueError(
                f"{n} bytes at offset {offset} do not fit slot {self.slot} "
                f"of {self._size} bytes")
        if n:
            memcpy(self._data + offset, &data[0], n)


# ---- DLPack: a leaf handed to torch in one call ------------------------------
# dlpack.h's ABI (unchanged since DLPack 0.5): the structs a "dltensor"
# capsule points to.  torch._C._from_dlpack makes a tensor of it in one call,
# where torch.frombuffer and Tensor.set_ take two (see _layout.py's NOTE
# [layout: one batch's decoding]); torch renames the capsule it takes and
# calls the deleter when the tensor's storage dies.

cdef extern from "Python.h":
    int Py_IsInitialized() nogil

ctypedef struct DLDevice:
    int32_t device_type  # 1: kDLCPU
    int32_t device_id

ctypedef struct DLDataType:
    uint8_t code
    uint8_t bits
    uint16_t lanes

ctypedef struct DLTensor:
    void *data
    DLDevice device
    int32_t ndim
    DLDataType dtype
    int64_t *shape
    int64_t *strides
    uint64_t byte_offset

ctypedef struct DLManagedTensor:
    DLTensor dl_tensor
    void *manager_ctx  # the SlotMemory a view keeps alive, or NULL for a copy
    void (*deleter)(DLManagedTensor *) noexcept nogil


cdef void _dl_delete(DLManagedTensor *m) noexcept nogil:
    # (A tensor may die after the interpreter: its slot is then gone too.)
    if m.manager_ctx != NULL and Py_IsInitialized():
        with gil:
            Py_DECREF(<object>m.manager_ctx)
    free(m)


cdef void _dl_capsule_gone(object capsule) noexcept:
    # Only a capsule torch never took still has its name.
    if PyCapsule_IsValid(capsule, b"dltensor"):
        _dl_delete(<DLManagedTensor *>PyCapsule_GetPointer(capsule, b"dltensor"))


@cython.no_gc_clear
cdef class SlotLease(SlotMemory):
    """A READY slot taken by the consumer.  Tensors built on it (through
    leaf_capsule, torch.frombuffer or numpy) hold it alive; when the last one dies, the slot
    goes back to the ring.  release() is idempotent.

    Only the process that acquired the slot gives it back: a forked child
    (a worker of another loader, say) inherits copies of the consumer's leases,
    and their deaths in the child must not free slots the consumer holds."""
    cdef readonly uint64_t seq
    cdef readonly uint64_t meta_off
    cdef readonly uint64_t meta_len
    cdef readonly uint32_t rows         # row-by-row batches: rows, and those
    cdef readonly uint32_t failed_rows  # whose sample raised
    cdef bint _released
    cdef pid_t _owner

    def meta(self):
        return self.read(self.meta_off, self.meta_len)

    def release(self):
        if not self._released and _this_pid() == self._owner:
            self._released = True
            if self.ring.release_hook is not None:
                self.ring.release_hook(self.slot)
            else:
                self.ring.release(self.slot)

    def __dealloc__(self):
        if not self._released and self.ring is not None and _this_pid() == self._owner:
            self._released = True
            if self.ring.release_hook is not None:
                try:
                    self.ring.release_hook(self.slot)
                    return
                except Exception:
                    pass  # the hook failed: give the slot back at once
                except KeyboardInterrupt:
                    # A Ctrl-C met in the hook's Python: raised out of a
                    # deallocation it would be printed and dropped, and the
                    # loop would go on.  It is delivered again, to the code
                    # this deallocation interrupted; the slot stays as the
                    # hook left it (released, or held until its ring goes).
                    _thread.interrupt_main()
                    return
            self.ring._give_back(self.slot)


def copy_stream(SlotMemory dst, uint64_t offset, uint64_t src, uint64_t n):
    """Copy n bytes from address `src` (a CPU tensor's data_ptr()) to
    `offset` in slot `dst`, bypassing the cache (see shmring_copy_stream)."""
    if offset > <uint64_t>dst._size or n > <uint64_t>dst._size - offset:
        raise ValueError(f"{n} bytes at offset {offset} do not fit slot {dst.slot}")
    with nogil:
        shmring_copy_stream(dst._data + offset, <const void *>src, n)
