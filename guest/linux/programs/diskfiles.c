/* The persistent directory (disk=/data): files written, synced, renamed
 * and removed in one run ("write") are found by the next run on the same
 * disk ("check"), including a file never fsynced (written back at exit). */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) { printf("diskfiles: FAILED %s at line %d (errno %d)\n", #c, __LINE__, errno); return 1; } } while (0)
#define BIG (300 * 1024 + 17)

static unsigned char byte_at(int i) { return (unsigned char)(i * 7 + i / 4096); }

static int write_all(int fd, const void *p, size_t n) { return write(fd, p, n) == (ssize_t)n; }

static int do_write(void) {
    char cwd[64];
    CHECK(getcwd(cwd, sizeof cwd) && strcmp(cwd, "/data") == 0);
    /* An append-only log, synced after each record as redis does. */
    int fd = open("log.txt", O_WRONLY | O_APPEND | O_CREAT, 0644);
    CHECK(fd >= 0);
    for (int i = 0; i < 3; i++) {
        char line[32];
        int n = snprintf(line, sizeof line, "record %d\n", i);
        CHECK(write_all(fd, line, n) && fdatasync(fd) == 0);
    }
    close(fd);
    /* A big file across many blocks, written in odd pieces. */
    unsigned char *big = malloc(BIG);
    for (int i = 0; i < BIG; i++) big[i] = byte_at(i);
    fd = open("big.bin", O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    for (int at = 0; at < BIG; at += 10007) CHECK(write_all(fd, big + at, BIG - at < 10007 ? BIG - at : 10007));
    CHECK(fsync(fd) == 0);
    /* Overwrite in the middle, read back before and after sync. */
    CHECK(pwrite(fd, "MIDDLE", 6, 100000) == 6);
    char six[6];
    CHECK(pread(fd, six, 6, 100000) == 6 && memcmp(six, "MIDDLE", 6) == 0);
    CHECK(fsync(fd) == 0);
    close(fd);
    /* Write a temporary file, then rename it into place (a rewrite). */
    CHECK(mkdir("sub", 0755) == 0 && mkdir("sub", 0755) == -1 && errno == EEXIST);
    fd = open("sub/tmp", O_WRONLY | O_CREAT | O_EXCL, 0644);
    CHECK(fd >= 0 && write_all(fd, "new content", 11) && fsync(fd) == 0);
    close(fd);
    fd = open("final.txt", O_WRONLY | O_CREAT, 0644);
    CHECK(fd >= 0 && write_all(fd, "old content, longer", 19) && fsync(fd) == 0);
    close(fd);
    CHECK(rename("sub/tmp", "final.txt") == 0);
    CHECK(rmdir("/data") == -1 && errno == EBUSY);
    CHECK(rename("final.txt", "/tmp/x") == -1 && errno == EXDEV);
    fd = open("gone.txt", O_WRONLY | O_CREAT, 0644);
    CHECK(fd >= 0 && write_all(fd, "x", 1));
    close(fd);
    CHECK(unlink("gone.txt") == 0 && access("gone.txt", F_OK) == -1 && errno == ENOENT);
    /* Never fsynced: written back when the program exits. */
    fd = open("/data/unsynced.txt", O_WRONLY | O_CREAT, 0644);
    CHECK(fd >= 0 && write_all(fd, "written at exit", 15));
    close(fd);
    printf("diskfiles: wrote\n");
    return 0;
}

static int do_check(void) {
    char buf[64] = {0};
    int fd = open("log.txt", O_RDONLY);
    CHECK(fd >= 0 && read(fd, buf, sizeof buf) == 27 && strcmp(buf, "record 0\nrecord 1\nrecord 2\n") == 0);
    close(fd);
    struct stat st;
    CHECK(stat("big.bin", &st) == 0 && st.st_size == BIG && S_ISREG(st.st_mode));
    unsigned char *big = malloc(BIG);
    FILE *f = fopen("big.bin", "r");
    CHECK(f && fread(big, 1, BIG, f) == BIG);
    fclose(f);
    for (int i = 0; i < BIG; i++) {
        unsigned char want = (i >= 100000 && i < 100006) ? "MIDDLE"[i - 100000] : byte_at(i);
        CHECK(big[i] == want);
    }
    memset(buf, 0, sizeof buf);
    fd = open("final.txt", O_RDONLY);
    CHECK(fd >= 0 && read(fd, buf, sizeof buf) == 11 && strcmp(buf, "new content") == 0);
    close(fd);
    memset(buf, 0, sizeof buf);
    fd = open("unsynced.txt", O_RDONLY);
    CHECK(fd >= 0 && read(fd, buf, sizeof buf) == 15 && strcmp(buf, "written at exit") == 0);
    close(fd);
    /* The directory listing: exactly what the first run left. */
    DIR *d = opendir(".");
    CHECK(d);
    char names[256] = {0};
    struct dirent *e;
    while ((e = readdir(d))) {
        strcat(names, e->d_name);
        strcat(names, e->d_type == DT_DIR ? "/ " : " ");
    }
    closedir(d);
    CHECK(strcmp(names, "big.bin final.txt log.txt sub/ unsynced.txt ") == 0);
    printf("diskfiles: check ok\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 2 && strcmp(argv[1], "write") == 0) return do_write();
    if (argc == 2 && strcmp(argv[1], "check") == 0) return do_check();
    printf("diskfiles: usage: diskfiles write|check\n");
    return 2;
}
