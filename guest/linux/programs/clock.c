/* The clock calls through the vDSO (AT_SYSINFO_EHDR) agree with the system
 * calls: each vDSO reading lies between the system-call readings taken
 * just before and after it, for every clock libc reads through it. */
#include <stdio.h>
#include <sys/auxv.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long ns(struct timespec t) { return t.tv_sec * 1000000000LL + t.tv_nsec; }

static int ordered(clockid_t clk) {
    struct timespec before, via_libc, after;
    for (int i = 0; i < 1000; i++) {
        if (syscall(SYS_clock_gettime, clk, &before) || clock_gettime(clk, &via_libc) || syscall(SYS_clock_gettime, clk, &after))
            return 0;
        /* CLOCK_REALTIME is guest time plus a base: both move together. */
        if (ns(before) > ns(via_libc) || ns(via_libc) > ns(after))
            return 0;
    }
    return 1;
}

int main(void) {
    printf("clock: vdso=%s\n", getauxval(AT_SYSINFO_EHDR) ? "yes" : "no");
    printf("clock: monotonic ordered=%d realtime ordered=%d\n", ordered(CLOCK_MONOTONIC), ordered(CLOCK_REALTIME));
    struct timeval tv;
    struct timespec ts;
    if (gettimeofday(&tv, NULL) || clock_gettime(CLOCK_REALTIME, &ts))
        return 1;
    time_t t = time(NULL);
    /* gettimeofday and time() go through the same clock: within a second. */
    long long a = tv.tv_sec, b = ts.tv_sec, c = t;
    printf("clock: agree=%d\n", b - a <= 1 && b >= a && c - b <= 1 && c >= b);
    printf("clock: bad clock=%d\n", clock_gettime(12345, &ts) == -1);
    return 0;
}
