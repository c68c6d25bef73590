/* Threads: pthread_create (clone with the thread flags, TLS), mutexes and
 * condition variables (futex wait/wake/requeue), pthread_join
 * (CLONE_CHILD_CLEARTID), nanosleep, sched_yield; signals to one thread:
 * pthread_kill (its handler runs in that thread, whose blocked read goes
 * on) and pthread_cancel (of a thread blocked in pthread_cond_wait). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define THREADS 4
#define ROUNDS 10000

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cond = PTHREAD_COND_INITIALIZER;
static long counter;
static int turn;
static __thread long mine;

static void *worker(void *arg) {
    long id = (long)arg;
    for (int i = 0; i < ROUNDS; i++) {
        pthread_mutex_lock(&lock);
        counter++;
        mine++;
        pthread_mutex_unlock(&lock);
        if (i % 1000 == 0)
            sched_yield();
    }
    /* Take turns in id order through a condition variable. */
    pthread_mutex_lock(&lock);
    while (turn != id)
        pthread_cond_wait(&cond, &lock);
    printf("threads: worker %ld done mine=%ld\n", id, mine);
    turn++;
    pthread_cond_broadcast(&cond);
    pthread_mutex_unlock(&lock);
    return (void *)(id * 10);
}

static volatile long handled_in, waiter_tid;
static int pipefd[2];
static pthread_mutex_t held = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t never = PTHREAD_COND_INITIALIZER;

static void on_usr2(int sig) {
    (void)sig;
    handled_in = syscall(SYS_gettid);
}

static void *waiter(void *arg) {
    (void)arg;
    waiter_tid = syscall(SYS_gettid);
    char c = 0;
    /* Interrupted by the handler, restarted (SA_RESTART), then served. */
    long n = read(pipefd[0], &c, 1);
    return (void *)(n == 1 ? (long)c : -1L);
}

static void *sleeper(void *arg) {
    (void)arg;
    pthread_mutex_lock(&held);
    for (;;)
        pthread_cond_wait(&never, &held);
    return NULL;
}

/* pthread_kill and pthread_cancel: signals to one thread. */
static int one_thread_signals(void) {
    struct sigaction sa = {.sa_handler = on_usr2, .sa_flags = SA_RESTART};
    struct timespec nap = {0, 50 * 1000 * 1000};
    pthread_t w, s;
    if (sigaction(SIGUSR2, &sa, NULL) != 0 || pipe(pipefd) != 0 || pthread_create(&w, NULL, waiter, NULL) != 0)
        return 0;
    nanosleep(&nap, NULL);
    pthread_kill(w, SIGUSR2);
    nanosleep(&nap, NULL);
    int in_target = handled_in == waiter_tid && handled_in != syscall(SYS_gettid);
    void *r;
    if (write(pipefd[1], "k", 1) != 1 || pthread_join(w, &r) != 0)
        return 0;
    int read_on = (long)r == 'k';
    if (pthread_create(&s, NULL, sleeper, NULL) != 0)
        return 0;
    nanosleep(&nap, NULL);
    int cancelled = pthread_cancel(s) == 0 && pthread_join(s, &r) == 0 && r == PTHREAD_CANCELED;
    printf("threads: one-thread signals in_target=%d read_on=%d cancelled=%d\n", in_target, read_on, cancelled);
    return in_target && read_on && cancelled;
}

int main(void) {
    pthread_t t[THREADS];
    struct timespec a, b, nap = {0, 20 * 1000 * 1000};
    clock_gettime(CLOCK_MONOTONIC, &a);
    nanosleep(&nap, NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    long slept_ms = (b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000;
    printf("threads: slept %s\n", slept_ms >= 20 && slept_ms < 1000 ? "ok" : "wrong");
    for (long i = 0; i < THREADS; i++)
        if (pthread_create(&t[i], NULL, worker, (void *)i) != 0) {
            printf("threads: pthread_create failed\n");
            return 1;
        }
    long sum = 0;
    for (int i = 0; i < THREADS; i++) {
        void *r;
        pthread_join(t[i], &r);
        sum += (long)r;
    }
    printf("threads: counter=%ld joined=%ld main_tls=%ld\n", counter, sum, mine);
    if (!one_thread_signals())
        return 1;
    return counter == THREADS * ROUNDS ? 0 : 1;
}
