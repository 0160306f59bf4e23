/*
 * row_claim_race: a producer late to a row-by-row batch must take no row of
 * the slot's next batch (tests/robustness/test_sanitizers.py builds and runs it).
 *
 *   gcc -std=c11 -Icsrc -DSHMRING_ROW_CAS_PAUSE=row_cas_pause_here \
 *       tests/c/row_claim_race.c csrc/shmring.c -pthread -o row_claim_race
 *
 * A thread stops in shmring_row_claim for batch 100 after its look at the
 * slot and before its CAS (the pause shmring.c leaves for this test), as a
 * descheduled worker would.  Meanwhile batch 100 is completed, acquired and
 * released, and the slot is claimed again for batch 101, whose first row is
 * taken.  The late thread then goes on: it must get -ESTALE, not row 1 of
 * batch 101 (which it would fill with batch 100's sample).  Exits 0 when it
 * does, 1 otherwise.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <semaphore.h>
#include <stdio.h>

#include "shmring.h"

static __thread int pauses;
static sem_t in_window, go_on;
static shmring_t *ring;

void row_cas_pause_here(void) {
    if (pauses) {
        pauses = 0;
        sem_post(&in_window);
        sem_wait(&go_on);
    }
}

static void *late_producer(void *out) {
    uint32_t row = 99;
    pauses = 1;
    *(int *)out = shmring_row_claim(ring, 0, 100, &row);
    return NULL;
}

static int check(int rc, const char *what) {
    if (rc < 0) {
        fprintf(stderr, "%s failed: %d\n", what, rc);
        return 1;
    }
    return 0;
}

int main(void) {
    uint32_t slot, row;
    uint64_t seq, meta_off, meta_len;
    int late_rc = 0;
    pthread_t late;
    sem_init(&in_window, 0, 0);
    sem_init(&go_on, 0, 0);
    if (check(shmring_create_in("/dev/shm", 1, 4096, &ring), "create") ||
        check(shmring_claim(ring, &slot), "claim") ||
        check(shmring_rows_begin(ring, slot, 100, 4, 0), "rows_begin 100"))
        return 1;
    pthread_create(&late, NULL, late_producer, &late_rc);
    sem_wait(&in_window);  /* it looked at batch 100's row 0, and stopped */
    for (int i = 0; i < 4; i++)
        if (check(shmring_row_claim(ring, slot, 100, &row), "row_claim 100") ||
            check(shmring_row_done(ring, slot, 0), "row_done 100"))
            return 1;
    if (check(shmring_acquire(ring, &slot, &seq, &meta_off, &meta_len), "acquire") ||
        check(shmring_release(ring, slot), "release") ||
        check(shmring_claim(ring, &slot), "claim again") ||
        check(shmring_rows_begin(ring, slot, 101, 4, 0), "rows_begin 101") ||
        check(shmring_row_claim(ring, slot, 101, &row), "row_claim 101"))
        return 1;
    sem_post(&go_on);
    pthread_join(late, NULL);
    shmring_destroy(ring);
    if (late_rc != -ESTALE) {
        printf("late producer of batch 100: %d (a row of batch 101), expected -ESTALE\n",
               late_rc);
        return 1;
    }
    puts("late producer: -ESTALE");
    return 0;
}
