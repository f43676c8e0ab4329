/* registry.c: the bookkeeping of storages, per-connection references and
 * keys. A storage lives exactly while its count of references is non-zero.
 * Nothing here does I/O; the owner releases segments in free_fn. */
#include "registry.h"

#include "common.h"
#include "list.h"
#include "log.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int storage_eq(const td__hnode *n, const void *key) {
  return td__container_of(n, td__storage, node)->id == *(const uint64_t *)key;
}

static int ref_eq(const td__hnode *n, const void *key) {
  return td__container_of(n, td__ref, node)->storage->id ==
         *(const uint64_t *)key;
}

typedef struct {
  const char *s;
  size_t len;
} keyspan;

static int key_eq(const td__hnode *n, const void *key) {
  const td__key *k = td__container_of(n, td__key, node);
  const keyspan *ks = key;
  return k->len == ks->len && memcmp(k->name, ks->s, ks->len) == 0;
}

/* What one uid owns (bytes of storages, creates in flight included) and
 * has published (keys); there while either is non-zero. */
typedef struct td__usage {
  td__hnode node;
  uid_t uid;
  uint64_t bytes;
  uint64_t keys;
} td__usage;

static int usage_eq(const td__hnode *n, const void *key) {
  return td__container_of(n, td__usage, node)->uid == *(const uid_t *)key;
}

static td__usage *usage_find(const td__registry *r, uid_t uid) {
  td__hnode *n = td__htab_find(&r->usage, td__hash_u64(uid), usage_eq, &uid);
  return n ? td__container_of(n, td__usage, node) : NULL;
}

/* uid's entry, made if need be. Returns NULL if out of memory. */
static td__usage *usage_get(td__registry *r, uid_t uid) {
  td__usage *u = usage_find(r, uid);
  if (u != NULL)
    return u;
  u = calloc(1, sizeof(*u));
  if (u == NULL)
    return NULL;
  u->uid = uid;
  if (td__htab_insert(&r->usage, &u->node, td__hash_u64(uid)) < 0) {
    free(u);
    return NULL;
  }
  return u;
}

/* Frees u once it counts nothing. */
static void usage_put(td__registry *r, td__usage *u) {
  if (u->bytes == 0 && u->keys == 0) {
    td__htab_remove(&r->usage, &u->node);
    free(u);
  }
}

uint64_t td__usage_of(const td__registry *r, uid_t uid) {
  td__usage *u = usage_find(r, uid);
  return u ? u->bytes : 0;
}

uint64_t td__keys_of(const td__registry *r, uid_t uid) {
  td__usage *u = usage_find(r, uid);
  return u ? u->keys : 0;
}

void td__usage_each(const td__registry *r, td__usage_fn fn, void *arg) {
  for (size_t b = 0; b < r->usage.nbuckets; b++)
    for (const td__hnode *n = r->usage.buckets[b]; n != NULL; n = n->next) {
      const td__usage *u = td__container_of(n, td__usage, node);
      fn(u->uid, u->bytes, u->keys, arg);
    }
}

int td__charge(td__registry *r, uid_t uid, uint64_t n, int force, char *msg,
               size_t len) {
  char a[32], b[32], c[32];
  uint64_t committed = r->bytes_committed;
  if (!force && (n > r->capacity || committed > r->capacity - n)) {
    uint64_t avail = committed < r->capacity ? r->capacity - committed : 0;
    return td__msg(msg, len, TD_ENOMEM,
                   "%s (%llu bytes) exceeds capacity: %s (%llu bytes) free "
                   "of %s",
                   td__human_bytes(n, a, sizeof(a)), (unsigned long long)n,
                   td__human_bytes(avail, b, sizeof(b)),
                   (unsigned long long)avail,
                   td__human_bytes(r->capacity, c, sizeof(c)));
  }
  td__usage *u = usage_find(r, uid);
  uint64_t used = u ? u->bytes : 0;
  if (!force && r->quota && (n > r->quota || used > r->quota - n))
    return td__msg(msg, len, TD_EDQUOT,
                   "%s (%llu bytes) exceeds the quota of uid %u: it owns %s "
                   "(%llu bytes) of %s",
                   td__human_bytes(n, a, sizeof(a)), (unsigned long long)n,
                   (unsigned)uid, td__human_bytes(used, b, sizeof(b)),
                   (unsigned long long)used,
                   td__human_bytes(r->quota, c, sizeof(c)));
  if (u == NULL && (u = usage_get(r, uid)) == NULL)
    return td__msg(msg, len, TD_ENOMEM, "out of memory");
  u->bytes += n;
  r->bytes_committed += n;
  return 0;
}

void td__credit(td__registry *r, uid_t uid, uint64_t n) {
  td__usage *u = usage_find(r, uid);
  r->bytes_committed -= n;
  if (u == NULL)
    return;
  u->bytes -= n;
  usage_put(r, u);
}

void td__registry_init(td__registry *r, uint64_t capacity,
                       td__storage_free_fn fn, void *arg) {
  memset(r, 0, sizeof(*r));
  td__htab_init(&r->storages);
  td__htab_init(&r->keys);
  td__htab_init(&r->scopes);
  td__htab_init(&r->usage);
  r->next_id = 1;
  r->capacity = capacity;
  r->free_fn = fn;
  r->free_arg = arg;
}

/* Drops one reference of s; the last one unregisters it and hands it to
 * free_fn. */
static void storage_unref(td__registry *r, td__storage *s) {
  if (--s->refs > 0)
    return;
  td__storage_remove(r, s);
  td__credit(r, s->owner.uid, td__host_bytes(s));
  r->free_fn(s, r->free_arg);
}

void td__registry_drop_keys(td__registry *r) {
  for (td__storage *s = r->first, *next; s != NULL; s = next) {
    /* Removing s's last key may free s; take the next one first. A storage
     * has at most its own keys, so s->next survives. */
    next = s->next;
    while (s->keys != NULL) {
      td__key *k = s->keys;
      int last = s->refs == 1;
      td__key_remove(r, k);
      if (last)
        break;
    }
  }
}

/* Frees t and its every entry, each malloc'd with its node at offset off. */
static void free_entries(td__htab *t, size_t off) {
  for (size_t i = 0; i < t->nbuckets; i++) {
    for (td__hnode *n = t->buckets[i], *next; n != NULL; n = next) {
      next = n->next;
      free((char *)n - off);
    }
  }
  td__htab_free(t);
}

void td__registry_free(td__registry *r) {
  td__registry_drop_keys(r);
  /* Scopes their connections did not end (a stop): their keys are gone. */
  free_entries(&r->scopes, offsetof(td__scope, node));
  td__htab_free(&r->storages);
  td__htab_free(&r->keys);
  /* Creates still in flight find no entry and credit only the total. */
  free_entries(&r->usage, offsetof(td__usage, node));
}

td__storage *td__storage_find(const td__registry *r, uint64_t id) {
  td__hnode *n = td__htab_find(&r->storages, td__hash_u64(id), storage_eq, &id);
  return n ? td__container_of(n, td__storage, node) : NULL;
}

int td__storage_insert(td__registry *r, td__storage *s, td__holdings *h) {
  s->refs = 0;
  s->holders = NULL;
  s->keys = NULL;
  int err = td__htab_insert(&r->storages, &s->node, td__hash_u64(s->id));
  if (err < 0)
    return err;
  err = h ? td__ref_add(r, h, s, 0, NULL) : 0;
  if (err < 0) {
    td__htab_remove(&r->storages, &s->node);
    return err;
  }
  /* Ids only grow, so appending keeps the list in id order. */
  TD__LIST_APPEND(&r->first, &r->last, s, prev, next);
  r->bytes_used += td__host_bytes(s);
  return 0;
}

void td__storage_remove(td__registry *r, td__storage *s) {
  td__htab_remove(&r->storages, &s->node);
  TD__LIST_REMOVE_TAIL(&r->first, &r->last, s, prev, next);
  r->bytes_used -= td__host_bytes(s);
}

td__storage *td__storage_after(const td__registry *r, uint64_t after_id) {
  if (after_id == 0)
    return r->first;
  if (r->last == NULL || r->last->id <= after_id)
    return NULL;
  td__storage *s = td__storage_find(r, after_id);
  if (s != NULL)
    return s->next;
  /* after_id is gone (freed while a listing paged past it). Where storages
   * live, ids are dense: look up the next few ids, then ids further and
   * further on; from the first found (or the last storage), walk back over
   * those between. The cost grows with how far on the next storage is and
   * with what this page lists, not with the registry: a walk from either end
   * made paging through a registry under churn quadratic. */
  uint64_t span = r->last->id - after_id;
  for (uint64_t d = 1; d < span && s == NULL; d = d < 16 ? d + 1 : d * 2)
    s = td__storage_find(r, after_id + d);
  if (s == NULL)
    s = r->last;
  while (s->prev != NULL && s->prev->id > after_id)
    s = s->prev;
  return s;
}

void td__holdings_init(td__holdings *h, const td__peer *peer) {
  td__htab_init(&h->refs);
  h->peer = *peer;
  h->nrefs = 0;
  h->ngroups = 0;
  h->groups = NULL;
  h->name = "";
  h->events = NULL;
}

td__ref *td__ref_find(const td__holdings *h, uint64_t id) {
  td__hnode *n = td__htab_find(&h->refs, td__hash_u64(id), ref_eq, &id);
  return n ? td__container_of(n, td__ref, node) : NULL;
}

int td__ref_add(td__registry *r, td__holdings *h, td__storage *s, int ro,
                uint32_t *had) {
  td__ref *ref = td__ref_find(h, s->id);
  if (s->refs == UINT32_MAX ||
      (ref != NULL && (ro ? ref->ro : ref->rw) == UINT32_MAX))
    return TD_EOVERFLOW;
  if (ref == NULL) {
    ref = calloc(1, sizeof(*ref));
    if (ref == NULL)
      return TD_ENOMEM;
    ref->storage = s;
    ref->peer = &h->peer;
    if (td__htab_insert(&h->refs, &ref->node, td__hash_u64(s->id)) < 0) {
      free(ref);
      return TD_ENOMEM;
    }
    if (h->nrefs == 0)
      r->nholdings++;
    TD__LIST_PUSH(&s->holders, ref, sprev, snext);
  }
  uint32_t *count = ro ? &ref->ro : &ref->rw;
  if (had)
    *had = *count;
  (*count)++;
  h->nrefs++;
  s->refs++;
  return 0;
}

int td__ref_restore(td__registry *r, td__holdings *h, td__storage *s,
                    uint32_t rw, uint32_t ro) {
  uint64_t add = (uint64_t)rw + ro;
  if (add == 0)
    return 0;
  if (td__ref_find(h, s->id) != NULL || s->refs + add > UINT32_MAX)
    return TD_EOVERFLOW;
  uint32_t had;
  int err = td__ref_add(r, h, s, rw == 0, &had);
  if (err < 0)
    return err;
  td__ref *ref = td__ref_find(h, s->id);
  ref->rw = rw;
  ref->ro = ro;
  h->nrefs += add - 1;
  s->refs += (uint32_t)(add - 1);
  return 0;
}

/* Unlinks ref from its storage and its holdings and frees it. */
static void ref_free(td__registry *r, td__holdings *h, td__ref *ref) {
  td__storage *s = ref->storage;
  td__htab_remove(&h->refs, &ref->node);
  TD__LIST_REMOVE(&s->holders, ref, sprev, snext);
  free(ref);
  if (h->nrefs == 0)
    r->nholdings--;
}

int td__ref_drop(td__registry *r, td__holdings *h, uint64_t id, int ro,
                 uint32_t count) {
  td__ref *ref = td__ref_find(h, id);
  if (ref == NULL || count == 0)
    return TD_ENOENT;
  uint32_t *held = ro ? &ref->ro : &ref->rw;
  if (*held < count)
    return TD_ENOENT;
  td__storage *s = ref->storage;
  *held -= count;
  h->nrefs -= count;
  if (ref->rw == 0 && ref->ro == 0)
    ref_free(r, h, ref);
  /* Keep s registered until the last of these drops. */
  s->refs -= count - 1;
  storage_unref(r, s);
  return 0;
}

size_t td__holdings_clear_some(td__registry *r, td__holdings *h, size_t max) {
  td__holdings_drop_events(h); /* no key may point at h once it goes */
  for (size_t i = 0; i < max; i++) {
    td__hnode *n = td__htab_any(&h->refs);
    if (n == NULL)
      break;
    td__ref *ref = td__container_of(n, td__ref, node);
    uint32_t count = ref->rw + ref->ro;
    td__storage *s = ref->storage;
    h->nrefs -= count;
    ref_free(r, h, ref);
    s->refs -= count - 1;
    storage_unref(r, s);
  }
  if (h->refs.count == 0)
    td__htab_free(&h->refs);
  return h->refs.count;
}

void td__holdings_clear(td__registry *r, td__holdings *h) {
  td__holdings_clear_some(r, h, SIZE_MAX);
}

int td__may_mode(uint32_t mode, const td__peer *owner, const td__holdings *h,
                 int want) {
  if (h->peer.uid == 0)
    return 0;
  unsigned bits;
  if (h->peer.uid == owner->uid) {
    bits = (mode >> 6) & 7;
  } else {
    int member = h->peer.gid == owner->gid;
    for (int i = 0; i < h->ngroups && !member; i++)
      member = h->groups[i] == owner->gid;
    bits = member ? (mode >> 3) & 7 : mode & 7;
  }
  return (bits & (unsigned)want) == (unsigned)want ? 0 : TD_EACCES;
}

int td__may(const td__storage *s, const td__holdings *h, int want) {
  return td__may_mode(s->mode, &s->owner, h, want);
}

char *td__describe_access(const td__storage *s, char *buf, size_t len) {
  snprintf(buf, len, "mode %04o, owner uid %u gid %u", (unsigned)s->mode,
           (unsigned)s->owner.uid, (unsigned)s->owner.gid);
  return buf;
}

td__key *td__key_find(const td__registry *r, const char *key, size_t len) {
  keyspan ks = {key, len};
  td__hnode *n = td__htab_find(&r->keys, td__hash_bytes(key, len), key_eq, &ks);
  return n ? td__container_of(n, td__key, node) : NULL;
}

static void key_link(td__storage *s, td__key *k) {
  k->storage = s;
  TD__LIST_PUSH(&s->keys, k, sprev, snext);
  s->refs++;
}

static void scope_link(td__scope *sc, td__key *k) {
  k->scope = sc;
  TD__LIST_PUSH(&sc->keys, k, cprev, cnext);
  sc->nkeys++;
}

static void scope_unlink(td__key *k) {
  td__scope *sc = k->scope;
  TD__LIST_REMOVE(&sc->keys, k, cprev, cnext);
  k->scope = NULL;
  k->cprev = k->cnext = NULL;
  sc->nkeys--;
}

static void key_unlink(td__key *k) {
  TD__LIST_REMOVE(&k->storage->keys, k, sprev, snext);
}

/* Takes k's event away, and k out of its publisher's list. */
static void event_drop(td__key *k) {
  if (k->evby != NULL)
    TD__LIST_REMOVE(&k->evby->events, k, eprev, enext);
  k->evby = NULL;
  k->eprev = k->enext = NULL;
  k->has_event = 0;
}

void td__key_set_event(td__key *k, td__holdings *by, const uint8_t ev[64]) {
  event_drop(k);
  memcpy(k->event, ev, sizeof(k->event));
  k->has_event = 1;
  k->evby = by;
  if (by != NULL)
    TD__LIST_PUSH(&by->events, k, eprev, enext);
}

size_t td__holdings_drop_events(td__holdings *h) {
  size_t n = 0;
  for (; h->events != NULL; n++)
    event_drop(h->events);
  return n;
}

int td__key_prepare(td__registry *r, const char *key, size_t len,
                    td__storage *s, uid_t uid, td__key_prep *p) {
  p->s = s;
  p->uid = uid;
  p->scope = NULL;
  p->k = td__key_find(r, key, len);
  p->fresh = p->k == NULL;
  /* Commit links the key to s before it unlinks it from its old storage,
   * even when that is s: room for one more reference either way. */
  if (s->refs == UINT32_MAX)
    return TD_EOVERFLOW;
  p->usage_made = usage_find(r, uid) == NULL;
  if (usage_get(r, uid) == NULL)
    return TD_ENOMEM;
  if (!p->fresh)
    return 0;
  td__key *k = malloc(sizeof(*k) + len + 1);
  if (k == NULL)
    goto nomem;
  memcpy(k->name, key, len);
  k->name[len] = '\0';
  k->len = len;
  k->storage = NULL;
  k->scope = NULL;
  k->cprev = k->cnext = NULL;
  k->has_event = 0;
  k->evby = NULL;
  k->eprev = k->enext = NULL;
  if (td__htab_insert(&r->keys, &k->node, td__hash_bytes(key, len)) < 0) {
    free(k);
    goto nomem;
  }
  p->k = k;
  return 0;
nomem:
  if (p->usage_made)
    usage_put(r, usage_find(r, uid));
  return TD_ENOMEM;
}

td__key *td__key_commit(td__registry *r, td__key_prep *p, const td_view *view) {
  td__key *k = p->k;
  td__storage *old = k->storage;
  /* The key counts against its new publisher first, so that no step in
   * between finds that uid's entry empty. */
  usage_find(r, p->uid)->keys++;
  if (old != NULL) {
    td__usage *was = usage_find(r, k->uid);
    was->keys--;
    usage_put(r, was);
  }
  k->uid = p->uid;
  /* A scoped key is never journaled, so it does not name its segment in
   * a journal. A key replaced by an ordinary publish leaves its scope. */
  if (p->scope == NULL)
    p->s->named = 1;
  if (k->scope != NULL)
    scope_unlink(k);
  if (p->scope != NULL)
    scope_link(p->scope, k);
  /* The new storage gains its reference before the old one loses its, so
   * publishing a key onto its own storage frees nothing. */
  if (old != NULL)
    key_unlink(k);
  key_link(p->s, k);
  k->view = *view;
  k->published_ms = td__now_ms();
  event_drop(k); /* the new publisher's to set (td__key_set_event) */
  if (old != NULL)
    storage_unref(r, old);
  return k;
}

void td__key_abort(td__registry *r, td__key_prep *p) {
  if (p->fresh) {
    td__htab_remove(&r->keys, &p->k->node);
    free(p->k);
  }
  if (p->usage_made)
    usage_put(r, usage_find(r, p->uid));
}

int td__key_publish(td__registry *r, const char *key, size_t len,
                    td__storage *s, uid_t uid, const td_view *view,
                    td__key **out) {
  td__key_prep p;
  int err = td__key_prepare(r, key, len, s, uid, &p);
  if (err < 0)
    return err;
  *out = td__key_commit(r, &p, view);
  return 0;
}

void td__key_remove(td__registry *r, td__key *k) {
  td__storage *s = k->storage;
  td__usage *u = usage_find(r, k->uid);
  u->keys--;
  usage_put(r, u);
  td__htab_remove(&r->keys, &k->node);
  key_unlink(k);
  if (k->scope != NULL)
    scope_unlink(k);
  event_drop(k);
  free(k);
  storage_unref(r, s);
}

static int scope_eq(const td__hnode *n, const void *key) {
  return td__container_of(n, td__scope, node)->token == *(const uint64_t *)key;
}

int td__scope_open(td__registry *r, uint64_t token, uid_t uid, void *owner,
                   td__scope **out) {
  if (td__scope_find(r, token) != NULL)
    return TD_EEXIST;
  td__scope *sc = calloc(1, sizeof(*sc));
  if (sc == NULL)
    return TD_ENOMEM;
  sc->token = token;
  sc->uid = uid;
  sc->owner = owner;
  if (td__htab_insert(&r->scopes, &sc->node, td__hash_u64(token)) < 0) {
    free(sc);
    return TD_ENOMEM;
  }
  *out = sc;
  return 0;
}

td__scope *td__scope_find(const td__registry *r, uint64_t token) {
  td__hnode *n =
      td__htab_find(&r->scopes, td__hash_u64(token), scope_eq, &token);
  return n ? td__container_of(n, td__scope, node) : NULL;
}

uint64_t td__scope_close(td__registry *r, td__scope *sc) {
  uint64_t n = 0;
  while (sc->keys != NULL) {
    td__key_remove(r, sc->keys);
    n++;
  }
  td__htab_remove(&r->scopes, &sc->node);
  free(sc);
  return n;
}

int td__key_validate(const char *key, size_t len, char *msg, size_t msglen) {
  if (len == 0)
    return td__msg(msg, msglen, TD_EINVAL, "empty key");
  if (len > TD_KEY_MAX)
    return td__msg(msg, msglen, TD_EINVAL,
                   "key of %zu bytes: longer than %d bytes", len, TD_KEY_MAX);
  const unsigned char *p = (const unsigned char *)key;
  for (size_t i = 0; i < len;) {
    unsigned c = p[i];
    size_t n;
    uint32_t cp;
    if (c == 0)
      return td__msg(msg, msglen, TD_EINVAL, "key contains NUL at byte %zu", i);
    if (c < 0x80) {
      i++;
      continue;
    } else if ((c & 0xe0) == 0xc0) {
      n = 2;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      n = 3;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      n = 4;
      cp = c & 0x07;
    } else {
      goto bad;
    }
    if (i + n > len)
      goto bad;
    for (size_t j = 1; j < n; j++) {
      if ((p[i + j] & 0xc0) != 0x80)
        goto bad;
      cp = cp << 6 | (p[i + j] & 0x3f);
    }
    /* Overlong forms, surrogates and code points past U+10FFFF. */
    if ((n == 2 && cp < 0x80) || (n == 3 && cp < 0x800) ||
        (n == 4 && cp < 0x10000) || cp > 0x10ffff ||
        (cp >= 0xd800 && cp <= 0xdfff))
      goto bad;
    i += n;
    continue;
  bad:
    return td__msg(msg, msglen, TD_EINVAL, "key is not valid UTF-8 at byte %zu",
                   i);
  }
  return 0;
}
