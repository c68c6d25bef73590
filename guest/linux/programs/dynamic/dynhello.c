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
#include <sys/mman.h>
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

    /* Private file mappings, as ld.so makes them: at an offset, the end of
     * the file in the middle of the last page, a private write, MAP_FIXED
     * over part of it, munmap of part. */
    int efd = open(exe, O_RDONLY | O_CLOEXEC);
    CHECK(efd >= 0, "open %s errno %d", exe, errno);
    long page = sysconf(_SC_PAGESIZE);
    off_t off = page * ((st.st_size / page) / 2);
    size_t tail = st.st_size - off; /* the file's bytes from off */
    size_t len = (tail / page + 2) * page;
    unsigned char *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, efd, off);
    CHECK(m != MAP_FAILED, "mmap errno %d", errno);
    unsigned char *want = malloc(tail);
    CHECK(pread(efd, want, tail, off) == (ssize_t)tail, "pread tail");
    CHECK(memcmp(m, want, tail) == 0, "mapped bytes differ from the file");
    /* The rest of the file's last page reads as zero (whole pages past
     * it would fault on Linux: not touched). */
    for (size_t i = tail; i % page != 0; i++)
        CHECK(m[i] == 0, "byte %zu past the end of the file is %d", i, m[i]);
    m[0] ^= 0xff; /* private: the file stays as it was */
    unsigned char first;
    CHECK(pread(efd, &first, 1, off) == 1 && first == want[0], "a private write reached the file");
    unsigned char *z = mmap(m + page, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED | MAP_ANONYMOUS, -1, 0);
    CHECK(z == m + page && z[0] == 0 && z[page - 1] == 0, "MAP_FIXED anonymous over a file mapping");
    CHECK(munmap(m + page, page) == 0 && m[0] == (want[0] ^ 0xff), "munmap of part");
    CHECK(mmap(NULL, page, PROT_READ, MAP_PRIVATE, efd, 1) == MAP_FAILED && errno == EINVAL, "unaligned offset accepted");
    /* Linux maps it; the personality has no page cache to share. */
    void *shared = mmap(NULL, page, PROT_READ, MAP_SHARED, efd, 0);
    printf("dynhello: shared file mapping errno=%d\n", shared == MAP_FAILED ? errno : 0);
    free(want);
    close(efd);
    printf("dynhello: mmap ok\n");

    /* And a file the program writes. */
    int fd = open("/tmp/dynhello.out", O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    CHECK(fd >= 0, "open /tmp/dynhello.out errno %d", errno);
    CHECK(write(fd, "written", 7) == 7, "write");
    CHECK(pread(fd, buf, 7, 0) == 7 && memcmp(buf, "written", 7) == 0, "pread");
    close(fd);

    printf("dynhello: ok\n");
    return 3;
}
