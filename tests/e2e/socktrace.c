/* socktrace: the socket reads and writes of a process, with monotonic timestamps, for the
 * live benchmark's per-request timeline (tests/e2e/timeline.py reads what it writes).
 *
 *     cc -O2 -shared -fPIC -o socktrace.so tests/e2e/socktrace.c -ldl
 *     SOCKTRACE_DIR=DIR LD_PRELOAD=/abs/socktrace.so program ...
 *
 * Loaded before libc (LD_PRELOAD), it wraps the calls a program makes through libc's dynamic
 * symbols on TCP sockets: read/readv/recv/recvfrom/recvmsg that return bytes (and 0, the
 * peer's end), write/writev/send/sendto/sendmsg that take bytes, connect, accept/accept4,
 * close, setsockopt's TCP_NODELAY, and epoll_wait/epoll_pwait returning events (the moment
 * the event loop woke): a read at its return, a write at its call. Every
 * process (a fork or a spawned child too: the environment carries the preload) appends to
 * DIR/trace-<pid>.bin, a file it maps shared, so what it wrote is there however it ends.
 *
 * File: a 64-byte header ("SOCKTRC1", then the bytes used and the records dropped, u64 each),
 * then records, each 32 bytes + its captured bytes rounded up to 8:
 *   u64 t_ns (CLOCK_MONOTONIC: one clock for every process of the machine), i32 pid, i32 tid,
 *   i32 fd, i32 ret (bytes moved, or events, or 0), u16 local port, u16 peer port, u8 op
 *   ('R' read, 'W' write, 'C' connect, 'A' accept, 'X' close, 'E' epoll woke), u8 nodelay
 *   (TCP_NODELAY on the socket at the call: 0, 1), u16 captured (the first bytes moved,
 *   at most CAPTURE).
 * A socket is traced when it is AF_INET or AF_INET6 and SOCK_STREAM; its ports are read once,
 * when it is first seen, and forgotten at close.
 *
 * It measures, and so perturbs: one clock read and a copy of at most CAPTURE bytes per call
 * on a socket. The benchmark runs it in rounds of its own, never in the rounds it reports
 * as the cost of each path.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define CAPTURE 2048
#define FILE_BYTES (1ULL << 30) /* sparse: only what is written takes disk */
#define MAX_FD 65536
#define HEADER 64

struct record {
    uint64_t t_ns;
    int32_t pid, tid, fd, ret;
    uint16_t lport, pport;
    uint8_t op, nodelay;
    uint16_t captured;
};

/* per fd: 0 not seen, 1 not traced, 2 traced */
static unsigned char kind[MAX_FD];
static uint16_t lports[MAX_FD], pports[MAX_FD];
static unsigned char nodelays[MAX_FD];

static char *map;          /* the process's file, mapped */
static pid_t map_pid;      /* the process that mapped it (a fork maps its own) */
static pthread_mutex_t opening = PTHREAD_MUTEX_INITIALIZER;

static ssize_t (*real_read)(int, void *, size_t);
static ssize_t (*real_readv)(int, const struct iovec *, int);
static ssize_t (*real_recv)(int, void *, size_t, int);
static ssize_t (*real_recvfrom)(int, void *, size_t, int, struct sockaddr *, socklen_t *);
static ssize_t (*real_recvmsg)(int, struct msghdr *, int);
static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_writev)(int, const struct iovec *, int);
static ssize_t (*real_send)(int, const void *, size_t, int);
static ssize_t (*real_sendto)(int, const void *, size_t, int, const struct sockaddr *, socklen_t);
static ssize_t (*real_sendmsg)(int, const struct msghdr *, int);
static int (*real_connect)(int, const struct sockaddr *, socklen_t);
static int (*real_accept)(int, struct sockaddr *, socklen_t *);
static int (*real_accept4)(int, struct sockaddr *, socklen_t *, int);
static int (*real_close)(int);
static int (*real_setsockopt)(int, int, int, const void *, socklen_t);
static int (*real_epoll_wait)(int, struct epoll_event *, int, int);
static int (*real_epoll_pwait)(int, struct epoll_event *, int, int, const sigset_t *);

#define RESOLVE(name) \
    do { \
        if (!real_##name) *(void **)&real_##name = dlsym(RTLD_NEXT, #name); \
    } while (0)

static char *mapped(void) {
    pid_t pid = getpid();
    if (__atomic_load_n(&map_pid, __ATOMIC_ACQUIRE) == pid) return map; /* NULL: no trace */
    pthread_mutex_lock(&opening);
    if (map_pid != pid) {  /* this process's first event (a fork maps a file of its own) */
        const char *dir = getenv("SOCKTRACE_DIR");
        char *fresh = NULL;
        if (dir && *dir) {
            char path[4096];
            snprintf(path, sizeof path, "%s/trace-%d.bin", dir, (int)pid);
            int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
            if (fd >= 0) {
                if (ftruncate(fd, (off_t)FILE_BYTES) == 0) {
                    void *m = mmap(NULL, FILE_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                    if (m != MAP_FAILED) {
                        fresh = m;
                        memcpy(fresh, "SOCKTRC1", 8);
                        __atomic_store_n((uint64_t *)(fresh + 8), (uint64_t)HEADER,
                                         __ATOMIC_RELEASE);
                    }
                }
                RESOLVE(close);
                real_close(fd);
            }
        }
        map = fresh;
        __atomic_store_n(&map_pid, pid, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&opening);
    return map;
}

static uint16_t port_of(const struct sockaddr_storage *a) {
    return ntohs(a->ss_family == AF_INET ? ((const struct sockaddr_in *)a)->sin_port
                                         : ((const struct sockaddr_in6 *)a)->sin6_port);
}

static int traced(int fd) {
    if (fd < 0 || fd >= MAX_FD) return 0;
    unsigned char k = kind[fd];
    if (k) return k == 2;
    int type = 0;
    socklen_t len = sizeof type;
    struct sockaddr_storage local, peer;
    socklen_t llen = sizeof local, plen = sizeof peer;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM ||
        getsockname(fd, (struct sockaddr *)&local, &llen) != 0 ||
        (local.ss_family != AF_INET && local.ss_family != AF_INET6)) {
        kind[fd] = 1;
        return 0;
    }
    if (getpeername(fd, (struct sockaddr *)&peer, &plen) != 0)
        return 0; /* not connected (yet): look again at the next call */
    lports[fd] = port_of(&local);
    pports[fd] = port_of(&peer);
    int on = 0;
    len = sizeof on;
    nodelays[fd] = getsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, &len) == 0 && on;
    kind[fd] = 2;
    return 1;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* A record. `t`: a read's (or accept's, or epoll's) return, a write's (or connect's) call: so
 * a byte's write is never timed after its read on the other end. */
static void emit_at(uint64_t t, char op, int fd, long ret, const struct iovec *iov, int iovcnt,
                    uint16_t lport, uint16_t pport, uint8_t nodelay) {
    int saved = errno;
    char *m = mapped();
    if (!m) {
        errno = saved;
        return;
    }
    size_t want = 0;
    if (iov && ret > 0) want = (size_t)ret < CAPTURE ? (size_t)ret : CAPTURE;
    size_t size = sizeof(struct record) + ((want + 7) & ~(size_t)7);
    uint64_t at = __atomic_fetch_add((uint64_t *)(m + 8), (uint64_t)size, __ATOMIC_ACQ_REL);
    if (at + size > FILE_BYTES) {
        __atomic_fetch_add((uint64_t *)(m + 16), 1, __ATOMIC_RELAXED);
        errno = saved;
        return;
    }
    struct record *r = (struct record *)(m + at);
    r->t_ns = t;
    r->pid = map_pid;
    r->tid = (int32_t)syscall(SYS_gettid);
    r->fd = fd;
    r->ret = (int32_t)ret;
    r->lport = lport;
    r->pport = pport;
    r->op = (uint8_t)op;
    r->nodelay = nodelay;
    r->captured = (uint16_t)want;
    char *out = (char *)(r + 1);
    for (int i = 0; iov && i < iovcnt && want; i++) {
        size_t n = iov[i].iov_len < want ? iov[i].iov_len : want;
        memcpy(out, iov[i].iov_base, n);
        out += n;
        want -= n;
    }
    errno = saved;
}

static void emit(uint64_t t, char op, int fd, long ret, const struct iovec *iov, int iovcnt) {
    int ok = fd >= 0 && fd < MAX_FD && kind[fd] == 2;
    emit_at(t, op, fd, ret, iov, iovcnt, ok ? lports[fd] : 0, ok ? pports[fd] : 0,
            ok ? nodelays[fd] : 0);
}

static void forget(int fd) {
    if (fd >= 0 && fd < MAX_FD) kind[fd] = 0;
}

#define IO(t, op, fd, ret, base, len) \
    do { \
        if ((ret) >= 0 && traced(fd)) { \
            struct iovec one = {(void *)(base), (size_t)(len)}; \
            emit(t, op, fd, ret, &one, 1); \
        } \
    } while (0)

ssize_t read(int fd, void *buf, size_t n) {
    RESOLVE(read);
    ssize_t ret = real_read(fd, buf, n);
    IO(now_ns(), 'R', fd, ret, buf, n);
    return ret;
}

ssize_t recv(int fd, void *buf, size_t n, int flags) {
    RESOLVE(recv);
    ssize_t ret = real_recv(fd, buf, n, flags);
    if (!(flags & MSG_PEEK)) IO(now_ns(), 'R', fd, ret, buf, n);
    return ret;
}

ssize_t recvfrom(int fd, void *buf, size_t n, int flags, struct sockaddr *a, socklen_t *l) {
    RESOLVE(recvfrom);
    ssize_t ret = real_recvfrom(fd, buf, n, flags, a, l);
    if (!(flags & MSG_PEEK)) IO(now_ns(), 'R', fd, ret, buf, n);
    return ret;
}

ssize_t readv(int fd, const struct iovec *iov, int iovcnt) {
    RESOLVE(readv);
    ssize_t ret = real_readv(fd, iov, iovcnt);
    if (ret >= 0 && traced(fd)) emit(now_ns(), 'R', fd, ret, iov, iovcnt);
    return ret;
}

ssize_t recvmsg(int fd, struct msghdr *msg, int flags) {
    RESOLVE(recvmsg);
    ssize_t ret = real_recvmsg(fd, msg, flags);
    if (ret >= 0 && !(flags & MSG_PEEK) && traced(fd))
        emit(now_ns(), 'R', fd, ret, msg->msg_iov, (int)msg->msg_iovlen);
    return ret;
}

ssize_t write(int fd, const void *buf, size_t n) {
    RESOLVE(write);
    uint64_t t = now_ns();
    ssize_t ret = real_write(fd, buf, n);
    if (ret > 0) IO(t, 'W', fd, ret, buf, n);
    return ret;
}

ssize_t send(int fd, const void *buf, size_t n, int flags) {
    RESOLVE(send);
    uint64_t t = now_ns();
    ssize_t ret = real_send(fd, buf, n, flags);
    if (ret > 0) IO(t, 'W', fd, ret, buf, n);
    return ret;
}

ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *a,
               socklen_t l) {
    RESOLVE(sendto);
    uint64_t t = now_ns();
    ssize_t ret = real_sendto(fd, buf, n, flags, a, l);
    if (ret > 0) IO(t, 'W', fd, ret, buf, n);
    return ret;
}

ssize_t writev(int fd, const struct iovec *iov, int iovcnt) {
    RESOLVE(writev);
    uint64_t t = now_ns();
    ssize_t ret = real_writev(fd, iov, iovcnt);
    if (ret > 0 && traced(fd)) emit(t, 'W', fd, ret, iov, iovcnt);
    return ret;
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags) {
    RESOLVE(sendmsg);
    uint64_t t = now_ns();
    ssize_t ret = real_sendmsg(fd, msg, flags);
    if (ret > 0 && traced(fd)) emit(t, 'W', fd, ret, msg->msg_iov, (int)msg->msg_iovlen);
    return ret;
}

int connect(int fd, const struct sockaddr *a, socklen_t l) {
    RESOLVE(connect);
    uint64_t t = now_ns();
    forget(fd);
    int ret = real_connect(fd, a, l);
    int saved = errno;
    /* a non-blocking connect returns EINPROGRESS: the peer is the address asked for */
    if ((ret == 0 || saved == EINPROGRESS) && a &&
        (a->sa_family == AF_INET || a->sa_family == AF_INET6)) {
        struct sockaddr_storage local, peer;
        socklen_t llen = sizeof local;
        memset(&peer, 0, sizeof peer);
        memcpy(&peer, a, l < sizeof peer ? l : sizeof peer);
        int type = 0;
        socklen_t tlen = sizeof type;
        if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tlen) == 0 && type == SOCK_STREAM &&
            getsockname(fd, (struct sockaddr *)&local, &llen) == 0)
            emit_at(t, 'C', fd, 0, NULL, 0, port_of(&local), port_of(&peer), 0);
    }
    errno = saved;
    return ret;
}

int accept(int fd, struct sockaddr *a, socklen_t *l) {
    RESOLVE(accept);
    int ret = real_accept(fd, a, l);
    if (ret >= 0) {
        forget(ret);
        if (traced(ret)) emit(now_ns(), 'A', ret, 0, NULL, 0);
    }
    return ret;
}

int accept4(int fd, struct sockaddr *a, socklen_t *l, int flags) {
    RESOLVE(accept4);
    int ret = real_accept4(fd, a, l, flags);
    if (ret >= 0) {
        forget(ret);
        if (traced(ret)) emit(now_ns(), 'A', ret, 0, NULL, 0);
    }
    return ret;
}

/* TCP_NODELAY as the program sets it (an accepted socket gets it after it is first seen) */
int setsockopt(int fd, int level, int name, const void *value, socklen_t len) {
    RESOLVE(setsockopt);
    int ret = real_setsockopt(fd, level, name, value, len);
    if (ret == 0 && level == IPPROTO_TCP && name == TCP_NODELAY && value &&
        len >= (socklen_t)sizeof(int) && fd >= 0 && fd < MAX_FD && kind[fd] == 2)
        nodelays[fd] = *(const int *)value != 0;
    return ret;
}

int close(int fd) {
    RESOLVE(close);
    if (fd >= 0 && fd < MAX_FD && kind[fd] == 2) emit(now_ns(), 'X', fd, 0, NULL, 0);
    forget(fd);
    return real_close(fd);
}

int epoll_wait(int epfd, struct epoll_event *events, int max, int timeout) {
    RESOLVE(epoll_wait);
    int ret = real_epoll_wait(epfd, events, max, timeout);
    if (ret > 0) emit(now_ns(), 'E', epfd, ret, NULL, 0);
    return ret;
}

int epoll_pwait(int epfd, struct epoll_event *events, int max, int timeout,
                const sigset_t *mask) {
    RESOLVE(epoll_pwait);
    int ret = real_epoll_pwait(epfd, events, max, timeout, mask);
    if (ret > 0) emit(now_ns(), 'E', epfd, ret, NULL, 0);
    return ret;
}
