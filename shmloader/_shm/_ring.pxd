# Mirrors csrc/shmring.h; nothing else belongs here.
from libc.stdint cimport uint32_t, uint64_t


cdef extern from "poll.h":
    struct pollfd:
        int fd
        short events
        short revents
    enum:
        POLLIN
        POLLERR
        POLLHUP


cdef extern from "shmring.h" nogil:
    ctypedef struct shmring_t:
        pass

    enum:
        SHMRING_FREE
        SHMRING_CLAIMED
        SHMRING_READY
        SHMRING_READING
        SHMRING_MAX_SLOTS
        SHMRING_MAX_WORKERS
        SHMRING_WORKER_COUNTERS

    int shmring_create_in(const char *dir, uint32_t nslots, uint64_t slot_bytes, shmring_t **out)
    int shmring_create_memfd(const char *name, uint32_t nslots, uint64_t slot_bytes, shmring_t **out)
    int shmring_attach(int fd, int efd, shmring_t **out)
    void shmring_close_fds(shmring_t *r)
    void shmring_close_wakeup(shmring_t *r)
    void shmring_destroy(shmring_t *r)
    uint32_t shmring_nslots(const shmring_t *r)
    uint64_t shmring_slot_bytes(const shmring_t *r)
    uint64_t shmring_total_bytes(const shmring_t *r)
    int shmring_fd(const shmring_t *r)
    int shmring_eventfd(const shmring_t *r)
    char *shmring_slot_data(const shmring_t *r, uint32_t slot)
    int shmring_slot_state(const shmring_t *r, uint32_t slot)
    int shmring_claim(shmring_t *r, uint32_t *slot)
    int shmring_reserve(shmring_t *r, uint32_t slot)
    int shmring_reserve_all(shmring_t *r)
    int shmring_publish(shmring_t *r, uint32_t slot, uint64_t seq, uint64_t meta_off, uint64_t meta_len)
    int shmring_abandon(shmring_t *r, uint32_t slot)
    int shmring_acquire(shmring_t *r, uint32_t *slot, uint64_t *seq, uint64_t *meta_off, uint64_t *meta_len)
    int shmring_release(shmring_t *r, uint32_t slot)
    int shmring_set_poison(shmring_t *r, int byte, int private_view)
    int shmring_poison(const shmring_t *r)
    int shmring_slot_privatize(shmring_t *r, uint32_t slot)
    int shmring_slot_share(shmring_t *r, uint32_t slot)
    int shmring_slot_drop_pages(shmring_t *r, uint32_t slot)
    int shmring_rows_begin(shmring_t *r, uint32_t slot, uint64_t seq, uint32_t nrows, uint32_t first_row)
    int shmring_row_claim(shmring_t *r, uint32_t slot, uint64_t seq, uint32_t *row)
    int shmring_row_done(shmring_t *r, uint32_t slot, int failed)
    int shmring_slot_rows(const shmring_t *r, uint32_t slot, uint32_t *nrows, uint32_t *failed)
    int shmring_count_free(const shmring_t *r)
    int shmring_worker_add(shmring_t *r, uint32_t worker, const uint64_t *add)
    int shmring_worker_read(const shmring_t *r, uint32_t worker, uint64_t *out)
    int shmring_wait(shmring_t *r, int timeout_ms, pollfd *fds, int nfds)
    void shmring_copy_stream(void *dst, const void *src, uint64_t n)
