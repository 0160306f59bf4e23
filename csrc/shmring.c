/* The shared-memory batch ring: layout, states and memory ordering are drawn
 * in shmring.h. */
#define _GNU_SOURCE
#include "shmring.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define CACHE_LINE 64

struct shmring_header {
    _Atomic uint64_t magic;
    uint32_t version;
    uint32_t nslots;
    uint64_t slot_bytes;  /* page-aligned */
    uint64_t data_off;    /* page-aligned offset of slot 0's data */
    uint64_t total_bytes; /* data_off + nslots * slot_bytes */
    uint32_t owner_uid;
    uint32_t header_bytes; /* sizeof(struct shmring_header): a layout check */
    char pad0[CACHE_LINE - 6 * 8];
    /* Written by the consumer, read by every producer on publish: its own
     * cache line so producers' slot writes do not bounce it. */
    _Atomic uint32_t consumer_sleeping;
    char pad1[CACHE_LINE - 4];
};

struct shmring_slot {
    _Atomic uint32_t state; /* enum shmring_state */
    uint32_t nrows;         /* rows of a batch filled row by row (rows_begin) */
    uint64_t seq;           /* written by the producer before publish */
    uint64_t meta_off;      /* idem: where the metadata lies inside the slot */
    uint64_t meta_len;
    /* Row-by-row batches: set by the consumer in rows_begin while CLAIMED,
     * before it tells any producer about the slot. */
    /* The next unclaimed row (low 32 bits) of the batch whose seq's low 32
     * bits are the high ones: a CAS by producers (row_claim).  The tag makes
     * a late producer's CAS fail once the slot holds a later batch. */
    _Atomic uint64_t next_claim;
    _Atomic uint32_t rows_done;   /* fetch_add (acq_rel) by producers per row written */
    _Atomic uint32_t rows_failed; /* rows whose sample raised instead */
    /* 1 once the slot's pages are reserved (shmring_reserve): a hint that
     * spares later writers the syscall; any of them may set it. */
    _Atomic uint32_t reserved;
    char pad1[CACHE_LINE - 5 * 8 - 3 * 4];
};

/* Per-worker counters, added to by that worker (relaxed: totals only). */
struct shmring_worker {
    _Atomic uint64_t counters[SHMRING_WORKER_COUNTERS];
    char pad[CACHE_LINE - SHMRING_WORKER_COUNTERS * 8];
};

_Static_assert(sizeof(struct shmring_header) == 2 * CACHE_LINE, "header layout");
_Static_assert(sizeof(struct shmring_slot) == CACHE_LINE, "slot layout");
_Static_assert(sizeof(struct shmring_worker) == CACHE_LINE, "worker layout");

struct shmring {
    char *base;
    uint64_t map_bytes;
    int fd;
    int efd;
    struct shmring_header *hdr;
    struct shmring_slot *slots;
    struct shmring_worker *workers;
    int poison;       /* byte written over a slot's data at release, -1: none */
    int poison_view;  /* 1: over this process's view only (shmring_set_poison) */
};

static uint64_t round_up(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

static uint64_t page_size(void) { return (uint64_t)sysconf(_SC_PAGESIZE); }

static uint64_t workers_offset(uint32_t nslots) {
    return sizeof(struct shmring_header) + (uint64_t)nslots * sizeof(struct shmring_slot);
}

static uint64_t data_offset(uint32_t nslots) {
    return round_up(workers_offset(nslots) + SHMRING_MAX_WORKERS * sizeof(struct shmring_worker),
                    page_size());
}

/* Map fd and fill the handle.  No MAP_POPULATE: on tmpfs populating
 * allocates and zeroes every page, some 30 ms per 80 MB on the path to the
 * first batch.  A slot's pages are reserved by its first writer (see
 * shmring_reserve), and each process faults a page in once, the first time
 * it touches it; from then on no batch pays a page fault. */
static int map_segment(int fd, int efd, uint64_t bytes, shmring_t **out) {
    shmring_t *r = calloc(1, sizeof(*r));
    if (!r) return -ENOMEM;
    void *base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        int err = errno;
        free(r);
        return -err;
    }
    r->base = base;
    r->map_bytes = bytes;
    r->fd = fd;
    r->efd = efd;
    r->hdr = (struct shmring_header *)base;
    r->slots = (struct shmring_slot *)(r->base + sizeof(struct shmring_header));
    r->workers = NULL; /* set once the geometry is known (init or attach) */
    r->poison = -1;
    *out = r;
    return 0;
}

/* Size, reserve, map and initialise a new segment in `fd` (which it owns:
 * closed on failure); `seal`: fix its size for good (a memfd). */
static int init_segment(int fd, int seal, uint32_t nslots, uint64_t slot_bytes,
                        shmring_t **out);

int shmring_create_memfd(const char *name, uint32_t nslots, uint64_t slot_bytes,
                         shmring_t **out) {
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return -errno;
    /* A memfd is made 0777; producers' attach refuses any group/other access. */
    if (fchmod(fd, 0600) != 0) {
        int err = errno;
        close(fd);
        return -err;
    }
    return init_segment(fd, 1, nslots, slot_bytes, out);
}

int shmring_create_in(const char *dir, uint32_t nslots, uint64_t slot_bytes, shmring_t **out) {
    int fd = open(dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) return -errno;
    return init_segment(fd, 0, nslots, slot_bytes, out);
}

static int init_segment(int fd, int seal, uint32_t nslots, uint64_t slot_bytes,
                        shmring_t **out) {
    uint64_t data_off = data_offset(nslots);
    uint64_t total = 0;
    if (nslots == 0 || nslots > SHMRING_MAX_SLOTS || slot_bytes == 0) {
        close(fd);
        return -EINVAL;
    }
    if (slot_bytes > UINT64_MAX - page_size()) { /* round_up would wrap */
        close(fd);
        return -EOVERFLOW;
    }
    uint64_t slot = round_up(slot_bytes, page_size());
    if (slot > (UINT64_MAX - data_off) / nslots ||
        (total = data_off + (uint64_t)nslots * slot) > (uint64_t)INT64_MAX) {
        close(fd);
        return -EOVERFLOW;
    }
    int err = 0;
    int efd = -1;
    struct statvfs fs;
    if (ftruncate(fd, (off_t)total) != 0) {
        err = errno;
        goto fail;
    }
    /* No process holding the fd may change the size under the others: a
     * shrink would be a SIGBUS in whoever touches the lost pages. */
    if (seal && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        err = errno;
        goto fail;
    }
    /* The header now; each slot's data when it is first written (by the
     * producer, shmring_reserve).  Reserving all of it here zeroed some 20 ms
     * per 80 MB of pages before the first batch could be written, on cores
     * the workers need.  The room for all of it must be free now, though: a
     * too-small /dev/shm fails here.  (A memfd's filesystem has no size,
     * f_blocks 0: memory alone limits it, which the caller checks.) */
    if (fstatvfs(fd, &fs) != 0) {
        err = errno;
        goto fail;
    }
    if (fs.f_blocks != 0 && (uint64_t)fs.f_bavail < (total - data_off) / fs.f_frsize + 1) {
        err = ENOSPC;
        goto fail;
    }
    /* posix_fallocate returns the error instead of setting errno. */
    err = posix_fallocate(fd, 0, (off_t)data_off);
    if (err) goto fail;
    efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (efd < 0) {
        err = errno;
        goto fail;
    }
    err = -map_segment(fd, efd, total, out);
    if (err) goto fail;

    struct shmring_header *h = (*out)->hdr;
    h->version = SHMRING_VERSION;
    h->nslots = nslots;
    h->slot_bytes = slot;
    h->data_off = data_off;
    h->total_bytes = total;
    h->owner_uid = (uint32_t)geteuid();
    h->header_bytes = sizeof(struct shmring_header);
    atomic_init(&h->consumer_sleeping, 0);
    for (uint32_t i = 0; i < nslots; i++) {
        atomic_init(&(*out)->slots[i].state, SHMRING_FREE);
        atomic_init(&(*out)->slots[i].reserved, 0);
    }
    (*out)->workers = (struct shmring_worker *)((*out)->base + workers_offset(nslots));
    /* The magic goes last, with release order: an attacher that sees it sees
     * a complete header. */
    atomic_store_explicit(&h->magic, SHMRING_MAGIC, memory_order_release);
    return 0;

fail:
    if (efd >= 0) close(efd);
    close(fd);
    return -err;
}

int shmring_attach(int fd, int efd, shmring_t **out) {
    struct stat st;
    if (fstat(fd, &st) != 0) return -errno;
    if (st.st_uid != geteuid() || (st.st_mode & 077) != 0) return -EPERM;
    if ((uint64_t)st.st_size < sizeof(struct shmring_header)) return -EBADMSG;

    int myfd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (myfd < 0) return -errno;
    int myefd = fcntl(efd, F_DUPFD_CLOEXEC, 0);
    if (myefd < 0) {
        int err = errno;
        close(myfd);
        return -err;
    }
    int err = -map_segment(myfd, myefd, (uint64_t)st.st_size, out);
    if (err) {
        close(myfd);
        close(myefd);
        return -err;
    }
    const struct shmring_header *h = (*out)->hdr;
    uint64_t magic = atomic_load_explicit(&h->magic, memory_order_acquire);
    if (magic != SHMRING_MAGIC || h->header_bytes != sizeof(struct shmring_header))
        err = EBADMSG;
    else if (h->version != SHMRING_VERSION)
        err = EPROTO;
    else if (h->owner_uid != (uint32_t)geteuid())
        err = EPERM;
    else if (h->nslots == 0 || h->nslots > SHMRING_MAX_SLOTS ||
             h->data_off != data_offset(h->nslots) || h->slot_bytes % page_size() != 0 ||
             h->total_bytes != (uint64_t)st.st_size ||
             h->data_off + (uint64_t)h->nslots * h->slot_bytes != h->total_bytes)
        err = EBADMSG;
    if (err) {
        shmring_close_fds(*out);
        shmring_destroy(*out);
        *out = NULL;
        return -err;
    }
    (*out)->workers = (struct shmring_worker *)((*out)->base + workers_offset(h->nslots));
    return 0;
}

void shmring_close_fds(shmring_t *r) {
    if (r->fd >= 0) close(r->fd);
    if (r->efd >= 0) close(r->efd);
    r->fd = -1;
    r->efd = -1;
}

void shmring_close_wakeup(shmring_t *r) {
    if (r->efd >= 0) close(r->efd);
    r->efd = -1;
}

void shmring_destroy(shmring_t *r) {
    shmring_close_fds(r);
    munmap(r->base, r->map_bytes);
    free(r);
}

uint32_t shmring_nslots(const shmring_t *r) { return r->hdr->nslots; }
uint64_t shmring_slot_bytes(const shmring_t *r) { return r->hdr->slot_bytes; }
uint64_t shmring_total_bytes(const shmring_t *r) { return r->hdr->total_bytes; }
int shmring_fd(const shmring_t *r) { return r->fd; }
int shmring_eventfd(const shmring_t *r) { return r->efd; }

char *shmring_slot_data(const shmring_t *r, uint32_t slot) {
    return r->base + r->hdr->data_off + (uint64_t)slot * r->hdr->slot_bytes;
}

int shmring_slot_state(const shmring_t *r, uint32_t slot) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    return (int)atomic_load_explicit(&r->slots[slot].state, memory_order_acquire);
}

/* Move `slot` from `from` to `to`; -EINVAL for a bad index, -EBUSY when the
 * slot is not in `from` (a protocol error the caller reports). */
static int transition(shmring_t *r, uint32_t slot, uint32_t from, uint32_t to,
                      memory_order success) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    uint32_t expected = from;
    if (!atomic_compare_exchange_strong_explicit(&r->slots[slot].state, &expected, to, success,
                                                 memory_order_relaxed))
        return -EBUSY;
    return 0;
}

int shmring_reserve(shmring_t *r, uint32_t slot) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    struct shmring_slot *s = &r->slots[slot];
    if (atomic_load_explicit(&s->reserved, memory_order_acquire)) return 0;
    uint64_t offset = r->hdr->data_off + (uint64_t)slot * r->hdr->slot_bytes;
    int err = posix_fallocate(r->fd, (off_t)offset, (off_t)r->hdr->slot_bytes);
    if (err) return -err;
    atomic_store_explicit(&s->reserved, 1, memory_order_release);
    return 0;
}

int shmring_claim(shmring_t *r, uint32_t *slot) {
    for (uint32_t i = 0; i < r->hdr->nslots; i++) {
        if (transition(r, i, SHMRING_FREE, SHMRING_CLAIMED, memory_order_acquire) == 0) {
            *slot = i;
            return 0;
        }
    }
    return -EAGAIN;
}

int shmring_reserve_all(shmring_t *r) {
    for (uint32_t i = 0; i < r->hdr->nslots; i++) {
        int rc = shmring_reserve(r, i);
        if (rc) return rc;
    }
    return 0;
}

int shmring_publish(shmring_t *r, uint32_t slot, uint64_t seq, uint64_t meta_off,
                    uint64_t meta_len) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    if (meta_off > r->hdr->slot_bytes || meta_len > r->hdr->slot_bytes - meta_off)
        return -ERANGE;
    struct shmring_slot *s = &r->slots[slot];
    /* A publish out of turn (the slot not this producer's) is refused before
     * it writes anything: a READY batch's descriptor stays as published. */
    if (atomic_load_explicit(&s->state, memory_order_acquire) != SHMRING_CLAIMED) return -EBUSY;
    s->seq = seq;
    s->meta_off = meta_off;
    s->meta_len = meta_len;
    int rc = transition(r, slot, SHMRING_CLAIMED, SHMRING_READY, memory_order_seq_cst);
    if (rc) return rc;
    if (atomic_load_explicit(&r->hdr->consumer_sleeping, memory_order_seq_cst)) {
        uint64_t one = 1;
        /* EAGAIN means the counter is saturated: the consumer is woken anyway. */
        if (write(r->efd, &one, sizeof(one)) < 0 && errno != EAGAIN) return -errno;
    }
    return 0;
}

#define CLAIM_ROW_MASK 0xffffffffull

/* A pause between a producer's look at next_claim and its CAS, where it may
 * be descheduled while the slot is done and begun again: only a test defines
 * it (tests/c/row_claim_race.c), to stop there on purpose. */
#ifdef SHMRING_ROW_CAS_PAUSE
void SHMRING_ROW_CAS_PAUSE(void);
#define row_cas_pause() SHMRING_ROW_CAS_PAUSE()
#else
#define row_cas_pause() ((void)0)
#endif

/* next_claim's tag for batch `seq`: its low 32 bits, above the row. */
static uint64_t claim_tag(uint64_t seq) { return (seq & CLAIM_ROW_MASK) << 32; }

int shmring_rows_begin(shmring_t *r, uint32_t slot, uint64_t seq, uint32_t nrows,
                       uint32_t first_row) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    if (nrows == 0 || first_row > nrows) return -EINVAL;
    struct shmring_slot *s = &r->slots[slot];
    if (atomic_load_explicit(&s->state, memory_order_acquire) != SHMRING_CLAIMED) return -EBUSY;
    s->seq = seq;
    s->nrows = nrows;
    s->meta_off = 0;
    s->meta_len = 0;
    atomic_store_explicit(&s->rows_failed, 0, memory_order_relaxed);
    atomic_store_explicit(&s->rows_done, 0, memory_order_relaxed);
    /* Last, with release: a producer whose acquire load of next_claim sees
     * this value sees this batch's nrows too (see row_claim). */
    atomic_store_explicit(&s->next_claim, claim_tag(seq) | first_row, memory_order_release);
    return 0;
}

int shmring_row_claim(shmring_t *r, uint32_t slot, uint64_t seq, uint32_t *row) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    struct shmring_slot *s = &r->slots[slot];
    uint64_t tag = claim_tag(seq);
    uint64_t claim = atomic_load_explicit(&s->next_claim, memory_order_acquire);
    /* A producer late to batch `seq` may find the slot done and begun again
     * for a later batch, at any moment up to its CAS: every try compares the
     * tag, so it takes no row of that batch (the tag would repeat only after
     * 2^32 batches).  A CAS loop rather than fetch_add also keeps the row
     * from running past nrows however often claims are retried. */
    do {
        if ((claim & ~CLAIM_ROW_MASK) != tag) return -ESTALE;
        if ((uint32_t)claim >= s->nrows) return -EAGAIN;
        row_cas_pause();
    } while (!atomic_compare_exchange_weak_explicit(&s->next_claim, &claim, claim + 1,
                                                    memory_order_acquire, memory_order_acquire));
    *row = (uint32_t)claim;
    return 0;
}

int shmring_row_done(shmring_t *r, uint32_t slot, int failed) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    struct shmring_slot *s = &r->slots[slot];
    if (failed) atomic_fetch_add_explicit(&s->rows_failed, 1, memory_order_relaxed);
    /* acq_rel: the producer that writes the last row sees every other row's
     * bytes, and its seq_cst publish passes them all on to the consumer. */
    uint32_t done = atomic_fetch_add_explicit(&s->rows_done, 1, memory_order_acq_rel) + 1;
    if (done > s->nrows) return -ERANGE;
    if (done < s->nrows) return 0;
    int rc = shmring_publish(r, slot, s->seq, 0, 0);
    return rc ? rc : 1;
}

int shmring_slot_rows(const shmring_t *r, uint32_t slot, uint32_t *nrows, uint32_t *failed) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    const struct shmring_slot *s = &r->slots[slot];
    *nrows = s->nrows;
    *failed = atomic_load_explicit(&s->rows_failed, memory_order_relaxed);
    return 0;
}

int shmring_count_free(const shmring_t *r) {
    int n = 0;
    for (uint32_t i = 0; i < r->hdr->nslots; i++)
        n += atomic_load_explicit(&r->slots[i].state, memory_order_relaxed) == SHMRING_FREE;
    return n;
}

int shmring_worker_add(shmring_t *r, uint32_t worker, const uint64_t add[SHMRING_WORKER_COUNTERS]) {
    if (worker >= SHMRING_MAX_WORKERS) return -EINVAL;
    for (int i = 0; i < SHMRING_WORKER_COUNTERS; i++)
        if (add[i]) atomic_fetch_add_explicit(&r->workers[worker].counters[i], add[i],
                                              memory_order_relaxed);
    return 0;
}

int shmring_worker_read(const shmring_t *r, uint32_t worker, uint64_t out[SHMRING_WORKER_COUNTERS]) {
    if (worker >= SHMRING_MAX_WORKERS) return -EINVAL;
    for (int i = 0; i < SHMRING_WORKER_COUNTERS; i++)
        out[i] = atomic_load_explicit(&r->workers[worker].counters[i], memory_order_relaxed);
    return 0;
}

int shmring_abandon(shmring_t *r, uint32_t slot) {
    return transition(r, slot, SHMRING_CLAIMED, SHMRING_FREE, memory_order_release);
}

int shmring_acquire(shmring_t *r, uint32_t *slot, uint64_t *seq, uint64_t *meta_off,
                    uint64_t *meta_len) {
    for (uint32_t i = 0; i < r->hdr->nslots; i++) {
        if (transition(r, i, SHMRING_READY, SHMRING_READING, memory_order_acquire) == 0) {
            const struct shmring_slot *s = &r->slots[i];
            *slot = i;
            *seq = s->seq;
            *meta_off = s->meta_off;
            *meta_len = s->meta_len;
            return 0;
        }
    }
    return -EAGAIN;
}

/* Poison mode: `slot`'s data overwritten with r->poison (see shmring.h). */
static int poison_slot(shmring_t *r, uint32_t slot) {
    struct shmring_slot *s = &r->slots[slot];
    /* Only a slot this consumer holds: in any other state the bytes are
     * someone else's (the release below reports the error).  Relaxed: the
     * state is READING only by this process's own acquire. */
    if (atomic_load_explicit(&s->state, memory_order_relaxed) != SHMRING_READING) return 0;
    /* Never written (no batch in it) or its pages dropped (they read as
     * zeros): nothing to hide, and no memory reserved to write on. */
    if (!atomic_load_explicit(&s->reserved, memory_order_acquire)) return 0;
    char *data = shmring_slot_data(r, slot);
    uint64_t n = r->hdr->slot_bytes;
    if (r->poison_view &&
        mmap(data, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
            MAP_FAILED)
        return -errno; /* the view as it was: the slot stays READING */
    memset(data, r->poison, n);
    return 0;
}

int shmring_release(shmring_t *r, uint32_t slot) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    if (r->poison >= 0) {
        int rc = poison_slot(r, slot);
        if (rc) return rc;
    }
    /* Release order: the pattern is complete before any claim sees FREE. */
    return transition(r, slot, SHMRING_READING, SHMRING_FREE, memory_order_release);
}

int shmring_set_poison(shmring_t *r, int byte, int private_view) {
    if (byte < -1 || byte > 255) return -EINVAL;
    r->poison = byte;
    r->poison_view = private_view != 0;
    return 0;
}

int shmring_poison(const shmring_t *r) { return r->poison; }

int shmring_slot_privatize(shmring_t *r, uint32_t slot) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    char *data = shmring_slot_data(r, slot);
    uint64_t n = r->hdr->slot_bytes;
    uint64_t offset = r->hdr->data_off + (uint64_t)slot * n;
    /* A copy-on-write mapping of the slot's own pages, moved over the slot's
     * range in one step (no moment where the address holds nothing), then
     * every page copied by the kernel.  No byte is copied by this thread: a
     * write another thread makes meanwhile lands in the shared page before
     * the move (and is read through the new mapping) or in the private page
     * after it, never in a copy taken too early. */
    void *cow = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE, r->fd, (off_t)offset);
    if (cow == MAP_FAILED) return -errno;
    if (mremap(cow, n, n, MREMAP_MAYMOVE | MREMAP_FIXED, data) == MAP_FAILED) {
        int err = errno;
        munmap(cow, n);
        return -err;
    }
    if (madvise(data, n, MADV_POPULATE_WRITE) != 0) {
        if (errno != EINVAL) {
            /* Some pages not copied would show the slot's next batch: the
             * shared mapping back, and the error (the caller holds no copy). */
            int err = errno;
            shmring_slot_share(r, slot);
            return -err;
        }
        /* Kernels before 5.14: a write of nothing to each page (an atomic
         * add of 0 cannot undo another thread's store) makes its copy. */
        long page = sysconf(_SC_PAGESIZE);
        for (uint64_t at = 0; at < n; at += (uint64_t)page)
            atomic_fetch_add_explicit((_Atomic char *)(data + at), 0, memory_order_relaxed);
    }
    return 0;
}

int shmring_slot_share(shmring_t *r, uint32_t slot) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    uint64_t offset = r->hdr->data_off + (uint64_t)slot * r->hdr->slot_bytes;
    if (mmap(shmring_slot_data(r, slot), r->hdr->slot_bytes, PROT_READ | PROT_WRITE,
             MAP_SHARED | MAP_FIXED, r->fd, (off_t)offset) == MAP_FAILED)
        return -errno;
    return 0;
}

int shmring_slot_drop_pages(shmring_t *r, uint32_t slot) {
    if (slot >= r->hdr->nslots) return -EINVAL;
    struct shmring_slot *s = &r->slots[slot];
    if (atomic_load_explicit(&s->state, memory_order_acquire) != SHMRING_FREE) return -EBUSY;
    uint64_t offset = r->hdr->data_off + (uint64_t)slot * r->hdr->slot_bytes;
    atomic_store_explicit(&s->reserved, 0, memory_order_release);
    if (fallocate(r->fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)offset,
                  (off_t)r->hdr->slot_bytes) != 0)
        return -errno;
    return 0;
}

static int any_ready(const shmring_t *r) {
    for (uint32_t i = 0; i < r->hdr->nslots; i++)
        if (atomic_load_explicit(&r->slots[i].state, memory_order_seq_cst) == SHMRING_READY)
            return 1;
    return 0;
}

/* The eventfd and the caller's fds in one array for poll(): on the stack for
 * up to this many (a loader of up to 31 workers), on the heap for more, so the
 * count has no cap of its own; poll() refuses more than RLIMIT_NOFILE. */
#define WAIT_STACK_FDS 64

int shmring_wait(shmring_t *r, int timeout_ms, struct pollfd *fds, int nfds) {
    if (nfds < 0 || nfds == INT_MAX) return -EINVAL;
    struct pollfd on_stack[WAIT_STACK_FDS];
    struct pollfd *all = on_stack;
    if (nfds + 1 > WAIT_STACK_FDS) {
        all = malloc(((size_t)nfds + 1) * sizeof(struct pollfd));
        if (all == NULL) return -ENOMEM;
    }
    all[0].fd = r->efd;
    all[0].events = POLLIN;
    all[0].revents = 0;
    for (int i = 0; i < nfds; i++) {
        all[i + 1] = fds[i];
        all[i + 1].revents = 0;
    }
    atomic_store_explicit(&r->hdr->consumer_sleeping, 1, memory_order_seq_cst);
    int rc = 0;
    /* With a slot READY already, no sleep, but still a look at the fds: a
     * caller waiting for a pipe message must not spin past a READY slot. */
    int ready = any_ready(r);
    int n = poll(all, (nfds_t)nfds + 1, ready ? 0 : timeout_ms);
    if (n < 0)
        rc = -errno;
    else if (n == 0 && !ready)
        rc = -ETIMEDOUT;
    atomic_store_explicit(&r->hdr->consumer_sleeping, 0, memory_order_relaxed);
    if (all[0].revents & POLLIN) {
        uint64_t drained;
        /* Non-blocking: another wake-up may have drained it already. */
        if (read(r->efd, &drained, sizeof(drained)) < 0 && errno != EAGAIN) rc = -errno;
    }
    for (int i = 0; i < nfds; i++) fds[i].revents = all[i + 1].revents;
    if (all != on_stack) free(all);
    return rc;
}

void shmring_copy_stream(void *dst, const void *src, uint64_t n) {
#ifdef __SSE2__
    char *d = dst;
    const char *s = src;
    uint64_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (n < 256 || head > n) {
        memcpy(d, s, n);
        return;
    }
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)d, a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
    }
    memcpy(d, s, n);
    _mm_sfence();
#else
    memcpy(dst, src, n);
#endif
}
