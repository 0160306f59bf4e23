/*
 * ring_stress: a standalone stress test of the C ring (csrc/shmring.c), meant
 * to be built plain and under sanitizers (tests/robustness/test_sanitizers.py does both).
 *
 *   gcc -std=c11 -O2 -Icsrc tests/c/ring_stress.c csrc/shmring.c -pthread -o ring_stress
 *   ./ring_stress [-r process_rounds] [-t thread_rounds] [-p producers] [-n threads]
 *                 [-s seed] [-c copies]
 *
 * Phases (each prints one line; the program exits 1 at the first mismatch):
 *
 *  1. copy     shmring_copy_stream against memcpy: random sizes (around the
 *              256-byte threshold and the 64-byte blocks, up to 64 KiB), random
 *              source and destination alignments; guard bytes on both sides of
 *              the destination must stay untouched.
 *  2. api      state-machine errors, wait: timeout (0 ms and 50 ms: not cut
 *              short), wake on a readable fd, return when a slot is READY
 *              (with no timeout: a wait that sleeps on is cut short by an alarm
 *              and fails, never a clock reading, which a loaded machine
 *              stretches), -EINTR on a signal, -EINVAL on a negative nfds; publish
 *              with nobody sleeping must not write the eventfd; attach sees
 *              the same bytes.
 *  3. procs    the ring's contract: ONE consumer process (this one) claims,
 *              acquires, releases and waits; several producer processes, forked
 *              and attached through the inherited fds (shmring_attach), publish
 *              or abandon.  Each producer process runs 2 threads; each thread
 *              fills and publishes only the slots the consumer hands it over
 *              its own task pipe.  Payloads are a seeded PRNG fill of a seeded
 *              size; a meta record (seq, size, FNV-1a hash) is written at a
 *              seeded offset before publish.  The consumer checks every payload
 *              on acquire, keeps some leases a while (as a user keeping
 *              batches) and checks them again on release (a READING slot must
 *              never change), then scribbles over the slot.  About 3% of tasks
 *              are abandoned; the producer says so over its process's note
 *              pipe, which shmring_wait also watches.  Random nanosleep /
 *              sched_yield on both sides vary who sleeps when.  A wait that
 *              runs out its timeout while a slot published in its first half
 *              is READY is reported as a lost wake-up (the meta record carries
 *              the time just before publish; the wait is long, so that a
 *              producer held off the CPU between the two cannot pass for one).
 *  4. death    one producer kills itself (SIGKILL) while the consumer sleeps in
 *              shmring_wait on a pipe whose write end only that producer held:
 *              the wait must wake with POLLHUP.  Another is killed by the
 *              consumer while it sleeps on the producer's pidfd: the wait must
 *              wake with POLLIN.  The others exit 0 when their task pipes close.
 *  5. threads  the same protocol with producer threads inside the consumer's
 *              process, all on the consumer's own mapping.  ThreadSanitizer
 *              does not follow memory shared between processes (each process
 *              has its own shadow; the other side of every hand-off in phase 3
 *              is invisible to it), so this is the phase where TSan actually
 *              checks the header's memory-ordering claims: the producer's plain
 *              stores (data, seq, meta_off, meta_len) before publish, read by
 *              the consumer after acquire, and the consumer's reads and
 *              scribbles before release, followed by a producer's writes after
 *              the next claim (handed over through a pipe, which TSan models
 *              as a happens-before edge).  Running producers as threads of the
 *              consumer process keeps the contract (one consumer process;
 *              producers only publish/abandon).  About half of the releases
 *              happen in a second thread of the consumer process (a batch's
 *              last view may die in any of its threads), so the release ->
 *              claim ordering is checked too: that thread's reads and
 *              scribbles of a slot must happen before the next producer's
 *              writes into it.
 *
 * In phase 3 a slot always goes to thread (slot % 2) of whichever producer
 * process the consumer picks: slots still move between processes, but within
 * one process a slot is only ever written by one thread, since the
 * synchronisation that orders two threads' writes to the same slot goes
 * through the consumer process, which TSan cannot see (it would report a
 * false race).  Phase 5 hands any slot to any thread.
 */
#define _GNU_SOURCE
#include "shmring.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NSLOTS 8u
#define SLOT_BYTES 16384u
#define META_ROOM 512u /* after the payload: alignment gap + meta record */
#define THREADS_PER_PROC 2
#define MAX_PRODUCERS 8
#define MAX_THREADS 8
/* The consumer's wait, long next to any pause a loaded machine gives a producer between
 * stamping a slot's time and publishing it (a lost wake-up is a slot published in the
 * first half of a wait that ran out). */
#define WAIT_MS 20000
#define STALL_LIMIT 6 /* consecutive empty WAIT_MS waits before calling it a hang */
/* Bounds on what must happen (a wake-up on a death, a release), generous: they catch hangs,
 * and measure nothing. */
#define HANG_MS 60000
#define META_MAGIC 0x4154454d53534552ULL /* "RESSMETA" */

enum { CMD_FILL = 0, CMD_HOLD_DIE = 1 };
enum { NOTE_ABANDONED = 1, NOTE_ERROR = 2, NOTE_RELEASED = 3 };

struct task {
    uint64_t seq;
    uint32_t slot;
    uint32_t cmd; /* CMD_FILL; CMD_HOLD_DIE: write into `slot`, then SIGKILL self */
};

struct note {
    uint64_t seq;
    uint32_t slot;
    uint32_t kind;
    int32_t err; /* NOTE_ERROR: the -errno or a line number */
    uint32_t who;
};

struct meta {
    uint64_t magic;
    uint64_t seq;
    uint64_t size;
    uint64_t hash;
    uint32_t producer;
    uint32_t thread;
    int64_t published_ns; /* CLOCK_MONOTONIC just before publish: lost wake-up evidence */
};

static uint64_t g_seed = 0x5eed;

/* ------------------------------------------------------------------ util */

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ring_stress: FAIL [pid %d]: ", (int)getpid());
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fflush(stderr);
    exit(1);
}

#define CHECK(cond, ...)                          \
    do {                                          \
        if (!(cond)) fail(__VA_ARGS__);           \
    } while (0)

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static uint64_t fnv1a(const unsigned char *p, uint64_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (uint64_t i = 0; i < n; i++) {
        h ^= p[i];
        h *= 0x100000001b3ULL;
    }
    return h;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void jitter(uint64_t *rng) {
    uint64_t r = splitmix(rng) % 64;
    if (r == 0) {
        struct timespec ts = {0, (long)(splitmix(rng) % 50000)}; /* < 50 us */
        nanosleep(&ts, NULL);
    } else if (r < 4) {
        sched_yield();
    }
}

static void fill_bytes(unsigned char *p, uint64_t n, uint64_t seed) {
    uint64_t s = seed;
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = splitmix(&s);
        memcpy(p + i, &v, 8);
    }
    if (i < n) {
        uint64_t v = splitmix(&s);
        memcpy(p + i, &v, n - i);
    }
}

/* What seq's payload looks like: size, where its meta record goes, PRNG seed. */
struct plan {
    uint64_t size, meta_off, fill_seed;
};

static struct plan plan_for(uint64_t seq) {
    uint64_t s = g_seed ^ (seq * 0xd1b54a32d192ed03ULL);
    struct plan p;
    uint64_t kind = splitmix(&s) % 8;
    uint64_t max = SLOT_BYTES - META_ROOM;
    if (kind == 0)
        p.size = splitmix(&s) % 16; /* tiny, including empty */
    else if (kind < 3)
        p.size = 200 + splitmix(&s) % 120; /* around copy_stream's 256-byte threshold */
    else
        p.size = 1 + splitmix(&s) % max;
    p.meta_off = (p.size + 7) / 8 * 8 + (splitmix(&s) % 32) * 8;
    p.fill_seed = splitmix(&s);
    return p;
}

static int set_nonblock(int fd) {
    int fl = fcntl(fd, F_GETFL);
    return fl < 0 ? -1 : fcntl(fd, F_SETFL, fl | O_NONBLOCK);
}

static int write_full(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* 1 on a whole struct, 0 on EOF, -errno on error. */
static int read_full(int fd, void *buf, size_t n) {
    char *p = buf;
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, p + got, n - got);
        if (r < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (r == 0) return got ? -EPIPE : 0;
        got += (size_t)r;
    }
    return 1;
}

/* ----------------------------------------------------------- 1. copy_stream */

static void phase_copy(int iters) {
    enum { MAXN = 65536, PAD = 128 };
    unsigned char *src = malloc(MAXN + PAD);
    unsigned char *dst = malloc(MAXN + 2 * PAD);
    CHECK(src && dst, "malloc");
    uint64_t rng = g_seed ^ 0xc0b1;
    fill_bytes(src, MAXN + PAD, splitmix(&rng));
    static const uint64_t edges[] = {0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 257, 271, 272,
                                     319, 320, 321, 4095, 4096, 4097, 65535 - 64};
    for (int it = 0; it < iters; it++) {
        uint64_t n;
        uint64_t pick = splitmix(&rng) % 8;
        if (it < (int)(sizeof(edges) / sizeof(edges[0])) * 4)
            n = edges[it / 4];
        else if (pick < 3)
            n = splitmix(&rng) % 400;
        else if (pick < 7)
            n = splitmix(&rng) % 5000;
        else
            n = splitmix(&rng) % (MAXN - 64);
        uint64_t da = splitmix(&rng) % 64, sa = splitmix(&rng) % 64;
        unsigned char guard = (unsigned char)(0x5a ^ it);
        memset(dst, guard, MAXN + 2 * PAD);
        shmring_copy_stream(dst + PAD + da, src + sa, n);
        CHECK(memcmp(dst + PAD + da, src + sa, n) == 0,
              "copy_stream(n=%" PRIu64 ", dst align %" PRIu64 ", src align %" PRIu64
              ") differs from memcpy",
              n, da, sa);
        for (uint64_t i = 0; i < PAD + da; i++)
            CHECK(dst[i] == guard, "copy_stream(n=%" PRIu64 ", dst align %" PRIu64
                  ") wrote %" PRIu64 " bytes before dst", n, da, PAD + da - i);
        for (uint64_t i = PAD + da + n; i < MAXN + 2 * PAD; i++)
            CHECK(dst[i] == guard, "copy_stream(n=%" PRIu64 ", dst align %" PRIu64
                  ") wrote past the end (byte %" PRIu64 " after)", n, da, i - (PAD + da + n));
    }
    /* Exact-size heap buffers: under ASan any access past either end is a report. */
    for (int it = 0; it < 200; it++) {
        uint64_t n = splitmix(&rng) % 3000;
        unsigned char *a = malloc(n ? n : 1), *b = malloc(n ? n : 1);
        CHECK(a && b, "malloc");
        fill_bytes(a, n, it);
        shmring_copy_stream(b, a, n);
        CHECK(memcmp(a, b, n) == 0, "copy_stream exact-size n=%" PRIu64, n);
        free(a);
        free(b);
    }
    free(src);
    free(dst);
    printf("ring_stress: copy: %d random copies against memcpy OK\n", iters);
}

/* ------------------------------------------------------------------ 2. api */

static void on_alarm(int sig) { (void)sig; }

/* SIGALRM (on_alarm: it only interrupts a wait) in `ms`, then every `ms`, or never (0). */
static void alarm_every(int ms) {
    struct itimerval itv = {{ms / 1000, (ms % 1000) * 1000}, {ms / 1000, (ms % 1000) * 1000}};
    CHECK(setitimer(ITIMER_REAL, &itv, NULL) == 0, "setitimer: %s", strerror(errno));
}

static void phase_api(void) {
    shmring_t *r;
    int rc = shmring_create_in("/dev/shm", 4, 10000, &r);
    CHECK(rc == 0, "shmring_create_in: %s", strerror(-rc));
    uint32_t n = shmring_nslots(r);
    CHECK(n == 4, "nslots %u", n);
    CHECK(shmring_slot_bytes(r) % (uint64_t)sysconf(_SC_PAGESIZE) == 0 &&
              shmring_slot_bytes(r) >= 10000,
          "slot_bytes %" PRIu64, shmring_slot_bytes(r));
    CHECK(shmring_total_bytes(r) >= 4 * shmring_slot_bytes(r), "total");
    uint64_t sb = shmring_slot_bytes(r);

    /* protocol errors */
    CHECK(shmring_publish(r, 0, 1, 0, 0) == -EBUSY, "publish FREE slot");
    CHECK(shmring_release(r, 0) == -EBUSY, "release FREE slot");
    CHECK(shmring_abandon(r, 0) == -EBUSY, "abandon FREE slot");
    CHECK(shmring_publish(r, n, 1, 0, 0) == -EINVAL, "publish bad index");
    CHECK(shmring_slot_state(r, n) == -EINVAL, "state bad index");
    uint32_t s, s2;
    uint64_t seq, mo, ml;
    CHECK(shmring_acquire(r, &s, &seq, &mo, &ml) == -EAGAIN, "acquire empty ring");
    CHECK(shmring_claim(r, &s) == 0, "claim");
    CHECK(shmring_publish(r, s, 1, sb - 2, 10) == -ERANGE, "meta past slot end");
    CHECK(shmring_publish(r, s, 1, sb + 1, 0) == -ERANGE, "meta_off past slot end");
    CHECK(shmring_publish(r, s, 1, 8, UINT64_MAX) == -ERANGE, "meta_len overflow");
    CHECK(shmring_slot_state(r, s) == SHMRING_CLAIMED, "state after failed publish");
    CHECK(shmring_release(r, s) == -EBUSY, "release CLAIMED");

    /* publish with nobody sleeping: no eventfd write (no syscall per batch) */
    memcpy(shmring_slot_data(r, s) + 100, "meta", 4);
    CHECK(shmring_publish(r, s, 42, 100, 4) == 0, "publish");
    uint64_t cnt;
    CHECK(read(shmring_eventfd(r), &cnt, 8) < 0 && errno == EAGAIN,
          "publish with no sleeping consumer wrote the eventfd");
    CHECK(shmring_publish(r, s, 42, 100, 4) == -EBUSY, "double publish");

    /* Alarms cut short a wait that sleeps on where it must not (and interrupt below). */
    struct sigaction sa, old;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_alarm;
    sigemptyset(&sa.sa_mask);
    CHECK(sigaction(SIGALRM, &sa, &old) == 0, "sigaction");

    /* wait returns at once while a slot is READY: with no timeout, else the alarm ends it */
    alarm_every(HANG_MS);
    rc = shmring_wait(r, -1, NULL, 0);
    alarm_every(0);
    CHECK(rc == 0, "wait with a READY slot: rc %d (it slept)", rc);
    CHECK(shmring_acquire(r, &s2, &seq, &mo, &ml) == 0 && s2 == s && seq == 42 && mo == 100 &&
              ml == 4,
          "acquire returned slot %u seq %" PRIu64, s2, seq);
    CHECK(memcmp(shmring_slot_data(r, s) + mo, "meta", 4) == 0, "meta bytes");
    CHECK(shmring_release(r, s) == 0 && shmring_release(r, s) == -EBUSY, "release twice");

    /* claim until exhausted */
    uint32_t got[4];
    for (int i = 0; i < 4; i++) CHECK(shmring_claim(r, &got[i]) == 0, "claim %d", i);
    CHECK(shmring_claim(r, &s) == -EAGAIN, "claim on a full ring");
    for (int i = 0; i < 4; i++) CHECK(shmring_abandon(r, got[i]) == 0, "abandon %d", i);

    /* timeouts (not cut short; how much longer a loaded machine makes them says nothing) */
    rc = shmring_wait(r, 0, NULL, 0);
    CHECK(rc == -ETIMEDOUT, "wait(0): rc %d", rc);
    double t0 = now_ms();
    rc = shmring_wait(r, 50, NULL, 0);
    double dt = now_ms() - t0;
    CHECK(rc == -ETIMEDOUT && dt >= 45, "wait(50 ms): rc %d after %.1f ms", rc, dt);

    /* an fd that fires */
    int p[2];
    CHECK(pipe(p) == 0, "pipe");
    struct pollfd pf = {.fd = p[0], .events = POLLIN, .revents = 0x7fff};
    rc = shmring_wait(r, 30, &pf, 1);
    CHECK(rc == -ETIMEDOUT && pf.revents == 0, "wait on a silent fd: rc %d revents %#x", rc,
          pf.revents);
    CHECK(write(p[1], "x", 1) == 1, "write");
    alarm_every(HANG_MS); /* no timeout: a wait not woken by the fd is cut short */
    rc = shmring_wait(r, -1, &pf, 1);
    alarm_every(0);
    CHECK(rc == 0 && (pf.revents & POLLIN), "wait on a readable fd: rc %d revents %#x", rc,
          pf.revents);
    close(p[1]);
    char c;
    CHECK(read(p[0], &c, 1) == 1, "read");
    rc = shmring_wait(r, 5000, &pf, 1);
    CHECK(rc == 0 && (pf.revents & POLLHUP), "wait on a hung-up pipe: rc %d revents %#x", rc,
          pf.revents);
    close(p[0]);

    /* bad nfds; any number of fds else (beyond 64 the pollfd array is allocated) */
    CHECK(shmring_wait(r, 0, NULL, -1) == -EINVAL, "nfds -1");
    struct pollfd *many = calloc(1500, sizeof(*many));
    CHECK(many, "calloc");
    for (int i = 0; i < 1500; i++) many[i].fd = -1;
    CHECK(shmring_wait(r, 0, many, 64) == -ETIMEDOUT, "nfds 64 of ignored fds");
    struct rlimit files;  /* (poll itself refuses more fds than RLIMIT_NOFILE) */
    CHECK(getrlimit(RLIMIT_NOFILE, &files) == 0, "getrlimit");
    if (files.rlim_cur < 1500 && files.rlim_max >= 1500) {
        files.rlim_cur = 1500;
        CHECK(setrlimit(RLIMIT_NOFILE, &files) == 0, "setrlimit");
    }
    if (files.rlim_cur >= 1500)
        CHECK(shmring_wait(r, 0, many, 1500) == -ETIMEDOUT, "nfds 1500 of ignored fds");
    free(many);

    /* a signal interrupts the wait: -EINTR (poll is never restarted).  The alarm repeats:
     * one that fires before the wait sleeps (a loaded machine) leaves the next to it. */
    alarm_every(30);
    rc = shmring_wait(r, 5000, NULL, 0);
    alarm_every(0);
    CHECK(rc == -EINTR, "wait interrupted by SIGALRM: rc %d", rc);
    sigaction(SIGALRM, &old, NULL);

    /* attach through the fds sees the same bytes and states */
    shmring_t *o;
    rc = shmring_attach(shmring_fd(r), shmring_eventfd(r), &o);
    CHECK(rc == 0, "attach: %s", strerror(-rc));
    CHECK(shmring_nslots(o) == n && shmring_slot_bytes(o) == sb, "attached geometry");
    CHECK(shmring_claim(r, &s) == 0, "claim");
    memcpy(shmring_slot_data(r, s) + 8, "shared", 6);
    CHECK(memcmp(shmring_slot_data(o, s) + 8, "shared", 6) == 0, "attached bytes");
    CHECK(shmring_slot_state(o, s) == SHMRING_CLAIMED, "attached state");
    CHECK(shmring_publish(o, s, 7, 0, 0) == 0, "publish through the attached handle");
    CHECK(shmring_acquire(r, &s2, &seq, &mo, &ml) == 0 && s2 == s && seq == 7, "acquire");
    CHECK(shmring_release(r, s) == 0, "release");
    shmring_destroy(o);
    shmring_destroy(r);
    printf("ring_stress: api: states, errors, timeouts, fd wake-ups, EINTR, attach OK\n");
}

/* -------------------------------------------------------- producers (3 & 5) */

struct producer_thread {
    shmring_t *ring;
    int task_fd;  /* read end */
    int note_fd;  /* write end, shared by the threads of a producer */
    uint32_t who; /* producer * 16 + thread */
    uint64_t rng;
    int failed;
    pthread_t tid;
};

static void send_note(struct producer_thread *pt, uint64_t seq, uint32_t slot, uint32_t kind,
                      int err) {
    struct note nt = {.seq = seq, .slot = slot, .kind = kind, .err = err, .who = pt->who};
    /* sizeof(struct note) < PIPE_BUF: atomic, so two threads' notes never interleave */
    if (write_full(pt->note_fd, &nt, sizeof(nt)) != 0) pt->failed = 1;
}

static void *producer_main(void *arg) {
    struct producer_thread *pt = arg;
    unsigned char *buf = malloc(SLOT_BYTES);
    if (!buf) {
        pt->failed = 1;
        return NULL;
    }
    uint64_t slot_bytes = shmring_slot_bytes(pt->ring);
    for (;;) {
        struct task t;
        int rc = read_full(pt->task_fd, &t, sizeof(t));
        if (rc == 0) break;
        if (rc < 0) {
            send_note(pt, 0, 0, NOTE_ERROR, __LINE__);
            pt->failed = 1;
            break;
        }
        if (t.slot >= shmring_nslots(pt->ring)) {
            send_note(pt, t.seq, t.slot, NOTE_ERROR, __LINE__);
            pt->failed = 1;
            break;
        }
        char *data = shmring_slot_data(pt->ring, t.slot);
        if (t.cmd == CMD_HOLD_DIE) {
            /* Half-write the slot, sleep, and die holding it CLAIMED. */
            memset(data, 0xee, 1000);
            struct timespec ts = {0, 100 * 1000 * 1000};
            nanosleep(&ts, NULL);
            kill(getpid(), SIGKILL);
            for (;;) pause();
        }
        jitter(&pt->rng);
        if (splitmix(&pt->rng) % 32 == 0) {
            /* Give the slot back instead of filling it (maybe after scribbling:
             * an abandoned slot's bytes mean nothing). */
            if (splitmix(&pt->rng) % 2) memset(data, 0x77, 64);
            rc = shmring_abandon(pt->ring, t.slot);
            if (rc) {
                send_note(pt, t.seq, t.slot, NOTE_ERROR, rc);
                pt->failed = 1;
                break;
            }
            send_note(pt, t.seq, t.slot, NOTE_ABANDONED, 0);
            continue;
        }
        struct plan p = plan_for(t.seq);
        if (p.meta_off + sizeof(struct meta) > slot_bytes) {
            send_note(pt, t.seq, t.slot, NOTE_ERROR, __LINE__);
            pt->failed = 1;
            break;
        }
        /* Payload: straight into the slot, or staged and copied with
         * non-temporal stores (as the loader's stack does). */
        if (splitmix(&pt->rng) % 2) {
            fill_bytes((unsigned char *)data, p.size, p.fill_seed);
        } else {
            fill_bytes(buf, p.size, p.fill_seed);
            shmring_copy_stream(data, buf, p.size);
        }
        struct meta m = {.magic = META_MAGIC,
                         .seq = t.seq,
                         .size = p.size,
                         .hash = fnv1a((const unsigned char *)data, p.size),
                         .producer = pt->who >> 4,
                         .thread = pt->who & 15};
        jitter(&pt->rng);
        m.published_ns = now_ns();
        memcpy(data + p.meta_off, &m, sizeof(m));
        rc = shmring_publish(pt->ring, t.slot, t.seq, p.meta_off, sizeof(m));
        if (rc) {
            send_note(pt, t.seq, t.slot, NOTE_ERROR, rc);
            pt->failed = 1;
            break;
        }
    }
    free(buf);
    return NULL;
}

/* ------------------------------------------------------------- consumer */

struct consumer {
    shmring_t *r;
    uint64_t rounds;
    int nthreads;           /* producer threads that take tasks */
    int task_fds[MAX_PRODUCERS * THREADS_PER_PROC]; /* write ends, per producer thread */
    int nprocs;             /* producer processes (0: threads in this process) */
    int note_fds[MAX_PRODUCERS]; /* read ends (non-blocking) */
    int nnotes;
    int32_t *slot_of;       /* per seq: claimed slot, -1 when done */
    uint64_t sent, received, abandoned, held_max, waits, spurious;
    uint64_t rng;
    uint32_t held[NSLOTS];  /* leases kept (as a user keeping batches) */
    uint64_t held_seq[NSLOTS];
    int nheld;
    int release_fd;         /* >= 0: a releaser thread's task pipe (phase 5) */
    uint64_t pending;       /* slots handed to the releaser, not yet released */
    uint64_t offloaded;
};

static void verify_slot(shmring_t *r, uint32_t slot, uint64_t seq, uint64_t meta_off,
                        uint64_t meta_len, const char *when) {
    const unsigned char *data = (const unsigned char *)shmring_slot_data(r, slot);
    struct plan p = plan_for(seq);
    CHECK(meta_off == p.meta_off && meta_len == sizeof(struct meta),
          "%s: slot %u seq %" PRIu64 ": published meta at %" PRIu64 "+%" PRIu64
          ", expected %" PRIu64 "+%zu",
          when, slot, seq, meta_off, meta_len, p.meta_off, sizeof(struct meta));
    struct meta m;
    memcpy(&m, data + meta_off, sizeof(m));
    CHECK(m.magic == META_MAGIC && m.seq == seq && m.size == p.size,
          "%s: slot %u seq %" PRIu64 ": meta record magic %#" PRIx64 " seq %" PRIu64
          " size %" PRIu64 " (expected size %" PRIu64 ")",
          when, slot, seq, m.magic, m.seq, m.size, p.size);
    uint64_t h = fnv1a(data, p.size);
    CHECK(h == m.hash, "%s: slot %u seq %" PRIu64 " (producer %u thread %u): payload hash %#" PRIx64
          " != published %#" PRIx64, when, slot, seq, m.producer, m.thread, h, m.hash);
    static _Thread_local unsigned char expect[SLOT_BYTES];
    fill_bytes(expect, p.size, p.fill_seed);
    CHECK(memcmp(expect, data, p.size) == 0, "%s: slot %u seq %" PRIu64 ": payload differs",
          when, slot, seq);
}

/* Check a held slot again (a READING slot must not change), scribble, release. */
static void finish_slot(struct consumer *c, int k) {
    uint32_t slot = c->held[k];
    uint64_t seq = c->held_seq[k];
    c->held[k] = c->held[c->nheld - 1];
    c->held_seq[k] = c->held_seq[c->nheld - 1];
    c->nheld--;
    CHECK(shmring_slot_state(c->r, slot) == SHMRING_READING, "held slot %u not READING", slot);
    CHECK(c->slot_of[seq] == -2 - (int32_t)slot, "seq %" PRIu64 " not held in slot %u", seq,
          slot);
    struct plan p = plan_for(seq);
    c->slot_of[seq] = -1;
    if (c->release_fd >= 0 && splitmix(&c->rng) % 2) {
        /* The last view of a batch may die in any thread of the consumer
         * process: let the releaser thread check, scribble and release. */
        struct task t = {.seq = seq, .slot = slot, .cmd = CMD_FILL};
        int rc = write_full(c->release_fd, &t, sizeof(t));
        CHECK(rc == 0, "sending to the releaser: %s", strerror(-rc));
        c->pending++;
        c->offloaded++;
        return;
    }
    verify_slot(c->r, slot, seq, p.meta_off, sizeof(struct meta), "on release");
    /* Scribble: a producer that published without writing, or a consumer that
     * saw stale bytes, fails the next check. */
    memset(shmring_slot_data(c->r, slot), 0xa5, p.meta_off + sizeof(struct meta));
    CHECK(shmring_release(c->r, slot) == 0, "release slot %u", slot);
}

static void drain_notes(struct consumer *c, int *progress) {
    for (int i = 0; i < c->nnotes; i++) {
        for (;;) {
            struct note nt[16];
            ssize_t n = read(c->note_fds[i], nt, sizeof(nt));
            if (n < 0 && (errno == EAGAIN || errno == EINTR)) break;
            CHECK(n >= 0, "reading notes: %s", strerror(errno));
            if (n == 0) break; /* EOF: checked by the caller through POLLHUP */
            CHECK(n % (ssize_t)sizeof(struct note) == 0, "torn note (%zd bytes)", n);
            for (ssize_t k = 0; k < n / (ssize_t)sizeof(struct note); k++) {
                if (nt[k].kind == NOTE_RELEASED) {
                    CHECK(c->pending > 0, "release note with nothing pending");
                    c->pending--;
                    *progress = 1;
                    continue;
                }
                CHECK(nt[k].kind == NOTE_ABANDONED,
                      "producer %u thread %u reported error %d (seq %" PRIu64 ", slot %u)",
                      nt[k].who >> 4, nt[k].who & 15, nt[k].err, nt[k].seq, nt[k].slot);
                CHECK(nt[k].seq < c->sent && c->slot_of[nt[k].seq] == (int32_t)nt[k].slot,
                      "abandon note for seq %" PRIu64 " slot %u that was not outstanding",
                      nt[k].seq, nt[k].slot);
                c->slot_of[nt[k].seq] = -1;
                c->abandoned++;
                *progress = 1;
            }
        }
    }
}

static int pick_thread(struct consumer *c, uint32_t slot) {
    if (c->nprocs == 0) return (int)(splitmix(&c->rng) % (uint64_t)c->nthreads);
    /* any process; within it, the thread that owns slot's parity (see top) */
    int proc = (int)(splitmix(&c->rng) % (uint64_t)c->nprocs);
    return proc * THREADS_PER_PROC + (int)(slot % THREADS_PER_PROC);
}

static void consume(struct consumer *c) {
    int stalls = 0;
    while (c->received + c->abandoned < c->rounds) {
        uint32_t slot;
        int progress = 0;
        while (c->sent < c->rounds && shmring_claim(c->r, &slot) == 0) {
            CHECK(slot < NSLOTS, "claim gave slot %u", slot);
            struct task t = {.seq = c->sent, .slot = slot, .cmd = CMD_FILL};
            c->slot_of[c->sent] = (int32_t)slot;
            int th = pick_thread(c, slot);
            int rc = write_full(c->task_fds[th], &t, sizeof(t));
            CHECK(rc == 0, "sending a task: %s", strerror(-rc));
            c->sent++;
        }
        uint64_t seq, mo, ml;
        int rc = shmring_acquire(c->r, &slot, &seq, &mo, &ml);
        if (rc == 0) {
            CHECK(seq < c->sent && c->slot_of[seq] == (int32_t)slot,
                  "acquired slot %u with seq %" PRIu64 ", which was %s", slot, seq,
                  seq < c->sent ? "not handed that slot (or already done)" : "never sent");
            verify_slot(c->r, slot, seq, mo, ml, "on acquire");
            c->received++;
            c->slot_of[seq] = -2 - (int32_t)slot; /* held */
            c->held[c->nheld] = slot;
            c->held_seq[c->nheld++] = seq;
            if ((uint64_t)c->nheld > c->held_max) c->held_max = (uint64_t)c->nheld;
            /* Keep some leases a while, as a user keeping batches: release a
             * random one while more than 3 are held, and usually the rest. */
            while (c->nheld > 3 || (c->nheld && splitmix(&c->rng) % 4 != 0))
                finish_slot(c, (int)(splitmix(&c->rng) % (uint64_t)c->nheld));
            stalls = 0;
            jitter(&c->rng);
            continue;
        }
        CHECK(rc == -EAGAIN, "acquire: %d", rc);
        drain_notes(c, &progress);
        if (progress) {
            stalls = 0;
            continue;
        }
        if (c->sent == c->received + c->abandoned && c->pending == 0) {
            /* Nothing in flight: every free slot is claimed, or the user holds
             * the rest.  Give the held ones back. */
            CHECK(c->nheld > 0, "nothing in flight, nothing held, no slot to claim");
            while (c->nheld) finish_slot(c, c->nheld - 1);
            continue;
        }
        struct pollfd pf[MAX_PRODUCERS];
        for (int i = 0; i < c->nnotes; i++) pf[i] = (struct pollfd){c->note_fds[i], POLLIN, 0};
        c->waits++;
        int64_t slept_from = now_ns();
        rc = shmring_wait(c->r, WAIT_MS, pf, c->nnotes);
        if (rc == -EINTR) continue;
        if (rc == -ETIMEDOUT) {
            /* A slot published early in the sleep (its producer stamped the time
             * just before publish) and the wait still ran out: a lost wake-up.
             * One published at the very end may simply have missed the flag. */
            for (uint32_t i = 0; i < NSLOTS; i++) {
                if (shmring_slot_state(c->r, i) != SHMRING_READY) continue; /* acquire */
                for (int k = 0; k < c->nheld; k++) CHECK(c->held[k] != i, "held slot READY");
                uint64_t seq = UINT64_MAX;
                for (uint64_t q = 0; q < c->sent; q++)
                    if (c->slot_of[q] == (int32_t)i) seq = q;
                CHECK(seq != UINT64_MAX, "READY slot %u was never handed out", i);
                struct meta m;
                memcpy(&m, shmring_slot_data(c->r, i) + plan_for(seq).meta_off, sizeof(m));
                CHECK(m.published_ns > slept_from + (int64_t)WAIT_MS * 1000000 / 2,
                      "lost wake-up: slot %u was published %.1f ms into a %d ms "
                      "shmring_wait that then ran out",
                      i, (m.published_ns - slept_from) / 1e6, WAIT_MS);
            }
            CHECK(++stalls < STALL_LIMIT, "no progress for %d s (%" PRIu64 " in flight)",
                  STALL_LIMIT * WAIT_MS / 1000, c->sent - c->received - c->abandoned);
            continue;
        }
        CHECK(rc == 0, "shmring_wait: %d", rc);
        int fired = 0;
        for (int i = 0; i < c->nnotes; i++) {
            CHECK(!(pf[i].revents & (POLLHUP | POLLERR)) || (pf[i].revents & POLLIN),
                  "producer %d died (its note pipe hung up, revents %#x)", i, pf[i].revents);
            fired |= pf[i].revents != 0;
        }
        int any = 0;
        for (uint32_t i = 0; i < NSLOTS; i++) any |= shmring_slot_state(c->r, i) == SHMRING_READY;
        if (!fired && !any) c->spurious++;
    }
    while (c->nheld) finish_slot(c, c->nheld - 1);
    int progress = 0;
    double t0 = now_ms();
    for (;;) {
        drain_notes(c, &progress);
        if (c->pending == 0) break;
        CHECK(now_ms() - t0 < HANG_MS, "the releaser thread never released %" PRIu64 " slots",
              c->pending);
        struct pollfd pf = {c->note_fds[0], POLLIN, 0};
        poll(&pf, 1, 100);
    }
    CHECK(c->sent == c->rounds && c->received + c->abandoned == c->rounds,
          "sent %" PRIu64 " received %" PRIu64 " abandoned %" PRIu64, c->sent, c->received,
          c->abandoned);
    for (uint64_t s = 0; s < c->rounds; s++) CHECK(c->slot_of[s] == -1, "seq %" PRIu64 " open", s);
    for (uint32_t i = 0; i < NSLOTS; i++)
        CHECK(shmring_slot_state(c->r, i) == SHMRING_FREE, "slot %u not FREE at the end (%d)", i,
              shmring_slot_state(c->r, i));
}

/* --------------------------------------------------------- 3 & 4. processes */

static int pidfd_open_errno(pid_t pid, int *fd) {
#ifdef SYS_pidfd_open
    long rc = syscall(SYS_pidfd_open, pid, 0);
    *fd = (int)rc;
    return rc < 0 ? -errno : 0;
#else
    (void)pid;
    *fd = -1;
    return -ENOSYS;
#endif
}

static void producer_process(int idx, shmring_t *parent_ring, int task_rd[THREADS_PER_PROC],
                             int note_wr) {
    shmring_t *r;
    int rc = shmring_attach(shmring_fd(parent_ring), shmring_eventfd(parent_ring), &r);
    if (rc) {
        fprintf(stderr, "ring_stress: producer %d: attach: %s\n", idx, strerror(-rc));
        _exit(2);
    }
    /* The inherited handle is the consumer's: not ours to use.  Its fds go
     * (attach made its own copies); its mapping goes with the process. */
    shmring_close_fds(parent_ring);
    struct producer_thread pt[THREADS_PER_PROC];
    for (int t = 0; t < THREADS_PER_PROC; t++) {
        pt[t] = (struct producer_thread){.ring = r,
                                         .task_fd = task_rd[t],
                                         .note_fd = note_wr,
                                         .who = (uint32_t)(idx * 16 + t),
                                         .rng = g_seed * 31 + (uint64_t)idx * 1000 + (uint64_t)t};
        if (pthread_create(&pt[t].tid, NULL, producer_main, &pt[t]) != 0) _exit(3);
    }
    int failed = 0;
    for (int t = 0; t < THREADS_PER_PROC; t++) {
        pthread_join(pt[t].tid, NULL);
        failed |= pt[t].failed;
        close(task_rd[t]);
    }
    close(note_wr);
    shmring_destroy(r);
    exit(failed ? 4 : 0);
}

static void phase_procs(uint64_t rounds, int nprocs) {
    shmring_t *r;
    int rc = shmring_create_in("/dev/shm", NSLOTS, SLOT_BYTES, &r);
    CHECK(rc == 0, "shmring_create_in: %s", strerror(-rc));
    CHECK(shmring_slot_bytes(r) == SLOT_BYTES, "slot bytes %" PRIu64, shmring_slot_bytes(r));

    int task[MAX_PRODUCERS][THREADS_PER_PROC][2], note[MAX_PRODUCERS][2];
    for (int i = 0; i < nprocs; i++) {
        CHECK(pipe(note[i]) == 0, "pipe");
        for (int t = 0; t < THREADS_PER_PROC; t++) CHECK(pipe(task[i][t]) == 0, "pipe");
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pids[MAX_PRODUCERS];
    for (int i = 0; i < nprocs; i++) {
        pid_t pid = fork();
        CHECK(pid >= 0, "fork: %s", strerror(errno));
        if (pid == 0) {
            /* Keep only this producer's ends: then its note pipe hangs up
             * exactly when this producer dies. */
            int mine[THREADS_PER_PROC];
            for (int j = 0; j < nprocs; j++) {
                close(note[j][0]);
                if (j != i) close(note[j][1]);
                for (int t = 0; t < THREADS_PER_PROC; t++) {
                    close(task[j][t][1]);
                    if (j != i) close(task[j][t][0]);
                }
            }
            for (int t = 0; t < THREADS_PER_PROC; t++) mine[t] = task[i][t][0];
            producer_process(i, r, mine, note[i][1]);
        }
        pids[i] = pid;
    }
    struct consumer c;
    memset(&c, 0, sizeof(c));
    c.r = r;
    c.rounds = rounds;
    c.nprocs = nprocs;
    c.nthreads = nprocs * THREADS_PER_PROC;
    c.nnotes = nprocs;
    c.rng = g_seed ^ 0xc0ffee;
    c.release_fd = -1;
    c.slot_of = malloc(rounds * sizeof(*c.slot_of));
    CHECK(c.slot_of, "malloc");
    for (int i = 0; i < nprocs; i++) {
        close(note[i][1]);
        CHECK(set_nonblock(note[i][0]) == 0, "O_NONBLOCK");
        c.note_fds[i] = note[i][0];
        for (int t = 0; t < THREADS_PER_PROC; t++) {
            close(task[i][t][0]);
            c.task_fds[i * THREADS_PER_PROC + t] = task[i][t][1];
        }
    }
    double t0 = now_ms();
    consume(&c);
    printf("ring_stress: procs: %d producer processes x %d threads, %" PRIu64 " rounds (%" PRIu64
           " published, %" PRIu64 " abandoned), every payload verified on acquire and release; "
           "%" PRIu64 " waits (%" PRIu64 " spurious), up to %" PRIu64 " leases held; %.0f ms\n",
           nprocs, THREADS_PER_PROC, rounds, c.received, c.abandoned, c.waits, c.spurious,
           c.held_max, now_ms() - t0);

    /* ---- 4. death: producer 0 dies on its own while we sleep on its pipe;
     * producer 1 is killed while we sleep on its pidfd. */
    int victims = nprocs >= 2 ? 2 : 1;
    uint32_t held_slot;
    CHECK(shmring_claim(r, &held_slot) == 0, "claim for the dying producer");
    struct task die = {.seq = rounds, .slot = held_slot, .cmd = CMD_HOLD_DIE};
    /* to the thread of producer 0 that owns this slot's parity (see top) */
    CHECK(write_full(c.task_fds[held_slot % THREADS_PER_PROC], &die, sizeof(die)) == 0,
          "send die");
    struct pollfd pf = {.fd = c.note_fds[0], .events = POLLIN, .revents = 0};
    t0 = now_ms();
    for (;;) { /* a stale eventfd count may wake us once early: that is allowed */
        double left = HANG_MS - (now_ms() - t0);
        CHECK(left > 0, "producer 0 died (SIGKILL) but shmring_wait on its pipe never woke");
        rc = shmring_wait(r, (int)left, &pf, 1);
        CHECK(rc == 0 || rc == -EINTR, "wait for producer 0's death: %d", rc);
        if (pf.revents) break;
    }
    double woke = now_ms() - t0;
    CHECK(pf.revents & POLLHUP, "producer 0's pipe: revents %#x, expected POLLHUP", pf.revents);
    CHECK(woke >= 50, "woke after %.1f ms, before producer 0 could have died (100 ms)", woke);
    int st;
    CHECK(waitpid(pids[0], &st, 0) == pids[0] && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
          "producer 0: status %#x, expected SIGKILL", st);
    CHECK(shmring_slot_state(r, held_slot) == SHMRING_CLAIMED,
          "the dead producer's slot changed state");
    printf("ring_stress: death: wait woke %.0f ms after asking producer 0 to die (pipe POLLHUP)\n",
           woke);

    if (victims == 2) {
        int pidfd;
        rc = pidfd_open_errno(pids[1], &pidfd);
        if (rc == -ENOSYS) {
            printf("ring_stress: death: no pidfd_open here; pidfd wake-up not tested\n");
            kill(pids[1], SIGKILL);
        } else {
            CHECK(rc == 0, "pidfd_open: %s", strerror(-rc));
            /* The producer is alive and idle: a short wait must time out. */
            pf = (struct pollfd){.fd = pidfd, .events = POLLIN, .revents = 0};
            rc = shmring_wait(r, 20, &pf, 1);
            CHECK((rc == -ETIMEDOUT || rc == 0) && pf.revents == 0,
                  "wait on a live producer's pidfd: rc %d revents %#x", rc, pf.revents);
            CHECK(kill(pids[1], SIGKILL) == 0, "kill: %s", strerror(errno));
            t0 = now_ms();
            for (;;) {
                double left = HANG_MS - (now_ms() - t0);
                CHECK(left > 0, "producer 1 was killed but shmring_wait on its pidfd never woke");
                rc = shmring_wait(r, (int)left, &pf, 1);
                CHECK(rc == 0 || rc == -EINTR, "wait for producer 1's death: %d", rc);
                if (pf.revents) break;
            }
            CHECK(pf.revents & POLLIN, "pidfd revents %#x", pf.revents);
            printf("ring_stress: death: wait woke %.1f ms after SIGKILL of producer 1 (pidfd)\n",
                   now_ms() - t0);
            close(pidfd);
        }
        CHECK(waitpid(pids[1], &st, 0) == pids[1] && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL,
              "producer 1: status %#x, expected SIGKILL", st);
    }
    /* The rest exit 0 once their task pipes close. */
    for (int i = 0; i < nprocs * THREADS_PER_PROC; i++) close(c.task_fds[i]);
    for (int i = victims; i < nprocs; i++) {
        CHECK(waitpid(pids[i], &st, 0) == pids[i], "waitpid");
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "producer %d: status %#x", i, st);
    }
    for (int i = 0; i < nprocs; i++) close(c.note_fds[i]);
    CHECK(shmring_abandon(r, held_slot) == 0, "abandon the dead producer's slot");
    free(c.slot_of);
    shmring_destroy(r);
}

/* ------------------------------------------------------------ 5. threads */

struct releaser {
    shmring_t *ring;
    int task_fd, note_fd;
    uint64_t rng;
    pthread_t tid;
};

/* Another thread of the consumer process: check, scribble and release the
 * slots the consumer hands it (as when a batch's last view dies elsewhere). */
static void *releaser_main(void *arg) {
    struct releaser *rl = arg;
    struct task t;
    while (read_full(rl->task_fd, &t, sizeof(t)) == 1) {
        jitter(&rl->rng);
        struct plan p = plan_for(t.seq);
        CHECK(shmring_slot_state(rl->ring, t.slot) == SHMRING_READING,
              "releaser: slot %u not READING", t.slot);
        verify_slot(rl->ring, t.slot, t.seq, p.meta_off, sizeof(struct meta),
                    "on release in another thread");
        memset(shmring_slot_data(rl->ring, t.slot), 0x5c, p.meta_off + sizeof(struct meta));
        CHECK(shmring_release(rl->ring, t.slot) == 0, "releaser: release slot %u", t.slot);
        struct note nt = {.seq = t.seq, .slot = t.slot, .kind = NOTE_RELEASED};
        CHECK(write_full(rl->note_fd, &nt, sizeof(nt)) == 0, "releaser: note");
    }
    return NULL;
}

static void phase_threads(uint64_t rounds, int nthreads) {
    shmring_t *r;
    int rc = shmring_create_in("/dev/shm", NSLOTS, SLOT_BYTES, &r);
    CHECK(rc == 0, "shmring_create_in: %s", strerror(-rc));
    int note[2];
    CHECK(pipe(note) == 0, "pipe");
    CHECK(set_nonblock(note[0]) == 0, "O_NONBLOCK");
    struct producer_thread pt[MAX_THREADS];
    struct consumer c;
    memset(&c, 0, sizeof(c));
    for (int t = 0; t < nthreads; t++) {
        int tp[2];
        CHECK(pipe(tp) == 0, "pipe");
        c.task_fds[t] = tp[1];
        pt[t] = (struct producer_thread){.ring = r,
                                         .task_fd = tp[0],
                                         .note_fd = note[1],
                                         .who = (uint32_t)(15 * 16 + t),
                                         .rng = g_seed * 77 + (uint64_t)t};
        CHECK(pthread_create(&pt[t].tid, NULL, producer_main, &pt[t]) == 0, "pthread_create");
    }
    struct releaser rl = {.ring = r, .note_fd = note[1], .rng = g_seed ^ 0x7e1e};
    int rp[2];
    CHECK(pipe(rp) == 0, "pipe");
    rl.task_fd = rp[0];
    c.release_fd = rp[1];
    CHECK(pthread_create(&rl.tid, NULL, releaser_main, &rl) == 0, "pthread_create");
    c.r = r;
    c.rounds = rounds;
    c.nprocs = 0;
    c.nthreads = nthreads;
    c.nnotes = 1;
    c.note_fds[0] = note[0];
    c.rng = g_seed ^ 0xbeef;
    c.slot_of = malloc(rounds * sizeof(*c.slot_of));
    CHECK(c.slot_of, "malloc");
    double t0 = now_ms();
    consume(&c);
    close(c.release_fd);
    pthread_join(rl.tid, NULL);
    close(rl.task_fd);
    for (int t = 0; t < nthreads; t++) close(c.task_fds[t]);
    int failed = 0;
    for (int t = 0; t < nthreads; t++) {
        pthread_join(pt[t].tid, NULL);
        failed |= pt[t].failed;
        close(pt[t].task_fd);
    }
    CHECK(!failed, "a producer thread failed");
    close(note[0]);
    close(note[1]);
    printf("ring_stress: threads: %d producer threads in the consumer's process, %" PRIu64
           " rounds (%" PRIu64 " published, %" PRIu64 " abandoned, %" PRIu64
           " released by another consumer thread), %" PRIu64 " waits; %.0f ms\n",
           nthreads, rounds, c.received, c.abandoned, c.offloaded, c.waits, now_ms() - t0);
    free(c.slot_of);
    shmring_destroy(r);
}

int main(int argc, char **argv) {
    uint64_t proc_rounds = 20000, thread_rounds = 20000;
    int nprocs = 3, nthreads = 4, copies = 3000;
    int opt;
    while ((opt = getopt(argc, argv, "r:t:p:n:s:c:")) != -1) {
        switch (opt) {
        case 'r': proc_rounds = strtoull(optarg, NULL, 0); break;
        case 't': thread_rounds = strtoull(optarg, NULL, 0); break;
        case 'p': nprocs = atoi(optarg); break;
        case 'n': nthreads = atoi(optarg); break;
        case 's': g_seed = strtoull(optarg, NULL, 0); break;
        case 'c': copies = atoi(optarg); break;
        default:
            fprintf(stderr, "usage: %s [-r proc_rounds] [-t thread_rounds] [-p producers] "
                            "[-n threads] [-s seed] [-c copies]\n", argv[0]);
            return 2;
        }
    }
    if (nprocs < 1 || nprocs > MAX_PRODUCERS || nthreads < 1 || nthreads > MAX_THREADS) {
        fprintf(stderr, "ring_stress: 1 <= producers <= %d, 1 <= threads <= %d\n",
                MAX_PRODUCERS, MAX_THREADS);
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    signal(SIGPIPE, SIG_IGN);
    printf("ring_stress: seed %#" PRIx64 "\n", g_seed);
    phase_copy(copies);
    phase_api();
    if (proc_rounds) phase_procs(proc_rounds, nprocs); /* forks: before any thread exists */
    if (thread_rounds) phase_threads(thread_rounds, nthreads);
    printf("ring_stress: OK\n");
    return 0;
}
