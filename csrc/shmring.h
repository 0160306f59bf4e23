/*
 * shmring: a ring of fixed-size batch slots in one shared-memory segment.
 *
 * The C core knows bytes and ordering only: it creates, attaches and maps the
 * segment, moves slots through their states with C11 atomics, and sleeps in
 * the kernel until something happens.  Every function returns 0 (or a count)
 * on success and -errno on failure; it never prints, allocates Python objects
 * or decides policy (sizes, names, what to do on error).
 *
 * Segment layout (all offsets from the segment base, which mmap page-aligns):
 *
 *   0        struct shmring_header   magic, version, geometry, owner (64 bytes),
 *                                    consumer_sleeping (own cache line, 64 bytes)
 *   128      struct shmring_slot[n]  one 64-byte descriptor per slot
 *            struct shmring_worker[SHMRING_MAX_WORKERS]  64-byte counters each
 *   data_off slot 0 data             page-aligned, slot_bytes long
 *            slot 1 data             data_off + 1 * slot_bytes
 *            ...
 *   total    = data_off + nslots * slot_bytes   (slot_bytes is page-aligned)
 *
 * Slot states and who moves them (one consumer process, many producers):
 *
 *   FREE --claim (consumer)--> CLAIMED --publish (producer)--> READY
 *     ^  <--abandon (producer)--'                                |
 *     '------------release (consumer)-- READING <--acquire-------'
 *
 * Memory ordering.  A producer writes the slot's data and its descriptor
 * fields (seq, meta_off, meta_len) with plain stores, then publishes with a
 * seq_cst CAS on `state`; the consumer's acquire CAS that observes READY
 * synchronises with it, so every byte written before publish is visible after
 * acquire.  release/abandon store FREE with release order so the consumer's
 * next claim (acquire CAS) sees the slot's previous readers finished.
 *
 * Row-by-row batches (several producers fill one slot, a row each).  The
 * consumer claims the slot and sets its row count with rows_begin before any
 * producer hears of it.  Producers take rows (row_claim, a CAS on next_claim:
 * the next row tagged with the batch's seq, or rows the caller assigns
 * itself), write them, and call row_done: an acq_rel
 * fetch_add on rows_done, so the producer that completes the count has seen
 * every row and publishes the slot for all of them.
 *
 * Sleeping (an eventcount).  The consumer sets consumer_sleeping (seq_cst),
 * rechecks for READY slots, then poll()s the eventfd together with any fds the
 * caller adds (worker pipes, process sentinels: so a worker's death wakes it)
 * until a timeout.  A producer publishes (seq_cst), then loads
 * consumer_sleeping (seq_cst) and writes the eventfd only if it is set.  Both
 * sides store then load with seq_cst, so either the consumer's recheck sees
 * READY or the producer sees the flag and wakes it: no lost wake-up, and no
 * syscall per batch while the consumer is busy.
 */
#ifndef SHMRING_H
#define SHMRING_H

#include <poll.h>
#include <stdint.h>

#define SHMRING_MAGIC 0x474e49524d485321ULL /* "!SHMRING" little-endian */
#define SHMRING_VERSION 4u
#define SHMRING_MAX_SLOTS 4096u
#define SHMRING_MAX_WORKERS 256u    /* workers with counters; more still work, uncounted */
#define SHMRING_WORKER_COUNTERS 4   /* what each counts is the caller's business */

enum shmring_state {
    SHMRING_FREE = 0,
    SHMRING_CLAIMED = 1,
    SHMRING_READY = 2,
    SHMRING_READING = 3,
};

typedef struct shmring shmring_t; /* process-local handle, opaque */

/* Create a segment for `nslots` slots of at least `slot_bytes` each, map it,
 * and create the wake-up eventfd.  The header's pages are reserved now, a
 * slot's by its first writer (shmring_reserve).  The segment never has a
 * name anyone else could open or that a dying process could leave behind:
 * it lives on only in fds, this handle's and those passed to the producers.
 *   _memfd: anonymous memory (memfd_create; `name` only labels it in
 *           /proc/<pid>/fd), its size sealed (F_SEAL_SHRINK | F_SEAL_GROW),
 *           limited by memory alone;
 *   _in:    where memfd_create is refused, an unnamed file (O_TMPFILE) in
 *           the tmpfs directory `dir`, which must have room for all of it
 *           now (-ENOSPC if not). */
int shmring_create_memfd(const char *name, uint32_t nslots, uint64_t slot_bytes,
                         shmring_t **out);
int shmring_create_in(const char *dir, uint32_t nslots, uint64_t slot_bytes, shmring_t **out);

/* Map a segment received as an open fd (plus its eventfd).  Checks that the
 * file belongs to this user with no group/other access, and that magic,
 * version and geometry agree with the file size.  Takes ownership of neither
 * fd: the caller closes its copies. */
int shmring_attach(int fd, int efd, shmring_t **out);

/* Close the handle's fds (idempotent); the mapping stays until destroy. */
void shmring_close_fds(shmring_t *r);

/* Close the wake-up eventfd only (idempotent), for a ring no producer will
 * publish to again: shmring_wait then watches the caller's fds alone. */
void shmring_close_wakeup(shmring_t *r);

/* Unmap and free the handle. */
void shmring_destroy(shmring_t *r);

uint32_t shmring_nslots(const shmring_t *r);
uint64_t shmring_slot_bytes(const shmring_t *r);
uint64_t shmring_total_bytes(const shmring_t *r);
int shmring_fd(const shmring_t *r);
int shmring_eventfd(const shmring_t *r);
char *shmring_slot_data(const shmring_t *r, uint32_t slot);
int shmring_slot_state(const shmring_t *r, uint32_t slot);

/* Consumer: move a FREE slot to CLAIMED; -EAGAIN when none is free. */
int shmring_claim(shmring_t *r, uint32_t *slot);

/* Producer, before its first write to a slot: reserve the slot's pages
 * (posix_fallocate, once per slot for all processes), so that no write ever
 * lands on memory the kernel cannot supply (SIGBUS).  -ENOSPC when /dev/shm
 * (the fallback's) has filled up since the ring was made, -ENOMEM when
 * memory (the memory cgroup's) has run out. */
int shmring_reserve(shmring_t *r, uint32_t slot);

/* Consumer: reserve every slot's pages now (before pinning the whole ring). */
int shmring_reserve_all(shmring_t *r);

/* Producer: CLAIMED -> READY with the payload's sequence number and the
 * location of its metadata inside the slot; wakes a sleeping consumer. */
int shmring_publish(shmring_t *r, uint32_t slot, uint64_t seq, uint64_t meta_off,
                    uint64_t meta_len);

/* Producer: CLAIMED -> FREE, giving back a slot it will not fill. */
int shmring_abandon(shmring_t *r, uint32_t slot);

/* Consumer: take any READY slot (-> READING) and return what was published
 * with it; -EAGAIN when none is ready. */
int shmring_acquire(shmring_t *r, uint32_t *slot, uint64_t *seq, uint64_t *meta_off,
                    uint64_t *meta_len);

/* Consumer: READING -> FREE once nothing views the slot any more.  With a
 * poison byte set (shmring_set_poison) the slot's data bytes are overwritten
 * with it first, and only then is FREE stored (release order): no producer
 * can claim the slot before the pattern is complete, so a view of it that
 * escaped its lease reads the pattern, never the next batch.  Only data:
 * the header and the slot's descriptor are left alone; a slot whose pages
 * were never reserved holds no batch (and may have no memory behind it) and
 * is not written. */
int shmring_release(shmring_t *r, uint32_t slot);

/* Poison mode for this handle (process-local; no other process's handle is
 * affected): `byte` 0..255 is written over a slot's data at each release,
 * -1 (the default) turns it off.  `private_view`: overwrite this process's
 * view only, mapping fresh private memory filled with the byte over the
 * slot (for a segment no producer writes again, whose pages a forked child
 * may still map and keep); else the shared pages themselves.  -EINVAL for a
 * byte out of range. */
int shmring_set_poison(shmring_t *r, int byte, int private_view);
int shmring_poison(const shmring_t *r);

/* Consumer, before it forks: replace this process's mapping of a slot it
 * holds with a private copy of its bytes, at the same address, so that a
 * forked child keeps what it saw after the slot is reused.  The slot's state
 * is not touched.  shmring_slot_share maps the segment's slot back there
 * (before the slot is released: the next batch's bytes arrive through it). */
int shmring_slot_privatize(shmring_t *r, uint32_t slot);
int shmring_slot_share(shmring_t *r, uint32_t slot);

/* Consumer, for a ring no worker will write again: give a FREE slot's pages
 * back to the filesystem (its reservation goes with them).  -EBUSY if the
 * slot is not FREE. */
int shmring_slot_drop_pages(shmring_t *r, uint32_t slot);

/* Consumer: make a CLAIMED slot batch `seq` of `nrows` rows filled by
 * producers; rows below `first_row` (<= nrows) are someone's already
 * (row_claim starts there). */
int shmring_rows_begin(shmring_t *r, uint32_t slot, uint64_t seq, uint32_t nrows,
                       uint32_t first_row);

/* Producer: take the next unclaimed row of batch `seq` in its slot; -EAGAIN
 * when every row is taken, -ESTALE when the slot holds another batch now. */
int shmring_row_claim(shmring_t *r, uint32_t slot, uint64_t seq, uint32_t *row);

/* Producer: one row written (failed: its sample raised instead).  Returns 1
 * when it was the last row and the slot is now published, else 0. */
int shmring_row_done(shmring_t *r, uint32_t slot, int failed);

/* Consumer, after acquire: the row count and how many rows failed. */
int shmring_slot_rows(const shmring_t *r, uint32_t slot, uint32_t *nrows, uint32_t *failed);

/* How many slots are FREE now (a snapshot, for statistics). */
int shmring_count_free(const shmring_t *r);

/* Per-worker counters: add to them (producer) or read them (consumer). */
int shmring_worker_add(shmring_t *r, uint32_t worker, const uint64_t add[SHMRING_WORKER_COUNTERS]);
int shmring_worker_read(const shmring_t *r, uint32_t worker,
                        uint64_t out[SHMRING_WORKER_COUNTERS]);

/* Consumer: sleep until a slot may be READY, one of `fds` has an event, or
 * `timeout_ms` passes (-1: no timeout); with a slot READY already, return at
 * once.  Returns 0 on a wake-up (revents of `fds` are filled, in either case;
 * the caller then tries acquire and reads the fds that fired), -ETIMEDOUT, or
 * -EINTR when a signal arrived (the caller handles it and calls again).  Any
 * number of `fds` (two a worker): past a few dozen their array is allocated,
 * -ENOMEM if it cannot be; poll() itself refuses more than RLIMIT_NOFILE
 * (-EINVAL), more than the process can have open unless given one fd twice. */
int shmring_wait(shmring_t *r, int timeout_ms, struct pollfd *fds, int nfds);

/* Copy `n` bytes with non-temporal stores where the CPU has them (SSE2):
 * a batch is written once into a slot and read later by another process (or
 * a DMA engine), so caching it on the way only evicts the working sets of
 * every process sharing the cache, and each written line would first be read
 * (read-for-ownership).  The copy is complete and ordered (sfence) on return. */
void shmring_copy_stream(void *dst, const void *src, uint64_t n);

#endif
