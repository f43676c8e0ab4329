/* oracle.c: fuzz_request's oracle (see oracle.h): replays what the clients
 * sent through its own framing and a model of the registry, and checks the
 * replies against both. */
#include "oracle.h"
#include "view_sure.h"

#include "tensord.h"
#include "wire.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

/* Creates above this many bytes run on the daemon's thread pool (ops.c's
 * SYNC_BYTES_MAX): their replies may come after later requests'. */
#define POOL_BYTES (256u * 1024)
/* A create must succeed only with this much more free in /dev/shm than it
 * asks for: other processes use it too. */
#define SHM_MARGIN (64ull << 20)
/* Scopes one connection may have open (ops.c's TD__SCOPES_PER_CONN). */
#define SCOPES_PER_CONN 1024
/* A missing protocol-error reply is excused only if the client read this
 * much before it, or a cut frame after it: the daemon makes one attempt to
 * send it, and only a full socket stops that. */
#define FULL_SOCKET (64u << 10)

#define READ 04
#define WRITE 02

enum { EV_SENT, EV_SHUT, EV_PAUSED, EV_SETTLED };

typedef struct event {
  int type;
  int end;
  size_t upto; /* EV_SENT: the end's stream length after the send */
  int gone[OR_ENDS];
} event;

/* How many replies a handled request gets. */
enum { X_NONE, X_MUST, X_MAYBE };

/* One frame of a client's stream, or the point where the daemon must stop
 * reading it. */
typedef struct item {
  size_t at;             /* the daemon acts once it has this many bytes */
  Tensord__Request *req; /* NULL for a protocol error below the request */
  int cut;               /* a protocol error: the daemon answers and closes */
  uint64_t cut_seq;
  int cut_code;
  const char *cut_why;
  int handled;
  int expect;
  int ambiguous;            /* its reply cannot be told from others' */
  Tensord__Response *reply; /* the one matched to it, if any */
} item;

typedef struct mref {
  uint64_t id;
  uint32_t rw, ro;
} mref;

typedef struct oend {
  uint8_t *sent;
  size_t nsent, capsent;
  size_t fd_at; /* stream offset of the first fd sent, if has_fd */
  int has_fd;
  Tensord__Response **replies;
  size_t nreplies, capreplies, reply_bytes, partial;
  item *items;
  size_t nitems, capitems, next;
  int refused, paused, deaf, shut, gone, closed, truncated;
  size_t paused_at; /* stream offset when the daemon was seen paused */
  int muted;        /* it left its replies unread for a while */
  item *cut;        /* the protocol error in the stream, if any */
  oracle_peer peer;
  /* the model: what the connection holds */
  mref *refs;
  size_t nrefs, caprefs;
  uint32_t failed_pool; /* thread-pool creates that failed this segment */
  /* LookupManyReply frames before the one that ends their reply, in the
   * order they came: the reply is its last frame, and do_lookup_many reads
   * these from parts_next on. */
  Tensord__Response **parts;
  size_t nparts, capparts, parts_next;
  int watching;   /* a Watch succeeded: every request but Release is EBUSY */
  int may_watch;  /* it sent a Watch the model let through */
  size_t nevents; /* Event frames it got (not replies: never matched) */
} oend;

typedef struct mstorage {
  uint64_t id, nbytes;
  uid_t uid;
  gid_t gid;
  uint32_t mode;
  uint64_t refs; /* holders' references plus one per key */
  int unsettled; /* created on the thread pool this segment */
  int live;
} mstorage;

typedef struct mkey {
  const ProtobufCBinaryData *name; /* in the request that published it */
  uint64_t id;
  uint64_t scope; /* the scope it goes with, or 0 */
  td_view view;
  int view_known;
  int live;
} mkey;

/* A scope: its keys go when its connection ends it or goes. */
typedef struct mscope {
  uint64_t token;
  int end; /* the connection that opened it */
  int live;
} mscope;

typedef struct mwaiter {
  int end;
  size_t item;
  int live;
} mwaiter;

typedef struct pool_item {
  int end;
  size_t item;
} pool_item;

typedef struct pool_charge {
  uid_t uid;
  uint64_t n;
} pool_charge;

static struct {
  oracle_setup s;
  oend e[OR_ENDS];
  event *ev;
  size_t nev, capev;
  mstorage *st;
  size_t nst, capst;
  mkey *keys;
  size_t nkeys, capkeys;
  mscope *sc;
  size_t nsc, capsc;
  mwaiter *w;
  size_t nw, capw;
  pool_charge *failed; /* failed thread-pool creates of this segment */
  size_t nfailed, capfailed;
  pool_item *pool; /* thread-pool creates of this segment */
  size_t npool, cappool;
  uint64_t shm_free;
  int lost; /* the model no longer knows the daemon's state */
  unsigned checked;
} O;

#define FAIL(...) O.s.fail(__VA_ARGS__)

/* Grows *p (of *cap elements of size) to hold n + 1. */
static void *grow(void *p, size_t *cap, size_t n, size_t size) {
  if (n < *cap)
    return p;
  size_t c = *cap ? *cap * 2 : 16;
  void *q = realloc(p, c * size);
  if (q == NULL)
    FAIL("oracle: out of memory");
  *cap = c;
  return q;
}

#define PUSH(arr, n, cap)                                                      \
  ((arr) = grow((arr), &(cap), (n), sizeof(*(arr))), &(arr)[(n)++])

static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

static const char *body_name(const Tensord__Request *r) {
  const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(
      &tensord__request__descriptor, (unsigned)r->body_case);
  return f ? f->name : "(no body)";
}

/* "error EACCES: message" or "lookup" for a reply; "none" for NULL. */
static const char *reply_str(const Tensord__Response *r, char *buf,
                             size_t len) {
  if (r == NULL)
    return "no reply";
  if (r->body_case == TENSORD__RESPONSE__BODY_ERROR) {
    snprintf(buf, len, "error %s: %s", td_err_name(r->error->code),
             r->error->message);
    return buf;
  }
  const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(
      &tensord__response__descriptor, (unsigned)r->body_case);
  snprintf(buf, len, "%s", f ? f->name : "?");
  return buf;
}

static void lose(const char *why) {
  if (O.lost)
    return;
  O.lost = 1;
  if (O.s.verbose)
    fprintf(stderr, "fuzz_request: oracle: the model stops predicting: %s\n",
            why);
}

/* Whether e may miss replies: it stopped reading; the daemon drops
 * clients on a timer; its protocol error's reply did not fit the socket, or
 * may not have (it left replies unread, and a socket full of fd-carrying
 * replies takes no more, however few their bytes); or it sent an fd while
 * the daemon was not reading it (paused), so the read that brought the fd
 * may have brought requests before it too. */
static int lenient(const oend *e) {
  return e->deaf || O.s.timeouts || e->truncated || (e->muted && e->cut) ||
         (e->paused && e->has_fd && e->fd_at >= e->paused_at);
}

/* ---- recording ---- */

/* Frees what the oracle kept of the last input. */
static void reset(void) {
  for (int i = 0; i < OR_ENDS; i++) {
    oend *e = &O.e[i];
    free(e->sent);
    for (size_t j = 0; j < e->nreplies; j++)
      tensord__response__free_unpacked(e->replies[j], NULL);
    free(e->replies);
    for (size_t j = 0; j < e->nparts; j++)
      tensord__response__free_unpacked(e->parts[j], NULL);
    free(e->parts);
    for (size_t j = 0; j < e->nitems; j++)
      if (e->items[j].req)
        tensord__request__free_unpacked(e->items[j].req, NULL);
    free(e->items);
    free(e->refs);
  }
  free(O.ev);
  free(O.st);
  free(O.keys);
  free(O.sc);
  free(O.w);
  free(O.failed);
  free(O.pool);
  memset(&O, 0, sizeof(O));
}

void oracle_start(const oracle_setup *s) {
  reset();
  O.s = *s;
  for (int i = 0; i < s->nends; i++) {
    O.e[i].peer = s->peer[i];
    O.e[i].refused = s->refused[i];
  }
  struct statvfs sv;
  if (statvfs("/dev/shm", &sv) == 0)
    O.shm_free = (uint64_t)sv.f_bavail * sv.f_frsize;
}

void oracle_sent(int end, const uint8_t *p, size_t n, int fd) {
  oend *e = &O.e[end];
  if (fd && !e->has_fd) {
    e->has_fd = 1;
    e->fd_at = e->nsent;
  }
  if (e->nsent + n > e->capsent) {
    size_t c = e->capsent ? e->capsent : 4096;
    while (c < e->nsent + n)
      c *= 2;
    uint8_t *q = realloc(e->sent, c);
    if (q == NULL)
      FAIL("oracle: out of memory");
    e->sent = q;
    e->capsent = c;
  }
  memcpy(e->sent + e->nsent, p, n);
  e->nsent += n;
  event *v = PUSH(O.ev, O.nev, O.capev);
  memset(v, 0, sizeof(*v));
  v->type = EV_SENT;
  v->end = end;
  v->upto = e->nsent;
}

void oracle_reply(int end, Tensord__Response *r, size_t len) {
  oend *e = &O.e[end];
  if (r->body_case == TENSORD__RESPONSE__BODY_EVENT) {
    /* What happened, streamed to a watcher: no request's reply. */
    e->nevents++;
    e->reply_bytes += len + TD__FRAME_HDR;
    tensord__response__free_unpacked(r, NULL);
    return;
  }
  e->reply_bytes += len + TD__FRAME_HDR;
  if (r->body_case == TENSORD__RESPONSE__BODY_LOOKUP_MANY &&
      !r->lookup_many->last) {
    *PUSH(e->parts, e->nparts, e->capparts) = r;
    return;
  }
  *PUSH(e->replies, e->nreplies, e->capreplies) = r;
}

static void mark(int type, int end) {
  event *v = PUSH(O.ev, O.nev, O.capev);
  memset(v, 0, sizeof(*v));
  v->type = type;
  v->end = end;
}

void oracle_shut(int end) {
  mark(EV_SHUT, end);
}

void oracle_muted(int end) {
  O.e[end].muted = 1;
}

void oracle_paused(int end) {
  oend *e = &O.e[end];
  if (e->paused)
    return;
  e->paused = 1;
  e->paused_at = e->nsent;
  mark(EV_PAUSED, end);
}

/* A deaf client may miss any reply: it is judged leniently throughout. */
void oracle_deaf(int end) {
  O.e[end].deaf = 1;
}

void oracle_settled(const int gone[OR_ENDS]) {
  mark(EV_SETTLED, 0);
  memcpy(O.ev[O.nev - 1].gone, gone, sizeof(O.ev[0].gone));
}

void oracle_partial(int end, size_t len) {
  O.e[end].partial = len;
}

/* ---- the daemon's framing, replayed ---- */

static item *add_item(oend *e, size_t at, Tensord__Request *r) {
  item *it = PUSH(e->items, e->nitems, e->capitems);
  memset(it, 0, sizeof(*it));
  it->at = at;
  it->req = r;
  return it;
}

static void add_cut(oend *e, size_t at, Tensord__Request *r, int code,
                    const char *why) {
  item *it = add_item(e, at, r);
  it->cut = 1;
  it->cut_seq = r ? r->seq : 0;
  it->cut_code = code;
  it->cut_why = why;
  e->cut = it;
}

/* Splits e's stream into the requests the daemon handles, up to the first
 * protocol error. Bytes that reach the daemon after an fd are never read:
 * it hangs up on the fd. */
static void parse(oend *e) {
  size_t off = 0, fd_at = e->has_fd ? e->fd_at : SIZE_MAX;
  int hello = 0;
  while (e->nsent - off >= TD__FRAME_HDR) {
    const uint8_t *h = e->sent + off;
    size_t hend = off + TD__FRAME_HDR;
    if (hend > fd_at)
      break;
    uint32_t len = le32(h);
    if (h[6] != 'T' || h[7] != 'D' || h[5] != 0) {
      add_cut(e, hend, NULL, TD_EPROTO, "a bad frame header");
      return;
    }
    if (len > TD__FRAME_MAX) {
      add_cut(e, hend, NULL, TD_EMSGSIZE, "a frame over the limit");
      return;
    }
    if (h[4] > TD__FRAME_MAX_FDS) {
      add_cut(e, hend, NULL, TD_EPROTO, "a frame announcing > 4 fds");
      return;
    }
    size_t fend = hend + len;
    if (fend > e->nsent || fend > fd_at)
      break;
    if (h[4] > 0) {
      add_cut(e, fend, NULL, TD_EPROTO, "a frame whose fds never came");
      return;
    }
    Tensord__Request *r = tensord__request__unpack(NULL, len, h + 8);
    if (r == NULL) {
      add_cut(e, fend, NULL, TD_EPROTO, "a frame that does not decode");
      return;
    }
    if (!hello && r->body_case != TENSORD__REQUEST__BODY_HELLO) {
      add_cut(e, fend, r, TD_EPROTO, "a request before Hello");
      return;
    }
    if (r->body_case == TENSORD__REQUEST__BODY_HELLO) {
      if (hello) {
        add_cut(e, fend, r, TD_EPROTO, "a second Hello");
        return;
      }
      if (r->hello->version != TD_PROTOCOL_VERSION) {
        add_cut(e, fend, r, TD_EPROTONOSUPPORT, "a Hello of another version");
        return;
      }
      hello = 1;
    }
    add_item(e, fend, r);
    off = fend;
  }
  if (e->has_fd)
    add_cut(e, fd_at + 1, NULL, TD_EPROTO, "an fd sent to the daemon");
}

/* Whether r's reply comes before those of the requests after it. */
static int immediate(const Tensord__Request *r) {
  if (r->body_case == TENSORD__REQUEST__BODY_CREATE)
    return r->create->nbytes <= POOL_BYTES;
  if (r->body_case == TENSORD__REQUEST__BODY_LOOKUP)
    return r->lookup->wait_ms == 0 || r->lookup->wait_ms < -1;
  return 1;
}

/* Pairs e's replies with its requests by seq. The protocol error's reply
 * comes last. Requests sharing a seq are paired in order if all of them are
 * answered at once; otherwise none of them can be paired. */
static void match(oend *e) {
  size_t nr = e->nreplies;
  char b[256];
  if (e->cut != NULL) {
    item *c = e->cut;
    Tensord__Response *last = nr ? e->replies[nr - 1] : NULL;
    if (last && last->body_case == TENSORD__RESPONSE__BODY_ERROR &&
        last->seq == c->cut_seq && last->error->code == c->cut_code) {
      c->reply = last;
      nr--;
    } else if (e->partial > 0 || e->reply_bytes >= FULL_SOCKET) {
      e->truncated = 1; /* the daemon's one try could not send it */
    } else if (!lenient(e)) {
      FAIL("client %d: protocol error (%s) at byte %zu: the last reply is "
           "%s, not the %s Error (seq %llu) it calls for",
           (int)(e - O.e), c->cut_why, c->at, reply_str(last, b, sizeof(b)),
           td_err_name(c->cut_code), (unsigned long long)c->cut_seq);
    }
  }
  for (size_t i = 0; i < e->nitems; i++) {
    item *it = &e->items[i];
    if (it->req == NULL || it->cut || it->reply || it->ambiguous ||
        it->req->body_case == TENSORD__REQUEST__BODY_RELEASE)
      continue;
    uint64_t seq = it->req->seq;
    size_t k = 0, nrep = 0;
    int all_immediate = 1;
    for (size_t j = i; j < e->nitems; j++) {
      const item *o = &e->items[j];
      if (o->req && !o->cut && o->req->seq == seq &&
          o->req->body_case != TENSORD__REQUEST__BODY_RELEASE) {
        k++;
        all_immediate = all_immediate && immediate(o->req);
      }
    }
    for (size_t j = 0; j < nr; j++)
      nrep += e->replies[j]->seq == seq;
    int pair = k == 1 || (all_immediate && (nrep == k || !lenient(e)));
    size_t r = 0;
    for (size_t j = i; j < e->nitems; j++) {
      item *o = &e->items[j];
      if (!o->req || o->cut || o->req->seq != seq ||
          o->req->body_case == TENSORD__REQUEST__BODY_RELEASE)
        continue;
      if (!pair) {
        o->ambiguous = 1;
        continue;
      }
      while (r < nr && e->replies[r]->seq != seq)
        r++;
      o->reply = r < nr ? e->replies[r++] : NULL; /* NULL: none came */
    }
  }
}

/* ---- the model ---- */

/* Whether two byte strings are equal (protobuf-c leaves empty ones NULL). */
static int bytes_eq(const ProtobufCBinaryData *a,
                    const ProtobufCBinaryData *b) {
  return a->len == b->len &&
         (a->len == 0 || memcmp(a->data, b->data, a->len) == 0);
}

static mstorage *st_find(uint64_t id) {
  for (size_t i = 0; i < O.nst; i++)
    if (O.st[i].live && O.st[i].id == id)
      return &O.st[i];
  return NULL;
}

static mkey *key_find(const ProtobufCBinaryData *k) {
  for (size_t i = 0; i < O.nkeys; i++)
    if (O.keys[i].live && bytes_eq(O.keys[i].name, k))
      return &O.keys[i];
  return NULL;
}

static mref *ref_find(oend *e, uint64_t id) {
  for (size_t i = 0; i < e->nrefs; i++)
    if (e->refs[i].id == id)
      return &e->refs[i];
  return NULL;
}

/* A key the daemon surely accepts: 1-255 bytes of ASCII without NUL. */
static int key_sure(const ProtobufCBinaryData *k) {
  if (k->len == 0 || k->len > TD_KEY_MAX)
    return 0;
  for (size_t i = 0; i < k->len; i++)
    if (k->data[i] == 0 || k->data[i] >= 0x80)
      return 0;
  return 1;
}

/* Like a file: root may do anything; then the owner's bits, the group's
 * or the others'. */
static int may(const oend *e, const mstorage *s, int want) {
  const oracle_peer *p = &e->peer;
  if (p->uid == 0)
    return 1;
  unsigned bits;
  if (p->uid == s->uid) {
    bits = (s->mode >> 6) & 7;
  } else {
    int member = p->gid == s->gid;
    for (int i = 0; i < p->ngroups && !member; i++)
      member = p->groups[i] == s->gid;
    bits = member ? (s->mode >> 3) & 7 : s->mode & 7;
  }
  return (bits & (unsigned)want) == (unsigned)want;
}

/* Whether e may take a reference to storage id under
 * --max-storages-per-client, counting its creates in flight. */
static int under_limit(oend *e, uint64_t id) {
  uint32_t max = O.s.max_storages;
  if (max == 0 || (id != 0 && ref_find(e, id) != NULL))
    return 1;
  return e->nrefs + e->failed_pool < max;
}

/* Bytes charged, for uid (or everyone if all): live storages and the
 * thread-pool creates that failed this segment (charged until then). */
static uint64_t charged(uid_t uid, int all) {
  uint64_t n = 0;
  for (size_t i = 0; i < O.nst; i++)
    if (O.st[i].live && (all || O.st[i].uid == uid))
      n += O.st[i].nbytes;
  for (size_t i = 0; i < O.nfailed; i++)
    if (all || O.failed[i].uid == uid)
      n += O.failed[i].n;
  return n;
}

static void st_unref(mstorage *s, uint64_t n) {
  s->refs -= n;
  if (s->refs == 0)
    s->live = 0;
}

static void key_remove(mkey *k) {
  k->live = 0;
  mstorage *s = st_find(k->id);
  if (s != NULL)
    st_unref(s, 1);
}

static mscope *scope_find(uint64_t token) {
  for (size_t i = 0; i < O.nsc; i++)
    if (O.sc[i].live && O.sc[i].token == token)
      return &O.sc[i];
  return NULL;
}

/* Scopes connection end has open. */
static uint32_t scopes_of(int end) {
  uint32_t n = 0;
  for (size_t i = 0; i < O.nsc; i++)
    n += O.sc[i].live && O.sc[i].end == end;
  return n;
}

/* Ends sc: its keys go. Returns how many. */
static uint64_t scope_end(mscope *sc) {
  uint64_t n = 0;
  for (size_t i = 0; i < O.nkeys; i++)
    if (O.keys[i].live && O.keys[i].scope == sc->token) {
      key_remove(&O.keys[i]);
      n++;
    }
  sc->live = 0;
  return n;
}

/* Whether e may publish into scope token: it is open, the key is new, and
 * e runs as its owner's uid or as root. */
static int scope_lets(const oend *e, uint64_t token, const mkey *old) {
  const mscope *sc = scope_find(token);
  return sc != NULL && old == NULL &&
         (e->peer.uid == 0 || e->peer.uid == O.e[sc->end].peer.uid);
}

static void ref_add(oend *e, mstorage *s, int ro, uint32_t *had) {
  mref *r = ref_find(e, s->id);
  if (r == NULL) {
    r = PUSH(e->refs, e->nrefs, e->caprefs);
    memset(r, 0, sizeof(*r));
    r->id = s->id;
  }
  uint32_t *count = ro ? &r->ro : &r->rw;
  if (had)
    *had = *count;
  (*count)++;
  s->refs++;
}

static void ref_drop(oend *e, mref *r, int ro, uint32_t n) {
  mstorage *s = st_find(r->id);
  *(ro ? &r->ro : &r->rw) -= n;
  if (r->rw == 0 && r->ro == 0)
    *r = e->refs[--e->nrefs];
  if (s != NULL)
    st_unref(s, n);
}

/* The view a Publish sent, as the daemon keeps it; 0 if it has none the
 * model can write down. */
static int view_of(const Tensord__View *m, uint64_t nbytes, td_view *v) {
  if (fz_view_sure(m, nbytes, v))
    return 1;
  if (m == NULL || m->n_shape > TD_MAX_DIMS || m->n_stride != m->n_shape)
    return 0;
  v->dtype = (td_dtype)m->dtype;
  v->ndim = (int32_t)m->n_shape;
  v->offset = m->offset;
  for (size_t i = 0; i < m->n_shape; i++) {
    v->shape[i] = m->shape[i];
    v->stride[i] = m->stride[i];
  }
  return 1;
}

/* Describes request it of e for messages. */
static const char *what(const oend *e, const item *it, char *buf, size_t len) {
  snprintf(buf, len, "client %d: %s seq %llu (request ending at byte %zu)",
           (int)(e - O.e), body_name(it->req), (unsigned long long)it->req->seq,
           it->at);
  return buf;
}

static int is_error(const Tensord__Response *r);

/* A request the model said must succeed got rep (an error, or nothing the
 * right shape). */
static void refused(const oend *e, const item *it, const char *why) {
  char a[200], b[1200];
  /* With a short --io-timeout the daemon drops any client whose request
   * stalls, at a time the model cannot know: the storages only it held and
   * the keys of the scopes it owned go with it. A "no such storage or key"
   * then says nothing against the daemon. */
  if (O.s.timeouts && it->reply != NULL && is_error(it->reply) &&
      it->reply->error != NULL && it->reply->error->code == TD_ENOENT) {
    lose("a client the io timer dropped may have held what was asked for");
    return;
  }
  FAIL("%s must succeed (%s) but got %s", what(e, it, a, sizeof(a)), why,
       reply_str(it->reply, b, sizeof(b)));
}

static int is_error(const Tensord__Response *r) {
  return r->body_case == TENSORD__RESPONSE__BODY_ERROR;
}

/* What a successful lookup of key k did for e: checks the reply against
 * the model and applies it. */
static void looked_up(oend *e, const item *it, mkey *k, mstorage *s) {
  const Tensord__Lookup *m = it->req->lookup;
  const Tensord__LookupReply *lr = it->reply->lookup;
  const Tensord__StorageReply *sr = lr->storage;
  char a[200];
  uint32_t had = 0;
  mref *r = ref_find(e, s->id);
  if (r != NULL)
    had = m->readonly ? r->ro : r->rw;
  if (sr->id != s->id || sr->nbytes != s->nbytes ||
      sr->readonly != m->readonly ||
      (k->view_known && !fz_view_eq(&k->view, lr->view)))
    FAIL("%s: the reply names storage %llu (%llu bytes, %s); the key names "
         "storage %llu (%llu bytes)%s",
         what(e, it, a, sizeof(a)), (unsigned long long)sr->id,
         (unsigned long long)sr->nbytes,
         sr->readonly ? "read-only" : "read-write", (unsigned long long)s->id,
         (unsigned long long)s->nbytes,
         k->view_known && !fz_view_eq(&k->view, lr->view)
             ? ", with another view than published"
             : "");
  if ((int)sr->fd != (had == 0 || m->force_fd))
    FAIL("%s: fd %s; the client held %u %s reference(s)%s",
         what(e, it, a, sizeof(a)), sr->fd ? "sent" : "not sent", had,
         m->readonly ? "read-only" : "read-write",
         m->force_fd ? " and asked for one" : "");
  ref_add(e, s, m->readonly, NULL);
  if (m->take)
    key_remove(k);
}

/* Whether e's lookup of k must succeed. */
static int lookup_must(oend *e, const Tensord__Lookup *m, const mstorage *s) {
  int want = READ | (m->readonly && !m->take ? 0 : WRITE);
  return key_sure(&m->key) && !s->unsettled && may(e, s, want) &&
         under_limit(e, s->id);
}

/* Hands key k, just published, to the lookups waiting for it, in order,
 * until one takes it: what each got is in its reply. */
static void wake(const ProtobufCBinaryData *name) {
  for (size_t i = 0; i < O.nw && !O.lost; i++) {
    mwaiter *w = &O.w[i];
    oend *e = &O.e[w->end];
    item *it = &e->items[w->item];
    const Tensord__Lookup *m = it->req->lookup;
    if (!w->live || !bytes_eq(&m->key, name))
      continue;
    mkey *k = key_find(name);
    if (k == NULL)
      break; /* taken */
    mstorage *s = st_find(k->id);
    w->live = 0;
    it->expect = X_MUST;
    if (it->ambiguous || it->reply == NULL || s == NULL) {
      lose("a lookup woken by a publish has no reply to learn from");
      return;
    }
    char a[200];
    if (is_error(it->reply)) {
      if (it->reply->error->code == TD_ETIMEDOUT) {
        if (m->wait_ms == -1)
          FAIL("%s: waiting forever, it timed out", what(e, it, a, sizeof(a)));
        continue; /* it timed out before the publish */
      }
      O.checked++;
      if (lookup_must(e, m, s))
        refused(e, it, "woken: its key was published");
      continue;
    }
    if (it->reply->body_case != TENSORD__RESPONSE__BODY_LOOKUP)
      refused(e, it, "woken: a lookup is answered with a LookupReply");
    looked_up(e, it, k, s);
  }
}

/* Applies a successful create of e. */
static void created(oend *e, const item *it) {
  const Tensord__Create *m = it->req->create;
  const Tensord__StorageReply *sr = it->reply->storage;
  char a[200];
  if (sr->nbytes != m->nbytes || sr->readonly || !sr->fd ||
      st_find(sr->id) != NULL)
    FAIL("%s: got storage %llu of %llu bytes%s%s%s", what(e, it, a, sizeof(a)),
         (unsigned long long)sr->id, (unsigned long long)sr->nbytes,
         sr->readonly ? ", read-only" : "", sr->fd ? "" : ", without an fd",
         st_find(sr->id) ? ", an id already in use" : "");
  mstorage *s = PUSH(O.st, O.nst, O.capst);
  memset(s, 0, sizeof(*s));
  s->id = sr->id;
  s->nbytes = m->nbytes;
  s->uid = e->peer.uid;
  s->gid = e->peer.gid;
  s->mode = m->mode ? m->mode : 0600;
  s->unsettled = m->nbytes > POOL_BYTES;
  s->live = 1;
  ref_add(e, s, 0, NULL);
}

static void do_create(oend *e, item *it) {
  const Tensord__Create *m = it->req->create;
  uint64_t n = m->nbytes;
  int valid = n > 0 && m->device == TENSORD__DEVICE__DEVICE_CPU &&
              (m->mode & ~0666u) == 0;
  int pool = valid && n > POOL_BYTES;
  if (pool) {
    pool_item *p = PUSH(O.pool, O.npool, O.cappool);
    p->end = (int)(e - O.e);
    p->item = (size_t)(it - e->items);
  }
  if (O.lost)
    return;
  uint64_t all = charged(0, 1), mine = charged(e->peer.uid, 0);
  int must = valid && under_limit(e, 0) && n <= O.s.capacity &&
             all <= O.s.capacity - n &&
             (O.s.quota == 0 || (n <= O.s.quota && mine <= O.s.quota - n)) &&
             n + SHM_MARGIN <= O.shm_free;
  if (it->ambiguous || it->reply == NULL) {
    if (valid)
      lose("a create's outcome is unknown");
    return;
  }
  O.checked += must;
  if (is_error(it->reply)) {
    if (must)
      refused(e, it, "within capacity, quota and the storage limit");
    if (pool) {
      pool_charge *c = PUSH(O.failed, O.nfailed, O.capfailed);
      c->uid = e->peer.uid;
      c->n = n;
      e->failed_pool++;
    }
    return;
  }
  char a[200];
  if (!valid)
    FAIL("%s: created a storage, though the create is invalid",
         what(e, it, a, sizeof(a)));
  if (it->reply->body_case != TENSORD__RESPONSE__BODY_STORAGE)
    refused(e, it, "a create gets a StorageReply");
  created(e, it);
}

static void do_open(oend *e, item *it) {
  const Tensord__Open *m = it->req->open;
  if (O.lost)
    return;
  mstorage *s = st_find(m->id);
  int want = READ | (m->readonly ? 0 : WRITE);
  int must = s && !s->unsettled && may(e, s, want) && under_limit(e, m->id);
  if (it->ambiguous || it->reply == NULL) {
    lose("an open's outcome is unknown");
    return;
  }
  O.checked += must;
  char a[200];
  if (is_error(it->reply)) {
    if (must)
      refused(e, it, "the storage exists and the client may open it");
    return;
  }
  const Tensord__StorageReply *sr = it->reply->storage;
  if (it->reply->body_case != TENSORD__RESPONSE__BODY_STORAGE)
    refused(e, it, "an open gets a StorageReply");
  if (s == NULL)
    FAIL("%s: succeeded, yet the model has no storage %llu",
         what(e, it, a, sizeof(a)), (unsigned long long)m->id);
  mref *r = ref_find(e, s->id);
  uint32_t had = r ? (m->readonly ? r->ro : r->rw) : 0;
  if (sr->id != s->id || sr->nbytes != s->nbytes || sr->readonly != m->readonly)
    FAIL("%s: got storage %llu of %llu bytes (%s); it has %llu bytes",
         what(e, it, a, sizeof(a)), (unsigned long long)sr->id,
         (unsigned long long)sr->nbytes,
         sr->readonly ? "read-only" : "read-write",
         (unsigned long long)s->nbytes);
  if ((int)sr->fd != (had == 0 || m->force_fd))
    FAIL("%s: fd %s; the client held %u such reference(s)%s",
         what(e, it, a, sizeof(a)), sr->fd ? "sent" : "not sent", had,
         m->force_fd ? " and asked for one" : "");
  ref_add(e, s, m->readonly, NULL);
}

static void do_release(oend *e, const item *it) {
  const Tensord__Release *m = it->req->release;
  if (O.lost)
    return;
  mstorage *s = st_find(m->id);
  if (s != NULL && s->unsettled) {
    lose("a release races the create of its storage");
    return;
  }
  uint32_t n = m->count ? m->count : 1;
  mref *r = ref_find(e, m->id);
  if (r != NULL && (m->readonly ? r->ro : r->rw) >= n)
    ref_drop(e, r, m->readonly, n);
}

static void do_publish(oend *e, item *it) {
  const Tensord__Publish *m = it->req->publish;
  if (O.lost)
    return;
  mstorage *s = st_find(m->id);
  mref *r = ref_find(e, m->id);
  mkey *old = key_find(&m->key);
  mstorage *olds = old ? st_find(old->id) : NULL;
  td_view v;
  int held = s && r && r->rw > 0;
  int scoped = m->scope != 0;
  int must = key_sure(&m->key) && held && !s->unsettled &&
             fz_view_sure(m->view, s->nbytes, &v) &&
             (old == NULL || (olds && may(e, olds, WRITE))) &&
             (!scoped || scope_lets(e, m->scope, old));
  if (it->ambiguous || it->reply == NULL) {
    lose("a publish's outcome is unknown");
    return;
  }
  O.checked += must;
  char a[200];
  if (is_error(it->reply)) {
    if (must)
      refused(e, it,
              "the client holds the storage read-write, the key and "
              "view are valid");
    return;
  }
  if (it->reply->body_case != TENSORD__RESPONSE__BODY_OK)
    refused(e, it, "a publish gets Ok");
  if (!held && !(s && s->unsettled))
    FAIL("%s: published storage %llu, which the client does not hold "
         "read-write",
         what(e, it, a, sizeof(a)), (unsigned long long)m->id);
  if (scoped && !scope_lets(e, m->scope, old))
    FAIL("%s: published into scope %016llx, which %s",
         what(e, it, a, sizeof(a)), (unsigned long long)m->scope,
         scope_find(m->scope) == NULL ? "is not open"
         : old != NULL ? "a scoped publish may not do: the key exists"
                       : "belongs to another uid");
  if (s == NULL) {
    lose("a publish of a storage the model does not know");
    return;
  }
  mkey *k = PUSH(O.keys, O.nkeys, O.capkeys);
  memset(k, 0, sizeof(*k));
  k->name = &m->key;
  k->id = s->id;
  k->scope = m->scope;
  k->view_known = view_of(m->view, s->nbytes, &k->view);
  k->live = 1;
  s->refs++;
  if (old != NULL)
    key_remove(old);
  wake(&m->key);
}

static void do_lookup(oend *e, item *it) {
  const Tensord__Lookup *m = it->req->lookup;
  int waits = m->wait_ms != 0 && m->wait_ms >= -1;
  if (O.lost) {
    it->expect = waits ? X_MAYBE : X_MUST;
    return;
  }
  mkey *k = key_find(&m->key);
  char a[200];
  if (k == NULL) {
    int bad = m->key.len == 0 || m->key.len > TD_KEY_MAX ||
              memchr(m->key.data, 0, m->key.len) != NULL; /* len > 0 */
    if (waits && !bad) { /* it waits; a publish or its timer answers */
      it->expect = X_MAYBE;
      mwaiter *w = PUSH(O.w, O.nw, O.capw);
      w->end = (int)(e - O.e);
      w->item = (size_t)(it - e->items);
      w->live = 1;
      return;
    }
    if (it->reply != NULL && !it->ambiguous && !is_error(it->reply))
      FAIL("%s: found a key that is not published", what(e, it, a, sizeof(a)));
    return;
  }
  mstorage *s = st_find(k->id);
  if (s == NULL) {
    lose("a key whose storage the model lost");
    return;
  }
  int must = lookup_must(e, m, s);
  if (it->ambiguous || it->reply == NULL) {
    lose("a lookup's outcome is unknown");
    return;
  }
  O.checked += must;
  if (is_error(it->reply)) {
    if (must)
      refused(e, it, "the key is published and the client may have it");
    return;
  }
  if (it->reply->body_case != TENSORD__RESPONSE__BODY_LOOKUP)
    refused(e, it, "a lookup gets a LookupReply");
  looked_up(e, it, k, s);
}

/* The frame of it's LookupMany reply that begins at key i: the next part
 * of e if it is that, else the reply's last frame if it begins there; NULL
 * if neither does. */
static const Tensord__LookupManyReply *many_frame(oend *e, const item *it,
                                                  size_t i) {
  if (e->parts_next < e->nparts) {
    const Tensord__Response *p = e->parts[e->parts_next];
    if (p->seq == it->req->seq && p->lookup_many->first == i) {
      e->parts_next++;
      return p->lookup_many;
    }
  }
  const Tensord__LookupManyReply *last = it->reply->lookup_many;
  return last->first == i ? last : NULL;
}

/* Key name of m, answered with x: checks x against the model (what a
 * Lookup with wait 0 of that key must get) and applies it. */
static void many_key(oend *e, const item *it, size_t i,
                     const Tensord__LookupManyItem *x) {
  const Tensord__LookupMany *m = it->req->lookup_many;
  const ProtobufCBinaryData *name = &m->keys[i];
  char a[200];
  mkey *k = key_find(name);
  if (k == NULL) {
    if (x->code == 0)
      FAIL("%s: key %zu found, but it is not published",
           what(e, it, a, sizeof(a)), i);
    else if (key_sure(name) && x->code != TD_ENOENT)
      FAIL("%s: key %zu, not published, answered %s, not ENOENT",
           what(e, it, a, sizeof(a)), i, td_err_name(x->code));
    return;
  }
  mstorage *s = st_find(k->id);
  if (s == NULL) {
    lose("a key whose storage the model lost");
    return;
  }
  int want = READ | (m->readonly ? 0 : WRITE);
  int must = key_sure(name) && !s->unsettled && may(e, s, want) &&
             under_limit(e, s->id);
  O.checked += must;
  if (x->code != 0) {
    if (must)
      FAIL("%s: key %zu must be found (published, and the client may have "
           "it) but got %s: %s",
           what(e, it, a, sizeof(a)), i, td_err_name(x->code), x->message);
    return;
  }
  const Tensord__LookupReply *lr = x->lookup;
  const Tensord__StorageReply *sr = lr != NULL ? lr->storage : NULL;
  if (sr == NULL || lr->view == NULL) {
    FAIL("%s: key %zu found without its storage or view",
         what(e, it, a, sizeof(a)), i);
    return;
  }
  mref *r = ref_find(e, s->id);
  uint32_t had = r == NULL ? 0 : m->readonly ? r->ro : r->rw;
  if (sr->id != s->id || sr->nbytes != s->nbytes ||
      sr->readonly != m->readonly ||
      (k->view_known && !fz_view_eq(&k->view, lr->view)))
    FAIL("%s: key %zu: the reply names storage %llu (%llu bytes, %s); the "
         "key names storage %llu (%llu bytes)%s",
         what(e, it, a, sizeof(a)), i, (unsigned long long)sr->id,
         (unsigned long long)sr->nbytes,
         sr->readonly ? "read-only" : "read-write", (unsigned long long)s->id,
         (unsigned long long)s->nbytes,
         k->view_known && !fz_view_eq(&k->view, lr->view)
             ? ", with another view than published"
             : "");
  if ((int)sr->fd != (had == 0))
    FAIL("%s: key %zu: fd %s; the client held %u %s reference(s)",
         what(e, it, a, sizeof(a)), i, sr->fd ? "sent" : "not sent", had,
         m->readonly ? "read-only" : "read-write");
  ref_add(e, s, m->readonly, NULL);
}

/* A LookupMany: 1 to TD_LOOKUP_MANY_MAX keys answered item by item, in
 * order, across the reply's frames (the parts, then the last), each key as
 * a Lookup with wait 0 would be; anything else is EINVAL. */
static void do_lookup_many(oend *e, item *it) {
  const Tensord__LookupMany *m = it->req->lookup_many;
  char a[200], b[1200];
  if (O.lost)
    return;
  if (it->ambiguous || it->reply == NULL) {
    lose("a lookup_many's outcome is unknown");
    return;
  }
  if (m->n_keys == 0 || m->n_keys > TD_LOOKUP_MANY_MAX) {
    if (!is_error(it->reply) || it->reply->error->code != TD_EINVAL)
      FAIL("%s: %zu keys must be refused with EINVAL, not %s",
           what(e, it, a, sizeof(a)), m->n_keys,
           reply_str(it->reply, b, sizeof(b)));
    return;
  }
  O.checked++;
  if (it->reply->body_case != TENSORD__RESPONSE__BODY_LOOKUP_MANY) {
    refused(e, it, "1 to 65,536 keys are answered key by key");
    return;
  }
  const Tensord__LookupManyReply *fr = NULL;
  size_t fi = 0;
  for (size_t i = 0; i < m->n_keys && !O.lost; i++) {
    if (fr == NULL || fi == fr->n_items) {
      if (fr == it->reply->lookup_many || (fr = many_frame(e, it, i)) == NULL ||
          fr->n_items == 0) {
        FAIL("%s: no frame of the reply answers key %zu of %zu",
             what(e, it, a, sizeof(a)), i, m->n_keys);
        return;
      }
      fi = 0;
    }
    many_key(e, it, i, fr->items[fi++]);
  }
  if (!O.lost && (fr != it->reply->lookup_many || fi != fr->n_items))
    FAIL("%s: the reply answers more than its %zu keys",
         what(e, it, a, sizeof(a)), m->n_keys);
}

static void do_unpublish(oend *e, item *it) {
  const Tensord__Unpublish *m = it->req->unpublish;
  if (O.lost)
    return;
  mkey *k = key_find(&m->key);
  mstorage *s = k ? st_find(k->id) : NULL;
  int must = key_sure(&m->key) && s && may(e, s, WRITE);
  if (it->ambiguous || it->reply == NULL) {
    lose("an unpublish's outcome is unknown");
    return;
  }
  O.checked += must;
  char a[200];
  if (is_error(it->reply)) {
    if (must)
      refused(e, it, "the key is published and the client may write it");
    return;
  }
  if (it->reply->body_case != TENSORD__RESPONSE__BODY_OK)
    refused(e, it, "an unpublish gets Ok");
  if (k == NULL)
    FAIL("%s: removed a key that is not published", what(e, it, a, sizeof(a)));
  key_remove(k);
}

/* Opens a scope, or ends one the client owns (its keys go). */
static void do_scope(oend *e, item *it) {
  const Tensord__Scope *m = it->req->scope;
  if (O.lost)
    return;
  int end = (int)(e - O.e);
  mscope *sc = m->close ? scope_find(m->token) : NULL;
  int must = m->close ? sc != NULL && sc->end == end
                      : scopes_of(end) < SCOPES_PER_CONN;
  if (it->ambiguous || it->reply == NULL) {
    lose("a scope request's outcome is unknown");
    return;
  }
  O.checked += must;
  char a[200];
  if (is_error(it->reply)) {
    if (must)
      refused(e, it,
              m->close ? "the client owns the scope"
                       : "the client has fewer scopes open than the limit");
    return;
  }
  if (it->reply->body_case != TENSORD__RESPONSE__BODY_SCOPE)
    refused(e, it, "a scope request gets a ScopeReply");
  const Tensord__ScopeReply *r = it->reply->scope;
  if (m->close) {
    if (sc == NULL || sc->end != end)
      FAIL("%s: ended scope %016llx, which %s", what(e, it, a, sizeof(a)),
           (unsigned long long)m->token,
           sc == NULL ? "is not open" : "another client owns");
    uint64_t n = scope_end(sc);
    if (r->token != m->token || r->dropped != n)
      FAIL("%s: the reply names scope %016llx and %llu key(s) dropped; the "
           "model ended %016llx with %llu",
           what(e, it, a, sizeof(a)), (unsigned long long)r->token,
           (unsigned long long)r->dropped, (unsigned long long)m->token,
           (unsigned long long)n);
    return;
  }
  if (!must || r->token == 0 || scope_find(r->token) != NULL)
    FAIL("%s: opened scope %016llx%s", what(e, it, a, sizeof(a)),
         (unsigned long long)r->token,
         !must           ? " past the limit"
         : r->token == 0 ? ", a token that names none"
                         : ", a token already open");
  mscope *n = PUSH(O.sc, O.nsc, O.capsc);
  n->token = r->token;
  n->end = end;
  n->live = 1;
}

/* Channels (docs/channels.md): the model does not follow them. A refusal
 * changes nothing; a ChanCreate without slots and a ChanList change no
 * storage; anything else that succeeds moves references (slots, tickets),
 * and the model stops predicting. */
static void do_chan(oend *e, item *it) {
  (void)e;
  const Tensord__Request *q = it->req;
  const Tensord__Response *rep = it->reply;
  if (q->body_case == TENSORD__REQUEST__BODY_CHAN_CLOSE) {
    it->expect = X_NONE;
    return;
  }
  if (O.lost || it->ambiguous || rep == NULL || is_error(rep))
    return;
  if (q->body_case == TENSORD__REQUEST__BODY_CHAN_LIST ||
      (q->body_case == TENSORD__REQUEST__BODY_CHAN_CREATE &&
       q->chan_create->n_slots == 0) ||
      q->body_case == TENSORD__REQUEST__BODY_CHAN_OPEN)
    return;
  lose("a channel request moved references the model does not follow");
}

/* Requests that change nothing: only their reply is checked. */
static void do_query(oend *e, item *it) {
  const Tensord__Request *q = it->req;
  const Tensord__Response *rep = it->reply;
  if (O.lost || it->ambiguous || rep == NULL)
    return;
  int must = 1, want = 0;
  const mstorage *s = NULL;
  const mkey *k = NULL;
  switch (q->body_case) {
  case TENSORD__REQUEST__BODY_HELLO:
    want = TENSORD__RESPONSE__BODY_HELLO;
    break;
  case TENSORD__REQUEST__BODY_PING:
    want = TENSORD__RESPONSE__BODY_PONG;
    break;
  case TENSORD__REQUEST__BODY_STAT:
    want = TENSORD__RESPONSE__BODY_STAT;
    break;
  case TENSORD__REQUEST__BODY_LIST:
    want = TENSORD__RESPONSE__BODY_LIST;
    break;
  case TENSORD__REQUEST__BODY_METRICS:
    want = TENSORD__RESPONSE__BODY_METRICS;
    break;
  case TENSORD__REQUEST__BODY_INFO:
    want = TENSORD__RESPONSE__BODY_INFO;
    if (q->info->which_case == TENSORD__INFO__WHICH_KEY) {
      k = key_find(&q->info->key);
      s = k ? st_find(k->id) : NULL;
      must = key_sure(&q->info->key) && s != NULL;
    } else {
      s = st_find(q->info->id);
      must = s != NULL && !s->unsettled;
    }
    break;
  default: /* an operation this daemon does not know */
    if (!is_error(rep) || rep->error->code != TD_ENOSYS)
      refused(e, it, "an unknown operation is answered ENOSYS");
    return;
  }
  O.checked += must;
  if (!must)
    return;
  if ((int)rep->body_case != want)
    refused(e, it, "it always succeeds for a client past Hello");
  char a[200];
  int settled = O.npool == 0;
  switch (q->body_case) {
  case TENSORD__REQUEST__BODY_HELLO:
    if (rep->hello->version != TD_PROTOCOL_VERSION)
      FAIL("%s: HelloReply version %u", what(e, it, a, sizeof(a)),
           rep->hello->version);
    break;
  case TENSORD__REQUEST__BODY_PING:
    if (!bytes_eq(&rep->pong->payload, &q->ping->payload))
      FAIL("%s: the Pong carries another payload", what(e, it, a, sizeof(a)));
    break;
  case TENSORD__REQUEST__BODY_STAT: {
    uint64_t nst = 0, nk = 0;
    for (size_t i = 0; i < O.nst; i++)
      nst += O.st[i].live;
    for (size_t i = 0; i < O.nkeys; i++)
      nk += O.keys[i].live;
    if (settled && (rep->stat->storages != nst || rep->stat->keys != nk))
      FAIL("%s: says %llu storage(s) and %llu key(s); the model has %llu and "
           "%llu",
           what(e, it, a, sizeof(a)), (unsigned long long)rep->stat->storages,
           (unsigned long long)rep->stat->keys, (unsigned long long)nst,
           (unsigned long long)nk);
    break;
  }
  case TENSORD__REQUEST__BODY_INFO:
    if (rep->info->storage == NULL || rep->info->storage->id != s->id ||
        rep->info->storage->nbytes != s->nbytes)
      FAIL("%s: describes another storage than %llu", what(e, it, a, sizeof(a)),
           (unsigned long long)s->id);
    break;
  default:
    break;
  }
}

/* The daemon dropped e: its references go, its waiters are forgotten, and
 * its creates still on the thread pool may go unanswered. */
static void close_conn(oend *e) {
  if (e->closed)
    return;
  e->closed = 1;
  int end = (int)(e - O.e);
  while (e->nrefs > 0) {
    mref *r = &e->refs[0];
    uint32_t ro = r->ro;
    if (r->rw)
      ref_drop(e, r, 0, r->rw);
    if (ro)
      ref_drop(e, &e->refs[0], 1, ro);
  }
  for (size_t i = 0; i < O.nw; i++)
    if (O.w[i].live && O.w[i].end == end)
      O.w[i].live = 0;
  /* Its scopes end: keys still in flight to it go. */
  for (size_t i = 0; i < O.nsc; i++)
    if (O.sc[i].live && O.sc[i].end == end)
      scope_end(&O.sc[i]);
  for (size_t i = 0; i < O.npool; i++)
    if (O.pool[i].end == end)
      e->items[O.pool[i].item].expect = X_MAYBE;
}

/* A Watch: Ok, after which the connection is a watcher, or EINVAL for a
 * prefix no key can begin. */
static void do_watch(oend *e, item *it) {
  const Tensord__Watch *m = it->req->watch;
  int bad = m->prefix.len > TD_KEY_MAX ||
            (m->prefix.len > 0 && memchr(m->prefix.data, 0, m->prefix.len));
  if (!bad) {
    e->watching = 1;
    e->may_watch = 1;
  }
  const Tensord__Response *rep = it->reply;
  if (O.lost || it->ambiguous || rep == NULL)
    return;
  O.checked++;
  char a[200], b[1200];
  if (bad && (!is_error(rep) || rep->error->code != TD_EINVAL))
    FAIL("%s: a bad prefix must get EINVAL, got %s", what(e, it, a, sizeof(a)),
         reply_str(rep, b, sizeof(b)));
  if (!bad && rep->body_case != TENSORD__RESPONSE__BODY_OK)
    refused(e, it, "a Watch with a prefix a key may have gets Ok");
}

/* A request on a watching connection: EBUSY, and nothing changes. */
static void do_busy(oend *e, item *it) {
  const Tensord__Response *rep = it->reply;
  if (O.lost || it->ambiguous || rep == NULL)
    return;
  O.checked++;
  char a[200], b[1200];
  if (!is_error(rep) || rep->error->code != TD_EBUSY)
    FAIL("%s: a watching connection's request must get EBUSY, got %s",
         what(e, it, a, sizeof(a)), reply_str(rep, b, sizeof(b)));
}

static void handle(oend *e, item *it) {
  it->handled = 1;
  if (it->cut) {
    close_conn(e);
    return;
  }
  it->expect = X_MUST;
  if (e->watching && it->req->body_case != TENSORD__REQUEST__BODY_RELEASE) {
    do_busy(e, it);
    return;
  }
  switch (it->req->body_case) {
  case TENSORD__REQUEST__BODY_WATCH:
    do_watch(e, it);
    return;
  case TENSORD__REQUEST__BODY_CREATE:
    do_create(e, it);
    return;
  case TENSORD__REQUEST__BODY_OPEN:
    do_open(e, it);
    return;
  case TENSORD__REQUEST__BODY_RELEASE:
    it->expect = X_NONE;
    do_release(e, it);
    return;
  case TENSORD__REQUEST__BODY_PUBLISH:
    do_publish(e, it);
    return;
  case TENSORD__REQUEST__BODY_LOOKUP:
    do_lookup(e, it);
    return;
  case TENSORD__REQUEST__BODY_LOOKUP_MANY:
    do_lookup_many(e, it);
    return;
  case TENSORD__REQUEST__BODY_UNPUBLISH:
    do_unpublish(e, it);
    return;
  case TENSORD__REQUEST__BODY_SCOPE:
    do_scope(e, it);
    return;
  case TENSORD__REQUEST__BODY_CHAN_CREATE:
  case TENSORD__REQUEST__BODY_CHAN_OPEN:
  case TENSORD__REQUEST__BODY_CHAN_SLOT:
  case TENSORD__REQUEST__BODY_CHAN_CLOSE:
  case TENSORD__REQUEST__BODY_CHAN_PUT:
  case TENSORD__REQUEST__BODY_CHAN_TAKE:
  case TENSORD__REQUEST__BODY_CHAN_LIST:
    do_chan(e, it);
    return;
  default:
    do_query(e, it);
    return;
  }
}

/* The daemon has handled everything sent so far: check which connections
 * it dropped, and creates on the thread pool have finished. */
static void settled(const event *v) {
  for (int i = 0; i < O.s.nends; i++) {
    oend *e = &O.e[i];
    if (e->refused)
      continue;
    if (v->gone[i] && !e->gone) {
      e->gone = 1;
      if (!e->closed && !e->shut && !lenient(e))
        FAIL("client %d: the daemon dropped it after %zu byte(s) with no "
             "protocol error in them and before end of stream",
             i, e->nsent);
      if (!e->closed && !e->shut) {
        int waiting = 0;
        for (size_t j = 0; j < O.nw; j++)
          waiting |= O.w[j].live && O.w[j].end == i;
        if (e->nrefs > 0 || waiting || scopes_of(i) > 0)
          lose("a client dropped at a time the model cannot place");
      }
      close_conn(e);
    } else if (!v->gone[i] && e->closed && !e->paused && !lenient(e)) {
      FAIL("client %d: the daemon kept it open after a protocol error (%s) "
           "at byte %zu",
           i, e->cut ? e->cut->cut_why : "?", e->cut ? e->cut->at : 0);
    }
    e->failed_pool = 0;
  }
  for (size_t i = 0; i < O.nst; i++)
    O.st[i].unsettled = 0;
  O.nfailed = 0;
  O.npool = 0;
}

/* Every handled request got as many replies as it should; no reply names
 * a seq that no handled request has. */
static void count(oend *e) {
  int end = (int)(e - O.e);
  char b[1200];
  if (e->refused) {
    const Tensord__Response *r = e->nreplies ? e->replies[0] : NULL;
    if (e->nreplies > 1 || (e->nreplies == 0 && !lenient(e)) ||
        (r && (r->seq != 0 || !is_error(r) || r->error->code != TD_EUSERS)))
      FAIL("client %d, refused by --max-clients: %zu repl%s, the first %s", end,
           e->nreplies, e->nreplies == 1 ? "y" : "ies",
           reply_str(r, b, sizeof(b)));
    return;
  }
  if (e->nevents > 0 && !e->may_watch)
    FAIL("client %d: %zu event(s) on a connection that never watched", end,
         e->nevents);
  for (size_t i = 0; i < e->nitems + e->nreplies; i++) {
    uint64_t seq;
    if (i < e->nitems) {
      const item *it = &e->items[i];
      if (!it->handled)
        continue;
      seq = it->req ? it->req->seq : 0;
    } else {
      seq = e->replies[i - e->nitems]->seq;
    }
    /* Count each seq once: at its first handled request or reply. */
    int seen = 0;
    for (size_t j = 0; j < i && !seen; j++) {
      if (j < e->nitems)
        seen = e->items[j].handled &&
               (e->items[j].req ? e->items[j].req->seq : 0) == seq;
      else
        seen = e->replies[j - e->nitems]->seq == seq;
    }
    if (seen)
      continue;
    size_t must = 0, maybe = 0, got = 0;
    for (size_t j = 0; j < e->nitems; j++) {
      const item *it = &e->items[j];
      if (!it->handled || (it->req ? it->req->seq : 0) != seq)
        continue;
      int x = it->cut ? X_MUST : it->expect;
      must += x == X_MUST;
      maybe += x == X_MAYBE;
    }
    for (size_t j = 0; j < e->nreplies; j++)
      got += e->replies[j]->seq == seq;
    if (lenient(e)) {
      maybe += must;
      must = 0;
    }
    if (got < must || got > must + maybe) {
      const Tensord__Response *last = NULL;
      for (size_t j = 0; j < e->nreplies; j++)
        if (e->replies[j]->seq == seq)
          last = e->replies[j];
      FAIL("client %d: seq %llu: %zu repl%s (the last: %s) to %zu handled "
           "request(s) that must be answered and %zu that may be; %zu "
           "byte(s) sent%s%s",
           end, (unsigned long long)seq, got, got == 1 ? "y" : "ies",
           reply_str(last, b, sizeof(b)), must, maybe, e->nsent,
           e->cut ? ", the connection cut by " : "",
           e->cut ? e->cut->cut_why : "");
    }
  }
}

void oracle_finish(void) {
  for (int i = 0; i < O.s.nends; i++) {
    if (O.e[i].refused)
      continue;
    parse(&O.e[i]);
    match(&O.e[i]);
  }
  for (size_t i = 0; i < O.nev; i++) {
    const event *v = &O.ev[i];
    oend *e = &O.e[v->end];
    switch (v->type) {
    case EV_SENT:
      while (!e->refused && !e->gone && !e->closed && e->next < e->nitems &&
             e->items[e->next].at <= v->upto)
        handle(e, &e->items[e->next++]);
      break;
    case EV_SHUT:
      e->shut = 1;
      break;
    case EV_PAUSED:
      lose("the daemon stopped reading a client that leaves its replies "
           "unread: it handles that client's requests later than the model");
      break;
    case EV_SETTLED:
      settled(v);
      break;
    }
  }
  for (int i = 0; i < O.s.nends; i++) {
    count(&O.e[i]);
    if (!O.lost && !lenient(&O.e[i]) && O.e[i].parts_next < O.e[i].nparts)
      FAIL("client %d: %zu LookupManyReply frame(s) that no reply's last "
           "frame ends",
           i, O.e[i].nparts - O.e[i].parts_next);
  }
  if (O.s.verbose)
    fprintf(stderr,
            "fuzz_request: oracle: %u request(s) judged by the "
            "model%s\n",
            O.checked, O.lost ? " before it lost track" : "");
  reset();
}
