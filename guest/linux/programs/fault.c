/* A program that dereferences a null pointer: the VM reports the fault. */
#include <stdio.h>

int main(void) {
    printf("fault: about to fault\n");
    fflush(stdout);
    volatile int *p = (int *)0;
    return *p;
}
