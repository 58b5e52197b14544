/* Preloaded into the test processes and the lab's nodes (mlxcluster/lab/ring_wait.py): a recv or
 * send on a non-blocking socket that would block waits for the socket, up to 200 microseconds,
 * before it says EAGAIN, as it still does.
 *
 * MLX's ring backend gives each socket a thread that retries a pending recv or send at once while
 * nothing comes (mlx/distributed/ring/ring.cpp, SocketThread::worker): a rank waiting for a peer
 * keeps a core busy. On a Mac each rank has cores of its own; the lab's nodes and the tests' local
 * ranks share this machine's two, and a waiting rank took them from the ranks doing the work. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

static const struct timespec WAIT = {.tv_sec = 0, .tv_nsec = 200000};

static void wait_for(int fd, short events) {
  int saved_errno = errno;
  struct pollfd socket = {.fd = fd, .events = events};
  ppoll(&socket, 1, &WAIT, NULL);
  errno = saved_errno;
}

ssize_t recv(int fd, void *buffer, size_t size, int flags) {
  static ssize_t (*next)(int, void *, size_t, int);
  if (!next) next = (ssize_t (*)(int, void *, size_t, int))dlsym(RTLD_NEXT, "recv");
  ssize_t done = next(fd, buffer, size, flags);
  if (done < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && !(flags & MSG_DONTWAIT)) wait_for(fd, POLLIN);
  return done;
}

ssize_t send(int fd, const void *buffer, size_t size, int flags) {
  static ssize_t (*next)(int, const void *, size_t, int);
  if (!next) next = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
  ssize_t done = next(fd, buffer, size, flags);
  if (done < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && !(flags & MSG_DONTWAIT)) wait_for(fd, POLLOUT);
  return done;
}
