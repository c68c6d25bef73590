/* A program that dereferences a null pointer (or, with argument "call",
 * calls a null function pointer; with "child", writes through one in a
 * forked child, after a write into memory it shares with its parent): the
 * VM reports the fault. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

typedef long (*fn)(long);

int main(int argc, char **argv) {
    printf("fault: about to fault\n");
    fflush(stdout);
    if (argc > 1 && strcmp(argv[1], "call") == 0) {
        volatile fn f = 0;
        long r = f(0);
        printf("fault: the null call returned %ld\n", r);
        return 3;
    }
    if (argc > 1 && strcmp(argv[1], "child") == 0) {
        char *shared = malloc(4 << 20);
        memset(shared, 'P', 4 << 20);
        pid_t pid = fork();
        if (pid == 0) {
            memset(shared, 'C', 4 << 20);
            printf("fault: child wrote its copy\n");
            fflush(stdout);
            volatile int *p = (int *)0;
            *p = 1;
            _exit(4);
        }
        int st;
        waitpid(pid, &st, 0);
        printf("fault: the child ended with %d\n", st);
        return 3;
    }
    volatile int *p = (int *)0;
    return *p;
}
