/* Threads: pthread_create (clone with the thread flags, TLS), mutexes and
 * condition variables (futex wait/wake/requeue), pthread_join
 * (CLONE_CHILD_CLEARTID), nanosleep, sched_yield. */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <time.h>

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
    return counter == THREADS * ROUNDS ? 0 : 1;
}
