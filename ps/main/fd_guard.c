/* Out of file descriptors, the server keeps accepting once there are some
 * again.
 *
 * gRPC 1.51's listener gives up for good on the first accept4 that fails
 * with EMFILE or ENFILE (tcp_server_posix.cc: "Failed accept4: Too many open
 * files", and the listening socket is never polled again), so one burst of
 * connections would leave a shard deaf for the rest of its life while its
 * existing connections go on. This file defines accept4 in the ps-server
 * program, which the dynamic linker binds gRPC's calls to ahead of the C
 * library's: it calls the system's accept4, and when that fails for want
 * of descriptors it sheds the connections that wait (closing a spare
 * descriptor kept for this, accepting one, closing it, reopening the spare:
 * libuv's and nginx's answer to the same problem) and answers EAGAIN,
 * which gRPC takes as "nothing more to accept now" and so keeps polling.
 * Clients that were shed see their connection closed and retry. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/util.h"
#include "ps/main/server_run.h"

static pthread_mutex_t guard_mu = PTHREAD_MUTEX_INITIALIZER;
static int spare = -1;
static atomic_uint_fast64_t shed_total;
static atomic_int_fast64_t last_warn_ms;

static int sys_accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
  return (int)syscall(SYS_accept4, fd, addr, len, flags);
}

int ps_fd_guard_init(void) {
  /* As many descriptors as the hard limit allows (Debian's soft default of
   * 1024 is small for a shard with many workers). */
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
    rl.rlim_cur = rl.rlim_max;
    (void)setrlimit(RLIMIT_NOFILE, &rl);
  }
  pthread_mutex_lock(&guard_mu);
  if (spare < 0) spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
  int ok = spare >= 0;
  pthread_mutex_unlock(&guard_mu);
  return ok ? 0 : PS_EIO;
}

uint64_t ps_fd_guard_shed(void) { return (uint64_t)atomic_load(&shed_total); }

int accept4(int fd, struct sockaddr *addr, socklen_t *addrlen, int flags) {
  int c = sys_accept4(fd, addr, addrlen, flags);
  if (c >= 0 || (errno != EMFILE && errno != ENFILE)) return c;
  int why = errno;
  uint64_t shed = 0;
  pthread_mutex_lock(&guard_mu);
  while (spare >= 0) {
    close(spare);
    int x = sys_accept4(fd, NULL, NULL, SOCK_CLOEXEC);
    if (x >= 0) close(x);
    spare = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (x < 0) break; /* nothing waits any more (or still no descriptor) */
    shed++;
  }
  pthread_mutex_unlock(&guard_mu);
  atomic_fetch_add(&shed_total, shed);
  int64_t now = ps_now_ms(), last = atomic_load(&last_warn_ms);
  if (now - last >= 5000 && atomic_compare_exchange_strong(&last_warn_ms, &last, now))
    PS_WARN("out of file descriptors (%s): closed %" PRIu64 " waiting connection(s), %" PRIu64
            " in all; still accepting (raise `ulimit -n`)",
            why == EMFILE ? "this process's limit" : "the system's limit", shed,
            (uint64_t)atomic_load(&shed_total));
  errno = EAGAIN;
  return -1;
}
