/* LD_PRELOAD shim for tests/test_slots.py: reserving room fails with ENOSPC
 * for torch's shared-memory files (/dev/shm/torch_*) only, as in a full
 * /dev/shm: torch raises its own error, while shmloader's memory is
 * untouched.  Later torch reserves with posix_fallocate, earlier torch (2.6)
 * with fallocate, so both are intercepted. */
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

int posix_fallocate(int fd, off_t offset, off_t len) {
    static int (*real)(int, off_t, off_t);
    if (!real) real = (int (*)(int, off_t, off_t))dlsym(RTLD_NEXT, "posix_fallocate");
    return is_torchs(fd) ? ENOSPC : real(fd, offset, len);
}

int posix_fallocate64(int fd, off_t offset, off_t len) {
    static int (*real)(int, off_t, off_t);
    if (!real) real = (int (*)(int, off_t, off_t))dlsym(RTLD_NEXT, "posix_fallocate64");
    return is_torchs(fd) ? ENOSPC : real(fd, offset, len);
}

int fallocate(int fd, int mode, off_t offset, off_t len) {
    static int (*real)(int, int, off_t, off_t);
    if (!real) real = (int (*)(int, int, off_t, off_t))dlsym(RTLD_NEXT, "fallocate");
    if (is_torchs(fd)) {
        errno = ENOSPC;
        return -1;
    }
    return real(fd, mode, offset, len);
}

int fallocate64(int fd, int mode, off_t offset, off_t len) {
    static int (*real)(int, int, off_t, off_t);
    if (!real) real = (int (*)(int, int, off_t, off_t))dlsym(RTLD_NEXT, "fallocate64");
    if (is_torchs(fd)) {
        errno = ENOSPC;
        return -1;
    }
    return real(fd, mode, offset, len);
}
