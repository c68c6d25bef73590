/* Memory and files: brk (malloc), anonymous mmap/munmap/mremap, and the
 * in-memory file system (/dev/null, /dev/urandom, a file written, read back,
 * renamed and unlinked), pipes, epoll on a pipe. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) { printf("memfiles: FAILED %s at line %d\n", #c, __LINE__); return 1; } } while (0)

int main(void) {
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
