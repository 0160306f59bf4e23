/* LD_PRELOAD shim for tests/unit/test_slots.py: sizing torch's shared-memory
 * files (/dev/shm/torch_*) fails with ENOSPC, as in a full /dev/shm, while
 * shmloader's memory is untouched: torch raises its own "unable to resize
 * file" error.  ftruncate, because every torch calls it first; a later torch
 * would fail its posix_fallocate next in a really full /dev/shm, and torch
 * 2.6, which reserves nothing, would die of SIGBUS on writing. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static int is_torchs(int fd) {
    char link[64], target[512];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n < 0) return 0;
    target[n] = 0;
    return strstr(target, "/torch_") != NULL;
}

static int no_room(int fd, off_t length) {
    if (length > 0 && is_torchs(fd)) {
        errno = ENOSPC;
        return 1;
    }
    return 0;
}

int ftruncate(int fd, off_t length) {
    static int (*real)(int, off_t);
    if (!real) real = (int (*)(int, off_t))dlsym(RTLD_NEXT, "ftruncate");
    return no_room(fd, length) ? -1 : real(fd, length);
}

int ftruncate64(int fd, off_t length) {
    static int (*real)(int, off_t);
    if (!real) real = (int (*)(int, off_t))dlsym(RTLD_NEXT, "ftruncate64");
    return no_room(fd, length) ? -1 : real(fd, length);
}
