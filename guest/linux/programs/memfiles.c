/* Memory and files: brk (malloc), anonymous mmap/munmap/mremap, and the
 * in-memory file system (/dev/null, /dev/urandom, a file written, read back,
 * renamed and unlinked), pipes, epoll on a pipe.
 *   memfiles       those checks
 *   memfiles big   a file larger than the runtime's share of memory (run
 *                  with rtmem=32 and --memory 512): written, read back,
 *                  cut and extended, its memory the program's while it
 *                  exists and back once it is unlinked */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) { printf("memfiles: FAILED %s at line %d\n", #c, __LINE__); return 1; } } while (0)

static unsigned char at(size_t pos) {
    return (unsigned char)(pos * 7 + pos / 4093);
}

static int big(void) {
    enum { MIB = 1 << 20, SIZE = 160 * MIB };
    struct sysinfo si;
    CHECK(sysinfo(&si) == 0);
    size_t region = si.totalram * si.mem_unit, want = region / 8 * 7;
    static unsigned char buf[3 * MIB + 11];
    int fd = open("/tmp/big", O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    /* Odd-sized writes, so that they straddle the file's 2 MiB pieces. */
    for (size_t pos = 0; pos < SIZE;) {
        size_t n = sizeof buf < SIZE - pos ? sizeof buf : SIZE - pos;
        for (size_t i = 0; i < n; i++)
            buf[i] = at(pos + i);
        CHECK(write(fd, buf, n) == (ssize_t)n);
        pos += n;
    }
    struct stat st;
    CHECK(fstat(fd, &st) == 0 && st.st_size == SIZE);
    for (size_t pos = 0; pos < SIZE; pos += sizeof buf) {
        ssize_t n = pread(fd, buf, sizeof buf, pos);
        CHECK(n == (ssize_t)(sizeof buf < SIZE - pos ? sizeof buf : SIZE - pos));
        for (ssize_t i = 0; i < n; i++)
            CHECK(buf[i] == at(pos + i));
    }
    /* The file's memory is the program's: seven eighths of it is too much. */
    char *m = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    int refused = m == MAP_FAILED;
    /* Cut inside a piece, then extended: the cut bytes read as zero. */
    CHECK(ftruncate(fd, 3 * MIB + 5) == 0 && ftruncate(fd, 5 * MIB) == 0);
    CHECK(pread(fd, buf, 16, 3 * MIB) == 16);
    for (int i = 0; i < 16; i++)
        CHECK(buf[i] == (i < 5 ? at(3 * MIB + i) : 0));
    CHECK(pread(fd, buf, 16, 5 * MIB - 16) == 16 && buf[0] == 0 && buf[15] == 0);
    /* A write past the end leaves zeros in the gap. */
    CHECK(pwrite(fd, "end", 3, 9 * MIB) == 3 && pread(fd, buf, 4, 9 * MIB - 1) == 4);
    CHECK(buf[0] == 0 && memcmp(buf + 1, "end", 3) == 0);
    close(fd);
    CHECK(unlink("/tmp/big") == 0);
    m = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED);
    int zero = 1;
    for (size_t pos = 0; pos < want; pos += 4096)
        zero &= m[pos] == 0;
    printf("memfiles: big file ok mib=%d refused=%d zero=%d\n", SIZE / MIB, refused, zero);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "big") == 0)
        return big();
    /* brk and mmap through malloc, big and small. */
    char *small = malloc(100), *big = malloc(8 << 20);
    CHECK(small && big);
    memset(big, 0x5a, 8 << 20);
    free(big);
    char *m = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED && m[4096] == 0);
    m[0] = 1;
    m = mremap(m, 1 << 20, 4 << 20, MREMAP_MAYMOVE);
    CHECK(m != MAP_FAILED && m[0] == 1 && m[(4 << 20) - 1] == 0);
    CHECK(munmap(m, 4 << 20) == 0);
    char *again = mmap(NULL, 4 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(again != MAP_FAILED && again[0] == 0);
    printf("memfiles: memory ok\n");

    /* Devices. */
    int fd = open("/dev/urandom", O_RDONLY);
    unsigned char r[32] = {0};
    CHECK(fd >= 0 && read(fd, r, sizeof r) == sizeof r);
    int nonzero = 0;
    for (int i = 0; i < 32; i++) nonzero += r[i] != 0;
    CHECK(nonzero > 16);
    close(fd);
    fd = open("/dev/null", O_WRONLY);
    CHECK(fd >= 0 && write(fd, "x", 1) == 1);
    close(fd);

    /* A file: write, append, stat, seek, read, rename, unlink. */
    CHECK(chdir("/tmp") == 0);
    fd = open("note.txt", O_WRONLY | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0 && write(fd, "hello ", 6) == 6);
    close(fd);
    fd = open("/tmp/note.txt", O_WRONLY | O_APPEND);
    CHECK(fd >= 0 && write(fd, "world", 5) == 5);
    close(fd);
    struct stat st;
    CHECK(stat("note.txt", &st) == 0 && st.st_size == 11 && S_ISREG(st.st_mode));
    CHECK(rename("note.txt", "renamed.txt") == 0 && access("note.txt", F_OK) != 0);
    FILE *f = fopen("renamed.txt", "r");
    char line[64] = {0};
    CHECK(f && fgets(line, sizeof line, f) && strcmp(line, "hello world") == 0);
    fclose(f);
    char cwd[64];
    CHECK(getcwd(cwd, sizeof cwd) && strcmp(cwd, "/tmp") == 0);
    CHECK(unlink("renamed.txt") == 0 && stat("renamed.txt", &st) != 0);
    printf("memfiles: files ok\n");

    /* A pipe watched by epoll. */
    int p[2];
    CHECK(pipe2(p, O_NONBLOCK) == 0);
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.u64 = 77}, out[4];
    CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, p[0], &ev) == 0);
    CHECK(epoll_wait(ep, out, 4, 0) == 0);
    char buf[8];
    CHECK(read(p[0], buf, sizeof buf) == -1);
    CHECK(write(p[1], "ping", 4) == 4);
    CHECK(epoll_wait(ep, out, 4, 1000) == 1 && out[0].data.u64 == 77 && (out[0].events & EPOLLIN));
    CHECK(read(p[0], buf, sizeof buf) == 4 && memcmp(buf, "ping", 4) == 0);
    close(p[1]);
    CHECK(read(p[0], buf, sizeof buf) == 0);
    printf("memfiles: pipe ok\n");
    return 0;
}
