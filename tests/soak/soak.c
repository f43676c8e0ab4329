/* soak.c: hundreds of client processes, some of other uids, drive one tensord
 * for a set time while a chaos loop SIGKILLs clients (and, with --restart,
 * the daemon); invariants are checked throughout and the daemon's state at
 * the end. Run by tests/soak/run.sh (make soak), never by ctest.
 *
 * What is checked, and how:
 * - Bytes: every storage carries a payload its creator wrote before anyone
 *   else could reach it (before publishing it or naming its id): a header
 *   (magic, length, seed, owner uid and gid, mode, a hash) and a body derived
 *   from the seed. Nobody writes a storage after that, so every reader, by
 *   key or by id, must see exactly that payload; storages under 48 bytes
 *   hold a pattern of their length instead. Any difference is a violation.
 * - Access: a client that is not root checks, from the header, that the
 *   creator's mode allowed what the daemon gave it (read, write for a
 *   read-write open or a take); a lookup or unpublish of another uid's
 *   "private/<uid>/<n>" key (mode 0600) that succeeds is a violation, as is
 *   a read-only handle whose mapping mprotect() lets become writable.
 * - Durable keys: "durable/<i>", published by the coordinator at the start,
 *   touched by nobody else, must resolve to their exact bytes at every
 *   check, across daemon restarts. "durable-rw/<i>" are replaced without
 *   pause by a few processes the chaos loop spares; after a restart each
 *   must hold the last acknowledged change or the one in flight.
 * - Errors: each operation has the errors the situation allows (ENOENT for a
 *   key that is not there, EACCES where the mode refuses, ECONNRESET from a
 *   daemon the coordinator killed...); any other error is counted as
 *   unexpected and fails the run.
 * - Enough work: a run must verify at least FLOOR_READS payloads per client
 *   and second, and at most MAX_ALLOWED_ERR of its operations may fail even
 *   with errors the situation allows; a run in which nearly everything
 *   fails proves nothing and fails. (SOAK_CRIPPLE=N turns N of every 1000
 *   client operations into lookups of a key nobody publishes, to see it.)
 * - At the end, with every client gone: the daemon holds no client's
 *   reference, every storage it lists is named by a key, the keys the
 *   keyspace resolves to name exactly those storages, `storages` of
 *   td_stat_get agrees, /dev/shm holds exactly that many segments of this
 *   run's instances, and the daemon's RSS did not grow from the first to the
 *   last part of the run.
 *
 * - Live upgrades (--upgrade CMD): every ~--upgrade-every seconds the
 *   coordinator runs CMD (run.sh's: `tensord --upgrade` with the daemon's
 *   options) under full load, and waits for the old daemon to exit (0, where
 *   it is the coordinator's child) and the new one to serve (stat's pid) with
 *   the same instance. Clients must notice nothing: a lost connection is an
 *   unexpected error as any other, and a client that never comes back from
 *   a request (a lost reply) keeps the parking below from completing. After
 *   each upgrade the durable keys are checked, then every client parks
 *   between operations while the coordinator checks the daemon's state:
 *   stat's storages and keys agree with its listing, every storage is named
 *   by a key or held, and /dev/shm holds one segment per storage and the
 *   pool's segments. The
 *   summary reports the upgrades and the longest client operation across
 *   one (lookups that may wait aside), next to the longest otherwise.
 *
 * The coordinator forks the clients (they die with it) and counts through a
 * shared anonymous mapping of atomic counters. It restarts no daemon itself:
 * with --restart it SIGKILLs the daemon and waits for whoever supervises it
 * (run.sh, as systemd would with Restart=on-failure) to start it again on
 * the same socket and --state-dir. The daemons --upgrade starts are the
 * coordinator's children; run.sh's supervisor follows them by pid. */
#include "bench.h"
#include "seed.h"

#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MIB (1024u * 1024u)
#define MAX_SIZE MIB       /* largest storage a client creates */
#define HOT_KEYS 64        /* soak/0..63: where lookups with wait go */
#define PRIVATE_KEYS 64    /* private/<uid>/0..63 per uid */
#define MAX_HELD 8         /* handles a client keeps between operations */
#define RECENT 512         /* ids of recent storages, for open by id */
#define MAX_INSTANCES 1024 /* daemon instances one run may see */
#define MAX_MSGS 24        /* violations and unexpected errors kept verbatim */
#define NERR 160           /* error codes counted by -code; the last: others */
#define NUIDS 3            /* uids other than root, below */
#define REPLACERS 4        /* processes that keep replacing keys */
#define RW_KEYS 16         /* durable-rw/0..15, key i is replacer i % 4's */
#define RW_ABSENT 1ull     /* a durable-rw key that is not published */
/* The floor of a run, whatever its length: payloads the clients verify per
 * client and second (12.6 in a 20 s run of 256 clients on a busy 2-CPU
 * machine), and the largest fraction of their requests that may fail with
 * errors the situation allows (25% there: lookups of keys nobody
 * published, waits that time out, probes). */
#define FLOOR_READS 1.0
#define MAX_ALLOWED_ERR 0.5

/* The uids clients that are not root run as: 4242 and 4243 have groups of
 * their own, 4244 shares 4242's group, so that group bits count. */
static const uid_t other_uid[NUIDS] = {4242, 4243, 4244};
static const gid_t other_gid[NUIDS] = {4242, 4243, 4242};

/* ---- the payload ---- */

#define PAYLOAD_MAGIC 0x31306b616f736474ull /* "tdsoak01" */

typedef struct payload_hdr {
  uint64_t magic;
  uint64_t len;  /* the storage's size */
  uint64_t seed; /* word i of the body is mix(seed, i) */
  uint64_t hash; /* of the other fields and the body */
  uint32_t uid, gid, mode, pad;
} payload_hdr;

#define HDR ((size_t)sizeof(payload_hdr))

static uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

static uint64_t body_word(uint64_t seed, size_t i) {
  return splitmix(seed ^ ((uint64_t)i * 0xd6e8feb86659fd93ull));
}

static uint64_t hash_step(uint64_t h, uint64_t w) {
  return (h ^ w) * 0x100000001b3ull + (h >> 29);
}

static uint64_t hdr_hash0(const payload_hdr *h) {
  uint64_t x = 0xcbf29ce484222325ull;
  x = hash_step(x, h->len);
  x = hash_step(x, h->seed);
  x = hash_step(x, (uint64_t)h->uid << 32 | h->gid);
  return hash_step(x, h->mode);
}

static uint8_t tiny_byte(size_t n, size_t i) {
  return (uint8_t)(n * 131 + i * 29 + 7);
}

/* Writes into p[0..n) the payload of seed, saying that uid and gid made it
 * with mode. */
static void payload_write(uint8_t *p, size_t n, uint64_t seed, uint32_t mode,
                          uint32_t uid, uint32_t gid) {
  if (n < HDR) {
    for (size_t i = 0; i < n; i++)
      p[i] = tiny_byte(n, i);
    return;
  }
  payload_hdr h = {PAYLOAD_MAGIC, n, seed, 0, uid, gid, mode, 0};
  uint64_t x = hdr_hash0(&h);
  size_t words = (n - HDR) / 8, i;
  uint8_t *body = p + HDR;
  for (i = 0; i < words; i++) {
    uint64_t w = body_word(seed, i);
    memcpy(body + 8 * i, &w, 8);
    x = hash_step(x, w);
  }
  uint64_t w = body_word(seed, i);
  for (size_t j = 0; j < (n - HDR) % 8; j++) {
    body[8 * i + j] = (uint8_t)(w >> (8 * j));
    x = hash_step(x, body[8 * i + j]);
  }
  h.hash = x;
  memcpy(p, &h, HDR);
}

/* Checks p[0..n) against the payload its header names. Returns NULL if it
 * matches (and fills *h, zeroed for a tiny one), else what differs. */
static const char *payload_check(const uint8_t *p, size_t n, payload_hdr *h,
                                 char *why, size_t len) {
  memset(h, 0, sizeof(*h));
  if (n < HDR) {
    for (size_t i = 0; i < n; i++)
      if (p[i] != tiny_byte(n, i)) {
        snprintf(why, len,
                 "byte %zu of a %zu-byte storage is 0x%02x, not "
                 "0x%02x",
                 i, n, p[i], tiny_byte(n, i));
        return why;
      }
    return NULL;
  }
  memcpy(h, p, HDR);
  if (h->magic != PAYLOAD_MAGIC) {
    snprintf(why, len, "header magic is %016" PRIx64 " (storage of %zu bytes)",
             h->magic, n);
    return why;
  }
  if (h->len != n) {
    snprintf(why, len, "header says %" PRIu64 " bytes, the storage has %zu",
             h->len, n);
    return why;
  }
  uint64_t x = hdr_hash0(h);
  size_t words = (n - HDR) / 8, i;
  const uint8_t *body = p + HDR;
  for (i = 0; i < words; i++) {
    uint64_t w;
    memcpy(&w, body + 8 * i, 8);
    if (w != body_word(h->seed, i)) {
      snprintf(why, len,
               "body word %zu (byte %zu of %zu, seed %016" PRIx64
               ") is %016" PRIx64 ", not %016" PRIx64,
               i, HDR + 8 * i, n, h->seed, w, body_word(h->seed, i));
      return why;
    }
    x = hash_step(x, w);
  }
  uint64_t w = body_word(h->seed, i);
  for (size_t j = 0; j < (n - HDR) % 8; j++) {
    if (body[8 * i + j] != (uint8_t)(w >> (8 * j))) {
      snprintf(why, len, "tail byte %zu of %zu differs", HDR + 8 * i + j, n);
      return why;
    }
    x = hash_step(x, body[8 * i + j]);
  }
  if (x != h->hash) {
    snprintf(why, len, "hash %016" PRIx64 " != header's %016" PRIx64, x,
             h->hash);
    return why;
  }
  return NULL;
}

/* As tensord decides: may (uid, gid) have want (4 read, 2 write) of a
 * storage of owner ouid/ogid and mode? The clients have no supplementary
 * groups. */
static int may(uid_t uid, gid_t gid, const payload_hdr *h, unsigned want) {
  if (uid == 0)
    return 1;
  unsigned bits = uid == h->uid   ? (h->mode >> 6) & 7
                  : gid == h->gid ? (h->mode >> 3) & 7
                                  : h->mode & 7;
  return (bits & want) == want;
}

/* ---- what everyone shares ---- */

enum {
  OP_CONNECT,
  OP_CREATE,
  OP_PUBLISH,
  OP_LOOKUP,
  OP_LOOKUP_RO,
  OP_LOOKUP_WAIT,
  OP_TAKE,
  OP_OPEN_RO,
  OP_OPEN_RW,
  OP_RELEASE,
  OP_UNPUBLISH,
  OP_PROBE_READ,  /* another uid's private key: lookup */
  OP_PROBE_WRITE, /* another uid's private or a durable key: unpublish */
  OP_DURABLE,     /* a durable key, read-only */
  OP_LIST,
  OP_REPLACE, /* the replacer: publish over its own key */
  OP_RW_UNPUBLISH,
  OP_RESOLVE, /* the replacer, after a reconnect: what survived */
  OP_COUNT
};

static const char *const op_name[OP_COUNT] = {
    "connect",          "create",       "publish",     "lookup",
    "lookup ro",        "lookup wait",  "lookup take", "open ro by id",
    "open rw by id",    "release",      "unpublish",   "probe: read other's",
    "probe: unpublish", "durable read", "list+stat",   "rw: replace",
    "rw: unpublish",    "rw: resolve",
};

typedef struct shared {
  _Atomic uint64_t ok[OP_COUNT];
  _Atomic uint64_t err[OP_COUNT][NERR];
  _Atomic uint64_t unexpected[OP_COUNT][NERR];
  _Atomic uint64_t reads_verified, bytes_verified, mprotect_probes;
  /* The client processes' own: requests answered, those that failed with
   * an allowed error, payloads verified (the floor is judged on these). */
  _Atomic uint64_t client_ops, client_allowed, client_reads;
  _Atomic uint64_t reconnects, conn_lost;
  _Atomic uint64_t violations, unexpected_total;
  _Atomic uint32_t nmsgs;
  char msgs[MAX_MSGS][320];
  _Atomic int stop;
  _Atomic int restarting; /* the daemon is down or coming back */
  /* --upgrade: one is under way; upgrades begun (a client's operation that
   * sees either change spans one); clients parked for the check after it. */
  _Atomic int upgrading, hold;
  _Atomic uint64_t upgrade_gen;
  _Atomic uint32_t parked;
  _Atomic uint64_t op_max_ns, op_max_upgrade_ns; /* longest client op */
  _Atomic uint32_t nkilled;
  _Atomic uint64_t killed[MAX_INSTANCES]; /* instances the coordinator killed */
  _Atomic uint32_t recent_next;
  _Atomic uint64_t recent_id[RECENT], recent_inst[RECENT];
  /* The replacer's keys: the seed of the last change tensord acknowledged
   * (RW_ABSENT: unpublished) and of the one in flight (0: none). */
  _Atomic uint64_t rw_acked[RW_KEYS], rw_inflight[RW_KEYS];
  _Atomic uint64_t rw_lost; /* changes in flight when a connection broke */
} shared;

static shared *sh;
static pid_t coordinator;
static int in_client; /* this process is one of the clients */

/* Settings, from the command line. */
static struct {
  const char *sock;
  unsigned seconds, clients, keys, durable;
  unsigned sleep_min_ms, sleep_max_ms, kill_every_ms, restart_every_s;
  int restart;
  uint64_t seed;
  const char *instances_file;
  unsigned cripple;        /* $SOAK_CRIPPLE: per 1000 operations, see the top */
  const char *upgrade_cmd; /* --upgrade: starts `tensord --upgrade` */
  unsigned upgrade_every_s;
} cfg = {NULL, 300, 256, 1024, 32, 1, 20, 250, 15, 0, 0, NULL, 0, NULL, 6};

static void note_msg(const char *kind, const char *fmt, va_list ap) {
  char buf[320];
  int n = snprintf(buf, sizeof(buf), "%s (pid %d): ", kind, (int)getpid());
  vsnprintf(buf + n, sizeof(buf) - (size_t)n, fmt, ap);
  uint32_t i = atomic_fetch_add(&sh->nmsgs, 1);
  if (i < MAX_MSGS) {
    memcpy(sh->msgs[i], buf, sizeof(buf));
    fprintf(stderr, "soak: %s\n", buf);
  }
}

static void violation(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
static void violation(const char *fmt, ...) {
  atomic_fetch_add(&sh->violations, 1);
  va_list ap;
  va_start(ap, fmt);
  note_msg("VIOLATION", fmt, ap);
  va_end(ap);
}

static void unexpected(const char *fmt, ...)
    __attribute__((format(printf, 1, 2)));
static void unexpected(const char *fmt, ...) {
  atomic_fetch_add(&sh->unexpected_total, 1);
  va_list ap;
  va_start(ap, fmt);
  note_msg("unexpected", fmt, ap);
  va_end(ap);
}

static int err_slot(int err) {
  return err < 0 && -err < NERR - 1 ? -err : NERR - 1;
}

static int is_conn_err(int err) {
  return err == TD_ECONNRESET || err == TD_ENOTCONN || err == TD_ECONNREFUSED ||
         err == -EPIPE;
}

static int instance_killed(uint64_t inst) {
  uint32_t n = atomic_load(&sh->nkilled);
  for (uint32_t i = 0; i < n && i < MAX_INSTANCES; i++)
    if (atomic_load(&sh->killed[i]) == inst)
      return 1;
  return 0;
}

/* ---- a client process ---- */

typedef struct held {
  td_storage *s;
} held;

typedef struct client {
  int slot;
  uid_t uid;
  gid_t gid;
  td_client *c;
  uint64_t inst; /* of the daemon c talks to */
  uint64_t rng;
  held h[MAX_HELD];
  int nh;
  int connects;
} client;

static uint64_t rnd(client *me) {
  me->rng ^= me->rng << 13;
  me->rng ^= me->rng >> 7;
  me->rng ^= me->rng << 17;
  return me->rng;
}

static unsigned below(client *me, unsigned n) {
  return (unsigned)(rnd(me) % n);
}

static void sleep_ms(unsigned ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) < 0 && errno == EINTR)
    ;
}

/* What kind of key a client touches, for what errors it may expect. */
enum { K_SOAK, K_OWN, K_OTHER, K_DURABLE, K_ID };

/* Counts the outcome err of op by me on a key of kind k, and judges an
 * error: returns 1 if it lost the connection. */
static int outcome(client *me, int op, int err, int k, const char *what) {
  if (in_client)
    atomic_fetch_add(&sh->client_ops, 1);
  if (err >= 0) {
    atomic_fetch_add(&sh->ok[op], 1);
    return 0;
  }
  int slot = err_slot(err);
  atomic_fetch_add(&sh->err[op][slot], 1);
  int ok;
  if (op == OP_CONNECT)
    ok = atomic_load(&sh->restarting); /* no socket yet, or not chmod-ed */
  else if (is_conn_err(err))
    ok = instance_killed(me->inst) || atomic_load(&sh->restarting);
  else if (err == TD_ENOENT)
    ok = 1; /* a durable key gone is a violation, counted by the caller */
  else if (err == TD_ETIMEDOUT)
    ok = op == OP_LOOKUP_WAIT || op == OP_TAKE; /* both may wait */
  else if (err == TD_EACCES)
    ok = me->uid != 0 && (k == K_SOAK || k == K_OTHER || k == K_ID ||
                          (k == K_DURABLE && op == OP_PROBE_WRITE));
  else
    ok = 0;
  if (ok && in_client)
    atomic_fetch_add(&sh->client_allowed, 1);
  if (!ok) {
    atomic_fetch_add(&sh->unexpected[op][slot], 1);
    unexpected("client %d (uid %u): %s %s: %s: %s", me->slot, (unsigned)me->uid,
               op_name[op], what, td_err_name(err),
               td_last_error(op == OP_CONNECT ? NULL : me->c));
  }
  if (is_conn_err(err) && op != OP_CONNECT) {
    atomic_fetch_add(&sh->conn_lost, 1);
    return 1;
  }
  return 0;
}

static void drop_held(client *me, int i) {
  td_storage_release(me->h[i].s);
  me->h[i] = me->h[--me->nh];
}

static void keep(client *me, td_storage *s) {
  if (me->nh == MAX_HELD)
    drop_held(me, (int)below(me, MAX_HELD));
  me->h[me->nh++].s = s;
}

static void disconnect(client *me) {
  while (me->nh > 0)
    drop_held(me, me->nh - 1);
  td_close(me->c);
  me->c = NULL;
}

static int client_connect(client *me) {
  td_client *c;
  int err = td_connect(cfg.sock, &c);
  if (outcome(me, OP_CONNECT, err, K_ID, cfg.sock) || err < 0)
    return -1;
  td_stat st;
  err = td_stat_get(c, &st);
  if (err < 0) {
    me->c = c;
    me->inst = 0;
    outcome(me, OP_LIST, err, K_ID, "stat after connect");
    td_close(c);
    me->c = NULL;
    return -1;
  }
  me->c = c;
  me->inst = st.instance;
  if (me->connects++ > 0)
    atomic_fetch_add(&sh->reconnects, 1);
  return 0;
}

/* Checks a handle just got: read-only if ro, its view (if v), its bytes,
 * and that the daemon was allowed to give it what want asks (4 read, 6 read
 * and write: a read-write handle or a take). */
static void check_handle(client *me, td_storage *s, const td_view *v, int ro,
                         unsigned want, const char *what) {
  size_t n = td_storage_nbytes(s);
  const uint8_t *p = td_storage_data(s);
  char why[256];
  payload_hdr h;
  if (v != NULL &&
      (v->dtype != TD_UINT8 || v->ndim != 1 || v->shape[0] != (int64_t)n ||
       v->stride[0] != 1 || v->offset != 0)) {
    char vb[128];
    violation("%s: view %s, published as uint8[%zu]", what,
              td_view_format(v, vb, sizeof(vb)), n);
  }
  if (td_storage_is_readonly(s) != ro)
    violation("%s: handle is %s, asked for %s", what,
              td_storage_is_readonly(s) ? "read-only" : "read-write",
              ro ? "read-only" : "read-write");
  if (payload_check(p, n, &h, why, sizeof(why)) != NULL) {
    violation("%s (storage %" PRIu64 ", %zu bytes): %s", what, td_storage_id(s),
              n, why);
    return;
  }
  atomic_fetch_add(&sh->reads_verified, 1);
  atomic_fetch_add(&sh->bytes_verified, n);
  if (in_client)
    atomic_fetch_add(&sh->client_reads, 1);
  if (n >= HDR && !may(me->uid, me->gid, &h, want))
    violation("%s: uid %u gid %u got %s access to storage %" PRIu64
              " of uid %u gid %u mode %04o",
              what, (unsigned)me->uid, (unsigned)me->gid,
              want & 2 ? "read-write" : "read", td_storage_id(s), h.uid, h.gid,
              h.mode);
  /* A read-only mapping must not become writable. */
  if (ro && below(me, 16) == 0) {
    atomic_fetch_add(&sh->mprotect_probes, 1);
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    void *base = (void *)((uintptr_t)p & ~(uintptr_t)(pg - 1));
    if (mprotect(base, pg, PROT_READ | PROT_WRITE) == 0) {
      violation("%s: mprotect(PROT_WRITE) of a read-only storage (%" PRIu64
                ") succeeded",
                what, td_storage_id(s));
      mprotect(base, pg, PROT_READ);
    }
  }
}

static void soak_key(client *me, char *key, size_t len, unsigned n) {
  snprintf(key, len, "soak/%u", below(me, n));
}

static void private_key(client *me, uid_t uid, char *key, size_t len) {
  snprintf(key, len, "private/%u/%u", (unsigned)uid, below(me, PRIVATE_KEYS));
}

static uid_t another_uid(client *me) {
  uid_t u;
  do
    u = other_uid[below(me, NUIDS)];
  while (u == me->uid);
  return u;
}

static size_t random_size(client *me) {
  unsigned bits = below(me, 21); /* 1 B .. 1 MiB, as many of each scale */
  size_t n = ((size_t)1 << bits) + (rnd(me) & (((size_t)1 << bits) - 1));
  return n > MAX_SIZE ? MAX_SIZE : n;
}

static int op_create(client *me) {
  static const uint32_t modes[] = {0600, 0640, 0644, 0660, 0666};
  int priv = me->uid != 0 && below(me, 2) == 0;
  td_create_opts o = {0};
  o.nbytes = random_size(me);
  o.mode = priv ? 0600 : modes[below(me, 5)];
  if (o.nbytes < HDR && priv)
    o.nbytes += HDR; /* private ones say whose they are */
  if (o.nbytes < HDR)
    o.mode = 0666; /* a tiny payload cannot say who may read it */
  /* A third of the creates leave the bytes to the caller (TD_UNINIT): a
   * recycled segment then keeps what was written there last, which must be
   * this uid's own. Every other create must read as zeros. */
  if (below(me, 3) == 0)
    o.flags = TD_UNINIT;
  td_storage *s;
  int err = td_storage_create_ex(me->c, &o, &s);
  if (outcome(me, OP_CREATE, err, K_ID, "") || err < 0)
    return err;
  const uint8_t *fresh = td_storage_data(s);
  if (!(o.flags & TD_UNINIT)) {
    for (size_t i = 0; i < o.nbytes; i++)
      if (fresh[i] != 0) {
        violation("a new storage (%" PRIu64 ", %zu bytes) is not zero: byte "
                  "%zu is 0x%02x",
                  td_storage_id(s), o.nbytes, i, fresh[i]);
        break;
      }
  } else if (o.nbytes >= HDR) {
    payload_hdr h;
    memcpy(&h, fresh, HDR);
    if (h.magic == PAYLOAD_MAGIC && h.uid != me->uid)
      violation("a new storage (%" PRIu64 ", %zu bytes) of uid %u holds "
                "bytes uid %u wrote (mode %04o): recycled across uids",
                td_storage_id(s), o.nbytes, (unsigned)me->uid, h.uid, h.mode);
  }
  payload_write(td_storage_data(s), o.nbytes, rnd(me), o.mode, me->uid,
                me->gid);
  uint32_t r = atomic_fetch_add(&sh->recent_next, 1) % RECENT;
  atomic_store(&sh->recent_inst[r], me->inst);
  atomic_store(&sh->recent_id[r], td_storage_id(s));
  if (below(me, 8) != 0) {
    char key[64];
    int k = priv ? K_OWN : K_SOAK;
    if (priv)
      private_key(me, me->uid, key, sizeof(key));
    else
      soak_key(me, key, sizeof(key), cfg.keys);
    err = td_publish(me->c, key, s, NULL);
    if (outcome(me, OP_PUBLISH, err, k, key)) {
      td_storage_release(s);
      return err;
    }
  }
  if (below(me, 2) == 0)
    keep(me, s);
  else
    td_storage_release(s);
  return err;
}

static int op_lookup(client *me, int op) {
  char key[64];
  int k = K_SOAK;
  unsigned flags = 0;
  int timeout = 0;
  if (op == OP_LOOKUP_RO)
    flags = TD_RDONLY;
  if (op == OP_LOOKUP && me->uid != 0 && below(me, 3) == 0) {
    private_key(me, me->uid, key, sizeof(key));
    k = K_OWN;
  } else if (op == OP_LOOKUP_WAIT) {
    soak_key(me, key, sizeof(key), HOT_KEYS);
    timeout = 1 + (int)below(me, 300);
    flags = below(me, 2) ? TD_RDONLY : 0;
  } else if (op == OP_TAKE) {
    soak_key(me, key, sizeof(key), cfg.keys);
    flags = TD_TAKE | (below(me, 3) == 0 ? TD_RDONLY : 0);
    if (below(me, 4) == 0)
      timeout = 1 + (int)below(me, 100);
  } else if (op == OP_LOOKUP && me->uid == 0 && below(me, 8) == 0) {
    /* Root may read anything, private keys too. */
    private_key(me, other_uid[below(me, NUIDS)], key, sizeof(key));
    k = K_OWN;
  } else {
    soak_key(me, key, sizeof(key), cfg.keys);
  }
  td_storage *s;
  td_view v;
  int err = td_lookup(me->c, key, flags, timeout, &s, &v);
  if (outcome(me, op, err, k, key) || err < 0)
    return err;
  char what[96];
  snprintf(what, sizeof(what), "%s '%s'", op_name[op], key);
  int ro = (flags & TD_RDONLY) != 0;
  check_handle(me, s, &v, ro, ro && !(flags & TD_TAKE) ? 4 : 6, what);
  if (op == OP_TAKE && !(flags & TD_RDONLY) && below(me, 2) == 0) {
    /* Hand it on, unchanged, under another key. */
    soak_key(me, key, sizeof(key), cfg.keys);
    err = td_publish(me->c, key, s, NULL);
    if (outcome(me, OP_PUBLISH, err, K_SOAK, key)) {
      td_storage_release(s);
      return err;
    }
  }
  if (below(me, 3) == 0)
    keep(me, s);
  else
    td_storage_release(s);
  return 0;
}

static int op_open(client *me, int op) {
  uint32_t r = below(me, RECENT);
  uint64_t inst = atomic_load(&sh->recent_inst[r]);
  uint64_t id = atomic_load(&sh->recent_id[r]);
  if (id == 0 || inst != me->inst)
    return 0;
  unsigned flags = op == OP_OPEN_RO ? TD_RDONLY : 0;
  td_storage *s;
  char what[64];
  snprintf(what, sizeof(what), "storage %" PRIu64, id);
  int err = td_storage_open(me->c, id, flags, &s);
  if (outcome(me, op, err, K_ID, what) || err < 0)
    return err;
  snprintf(what, sizeof(what), "%s %" PRIu64, op_name[op], id);
  check_handle(me, s, NULL, flags != 0, flags ? 4 : 6, what);
  if (below(me, 3) == 0)
    keep(me, s);
  else
    td_storage_release(s);
  return 0;
}

static int op_unpublish(client *me) {
  char key[64];
  soak_key(me, key, sizeof(key), cfg.keys);
  int err = td_unpublish(me->c, key);
  outcome(me, OP_UNPUBLISH, err, K_SOAK, key);
  return err;
}

/* Another uid's private keys must stay out of reach; durable keys (mode
 * 0644, root's) must not be unpublished by anyone else. */
static int op_probe(client *me, int op) {
  char key[64];
  int err;
  if (op == OP_PROBE_READ) {
    private_key(me, another_uid(me), key, sizeof(key));
    static const unsigned fl[] = {0, TD_RDONLY, TD_TAKE, TD_TAKE | TD_RDONLY};
    td_storage *s;
    unsigned flags = fl[below(me, 4)];
    err = td_lookup(me->c, key, flags, 0, &s, NULL);
    if (err == 0) {
      violation("uid %u looked up another uid's private key '%s' (flags %u): "
                "storage %" PRIu64,
                (unsigned)me->uid, key, flags, td_storage_id(s));
      td_storage_release(s);
    }
    return outcome(me, op, err, K_OTHER, key) ? err : 0;
  }
  int durable = below(me, 2) == 0;
  if (durable)
    snprintf(key, sizeof(key), "durable/%u", below(me, cfg.durable));
  else
    private_key(me, another_uid(me), key, sizeof(key));
  err = td_unpublish(me->c, key);
  if (err == 0)
    violation("uid %u unpublished '%s', which it may not write",
              (unsigned)me->uid, key);
  if (err == TD_ENOENT && durable)
    violation("durable key '%s' is gone (seen by uid %u)", key,
              (unsigned)me->uid);
  return outcome(me, op, err, durable ? K_DURABLE : K_OTHER, key) ? err : 0;
}

/* The durable payloads: sizes from 1 byte to 1 MiB, fixed seeds. */
static size_t durable_size(unsigned i) {
  unsigned bits = cfg.durable > 1 ? i * 20 / (cfg.durable - 1) : 10;
  size_t n = ((size_t)1 << bits) + i * 7;
  return n > MAX_SIZE ? MAX_SIZE : n;
}

static uint64_t durable_seed(unsigned i) {
  return 0xd00dull << 32 | i;
}

/* Returns NULL if s holds exactly durable payload i, else what differs. */
static const char *durable_check(unsigned i, td_storage *s, char *why,
                                 size_t len) {
  size_t n = durable_size(i);
  if (td_storage_nbytes(s) != n) {
    snprintf(why, len, "%zu bytes, not %zu", td_storage_nbytes(s), n);
    return why;
  }
  uint8_t *want = malloc(n);
  if (want == NULL)
    bench_die("out of memory");
  payload_write(want, n, durable_seed(i), 0644, 0, 0); /* as root made it */
  const uint8_t *got = td_storage_data(s);
  const char *r = NULL;
  for (size_t j = 0; j < n; j++)
    if (got[j] != want[j]) {
      snprintf(why, len, "byte %zu of %zu is 0x%02x, not 0x%02x", j, n, got[j],
               want[j]);
      r = why;
      break;
    }
  free(want);
  return r;
}

static int op_durable(client *me) {
  unsigned i = below(me, cfg.durable);
  char key[64], why[200];
  snprintf(key, sizeof(key), "durable/%u", i);
  td_storage *s;
  int err = td_lookup(me->c, key, TD_RDONLY, 0, &s, NULL);
  if (err == TD_ENOENT)
    violation("durable key '%s' is gone", key);
  if (outcome(me, OP_DURABLE, err, K_DURABLE, key) || err < 0)
    return err;
  if (durable_check(i, s, why, sizeof(why)) != NULL)
    violation("durable key '%s': %s", key, why);
  else {
    atomic_fetch_add(&sh->reads_verified, 1);
    atomic_fetch_add(&sh->bytes_verified, td_storage_nbytes(s));
    atomic_fetch_add(&sh->client_reads, 1);
  }
  td_storage_release(s);
  return 0;
}

static int count_cb(const td_storage_info *info, void *arg) {
  (*(uint64_t *)arg)++;
  return 0;
}

static int op_list(client *me) {
  td_stat st;
  uint64_t n = 0;
  int err = td_stat_get(me->c, &st);
  if (err == 0)
    err = td_list(me->c, count_cb, &n);
  outcome(me, OP_LIST, err, K_ID, "");
  return err;
}

/* SOAK_CRIPPLE: a lookup that fails with ENOENT, an allowed error. */
static int op_missing(client *me) {
  td_storage *s;
  int err = td_lookup(me->c, "soak-crippled/nobody-publishes-this", 0, 0, &s,
                      NULL);
  if (err == 0)
    td_storage_release(s);
  outcome(me, OP_LOOKUP, err, K_SOAK, "soak-crippled/...");
  return err;
}

/* Raises *max to v if v is larger. */
static void note_max(_Atomic uint64_t *max, uint64_t v) {
  uint64_t m = atomic_load(max);
  while (v > m && !atomic_compare_exchange_weak(max, &m, v))
    ;
}

/* Between operations: waits while the coordinator checks the daemon's
 * state after an upgrade, counted in sh->parked. */
static void park(void) {
  if (!atomic_load(&sh->hold))
    return;
  atomic_fetch_add(&sh->parked, 1);
  while (atomic_load(&sh->hold) && !atomic_load(&sh->stop))
    sleep_ms(5);
  atomic_fetch_sub(&sh->parked, 1);
}

static int client_main(void *arg) {
  client me = {0};
  me.slot = (int)(intptr_t)arg;
  in_client = 1;
  /* Drop the coordinator's descriptors (its connection to tensord above
   * all: a copy here would keep that connection open after it closes). */
  for (int fd = 3; fd < 1024; fd++)
    close(fd);
  me.uid = getuid();
  me.gid = getgid();
  if (geteuid() == 0 && me.slot % 4 == 3) {
    int u = (me.slot / 4) % NUIDS;
    if (setgroups(0, NULL) < 0 || setgid(other_gid[u]) < 0 ||
        setuid(other_uid[u]) < 0)
      bench_die("client %d: becoming uid %u: %s", me.slot,
                (unsigned)other_uid[u], strerror(errno));
    me.uid = other_uid[u];
    me.gid = other_gid[u];
    /* A change of credentials clears the parent-death signal. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != coordinator)
      _exit(1); /* it died before that */
  }
  (void)setpriority(PRIO_PROCESS, 0, 10); /* only politeness */
  me.rng =
      splitmix(cfg.seed ^ ((uint64_t)getpid() << 20) ^ (uint64_t)me.slot) | 1;

  while (!atomic_load(&sh->stop)) {
    park();
    if (me.c == NULL && client_connect(&me) < 0) {
      sleep_ms(20 + below(&me, 30));
      continue;
    }
    sleep_ms(cfg.sleep_min_ms +
             below(&me, cfg.sleep_max_ms - cfg.sleep_min_ms + 1));
    unsigned r = below(&me, 1000);
    int err;
    uint64_t gen = atomic_load(&sh->upgrade_gen);
    int during = atomic_load(&sh->upgrading);
    uint64_t t = bench_now_ns();
    if (cfg.cripple > below(&me, 1000))
      err = op_missing(&me);
    else if (r < 220)
      err = op_create(&me);
    else if (r < 400)
      err = op_lookup(&me, OP_LOOKUP);
    else if (r < 520)
      err = op_lookup(&me, OP_LOOKUP_RO);
    else if (r < 600)
      err = op_lookup(&me, OP_LOOKUP_WAIT);
    else if (r < 680)
      err = op_lookup(&me, OP_TAKE);
    else if (r < 750)
      err = op_open(&me, OP_OPEN_RO);
    else if (r < 780)
      err = op_open(&me, OP_OPEN_RW);
    else if (r < 880) {
      if (me.nh > 0) {
        drop_held(&me, (int)below(&me, (unsigned)me.nh));
        atomic_fetch_add(&sh->ok[OP_RELEASE], 1);
      }
      err = 0;
    } else if (r < 930)
      err = op_unpublish(&me);
    else if (r < 960)
      err = me.uid != 0
                ? op_probe(&me, below(&me, 2) ? OP_PROBE_READ : OP_PROBE_WRITE)
                : op_lookup(&me, OP_LOOKUP);
    else if (r < 998)
      err = op_durable(&me);
    else
      err = op_list(&me);
    t = bench_now_ns() - t;
    if (r < 520 || r >= 680) /* lookups that may wait aside */
      note_max(during || atomic_load(&sh->upgrading) ||
                       atomic_load(&sh->upgrade_gen) != gen
                   ? &sh->op_max_upgrade_ns
                   : &sh->op_max_ns,
               t);
    if (is_conn_err(err))
      disconnect(&me);
  }
  if (me.c != NULL)
    disconnect(&me);
  return 0;
}

/* ---- the replacer ---- */

/* A few root processes, never killed by the chaos loop, keep changing the
 * keys durable-rw/<i>, each its own, without pausing: they publish new
 * storages over them (each replace drops the old storage) and sometimes
 * unpublish one. It notes the seed of each
 * change before asking and once tensord acknowledged it. After a lost
 * connection (a daemon restart) each key must resolve to the last
 * acknowledged state or the one in flight: a key lost by a restart, or one
 * that comes back after an acknowledged unpublish, is a violation. */

static void rw_key(unsigned i, char *key, size_t len) {
  snprintf(key, len, "durable-rw/%u", i);
}

/* What key i holds now: a seed, RW_ABSENT, or 0 (and a violation) if its
 * bytes are wrong; a connection error is returned as is. */
static int64_t rw_read(client *me, unsigned i, uint64_t *seed) {
  char key[64], why[256];
  rw_key(i, key, sizeof(key));
  td_storage *s;
  int err = td_lookup(me->c, key, TD_RDONLY, 0, &s, NULL);
  if (err == TD_ENOENT) {
    *seed = RW_ABSENT;
    return 0;
  }
  if (err < 0)
    return err;
  payload_hdr h;
  *seed = 0;
  if (payload_check(td_storage_data(s), td_storage_nbytes(s), &h, why,
                    sizeof(why)) != NULL)
    violation("'%s' (storage %" PRIu64 "): %s", key, td_storage_id(s), why);
  else
    *seed = h.seed;
  td_storage_release(s);
  return 0;
}

static const char *rw_state(uint64_t v, char *buf, size_t len) {
  if (v == 0)
    return "none";
  if (v == RW_ABSENT)
    return "unpublished";
  snprintf(buf, len, "seed %016" PRIx64, v);
  return buf;
}

/* After a (re)connect: checks what each key holds against what was
 * acknowledged and what was in flight, and settles it. */
static int rw_resolve(client *me) {
  for (unsigned i = (unsigned)me->slot; i < RW_KEYS; i += REPLACERS) {
    uint64_t got;
    int err = (int)rw_read(me, i, &got);
    if (outcome(me, OP_RESOLVE, err, K_DURABLE, "") || err < 0)
      return err;
    uint64_t acked = atomic_load(&sh->rw_acked[i]);
    uint64_t fly = atomic_load(&sh->rw_inflight[i]);
    if (got != 0 && got != acked && got != fly) {
      char key[64], a[40], b[40], c[40];
      rw_key(i, key, sizeof(key));
      violation("after a reconnect (instance %016" PRIx64 "), '%s' is %s; "
                "the last acknowledged change left it %s, the one in "
                "flight: %s",
                me->inst, key, rw_state(got, a, sizeof(a)),
                rw_state(acked, b, sizeof(b)), rw_state(fly, c, sizeof(c)));
    }
    if (fly != 0)
      atomic_fetch_add(&sh->rw_lost, 1);
    if (got != 0)
      atomic_store(&sh->rw_acked[i], got);
    atomic_store(&sh->rw_inflight[i], 0);
  }
  return 0;
}

static int rw_change(client *me) {
  unsigned i = (unsigned)me->slot + REPLACERS * below(me, RW_KEYS / REPLACERS);
  char key[64];
  rw_key(i, key, sizeof(key));
  int err;
  if (below(me, 8) == 0) {
    atomic_store(&sh->rw_inflight[i], RW_ABSENT);
    err = td_unpublish(me->c, key);
    if (outcome(me, OP_RW_UNPUBLISH, err, K_SOAK, key))
      return err; /* in flight: the next resolve decides */
    if (err == 0 || err == TD_ENOENT)
      atomic_store(&sh->rw_acked[i], RW_ABSENT);
    atomic_store(&sh->rw_inflight[i], 0);
    return 0;
  }
  td_create_opts o = {0};
  o.nbytes = HDR + below(me, 64 * 1024);
  o.mode = 0644;
  td_storage *s;
  err = td_storage_create_ex(me->c, &o, &s);
  if (outcome(me, OP_CREATE, err, K_ID, key) || err < 0)
    return err;
  uint64_t seed = rnd(me) | 1ull << 63;
  payload_write(td_storage_data(s), o.nbytes, seed, o.mode, me->uid, me->gid);
  atomic_store(&sh->rw_inflight[i], seed);
  err = td_publish(me->c, key, s, NULL);
  td_storage_release(s);
  if (outcome(me, OP_REPLACE, err, K_DURABLE, key))
    return err;
  if (err == 0)
    atomic_store(&sh->rw_acked[i], seed);
  atomic_store(&sh->rw_inflight[i], 0);
  return 0;
}

static int replacer_main(void *arg) {
  client me = {0};
  me.slot = (int)(intptr_t)arg; /* which replacer: its keys */
  for (int fd = 3; fd < 1024; fd++)
    close(fd);
  me.uid = getuid();
  me.gid = getgid();
  me.rng = splitmix(cfg.seed ^ 0x5eed ^ (uint64_t)me.slot) | 1;
  while (!atomic_load(&sh->stop)) {
    park();
    if (me.c == NULL) {
      if (client_connect(&me) < 0 || rw_resolve(&me) < 0) {
        if (me.c != NULL)
          disconnect(&me);
        sleep_ms(20);
        continue;
      }
    }
    if (is_conn_err(rw_change(&me)))
      disconnect(&me);
  }
  if (me.c != NULL)
    disconnect(&me);
  return 0;
}

/* ---- the coordinator ---- */

typedef struct slot {
  pid_t pid;
  int killed; /* by the chaos loop */
} slot;

static slot *slots;
static pid_t replacer[REPLACERS];
static uint64_t spawned, killed_clients, client_crashes;
static uint64_t seen[MAX_INSTANCES];
static unsigned nseen;
static uint64_t restarts, longest_outage_ns, unrelated_restarts;
static uint64_t upgrades, longest_upgrade_ns;
static unsigned lives; /* restarts: daemon lives before the current one */
static pid_t upgraded; /* the last daemon --upgrade started, or 0 */

typedef struct rss_sample {
  uint64_t t_ns;
  int64_t rss;
  unsigned life; /* restarts before it: which daemon process */
} rss_sample;
static rss_sample *rss;
static size_t nrss, rsscap;

static void spawn(int i) {
  slots[i].pid = bench_fork(client_main, (void *)(intptr_t)i);
  slots[i].killed = 0;
  spawned++;
}

static void note_instance(uint64_t inst) {
  for (unsigned i = 0; i < nseen; i++)
    if (seen[i] == inst)
      return;
  if (nseen == MAX_INSTANCES)
    bench_die("more than %d daemon instances", MAX_INSTANCES);
  seen[nseen++] = inst;
  if (cfg.instances_file != NULL) {
    FILE *f = fopen(cfg.instances_file, "a");
    if (f != NULL) {
      fprintf(f, "%016" PRIx64 "\n", inst);
      fclose(f);
    }
  }
}

/* Reaps what exited; respawns a slot unless stopping. Returns how many. */
static int reap(int respawn) {
  int n = 0, status;
  pid_t pid;
  while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
    n++;
    int r = 0;
    while (r < REPLACERS && replacer[r] != pid)
      r++;
    if (r < REPLACERS) {
      if (!(atomic_load(&sh->stop) && WIFEXITED(status) &&
            WEXITSTATUS(status) == 0)) {
        client_crashes++;
        unexpected("replacer %d (pid %d) ended by itself: %s %d", r, (int)pid,
                   WIFSIGNALED(status) ? "signal" : "exit status",
                   WIFSIGNALED(status) ? WTERMSIG(status)
                                       : WEXITSTATUS(status));
      }
      replacer[r] = 0;
      continue;
    }
    for (unsigned i = 0; i < cfg.clients; i++) {
      if (slots[i].pid != pid)
        continue;
      int by_us =
          slots[i].killed && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
      int clean_stop = atomic_load(&sh->stop) && WIFEXITED(status) &&
                       WEXITSTATUS(status) == 0;
      if (!by_us && !clean_stop) {
        client_crashes++;
        unexpected("client %u (pid %d) ended by itself: %s %d", i, (int)pid,
                   WIFSIGNALED(status) ? "signal" : "exit status",
                   WIFSIGNALED(status) ? WTERMSIG(status)
                                       : WEXITSTATUS(status));
      }
      slots[i].pid = 0;
      if (respawn)
        spawn((int)i);
      break;
    }
  }
  return n;
}

static td_client *coord;
static td_stat cur; /* the daemon's, as last seen */

/* Connects the coordinator (retrying for up to timeout_s) and reads the
 * daemon's stat. Returns 0 or the last error. */
static int coord_connect(unsigned timeout_s) {
  uint64_t deadline = bench_now_ns() + (uint64_t)timeout_s * 1000000000u;
  int err;
  for (;;) {
    td_close(coord);
    coord = NULL;
    err = td_connect(cfg.sock, &coord);
    if (err == 0) {
      err = td_stat_get(coord, &cur);
      if (err == 0) {
        note_instance(cur.instance);
        return 0;
      }
    }
    if (bench_now_ns() > deadline)
      return err;
    sleep_ms(20);
  }
}

/* Reads every durable key; counts a violation for each that is gone or
 * differs. Returns 0, or a connection error. */
static int check_durable(const char *when, unsigned *good) {
  char key[64], why[200];
  unsigned ok = 0;
  for (unsigned i = 0; i < cfg.durable; i++) {
    snprintf(key, sizeof(key), "durable/%u", i);
    td_storage *s;
    int err = td_lookup(coord, key, TD_RDONLY, 0, &s, NULL);
    if (is_conn_err(err))
      return err;
    if (err < 0) {
      violation("%s: durable key '%s': %s: %s", when, key, td_err_name(err),
                td_last_error(coord));
      continue;
    }
    if (durable_check(i, s, why, sizeof(why)) != NULL)
      violation("%s: durable key '%s': %s", when, key, why);
    else
      ok++;
    td_storage_release(s);
  }
  if (good != NULL)
    *good = ok;
  return 0;
}

static void publish_durable(void) {
  for (unsigned i = 0; i < cfg.durable; i++) {
    td_create_opts o = {0};
    o.nbytes = durable_size(i);
    o.mode = 0644;
    td_storage *s;
    char key[64];
    snprintf(key, sizeof(key), "durable/%u", i);
    int err = td_storage_create_ex(coord, &o, &s);
    if (err == 0) {
      payload_write(td_storage_data(s), o.nbytes, durable_seed(i), 0644, 0, 0);
      err = td_publish(coord, key, s, NULL);
      td_storage_release(s);
    }
    if (err < 0)
      bench_die("publishing %s: %s", key, td_last_error(coord));
  }
}

/* Whether pid is gone (or a zombie nobody reaped yet). */
static int pid_gone(pid_t pid) {
  char path[64], buf[256];
  snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (f == NULL)
    return 1;
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')');
  return p != NULL && (p[2] == 'Z' || p[2] == 'X');
}

/* SIGKILLs the daemon, waits for its supervisor to start it again and
 * checks the durable keys at once. */
static void restart_daemon(void) {
  pid_t pid = cur.pid;
  uint64_t old = cur.instance;
  atomic_store(&sh->restarting, 1);
  uint32_t k = atomic_load(&sh->nkilled);
  if (k < MAX_INSTANCES) {
    atomic_store(&sh->killed[k], old);
    atomic_store(&sh->nkilled, k + 1);
  }
  uint64_t t0 = bench_now_ns();
  if (kill(pid, SIGKILL) < 0)
    bench_die("kill -KILL tensord (pid %d): %s", (int)pid, strerror(errno));
  while (!pid_gone(pid)) {
    if (bench_now_ns() - t0 > 10000000000ull)
      bench_die("tensord (pid %d) still there 10 s after SIGKILL", (int)pid);
    sleep_ms(5);
  }
  restarts++;
  lives++;
  for (;;) {
    int err = coord_connect(30);
    if (err < 0)
      bench_die("tensord did not come back within 30 s of its SIGKILL (%s: "
                "%s); --restart needs a supervisor that restarts it, as "
                "run.sh does",
                td_err_name(err), td_last_error(coord));
    if (cur.instance != old)
      break;
    sleep_ms(20); /* the old one, somehow: wait */
  }
  uint64_t outage = bench_now_ns() - t0;
  if (outage > longest_outage_ns)
    longest_outage_ns = outage;
  char when[64];
  snprintf(when, sizeof(when), "after restart %" PRIu64, restarts);
  check_durable(when, NULL);
}

static void sample_rss(uint64_t t0) {
  if (cur.pid <= 0 || atomic_load(&sh->restarting) ||
      atomic_load(&sh->upgrading))
    return;
  int64_t v = bench_proc_status(cur.pid, "VmRSS");
  if (v < 0)
    return;
  if (nrss == rsscap) {
    rsscap = rsscap ? rsscap * 2 : 1024;
    rss = realloc(rss, rsscap * sizeof(*rss));
    if (rss == NULL)
      bench_die("out of memory");
  }
  rss[nrss].t_ns = bench_now_ns() - t0;
  rss[nrss].life = lives;
  rss[nrss++].rss = v;
}

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return x < y ? -1 : x > y;
}

/* The median RSS of the samples taken in [from, to) seconds. */
static int64_t rss_median(double from, double to, size_t *count) {
  int64_t *v = malloc((nrss + 1) * sizeof(*v));
  size_t n = 0;
  for (size_t i = 0; v != NULL && i < nrss; i++) {
    double t = (double)rss[i].t_ns / 1e9;
    if (t >= from && t < to)
      v[n++] = rss[i].rss;
  }
  int64_t m = -1;
  if (n > 0) {
    qsort(v, n, sizeof(*v), cmp_i64);
    m = v[n / 2];
  }
  free(v);
  *count = n;
  return m;
}

/* How far RSS may grow from base: 25% or 4 MiB, the larger. */
static int64_t rss_allow(int64_t base) {
  int64_t slack = base / 4;
  return base + (slack < 4 * (int64_t)MIB ? 4 * (int64_t)MIB : slack);
}

/* ---- the end state ---- */

typedef struct listed {
  uint64_t id;
  size_t nkeys_total;
  int holders; /* other than the coordinator */
  uint32_t refs;
  int32_t holder_pid;
} listed;

typedef struct listing {
  listed *v;
  size_t n, cap;
  char **keys; /* every key td_list showed */
  size_t nkeys, keycap;
  int truncated; /* some storage has more keys than LIST shows */
} listing;

static int list_cb(const td_storage_info *info, void *arg) {
  listing *l = arg;
  if (l->n == l->cap) {
    l->cap = l->cap ? l->cap * 2 : 256;
    l->v = realloc(l->v, l->cap * sizeof(*l->v));
    if (l->v == NULL)
      bench_die("out of memory");
  }
  listed *e = &l->v[l->n++];
  memset(e, 0, sizeof(*e));
  e->id = info->id;
  e->nkeys_total = info->nkeys_total;
  e->refs = info->refs;
  for (size_t i = 0; i < info->nholders; i++)
    if (info->holders[i].pid != getpid()) {
      e->holders++;
      e->holder_pid = info->holders[i].pid;
    }
  if (info->nkeys < info->nkeys_total)
    l->truncated = 1;
  for (size_t i = 0; i < info->nkeys; i++) {
    if (l->nkeys == l->keycap) {
      l->keycap = l->keycap ? l->keycap * 2 : 256;
      l->keys = realloc(l->keys, l->keycap * sizeof(*l->keys));
      if (l->keys == NULL)
        bench_die("out of memory");
    }
    l->keys[l->nkeys++] = strdup(info->keys[i]);
  }
  return 0;
}

static void listing_free(listing *l) {
  for (size_t i = 0; i < l->nkeys; i++)
    free(l->keys[i]);
  free(l->keys);
  free(l->v);
  memset(l, 0, sizeof(*l));
}

static int list_all(listing *l) {
  listing_free(l);
  return td_list(coord, list_cb, l);
}

/* Counts the /dev/shm segments of every instance this run saw: their
 * storages' ("tensord.<instance>.<id>-<tail>"), or with pool their
 * recycling pools' ("tensord.<instance>-pool.<n>-<tail>"). */
static unsigned count_files(int pool) {
  DIR *d = opendir("/dev/shm");
  if (d == NULL)
    return 0;
  unsigned n = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    for (unsigned i = 0; i < nseen; i++) {
      char prefix[48];
      snprintf(prefix, sizeof(prefix), "tensord.%016" PRIx64 "%s", seen[i],
               pool ? "-pool." : ".");
      if (strncmp(e->d_name, prefix, strlen(prefix)) == 0) {
        n++;
        break;
      }
    }
  }
  closedir(d);
  return n;
}

/* Every key soak may have published. */
static size_t keyspace(char ***out) {
  size_t n = cfg.keys + cfg.durable + NUIDS * PRIVATE_KEYS + RW_KEYS, i = 0;
  char **k = calloc(n, sizeof(*k));
  char buf[64];
  for (unsigned j = 0; j < cfg.keys; j++) {
    snprintf(buf, sizeof(buf), "soak/%u", j);
    k[i++] = strdup(buf);
  }
  for (unsigned u = 0; u < NUIDS; u++)
    for (unsigned j = 0; j < PRIVATE_KEYS; j++) {
      snprintf(buf, sizeof(buf), "private/%u/%u", (unsigned)other_uid[u], j);
      k[i++] = strdup(buf);
    }
  for (unsigned j = 0; j < cfg.durable; j++) {
    snprintf(buf, sizeof(buf), "durable/%u", j);
    k[i++] = strdup(buf);
  }
  for (unsigned j = 0; j < RW_KEYS; j++) {
    rw_key(j, buf, sizeof(buf));
    k[i++] = strdup(buf);
  }
  *out = k;
  return i;
}

/* With every live client parked between operations (up to 10 s; one that
 * never parks is stuck in a request), checks the daemon's state: stat's
 * storages and keys agree with its listing, every storage is named by a key
 * or held, /dev/shm holds one segment per storage and the recycling pool's
 * files td_stat_get counts. A client the chaos loop
 * killed just before is cleaned up in the background, so the checks are
 * retried for up to 5 s before they count. Leaves the clients running. */
static void check_state(const char *when) {
  atomic_store(&sh->hold, 1);
  uint64_t deadline = bench_now_ns() + 10000000000ull;
  uint32_t want = 0, got = 0;
  for (;;) {
    want = 0;
    for (unsigned i = 0; i < cfg.clients; i++)
      want += slots[i].pid > 0 && !slots[i].killed;
    for (int r = 0; r < REPLACERS; r++)
      want += replacer[r] > 0;
    got = atomic_load(&sh->parked);
    if (got >= want || bench_now_ns() > deadline)
      break;
    sleep_ms(5);
  }
  if (got < want) {
    violation("%s: %u of %u client(s) did not come back from a request "
              "within 10 s",
              when, want - got, want);
    atomic_store(&sh->hold, 0);
    return;
  }
  listing l = {0};
  char why[256] = "";
  deadline = bench_now_ns() + 5000000000ull;
  for (;;) {
    int err = td_stat_get(coord, &cur);
    if (err == 0)
      err = list_all(&l);
    if (err < 0) {
      unexpected("coordinator: %s: stat/list: %s: %s", when, td_err_name(err),
                 td_last_error(coord));
      break;
    }
    uint64_t keys = 0, bare = 0, bare_id = 0;
    for (size_t i = 0; i < l.n; i++) {
      keys += l.v[i].nkeys_total;
      if (l.v[i].nkeys_total == 0 && l.v[i].holders == 0 && !bare++)
        bare_id = l.v[i].id;
    }
    unsigned segs = count_files(0), pooled = count_files(1);
    why[0] = '\0';
    if (cur.storages != l.n || segs != l.n)
      snprintf(why, sizeof(why),
               "td_stat_get counts %" PRIu64 " storage(s), td_list %zu, "
               "/dev/shm %u segment(s)",
               cur.storages, l.n, segs);
    else if (cur.keys != keys)
      snprintf(why, sizeof(why),
               "td_stat_get counts %" PRIu64 " key(s), td_list's storages "
               "%" PRIu64,
               cur.keys, keys);
    else if (pooled != cur.pool_segments)
      snprintf(why, sizeof(why),
               "td_stat_get counts %" PRIu64 " pooled segment(s), /dev/shm "
               "%u",
               cur.pool_segments, pooled);
    else if (bare)
      snprintf(why, sizeof(why),
               "%" PRIu64 " storage(s) neither named nor held (id %" PRIu64 ")",
               bare, bare_id);
    if (why[0] == '\0' || bench_now_ns() > deadline)
      break;
    sleep_ms(50);
  }
  if (why[0] != '\0')
    violation("%s, every client parked for 5 s: %s", when, why);
  listing_free(&l);
  atomic_store(&sh->hold, 0);
}

/* Runs cfg.upgrade_cmd (`tensord --upgrade`) under load; waits for the old
 * daemon to exit (0, where it is ours) and the new one to serve the same
 * instance, on the coordinator's own connection, which must see nothing;
 * then checks the durable keys and the daemon's state. */
static void upgrade_daemon(void) {
  pid_t old = cur.pid;
  uint64_t inst = cur.instance;
  char when[64];
  snprintf(when, sizeof(when), "after upgrade %" PRIu64, upgrades + 1);
  atomic_store(&sh->upgrading, 1);
  atomic_fetch_add(&sh->upgrade_gen, 1);
  uint64_t t0 = bench_now_ns();
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0)
    bench_die("fork: %s", strerror(errno));
  if (pid == 0) {
    execl(cfg.upgrade_cmd, cfg.upgrade_cmd, (char *)NULL);
    fprintf(stderr, "soak: running %s: %s\n", cfg.upgrade_cmd, strerror(errno));
    _exit(127);
  }
  for (;;) {
    int st;
    if (waitpid(pid, &st, WNOHANG) == pid)
      bench_die("%s (pid %d) ended with %s %d before it served; see "
                "tensord's log",
                cfg.upgrade_cmd, (int)pid,
                WIFSIGNALED(st) ? "signal" : "exit status",
                WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
    int err = td_stat_get(coord, &cur);
    if (err < 0) {
      unexpected("coordinator: stat across upgrade %" PRIu64 ": %s: %s",
                 upgrades + 1, td_err_name(err), td_last_error(coord));
      if (coord_connect(30) < 0)
        bench_die("tensord is gone: %s", td_last_error(NULL));
    }
    if (cur.pid == pid && pid_gone(old))
      break;
    if (bench_now_ns() - t0 > 30000000000ull)
      bench_die("upgrade %" PRIu64 ": after 30 s tensord pid %d serves, old "
                "pid %d %s; see tensord's log",
                upgrades + 1, (int)cur.pid, (int)old,
                pid_gone(old) ? "exited" : "runs on");
    sleep_ms(5);
  }
  uint64_t took = bench_now_ns() - t0;
  if (took > longest_upgrade_ns)
    longest_upgrade_ns = took;
  upgrades++;
  if (old == upgraded) { /* ours: it must have exited 0 */
    int st;
    if (waitpid(old, &st, 0) == old && !(WIFEXITED(st) && !WEXITSTATUS(st)))
      violation("%s: the old tensord (pid %d) ended with %s %d, not exit "
                "status 0",
                when, (int)old, WIFSIGNALED(st) ? "signal" : "exit status",
                WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
  }
  upgraded = pid;
  atomic_store(&sh->upgrading, 0);
  if (cur.instance != inst)
    violation("%s: tensord pid %d serves instance %016" PRIx64 ", not "
              "%016" PRIx64,
              when, (int)cur.pid, cur.instance, inst);
  if (check_durable(when, NULL) < 0)
    unexpected("coordinator: %s: lost the connection checking the durable "
               "keys: %s",
               when, td_last_error(coord));
  check_state(when);
}

/* The figures of the end-state table. */
static struct {
  int held_released; /* the daemon dropped every client's reference */
  uint64_t stray_holders, orphans;
  unsigned durable_ok, rw_ok;
  uint64_t keys_found, keys_stat, unknown_keys;
  uint64_t storages_named, storages_listed, storages_stat;
  uint64_t missing_from_list, missing_from_keys;
  unsigned segments;
  int segments_ok;
  unsigned pooled; /* files of the recycling pool */
  int pool_ok;
  int64_t rss_first, rss_last, rss_allowed;
  size_t rss_nfirst, rss_nlast;
  double rss_from;
  int rss_ok;
  int worst_life; /* with restarts: the life that grew most */
  int64_t life_first, life_last;
  size_t life_samples;
  uint64_t left_storages;
  unsigned left_segments;
  int cleanup_ok;
} end;

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static void final_checks(double run_s) {
  if (coord_connect(30) < 0)
    bench_die("cannot connect for the final checks: %s", td_last_error(NULL));
  /* 1. The daemon drops every reference of the clients gone. */
  listing l = {0};
  uint64_t deadline = bench_now_ns() + 15000000000ull;
  for (;;) {
    int err = td_stat_get(coord, &cur);
    if (err == 0)
      err = list_all(&l);
    if (err < 0)
      bench_die("final stat/list: %s", td_last_error(coord));
    uint64_t stray = 0;
    for (size_t i = 0; i < l.n; i++)
      stray += l.v[i].holders > 0;
    end.stray_holders = stray;
    if ((cur.clients == 1 && stray == 0) || bench_now_ns() > deadline)
      break;
    sleep_ms(50);
  }
  end.held_released = cur.clients == 1 && end.stray_holders == 0;
  if (!end.held_released) {
    for (size_t i = 0; i < l.n; i++)
      if (l.v[i].holders > 0) {
        violation("15 s after every client ended, storage %" PRIu64
                  " is still held by pid %d (%d holder(s), refs %u)",
                  l.v[i].id, (int)l.v[i].holder_pid, l.v[i].holders,
                  l.v[i].refs);
        break;
      }
    if (cur.clients != 1)
      violation("15 s after every client ended, tensord counts %" PRIu64
                " clients (the coordinator alone expected)",
                cur.clients);
  }

  /* 2. Durable keys, exactly; the replacer's as it last left them. */
  if (check_durable("at the end", &end.durable_ok) < 0)
    bench_die("lost the connection for the final checks");
  client me0 = {0};
  me0.c = coord;
  me0.slot = -1;
  for (unsigned i = 0; i < RW_KEYS; i++) {
    uint64_t got, acked = atomic_load(&sh->rw_acked[i]);
    uint64_t fly = atomic_load(&sh->rw_inflight[i]);
    if (rw_read(&me0, i, &got) < 0)
      bench_die("final lookup: %s", td_last_error(coord));
    if (got == acked || (fly != 0 && got == fly)) {
      end.rw_ok++;
    } else {
      char key[64], a[40], b[40];
      rw_key(i, key, sizeof(key));
      violation("at the end, '%s' is %s; the replacer left it %s", key,
                rw_state(got, a, sizeof(a)), rw_state(acked, b, sizeof(b)));
    }
  }

  /* 3. Every listed storage is named by a key; nobody holds one. */
  uint64_t sum_keys = 0;
  for (size_t i = 0; i < l.n; i++) {
    sum_keys += l.v[i].nkeys_total;
    if (l.v[i].nkeys_total == 0) {
      end.orphans++;
      violation("storage %" PRIu64 " is alive with no key naming it (refs "
                "%u, %d holder(s))",
                l.v[i].id, l.v[i].refs, l.v[i].holders);
    }
  }
  end.storages_listed = l.n;
  end.storages_stat = cur.storages;
  end.keys_stat = cur.keys;
  if (cur.storages != l.n)
    violation("td_stat_get says %" PRIu64 " storages, td_list lists %zu",
              cur.storages, l.n);
  if (sum_keys != cur.keys)
    violation("td_list's storages count %" PRIu64 " keys, td_stat_get %" PRIu64,
              sum_keys, cur.keys);

  /* 4. The keyspace resolves to exactly the listed storages, with the
   * bytes their creators wrote. */
  char **ks;
  size_t nk = keyspace(&ks);
  uint64_t *ids = malloc((nk + 1) * sizeof(*ids));
  size_t nids = 0;
  client me = {0};
  me.slot = -1;
  me.uid = geteuid();
  me.gid = getegid();
  me.c = coord;
  me.inst = cur.instance;
  me.rng = 1;
  for (size_t i = 0; i < nk; i++) {
    td_storage *s;
    td_view v;
    int err = td_lookup(coord, ks[i], TD_RDONLY, 0, &s, &v);
    if (err == TD_ENOENT)
      continue;
    if (err < 0) {
      unexpected("final lookup of '%s': %s", ks[i], td_last_error(coord));
      continue;
    }
    end.keys_found++;
    char what[96];
    snprintf(what, sizeof(what), "final lookup '%s'", ks[i]);
    if (strncmp(ks[i], "durable/", 8) != 0)
      check_handle(&me, s, &v, 1, 4, what);
    ids[nids++] = td_storage_id(s);
    td_storage_release(s);
  }
  qsort(ids, nids, sizeof(*ids), cmp_u64);
  size_t u = 0;
  for (size_t i = 0; i < nids; i++)
    if (i == 0 || ids[i] != ids[i - 1])
      ids[u++] = ids[i];
  end.storages_named = u;
  for (size_t i = 0; i < l.n; i++) {
    uint64_t *hit = bsearch(&l.v[i].id, ids, u, sizeof(*ids), cmp_u64);
    if (hit == NULL) {
      end.missing_from_keys++;
      if (l.v[i].nkeys_total > 0)
        violation("storage %" PRIu64 " is named by %zu key(s) outside the "
                  "keyspace",
                  l.v[i].id, l.v[i].nkeys_total);
    }
  }
  for (size_t i = 0; i < u; i++) {
    int in = 0;
    for (size_t j = 0; j < l.n && !in; j++)
      in = l.v[j].id == ids[i];
    if (!in) {
      end.missing_from_list++;
      violation("a key names storage %" PRIu64 ", which td_list does not "
                "show",
                ids[i]);
    }
  }
  end.unknown_keys = cur.keys > end.keys_found ? cur.keys - end.keys_found : 0;
  if (end.keys_found != cur.keys)
    violation("the keyspace resolves %" PRIu64
              " keys; td_stat_get counts %" PRIu64,
              end.keys_found, cur.keys);

  /* 5. /dev/shm holds exactly those segments (unlinks run on the daemon's
   * thread pool: give them a moment). */
  deadline = bench_now_ns() + 5000000000ull;
  do {
    end.segments = count_files(0);
    if (end.segments == cur.storages)
      break;
    sleep_ms(50);
  } while (bench_now_ns() < deadline);
  end.segments_ok = end.segments == cur.storages;
  if (!end.segments_ok)
    violation("/dev/shm holds %u segment(s) of this run's instances; tensord "
              "has %" PRIu64 " storage(s)",
              end.segments, cur.storages);
  /* 5b. The recycling pool: within its bound, and its files are the ones
   * td_stat_get counts (pools of daemons killed before are swept by the
   * start after them). */
  end.pooled = count_files(1);
  end.pool_ok = end.pooled == cur.pool_segments &&
                cur.pool_bytes <= cur.pool_limit;
  if (!end.pool_ok)
    violation("the recycling pool: %u file(s) in /dev/shm, td_stat_get counts "
              "%" PRIu64 " segment(s) of %" PRIu64 " bytes, bound %" PRIu64,
              end.pooled, cur.pool_segments, cur.pool_bytes, cur.pool_limit);

  /* 6. RSS: the first and the last minute (20% of a shorter run). With
   * restarts, each daemon process is judged on its own life, first 20% of
   * its samples against the last 20%: a restarted daemon's RSS depends on
   * the journal it replayed, so processes are not compared. A live upgrade
   * starts no new life: the new daemon serves what the old one had, so its
   * RSS is judged against the old one's (a leak in the handover shows). */
  double w = run_s >= 300 ? 60 : run_s * 0.2;
  end.rss_from = w;
  end.rss_first = rss_median(0, w, &end.rss_nfirst);
  end.rss_last = rss_median(run_s - w, run_s + 1, &end.rss_nlast);
  end.rss_allowed = rss_allow(end.rss_first);
  if (lives == 0) {
    end.rss_ok = end.rss_first > 0 && end.rss_last > 0 &&
                 end.rss_last <= end.rss_allowed;
    if (!end.rss_ok)
      violation("tensord's RSS grew from %" PRId64 " KiB (median of the "
                "first %.0f s) to %" PRId64 " KiB (of the last), more than "
                "the %" PRId64 " KiB allowed",
                end.rss_first / 1024, w, end.rss_last / 1024,
                end.rss_allowed / 1024);
  } else {
    end.rss_ok = 1;
    end.worst_life = -1;
    for (unsigned life = 0; life <= lives; life++) {
      int64_t *v = malloc((nrss + 1) * sizeof(*v));
      size_t n = 0;
      for (size_t k = 0; v != NULL && k < nrss; k++)
        if (rss[k].life == life)
          v[n++] = rss[k].rss;
      if (n >= 5) {
        size_t q = n / 5;
        int64_t a = v[q / 2], b = v[n - q + q / 2];
        if (end.worst_life < 0 || b - a > end.life_last - end.life_first) {
          end.worst_life = (int)life;
          end.life_first = a;
          end.life_last = b;
          end.life_samples = n;
        }
        if (b > rss_allow(a)) {
          end.rss_ok = 0;
          violation(
              "tensord's RSS grew from %" PRId64 " KiB to %" PRId64
              " KiB during its life %u (%zu samples), more than the %" PRId64
              " KiB allowed",
              a / 1024, b / 1024, life, n, rss_allow(a) / 1024);
        }
      }
      free(v);
    }
  }

  /* 7. Clean up: unpublish everything; the daemon unlinks it all. */
  for (size_t i = 0; i < nk; i++) {
    int err = td_unpublish(coord, ks[i]);
    if (err < 0 && err != TD_ENOENT)
      unexpected("unpublish '%s' at the end: %s", ks[i], td_last_error(coord));
  }
  if (list_all(&l) == 0)
    for (size_t i = 0; i < l.nkeys; i++)
      td_unpublish(coord, l.keys[i]);
  deadline = bench_now_ns() + 10000000000ull;
  for (;;) {
    if (td_stat_get(coord, &cur) < 0)
      bench_die("stat after the clean-up: %s", td_last_error(coord));
    end.left_storages = cur.storages;
    end.left_segments = count_files(0);
    if ((end.left_storages == 0 && end.left_segments == 0) ||
        bench_now_ns() > deadline)
      break;
    sleep_ms(50);
  }
  end.cleanup_ok = end.left_storages == 0 && end.left_segments == 0;
  if (!end.cleanup_ok)
    violation("after unpublishing every key, tensord has %" PRIu64
              " storage(s) and /dev/shm %u segment(s) of this run",
              end.left_storages, end.left_segments);
  for (size_t i = 0; i < nk; i++)
    free(ks[i]);
  free(ks);
  free(ids);
  listing_free(&l);
}

/* ---- the report ---- */

static uint64_t sum_err(int op, _Atomic uint64_t (*m)[NERR]) {
  uint64_t n = 0;
  for (int e = 0; e < NERR; e++)
    n += atomic_load(&m[op][e]);
  return n;
}

static void report(double run_s) {
  uint64_t total_ok = 0, total_err = 0;
  printf("\n%-20s %12s %12s %12s\n", "operation", "ok", "errors", "unexpected");
  for (int op = 0; op < OP_COUNT; op++) {
    uint64_t ok = atomic_load(&sh->ok[op]), e = sum_err(op, sh->err),
             x = sum_err(op, sh->unexpected);
    total_ok += ok;
    total_err += e;
    printf("%-20s %12" PRIu64 " %12" PRIu64 " %12" PRIu64 "\n", op_name[op], ok,
           e, x);
  }
  printf("%-20s %12" PRIu64 " %12" PRIu64 "   (%.0f ops/s)\n", "all", total_ok,
         total_err, (double)(total_ok + total_err) / run_s);

  printf("\n%-14s %10s %10s  %s\n", "error", "count", "unexpected",
         "by operation");
  for (int e = 1; e < NERR; e++) {
    uint64_t n = 0, x = 0;
    for (int op = 0; op < OP_COUNT; op++) {
      n += atomic_load(&sh->err[op][e]);
      x += atomic_load(&sh->unexpected[op][e]);
    }
    if (n == 0)
      continue;
    char by[512] = "";
    size_t len = 0;
    for (int op = 0; op < OP_COUNT && len < sizeof(by) - 40; op++) {
      uint64_t c = atomic_load(&sh->err[op][e]);
      if (c)
        len += (size_t)snprintf(by + len, sizeof(by) - len, "%s%s %" PRIu64,
                                len ? ", " : "", op_name[op], c);
    }
    printf("%-14s %10" PRIu64 " %10" PRIu64 "  %s\n",
           e == NERR - 1 ? "(other)" : td_err_name(-e), n, x, by);
  }

  printf("\n%s\n", "chaos");
  printf("  %-32s %" PRIu64 "\n", "client processes spawned", spawned);
  printf("  %-32s %" PRIu64 "\n", "clients SIGKILLed (survived)",
         killed_clients);
  printf("  %-32s %" PRIu64 "\n", "clients that died by themselves",
         client_crashes);
  printf("  %-32s %" PRIu64 "%s\n", "daemon SIGKILLs and restarts", restarts,
         cfg.restart ? "" : " (--restart not given)");
  if (restarts)
    printf("  %-32s %.0f ms\n", "longest outage (kill to serving)",
           (double)longest_outage_ns / 1e6);
  printf("  %-32s %" PRIu64 "%s\n", "live upgrades", upgrades,
         cfg.upgrade_cmd ? "" : " (--upgrade not given)");
  if (upgrades)
    printf("  %-32s %.0f ms\n", "longest upgrade (start to serving)",
           (double)longest_upgrade_ns / 1e6);
  printf("  %-32s %.0f ms across an upgrade, %.0f ms otherwise\n",
         "longest client operation",
         (double)atomic_load(&sh->op_max_upgrade_ns) / 1e6,
         (double)atomic_load(&sh->op_max_ns) / 1e6);
  printf("  %-32s %" PRIu64 "\n", "connections lost",
         atomic_load(&sh->conn_lost));
  printf("  %-32s %" PRIu64 "\n", "reconnects", atomic_load(&sh->reconnects));
  printf("  %-32s %" PRIu64 "\n", "rw changes in flight at a break",
         atomic_load(&sh->rw_lost));
  printf("  %-32s %u\n", "daemon instances seen", nseen);

  uint64_t bytes = atomic_load(&sh->bytes_verified);
  printf("\n%s\n", "invariants");
  printf("  %-32s %" PRIu64 " (%.2f GiB)\n", "payloads verified",
         atomic_load(&sh->reads_verified), (double)bytes / (1u << 30));
  printf("  %-32s %" PRIu64 "\n", "read-only mprotect probes",
         atomic_load(&sh->mprotect_probes));
  printf("  %-32s %" PRIu64 "\n", "violations", atomic_load(&sh->violations));
  printf("  %-32s %" PRIu64 "\n", "unexpected errors",
         atomic_load(&sh->unexpected_total));

  printf("\n%s\n", "end state");
  printf("  %-32s %s\n", "client references dropped",
         end.held_released ? "yes" : "NO");
  printf("  %-32s %u of %u, exact bytes\n", "durable keys", end.durable_ok,
         cfg.durable);
  printf("  %-32s %u of %u as last acknowledged\n",
         "replaced keys (durable-rw)", end.rw_ok, RW_KEYS);
  printf("  %-32s %" PRIu64 " (td_stat_get: %" PRIu64 "; outside the "
         "keyspace: %" PRIu64 ")\n",
         "live keys resolved", end.keys_found, end.keys_stat, end.unknown_keys);
  printf("  %-32s named %" PRIu64 ", listed %" PRIu64 ", td_stat_get %" PRIu64
         "; listed, not named: %" PRIu64 "; named, not listed: %" PRIu64 "\n",
         "storages", end.storages_named, end.storages_listed, end.storages_stat,
         end.missing_from_keys, end.missing_from_list);
  printf("  %-32s %" PRIu64 " / %" PRIu64 "\n", "orphans / held by a client",
         end.orphans, end.stray_holders);
  printf("  %-32s %u (%u instance(s))%s\n", "/dev/shm segments", end.segments,
         nseen, end.segments_ok ? "" : "  MISMATCH");
  printf("  %-32s %u file(s); td_stat_get %" PRIu64 " segment(s), %" PRIu64
         " of %" PRIu64 " bytes; %" PRIu64 " hit(s), %" PRIu64 " miss(es)%s\n",
         "recycling pool", end.pooled, cur.pool_segments, cur.pool_bytes,
         cur.pool_limit, cur.pool_hits, cur.pool_misses,
         end.pool_ok ? "" : "  MISMATCH");
  printf("  %-32s %.1f MiB (first %.0f s, %zu samples) -> %.1f MiB (last "
         "%.0f s, %zu samples); allowed %.1f MiB (+25%% or +4 MiB, the "
         "larger)%s\n",
         "tensord RSS, median", (double)end.rss_first / MIB, end.rss_from,
         end.rss_nfirst, (double)end.rss_last / MIB, end.rss_from,
         end.rss_nlast, (double)end.rss_allowed / MIB,
         lives        ? "; not judged across restarts"
         : end.rss_ok ? ""
                      : "  GREW");
  if (lives && end.worst_life >= 0)
    printf("  %-32s life %d of %u grew most: %.1f MiB -> %.1f MiB "
           "(first and last 20%% of its %zu samples; allowed %.1f MiB)%s\n",
           "tensord RSS, per daemon process", end.worst_life, lives + 1,
           (double)end.life_first / MIB, (double)end.life_last / MIB,
           end.life_samples, (double)rss_allow(end.life_first) / MIB,
           end.rss_ok ? "" : "  GREW");
  /* The course of it, in ten steps, to tell a leak from a warm-up. */
  char course[256] = "";
  size_t len = 0;
  for (int k = 0; k < 10 && nrss > 0; k++) {
    const rss_sample *r = &rss[(nrss - 1) * (size_t)k / 9];
    len += (size_t)snprintf(course + len, sizeof(course) - len, "%s%.1f",
                            k ? " " : "", (double)r->rss / MIB);
  }
  printf("  %-32s %s MiB\n", "tensord RSS through the run", course);
  printf("  %-32s %" PRIu64 " storage(s), %u segment(s) left\n",
         "after unpublishing everything", end.left_storages, end.left_segments);

  uint32_t nm = atomic_load(&sh->nmsgs);
  if (nm > 0) {
    printf("\nfirst %u of %u violation / unexpected messages:\n",
           nm < MAX_MSGS ? nm : MAX_MSGS, nm);
    for (uint32_t i = 0; i < nm && i < MAX_MSGS; i++)
      printf("  %s\n", sh->msgs[i]);
  }
}

static void usage(FILE *f) {
  fprintf(f, "usage: soak [OPTION]... SOCKET\n"
             "\n"
             "Drives the tensord at SOCKET with many client processes, kills\n"
             "them at random, checks invariants; exits 0 only if they held.\n"
             "Run as root, so that a quarter of the clients can run as uids\n"
             "4242-4244. Meant for tests/soak/run.sh (make soak).\n"
             "\n"
             "  --seconds N         how long (default 300)\n"
             "  --clients N         client processes (default 256)\n"
             "  --keys N            keys soak/0..N-1 (default 1024)\n"
             "  --durable N         durable keys (default 32)\n"
             "  --sleep MIN,MAX     ms a client sleeps between operations\n"
             "                      (default 1,20)\n"
             "  --kill-every MS     mean ms between client SIGKILLs (default\n"
             "                      250; 0: none)\n"
             "  --restart           SIGKILL the daemon every ~15 s; something\n"
             "                      must start it again (run.sh does)\n"
             "  --restart-every S   seconds between daemon kills (default 15)\n"
             "  --upgrade CMD       run CMD (tensord --upgrade with the\n"
             "                      daemon's options; run.sh makes one) every\n"
             "                      ~6 s under load; clients must notice\n"
             "                      nothing. Goes with --restart\n"
             "  --upgrade-every S   seconds between upgrades (default 6)\n"
             "  --seed N            random seed (default: $TDT_SEED, else from\n"
             "                      the time)\n"
             "  --instances-file F  append each daemon instance seen to F\n"
             "\n"
             "Environment: TDT_SEED fixes the seed; SOAK_CRIPPLE=N makes N of\n"
             "every 1000 client operations fail (ENOENT), to check that such\n"
             "a run fails the floor.\n");
}

static unsigned parse_u(const char *opt, const char *s, unsigned min,
                        unsigned max) {
  char *rest;
  errno = 0;
  unsigned long v = strtoul(s, &rest, 10);
  if (*s == '\0' || *rest != '\0' || errno || v < min || v > max)
    bench_die("%s '%s': not a number from %u to %u", opt, s, min, max);
  return (unsigned)v;
}

int main(int argc, char **argv) {
  enum {
    O_SECONDS = 256,
    O_CLIENTS,
    O_KEYS,
    O_DURABLE,
    O_SLEEP,
    O_KILL,
    O_RESTART,
    O_RESTART_EVERY,
    O_SEED,
    O_INSTANCES,
    O_UPGRADE,
    O_UPGRADE_EVERY,
  };
  static const struct option opts[] = {
      {"seconds", required_argument, NULL, O_SECONDS},
      {"clients", required_argument, NULL, O_CLIENTS},
      {"keys", required_argument, NULL, O_KEYS},
      {"durable", required_argument, NULL, O_DURABLE},
      {"sleep", required_argument, NULL, O_SLEEP},
      {"kill-every", required_argument, NULL, O_KILL},
      {"restart", no_argument, NULL, O_RESTART},
      {"restart-every", required_argument, NULL, O_RESTART_EVERY},
      {"seed", required_argument, NULL, O_SEED},
      {"instances-file", required_argument, NULL, O_INSTANCES},
      {"upgrade", required_argument, NULL, O_UPGRADE},
      {"upgrade-every", required_argument, NULL, O_UPGRADE_EVERY},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  bench_init("soak");
  coordinator = getpid();
  int ch, seed_given = 0;
  while ((ch = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
    switch (ch) {
    case O_SECONDS:
      cfg.seconds = parse_u("--seconds", optarg, 5, 7 * 24 * 3600);
      break;
    case O_CLIENTS:
      cfg.clients = parse_u("--clients", optarg, 1, 4096);
      break;
    case O_KEYS:
      cfg.keys = parse_u("--keys", optarg, HOT_KEYS, 1u << 20);
      break;
    case O_DURABLE:
      cfg.durable = parse_u("--durable", optarg, 1, 4096);
      break;
    case O_SLEEP: {
      unsigned a, b;
      if (sscanf(optarg, "%u,%u", &a, &b) != 2 || a > b || b > 10000)
        bench_die("--sleep '%s': use MIN,MAX in ms", optarg);
      cfg.sleep_min_ms = a;
      cfg.sleep_max_ms = b;
      break;
    }
    case O_KILL:
      cfg.kill_every_ms = parse_u("--kill-every", optarg, 0, 3600000);
      break;
    case O_RESTART:
      cfg.restart = 1;
      break;
    case O_RESTART_EVERY:
      cfg.restart_every_s = parse_u("--restart-every", optarg, 2, 3600);
      break;
    case O_SEED:
      cfg.seed = strtoull(optarg, NULL, 0);
      seed_given = 1;
      break;
    case O_INSTANCES:
      cfg.instances_file = optarg;
      break;
    case O_UPGRADE:
      if (access(optarg, X_OK) < 0)
        bench_die("--upgrade '%s': %s (a program that starts `tensord "
                  "--upgrade`)",
                  optarg, strerror(errno));
      cfg.upgrade_cmd = optarg;
      break;
    case O_UPGRADE_EVERY:
      cfg.upgrade_every_s = parse_u("--upgrade-every", optarg, 2, 3600);
      break;
    case 'h':
      usage(stdout);
      return 0;
    default:
      usage(stderr);
      return 2;
    }
  }
  if (optind != argc - 1) {
    usage(stderr);
    return 2;
  }
  cfg.sock = argv[optind];
  if (!seed_given)
    cfg.seed = tdt_seed("soak");
  const char *cripple = getenv("SOAK_CRIPPLE");
  if (cripple != NULL && cripple[0] != '\0')
    cfg.cripple = parse_u("SOAK_CRIPPLE", cripple, 0, 1000);
  signal(SIGPIPE, SIG_IGN);

  sh = bench_shared(sizeof(*sh));
  slots = calloc(cfg.clients, sizeof(*slots));
  if (slots == NULL)
    bench_die("out of memory");
  int err = coord_connect(10);
  if (err < 0)
    bench_die("connect to %s: %s", cfg.sock, td_last_error(NULL));
  unsigned others = geteuid() == 0 ? cfg.clients / 4 : 0;
  char chaos[128] = "";
  size_t cl = 0;
  if (cfg.restart)
    cl += (size_t)snprintf(chaos, sizeof(chaos),
                           ", tensord SIGKILLed every ~%u s",
                           cfg.restart_every_s);
  if (cfg.upgrade_cmd)
    snprintf(chaos + cl, sizeof(chaos) - cl,
             ", tensord upgraded live every ~%u s", cfg.upgrade_every_s);
  printf("soak: %u s, %u clients (%u of them as uids %u-%u), sleeping "
         "%u-%u ms between operations, keys soak/0..%u, %u durable; a client "
         "SIGKILLed every ~%u ms%s; seed %" PRIu64 "\n",
         cfg.seconds, cfg.clients, others, (unsigned)other_uid[0],
         (unsigned)other_uid[NUIDS - 1], cfg.sleep_min_ms, cfg.sleep_max_ms,
         cfg.keys - 1, cfg.durable, cfg.kill_every_ms, chaos, cfg.seed);
  printf("soak: tensord %s, pid %d, instance %016" PRIx64 ", state dir %s\n",
         cur.version, (int)cur.pid, cur.instance,
         cur.state_dir[0] ? cur.state_dir : "(none)");
  if (geteuid() != 0)
    printf("soak: not root: every client runs as uid %u, so the checks "
           "across uids are not made\n",
           (unsigned)geteuid());
  if (cfg.restart && cur.state_dir[0] == '\0')
    bench_die("--restart needs a tensord with --state-dir");
  if (cur.keys != 0 || cur.storages != 0)
    bench_die("tensord already has %" PRIu64 " key(s) and %" PRIu64
              " storage(s); soak wants a fresh one",
              cur.keys, cur.storages);
  publish_durable();

  uint64_t t0 = bench_now_ns();
  uint64_t end_ns = t0 + (uint64_t)cfg.seconds * 1000000000u;
  uint64_t rng = splitmix(cfg.seed) | 1;
#define CRND() (rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17, rng)
  for (unsigned i = 0; i < RW_KEYS; i++)
    atomic_store(&sh->rw_acked[i], RW_ABSENT);
  for (int r = 0; r < REPLACERS; r++)
    replacer[r] = bench_fork(replacer_main, (void *)(intptr_t)r);
  for (unsigned i = 0; i < cfg.clients; i++)
    spawn((int)i);
  uint64_t next_kill =
      t0 +
      (cfg.kill_every_ms ? CRND() % (2ull * cfg.kill_every_ms) : 0) * 1000000u;
  uint64_t next_restart =
      t0 + (uint64_t)cfg.restart_every_s * (700 + CRND() % 600) * 1000000u;
  uint64_t next_rss = t0, next_durable = t0 + 5000000000ull;
  uint64_t restart_window_end = 0;
  uint64_t next_upgrade =
      t0 + (uint64_t)cfg.upgrade_every_s * (700 + CRND() % 600) * 1000000u;

  for (;;) {
    uint64_t now = bench_now_ns();
    if (now >= end_ns)
      break;
    reap(1);
    if (restart_window_end && now > restart_window_end) {
      atomic_store(&sh->restarting, 0);
      restart_window_end = 0;
    }
    if (cfg.kill_every_ms && now >= next_kill) {
      unsigned i = (unsigned)(CRND() % cfg.clients);
      if (slots[i].pid > 0 && !slots[i].killed &&
          kill(slots[i].pid, SIGKILL) == 0) {
        slots[i].killed = 1;
        killed_clients++;
      }
      next_kill = now + (CRND() % (2ull * cfg.kill_every_ms)) * 1000000u;
    }
    if (cfg.restart && now >= next_restart && end_ns - now > 5000000000ull) {
      restart_daemon();
      /* Connection failures stay expected a little longer: clients notice
       * the restart only at their next call. */
      restart_window_end = bench_now_ns() + 2000000000ull;
      next_restart = bench_now_ns() + (uint64_t)cfg.restart_every_s *
                                          (700 + CRND() % 600) * 1000000u;
    }
    /* Not while connection errors are allowed after a restart: every
     * upgrade is judged strictly. */
    if (cfg.upgrade_cmd && now >= next_upgrade && !restart_window_end &&
        end_ns - now > 3000000000ull) {
      upgrade_daemon();
      next_upgrade = bench_now_ns() + (uint64_t)cfg.upgrade_every_s *
                                          (700 + CRND() % 600) * 1000000u;
    }
    if (now >= next_rss) {
      sample_rss(t0);
      next_rss += 1000000000u;
    }
    if (now >= next_durable) {
      int e = check_durable("periodic check", NULL);
      if (e == 0)
        e = td_stat_get(coord, &cur);
      if (e < 0) {
        if (!(is_conn_err(e) &&
              (instance_killed(cur.instance) || atomic_load(&sh->restarting))))
          unexpected("coordinator: %s: %s", td_err_name(e),
                     td_last_error(coord));
        uint64_t was = cur.instance;
        if (coord_connect(30) < 0)
          bench_die("tensord is gone: %s", td_last_error(NULL));
        if (cur.instance != was && !instance_killed(was)) {
          unrelated_restarts++;
          violation("tensord restarted without soak killing it (instance "
                    "%016" PRIx64 " -> %016" PRIx64 ")",
                    was, cur.instance);
        }
      }
      next_durable = now + 5000000000ull;
    }
    sleep_ms(10);
  }
  double run_s = (double)(bench_now_ns() - t0) / 1e9;
  sample_rss(t0);

  /* Stop: ask the clients to finish, then SIGKILL whoever lingers. */
  atomic_store(&sh->stop, 1);
  uint64_t deadline = bench_now_ns() + 10000000000ull;
  unsigned live;
  for (;;) {
    reap(0);
    live = 0;
    for (unsigned i = 0; i < cfg.clients; i++)
      live += slots[i].pid > 0;
    for (int r = 0; r < REPLACERS; r++)
      live += replacer[r] > 0;
    if (live == 0 || bench_now_ns() > deadline)
      break;
    sleep_ms(20);
  }
  if (live > 0) {
    printf("soak: %u client(s) still running 10 s after the stop; killing "
           "them\n",
           live);
    for (unsigned i = 0; i < cfg.clients; i++)
      if (slots[i].pid > 0) {
        slots[i].killed = 1;
        kill(slots[i].pid, SIGKILL);
      }
    for (int r = 0; r < REPLACERS; r++)
      if (replacer[r] > 0)
        kill(replacer[r], SIGKILL); /* a hang: reap counts it */
    while (reap(0) > 0 || waitpid(-1, NULL, 0) > 0)
      ;
  }
  atomic_store(&sh->restarting, 0);

  final_checks(run_s);
  report(run_s);

  char why[256] = "";
  size_t n = 0;
#define WHY(...)                                                               \
  n += (size_t)snprintf(why + n, n < sizeof(why) ? sizeof(why) - n : 0,        \
                        __VA_ARGS__)
  uint64_t v = atomic_load(&sh->violations),
           x = atomic_load(&sh->unexpected_total);
  /* The floor, on what the clients did: enough verified reads, not too
   * many (allowed) errors. */
  uint64_t ops = atomic_load(&sh->client_ops);
  uint64_t allowed = atomic_load(&sh->client_allowed);
  uint64_t reads = atomic_load(&sh->client_reads);
  double reads_min = FLOOR_READS * cfg.clients * run_s;
  double err_frac = ops ? (double)allowed / (double)ops : 1.0;
  printf("\nsoak: floor: the clients verified %" PRIu64 " payloads, %.0f "
         "needed (%.1f per client per second); %.1f%% of their %" PRIu64
         " requests failed with allowed errors, %.0f%% at most%s\n",
         reads, reads_min, FLOOR_READS, 100 * err_frac, ops,
         100 * MAX_ALLOWED_ERR, cfg.cripple ? " (SOAK_CRIPPLE is set)" : "");
  if ((double)reads < reads_min)
    WHY("%s%" PRIu64 " payloads verified, under the floor of %.0f",
        n ? ", " : "", reads, reads_min);
  if (err_frac > MAX_ALLOWED_ERR)
    WHY("%s%.1f%% of the clients' requests failed, more than %.0f%%",
        n ? ", " : "", 100 * err_frac, 100 * MAX_ALLOWED_ERR);
  if (v)
    WHY("%s%" PRIu64 " invariant violation(s)", n ? ", " : "", v);
  if (x)
    WHY("%s%" PRIu64 " unexpected error(s)", n ? ", " : "", x);
  if (!end.rss_ok)
    WHY("%sRSS grew", n ? ", " : "");
  if (!end.cleanup_ok)
    WHY("%sclean-up left storages", n ? ", " : "");
  td_close(coord);
  char ups[160] = "";
  if (cfg.upgrade_cmd)
    snprintf(ups, sizeof(ups),
             "; %" PRIu64 " live upgrade(s), the longest client operation "
             "%.0f ms across one, %.0f ms otherwise",
             upgrades, (double)atomic_load(&sh->op_max_upgrade_ns) / 1e6,
             (double)atomic_load(&sh->op_max_ns) / 1e6);
  if (n == 0) {
    printf("soak: PASS%s\n", ups);
    return 0;
  }
  printf("soak: FAIL (%s)%s\n", why, ups);
  return 1;
}
