/* UDP sockets: datagrams to and from a peer outside the VM (an echo server
 * at argv[1]:argv[2]), bound and unbound, connected or not, non-blocking,
 * truncated. */
#include <arpa/inet.h>
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

static struct sockaddr_in peer;

static int readable(int s, int ms) {
    struct pollfd p = {s, POLLIN, 0};
    return poll(&p, 1, ms) == 1;
}

/* Discard whatever has arrived. */
static void drain(int s) {
    char buf[2048];
    while (readable(s, 200))
        recv(s, buf, sizeof buf, 0);
}

/* Send `msg` to the peer (through `to`, or the connected peer if NULL) and
 * wait for its echo. */
static int echo(int s, int via_sendto, const char *msg, char *reply, size_t cap, struct sockaddr_in *from) {
    ssize_t n = via_sendto ? sendto(s, msg, strlen(msg), 0, (struct sockaddr *)&peer, sizeof peer) : write(s, msg, strlen(msg));
    if (n != (ssize_t)strlen(msg) || !readable(s, 5000))
        return -1;
    socklen_t len = sizeof *from;
    return recvfrom(s, reply, cap, 0, (struct sockaddr *)from, &len);
}

int main(int argc, char **argv) {
    if (argc != 3)
        return 2;
    peer.sin_family = AF_INET;
    peer.sin_port = htons(atoi(argv[2]));
    inet_pton(AF_INET, argv[1], &peer.sin_addr);
    char reply[2048];
    struct sockaddr_in from;
    socklen_t len;

    int s = socket(AF_INET, SOCK_DGRAM, 0);
    int type = 0;
    len = sizeof type;
    getsockopt(s, SOL_SOCKET, SO_TYPE, &type, &len);
    struct sockaddr_in me = {.sin_family = AF_INET, .sin_port = htons(5000)};
    if (bind(s, (struct sockaddr *)&me, sizeof me))
        return 1;
    len = sizeof me;
    getsockname(s, (struct sockaddr *)&me, &len);
    printf("udp: type dgram=%d bound port=%d\n", type == SOCK_DGRAM, ntohs(me.sin_port));

    /* The first datagram may wait for ARP: retry until the peer answers. */
    int up = 0;
    for (int i = 0; i < 20 && !up; i++) {
        sendto(s, "hello", 5, 0, (struct sockaddr *)&peer, sizeof peer);
        up = readable(s, 500);
    }
    drain(s);
    printf("udp: peer up=%d\n", up);

    int n = echo(s, 1, "ping one", reply, sizeof reply, &from);
    printf("udp: sendto echo=%d from peer=%d\n", n == 8 && memcmp(reply, "ping one", 8) == 0,
           from.sin_addr.s_addr == peer.sin_addr.s_addr && from.sin_port == peer.sin_port);

    /* sendmsg gathers two pieces into one datagram; recvmsg scatters the
     * echo over two buffers and names its source. */
    struct iovec out[2] = {{"ping ", 5}, {"three", 5}};
    struct msghdr m = {.msg_name = &peer, .msg_namelen = sizeof peer, .msg_iov = out, .msg_iovlen = 2};
    char first[4], rest[16] = {0};
    struct iovec in[2] = {{first, sizeof first}, {rest, sizeof rest}};
    struct sockaddr_in src = {0};
    struct msghdr r = {.msg_name = &src, .msg_namelen = sizeof src, .msg_iov = in, .msg_iovlen = 2};
    int sent = sendmsg(s, &m, 0) == 10 && readable(s, 5000);
    n = recvmsg(s, &r, 0);
    printf("udp: msg echo=%d scattered=%d from peer=%d\n", sent && n == 10, memcmp(first, "ping", 4) == 0 && strcmp(rest, " three") == 0,
           src.sin_port == peer.sin_port && r.msg_namelen == sizeof src);

    /* An unbound socket gets an ephemeral port when it first sends. */
    int c = socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK, 0);
    int unconnected = send(c, "x", 1, 0) == -1 && errno == EDESTADDRREQ;
    if (connect(c, (struct sockaddr *)&peer, sizeof peer))
        return 1;
    n = echo(c, 0, "ping two", reply, sizeof reply, &from);
    struct sockaddr_in cme;
    len = sizeof cme;
    getsockname(c, (struct sockaddr *)&cme, &len);
    printf("udp: connected echo=%d ephemeral=%d edestaddrreq=%d\n", n == 8 && memcmp(reply, "ping two", 8) == 0,
           ntohs(cme.sin_port) != 0, unconnected);

    /* Nothing there: a non-blocking read says EAGAIN. */
    n = recv(c, reply, sizeof reply, 0);
    printf("udp: eagain=%d\n", n == -1 && errno == EAGAIN);

    /* A datagram longer than the buffer is cut; the rest is gone. */
    char big[100];
    memset(big, 'z', sizeof big);
    big[99] = 0;
    write(c, big, 99);
    readable(c, 5000);
    n = recv(c, reply, 10, 0);
    int after = recv(c, reply, sizeof reply, 0);
    printf("udp: truncated=%d rest dropped=%d\n", n == 10, after == -1 && errno == EAGAIN);

    int d = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in same = {.sin_family = AF_INET, .sin_port = htons(5000)};
    int inuse = bind(d, (struct sockaddr *)&same, sizeof same) == -1 && errno == EADDRINUSE;
    printf("udp: eaddrinuse=%d\n", inuse);
    close(d);
    close(c);
    close(s);
    return 0;
}
