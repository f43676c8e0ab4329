/* test_wire.c: framing and fd passing (proto/wire.c) over a socketpair, the
 * error table, the default socket path rule, and view arithmetic. */
#include "tensord.h"
#include "wire.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---- helpers ---- */

static int open_fds(void) {
  int n = 0;
  DIR *d = opendir("/proc/self/fd");
  cr_assert_not_null(d);
  struct dirent *e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.')
      n++;
  closedir(d);
  return n - 1; /* the directory's own fd */
}

/* Two ends of a socketpair, each with its wire: a sends, b receives. */
typedef struct pair {
  int sv[2];
  td__wire a, b;
} pair;

static void pair_open(pair *p) {
  cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, p->sv), 0,
               "socketpair: %s", strerror(errno));
  td__wire_init(&p->a, p->sv[0]);
  td__wire_init(&p->b, p->sv[1]);
}

static void pair_close(pair *p) {
  td__wire_free(&p->a);
  td__wire_free(&p->b);
  close(p->sv[0]);
  close(p->sv[1]);
}

/* A received frame, copied out of the wire. */
typedef struct got {
  uint8_t *data;
  size_t len;
  int fds[TD__FRAME_MAX_FDS];
  unsigned nfds;
} got;

static void got_free(got *g, size_t n) {
  for (size_t i = 0; i < n; i++) {
    free(g[i].data);
    td__close_fds(g[i].fds, g[i].nfds);
  }
}

/* Takes every complete frame from w into out (at most max - *n). Returns 0 or
 * the error td__wire_frame gave. */
static int take_frames(td__wire *w, got *out, size_t *n, size_t max) {
  td__frame f;
  int r = 0;
  while (*n < max && (r = td__wire_frame(w, &f)) == 1) {
    got *g = &out[(*n)++];
    g->len = f.len;
    g->data = malloc(f.len ? f.len : 1);
    cr_assert_not_null(g->data);
    memcpy(g->data, f.data, f.len);
    g->nfds = f.nfds;
    memcpy(g->fds, f.fds, f.nfds * sizeof(int));
    td__wire_consume(w, &f);
  }
  return *n < max && r < 0 ? r : 0;
}

/* Moves everything a has queued to b, alternating non-blocking flushes and
 * receives, until want frames have arrived. Asserts on any error. */
static void pump(pair *p, got *out, size_t want) {
  size_t n = 0;
  int idle = 0;
  while (n < want) {
    int err = td__wire_flush(&p->a, MSG_DONTWAIT);
    cr_assert(err == 0 || err == TD_EAGAIN, "flush: %s", td_err_name(err));
    cr_assert_eq(take_frames(&p->b, out, &n, want), 0);
    if (n == want)
      break;
    ssize_t r = td__wire_recv(&p->b, MSG_DONTWAIT);
    if (r == TD_EAGAIN) {
      cr_assert(err == TD_EAGAIN || idle++ < 2,
                "everything was sent but only %zu of %zu frames arrived", n,
                want);
      continue;
    }
    idle = 0;
    cr_assert(r > 0, "recv: %zd (%s)", r, td_err_name((int)r));
    cr_assert_eq(take_frames(&p->b, out, &n, want), 0);
  }
  cr_assert_eq(td__wire_flush(&p->a, MSG_DONTWAIT), 0);
  cr_assert_eq(td__wire_pending(&p->a), 0);
}

/* Fills buf with a pattern that depends on seed. */
static void pattern(uint8_t *buf, size_t len, unsigned seed) {
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < len; i++) {
    x = x * 1103515245u + 12345u;
    buf[i] = (uint8_t)(x >> 16);
  }
}

static void check_pattern(const got *g, size_t len, unsigned seed) {
  cr_assert_eq(g->len, len, "frame %u: %zu bytes, expected %zu", seed, g->len,
               len);
  uint8_t *want = malloc(len ? len : 1);
  pattern(want, len, seed);
  cr_assert(memcmp(g->data, want, len) == 0, "frame %u: payload differs", seed);
  free(want);
}

/* A new memfd and its identity. */
static int new_file(struct stat *st) {
  int fd = memfd_create("test_wire", MFD_CLOEXEC);
  cr_assert(fd >= 0, "memfd_create: %s", strerror(errno));
  cr_assert_eq(fstat(fd, st), 0);
  return fd;
}

static void check_same_file(int fd, const struct stat *want, const char *what) {
  struct stat st;
  cr_assert_eq(fstat(fd, &st), 0, "%s: fd %d is not open", what, fd);
  cr_assert(st.st_ino == want->st_ino && st.st_dev == want->st_dev,
            "%s: fd %d is another file", what, fd);
  int fl = fcntl(fd, F_GETFD);
  cr_assert(fl >= 0 && (fl & FD_CLOEXEC), "%s: received without CLOEXEC", what);
}

/* Writes len raw bytes (no framing) to fd. */
static void raw_write(int fd, const void *buf, size_t len) {
  cr_assert_eq(write(fd, buf, len), (ssize_t)len, "write: %s", strerror(errno));
}

static void header(uint8_t h[8], uint32_t len, uint8_t nfds) {
  h[0] = (uint8_t)len;
  h[1] = (uint8_t)(len >> 8);
  h[2] = (uint8_t)(len >> 16);
  h[3] = (uint8_t)(len >> 24);
  h[4] = nfds;
  h[5] = 0;
  h[6] = 'T';
  h[7] = 'D';
}

/* Receives on b until td__wire_frame says something other than 0. */
static int recv_until_frame(td__wire *w, td__frame *f) {
  int r;
  for (int i = 0; i < 100000; i++) {
    if ((r = td__wire_frame(w, f)) != 0)
      return r;
    ssize_t n = td__wire_recv(w, MSG_DONTWAIT);
    if (n == TD_EAGAIN)
      return 0;
    cr_assert(n > 0, "recv: %zd", n);
  }
  return 0;
}

/* ---- framing ---- */

Test(wire, frames_round_trip_in_order, .timeout = 30) {
  pair p;
  pair_open(&p);
  static const size_t sizes[] = {0,    1,     7,     8,     9,      100, 4095,
                                 4096, 65535, 65536, 65537, 200000, 3};
  enum { N = sizeof(sizes) / sizeof(sizes[0]) };
  for (unsigned i = 0; i < N; i++) {
    uint8_t *buf = malloc(sizes[i] + 1);
    pattern(buf, sizes[i], i);
    cr_assert_eq(td__wire_queue(&p.a, buf, sizes[i], NULL, 0), 0);
    free(buf);
  }
  got g[N];
  memset(g, 0, sizeof(g));
  pump(&p, g, N);
  for (unsigned i = 0; i < N; i++) {
    check_pattern(&g[i], sizes[i], i);
    cr_assert_eq(g[i].nfds, 0);
  }
  got_free(g, N);
  td__frame f;
  cr_assert_eq(td__wire_frame(&p.b, &f), 0, "nothing more");
  pair_close(&p);
}

Test(wire, reserve_and_commit_pack_in_place, .timeout = 30) {
  pair p;
  pair_open(&p);
  uint8_t *dst = td__wire_reserve(&p.a, 5);
  cr_assert_not_null(dst);
  memcpy(dst, "hello", 5);
  cr_assert_eq(td__wire_commit(&p.a, 5, NULL, 0), 0);
  cr_assert_eq(td__wire_pending(&p.a), TD__FRAME_HDR + 5);
  got g[1] = {{0}};
  pump(&p, g, 1);
  cr_assert_eq(g[0].len, 5);
  cr_assert(memcmp(g[0].data, "hello", 5) == 0);
  got_free(g, 1);
  pair_close(&p);
}

Test(wire, largest_frame_round_trips, .timeout = 30) {
  pair p;
  pair_open(&p);
  uint8_t *buf = malloc(TD__FRAME_MAX);
  pattern(buf, TD__FRAME_MAX, 42);
  cr_assert_eq(td__wire_queue(&p.a, buf, TD__FRAME_MAX, NULL, 0), 0);
  free(buf);
  got g[1] = {{0}};
  pump(&p, g, 1);
  check_pattern(&g[0], TD__FRAME_MAX, 42);
  got_free(g, 1);
  pair_close(&p);
}

Test(wire, oversize_frame_is_refused_when_queued, .timeout = 30) {
  pair p;
  pair_open(&p);
  int before = open_fds();
  struct stat st;
  int fds[1] = {new_file(&st)};
  uint8_t *buf = calloc(1, TD__FRAME_MAX + 1);
  cr_assert_eq(td__wire_queue(&p.a, buf, TD__FRAME_MAX + 1, fds, 1),
               TD_EMSGSIZE);
  free(buf);
  cr_assert_null(td__wire_reserve(&p.a, TD__FRAME_MAX + 1));
  cr_assert_eq(td__wire_pending(&p.a), 0, "nothing was queued");
  cr_assert_eq(open_fds(), before, "the frame's fd was closed on failure");
  pair_close(&p);
}

Test(wire, too_many_fds_for_one_frame_is_refused, .timeout = 30) {
  pair p;
  pair_open(&p);
  int before = open_fds();
  int fds[TD__FRAME_MAX_FDS + 1];
  struct stat st;
  for (int i = 0; i <= TD__FRAME_MAX_FDS; i++)
    fds[i] = new_file(&st);
  cr_assert_eq(td__wire_queue(&p.a, "x", 1, fds, TD__FRAME_MAX_FDS + 1),
               TD_EMSGSIZE);
  cr_assert_eq(td__wire_pending(&p.a), 0, "nothing was queued");
  cr_assert_eq(open_fds(), before, "every fd was closed on failure");
  pair_close(&p);
}

/* Short reads and writes: every recvmsg and sendmsg moves at most n bytes. */
static void short_io(size_t n) {
  pair p;
  pair_open(&p);
  p.a.max_io = n;
  p.b.max_io = n;
  int before = open_fds();
  static const size_t sizes[] = {0, 1, 2, 3, 5, 7, 8, 9, 13, 64, 1000, 2};
  enum { N = sizeof(sizes) / sizeof(sizes[0]) };
  struct stat st[N][TD__FRAME_MAX_FDS];
  for (unsigned i = 0; i < N; i++) {
    uint8_t buf[1000];
    pattern(buf, sizes[i], i);
    int fds[TD__FRAME_MAX_FDS];
    unsigned nfds = i % (TD__FRAME_MAX_FDS + 1);
    for (unsigned j = 0; j < nfds; j++)
      fds[j] = new_file(&st[i][j]);
    cr_assert_eq(td__wire_queue(&p.a, buf, sizes[i], fds, nfds), 0);
  }
  got g[N];
  memset(g, 0, sizeof(g));
  pump(&p, g, N);
  for (unsigned i = 0; i < N; i++) {
    check_pattern(&g[i], sizes[i], i);
    cr_assert_eq(g[i].nfds, i % (TD__FRAME_MAX_FDS + 1), "frame %u's fds", i);
    for (unsigned j = 0; j < g[i].nfds; j++)
      check_same_file(g[i].fds[j], &st[i][j], "short io");
  }
  got_free(g, N);
  cr_assert_eq(open_fds(), before, "no fd leaked");
  pair_close(&p);
}

Test(wire, short_io_of_1_byte_reassembles, .timeout = 60) {
  short_io(1);
}
Test(wire, short_io_of_3_bytes_reassembles, .timeout = 60) {
  short_io(3);
}
Test(wire, short_io_of_7_bytes_reassembles, .timeout = 60) {
  short_io(7);
}

Test(wire, short_read_flag_says_when_recv_filled_less_than_room,
     .timeout = 30) {
  pair p;
  pair_open(&p);
  cr_assert_eq(td__wire_queue(&p.a, "abc", 3, NULL, 0), 0);
  cr_assert_eq(td__wire_flush(&p.a, 0), 0);
  cr_assert_eq(td__wire_recv(&p.b, MSG_DONTWAIT), TD__FRAME_HDR + 3);
  cr_assert(p.b.short_read);
  cr_assert_eq(td__wire_recv(&p.b, MSG_DONTWAIT), TD_EAGAIN);
  pair_close(&p);
}

Test(wire, end_of_stream_reads_0, .timeout = 30) {
  pair p;
  pair_open(&p);
  shutdown(p.sv[0], SHUT_WR);
  cr_assert_eq(td__wire_recv(&p.b, 0), 0);
  pair_close(&p);
}

/* ---- fds ---- */

Test(wire, fds_travel_with_their_frame, .timeout = 30) {
  pair p;
  pair_open(&p);
  int before = open_fds();
  enum { N = 10 };
  struct stat st[N][TD__FRAME_MAX_FDS];
  unsigned want[N];
  for (unsigned i = 0; i < N; i++) {
    int fds[TD__FRAME_MAX_FDS];
    want[i] = (i * 3) % (TD__FRAME_MAX_FDS + 1); /* 0 3 1 4 2 0 3 ... */
    for (unsigned j = 0; j < want[i]; j++)
      fds[j] = new_file(&st[i][j]);
    char msg[32];
    int len = snprintf(msg, sizeof(msg), "frame %u", i);
    cr_assert_eq(td__wire_queue(&p.a, msg, (size_t)len, fds, want[i]), 0);
    /* Send every other frame at once, the rest in batches. */
    if (i % 2 == 0)
      cr_assert_eq(td__wire_flush(&p.a, 0), 0);
  }
  got g[N];
  memset(g, 0, sizeof(g));
  pump(&p, g, N);
  for (unsigned i = 0; i < N; i++) {
    char msg[32];
    int len = snprintf(msg, sizeof(msg), "frame %u", i);
    cr_assert_eq(g[i].len, (size_t)len);
    cr_assert(memcmp(g[i].data, msg, (size_t)len) == 0);
    cr_assert_eq(g[i].nfds, want[i], "frame %u: %u fds, expected %u", i,
                 g[i].nfds, want[i]);
    for (unsigned j = 0; j < want[i]; j++)
      check_same_file(g[i].fds[j], &st[i][j], msg);
  }
  got_free(g, N);
  cr_assert_eq(p.b.in_nfds, 0);
  cr_assert_eq(open_fds(), before, "the sender closed its copies once sent");
  pair_close(&p);
}

Test(wire, pipe_fd_received_is_the_same_pipe, .timeout = 30) {
  pair p;
  pair_open(&p);
  int pfd[2];
  cr_assert_eq(pipe2(pfd, O_CLOEXEC), 0);
  int wfd = pfd[1];
  cr_assert_eq(td__wire_queue(&p.a, "p", 1, &wfd, 1), 0); /* owns pfd[1] */
  got g[1] = {{0}};
  pump(&p, g, 1);
  cr_assert_eq(g[0].nfds, 1);
  cr_assert_eq(write(g[0].fds[0], "z", 1), 1);
  char c = 0;
  cr_assert_eq(read(pfd[0], &c, 1), 1);
  cr_assert_eq(c, 'z');
  got_free(g, 1); /* closes the last write end */
  cr_assert_eq(read(pfd[0], &c, 1), 0, "EOF: the sender closed its copy");
  close(pfd[0]);
  pair_close(&p);
}

/* Many frames with fds, queued before one flush: more fds than one sendmsg
 * carries, so the flush must split between frames and never send bytes of a
 * frame before its fds. */
static void many_fds(size_t max_io) {
  pair p;
  pair_open(&p);
  p.a.max_io = max_io;
  p.b.max_io = max_io;
  int before = open_fds();
  /* 9 frames of 3 fds fill 27 of 28 slots, so a following 4-fd frame must
   * wait for the next sendmsg; then a mix. */
  enum { N = 60 };
  unsigned want[N];
  static struct stat st[N][TD__FRAME_MAX_FDS];
  unsigned total = 0;
  for (unsigned i = 0; i < N; i++) {
    want[i] = i < 9 ? 3 : i < 12 ? 4 : (i * 7 + 1) % (TD__FRAME_MAX_FDS + 1);
    int fds[TD__FRAME_MAX_FDS];
    for (unsigned j = 0; j < want[i]; j++)
      fds[j] = new_file(&st[i][j]);
    total += want[i];
    uint8_t buf[64];
    pattern(buf, i % 64, i);
    cr_assert_eq(td__wire_queue(&p.a, buf, i % 64, fds, want[i]), 0);
  }
  cr_assert_gt(total, TD__SEND_FDS_MAX * 3, "the test sends %u fds", total);
  cr_assert_eq(p.a.out_nfds, total);
  got g[N];
  memset(g, 0, sizeof(g));
  pump(&p, g, N);
  for (unsigned i = 0; i < N; i++) {
    check_pattern(&g[i], i % 64, i);
    cr_assert_eq(g[i].nfds, want[i], "frame %u: %u fds, expected %u", i,
                 g[i].nfds, want[i]);
    for (unsigned j = 0; j < want[i]; j++)
      check_same_file(g[i].fds[j], &st[i][j], "many fds");
  }
  got_free(g, N);
  cr_assert_eq(p.a.out_nfds, 0);
  cr_assert_eq(p.b.in_nfds, 0);
  cr_assert_eq(open_fds(), before, "no fd leaked");
  pair_close(&p);
}

Test(wire, more_fds_than_one_sendmsg_arrive_with_their_frames, .timeout = 60) {
  many_fds(0);
}

Test(wire, more_fds_than_one_sendmsg_with_short_io, .timeout = 60) {
  many_fds(5);
}

/* Big frames (like LIST replies) between runs of frames with one fd each
 * (like OPEN replies), sent through a socket that takes only part of each
 * sendmsg: the fds of later frames must not run so far ahead of their bytes
 * that the receiver's fd queue overflows. */
Test(wire, partial_writes_do_not_send_fds_far_ahead_of_their_frames,
     .timeout = 60) {
  pair p;
  pair_open(&p);
  int before = open_fds();
  enum { RUNS = 4, PER_RUN = TD__SEND_FDS_MAX, BIG = 512 * 1024 };
  enum { N = RUNS * (PER_RUN + 1) };
  uint8_t *buf = malloc(BIG);
  unsigned k = 0;
  for (unsigned r = 0; r < RUNS; r++) {
    pattern(buf, BIG, k);
    cr_assert_eq(td__wire_queue(&p.a, buf, BIG, NULL, 0), 0);
    k++;
    for (unsigned i = 0; i < PER_RUN; i++, k++) {
      struct stat st;
      int fd = new_file(&st);
      pattern(buf, 16, k);
      cr_assert_eq(td__wire_queue(&p.a, buf, 16, &fd, 1), 0);
    }
  }
  free(buf);
  got *g = calloc(N, sizeof(*g));
  pump(&p, g, N);
  k = 0;
  for (unsigned r = 0; r < RUNS; r++) {
    check_pattern(&g[k], BIG, k);
    cr_assert_eq(g[k++].nfds, 0);
    for (unsigned i = 0; i < PER_RUN; i++, k++) {
      check_pattern(&g[k], 16, k);
      cr_assert_eq(g[k].nfds, 1);
    }
  }
  got_free(g, N);
  free(g);
  cr_assert_eq(open_fds(), before);
  pair_close(&p);
}

Test(wire, fd_queue_overflow_is_eproto_and_leaks_nothing, .timeout = 30) {
  pair p;
  pair_open(&p);
  int before = open_fds();
  /* 30 frames of 4 fds; the receiver reads without taking frames, so more
   * fds pile up than its queue holds. */
  for (unsigned i = 0; i < 30; i++) {
    int fds[4];
    struct stat st;
    for (unsigned j = 0; j < 4; j++)
      fds[j] = new_file(&st);
    cr_assert_eq(td__wire_queue(&p.a, "abcd", 4, fds, 4), 0);
  }
  cr_assert_eq(td__wire_flush(&p.a, 0), 0);
  ssize_t r = 0;
  int i;
  for (i = 0; i < 10; i++)
    if ((r = td__wire_recv(&p.b, MSG_DONTWAIT)) < 0)
      break;
  cr_assert_eq(r, TD_EPROTO, "a full fd queue is a protocol error, got %zd", r);
  cr_assert_eq(p.b.in_nfds, TD__FDQ_MAX);
  pair_close(&p);
  /* pair_close closed the sockets too: count them out. */
  cr_assert_eq(open_fds(), before - 2,
               "every received fd was closed (queued or dropped)");
}

Test(wire, truncated_ancillary_data_is_eproto, .timeout = 30) {
  pair p;
  pair_open(&p);
  int before = open_fds();
  /* One sendmsg with more fds than the receiver's control buffer holds. */
  enum { NF = TD__SEND_FDS_MAX + 12 };
  int fds[NF];
  struct stat st;
  for (int i = 0; i < NF; i++)
    fds[i] = new_file(&st);
  union {
    char buf[CMSG_SPACE(sizeof(fds))];
    struct cmsghdr align;
  } ctl;
  memset(&ctl, 0, sizeof(ctl));
  uint8_t h[TD__FRAME_HDR];
  header(h, 0, 0);
  struct iovec iov = {h, sizeof(h)};
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctl.buf;
  msg.msg_controllen = sizeof(ctl.buf);
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(fds));
  memcpy(CMSG_DATA(c), fds, sizeof(fds));
  cr_assert_eq(sendmsg(p.sv[0], &msg, 0), (ssize_t)sizeof(h), "sendmsg: %s",
               strerror(errno));
  td__close_fds(fds, NF);
  cr_assert_eq(td__wire_recv(&p.b, MSG_DONTWAIT), TD_EPROTO);
  pair_close(&p);
  cr_assert_eq(open_fds(), before - 2, "no received fd leaked");
}

/* ---- bad headers ---- */

Test(wire, oversize_header_is_refused_before_allocating, .timeout = 30) {
  pair p;
  pair_open(&p);
  uint8_t h[TD__FRAME_HDR];
  header(h, TD__FRAME_MAX + 1, 0);
  raw_write(p.sv[0], h, sizeof(h));
  td__frame f;
  cr_assert_eq(recv_until_frame(&p.b, &f), TD_EMSGSIZE);
  size_t cap = p.b.in_cap;
  cr_assert_leq(cap, 64 * 1024, "in_cap %zu after an oversize header", cap);
  /* More bytes after it do not make the wire grow toward the claimed size. */
  uint8_t junk[4096];
  memset(junk, 'j', sizeof(junk));
  raw_write(p.sv[0], junk, sizeof(junk));
  cr_assert_gt(td__wire_recv(&p.b, MSG_DONTWAIT), 0);
  cr_assert_eq(td__wire_frame(&p.b, &f), TD_EMSGSIZE);
  cr_assert_leq(p.b.in_cap, 64 * 1024, "in_cap %zu", p.b.in_cap);
  pair_close(&p);
}

Test(wire, header_of_4_gib_is_emsgsize, .timeout = 30) {
  pair p;
  pair_open(&p);
  uint8_t h[TD__FRAME_HDR];
  header(h, UINT32_MAX, 0);
  raw_write(p.sv[0], h, sizeof(h));
  td__frame f;
  cr_assert_eq(recv_until_frame(&p.b, &f), TD_EMSGSIZE);
  cr_assert_leq(p.b.in_cap, 64 * 1024);
  pair_close(&p);
}

Test(wire, header_of_exactly_the_limit_is_accepted, .timeout = 30) {
  pair p;
  pair_open(&p);
  uint8_t h[TD__FRAME_HDR];
  header(h, TD__FRAME_MAX, 0);
  raw_write(p.sv[0], h, sizeof(h));
  td__frame f;
  cr_assert_eq(recv_until_frame(&p.b, &f), 0, "waits for the payload");
  pair_close(&p);
}

Test(wire, bad_magic_is_eproto, .timeout = 30) {
  pair p;
  pair_open(&p);
  uint8_t h[TD__FRAME_HDR + 4];
  header(h, 4, 0);
  h[6] = 'X';
  raw_write(p.sv[0], h, sizeof(h));
  td__frame f;
  cr_assert_eq(recv_until_frame(&p.b, &f), TD_EPROTO);
  pair_close(&p);

  pair_open(&p);
  header(h, 4, 0);
  h[7] = 'd';
  raw_write(p.sv[0], h, sizeof(h));
  cr_assert_eq(recv_until_frame(&p.b, &f), TD_EPROTO);
  pair_close(&p);
}

Test(wire, nonzero_reserved_byte_is_eproto, .timeout = 30) {
  pair p;
  pair_open(&p);
  uint8_t h[TD__FRAME_HDR];
  header(h, 0, 0);
  h[5] = 1;
  raw_write(p.sv[0], h, sizeof(h));
  td__frame f;
  cr_assert_eq(recv_until_frame(&p.b, &f), TD_EPROTO);
  pair_close(&p);
}

Test(wire, header_with_more_than_4_fds_is_eproto, .timeout = 30) {
  pair p;
  pair_open(&p);
  uint8_t h[TD__FRAME_HDR];
  header(h, 0, TD__FRAME_MAX_FDS + 1);
  raw_write(p.sv[0], h, sizeof(h));
  td__frame f;
  cr_assert_eq(recv_until_frame(&p.b, &f), TD_EPROTO);
  pair_close(&p);
}

Test(wire, header_declaring_fds_that_did_not_arrive_is_eproto, .timeout = 30) {
  pair p;
  pair_open(&p);
  uint8_t h[TD__FRAME_HDR + 3];
  header(h, 3, 2);
  memcpy(h + TD__FRAME_HDR, "abc", 3);
  /* Incomplete: more bytes are needed first. */
  raw_write(p.sv[0], h, TD__FRAME_HDR + 1);
  td__frame f;
  cr_assert_eq(recv_until_frame(&p.b, &f), 0);
  raw_write(p.sv[0], h + TD__FRAME_HDR + 1, 2);
  cr_assert_eq(recv_until_frame(&p.b, &f), TD_EPROTO);
  pair_close(&p);
}

Test(wire, incomplete_header_needs_more_bytes, .timeout = 30) {
  pair p;
  pair_open(&p);
  uint8_t h[TD__FRAME_HDR];
  header(h, 0, 0);
  td__frame f;
  for (int i = 0; i < TD__FRAME_HDR - 1; i++) {
    raw_write(p.sv[0], h + i, 1);
    cr_assert_eq(recv_until_frame(&p.b, &f), 0, "after %d bytes", i + 1);
  }
  raw_write(p.sv[0], h + TD__FRAME_HDR - 1, 1);
  cr_assert_eq(recv_until_frame(&p.b, &f), 1);
  cr_assert_eq(f.len, 0);
  cr_assert_eq(f.nfds, 0);
  td__wire_consume(&p.b, &f);
  pair_close(&p);
}

/* ---- back-pressure ---- */

Test(wire, full_socket_gives_eagain_and_a_later_flush_completes,
     .timeout = 60) {
  pair p;
  pair_open(&p);
  int before = open_fds();
  enum { N = 64, LEN = 64 * 1024 };
  uint8_t *buf = malloc(LEN);
  struct stat st[N];
  for (unsigned i = 0; i < N; i++) {
    pattern(buf, LEN, i);
    int fd = new_file(&st[i]);
    cr_assert_eq(td__wire_queue(&p.a, buf, LEN, &fd, 1), 0);
  }
  free(buf);
  cr_assert_eq(td__wire_flush(&p.a, MSG_DONTWAIT), TD_EAGAIN,
               "4 MiB do not fit in a socket buffer");
  size_t pending = td__wire_pending(&p.a);
  cr_assert_gt(pending, 0);
  cr_assert_eq(td__wire_flush(&p.a, MSG_DONTWAIT), TD_EAGAIN,
               "still full: nobody read");
  cr_assert_eq(td__wire_pending(&p.a), pending);
  /* Queue more behind the stall; it goes out in order once drained. */
  cr_assert_eq(td__wire_queue(&p.a, "tail", 4, NULL, 0), 0);
  got *g = calloc(N + 1, sizeof(*g));
  pump(&p, g, N + 1);
  for (unsigned i = 0; i < N; i++) {
    check_pattern(&g[i], LEN, i);
    cr_assert_eq(g[i].nfds, 1);
    check_same_file(g[i].fds[0], &st[i], "after EAGAIN");
  }
  cr_assert_eq(g[N].len, 4);
  cr_assert(memcmp(g[N].data, "tail", 4) == 0);
  got_free(g, N + 1);
  free(g);
  cr_assert_eq(open_fds(), before);
  pair_close(&p);
}

Test(wire, flush_to_a_closed_peer_fails_without_sigpipe, .timeout = 30) {
  pair p;
  pair_open(&p);
  close(p.sv[1]);
  p.sv[1] = -1;
  cr_assert_eq(td__wire_queue(&p.a, "x", 1, NULL, 0), 0);
  int err = td__wire_flush(&p.a, MSG_DONTWAIT);
  cr_assert_eq(err, -EPIPE, "got %s", td_err_name(err));
  td__wire_free(&p.a);
  td__wire_free(&p.b);
  close(p.sv[0]);
}

/* ---- ownership ---- */

Test(wire, free_closes_unsent_fds, .timeout = 30) {
  pair p;
  pair_open(&p);
  int before = open_fds();
  for (unsigned i = 0; i < 5; i++) {
    int fds[3];
    struct stat st;
    for (unsigned j = 0; j < 3; j++)
      fds[j] = new_file(&st);
    cr_assert_eq(td__wire_queue(&p.a, "q", 1, fds, 3), 0);
  }
  cr_assert_eq(open_fds(), before + 15);
  td__wire_free(&p.a);
  cr_assert_eq(open_fds(), before, "td__wire_free closed the queued fds");
  td__wire_free(&p.a); /* twice is harmless */
  pair_close(&p);
}

Test(wire, free_closes_received_fds_not_yet_taken, .timeout = 30) {
  pair p;
  pair_open(&p);
  int before = open_fds();
  for (unsigned i = 0; i < 3; i++) {
    int fds[2];
    struct stat st;
    for (unsigned j = 0; j < 2; j++)
      fds[j] = new_file(&st);
    cr_assert_eq(td__wire_queue(&p.a, "r", 1, fds, 2), 0);
  }
  cr_assert_eq(td__wire_flush(&p.a, 0), 0);
  cr_assert_eq(open_fds(), before, "the sender's copies are closed");
  while (p.b.in_nfds < 6)
    cr_assert_gt(td__wire_recv(&p.b, MSG_DONTWAIT), 0);
  cr_assert_eq(open_fds(), before + 6);
  td__wire_free(&p.b);
  cr_assert_eq(open_fds(), before, "td__wire_free closed the received fds");
  pair_close(&p);
}

Test(wire, free_accepts_null) {
  td__wire_free(NULL);
}

/* ---- errors ---- */

Test(wire, errors_every_code_has_its_own_name_and_description) {
  static const struct {
    int code;
    const char *name;
  } codes[] = {
#define XX(name, code, _) {code, #name},
      TD_ERRNO_MAP(XX)
#undef XX
  };
  size_t n = sizeof(codes) / sizeof(codes[0]);
  for (size_t i = 0; i < n; i++) {
    const char *s = td_strerror(codes[i].code);
    const char *nm = td_err_name(codes[i].code);
    cr_assert_not_null(s);
    cr_assert_not_null(nm);
    cr_assert_lt(codes[i].code, 0, "%s is negative", codes[i].name);
    cr_assert_str_eq(nm, codes[i].name);
    cr_assert_str_neq(s, "unknown error", "%s has a description", nm);
    cr_assert_str_neq(nm, "EUNKNOWN");
    cr_assert_gt(strlen(s), 0);
    for (size_t j = 0; j < i; j++) {
      cr_assert_neq(codes[i].code, codes[j].code, "%s and %s share a code",
                    codes[i].name, codes[j].name);
      cr_assert_str_neq(s, td_strerror(codes[j].code),
                        "%s and %s share a description", codes[i].name,
                        codes[j].name);
      cr_assert_str_neq(nm, td_err_name(codes[j].code));
    }
  }
}

Test(wire, errors_codes_equal_minus_errno) {
  cr_assert_eq(TD_EINVAL, -EINVAL);
  cr_assert_eq(TD_ENOENT, -ENOENT);
  cr_assert_eq(TD_EAGAIN, -EAGAIN);
  cr_assert_eq(TD_EMSGSIZE, -EMSGSIZE);
  cr_assert_eq(TD_EPROTO, -EPROTO);
  cr_assert_eq(TD_ENAMETOOLONG, -ENAMETOOLONG);
}

Test(wire, errors_unknown_codes_are_named_never_null) {
  static const int odd[] = {1, -1000, 12345, INT32_MIN, INT32_MAX};
  for (size_t i = 0; i < sizeof(odd) / sizeof(odd[0]); i++) {
    cr_assert_str_eq(td_strerror(odd[i]), "unknown error");
    cr_assert_str_eq(td_err_name(odd[i]), "EUNKNOWN");
  }
  cr_assert_str_eq(td_strerror(0), "success");
  cr_assert_str_eq(td_err_name(0), "OK");
}

/* ---- default socket path ---- */

Test(wire, socket_path_tensord_socket_wins) {
  setenv("TENSORD_SOCKET", "/x/y.sock", 1);
  setenv("XDG_RUNTIME_DIR", "/run/user/1", 1);
  char buf[108];
  cr_assert_eq(td_default_socket_path(buf, sizeof(buf)), 0);
  cr_assert_str_eq(buf, "/x/y.sock");
}

Test(wire, socket_path_xdg_runtime_dir_next) {
  unsetenv("TENSORD_SOCKET");
  setenv("XDG_RUNTIME_DIR", "/run/user/1", 1);
  char buf[108];
  cr_assert_eq(td_default_socket_path(buf, sizeof(buf)), 0);
  cr_assert_str_eq(buf, "/run/user/1/tensord.sock");
  /* An empty TENSORD_SOCKET counts as unset. */
  setenv("TENSORD_SOCKET", "", 1);
  cr_assert_eq(td_default_socket_path(buf, sizeof(buf)), 0);
  cr_assert_str_eq(buf, "/run/user/1/tensord.sock");
}

Test(wire, socket_path_tmp_per_uid_last) {
  unsetenv("TENSORD_SOCKET");
  unsetenv("XDG_RUNTIME_DIR");
  char buf[108], want[108];
  snprintf(want, sizeof(want), "/tmp/tensord-%u/tensord.sock",
           (unsigned)getuid());
  cr_assert_eq(td_default_socket_path(buf, sizeof(buf)), 0);
  cr_assert_str_eq(buf, want);
  setenv("XDG_RUNTIME_DIR", "", 1);
  cr_assert_eq(td_default_socket_path(buf, sizeof(buf)), 0);
  cr_assert_str_eq(buf, want);
}

Test(wire, socket_path_small_buffer_is_enametoolong) {
  setenv("TENSORD_SOCKET", "/abc/def.sock", 1); /* 13 bytes */
  char buf[32];
  cr_assert_eq(td_default_socket_path(buf, 13), TD_ENAMETOOLONG);
  cr_assert_eq(td_default_socket_path(buf, 1), TD_ENAMETOOLONG);
  cr_assert_eq(td_default_socket_path(buf, 14), 0, "exactly fits with NUL");
  cr_assert_str_eq(buf, "/abc/def.sock");
  unsetenv("TENSORD_SOCKET");
  setenv("XDG_RUNTIME_DIR", "/r", 1);
  cr_assert_eq(td_default_socket_path(buf, strlen("/r/tensord.sock")),
               TD_ENAMETOOLONG);
  unsetenv("XDG_RUNTIME_DIR");
  cr_assert_eq(td_default_socket_path(buf, 10), TD_ENAMETOOLONG);
}

/* ---- views ---- */

Test(wire, view_contiguous_is_row_major) {
  int64_t shape[3] = {2, 3, 4};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 3, shape, &v), 0);
  cr_assert_eq(v.dtype, TD_FLOAT32);
  cr_assert_eq(v.ndim, 3);
  cr_assert_eq(v.stride[0], 12);
  cr_assert_eq(v.stride[1], 4);
  cr_assert_eq(v.stride[2], 1);
  cr_assert_eq(v.offset, 0);
  cr_assert_eq(td_view_numel(&v), 24);
  cr_assert_eq(td_view_check(&v, 96), 0);
  cr_assert_eq(td_view_check(&v, 95), TD_ERANGE);
  cr_assert_eq(td_view_check(&v, 1 << 20), 0);
}

Test(wire, view_zero_d_view_has_one_element) {
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT64, 0, NULL, &v), 0);
  cr_assert_eq(v.ndim, 0);
  cr_assert_eq(td_view_numel(&v), 1);
  cr_assert_eq(td_view_check(&v, 8), 0);
  cr_assert_eq(td_view_check(&v, 7), TD_ERANGE);
  v.offset = 1;
  cr_assert_eq(td_view_check(&v, 16), 0);
  cr_assert_eq(td_view_check(&v, 15), TD_ERANGE);
}

Test(wire, view_zero_size_dims_are_empty) {
  int64_t shape[3] = {3, 0, 2};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_INT16, 3, shape, &v), 0);
  cr_assert_eq(td_view_numel(&v), 0);
  /* PyTorch's strides for an empty (3, 0, 2) tensor. */
  cr_assert_eq(v.stride[0], 2);
  cr_assert_eq(v.stride[1], 2);
  cr_assert_eq(v.stride[2], 1);
  cr_assert_eq(td_view_check(&v, 0), 0, "an empty view touches no byte");
  /* An empty view may start at the very end of its storage, not past it. */
  v.offset = 8;
  cr_assert_eq(td_view_check(&v, 16), 0);
  v.offset = 9;
  cr_assert_eq(td_view_check(&v, 16), TD_ERANGE);
  int64_t one[1] = {0};
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, one, &v), 0);
  cr_assert_eq(td_view_numel(&v), 0);
  cr_assert_eq(td_view_check(&v, 0), 0);
}

Test(wire, view_strided_and_broadcast_views) {
  td_view v;
  memset(&v, 0, sizeof(v));
  v.dtype = TD_FLOAT32;
  v.ndim = 2;
  v.shape[0] = 4; /* the transpose of a 3 x 4 matrix */
  v.shape[1] = 3;
  v.stride[0] = 1;
  v.stride[1] = 4;
  cr_assert_eq(td_view_check(&v, 48), 0);
  cr_assert_eq(td_view_check(&v, 47), TD_ERANGE);
  v.offset = 1; /* now reaches element 12 */
  cr_assert_eq(td_view_check(&v, 48), TD_ERANGE);
  cr_assert_eq(td_view_check(&v, 52), 0);
  /* Stride 0: every element is the first. */
  memset(&v, 0, sizeof(v));
  v.dtype = TD_INT32;
  v.ndim = 1;
  v.shape[0] = 1000000;
  v.stride[0] = 0;
  cr_assert_eq(td_view_check(&v, 4), 0);
  cr_assert_eq(td_view_numel(&v), 1000000);
}

Test(wire, view_overflow_is_eoverflow) {
  td_view v, keep;
  memset(&keep, 0x5a, sizeof(keep));
  v = keep;
  int64_t big[2] = {INT64_MAX / 2, 4};
  cr_assert_eq(td_view_contiguous(TD_UINT8, 2, big, &v), TD_EINVAL);
  cr_assert(memcmp(&v, &keep, sizeof(v)) == 0, "*out unchanged on failure");

  memset(&v, 0, sizeof(v));
  v.dtype = TD_UINT8;
  v.ndim = 2;
  v.shape[0] = INT64_MAX;
  v.shape[1] = 2;
  v.stride[0] = 1;
  v.stride[1] = 1;
  cr_assert_eq(td_view_numel(&v), TD_EINVAL);
  cr_assert_eq(td_view_check(&v, SIZE_MAX), TD_EINVAL);

  memset(&v, 0, sizeof(v));
  v.dtype = TD_UINT8;
  v.ndim = 2;
  v.shape[0] = 2;
  v.shape[1] = 2;
  v.stride[0] = INT64_MAX;
  v.stride[1] = 1;
  cr_assert_eq(td_view_check(&v, SIZE_MAX), TD_EINVAL);

  /* The element count fits, the byte count does not. */
  memset(&v, 0, sizeof(v));
  v.dtype = TD_FLOAT64;
  v.ndim = 1;
  v.shape[0] = INT64_MAX / 4;
  v.stride[0] = 1;
  cr_assert_eq(td_view_numel(&v), INT64_MAX / 4);
  cr_assert_eq(td_view_check(&v, SIZE_MAX), TD_EINVAL);

  /* The offset alone. */
  memset(&v, 0, sizeof(v));
  v.dtype = TD_UINT8;
  v.ndim = 0;
  v.offset = INT64_MAX;
  cr_assert_eq(td_view_check(&v, SIZE_MAX), TD_EINVAL);
}

Test(wire, view_large_in_range_view_is_fine) {
  int64_t shape[2] = {1 << 20, 1 << 20};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  cr_assert_eq(td_view_numel(&v), (int64_t)1 << 40);
  cr_assert_eq(td_view_check(&v, (size_t)1 << 42), 0);
  cr_assert_eq(td_view_check(&v, ((size_t)1 << 42) - 1), TD_ERANGE);
}

Test(wire, view_malformed_views_are_einval) {
  td_view v, keep;
  int64_t shape[2] = {2, 2};
  memset(&keep, 0x5a, sizeof(keep));
  v = keep;
  cr_assert_eq(td_view_contiguous(TD_DTYPE_INVALID, 2, shape, &v), TD_EINVAL);
  cr_assert_eq(td_view_contiguous(TD_DTYPE_COUNT_, 2, shape, &v), TD_EINVAL);
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, -1, shape, &v), TD_EINVAL);
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, TD_MAX_DIMS + 1, shape, &v),
               TD_EINVAL);
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, NULL, &v), TD_EINVAL);
  int64_t neg[2] = {2, -1};
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, neg, &v), TD_EINVAL);
  cr_assert(memcmp(&v, &keep, sizeof(v)) == 0, "*out unchanged on failure");

  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  td_view bad = v;
  bad.stride[1] = -1;
  cr_assert_eq(td_view_check(&bad, 1024), TD_EINVAL, "negative stride");
  cr_assert_eq(td_view_numel(&bad), TD_EINVAL);
  bad = v;
  bad.shape[0] = -2;
  cr_assert_eq(td_view_check(&bad, 1024), TD_EINVAL, "negative size");
  bad = v;
  bad.offset = -1;
  cr_assert_eq(td_view_check(&bad, 1024), TD_EINVAL, "negative offset");
  bad = v;
  bad.ndim = TD_MAX_DIMS + 1;
  cr_assert_eq(td_view_check(&bad, 1024), TD_EINVAL, "too many dims");
  bad = v;
  bad.ndim = -1;
  cr_assert_eq(td_view_check(&bad, 1024), TD_EINVAL);
  bad = v;
  bad.dtype = (td_dtype)99;
  cr_assert_eq(td_view_check(&bad, 1024), TD_EINVAL, "unknown dtype");
}

Test(wire, view_sixteen_dims_are_allowed) {
  int64_t shape[TD_MAX_DIMS];
  for (int i = 0; i < TD_MAX_DIMS; i++)
    shape[i] = 2;
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_UINT8, TD_MAX_DIMS, shape, &v), 0);
  cr_assert_eq(td_view_numel(&v), 1 << TD_MAX_DIMS);
  cr_assert_eq(td_view_check(&v, 1 << TD_MAX_DIMS), 0);
  cr_assert_eq(td_view_check(&v, (1 << TD_MAX_DIMS) - 1), TD_ERANGE);
}

Test(wire, view_format_names_dtype_shape_strides_offset) {
  int64_t shape[2] = {4, 3};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 2, shape, &v), 0);
  char buf[128];
  cr_assert_str_eq(td_view_format(&v, buf, sizeof(buf)),
                   "float32[4, 3] stride (3, 1) offset 0");
  char small[8];
  td_view_format(&v, small, sizeof(small));
  cr_assert_lt(strlen(small), sizeof(small), "truncated, NUL-terminated");
}
