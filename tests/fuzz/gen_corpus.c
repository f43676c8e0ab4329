/* gen_corpus.c: writes fuzz_request's seed corpus: sessions of valid (and a
 * few deliberately bad) requests of every type, laid out as fuzz_input.h
 * says. The output is committed in tests/fuzz/corpus; regenerate it with
 *   build/tests/fuzz/gen_corpus tests/fuzz/corpus
 * Storage ids are predictable: each input gets a fresh daemon, whose ids
 * start at 1. */
#include "fuzz_input.h"

#include "tensord.h"
#include "tensord.pb-c.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUF_MAX 4096 /* the fuzzer's -max_len */

typedef struct buf {
  uint8_t b[BUF_MAX];
  size_t len;
} buf;

static const char *outdir;
static int nwritten;

static void put(buf *o, const void *p, size_t n) {
  if (o->len + n > sizeof(o->b)) {
    fprintf(stderr, "gen_corpus: input over %d bytes\n", BUF_MAX);
    exit(1);
  }
  memcpy(o->b + o->len, p, n);
  o->len += n;
}

/* Appends r as a frame: u32 LE length, nfds, 0, 'T', 'D', payload. */
static void add(buf *o, const Tensord__Request *r) {
  size_t n = tensord__request__get_packed_size(r);
  uint8_t h[8] = {(uint8_t)n,
                  (uint8_t)(n >> 8),
                  (uint8_t)(n >> 16),
                  (uint8_t)(n >> 24),
                  0,
                  0,
                  'T',
                  'D'};
  uint8_t p[BUF_MAX];
  if (n > sizeof(p)) {
    fprintf(stderr, "gen_corpus: request of %zu bytes\n", n);
    exit(1);
  }
  tensord__request__pack(r, p);
  put(o, h, sizeof(h));
  put(o, p, n);
}

/* ---- one function per request type ---- */

static void hello(buf *o, uint64_t seq, uint32_t version) {
  Tensord__Hello m = TENSORD__HELLO__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.version = version;
  m.client_name = "seed";
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_HELLO;
  r.hello = &m;
  add(o, &r);
}

static void create(buf *o, uint64_t seq, uint64_t nbytes, uint32_t mode) {
  Tensord__Create m = TENSORD__CREATE__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.nbytes = nbytes;
  m.mode = mode;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_CREATE;
  r.create = &m;
  add(o, &r);
}

static void create_cuda(buf *o, uint64_t seq) {
  Tensord__Create m = TENSORD__CREATE__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.nbytes = 4096;
  m.device = TENSORD__DEVICE__DEVICE_CUDA;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_CREATE;
  r.create = &m;
  add(o, &r);
}

static void open_(buf *o, uint64_t seq, uint64_t id, int ro, int force) {
  Tensord__Open m = TENSORD__OPEN__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.id = id;
  m.readonly = ro;
  m.force_fd = force;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_OPEN;
  r.open = &m;
  add(o, &r);
}

static void release(buf *o, uint64_t id, int ro, uint32_t count) {
  Tensord__Release m = TENSORD__RELEASE__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.id = id;
  m.readonly = ro;
  m.count = count;
  r.body_case = TENSORD__REQUEST__BODY_RELEASE;
  r.release = &m;
  add(o, &r);
}

static ProtobufCBinaryData key(const char *k) {
  ProtobufCBinaryData d = {strlen(k), (uint8_t *)k};
  return d;
}

/* A view of dtype with ndim dims (shape, stride), or none if ndim < 0. */
static void publish_view(buf *o, uint64_t seq, const char *k, uint64_t id,
                         int dtype, int ndim, int64_t *shape, int64_t *stride,
                         int64_t offset) {
  Tensord__View v = TENSORD__VIEW__INIT;
  Tensord__Publish m = TENSORD__PUBLISH__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.key = key(k);
  m.id = id;
  if (ndim >= 0) {
    v.dtype = dtype;
    v.n_shape = v.n_stride = (size_t)ndim;
    v.shape = shape;
    v.stride = stride;
    v.offset = offset;
    m.view = &v;
  }
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_PUBLISH;
  r.publish = &m;
  add(o, &r);
}

static void publish(buf *o, uint64_t seq, const char *k, uint64_t id) {
  publish_view(o, seq, k, id, 0, -1, NULL, NULL, 0);
}

/* A publish into scope token (FZ_SCOPE_TOKEN: the harness draws them). */
static void publish_in(buf *o, uint64_t seq, const char *k, uint64_t id,
                       uint64_t token) {
  Tensord__Publish m = TENSORD__PUBLISH__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.key = key(k);
  m.id = id;
  m.scope = token;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_PUBLISH;
  r.publish = &m;
  add(o, &r);
}

/* Makes the connection a watcher of the keys under prefix (len bytes). */
static void watch(buf *o, uint64_t seq, const char *prefix, size_t len) {
  Tensord__Watch m = TENSORD__WATCH__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.prefix.data = (uint8_t *)prefix;
  m.prefix.len = len;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_WATCH;
  r.watch = &m;
  add(o, &r);
}

/* Opens a scope (close 0), or ends scope token. */
static void scope(buf *o, uint64_t seq, int close, uint64_t token) {
  Tensord__Scope m = TENSORD__SCOPE__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.close = close;
  m.token = token;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_SCOPE;
  r.scope = &m;
  add(o, &r);
}

static void lookup(buf *o, uint64_t seq, const char *k, int ro, int32_t wait,
                   int take, int force) {
  Tensord__Lookup m = TENSORD__LOOKUP__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.key = key(k);
  m.readonly = ro;
  m.wait_ms = wait;
  m.take = take;
  m.force_fd = force;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_LOOKUP;
  r.lookup = &m;
  add(o, &r);
}

/* A LookupMany of the n keys (NULL: a key of no bytes). */
static void lookup_many(buf *o, uint64_t seq, const char *const *k, size_t n,
                        int ro) {
  ProtobufCBinaryData kb[16];
  Tensord__LookupMany m = TENSORD__LOOKUP_MANY__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  for (size_t i = 0; i < n && i < 16; i++)
    kb[i] = k[i] != NULL ? key(k[i]) : (ProtobufCBinaryData){0, NULL};
  m.keys = kb;
  m.n_keys = n < 16 ? n : 16;
  m.readonly = ro;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_LOOKUP_MANY;
  r.lookup_many = &m;
  add(o, &r);
}

static void unpublish_bin(buf *o, uint64_t seq, ProtobufCBinaryData k) {
  Tensord__Unpublish m = TENSORD__UNPUBLISH__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.key = k;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_UNPUBLISH;
  r.unpublish = &m;
  add(o, &r);
}

static void unpublish(buf *o, uint64_t seq, const char *k) {
  unpublish_bin(o, seq, key(k));
}

static void list(buf *o, uint64_t seq, uint64_t after, uint32_t limit) {
  Tensord__List m = TENSORD__LIST__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.after_id = after;
  m.limit = limit;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_LIST;
  r.list = &m;
  add(o, &r);
}

static void stat_(buf *o, uint64_t seq) {
  Tensord__Stat m = TENSORD__STAT__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_STAT;
  r.stat = &m;
  add(o, &r);
}

static void info_id(buf *o, uint64_t seq, uint64_t id) {
  Tensord__Info m = TENSORD__INFO__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.which_case = TENSORD__INFO__WHICH_ID;
  m.id = id;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_INFO;
  r.info = &m;
  add(o, &r);
}

static void info_key(buf *o, uint64_t seq, const char *k) {
  Tensord__Info m = TENSORD__INFO__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.which_case = TENSORD__INFO__WHICH_KEY;
  m.key = key(k);
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_INFO;
  r.info = &m;
  add(o, &r);
}

static void ping(buf *o, uint64_t seq, const char *payload) {
  Tensord__Ping m = TENSORD__PING__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.payload = key(payload);
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_PING;
  r.ping = &m;
  add(o, &r);
}

/* A request with no body: an operation this daemon does not know. */
static void chan_create(buf *o, uint64_t seq, const char *name, uint32_t cap,
                        uint64_t *slots, size_t nslots, uint64_t slot_bytes) {
  Tensord__ChanCreate m = TENSORD__CHAN_CREATE__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  m.name = key(name);
  m.capacity = cap;
  m.n_slots = nslots;
  m.slots = slots;
  m.slot_bytes = slot_bytes;
  r.seq = seq;
  r.body_case = TENSORD__REQUEST__BODY_CHAN_CREATE;
  r.chan_create = &m;
  add(o, &r);
}

/* ChanSlot, ChanPut, ChanTake and ChanClose of end 1 of channel 1. */
static void chan_op(buf *o, uint64_t seq, int body, uint64_t arg) {
  Tensord__ChanSlot sl = TENSORD__CHAN_SLOT__INIT;
  Tensord__ChanPut pu = TENSORD__CHAN_PUT__INIT;
  Tensord__ChanTake ta = TENSORD__CHAN_TAKE__INIT;
  Tensord__ChanClose cl = TENSORD__CHAN_CLOSE__INIT;
  Tensord__ChanList li = TENSORD__CHAN_LIST__INIT;
  Tensord__Request r = TENSORD__REQUEST__INIT;
  r.seq = seq;
  r.body_case = (Tensord__Request__BodyCase)body;
  sl.chan = pu.chan = ta.chan = cl.chan = 1;
  sl.end = pu.end = ta.end = cl.end = 1;
  sl.index = (uint32_t)arg;
  pu.id = arg;
  ta.ticket = arg;
  cl.final = 1;
  r.chan_slot = &sl; /* one member of the oneof is read, by body */
  if (body == TENSORD__REQUEST__BODY_CHAN_PUT)
    r.chan_put = &pu;
  else if (body == TENSORD__REQUEST__BODY_CHAN_TAKE)
    r.chan_take = &ta;
  else if (body == TENSORD__REQUEST__BODY_CHAN_CLOSE)
    r.chan_close = &cl;
  else if (body == TENSORD__REQUEST__BODY_CHAN_LIST)
    r.chan_list = &li;
  add(o, &r);
}

static void no_body(buf *o, uint64_t seq) {
  Tensord__Request r = TENSORD__REQUEST__INIT;
  r.seq = seq;
  add(o, &r);
}

/* ---- inputs ---- */

static void start(buf *o, uint8_t f0, uint8_t f1) {
  o->len = 0;
  put(o, &f0, 1);
  put(o, &f1, 1);
}

/* Appends s as segments for one connection (sel: FZ_SEG_*); the fd and
 * muting go with the first segment, the others after the last. */
static void segment(buf *o, uint8_t sel, const buf *s) {
  size_t off = 0;
  do {
    size_t n = s->len - off > 255 ? 255 : s->len - off;
    uint8_t h[2] = {(uint8_t)(sel & FZ_SEG_CONN), (uint8_t)n};
    if (off == 0)
      h[0] |= sel & (FZ_SEG_FD | FZ_SEG_MUTE);
    if (off + n == s->len)
      h[0] |= sel & (FZ_SEG_EOF | FZ_SEG_DEAF | FZ_SEG_TICK);
    put(o, h, 2);
    put(o, s->b + off, n);
    off += n;
  } while (off < s->len);
}

static void write_input(const char *name, const buf *o) {
  char path[4096];
  snprintf(path, sizeof(path), "%s/%s", outdir, name);
  FILE *f = fopen(path, "wb");
  if (f == NULL || fwrite(o->b, 1, o->len, f) != o->len || fclose(f) != 0) {
    fprintf(stderr, "gen_corpus: %s: %s\n", path, strerror(errno));
    exit(1);
  }
  nwritten++;
}

/* Single connection, Hello prepended by the harness. */
static buf in, s0, s1;

static void single(uint8_t f1) {
  start(&in, FZ_HELLO, f1);
}

static void gen_single(void) {
  int64_t sh2x3[] = {2, 3}, st2x3[] = {3, 1}, st3x2[] = {1, 3},
          sh3x2[] = {3, 2};
  int64_t shneg[] = {2, -3};
  int64_t big[] = {1 << 20}, one[] = {1};

  start(&in, 0, 0); /* the Hello in the stream */
  hello(&in, 1, TD_PROTOCOL_VERSION);
  ping(&in, 2, "hello");
  write_input("hello_ping", &in);

  single(0);
  ping(&in, 2, "");
  ping(&in, 3, "payload bytes");
  write_input("ping", &in);

  single(0);
  create(&in, 2, 4096, 0);
  create(&in, 3, 1, 0);
  create(&in, 4, 100, 0644);
  stat_(&in, 5);
  write_input("create_small", &in);

  single(0); /* past 256 KiB: created on the thread pool */
  create(&in, 2, 1 << 20, 0);
  create(&in, 3, 3 << 20, 0);
  stat_(&in, 4);
  list(&in, 5, 0, 0);
  write_input("create_pool", &in);

  single(0);
  create(&in, 2, 0, 0);
  create_cuda(&in, 3);
  create(&in, 4, 4096, 0777);
  create(&in, 5, 9 << 20, 0);
  create(&in, 6, UINT64_MAX, 0);
  write_input("create_errors", &in);

  single(0);
  create(&in, 2, 4096, 0);
  open_(&in, 3, 1, 0, 0);
  open_(&in, 4, 1, 1, 0);
  open_(&in, 5, 1, 1, 1);
  release(&in, 1, 1, 2);
  release(&in, 1, 0, 1);
  release(&in, 1, 0, 5); /* more than held: ignored */
  open_(&in, 6, 99, 0, 0);
  info_id(&in, 7, 1);
  release(&in, 1, 0, 1);
  info_id(&in, 8, 1);
  write_input("open_release", &in);

  single(0);
  create(&in, 2, 4096, 0);
  publish(&in, 3, "w", 1);
  publish_view(&in, 4, "w.f32", 1, TD_FLOAT32, 2, sh2x3, st2x3, 0);
  publish_view(&in, 5, "w.t", 1, TD_FLOAT32, 2, sh3x2, st3x2, 4);
  publish_view(&in, 6, "w.bad", 1, TD_FLOAT32, 2, shneg, st2x3, 0);
  publish_view(&in, 7, "w.far", 1, TD_FLOAT32, 1, big, one, 0);
  publish_view(&in, 8, "w.u8", 1, TD_UINT8, 1, big, one, 0);
  lookup(&in, 9, "w", 0, 0, 0, 0);
  lookup(&in, 10, "w.f32", 1, 0, 0, 0);
  lookup(&in, 11, "w.f32", 1, 0, 0, 1);
  info_key(&in, 12, "w.f32");
  unpublish(&in, 13, "w");
  release(&in, 1, 0, 1);
  list(&in, 14, 0, 0);
  write_input("publish_views", &in);

  single(0);
  create(&in, 2, 64, 0);
  publish(&in, 3, "k", 1);
  release(&in, 1, 0, 1);
  lookup(&in, 4, "k", 0, 0, 1, 0);
  lookup(&in, 5, "k", 0, 0, 0, 0);
  stat_(&in, 6);
  write_input("lookup_take", &in);

  single(0);
  lookup(&in, 2, "missing", 0, 0, 0, 0);
  lookup(&in, 3, "missing", 1, -1, 0, 0);
  lookup(&in, 4, "other", 0, 50, 0, 0);
  lookup(&in, 5, "bad wait", 0, -5, 0, 0);
  lookup(&in, 6, "missing", 0, -1, 1, 0);
  stat_(&in, 7);
  write_input("lookup_wait", &in);

  /* Many keys in one request: found, missing and bad keys answered one by
   * one; six storages new to the client, so the fds span two frames; the
   * same keys again (no fd: held), read-write, then none at all. */
  single(0);
  static const char *const ks[] = {"k0", "k1", "k2", "k3", "k4", "k5"};
  for (uint64_t i = 0; i < 6; i++) {
    create(&in, 2 + 2 * i, 64 * (i + 1), 0);
    publish(&in, 3 + 2 * i, ks[i], i + 1);
  }
  for (uint64_t i = 0; i < 6; i++)
    release(&in, i + 1, 0, 1);
  static const char *const many1[] = {"k0", "missing", "k1", NULL, "k2",
                                      "k3", "k0",      "k4", "k5"};
  lookup_many(&in, 20, many1, 9, 1);
  lookup_many(&in, 21, many1, 9, 1);
  lookup_many(&in, 22, ks, 6, 0);
  lookup_many(&in, 23, NULL, 0, 0);
  stat_(&in, 24);
  write_input("lookup_many", &in);

  single(0);
  create(&in, 2, 10, 0);
  create(&in, 3, 20, 0);
  create(&in, 4, 30, 0);
  publish(&in, 5, "two", 2);
  list(&in, 6, 0, 0);
  list(&in, 7, 1, 1);
  list(&in, 8, 100, 0);
  release(&in, 2, 0, 1);
  list(&in, 9, 1, 5000);
  write_input("list", &in);

  single(0);
  create(&in, 2, 4096, 0);
  publish(&in, 3, "a", 1);
  publish(&in, 4, "b", 1);
  stat_(&in, 5);
  info_id(&in, 6, 1);
  info_key(&in, 7, "b");
  info_id(&in, 8, 7);
  info_key(&in, 9, "");
  info_key(&in, 10, "nope");
  write_input("stat_info", &in);

  single(0);
  create(&in, 2, 4096, 0);
  publish(&in, 3, "model/layer0", 1);
  lookup(&in, 4, "model/layer0", 1, 0, 0, 0);
  unpublish(&in, 5, "model/layer0");
  unpublish(&in, 6, "model/layer0");
  write_input("session", &in);

  single(0);
  {
    char longkey[TD_KEY_MAX + 2];
    memset(longkey, 'k', sizeof(longkey) - 1);
    longkey[sizeof(longkey) - 1] = '\0';
    ProtobufCBinaryData nul = {3, (uint8_t *)"a\0b"};
    create(&in, 2, 16, 0);
    publish(&in, 3, "\xc3\x28", 1);     /* invalid UTF-8 */
    publish(&in, 4, "\xed\xa0\x80", 1); /* a surrogate */
    publish(&in, 5, longkey, 1);
    publish(&in, 6, "caf\xc3\xa9", 1);
    unpublish_bin(&in, 7, nul);
    lookup(&in, 8, "", 0, 0, 0, 0);
  }
  write_input("keys_bad", &in);

  /* Short reads and writes. */
  single(FZ_IO_CAP | 0);
  create(&in, 2, 4096, 0);
  publish(&in, 3, "k", 1);
  lookup(&in, 4, "k", 1, 0, 0, 0);
  list(&in, 5, 0, 0);
  write_input("io_cap_1", &in);

  single(FZ_IO_CAP | 2); /* many fds, 4 bytes per send */
  create(&in, 2, 64, 0);
  for (int i = 0; i < 100; i++)
    open_(&in, 3 + (uint64_t)i, 1, i & 1, 1);
  write_input("io_cap_fds", &in);

  single(FZ_IO_CAP | 3);
  create(&in, 2, 4096, 0);
  open_(&in, 3, 1, 1, 0);
  open_(&in, 4, 1, 1, 1);
  ping(&in, 5, "eight bytes at a time");
  write_input("io_cap_8", &in);

  /* Limits: 3 storages per client, 1 MiB per uid. */
  start(&in, FZ_HELLO | FZ_LIMITS, 0);
  create(&in, 2, 4096, 0);
  create(&in, 3, 4096, 0);
  create(&in, 4, 4096, 0);
  create(&in, 5, 4096, 0);
  release(&in, 3, 0, 1);
  create(&in, 6, 2 << 20, 0);
  create(&in, 7, 1 << 20, 0);
  open_(&in, 8, 1, 1, 0);
  write_input("limits", &in);

  /* A channel with two slots, a storage through it by ticket, a listing,
   * and its last end closed (docs/channels.md). */
  uint64_t slots[] = {1, 2};
  single(0);
  create(&in, 2, 4096, 0);
  create(&in, 3, 4096, 0);
  chan_create(&in, 4, "q", 4, slots, 2, 4096);
  release(&in, 1, 0, 1);
  release(&in, 2, 0, 1);
  chan_op(&in, 5, TENSORD__REQUEST__BODY_CHAN_SLOT, 1);
  create(&in, 6, 100, 0);
  chan_op(&in, 7, TENSORD__REQUEST__BODY_CHAN_PUT, 3);
  release(&in, 3, 0, 1);
  chan_op(&in, 8, TENSORD__REQUEST__BODY_CHAN_TAKE, 1);
  chan_op(&in, 9, TENSORD__REQUEST__BODY_CHAN_LIST, 0);
  chan_op(&in, 0, TENSORD__REQUEST__BODY_CHAN_CLOSE, 0);
  stat_(&in, 10);
  write_input("channel", &in);
}

static void gen_bad(void) {
  /* Frames the daemon must refuse, then hang up. */
  static const uint8_t magic[] = {4, 0, 0, 0, 0, 0, 'X', 'D', 1, 2, 3, 4};
  static const uint8_t huge[] = {0, 0, 0x20, 0, 0, 0, 'T', 'D'};
  static const uint8_t fds[] = {0, 0, 0, 0, 1, 0, 'T', 'D'};
  static const uint8_t many_fds[] = {0, 0, 0, 0, 9, 0, 'T', 'D'};
  static const uint8_t garbled[] = {3,   0,   0,    0,    0,   0,
                                    'T', 'D', 0xff, 0xff, 0xff};
  static const uint8_t reserved[] = {0, 0, 0, 0, 0, 1, 'T', 'D'};

  single(0);
  put(&in, magic, sizeof(magic));
  write_input("bad_magic", &in);
  single(0);
  put(&in, huge, sizeof(huge));
  write_input("bad_oversize", &in);
  single(0);
  put(&in, fds, sizeof(fds));
  write_input("bad_fd_count", &in);
  single(0);
  put(&in, many_fds, sizeof(many_fds));
  write_input("bad_many_fds", &in);
  single(0);
  put(&in, garbled, sizeof(garbled));
  write_input("bad_payload", &in);
  single(0);
  put(&in, reserved, sizeof(reserved));
  write_input("bad_reserved", &in);

  single(0);
  hello(&in, 2, TD_PROTOCOL_VERSION);
  ping(&in, 3, "after");
  write_input("bad_hello_twice", &in);

  start(&in, 0, 0);
  hello(&in, 1, 99);
  write_input("bad_version", &in);

  start(&in, 0, 0);
  ping(&in, 1, "no hello");
  write_input("bad_no_hello", &in);

  single(0);
  no_body(&in, 2);
  ping(&in, 3, "still here");
  write_input("unknown_op", &in);

  /* Scopes: keys that go when their scope ends; a scoped publish never
   * replaces a key; an ordinary one takes a key out of its scope. */
  single(0);
  scope(&in, 2, 0, 0);
  scope(&in, 3, 0, 0);
  create(&in, 4, 4096, 0);
  publish_in(&in, 5, "a", 1, FZ_SCOPE_TOKEN(0));
  publish_in(&in, 6, "b", 1, FZ_SCOPE_TOKEN(0));
  publish_in(&in, 7, "a", 1, FZ_SCOPE_TOKEN(1)); /* EEXIST */
  publish(&in, 8, "b", 1);
  publish_in(&in, 9, "c", 1, FZ_SCOPE_TOKEN(7));  /* never opened */
  scope(&in, 10, 1, FZ_SCOPE_TOKEN(0));           /* drops "a" */
  scope(&in, 11, 1, FZ_SCOPE_TOKEN(0));           /* ended */
  publish_in(&in, 12, "d", 1, FZ_SCOPE_TOKEN(0)); /* ended */
  publish_in(&in, 13, "d", 1, FZ_SCOPE_TOKEN(1));
  lookup(&in, 14, "d", 1, 0, 1, 0);
  publish_in(&in, 15, "e", 1, FZ_SCOPE_TOKEN(1));
  unpublish(&in, 16, "e");
  publish_in(&in, 17, "f", 1, FZ_SCOPE_TOKEN(1));
  stat_(&in, 18);
  release(&in, 1, 0, 1);
  write_input("scope", &in); /* FZ_SCOPE_TOKEN(1) ends with the client */

  single(0); /* end of stream in the middle of a frame */
  create(&in, 2, 4096, 0);
  publish(&in, 3, "cut", 1);
  in.len -= 3;
  write_input("partial_frame", &in);
}

/* Two connections (fuzz_input.h's segments). */
static void gen_multi(void) {
  /* A waiter woken by the other client's publish. */
  start(&in, FZ_HELLO | FZ_MULTI, 0);
  s1.len = 0;
  lookup(&s1, 2, "k", 1, -1, 0, 0);
  segment(&in, 1, &s1);
  s0.len = 0;
  create(&s0, 2, 4096, 0);
  publish(&s0, 3, "k", 1);
  segment(&in, 0, &s0);
  s1.len = 0;
  info_key(&s1, 3, "k");
  release(&s1, 1, 1, 1);
  segment(&in, 1, &s1);
  write_input("multi_wait", &in);

  /* Two waiters; the first takes the key. */
  start(&in, FZ_HELLO | FZ_MULTI, 0);
  s1.len = 0;
  lookup(&s1, 2, "k", 0, -1, 1, 0);
  lookup(&s1, 3, "k", 1, 1000, 0, 0);
  segment(&in, 1, &s1);
  s0.len = 0;
  create(&s0, 2, 4096, 0);
  publish(&s0, 3, "k", 1);
  lookup(&s0, 4, "k", 0, 0, 0, 0);
  segment(&in, 0, &s0);
  write_input("multi_take", &in);

  /* A waiter that leaves before the key comes. */
  start(&in, FZ_HELLO | FZ_MULTI, 0);
  s1.len = 0;
  lookup(&s1, 2, "k", 0, -1, 0, 0);
  segment(&in, 1 | FZ_SEG_EOF, &s1);
  s0.len = 0;
  create(&s0, 2, 4096, 0);
  publish(&s0, 3, "k", 1);
  stat_(&s0, 4);
  segment(&in, 0, &s0);
  write_input("multi_waiter_leaves", &in);

  /* A creator that leaves: its storage lives on through its key. */
  start(&in, FZ_HELLO | FZ_MULTI, 0);
  s0.len = 0;
  create(&s0, 2, 4096, 0);
  create(&s0, 3, 512 << 10, 0);
  publish(&s0, 4, "kept", 1);
  segment(&in, 0 | FZ_SEG_EOF, &s0);
  s1.len = 0;
  lookup(&s1, 2, "kept", 0, 0, 0, 0);
  list(&s1, 3, 0, 0);
  unpublish(&s1, 4, "kept");
  stat_(&s1, 5);
  segment(&in, 1, &s1);
  write_input("multi_creator_leaves", &in);

  /* A key in flight: its publisher leaves, the scope's owner takes one
   * key and leaves, and the other key goes with its scope. */
  start(&in, FZ_HELLO | FZ_MULTI, 0);
  s0.len = 0;
  scope(&s0, 2, 0, 0);
  segment(&in, 0, &s0);
  s1.len = 0;
  create(&s1, 2, 4096, 0);
  publish_in(&s1, 3, "flight", 1, FZ_SCOPE_TOKEN(0));
  publish_in(&s1, 4, "left", 1, FZ_SCOPE_TOKEN(0));
  scope(&s1, 5, 1, FZ_SCOPE_TOKEN(0)); /* not its scope */
  segment(&in, 1 | FZ_SEG_EOF, &s1);
  s0.len = 0;
  lookup(&s0, 3, "flight", 1, 0, 1, 0);
  stat_(&s0, 4);
  segment(&in, 0 | FZ_SEG_EOF, &s0);
  write_input("multi_scope", &in);

  /* A waiter is answered by a scoped publish. */
  start(&in, FZ_HELLO | FZ_MULTI, 0);
  s1.len = 0;
  lookup(&s1, 2, "w", 0, -1, 1, 0);
  segment(&in, 1, &s1);
  s0.len = 0;
  scope(&s0, 2, 0, 0);
  create(&s0, 3, 4096, 0);
  publish_in(&s0, 4, "w", 1, FZ_SCOPE_TOKEN(0));
  stat_(&s0, 5);
  segment(&in, 0, &s0);
  write_input("multi_scope_wait", &in);

  /* Only the owner's uid (and root) publish into a scope. */
  start(&in, FZ_HELLO | FZ_MULTI | FZ_CLASS0(1) | FZ_CLASS1(3), 0);
  s0.len = 0;
  scope(&s0, 2, 0, 0);
  segment(&in, 0, &s0);
  s1.len = 0;
  create(&s1, 2, 4096, 0);
  publish_in(&s1, 3, "theirs", 1, FZ_SCOPE_TOKEN(0));
  scope(&s1, 4, 0, 0);
  publish_in(&s1, 5, "mine", 1, FZ_SCOPE_TOKEN(1));
  segment(&in, 1, &s1);
  write_input("multi_scope_uid", &in);

  /* A watcher: a bad prefix, then a watch of everything; the other
   * connection's create, publish, take, refusal and free reach it as
   * events; its own requests after are EBUSY, its Release still works. */
  start(&in, FZ_HELLO | FZ_MULTI, 0);
  s0.len = 0;
  create(&s0, 2, 4096, 0);
  watch(&s0, 3, "a\0b", 3);
  watch(&s0, 4, "", 0);
  segment(&in, 0, &s0);
  s1.len = 0;
  create(&s1, 2, 4096, 0);
  publish(&s1, 3, "seen", 2);
  lookup(&s1, 4, "seen", 0, 0, 1, 0);
  lookup(&s1, 5, "missing", 0, 0, 0, 0);
  segment(&in, 1 | FZ_SEG_EOF, &s1);
  s0.len = 0;
  stat_(&s0, 5);
  watch(&s0, 6, "b/", 2);
  release(&s0, 1, 0, 1);
  ping(&s0, 7, "busy");
  segment(&in, 0, &s0);
  write_input("multi_watch", &in);

  /* Modes: 1 and 2 share a group; 3 is a stranger. */
  start(&in, FZ_HELLO | FZ_MULTI | FZ_CLASS0(1) | FZ_CLASS1(2), 0);
  s0.len = 0;
  create(&s0, 2, 4096, 0640);
  publish(&s0, 3, "shared", 1);
  create(&s0, 4, 4096, 0);
  publish(&s0, 5, "private", 2);
  segment(&in, 0, &s0);
  s1.len = 0;
  lookup(&s1, 2, "shared", 1, 0, 0, 0);
  lookup(&s1, 3, "shared", 0, 0, 0, 0);
  lookup(&s1, 4, "shared", 1, 0, 1, 0);
  unpublish(&s1, 5, "shared");
  lookup(&s1, 6, "private", 1, 0, 0, 0);
  open_(&s1, 7, 1, 1, 0);
  open_(&s1, 8, 2, 1, 0);
  publish(&s1, 9, "mine", 1);
  create(&s1, 10, 64, 0);
  publish(&s1, 11, "shared", 3);
  info_key(&s1, 12, "private");
  list(&s1, 13, 0, 0);
  segment(&in, 1, &s1);
  write_input("multi_access_group", &in);

  start(&in, FZ_HELLO | FZ_MULTI | FZ_CLASS0(1) | FZ_CLASS1(3), 0);
  s0.len = 0;
  create(&s0, 2, 4096, 0604);
  publish(&s0, 3, "public", 1);
  create(&s0, 4, 4096, 0666);
  publish(&s0, 5, "open", 2);
  segment(&in, 0, &s0);
  s1.len = 0;
  lookup(&s1, 2, "public", 1, 0, 0, 0);
  lookup(&s1, 3, "public", 0, 0, 0, 0);
  lookup(&s1, 4, "open", 0, 0, 1, 0);
  create(&s1, 5, 64, 0);
  publish(&s1, 6, "public", 3);
  segment(&in, 1, &s1);
  write_input("multi_access_other", &in);

  /* Replacing another client's key. */
  start(&in, FZ_HELLO | FZ_MULTI, 0);
  s0.len = 0;
  create(&s0, 2, 4096, 0);
  publish(&s0, 3, "k", 1);
  release(&s0, 1, 0, 1);
  segment(&in, 0, &s0);
  s1.len = 0;
  create(&s1, 2, 8192, 0);
  publish(&s1, 3, "k", 2);
  publish(&s1, 4, "k", 2);
  info_key(&s1, 5, "k");
  segment(&in, 1, &s1);
  write_input("multi_replace", &in);

  /* --max-clients 1: the second connection is refused. */
  start(&in, FZ_HELLO | FZ_MULTI | FZ_ONECLIENT, 0);
  s0.len = 0;
  ping(&s0, 2, "first");
  segment(&in, 0, &s0);
  s1.len = 0;
  ping(&s1, 2, "second");
  segment(&in, 1, &s1);
  write_input("multi_max_clients", &in);

  /* A waiter that stops reading: answering it fails with EPIPE. */
  start(&in, FZ_HELLO | FZ_MULTI, 0);
  s1.len = 0;
  lookup(&s1, 2, "k", 0, -1, 0, 0);
  lookup(&s1, 3, "j", 0, -1, 0, 0);
  segment(&in, 1, &s1);
  s1.len = 0;
  release(&s1, 7, 0, 1); /* never answered */
  segment(&in, 1 | FZ_SEG_DEAF, &s1);
  s0.len = 0;
  create(&s0, 2, 4096, 0);
  publish(&s0, 3, "k", 1);
  publish(&s0, 4, "j", 1);
  stat_(&s0, 5);
  segment(&in, 0, &s0);
  write_input("multi_waiter_deaf", &in);

  /* --max-storages-per-client on lookups and opens. */
  start(&in, FZ_HELLO | FZ_MULTI | FZ_LIMITS, 0);
  s0.len = 0;
  create(&s0, 2, 64, 0);
  create(&s0, 3, 64, 0);
  publish(&s0, 4, "a", 1);
  segment(&in, 0, &s0);
  s1.len = 0;
  create(&s1, 2, 64, 0);
  create(&s1, 3, 64, 0);
  create(&s1, 4, 64, 0);
  lookup(&s1, 5, "a", 1, 0, 0, 0);
  open_(&s1, 6, 2, 1, 0);
  open_(&s1, 7, 3, 1, 1);
  segment(&in, 1, &s1);
  write_input("multi_limits_refs", &in);

  /* Lookups that time out. */
  start(&in, FZ_HELLO | FZ_MULTI, FZ_TICKS);
  s1.len = 0;
  lookup(&s1, 2, "k", 0, 1, 0, 0);
  lookup(&s1, 3, "k", 1, 2, 1, 0);
  lookup(&s1, 4, "k", 1, 60000, 0, 0);
  segment(&in, 1 | FZ_SEG_TICK, &s1);
  s0.len = 0;
  create(&s0, 2, 64, 0);
  publish(&s0, 3, "k", 1);
  segment(&in, 0, &s0);
  write_input("multi_wait_timeout", &in);

  /* --io-timeout: half a request, and replies left unread. */
  start(&in, FZ_HELLO | FZ_MULTI, FZ_IO_TIMEOUT | FZ_TICKS);
  s0.len = 0;
  create(&s0, 2, 64, 0);
  publish(&s0, 3, "k", 1);
  segment(&in, 0 | FZ_SEG_MUTE, &s0);
  s1.len = 0;
  ping(&s1, 2, "half of this goes");
  s1.len -= 5;
  segment(&in, 1 | FZ_SEG_TICK, &s1);
  write_input("multi_io_timeout", &in);

  /* Replies and fds pile up in the daemon: past 256 unsent fds it stops
   * reading the client (sent a byte at a time, its replies fill the socket
   * early); past 28 fds a send carries some of them. */
  for (int cap = 0; cap < 2; cap++) {
    start(&in, FZ_HELLO | FZ_MULTI, cap ? FZ_IO_CAP | 0 : 0);
    s0.len = 0;
    create(&s0, 0, 64, 0);
    for (int i = 0; i < 285; i++) /* 14 bytes each: no seq */
      open_(&s0, 0, 1, 0, 1);
    segment(&in, 0 | FZ_SEG_MUTE, &s0);
    s1.len = 0;
    stat_(&s1, 0);
    segment(&in, 1, &s1);
    write_input(cap ? "multi_muted_fds_cap" : "multi_muted_fds", &in);
  }

  /* A client that sends an fd. */
  start(&in, FZ_HELLO | FZ_MULTI, 0);
  s0.len = 0;
  create(&s0, 2, 4096, 0);
  publish(&s0, 3, "k", 1);
  segment(&in, 0, &s0);
  s1.len = 0;
  ping(&s1, 2, "with an fd");
  segment(&in, 1 | FZ_SEG_FD, &s1);
  write_input("multi_sent_fd", &in);
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  outdir = argv[1];
  gen_single();
  gen_bad();
  gen_multi();
  printf("gen_corpus: wrote %d inputs to %s\n", nwritten, outdir);
  return 0;
}
