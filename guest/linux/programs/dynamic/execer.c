/* execve in the Linux personality: a path that is not there fails and the
 * program goes on; then the program runs itself again ("child"), which
 * finds the descriptor it kept and not the close-on-exec one, and runs
 * argv[1] (another program of the root file system) in its turn. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc >= 5 && strcmp(argv[1], "child") == 0) {
        int keep = atoi(argv[3]), closed = atoi(argv[4]);
        char buf[8] = {0};
        const char *stage = getenv("STAGE");
        printf("execer: child argc=%d STAGE=%s\n", argc, stage ? stage : "(unset)");
        printf("execer: kept=%d closed=%d\n", pread(keep, buf, 4, 0) == 4 && memcmp(buf, "kept", 4) == 0,
               fcntl(closed, F_GETFD) == -1 && errno == EBADF);
        fflush(stdout);
        char *next[] = {argv[2], "from-execer", NULL};
        char *env[] = {"GREETING=exec", NULL};
        execve(argv[2], next, env);
        printf("execer: exec %s failed errno=%d\n", argv[2], errno);
        return 1;
    }
    if (argc < 2) {
        printf("usage: execer PROGRAM\n");
        return 2;
    }
    char *none[] = {"/nonexistent", NULL};
    int r = execve("/nonexistent", none, none + 1);
    printf("execer: missing r=%d errno=%d\n", r, errno);
    int keep = open("/tmp/keep", O_CREAT | O_RDWR, 0644);
    int closed = open("/tmp/closed", O_CREAT | O_RDWR | O_CLOEXEC, 0644);
    if (keep < 0 || closed < 0 || write(keep, "kept", 4) != 4) {
        printf("execer: open failed errno=%d\n", errno);
        return 1;
    }
    char k[16], c[16];
    snprintf(k, sizeof k, "%d", keep);
    snprintf(c, sizeof c, "%d", closed);
    char *args[] = {argv[0], "child", argv[1], k, c, NULL};
    char *env[] = {"STAGE=2", NULL};
    printf("execer: exec self\n");
    fflush(stdout);
    execve(argv[0], args, env);
    printf("execer: exec self failed errno=%d\n", errno);
    return 1;
}
