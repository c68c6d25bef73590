/* A dynamically linked PIE (glibc): the Linux personality loads it and
 * ld-linux-x86-64.so.2 from the root file system, and the interpreter maps
 * libc.so.6 with mmap of its file. Prints what it checks; "dynhello: ok"
 * last. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

static int cmp(const void *a, const void *b) {
    return *(const int *)a - *(const int *)b;
}

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (!(cond)) {                                                     \
            printf("dynhello: FAIL %s: ", #cond);                          \
            printf(__VA_ARGS__);                                           \
            printf("\n");                                                  \
            return 1;                                                      \
        }                                                                  \
    } while (0)

int main(int argc, char **argv) {
    printf("dynhello: argc=%d argv0=%s argv1=%s\n", argc, argv[0], argc > 1 ? argv[1] : "");
    const char *greeting = getenv("GREETING");
    printf("dynhello: GREETING=%s\n", greeting ? greeting : "(unset)");

    /* Loaded by an interpreter at a base of its own, not at the linked 0. */
    unsigned long base = getauxval(AT_BASE), entry = getauxval(AT_ENTRY);
    CHECK(base != 0, "AT_BASE is 0");
    CHECK((unsigned long)&main > 0x10000, "main at %p", (void *)&main);
    printf("dynhello: pie main_below_entry=%d\n", (unsigned long)&main < entry + 0x100000);

    char exe[256];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    CHECK(n > 0, "readlink errno %d", errno);
    exe[n] = 0;
    printf("dynhello: exe=%s\n", exe);

    /* libc calls: malloc, qsort, snprintf with a float, the clock. */
    int *v = malloc(1000 * sizeof *v);
    CHECK(v != NULL, "malloc");
    for (int i = 0; i < 1000; i++)
        v[i] = (i * 7919) % 1000;
    qsort(v, 1000, sizeof *v, cmp);
    for (int i = 0; i < 1000; i++)
        CHECK(v[i] == i, "qsort v[%d]=%d", i, v[i]);
    free(v);
    char buf[64];
    snprintf(buf, sizeof buf, "%.3f", 2.5 * 1.5);
    CHECK(strcmp(buf, "3.750") == 0, "snprintf %s", buf);
    struct timespec ts;
    CHECK(clock_gettime(CLOCK_MONOTONIC, &ts) == 0, "clock_gettime");

    /* A file of the root file system, read through stdio. */
    struct stat st;
    CHECK(stat(exe, &st) == 0 && st.st_size > 1000, "stat %s", exe);
    FILE *f = fopen(exe, "rb");
    CHECK(f != NULL, "fopen %s errno %d", exe, errno);
    char magic[4];
    CHECK(fread(magic, 1, 4, f) == 4 && memcmp(magic, "\177ELF", 4) == 0, "ELF magic");
    fclose(f);
    printf("dynhello: size=%lld\n", (long long)st.st_size);

    /* And a file the program writes. */
    int fd = open("/tmp/dynhello.out", O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    CHECK(fd >= 0, "open /tmp/dynhello.out errno %d", errno);
    CHECK(write(fd, "written", 7) == 7, "write");
    CHECK(pread(fd, buf, 7, 0) == 7 && memcmp(buf, "written", 7) == 0, "pread");
    close(fd);

    printf("dynhello: ok\n");
    return 3;
}
