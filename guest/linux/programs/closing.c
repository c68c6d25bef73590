/* How TCP connections end, and the order epoll reports them in, driven by
 * a client outside the VM (the e2e tests say what it sends when). Modes:
 *   reset  port 7100, three connections in turn: the first closed with
 *          its data unread (Linux resets it), the second after SO_LINGER
 *          {1, 0} (reset; its one byte is read first, so that the reset
 *          cannot come before the client's connect returned and is not
 *          for unread data), the third after SO_LINGER {1, 5} (orderly).
 *   order  port 7101, two connections; once both are readable, the order
 *          epoll_wait reports them in (the client sent on the second one
 *          first), then one at a time (a reported one goes to the tail).
 *   exit   port 7102: one idle connection, one with unread data, one left
 *          in the accept queue (connected before the data is sent, so
 *          that the program ends only once the client has all three);
 *          then the program returns from main.
 *   abort  the same, ending in abort().
 * Progress lines tell the test when to go on. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#define CHECK(c) do { if (!(c)) { printf("closing: FAILED %s at line %d (errno %d)\n", #c, __LINE__, errno); exit(1); } } while (0)

static int listener(int port) {
    int s = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
    CHECK(s >= 0 && setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0);
    CHECK(bind(s, (struct sockaddr *)&a, sizeof a) == 0 && listen(s, 8) == 0);
    printf("closing: listening %d\n", port);
    return s;
}

static void wait_readable(int fd) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    CHECK(poll(&p, 1, 30000) == 1 && (p.revents & POLLIN));
}

static void set_linger(int fd, int onoff, int secs) {
    struct linger l = {.l_onoff = onoff, .l_linger = secs}, got;
    socklen_t len = sizeof got;
    CHECK(setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l) == 0);
    CHECK(getsockopt(fd, SOL_SOCKET, SO_LINGER, &got, &len) == 0 && len == sizeof got);
    CHECK(got.l_onoff == onoff && got.l_linger == secs);
}

static int resets(void) {
    int s = listener(7100);
    /* Off by default; a short option is refused. */
    struct linger got = {.l_onoff = 7, .l_linger = 7};
    socklen_t len = sizeof got;
    CHECK(getsockopt(s, SOL_SOCKET, SO_LINGER, &got, &len) == 0 && len == sizeof got && got.l_onoff == 0 && got.l_linger == 0);
    int four = 1;
    CHECK(setsockopt(s, SOL_SOCKET, SO_LINGER, &four, sizeof four) == -1 && errno == EINVAL);

    int a = accept(s, NULL, NULL);
    CHECK(a >= 0);
    wait_readable(a);
    close(a); /* the client's bytes unread */
    printf("closing: closed unread\n");

    a = accept(s, NULL, NULL);
    CHECK(a >= 0);
    set_linger(a, 1, 0);
    char byte;
    CHECK(read(a, &byte, 1) == 1);
    close(a);
    printf("closing: closed linger 0\n");

    a = accept(s, NULL, NULL);
    CHECK(a >= 0);
    set_linger(a, 1, 5);
    CHECK(write(a, "bye\n", 4) == 4);
    close(a);
    printf("closing: closed linger 5\n");
    close(s);
    printf("closing: done\n");
    return 0;
}

/* The client's label (one byte) on `fd`. */
static char label(int fd) {
    char c = '?';
    CHECK(read(fd, &c, 1) == 1);
    return c;
}

static int order(void) {
    int s = listener(7101);
    int first = accept(s, NULL, NULL);
    int second = accept(s, NULL, NULL);
    CHECK(first >= 0 && second > first);
    printf("closing: accepted\n");
    /* Both readable, found with poll (no order there). */
    struct pollfd p[2] = {{.fd = first, .events = POLLIN}, {.fd = second, .events = POLLIN}};
    while (!((p[0].revents & POLLIN) && (p[1].revents & POLLIN))) {
        CHECK(poll(p, 2, 30000) > 0);
    }
    int ep = epoll_create1(EPOLL_CLOEXEC);
    CHECK(ep >= 0);
    /* Registered in descriptor order. */
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = first};
    CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, first, &ev) == 0);
    ev.data.fd = second;
    CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, second, &ev) == 0);
    struct epoll_event out[2];
    CHECK(epoll_wait(ep, out, 2, 1000) == 2);
    int reported[5] = {out[0].data.fd, out[1].data.fd};
    /* Nothing read: both stay ready, and each reported one goes to the tail. */
    for (int i = 2; i < 5; i++) {
        CHECK(epoll_wait(ep, out, 1, 1000) == 1);
        reported[i] = out[0].data.fd;
    }
    char first_label = label(first), second_label = label(second);
    char names[6] = {0};
    for (int i = 0; i < 5; i++) names[i] = reported[i] == first ? first_label : second_label;
    printf("closing: order %.2s then %.3s\n", names, names + 2);
    close(first);
    close(second);
    close(ep);
    close(s);
    printf("closing: done\n");
    return 0;
}

static int ending(int do_abort) {
    int s = listener(7102);
    int idle = accept(s, NULL, NULL);
    int unread = accept(s, NULL, NULL);
    CHECK(idle >= 0 && unread >= 0);
    wait_readable(unread);
    wait_readable(s); /* a third connection, never accepted */
    printf("closing: ending\n");
    if (do_abort) abort();
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    const char *mode = argc == 2 ? argv[1] : "";
    if (strcmp(mode, "reset") == 0) return resets();
    if (strcmp(mode, "order") == 0) return order();
    if (strcmp(mode, "exit") == 0) return ending(0);
    if (strcmp(mode, "abort") == 0) return ending(1);
    printf("closing: usage: closing reset|order|exit|abort\n");
    return 2;
}
