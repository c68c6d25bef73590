/* The first milestone: start-up stack, TLS, stdio, exit status. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/auxv.h>
#include <time.h>

static __thread int tls_counter = 41;

int main(int argc, char **argv) {
    tls_counter++;
    printf("hello: argc=%d", argc);
    for (int i = 1; i < argc; i++)
        printf(" argv[%d]=[%s]", i, argv[i]);
    printf("\n");
    const char *greeting = getenv("GREETING");
    printf("hello: env GREETING=%s tls=%d pagesz=%lu random=%s\n", greeting ? greeting : "(unset)", tls_counter,
           getauxval(AT_PAGESZ), getauxval(AT_RANDOM) ? "yes" : "no");
    /* The wall clock, in seconds since the epoch: the host's, or epoch=. */
    printf("hello: time=%lld\n", (long long)time(NULL));
    fprintf(stderr, "hello: to stderr\n");
    return argc > 1 && strcmp(argv[1], "fail") == 0 ? 3 : 0;
}
