/* test_badinput.c: hand-made frames and misbehaving clients against a real
 * tensord: each gets the right error, and the daemon keeps serving others
 * and leaks nothing. */
#include "harness.h"

#include "tensord.pb-c.h"
#include "wire.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <string.h>
#include <sys/socket.h>

static tdt_daemon d;

/* ---- a raw connection ---- */

typedef struct raw {
  int fd;
  td__wire w;
} raw;

/* Raw connections live here, so that the fixture can close those a failed
 * test left open. A test that passes closes its own: the leak check at its
 * end counts them. */
static raw raws[8];

/* Connects (and says Hello if asked); returns a slot of raws. */
static raw *raw_open(int hello) {
  for (int i = 0; i < 8; i++) {
    raw *r = &raws[i];
    if (r->fd >= 0)
      continue;
    r->fd = tdt_raw_connect(&d, hello);
    td__wire_init(&r->w, r->fd);
    return r;
  }
  cr_assert_fail("too many raw connections");
  return NULL;
}

static void raw_close(raw *r) {
  td__wire_free(&r->w);
  if (r->fd >= 0)
    close(r->fd);
  r->fd = -1;
  r->w.fd = -1;
}

static void setup(void) {
  for (int i = 0; i < 8; i++)
    raws[i].fd = raws[i].w.fd = -1;
  tdt_start(&d, NULL);
}

/* After a failed assertion: what the test left goes. */
static void teardown(void) {
  for (int i = 0; i < 8; i++)
    if (raws[i].fd >= 0)
      raw_close(&raws[i]);
  tdt_cleanup();
}

TestSuite(badinput, .init = setup, .fini = teardown, .timeout = 30);

static void raw_write(raw *r, const void *buf, size_t len) {
  const uint8_t *p = buf;
  while (len > 0) {
    ssize_t n = send(r->fd, p, len, MSG_NOSIGNAL);
    cr_assert(n > 0, "send: %s", strerror(errno));
    p += n;
    len -= (size_t)n;
  }
}

static void frame_header(uint8_t h[8], uint32_t len, uint8_t nfds) {
  h[0] = (uint8_t)len;
  h[1] = (uint8_t)(len >> 8);
  h[2] = (uint8_t)(len >> 16);
  h[3] = (uint8_t)(len >> 24);
  h[4] = nfds;
  h[5] = 0;
  h[6] = 'T';
  h[7] = 'D';
}

/* Sends payload in one frame. */
static void raw_send_payload(raw *r, const void *payload, size_t len) {
  cr_assert_eq(td__wire_queue(&r->w, payload, len, NULL, 0), 0);
  cr_assert_eq(td__wire_flush(&r->w, 0), 0);
}

static void raw_send(raw *r, Tensord__Request *req) {
  size_t len = tensord__request__get_packed_size(req);
  uint8_t *p = td__wire_reserve(&r->w, len);
  cr_assert_not_null(p);
  tensord__request__pack(req, p);
  cr_assert_eq(td__wire_commit(&r->w, len, NULL, 0), 0);
  cr_assert_eq(td__wire_flush(&r->w, 0), 0);
}

/* Reads one Response, waiting up to timeout_ms. Returns NULL if the daemon
 * closed the connection (EOF or reset); asserts if nothing came in time.
 * The frame's fd goes to *fd (or is closed when fd is NULL). */
static Tensord__Response *raw_recv_ms(raw *r, int *fd, int timeout_ms) {
  if (fd != NULL)
    *fd = -1;
  for (;;) {
    td__frame f;
    int got = td__wire_frame(&r->w, &f);
    cr_assert_geq(got, 0, "bad frame from tensord: %s", td_err_name(got));
    if (got == 1) {
      Tensord__Response *resp = tensord__response__unpack(NULL, f.len, f.data);
      cr_assert_not_null(resp, "tensord's reply does not decode");
      for (unsigned i = 0; i < f.nfds; i++) {
        if (fd != NULL && i == 0)
          *fd = f.fds[0];
        else
          close(f.fds[i]);
      }
      td__wire_consume(&r->w, &f);
      return resp;
    }
    struct pollfd p = {r->fd, POLLIN, 0};
    int n = poll(&p, 1, timeout_ms);
    cr_assert_eq(n, 1, "no reply and no hang-up from tensord within %d ms",
                 timeout_ms);
    ssize_t k = td__wire_recv(&r->w, MSG_DONTWAIT);
    if (k == 0 || k == TD_ECONNRESET)
      return NULL;
    if (k == TD_EAGAIN)
      continue;
    cr_assert_gt(k, 0, "recv: %s", td_err_name((int)k));
  }
}

static Tensord__Response *raw_recv(raw *r, int *fd) {
  return raw_recv_ms(r, fd, 10000);
}

/* Reads one reply and asserts it is an Error with code whose message
 * contains each of the needles (NULL-terminated). Returns its seq. */
static uint64_t expect_error_(raw *r, int code, const char *const *needles) {
  Tensord__Response *resp = raw_recv(r, NULL);
  cr_assert_not_null(resp, "tensord hung up instead of answering %s",
                     td_err_name(code));
  cr_assert_eq(resp->body_case, TENSORD__RESPONSE__BODY_ERROR,
               "expected an Error (%s), got body %d", td_err_name(code),
               (int)resp->body_case);
  cr_assert_eq(resp->error->code, code, "expected %s, got %s: %s",
               td_err_name(code), td_err_name(resp->error->code),
               resp->error->message);
  for (int i = 0; needles && needles[i]; i++)
    cr_assert(strstr(resp->error->message, needles[i]) != NULL,
              "message '%s' does not name '%s'", resp->error->message,
              needles[i]);
  uint64_t seq = resp->seq;
  tensord__response__free_unpacked(resp, NULL);
  return seq;
}

#define expect_error(r, code, ...)                                             \
  expect_error_(r, code, (const char *const[]){__VA_ARGS__, NULL})

/* The daemon hung up on r (after any replies already read). */
static void expect_closed(raw *r) {
  Tensord__Response *resp = raw_recv_ms(r, NULL, 5000);
  cr_assert_null(resp, "tensord kept the connection and sent body %d",
                 resp ? (int)resp->body_case : 0);
}

/* The connection is still usable: a Ping on it gets its Pong. */
static void expect_usable(raw *r, uint64_t seq) {
  Tensord__Ping p = TENSORD__PING__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  uint8_t payload[3] = {1, 2, 3};
  p.payload.data = payload;
  p.payload.len = sizeof(payload);
  req.seq = seq;
  req.body_case = TENSORD__REQUEST__BODY_PING;
  req.ping = &p;
  raw_send(r, &req);
  Tensord__Response *resp = raw_recv(r, NULL);
  cr_assert_not_null(resp, "tensord hung up on a Ping");
  cr_assert_eq(resp->body_case, TENSORD__RESPONSE__BODY_PONG, "body %d",
               (int)resp->body_case);
  cr_assert_eq(resp->seq, seq);
  cr_assert_eq(resp->pong->payload.len, 3);
  cr_assert(memcmp(resp->pong->payload.data, payload, 3) == 0);
  tensord__response__free_unpacked(resp, NULL);
}

/* tensord still serves a new client and holds no segment. */
static void expect_daemon_fine(void) {
  td_client *c = tdt_connect(&d);
  cr_assert_eq(td_ping(c, NULL), 0, "ping: %s", td_last_error(c));
  td_close(c);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000), "%d segment(s) left",
            tdt_segments(&d));
}

static uint64_t stat_field(size_t off) {
  td_client *c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0, "stat: %s", td_last_error(c));
  td_close(c);
  return *(uint64_t *)((char *)&st + off);
}

static int no_waiters(const tdt_daemon *dd) {
  (void)dd;
  return stat_field(offsetof(td_stat, waiters)) == 0;
}

static int one_waiter(const tdt_daemon *dd) {
  (void)dd;
  return stat_field(offsetof(td_stat, waiters)) == 1;
}

/* Clients connected besides the one asking (stat counts its own) and those
 * the test keeps. */
static uint64_t kept_clients;
static int no_other_clients(const tdt_daemon *dd) {
  (void)dd;
  return stat_field(offsetof(td_stat, clients)) == 1 + kept_clients;
}

/* Creates a storage on r; returns its id (its fd is closed). */
static uint64_t raw_create(raw *r, uint64_t nbytes, uint64_t seq) {
  Tensord__Create m = TENSORD__CREATE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.nbytes = nbytes;
  req.seq = seq;
  req.body_case = TENSORD__REQUEST__BODY_CREATE;
  req.create = &m;
  raw_send(r, &req);
  int fd;
  Tensord__Response *resp = raw_recv(r, &fd);
  cr_assert_not_null(resp);
  cr_assert_eq(resp->body_case, TENSORD__RESPONSE__BODY_STORAGE, "body %d: %s",
               (int)resp->body_case,
               resp->body_case == TENSORD__RESPONSE__BODY_ERROR
                   ? resp->error->message
                   : "");
  cr_assert(resp->storage->fd && fd >= 0, "a create's reply carries an fd");
  uint64_t id = resp->storage->id;
  close(fd);
  tensord__response__free_unpacked(resp, NULL);
  return id;
}

static void raw_publish(raw *r, uint64_t seq, const void *key, size_t klen,
                        uint64_t id, Tensord__View *view) {
  Tensord__Publish m = TENSORD__PUBLISH__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.key.data = (uint8_t *)key;
  m.key.len = klen;
  m.id = id;
  m.view = view;
  req.seq = seq;
  req.body_case = TENSORD__REQUEST__BODY_PUBLISH;
  req.publish = &m;
  raw_send(r, &req);
}

static void raw_lookup(raw *r, uint64_t seq, const void *key, size_t klen,
                       int32_t wait_ms) {
  Tensord__Lookup m = TENSORD__LOOKUP__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.key.data = (uint8_t *)key;
  m.key.len = klen;
  m.wait_ms = wait_ms;
  req.seq = seq;
  req.body_case = TENSORD__REQUEST__BODY_LOOKUP;
  req.lookup = &m;
  raw_send(r, &req);
}

/* ---- framing ---- */

TDT_TEST(badinput, oversize_frame_closes_connection) {
  raw *r = raw_open(1);
  uint8_t h[8];
  frame_header(h, 2u << 20, 0);
  raw_write(r, h, sizeof(h));
  uint64_t seq = expect_error(r, TD_EMSGSIZE, "2097152", "1048576");
  cr_assert_eq(seq, 0, "a protocol error answers seq 0");
  expect_closed(r);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, oversize_frame_before_hello_closes_connection) {
  raw *r = raw_open(0);
  uint8_t h[8];
  frame_header(h, 0xffffffffu, 0);
  raw_write(r, h, sizeof(h));
  expect_error(r, TD_EMSGSIZE, "4294967295");
  expect_closed(r);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, garbled_header_closes_connection) {
  raw *r = raw_open(1);
  uint8_t h[12] = {4, 0, 0, 0, 0, 0, 'X', 'Y', 1, 2, 3, 4};
  raw_write(r, h, sizeof(h));
  expect_error(r, TD_EPROTO, "garbled frame header", "58 59");
  expect_closed(r);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, nonzero_reserved_byte_closes_connection) {
  raw *r = raw_open(1);
  uint8_t h[8];
  frame_header(h, 0, 0);
  h[5] = 7;
  raw_write(r, h, sizeof(h));
  expect_error(r, TD_EPROTO, "garbled frame header");
  expect_closed(r);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, frame_declaring_fds_it_did_not_send_closes_connection) {
  raw *r = raw_open(1);
  Tensord__Ping p = TENSORD__PING__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  req.seq = 2;
  req.body_case = TENSORD__REQUEST__BODY_PING;
  req.ping = &p;
  uint8_t buf[64];
  size_t len = tensord__request__pack(&req, buf + 8);
  frame_header(buf, (uint32_t)len, 1);
  raw_write(r, buf, 8 + len);
  expect_error(r, TD_EPROTO, "garbled frame header");
  expect_closed(r);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, truncated_frame_then_disconnect_leaks_nothing) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  for (int i = 0; i < 3; i++) {
    raw *r = raw_open(1);
    uint8_t buf[8 + 10];
    frame_header(buf, 100, 0);
    memset(buf + 8, 0x11, 10);
    raw_write(r, buf, i == 0 ? 5 : sizeof(buf)); /* mid-header, mid-body */
    raw_close(r);
  }
  kept_clients = 1;
  cr_assert(tdt_until(no_other_clients, &d, 5000),
            "tensord dropped the truncated clients");
  cr_assert_eq(td_ping(c, NULL), 0, "the other client is still served");
  cr_assert_eq(tdt_segments(&d), 1);
  td_storage_release(s);
  td_close(c);
  expect_daemon_fine();
}

TDT_TEST(badinput, payload_that_is_not_protobuf_closes_connection) {
  raw *r = raw_open(1);
  /* Field 10 (hello), length 127, but only two bytes follow. */
  static const uint8_t junk[] = {0x52, 0x7f, 0x01, 0x02};
  raw_send_payload(r, junk, sizeof(junk));
  expect_error(r, TD_EPROTO, "garbled frame", "4 bytes");
  expect_closed(r);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, payload_of_varint_garbage_closes_connection) {
  raw *r = raw_open(1);
  uint8_t junk[16];
  memset(junk, 0xff, sizeof(junk));
  raw_send_payload(r, junk, sizeof(junk));
  expect_error(r, TD_EPROTO, "16 bytes");
  expect_closed(r);
  raw_close(r);
  expect_daemon_fine();
}

/* ---- the Hello exchange ---- */

static void send_ping(raw *r, uint64_t seq) {
  Tensord__Ping p = TENSORD__PING__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  req.seq = seq;
  req.body_case = TENSORD__REQUEST__BODY_PING;
  req.ping = &p;
  raw_send(r, &req);
}

TDT_TEST(badinput, request_before_hello_is_eproto) {
  raw *r = raw_open(0);
  send_ping(r, 5);
  uint64_t seq = expect_error(r, TD_EPROTO, "Hello");
  cr_assert_eq(seq, 5);
  expect_closed(r);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, second_hello_is_eproto) {
  raw *r = raw_open(1);
  Tensord__Hello h = TENSORD__HELLO__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  h.version = TD_PROTOCOL_VERSION;
  req.seq = 9;
  req.body_case = TENSORD__REQUEST__BODY_HELLO;
  req.hello = &h;
  raw_send(r, &req);
  expect_error(r, TD_EPROTO, "Hello");
  expect_closed(r);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, wrong_protocol_version_closes_connection) {
  raw *r = raw_open(0);
  Tensord__Hello h = TENSORD__HELLO__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  h.version = TD_PROTOCOL_VERSION + 41;
  h.client_name = "from-the-future";
  req.seq = 1;
  req.body_case = TENSORD__REQUEST__BODY_HELLO;
  req.hello = &h;
  raw_send(r, &req);
  char want[16];
  snprintf(want, sizeof(want), "%d", TD_PROTOCOL_VERSION + 41);
  expect_error(r, TD_EPROTONOSUPPORT, want);
  expect_closed(r);
  raw_close(r);
  expect_daemon_fine();
}

/* ---- unknown operations ---- */

TDT_TEST(badinput, request_without_body_is_enosys_and_connection_stays) {
  raw *r = raw_open(1);
  Tensord__Request req = TENSORD__REQUEST__INIT;
  req.seq = 77;
  raw_send(r, &req);
  uint64_t seq = expect_error(r, TD_ENOSYS, "unknown operation");
  cr_assert_eq(seq, 77);
  expect_usable(r, 78);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, request_from_a_newer_client_is_enosys_and_connection_stays) {
  raw *r = raw_open(1);
  /* seq 7, then field 90 (an operation this daemon does not know), empty:
   * the tag (90 << 3 | 2) is the varint 0xd2 0x05. */
  static const uint8_t future[] = {0x08, 0x07, 0xd2, 0x05, 0x00};
  raw_send_payload(r, future, sizeof(future));
  uint64_t seq = expect_error(r, TD_ENOSYS, "unknown operation");
  cr_assert_eq(seq, 7);
  expect_usable(r, 8);
  raw_close(r);
  expect_daemon_fine();
}

/* ---- fds from the client ---- */

TDT_TEST(badinput, fds_from_client_are_refused_and_closed) {
  raw *r = raw_open(1);
  int pfd[2];
  cr_assert_eq(pipe2(pfd, O_CLOEXEC), 0);
  Tensord__Ping p = TENSORD__PING__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  req.seq = 3;
  req.body_case = TENSORD__REQUEST__BODY_PING;
  req.ping = &p;
  uint8_t buf[64];
  size_t len = tensord__request__pack(&req, buf + 8);
  frame_header(buf, (uint32_t)len, 1);
  union {
    char b[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } ctl;
  memset(&ctl, 0, sizeof(ctl));
  struct iovec iov = {buf, 8 + len};
  struct msghdr msg = {0};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = ctl.b;
  msg.msg_controllen = sizeof(ctl.b);
  struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  memcpy(CMSG_DATA(c), &pfd[1], sizeof(int)); /* the write end */
  cr_assert_eq(sendmsg(r->fd, &msg, MSG_NOSIGNAL), (ssize_t)(8 + len),
               "sendmsg: %s", strerror(errno));
  close(pfd[1]);
  expect_error(r, TD_EPROTO, "file descriptor");
  expect_closed(r);
  /* The daemon closed its copy of the write end: the read end sees EOF. */
  struct pollfd pp = {pfd[0], POLLIN, 0};
  cr_assert_eq(poll(&pp, 1, 5000), 1, "the pipe's write end is still open");
  char ch;
  cr_assert_eq(read(pfd[0], &ch, 1), 0, "EOF: no write end is left open");
  close(pfd[0]);
  raw_close(r);
  expect_daemon_fine();
}

/* ---- storages ---- */

TDT_TEST(badinput, open_of_unknown_storage_is_enoent_naming_the_id) {
  td_client *c = tdt_connect(&d);
  td_storage *s = (td_storage *)1;
  cr_assert_eq(td_storage_open(c, 987654321, 0, &s), TD_ENOENT);
  cr_assert_null(s);
  cr_assert(strstr(td_last_error(c), "987654321") != NULL, "'%s'",
            td_last_error(c));
  cr_assert_eq(td_storage_open(c, 987654321, TD_RDONLY, &s), TD_ENOENT);
  cr_assert_eq(td_ping(c, NULL), 0, "the connection stays");
  td_close(c);
  expect_daemon_fine();
}

TDT_TEST(badinput, create_of_zero_bytes_is_einval) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 0, &s), TD_EINVAL);
  cr_assert_null(s);
  cr_assert(strstr(td_last_error(c), "0 bytes") != NULL, "'%s'",
            td_last_error(c));
  td_close(c);
  /* And from a client that does not check first. */
  raw *r = raw_open(1);
  Tensord__Create m = TENSORD__CREATE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  req.seq = 4;
  req.body_case = TENSORD__REQUEST__BODY_CREATE;
  req.create = &m;
  raw_send(r, &req);
  cr_assert_eq(expect_error(r, TD_EINVAL, "0 bytes"), 4);
  expect_usable(r, 5);
  raw_close(r);
  expect_daemon_fine();
}

/* A CUDA create names its GPU by UUID (16 bytes): without one it is
 * malformed; with one no GPU of the daemon has (or with no driver at all,
 * as here unless the host has one) it is TD_ENODEV. */
TDT_TEST(badinput, create_on_cuda_needs_a_known_uuid) {
  raw *r = raw_open(1);
  Tensord__Create m = TENSORD__CREATE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.nbytes = 4096;
  m.device = TENSORD__DEVICE__DEVICE_CUDA;
  req.seq = 4;
  req.body_case = TENSORD__REQUEST__BODY_CREATE;
  req.create = &m;
  raw_send(r, &req);
  expect_error(r, TD_EINVAL, "UUID");
  uint8_t uuid[16];
  memset(uuid, 0xee, sizeof(uuid));
  m.device_uuid.data = uuid;
  m.device_uuid.len = sizeof(uuid);
  req.seq = 5;
  raw_send(r, &req);
  expect_error(r, TD_ENODEV, "");
  m.device = 7;
  req.seq = 6;
  raw_send(r, &req);
  expect_error(r, TD_ENODEV, "device 7");
  expect_usable(r, 7);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, release_of_what_is_not_held_is_ignored) {
  raw *r = raw_open(1);
  Tensord__Release m = TENSORD__RELEASE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.id = 424242;
  m.count = 3;
  req.body_case = TENSORD__REQUEST__BODY_RELEASE;
  req.release = &m;
  raw_send(r, &req);
  expect_usable(r, 2);
  cr_assert(tdt_log_has(&d, "424242"), "the log names the storage");
  /* Over-releasing a storage it holds changes nothing either. */
  uint64_t id = raw_create(r, 64, 3);
  m.id = id;
  m.count = 2;
  raw_send(r, &req);
  expect_usable(r, 4);
  cr_assert_eq(tdt_segments(&d), 1, "still held once");
  m.count = 1;
  raw_send(r, &req);
  expect_usable(r, 5);
  cr_assert(tdt_until(tdt_no_segments, &d, 5000));
  raw_close(r);
  expect_daemon_fine();
}

/* ---- keys ---- */

TDT_TEST(badinput, bad_keys_are_refused_by_the_library) {
  td_client *c = tdt_connect(&d);
  td_storage *s, *got;
  cr_assert_eq(td_storage_create(c, 64, &s), 0);
  char k256[257];
  memset(k256, 'k', 256);
  k256[256] = '\0';
  size_t big = 10u << 20;
  char *k10m = malloc(big + 1);
  cr_assert_not_null(k10m);
  memset(k10m, 'x', big);
  k10m[big] = '\0';
  const char *keys[] = {"", k256, k10m};
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(td_publish(c, keys[i], s, NULL), TD_EINVAL, "key %d", i);
    cr_assert_gt(strlen(td_last_error(c)), 0);
    cr_assert_lt(strlen(td_last_error(c)), 1024);
    got = (td_storage *)1;
    cr_assert_eq(td_lookup(c, keys[i], 0, 0, &got, NULL), TD_EINVAL);
    cr_assert_null(got);
    cr_assert_eq(td_lookup(c, keys[i], 0, -1, &got, NULL), TD_EINVAL,
                 "refused before any wait");
    cr_assert_eq(td_unpublish(c, keys[i]), TD_EINVAL);
    cr_assert_eq(td_info(c, 0, keys[i], NULL, NULL, NULL), TD_EINVAL);
  }
  cr_assert(strstr(td_last_error(c), "longer than 255") != NULL, "'%s'",
            td_last_error(c));
  cr_assert_eq(td_publish(c, NULL, s, NULL), TD_EINVAL);
  free(k10m);
  cr_assert_eq(td_ping(c, NULL), 0);
  td_storage_release(s);
  td_close(c);
  expect_daemon_fine();
}

TDT_TEST(badinput, bad_keys_sent_raw_are_einval_and_connection_stays) {
  raw *r = raw_open(1);
  uint64_t id = raw_create(r, 64, 2);
  static const struct {
    const char *key;
    size_t len;
    const char *why;
  } bad[] = {
      {"\xff\xfe", 2, "UTF-8"},
      {"ok\xc0\xaf", 4, "UTF-8"},
      {"\xed\xa0\x80", 3, "UTF-8"},
      {"a\0b", 3, "NUL"},
      {"", 0, "empty"},
  };
  uint64_t seq = 10;
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    raw_lookup(r, seq, bad[i].key, bad[i].len, 0);
    cr_assert_eq(expect_error(r, TD_EINVAL, "bad key", bad[i].why), seq);
    seq++;
    raw_lookup(r, seq, bad[i].key, bad[i].len, -1);
    cr_assert_eq(expect_error(r, TD_EINVAL, bad[i].why), seq, "no wait");
    seq++;
    raw_publish(r, seq, bad[i].key, bad[i].len, id, NULL);
    cr_assert_eq(expect_error(r, TD_EINVAL, bad[i].why), seq);
    seq++;
    Tensord__Unpublish u = TENSORD__UNPUBLISH__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    u.key.data = (uint8_t *)bad[i].key;
    u.key.len = bad[i].len;
    req.seq = seq;
    req.body_case = TENSORD__REQUEST__BODY_UNPUBLISH;
    req.unpublish = &u;
    raw_send(r, &req);
    cr_assert_eq(expect_error(r, TD_EINVAL, bad[i].why), seq);
    seq++;
    Tensord__Info in = TENSORD__INFO__INIT;
    in.which_case = TENSORD__INFO__WHICH_KEY;
    in.key.data = (uint8_t *)bad[i].key;
    in.key.len = bad[i].len;
    req.seq = seq;
    req.body_case = TENSORD__REQUEST__BODY_INFO;
    req.info = &in;
    raw_send(r, &req);
    cr_assert_eq(expect_error(r, TD_EINVAL, bad[i].why), seq);
    seq++;
    /* A channel's name is a key too; an empty one arrives with no data at
     * all (a NULL pointer, which the daemon must not copy from). */
    Tensord__ChanCreate cc = TENSORD__CHAN_CREATE__INIT;
    cc.name.data = (uint8_t *)bad[i].key;
    cc.name.len = bad[i].len;
    cc.capacity = 4;
    req.seq = seq;
    req.body_case = TENSORD__REQUEST__BODY_CHAN_CREATE;
    req.chan_create = &cc;
    raw_send(r, &req);
    cr_assert_eq(expect_error(r, TD_EINVAL, "channel name", bad[i].why), seq);
    seq++;
    Tensord__ChanOpen co = TENSORD__CHAN_OPEN__INIT;
    co.name.data = (uint8_t *)bad[i].key;
    co.name.len = bad[i].len;
    req.seq = seq;
    req.body_case = TENSORD__REQUEST__BODY_CHAN_OPEN;
    req.chan_open = &co;
    raw_send(r, &req);
    cr_assert_eq(expect_error(r, TD_EINVAL, "channel name", bad[i].why), seq);
    seq++;
  }
  /* 256 bytes: too long for the daemon too. */
  char k256[256];
  memset(k256, 'k', sizeof(k256));
  raw_lookup(r, seq, k256, sizeof(k256), 0);
  expect_error(r, TD_EINVAL, "256");
  expect_usable(r, ++seq);
  /* Nothing was published. */
  td_client *c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.keys, 0);
  cr_assert_eq(st.waiters, 0);
  td_close(c);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, key_with_nul_cannot_alias_a_shorter_key) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 64, &s), 0);
  cr_assert_eq(td_publish(c, "a", s, NULL), 0);
  raw *r = raw_open(1);
  raw_lookup(r, 2, "a\0b", 3, 0);
  expect_error(r, TD_EINVAL, "NUL");
  raw_close(r);
  cr_assert_eq(td_unpublish(c, "a"), 0);
  td_storage_release(s);
  td_close(c);
  expect_daemon_fine();
}

TDT_TEST(badinput, lookup_with_negative_wait_is_einval) {
  raw *r = raw_open(1);
  raw_lookup(r, 2, "k", 1, -5);
  expect_error(r, TD_EINVAL, "-5");
  expect_usable(r, 3);
  raw_close(r);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "k", 0, -2, &s, NULL), TD_EINVAL);
  cr_assert_eq(td_lookup(c, "k", 0x100, 0, &s, NULL), TD_EINVAL);
  td_close(c);
  expect_daemon_fine();
}

/* ---- views ---- */

static void view_msg(Tensord__View *m, int32_t dtype, size_t n, int64_t *shape,
                     int64_t *stride, int64_t offset) {
  tensord__view__init(m);
  m->dtype = dtype;
  m->n_shape = m->n_stride = n;
  m->shape = shape;
  m->stride = stride;
  m->offset = offset;
}

TDT_TEST(badinput, publish_of_view_past_storage_is_erange) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 64, &s), 0);
  int64_t shape[1] = {17};
  td_view v;
  cr_assert_eq(td_view_contiguous(TD_FLOAT32, 1, shape, &v), 0);
  cr_assert_eq(td_publish(c, "past", s, &v), TD_ERANGE);
  cr_assert(strstr(td_last_error(c), "68") && strstr(td_last_error(c), "64"),
            "'%s'", td_last_error(c));
  td_storage_release(s);
  td_close(c);

  /* The daemon checks too. */
  raw *r = raw_open(1);
  uint64_t id = raw_create(r, 64, 2);
  int64_t sh[2] = {4, 5}, st[2] = {4, 1};
  Tensord__View m;
  view_msg(&m, TD_FLOAT32, 2, sh, st, 0); /* elements 0..16: 68 bytes */
  raw_publish(r, 3, "past", 4, id, &m);
  cr_assert_eq(expect_error(r, TD_ERANGE, "past", "68", "64"), 3);
  view_msg(&m, TD_UINT8, 0, NULL, NULL, 64); /* 0-d at byte 64 */
  raw_publish(r, 4, "past", 4, id, &m);
  expect_error(r, TD_ERANGE, "65");
  int64_t e[1] = {0}, es[1] = {1};
  view_msg(&m, TD_UINT8, 1, e, es, 64); /* empty, at the end: fine */
  raw_publish(r, 5, "edge", 4, id, &m);
  Tensord__Response *resp = raw_recv(r, NULL);
  cr_assert_not_null(resp);
  cr_assert_eq(resp->body_case, TENSORD__RESPONSE__BODY_OK, "%s",
               resp->body_case == TENSORD__RESPONSE__BODY_ERROR
                   ? resp->error->message
                   : "");
  tensord__response__free_unpacked(resp, NULL);
  expect_usable(r, 6);
  raw_close(r);
  /* The key holds the storage until it goes. */
  c = tdt_connect(&d);
  cr_assert_eq(td_unpublish(c, "edge"), 0);
  td_close(c);
  expect_daemon_fine();
}

TDT_TEST(badinput, publish_of_view_whose_arithmetic_overflows_is_refused) {
  raw *r = raw_open(1);
  uint64_t id = raw_create(r, 64, 2);
  Tensord__View m;
  int64_t sh[2] = {2, 2}, st[2] = {INT64_MAX, 1};
  view_msg(&m, TD_UINT8, 2, sh, st, 0);
  raw_publish(r, 3, "ovf", 3, id, &m);
  expect_error(r, TD_EINVAL, "overflow");
  int64_t sh1[1] = {INT64_MAX}, st1[1] = {2};
  view_msg(&m, TD_FLOAT64, 1, sh1, st1, 0);
  raw_publish(r, 4, "ovf", 3, id, &m);
  expect_error(r, TD_EINVAL, "overflow");
  view_msg(&m, TD_FLOAT64, 0, NULL, NULL, INT64_MAX);
  raw_publish(r, 5, "ovf", 3, id, &m);
  expect_error(r, TD_EINVAL, "overflow");
  /* Stride-0 dims: one byte, but more than INT64_MAX elements. */
  int64_t sh2[2] = {1LL << 32, (1LL << 32) + 4}, st2[2] = {0, 0};
  view_msg(&m, TD_UINT8, 2, sh2, st2, 0);
  raw_publish(r, 6, "ovf", 3, id, &m);
  expect_error(r, TD_EINVAL, "[4294967296, 4294967300]", "INT64_MAX");
  expect_usable(r, 7);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, publish_of_malformed_view_is_einval) {
  raw *r = raw_open(1);
  uint64_t id = raw_create(r, 1024, 2);
  Tensord__View m;
  uint64_t seq = 3;
  int64_t sh[2] = {2, 2}, st[2] = {-1, 1};
  view_msg(&m, TD_UINT8, 2, sh, st, 0);
  raw_publish(r, seq++, "bad", 3, id, &m);
  expect_error(r, TD_EINVAL, "negative stride");
  st[0] = 2;
  sh[1] = -3;
  view_msg(&m, TD_UINT8, 2, sh, st, 0);
  raw_publish(r, seq++, "bad", 3, id, &m);
  expect_error(r, TD_EINVAL, "negative size");
  sh[1] = 2;
  view_msg(&m, TD_UINT8, 2, sh, st, -1);
  raw_publish(r, seq++, "bad", 3, id, &m);
  expect_error(r, TD_EINVAL, "negative offset");
  view_msg(&m, 99, 2, sh, st, 0);
  raw_publish(r, seq++, "bad", 3, id, &m);
  expect_error(r, TD_EINVAL, "dtype");
  view_msg(&m, TD_UINT8, 2, sh, st, 0);
  m.n_stride = 1;
  raw_publish(r, seq++, "bad", 3, id, &m);
  expect_error(r, TD_EINVAL, "strides");
  int64_t many[TD_MAX_DIMS + 1];
  for (int i = 0; i <= TD_MAX_DIMS; i++)
    many[i] = 1;
  view_msg(&m, TD_UINT8, TD_MAX_DIMS + 1, many, many, 0);
  raw_publish(r, seq++, "bad", 3, id, &m);
  expect_error(r, TD_EINVAL, "17");
  expect_usable(r, seq);
  raw_close(r);
  expect_daemon_fine();
}

TDT_TEST(badinput, publish_of_storage_not_held_read_write_is_refused) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 64, &s), 0);
  uint64_t id = td_storage_id(s);
  raw *r = raw_open(1);
  raw_publish(r, 2, "k", 1, id, NULL);
  expect_error(r, TD_EACCES, "not held read-write");
  /* Held read-only is not enough. */
  Tensord__Open o = TENSORD__OPEN__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  o.id = id;
  o.readonly = 1;
  req.seq = 3;
  req.body_case = TENSORD__REQUEST__BODY_OPEN;
  req.open = &o;
  raw_send(r, &req);
  int fd;
  Tensord__Response *resp = raw_recv(r, &fd);
  cr_assert_not_null(resp);
  cr_assert_eq(resp->body_case, TENSORD__RESPONSE__BODY_STORAGE);
  cr_assert(resp->storage->readonly);
  cr_assert_geq(fd, 0);
  int fl = fcntl(fd, F_GETFL);
  cr_assert_eq(fl & O_ACCMODE, O_RDONLY, "a read-only fd");
  close(fd);
  tensord__response__free_unpacked(resp, NULL);
  raw_publish(r, 4, "k", 1, id, NULL);
  expect_error(r, TD_EACCES, "not held read-write");
  raw_publish(r, 5, "k", 1, id + 100, NULL);
  expect_error(r, TD_ENOENT, "not held");
  expect_usable(r, 6);
  raw_close(r);
  td_storage_release(s);
  td_close(c);
  expect_daemon_fine();
}

/* ---- clients that leave mid-request ---- */

TDT_TEST(badinput, client_leaving_while_waiting_in_lookup_leaves_no_waiter) {
  for (int i = 0; i < 2; i++) {
    raw *r = raw_open(1);
    /* Wait forever, then wait with a timer. */
    raw_lookup(r, 2, "never/published", 15, i == 0 ? -1 : 60000);
    cr_assert(tdt_until(one_waiter, &d, 5000), "the lookup waits");
    raw_close(r);
    cr_assert(tdt_until(no_waiters, &d, 5000),
              "the waiter went with its client");
  }
  cr_assert(tdt_until(no_other_clients, &d, 5000));
  /* A later publish of that key finds nobody to answer. */
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 64, &s), 0);
  cr_assert_eq(td_publish(c, "never/published", s, NULL), 0);
  cr_assert_eq(td_unpublish(c, "never/published"), 0);
  td_storage_release(s);
  td_close(c);
  expect_daemon_fine();
}

static int create_left(const tdt_daemon *dd) {
  return tdt_log_has(dd, "creator left before it was ready") ||
         tdt_log_has(dd, "last reference dropped");
}

TDT_TEST(badinput, client_leaving_mid_create_leaves_no_segment) {
  raw *r = raw_open(1);
  Tensord__Create m = TENSORD__CREATE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.nbytes = 64u << 20;
  req.seq = 2;
  req.body_case = TENSORD__REQUEST__BODY_CREATE;
  req.create = &m;
  raw_send(r, &req);
  raw_close(r);
  cr_assert(tdt_until(create_left, &d, 10000),
            "tensord finished the abandoned create");
  cr_assert(tdt_until(tdt_no_segments, &d, 10000), "%d segment(s) left",
            tdt_segments(&d));
  cr_assert(tdt_until(no_other_clients, &d, 5000));
  td_client *c = tdt_connect(&d);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.storages, 0);
  cr_assert_eq(st.bytes_used, 0, "nothing reserved or used");
  /* The capacity it had reserved is free again. */
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 1 << 20, &s), 0, "%s", td_last_error(c));
  td_storage_release(s);
  td_close(c);
  expect_daemon_fine();
}

TDT_TEST(badinput, many_clients_leaving_mid_create_leave_no_segment,
         .timeout = 60) {
  for (int i = 0; i < 8; i++) {
    raw *r = raw_open(1);
    Tensord__Create m = TENSORD__CREATE__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    m.nbytes = (uint64_t)(1 + i) << 20;
    req.seq = 2;
    req.body_case = TENSORD__REQUEST__BODY_CREATE;
    req.create = &m;
    raw_send(r, &req);
    if (i % 2) /* a second create on the same connection */
      raw_send(r, &req);
    raw_close(r);
  }
  cr_assert(tdt_until(no_other_clients, &d, 10000));
  cr_assert(tdt_until(tdt_no_segments, &d, 10000), "%d segment(s) left",
            tdt_segments(&d));
  expect_daemon_fine();
}

/* ---- flow control ---- */

/* Queues a Request on r's wire without sending it. */
static void raw_queue(raw *r, Tensord__Request *req) {
  size_t len = tensord__request__get_packed_size(req);
  uint8_t *p = td__wire_reserve(&r->w, len);
  cr_assert_not_null(p);
  tensord__request__pack(req, p);
  cr_assert_eq(td__wire_commit(&r->w, len, NULL, 0), 0);
}

/* Sends everything queued on r while reading replies as they come, the way
 * a client with several threads does. Each reply must answer the next seq,
 * from first_seq on; a StorageReply must carry its fd. Returns the replies
 * read. */
static int exchange(raw *r, uint64_t first_seq, int nreplies) {
  uint64_t want = first_seq;
  int got = 0;
  while (got < nreplies) {
    int err = td__wire_flush(&r->w, MSG_DONTWAIT);
    cr_assert(err == 0 || err == TD_EAGAIN, "flush: %s", td_err_name(err));
    struct pollfd p = {r->fd, POLLIN | (td__wire_pending(&r->w) ? POLLOUT : 0),
                       0};
    cr_assert_eq(poll(&p, 1, 10000), 1, "stalled after %d of %d replies", got,
                 nreplies);
    if (!(p.revents & (POLLIN | POLLHUP)))
      continue;
    ssize_t k = td__wire_recv(&r->w, MSG_DONTWAIT);
    if (k == TD_EAGAIN)
      continue;
    cr_assert_neq(k, TD_EPROTO,
                  "after %d replies: more fds arrived ahead of their frames "
                  "than the client's queue of %d holds",
                  got, TD__FDQ_MAX);
    cr_assert_gt(k, 0, "recv after %d replies: %s", got, td_err_name((int)k));
    td__frame f;
    int fr;
    while ((fr = td__wire_frame(&r->w, &f)) == 1) {
      Tensord__Response *resp = tensord__response__unpack(NULL, f.len, f.data);
      cr_assert_not_null(resp);
      cr_assert_eq(resp->seq, want, "reply %d answers seq %llu, expected %llu",
                   got, (unsigned long long)resp->seq,
                   (unsigned long long)want);
      if (resp->body_case == TENSORD__RESPONSE__BODY_STORAGE) {
        cr_assert(resp->storage->fd);
        cr_assert_eq(f.nfds, 1, "reply %d: the fd travels with its frame", got);
      } else {
        cr_assert(resp->body_case == TENSORD__RESPONSE__BODY_PONG ||
                      resp->body_case == TENSORD__RESPONSE__BODY_INFO,
                  "body %d: %s", (int)resp->body_case,
                  resp->body_case == TENSORD__RESPONSE__BODY_ERROR
                      ? resp->error->message
                      : "");
        cr_assert_eq(f.nfds, 0);
      }
      td__close_fds(f.fds, f.nfds);
      tensord__response__free_unpacked(resp, NULL);
      td__wire_consume(&r->w, &f);
      want++;
      got++;
    }
    cr_assert_geq(fr, 0, "bad frame: %s", td_err_name(fr));
  }
  return got;
}

TDT_TEST(badinput,
         flow_big_replies_between_fd_replies_all_arrive_with_their_fds) {
  raw *r = raw_open(1);
  uint64_t id = raw_create(r, 64, 2);
  enum { RUNS = 6, OPENS = 28, PAYLOAD = 900 * 1024 };
  uint8_t *payload = calloc(1, PAYLOAD);
  uint64_t seq = 3;
  for (int run = 0; run < RUNS; run++) {
    Tensord__Ping p = TENSORD__PING__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    p.payload.data = payload;
    p.payload.len = PAYLOAD;
    req.seq = seq++;
    req.body_case = TENSORD__REQUEST__BODY_PING;
    req.ping = &p;
    raw_queue(r, &req);
    for (int i = 0; i < OPENS; i++) {
      Tensord__Open o = TENSORD__OPEN__INIT;
      o.id = id;
      o.readonly = i % 2;
      o.force_fd = 1;
      req.seq = seq++;
      req.body_case = TENSORD__REQUEST__BODY_OPEN;
      req.open = &o;
      raw_queue(r, &req);
    }
  }
  free(payload);
  cr_assert_eq(exchange(r, 3, RUNS * (OPENS + 1)), RUNS * (OPENS + 1));
  raw_close(r);
  expect_daemon_fine();
}

/* Small requests whose replies are large (INFO of a storage with 1000 long
 * keys), each followed by OPENs whose replies carry fds: the daemon queues
 * them all at once and sends them through a socket that takes only part of
 * each sendmsg. */
TDT_TEST(badinput,
         flow_large_info_replies_between_fd_replies_all_arrive_with_their_fds) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 64, &s), 0);
  char key[256];
  memset(key, 'k', 250);
  key[250] = '\0';
  for (int i = 0; i < 1000; i++) {
    snprintf(key, 12, "%010d", i);
    key[10] = '/';
    cr_assert_eq(td_publish(c, key, s, NULL), 0, "%s", td_last_error(c));
  }
  uint64_t id = td_storage_id(s);
  td_storage_release(s);
  td_close(c); /* the keys keep the storage */
  raw *r = raw_open(1);
  enum { RUNS = 6, OPENS = 28 };
  uint64_t seq = 2;
  snprintf(key, 12, "%010d", 0);
  key[10] = '/';
  for (int run = 0; run < RUNS; run++) {
    Tensord__Info in = TENSORD__INFO__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    in.which_case = TENSORD__INFO__WHICH_KEY;
    in.key.data = (uint8_t *)key;
    in.key.len = 250;
    req.seq = seq++;
    req.body_case = TENSORD__REQUEST__BODY_INFO;
    req.info = &in;
    raw_queue(r, &req);
    for (int i = 0; i < OPENS; i++) {
      Tensord__Open o = TENSORD__OPEN__INIT;
      o.id = id;
      o.readonly = i % 2;
      o.force_fd = 1;
      req.seq = seq++;
      req.body_case = TENSORD__REQUEST__BODY_OPEN;
      req.open = &o;
      raw_queue(r, &req);
    }
  }
  cr_assert_eq(exchange(r, 2, RUNS * (OPENS + 1)), RUNS * (OPENS + 1));
  raw_close(r);
  c = tdt_connect(&d);
  for (int i = 0; i < 1000; i++) {
    snprintf(key, 12, "%010d", i);
    key[10] = '/';
    cr_assert_eq(td_unpublish(c, key), 0);
  }
  td_close(c);
  expect_daemon_fine();
}

TDT_TEST(badinput, flow_client_that_does_not_read_stalls_only_itself) {
  raw *r = raw_open(1);
  enum { N = 200, PAYLOAD = 60 * 1024 };
  uint8_t *payload = calloc(1, PAYLOAD);
  for (int i = 0; i < N; i++) {
    Tensord__Ping p = TENSORD__PING__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    p.payload.data = payload;
    p.payload.len = PAYLOAD;
    req.seq = 10 + (uint64_t)i;
    req.body_case = TENSORD__REQUEST__BODY_PING;
    req.ping = &p;
    raw_queue(r, &req);
  }
  free(payload);
  /* Send without reading until the daemon stops taking requests. */
  int err;
  while ((err = td__wire_flush(&r->w, MSG_DONTWAIT)) == 0 ||
         td__wire_pending(&r->w) > 0) {
    if (err == TD_EAGAIN) {
      struct pollfd p = {r->fd, POLLOUT, 0};
      if (poll(&p, 1, 500) == 0)
        break; /* the daemon stopped reading us */
    }
  }
  cr_assert_gt(td__wire_pending(&r->w), 0,
               "12 MiB of replies nobody reads should stall this client");
  /* Others are served meanwhile. */
  td_client *c = tdt_connect(&d);
  for (int i = 0; i < 10; i++)
    cr_assert_eq(td_ping(c, NULL), 0, "%s", td_last_error(c));
  td_close(c);
  /* Reading resumes it; every reply arrives, in order. */
  cr_assert_eq(exchange(r, 10, N), N);
  raw_close(r);
  expect_daemon_fine();
}

static uint64_t want_used;

static int create_charged(const tdt_daemon *dd) {
  (void)dd;
  return stat_field(offsetof(td_stat, bytes_used)) >= want_used;
}

TDT_TEST(badinput, stop_with_a_create_in_flight_leaves_nothing) {
  raw *r = raw_open(1);
  Tensord__Create m = TENSORD__CREATE__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.nbytes = 128u << 20; /* long enough to be in flight, most times */
  req.seq = 2;
  req.body_case = TENSORD__REQUEST__BODY_CREATE;
  req.create = &m;
  raw_send(r, &req);
  /* tensord has the create in hand once it has charged its bytes. */
  want_used = m.nbytes;
  cr_assert(tdt_until(create_charged, &d, 10000),
            "tensord did not take the create of %llu bytes",
            (unsigned long long)m.nbytes);
  cr_assert_eq(kill(d.pid, SIGTERM), 0);
  /* The client is hung up on; before that it gets its storage if the
   * create finished first, and nothing else. */
  int fd = -1;
  Tensord__Response *resp = raw_recv(r, &fd);
  if (resp != NULL) {
    cr_assert_eq(resp->seq, 2);
    cr_assert_eq(resp->body_case, TENSORD__RESPONSE__BODY_STORAGE,
                 "body %d: %s", (int)resp->body_case,
                 resp->body_case == TENSORD__RESPONSE__BODY_ERROR
                     ? resp->error->message
                     : "");
    cr_assert_geq(fd, 0, "the storage came without its fd");
    close(fd);
    tensord__response__free_unpacked(resp, NULL);
    expect_closed(r);
  }
  raw_close(r);
  /* tensord exits 0, with no segment left, its socket removed, and the
   * test leaked no fd. */
  tdt_stopped(&d);
}

/* ---- end of stream ---- */

/* A client that shuts its write side after its requests still gets every
 * reply already due, then the daemon hangs up. */
TDT_TEST(badinput, half_close_still_gets_the_replies_due) {
  raw *r = raw_open(1);
  static uint8_t payload[60 * 1024];
  memset(payload, 0x5a, sizeof(payload));
  enum { N = 40 }; /* 2.4 MB of replies: more than the socket holds */
  for (uint64_t seq = 1; seq <= N; seq++) {
    Tensord__Ping p = TENSORD__PING__INIT;
    Tensord__Request req = TENSORD__REQUEST__INIT;
    p.payload.data = payload;
    p.payload.len = sizeof(payload);
    req.seq = seq;
    req.body_case = TENSORD__REQUEST__BODY_PING;
    req.ping = &p;
    raw_send(r, &req);
  }
  cr_assert_eq(shutdown(r->fd, SHUT_WR), 0);
  for (uint64_t seq = 1; seq <= N; seq++) {
    Tensord__Response *resp = raw_recv(r, NULL);
    cr_assert_not_null(resp, "reply %llu of %d lost at end of stream",
                       (unsigned long long)seq, (int)N);
    cr_assert_eq(resp->seq, seq);
    cr_assert_eq(resp->body_case, TENSORD__RESPONSE__BODY_PONG);
    cr_assert_eq(resp->pong->payload.len, sizeof(payload));
    tensord__response__free_unpacked(resp, NULL);
  }
  expect_closed(r);
  raw_close(r);
  expect_daemon_fine();
}

/* ---- LookupMany ---- */

/* A LookupMany naming a key of a megabyte answers that key alone (a short
 * message with its length, not the key) and the key beside it, and keeps
 * the connection; a LookupMany frame that does not decode ends only its
 * own connection; another client's lookups go on throughout. */
TDT_TEST(badinput, lookup_many_of_a_huge_key_or_a_garbled_frame_spares_others) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 64, &s), 0);
  cr_assert_eq(td_publish(c, "good", s, NULL), 0, "%s", td_last_error(c));

  raw *r = raw_open(1);
  size_t big = 1000000;
  uint8_t *huge = malloc(big);
  cr_assert_not_null(huge);
  memset(huge, 'h', big);
  ProtobufCBinaryData k[2] = {{big, huge}, {4, (uint8_t *)"good"}};
  Tensord__LookupMany m = TENSORD__LOOKUP_MANY__INIT;
  Tensord__Request req = TENSORD__REQUEST__INIT;
  m.keys = k;
  m.n_keys = 2;
  req.seq = 2;
  req.body_case = TENSORD__REQUEST__BODY_LOOKUP_MANY;
  req.lookup_many = &m;
  raw_send(r, &req);
  free(huge);
  Tensord__Response *resp = raw_recv(r, NULL);
  cr_assert_not_null(resp, "tensord hung up on a huge key");
  cr_assert_eq(resp->body_case, TENSORD__RESPONSE__BODY_LOOKUP_MANY, "body %d",
               (int)resp->body_case);
  Tensord__LookupManyReply *lm = resp->lookup_many;
  cr_assert(lm->first == 0 && lm->n_items == 2 && lm->last);
  cr_assert_eq(lm->items[0]->code, TD_EINVAL);
  cr_assert(strstr(lm->items[0]->message, "1000000 bytes"), "%s",
            lm->items[0]->message);
  cr_assert_lt(strlen(lm->items[0]->message), 640);
  cr_assert_eq(lm->items[1]->code, 0, "%s", lm->items[1]->message);
  cr_assert_not_null(lm->items[1]->lookup);
  uint64_t id = lm->items[1]->lookup->storage->id;
  tensord__response__free_unpacked(resp, NULL);
  cr_assert_eq(id, td_storage_id(s));
  expect_usable(r, 3);
  cr_assert_eq(td_ping(c, NULL), 0, "%s", td_last_error(c));

  raw *g = raw_open(1);
  /* Field 32 (lookup_many) of 4 bytes, whose key (field 1) claims 127
   * bytes and has 2. */
  static const uint8_t junk[] = {0x82, 0x02, 0x04, 0x0a, 0x7f, 0x01, 0x02};
  raw_send_payload(g, junk, sizeof(junk));
  expect_error(g, TD_EPROTO, "garbled frame", "7 bytes");
  expect_closed(g);
  raw_close(g);

  const char *keys[] = {"good", "good"};
  td_storage *got[2];
  cr_assert_eq(td_lookup_many(c, keys, 2, 0, 0, got, NULL, NULL), 0, "%s",
               td_last_error(c));
  cr_assert(td_storage_id(got[0]) == td_storage_id(s) &&
            td_storage_id(got[1]) == td_storage_id(s));
  td_storage_release(got[0]);
  td_storage_release(got[1]);
  expect_usable(r, 4);
  raw_close(r);
  cr_assert_eq(td_unpublish(c, "good"), 0);
  td_storage_release(s);
  td_close(c);
  expect_daemon_fine();
}
