/* A program that dereferences a null pointer (or, with argument "call",
 * calls a null function pointer): the VM reports the fault. */
#include <stdio.h>
#include <string.h>

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
    volatile int *p = (int *)0;
    return *p;
}
