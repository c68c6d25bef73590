/* Processes: fork, each child with its own copy of the parent's memory
 * (image data, heap, stack, mmap), pipes between them, wait4 (blocking,
 * WNOHANG, exit and signal statuses, ECHILD), waitid, getpid/getppid, kill with
 * SIGTERM/SIGKILL/SIGUSR1, nested fork, SIGCHLD ignored (no zombies).
 *   fork              the checks (run with rtmem=96 and --memory 512):
 *                     "fork: ... ok" lines
 *   fork bench        fork cost by size, copy-on-write costs and process-switch
 *                     cost instead
 *   fork slow MS      one child working for MS ms (for failover tests)
 *   fork oom          copy-on-write with too little memory for the copies
 *                     (run with rtmem=96 and --memory 512): the child is
 *                     killed, whether it writes or the parent does
 *   fork cowloop MS   copy-on-write faults without pause for MS ms: forks
 *                     and writes of parent and children into shared memory
 *                     (for failover tests: checkpoints land in the faults) */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/sysinfo.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) { printf("fork: FAILED %s at line %d (errno %d)\n", #c, __LINE__, errno); exit(1); } } while (0)

static char data[8192];

static long now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000L + t.tv_nsec / 1000;
}

static int all(const char *p, size_t n, char c) {
    for (size_t i = 0; i < n; i++)
        if (p[i] != c)
            return 0;
    return 1;
}

/* Read until EOF into buf; returns the length. */
static size_t slurp(int fd, char *buf, size_t cap) {
    size_t got = 0;
    ssize_t n;
    while (got < cap && (n = read(fd, buf + got, cap - got)) > 0)
        got += n;
    return got;
}

static void copies(void) {
    char stack[4096];
    char *heap = malloc(1 << 20);
    char *map = mmap(NULL, 4 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(heap && map != MAP_FAILED);
    memset(data, 'P', sizeof data);
    memset(stack, 'P', sizeof stack);
    memset(heap, 'P', 1 << 20);
    memset(map, 'P', 4 << 20);
    int p[2];
    CHECK(pipe(p) == 0);
    pid_t parent = getpid();
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(p[0]);
        int saw = all(data, sizeof data, 'P') && all(stack, sizeof stack, 'P') && all(heap, 1 << 20, 'P') && all(map, 4 << 20, 'P');
        memset(data, 'C', sizeof data);
        memset(stack, 'C', sizeof stack);
        memset(heap, 'C', 1 << 20);
        memset(map, 'C', 4 << 20);
        /* New memory in the child: backed on demand. */
        char *more = malloc(16 << 20);
        memset(more, 'N', 16 << 20);
        int kept = all(data, sizeof data, 'C') && all(heap, 1 << 20, 'C') && all(more, 16 << 20, 'N');
        /* More than the runtime keeps for itself (run with rtmem=96): the
         * child's frames come from the program region's free memory. */
        char *beyond = mmap(NULL, 160 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        int big = beyond != MAP_FAILED && all(beyond, 4096, 0);
        for (size_t at = 0; big && at < (160 << 20); at += 2 << 20)
            beyond[at] = 'B';
        /* More than the region holds: refused, and the child goes on. */
        struct sysinfo si;
        CHECK(sysinfo(&si) == 0);
        char *huge = mmap(NULL, si.totalram * si.mem_unit, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        int refused = big && huge == MAP_FAILED && errno == ENOMEM;
        char *after = mmap(NULL, 2 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        refused = refused && after != MAP_FAILED && all(after, 2 << 20, 0);
        dprintf(p[1], "pid=%d ppid_ok=%d saw=%d kept=%d refused=%d", (int)getpid(), getppid() == parent, saw, kept, refused);
        _exit(7);
    }
    close(p[1]);
    char msg[128] = {0};
    slurp(p[0], msg, sizeof msg - 1);
    close(p[0]);
    char want[128];
    snprintf(want, sizeof want, "pid=%d ppid_ok=1 saw=1 kept=1 refused=1", (int)pid);
    if (strcmp(msg, want) != 0)
        printf("fork: child said [%s]\n", msg);
    CHECK(strcmp(msg, want) == 0);
    CHECK(pid != parent && getpid() == parent);
    CHECK(all(data, sizeof data, 'P') && all(stack, sizeof stack, 'P') && all(heap, 1 << 20, 'P') && all(map, 4 << 20, 'P'));
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 7);
    CHECK(waitpid(-1, &st, WNOHANG) == -1 && errno == ECHILD);
    /* The child made the first getppid: its site, rewritten there into a
     * jump (syscall=jmp), is rewritten in this copy of the text too, so
     * these do not trap (the e2e test counts the traps). */
    pid_t pp = getppid();
    for (int i = 0; i < 2000; i++)
        CHECK(getppid() == pp);
    printf("fork: copy ok child_status=%d\n", WEXITSTATUS(st));
    free(heap);
    munmap(map, 4 << 20);
}

/* A child's memory comes out of the free memory of the region the parent's
 * comes from (the personality's memory model): while a child holds a
 * quarter of the region (more than the runtime's share, rtmem=96), the
 * parent cannot map seven eighths of it; once the child is reaped it can,
 * and that memory reads as zero (the child's frames were zeroed on the
 * way back). */
static void shared_region(void) {
    struct sysinfo si;
    CHECK(sysinfo(&si) == 0);
    size_t region = si.totalram * si.mem_unit, hold = region / 4, want = region / 8 * 7;
    int ready[2], done[2];
    CHECK(pipe(ready) == 0 && pipe(done) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(ready[0]);
        close(done[1]);
        char *m = mmap(NULL, hold, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(m != MAP_FAILED);
        for (size_t at = 0; at < hold; at += 4096)
            m[at] = 'H';
        CHECK(write(ready[1], "r", 1) == 1);
        char c;
        CHECK(read(done[0], &c, 1) == 0);
        _exit(all(m, 1, 'H') ? 5 : 6);
    }
    close(ready[1]);
    close(done[0]);
    char c;
    CHECK(read(ready[0], &c, 1) == 1);
    char *m = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    int refused = m == MAP_FAILED && errno == ENOMEM;
    close(done[1]);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st));
    m = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED);
    int zero = 1;
    for (size_t at = 0; at < want; at += 4096)
        zero &= m[at] == 0;
    CHECK(munmap(m, want) == 0);
    close(ready[0]);
    printf("fork: shared region ok refused=%d zero=%d status=%d\n", refused, zero, WEXITSTATUS(st));
}

static void several(void) {
    enum { N = 4 };
    int go[2], back[2];
    CHECK(pipe(go) == 0 && pipe(back) == 0);
    pid_t pids[N];
    for (int i = 0; i < N; i++) {
        pids[i] = fork();
        CHECK(pids[i] >= 0);
        if (pids[i] == 0) {
            close(go[1]);
            close(back[0]);
            char c;
            /* Wait for the parent's word (EOF when it closes the pipe). */
            CHECK(read(go[0], &c, 1) == 0);
            data[0] = (char)('a' + i);
            CHECK(write(back[1], data, 1) == 1);
            _exit(10 + i);
        }
    }
    close(go[0]);
    close(back[1]);
    int st;
    /* Every child is waiting: nothing to reap yet. */
    CHECK(waitpid(-1, &st, WNOHANG) == 0);
    close(go[1]);
    char got[N + 1] = {0};
    CHECK(slurp(back[0], got, N) == N);
    close(back[0]);
    int seen = 0, sum = 0;
    for (int i = 0; i < N; i++) {
        pid_t pid = waitpid(-1, &st, 0);
        CHECK(pid > 0 && WIFEXITED(st));
        for (int j = 0; j < N; j++)
            if (pids[j] == pid) {
                CHECK(WEXITSTATUS(st) == 10 + j);
                seen |= 1 << j;
            }
        sum += WEXITSTATUS(st);
    }
    CHECK(seen == (1 << N) - 1);
    CHECK(waitpid(-1, &st, 0) == -1 && errno == ECHILD);
    int letters = 0;
    for (int i = 0; i < N; i++)
        letters |= 1 << (got[i] - 'a');
    CHECK(letters == (1 << N) - 1);
    printf("fork: several ok children=%d statuses=%d\n", N, sum);
}

static void signals(void) {
    int sigs[] = {SIGTERM, SIGKILL, SIGUSR1};
    for (int i = 0; i < 3; i++) {
        int p[2];
        CHECK(pipe(p) == 0);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            char c;
            read(p[0], &c, 1); /* blocks: the parent never writes */
            _exit(99);
        }
        CHECK(kill(pid, 0) == 0);
        CHECK(kill(pid, sigs[i]) == 0);
        int st;
        CHECK(waitpid(pid, &st, 0) == pid);
        CHECK(WIFSIGNALED(st) && WTERMSIG(st) == sigs[i]);
        CHECK(kill(pid, 0) == -1 && errno == ESRCH);
        close(p[0]);
        close(p[1]);
    }
    printf("fork: kill ok SIGTERM SIGKILL SIGUSR1\n");
}

/* Copy-on-write: memory shared after fork is written by the parent, by
 * each of several children, by a thread of the parent, by a grandchild,
 * and by the runtime (read() into a shared buffer); every process sees
 * its own writes alone. One child ends without writing (its share is
 * dropped while shared). */
static char *cow_mem;
static size_t cow_len;

static void *cow_writer(void *arg) {
    (void)arg;
    /* A thread of the parent: the parent's own copy. */
    memset(cow_mem + cow_len / 2, 'T', cow_len / 2);
    return NULL;
}

static void cow(void) {
    enum { N = 4 };
    cow_len = 6 << 20; /* three chunks or more, unaligned */
    cow_mem = mmap(NULL, cow_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(cow_mem != MAP_FAILED);
    memset(cow_mem, 'P', cow_len);
    memset(data, 'P', sizeof data);
    int go[2], back[2], feed[2];
    CHECK(pipe(go) == 0 && pipe(back) == 0 && pipe(feed) == 0);
    pid_t pids[N];
    for (int i = 0; i < N; i++) {
        pids[i] = fork();
        CHECK(pids[i] >= 0);
        if (pids[i] == 0) {
            close(go[1]);
            close(back[0]);
            char c;
            /* EOF once the parent has written its copy. */
            CHECK(read(go[0], &c, 1) == 0);
            int ok = all(cow_mem, cow_len, 'P') && all(data, sizeof data, 'P');
            if (i == N - 1) {
                /* Ends still sharing everything. */
                dprintf(back[1], "%c%d", 'a' + i, ok);
                _exit(30 + i);
            }
            char mine = (char)('a' + i);
            if (i == 0) {
                /* The runtime writes into shared memory: read() lands in
                 * the middle of a chunk this child shares. */
                char *at = cow_mem + (3 << 20) + 100;
                ok = ok && slurp(feed[0], at, 10) == 10 && memcmp(at, "0123456789", 10) == 0;
                ok = ok && all(cow_mem, (3 << 20) + 100, 'P') && all(at + 10, cow_len - (3 << 20) - 110, 'P');
            }
            memset(cow_mem, mine, cow_len);
            data[0] = mine;
            ok = ok && all(cow_mem, cow_len, mine);
            if (i == 1) {
                /* A fork of a fork: the grandchild shares this child's
                 * copy, writes its own, and the child keeps its own. */
                pid_t g = fork();
                CHECK(g >= 0);
                if (g == 0) {
                    int seen = all(cow_mem, cow_len, mine);
                    memset(cow_mem, 'G', cow_len);
                    _exit(seen && all(cow_mem, cow_len, 'G') ? 40 : 41);
                }
                int st;
                CHECK(waitpid(g, &st, 0) == g);
                ok = ok && WIFEXITED(st) && WEXITSTATUS(st) == 40 && all(cow_mem, cow_len, mine);
            }
            dprintf(back[1], "%c%d", mine, ok);
            _exit(30 + i);
        }
    }
    close(go[0]);
    close(back[1]);
    close(feed[0]);
    /* The parent writes after the children were made: half directly,
     * half from a thread; none of it reaches them. */
    memset(cow_mem, 'Q', cow_len / 2);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, cow_writer, NULL) == 0);
    CHECK(pthread_join(t, NULL) == 0);
    data[0] = 'Q';
    CHECK(write(feed[1], "0123456789", 10) == 10);
    close(feed[1]);
    close(go[1]);
    char got[2 * N + 1] = {0};
    CHECK(slurp(back[0], got, 2 * N) == 2 * N);
    close(back[0]);
    int sum = 0;
    for (int i = 0; i < N; i++) {
        int st;
        CHECK(waitpid(pids[i], &st, 0) == pids[i] && WIFEXITED(st));
        sum += WEXITSTATUS(st);
    }
    int oks = 0;
    for (int i = 0; i < N; i++)
        oks += got[2 * i + 1] == '1';
    if (oks != N)
        printf("fork: cow children said [%s]\n", got);
    CHECK(oks == N);
    CHECK(all(cow_mem, cow_len / 2, 'Q') && all(cow_mem + cow_len / 2, cow_len / 2, 'T') && data[0] == 'Q' && data[1] == 'P');
    CHECK(munmap(cow_mem, cow_len) == 0);
    printf("fork: copy-on-write ok children=%d statuses=%d\n", N, sum);
}

static void streams_and_nesting(void) {
    /* A child writes more than a pipe holds: both sides block in turn. */
    int p[2];
    CHECK(pipe(p) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        static char chunk[4096];
        for (int i = 0; i < 256; i++) {
            memset(chunk, i, sizeof chunk);
            CHECK(write(p[1], chunk, sizeof chunk) == sizeof chunk);
        }
        /* A grandchild, reaped here. */
        pid_t g = fork();
        if (g == 0)
            _exit(getppid() == getpid() ? 1 : 3);
        int st;
        CHECK(waitpid(g, &st, 0) == g && WIFEXITED(st));
        _exit(20 + WEXITSTATUS(st));
    }
    close(p[1]);
    static char buf[1 << 20];
    size_t n = slurp(p[0], buf, sizeof buf);
    CHECK(n == 256 * 4096);
    for (size_t i = 0; i < n; i++)
        CHECK((unsigned char)buf[i] == (i / 4096) % 256);
    close(p[0]);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 23);
    printf("fork: stream ok bytes=%zu nested_status=%d\n", n, WEXITSTATUS(st));
}

/* vfork is served as fork (the child has its own copy, which vfork's
 * callers cannot tell); posix_spawn's clone(CLONE_VM|CLONE_VFORK), a child
 * sharing the parent's memory, is not supported: ENOSYS, reported once. */
static void vfork_and_spawn(void) {
    pid_t pid = vfork();
    if (pid == 0)
        _exit(9);
    int st;
    CHECK(pid > 0 && waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 9);
    char *argv[] = {"true", NULL};
    CHECK(posix_spawn(&pid, "/bin/true", NULL, NULL, argv, NULL) == ENOSYS);
    printf("fork: vfork ok status=%d spawn=ENOSYS\n", WEXITSTATUS(st));
}

/* waitid: siginfo for an exit and a kill; WNOHANG with a running child. */
static void waitid_info(void) {
    pid_t pid = fork();
    if (pid == 0)
        _exit(6);
    siginfo_t info;
    memset(&info, 0xff, sizeof info);
    CHECK(waitid(P_PID, pid, &info, WEXITED) == 0);
    CHECK(info.si_signo == SIGCHLD && info.si_code == CLD_EXITED && info.si_pid == pid && info.si_status == 6);
    pid = fork();
    if (pid == 0)
        for (;;)
            pause();
    memset(&info, 0xff, sizeof info);
    CHECK(waitid(P_ALL, 0, &info, WEXITED | WNOHANG) == 0 && info.si_pid == 0);
    CHECK(kill(pid, SIGKILL) == 0);
    CHECK(waitid(P_ALL, 0, &info, WEXITED) == 0);
    CHECK(info.si_code == CLD_KILLED && info.si_pid == pid && info.si_status == SIGKILL);
    CHECK(waitid(P_ALL, 0, &info, WEXITED) == -1 && errno == ECHILD);
    printf("fork: waitid ok\n");
}

static volatile sig_atomic_t chld_count, usr2_seen, usr2_masked;
static int report_fd;

static void on_chld(int s) {
    (void)s;
    chld_count++;
}

static void on_usr2(int s) {
    (void)s;
    double x = 1.5; /* SSE state in the handler, restored after it */
    usr2_seen = (int)(x * 2.0);
    sigset_t cur;
    sigprocmask(SIG_BLOCK, NULL, &cur);
    usr2_masked = sigismember(&cur, SIGUSR2);
}

/* A signal blocked by sigprocmask waits, and runs as the unblocking call
 * ends; its handler runs with it blocked, and the old mask comes back. */
static void masks(void) {
    struct sigaction sa = {0};
    sa.sa_handler = on_usr2;
    CHECK(sigaction(SIGUSR2, &sa, NULL) == 0);
    usr2_seen = usr2_masked = 0;
    sigset_t set, old, cur;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR2);
    CHECK(sigprocmask(SIG_BLOCK, &set, &old) == 0);
    CHECK(kill(getpid(), SIGUSR2) == 0);
    int waited = usr2_seen == 0;
    CHECK(sigprocmask(SIG_SETMASK, &old, NULL) == 0);
    CHECK(usr2_seen == 3 && usr2_masked == 1);
    CHECK(sigprocmask(SIG_BLOCK, NULL, &cur) == 0 && !sigismember(&cur, SIGUSR2));
    signal(SIGUSR2, SIG_DFL);
    printf("fork: masks ok waited=%d handler_masked=%d\n", waited, (int)usr2_masked);
}

static void on_usr1_exit(int s) {
    (void)s;
    write(report_fd, "usr1", 4);
    _exit(11);
}

/* A child blocked in read gets SIGUSR2: its handler runs, and the read is
 * made again (SA_RESTART) or returns EINTR. */
static int interrupted_read(int flags) {
    int a[2], ready[2];
    CHECK(pipe(a) == 0 && pipe(ready) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        struct sigaction sa = {0};
        sa.sa_handler = on_usr2;
        sa.sa_flags = flags;
        CHECK(sigaction(SIGUSR2, &sa, NULL) == 0);
        CHECK(write(ready[1], "r", 1) == 1);
        char c = 0;
        ssize_t n = read(a[0], &c, 1);
        if (flags & SA_RESTART)
            _exit(n == 1 && c == 'x' && usr2_seen == 3 ? 12 : 1);
        _exit(n == -1 && errno == EINTR && usr2_seen == 3 ? 13 : 1);
    }
    char c;
    CHECK(read(ready[0], &c, 1) == 1);
    struct timespec nap = {0, 20 * 1000 * 1000};
    nanosleep(&nap, NULL); /* the child is blocked in its read by now */
    CHECK(kill(pid, SIGUSR2) == 0);
    nanosleep(&nap, NULL);
    CHECK(write(a[1], "x", 1) == 1);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st));
    close(a[0]);
    close(a[1]);
    close(ready[0]);
    close(ready[1]);
    return WEXITSTATUS(st);
}

/* Handlers: SIGCHLD in the parent (its waitpid restarted), SIGUSR2 in a
 * child, restarted and not, SIGUSR1 in a child that exits from it (as
 * redis-server's BGSAVE child does). */
static void handlers(void) {
    struct sigaction sa = {0};
    sa.sa_handler = on_chld;
    sa.sa_flags = SA_RESTART;
    CHECK(sigaction(SIGCHLD, &sa, NULL) == 0);
    pid_t pid = fork();
    if (pid == 0)
        _exit(0);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid);
    CHECK(chld_count == 1);
    int restarted = interrupted_read(SA_RESTART), cut = interrupted_read(0);
    CHECK(restarted == 12 && cut == 13);
    int p[2];
    CHECK(pipe(p) == 0);
    pid = fork();
    if (pid == 0) {
        report_fd = p[1];
        struct sigaction su = {0};
        su.sa_handler = on_usr1_exit;
        CHECK(sigaction(SIGUSR1, &su, NULL) == 0);
        CHECK(write(p[1], "r", 1) == 1);
        for (;;)
            pause();
    }
    char msg[8] = {0};
    CHECK(read(p[0], msg, 1) == 1);
    CHECK(kill(pid, SIGUSR1) == 0);
    CHECK(read(p[0], msg, 4) == 4 && memcmp(msg, "usr1", 4) == 0);
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 11);
    close(p[0]);
    close(p[1]);
    CHECK(chld_count == 4);
    signal(SIGCHLD, SIG_DFL);
    printf("fork: handlers ok sigchld=%d restarted=%d interrupted=%d usr1=%d\n", (int)chld_count, restarted, cut, WEXITSTATUS(st));
}

static int blocked_fd;

static void *blocked_reader(void *arg) {
    (void)arg;
    char c;
    read(blocked_fd, &c, 1); /* never written: ends with the process */
    return NULL;
}

/* A child with a second thread blocked in a read ends (by _exit, then by
 * SIGTERM): the read gives up, so the pipe's read end it held is closed and
 * the parent's write then finds no reader (EPIPE). */
static void threads_in_child(void) {
    signal(SIGPIPE, SIG_IGN);
    for (int killed = 0; killed < 2; killed++) {
        int a[2], ready[2];
        CHECK(pipe(a) == 0 && pipe(ready) == 0);
        pid_t pid = fork();
        if (pid == 0) {
            close(a[1]);
            blocked_fd = a[0];
            pthread_t t;
            CHECK(pthread_create(&t, NULL, blocked_reader, NULL) == 0);
            struct timespec nap = {0, 20 * 1000 * 1000};
            nanosleep(&nap, NULL); /* the reader is blocked by now */
            close(a[0]);
            if (!killed)
                _exit(4);
            CHECK(write(ready[1], "r", 1) == 1);
            for (;;)
                pause();
        }
        close(a[0]);
        close(ready[1]);
        int st;
        if (killed) {
            char c;
            CHECK(read(ready[0], &c, 1) == 1);
            CHECK(kill(pid, SIGTERM) == 0);
            CHECK(waitpid(pid, &st, 0) == pid && WIFSIGNALED(st) && WTERMSIG(st) == SIGTERM);
        } else {
            CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st) && WEXITSTATUS(st) == 4);
        }
        CHECK(write(a[1], "x", 1) == -1 && errno == EPIPE);
        close(a[1]);
        close(ready[0]);
    }
    signal(SIGPIPE, SIG_DFL);
    printf("fork: threads in a child ok\n");
}

static void ignored_sigchld(void) {
    signal(SIGCHLD, SIG_IGN);
    pid_t pid = fork();
    if (pid == 0)
        _exit(5);
    int st;
    /* No zombie is kept: wait finds no child once it is gone. */
    CHECK(waitpid(-1, &st, 0) == -1 && errno == ECHILD);
    signal(SIGCHLD, SIG_DFL);
    printf("fork: sigchld ignored ok\n");
}

static int pingfd[2], pongfd[2];

static void *ponger(void *arg) {
    (void)arg;
    char c;
    while (read(pingfd[0], &c, 1) == 1 && c)
        write(pongfd[1], &c, 1);
    return NULL;
}

/* Round trips through two pipes: between threads of one process, then
 * between two processes. The difference is two address-space switches. */
static void bench(void) {
    enum { ROUNDS = 2000 };
    CHECK(pipe(pingfd) == 0 && pipe(pongfd) == 0);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, ponger, NULL) == 0);
    char c = 1;
    long t0 = now_us();
    for (int i = 0; i < ROUNDS; i++)
        CHECK(write(pingfd[1], &c, 1) == 1 && read(pongfd[0], &c, 1) == 1);
    long threads = now_us() - t0;
    c = 0;
    write(pingfd[1], &c, 1);
    pthread_join(t, NULL);
    pid_t pid = fork();
    if (pid == 0) {
        ponger(NULL);
        _exit(0);
    }
    c = 1;
    t0 = now_us();
    for (int i = 0; i < ROUNDS; i++)
        CHECK(write(pingfd[1], &c, 1) == 1 && read(pongfd[0], &c, 1) == 1);
    long procs = now_us() - t0;
    c = 0;
    write(pingfd[1], &c, 1);
    waitpid(pid, NULL, 0);
    printf("fork: bench round_trip_threads_ns=%ld round_trip_processes_ns=%ld switch_ns=%ld\n", threads * 1000 / ROUNDS,
           procs * 1000 / ROUNDS, (procs - threads) * 1000 / ROUNDS / 2);
    /* Each size twice: the first fork also pays for the first touch of
     * memory it needs (a host and a shadow page fault per page on these
     * hosts); the second reuses it. Then the cost of copy-on-write: the
     * child writes one byte into each 2 MiB chunk of the first 64 MiB (a
     * fault and a copy each under the personality, a 4 KiB copy natively),
     * then, while the child still lives, the parent into the same ones
     * (now its own alone: a fault each, no copy), and once the child is
     * gone into every chunk (no fault). 1 GiB only if the VM has room for
     * it (--memory 2048). */
    struct sysinfo si;
    CHECK(sysinfo(&si) == 0);
    int top = (unsigned long)si.totalram * si.mem_unit >= (1536UL << 20) ? 8 : 6;
    for (int k = 0; k < top; k++) {
        int mib = 16 << (2 * (k / 2));
        size_t len = (size_t)mib << 20, chunk = 2 << 20, probe = len < (64 << 20) ? len : (64 << 20);
        char *m = malloc(len);
        CHECK(m);
        memset(m, 1, len);
        int res[2], go[2];
        CHECK(pipe(res) == 0 && pipe(go) == 0);
        long f0 = now_us();
        pid = fork();
        if (pid == 0) {
            /* Not before the parent has its fork's time: the scheduler may
             * run the child first. */
            char c;
            close(go[1]);
            CHECK(read(go[0], &c, 1) == 1);
            long c0 = now_us();
            for (size_t at = 0; at < probe; at += chunk)
                m[at] = 2;
            long child = now_us() - c0;
            write(res[1], &child, sizeof child);
            /* Alive while the parent writes (EOF when it is done). */
            read(go[0], &c, 1);
            _exit(0);
        }
        long took = now_us() - f0;
        CHECK(write(go[1], "g", 1) == 1);
        long child = -1;
        CHECK(read(res[0], &child, sizeof child) == sizeof child);
        long p0 = now_us();
        for (size_t at = 0; at < probe; at += chunk)
            m[at] = 3;
        long parent = now_us() - p0;
        close(go[1]);
        waitpid(pid, NULL, 0);
        /* Once the child is gone, what it shared is the parent's alone
         * and writable again: no fault. */
        long a0 = now_us();
        for (size_t at = 0; at < len; at += chunk)
            m[at + 1] = 4;
        long after = now_us() - a0;
        close(res[1]);
        close(go[0]);
        printf("fork: bench touched_mib=%d %s fork_us=%ld child_write_us_per_chunk=%ld parent_write_us_per_chunk=%ld "
               "after_ns_per_chunk=%ld\n",
               mib, k % 2 ? "warm" : "cold", took, child / (long)(probe / chunk), parent / (long)(probe / chunk),
               after * 1000 / (long)(len / chunk));
        free(m);
    }
}

/* A child that works for `ms` milliseconds (sleeping in steps, checking its
 * copy of memory after each), reporting through a pipe. */
static void slow(int ms) {
    char *m = malloc(8 << 20);
    memset(m, 'S', 8 << 20);
    int p[2];
    CHECK(pipe(p) == 0);
    pid_t pid = fork();
    if (pid == 0) {
        close(p[0]);
        long end = now_us() + ms * 1000L;
        int steps = 0;
        while (now_us() < end) {
            struct timespec nap = {0, 10 * 1000 * 1000};
            nanosleep(&nap, NULL);
            CHECK(all(m, 8 << 20, 'S'));
            steps++;
        }
        memset(m, 'X', 8 << 20);
        dprintf(p[1], "steps=%d", steps > 0);
        _exit(42);
    }
    close(p[1]);
    printf("fork: slow child started\n");
    memset(m, 'T', 8 << 20);
    char msg[64] = {0};
    slurp(p[0], msg, sizeof msg - 1);
    int st;
    CHECK(waitpid(pid, &st, 0) == pid && WIFEXITED(st));
    CHECK(all(m, 8 << 20, 'T'));
    printf("fork: slow child done %s status=%d\n", msg, WEXITSTATUS(st));
}

/* Three quarters of the region written, then shared with a child: there
 * is no memory for a copy of all of it. When the child writes it all, it
 * is killed at the write that finds none (SIGKILL, as Linux's OOM killer);
 * when the parent does, the child sharing the memory is killed, and the
 * parent keeps its memory and goes on. */
static void oom(void) {
    struct sysinfo si;
    CHECK(sysinfo(&si) == 0);
    size_t len = (size_t)si.totalram * si.mem_unit / 4 * 3;
    char *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(m != MAP_FAILED);
    memset(m, 'P', len);
    for (int parent_writes = 0; parent_writes < 2; parent_writes++) {
        int p[2];
        CHECK(pipe(p) == 0);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            close(p[1]);
            char c;
            if (parent_writes) {
                /* Killed while blocked here, sharing everything. */
                read(p[0], &c, 1);
                _exit(all(m, len, 'P') ? 3 : 4);
            }
            memset(m, 'C', len);
            _exit(5);
        }
        close(p[0]);
        if (parent_writes)
            memset(m, 'Q', len);
        int st;
        CHECK(waitpid(pid, &st, 0) == pid);
        close(p[1]);
        CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL);
        CHECK(all(m, len, parent_writes ? 'Q' : 'P'));
        printf("fork: oom %s ok child killed by %d\n", parent_writes ? "parent writes" : "child writes", WTERMSIG(st));
    }
    munmap(m, len);
}

/* For `ms` milliseconds: the parent writes its mark into every chunk of a
 * 32 MiB buffer (after the previous child ended: a fault each that only
 * gives write access back), forks a child that checks the marks and
 * writes its own into one chunk (a fault that copies), writes another
 * chunk itself (a fault that moves the child to a copy) and checks, after
 * reaping the child, that it reads its own marks alone. */
static void cowloop(int ms) {
    enum { LEN = 32 << 20, CHUNK = 2 << 20 };
    char *m = malloc(LEN);
    CHECK(m);
    memset(m, 0, LEN);
    printf("fork: cowloop started\n");
    long end = now_us() + ms * 1000L;
    int rounds = 0, bad = 0;
    for (unsigned char mark = 1; now_us() < end; mark = mark % 100 + 1, rounds++) {
        for (size_t at = 0; at < LEN; at += CHUNK)
            m[at] = (char)mark;
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            int ok = 1;
            for (size_t at = 0; at < LEN; at += CHUNK)
                ok = ok && m[at] == (char)mark;
            m[0] = (char)(mark + 100);
            _exit(ok && m[0] == (char)(mark + 100) && m[CHUNK] == (char)mark ? 0 : 1);
        }
        m[CHUNK] = (char)(mark + 50);
        int st;
        CHECK(waitpid(pid, &st, 0) == pid);
        bad += !WIFEXITED(st) || WEXITSTATUS(st) != 0;
        for (size_t at = 0; at < LEN; at += CHUNK)
            bad += m[at] != (char)(at == CHUNK ? mark + 50 : mark);
    }
    printf("fork: cowloop done rounds=%d bad=%d\n", rounds > 0, bad);
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IONBF, 0);
    if (argc == 3 && strcmp(argv[1], "slow") == 0) {
        slow(atoi(argv[2]));
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "oom") == 0) {
        oom();
        return 0;
    }
    if (argc == 3 && strcmp(argv[1], "cowloop") == 0) {
        cowloop(atoi(argv[2]));
        return 0;
    }
    if (argc == 2 && strcmp(argv[1], "bench") == 0) {
        bench();
        return 0;
    }
    copies();
    shared_region();
    several();
    cow();
    signals();
    streams_and_nesting();
    vfork_and_spawn();
    waitid_info();
    handlers();
    masks();
    threads_in_child();
    ignored_sigchld();
    printf("fork: all ok\n");
    return 0;
}
