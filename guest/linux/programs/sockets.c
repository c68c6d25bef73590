/* TCP both ways over the runtime's stack: connect to a server outside the
 * VM (argv: its address and port; it speaks Redis: PING -> +PONG), then a
 * listener that is closed (new connections must be refused) and a second
 * one. Progress lines tell the test when to connect. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) { printf("sockets: FAILED %s at line %d (errno %d)\n", #c, __LINE__, errno); return 1; } } while (0)

static int listener(int port) {
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    if (s < 0 || setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) return -1;
    if (bind(s, (struct sockaddr *)&a, sizeof a) != 0 || listen(s, 8) != 0) return -1;
    return s;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0); /* the test follows the progress lines */
    if (argc != 3) {
        printf("sockets: usage: sockets SERVER_IP PORT\n");
        return 2;
    }
    /* connect: blocking, to a real server. */
    int c = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(c >= 0);
    struct sockaddr_in server = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[2]))};
    CHECK(inet_pton(AF_INET, argv[1], &server.sin_addr) == 1);
    CHECK(connect(c, (struct sockaddr *)&server, sizeof server) == 0);
    int one = 1;
    CHECK(setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0);
    struct sockaddr_in me, peer;
    socklen_t len = sizeof me;
    CHECK(getsockname(c, (struct sockaddr *)&me, &len) == 0 && ntohs(me.sin_port) != 0);
    len = sizeof peer;
    CHECK(getpeername(c, (struct sockaddr *)&peer, &len) == 0 && peer.sin_addr.s_addr == server.sin_addr.s_addr &&
          peer.sin_port == server.sin_port);
    CHECK(write(c, "PING\r\n", 6) == 6);
    char buf[64] = {0};
    int got = 0;
    while (got < 7) {
        int n = read(c, buf + got, sizeof buf - 1 - got);
        CHECK(n > 0);
        got += n;
    }
    CHECK(strcmp(buf, "+PONG\r\n") == 0);
    CHECK(shutdown(c, SHUT_WR) == 0);
    CHECK(read(c, buf, sizeof buf) == 0); /* the server closes after our FIN */
    close(c);
    /* A closed port: refused. */
    struct sockaddr_in closed = server;
    closed.sin_port = htons(1);
    c = socket(AF_INET, SOCK_STREAM, 0);
    CHECK(connect(c, (struct sockaddr *)&closed, sizeof closed) == -1 && errno == ECONNREFUSED);
    close(c);
    printf("sockets: connect ok\n");

    /* A listener, closed after one connection. */
    int s = listener(7000);
    CHECK(s >= 0);
    printf("sockets: listening 7000\n");
    int a = accept(s, NULL, NULL);
    CHECK(a >= 0 && write(a, "hello\n", 6) == 6);
    close(a);
    close(s);
    printf("sockets: listener closed\n");
    s = listener(7001);
    CHECK(s >= 0);
    printf("sockets: listening 7001\n");
    a = accept(s, NULL, NULL);
    CHECK(a >= 0);
    while (read(a, buf, sizeof buf) > 0) {
    }
    close(a);
    close(s);
    printf("sockets: done\n");
    return 0;
}
