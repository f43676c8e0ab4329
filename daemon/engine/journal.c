/* journal.c: --state-dir's records as values (journal.h). */
#include "journal.h"

#include "log.h"
#include "viewmsg.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static uint32_t crc32c(const uint8_t *p, size_t n) {
  static uint32_t table[256];
  if (table[1] == 0) {
    for (uint32_t i = 0; i < 256; i++) {
      uint32_t c = i;
      for (int k = 0; k < 8; k++)
        c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      table[i] = c;
    }
  }
  uint32_t c = 0xffffffffu;
  while (n--)
    c = table[(c ^ *p++) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

int td__rec_append(uint8_t **buf, size_t *len, size_t *cap,
                  const Tensord__StateRecord *r) {
  size_t n = tensord__state_record__get_packed_size(r);
  if (*len + TD__REC_HDR + n > *cap) {
    size_t c = *cap ? *cap : 4096;
    while (c < *len + TD__REC_HDR + n)
      c *= 2;
    uint8_t *p = realloc(*buf, c);
    if (p == NULL)
      return TD_ENOMEM;
    *buf = p;
    *cap = c;
  }
  uint8_t *p = *buf + *len;
  tensord__state_record__pack(r, p + TD__REC_HDR);
  put32(p, (uint32_t)n);
  put32(p + 4, crc32c(p + TD__REC_HDR, n));
  *len += TD__REC_HDR + n;
  return 0;
}

void td__rec_key(const char *key, size_t len, const td__storage *s,
                       uid_t publisher, const td_view *view,
                       int64_t published_ms, Tensord__StateKey *m,
                       Tensord__View *vm) {
  tensord__state_key__init(m);
  m->key.data = (uint8_t *)key;
  m->key.len = len;
  m->segment = (char *)s->name;
  m->nbytes = s->nbytes;
  m->owner_uid = s->owner.uid;
  m->owner_gid = s->owner.gid;
  m->owner_pid = s->owner.pid;
  m->mode = s->mode;
  m->created_unix_ms = s->created_ms;
  m->published_unix_ms = published_ms;
  m->publisher_uid = publisher;
  m->publisher_known = 1;
  td__view_to_msg(view, vm);
  m->view = vm;
}


void td__snap_free(td__snap *sn) {
  if (sn == NULL)
    return;
  free(sn->buf);
  free(sn->prefixes);
  free(sn);
}

td__snap *td__snap_begin(const char *prefix, uint64_t gen) {
  td__snap *sn = calloc(1, sizeof(*sn));
  if (sn == NULL)
    return NULL;
  Tensord__StateRecord r = TENSORD__STATE_RECORD__INIT;
  r.body_case = TENSORD__STATE_RECORD__BODY_GENERATION;
  r.generation = gen;
  int err = td__rec_append(&sn->buf, &sn->len, &sn->cap, &r);
  r.body_case = TENSORD__STATE_RECORD__BODY_PREFIX;
  r.prefix = (char *)prefix;
  if (err == 0)
    err = td__rec_append(&sn->buf, &sn->len, &sn->cap, &r);
  if (err < 0) {
    td__snap_free(sn);
    return NULL;
  }
  return sn;
}

/* Notes the prefix of s's segment if it is an adopted one not yet seen. */
static int snap_prefix(const char *prefix, td__snap *sn,
                       const td__storage *s) {
  char p[TD__PREFIX_MAX];
  if (td__segment_prefix(s->name, p) < 0 || strcmp(p, prefix) == 0)
    return 0;
  for (size_t i = 0; i < sn->nprefixes; i++)
    if (strcmp(sn->prefixes[i], p) == 0)
      return 0;
  char(*np)[TD__PREFIX_MAX] =
      realloc(sn->prefixes, (sn->nprefixes + 1) * sizeof(*np));
  if (np == NULL)
    return TD_ENOMEM;
  sn->prefixes = np;
  memcpy(sn->prefixes[sn->nprefixes++], p, sizeof(p));
  return 0;
}

int td__snap_keys(const td__registry *reg, const char *prefix, td__snap *sn,
                  size_t max) {
  Tensord__StateRecord r = TENSORD__STATE_RECORD__INIT;
  size_t n = 0;
  sn->slices++;
  const td__storage *s = td__storage_after(reg, sn->after);
  for (; s != NULL && n < max; s = s->next) {
    if (s->keys != NULL && snap_prefix(prefix, sn, s) < 0)
      return TD_ENOMEM;
    for (const td__key *k = s->keys; k != NULL; k = k->snext) {
      /* Never journaled, gone at a restart: scoped keys, and keys of a
       * GPU's storages (device memory dies with the daemon). */
      if (k->scope != NULL || s->device != TD_CPU)
        continue;
      n++;
      Tensord__StateKey m;
      Tensord__View vm;
      td__rec_key(k->name, k->len, s, k->uid, &k->view, k->published_ms, &m,
                 &vm);
      r.body_case = TENSORD__STATE_RECORD__BODY_PUT;
      r.put = &m;
      if (td__rec_append(&sn->buf, &sn->len, &sn->cap, &r) < 0)
        return TD_ENOMEM;
    }
    sn->after = s->id;
  }
  sn->nkeys += n;
  if (s != NULL)
    return 0;
  r.body_case = TENSORD__STATE_RECORD__BODY_PREFIX;
  for (size_t i = 0; i < sn->nprefixes; i++) {
    r.prefix = sn->prefixes[i];
    if (td__rec_append(&sn->buf, &sn->len, &sn->cap, &r) < 0)
      return TD_ENOMEM;
  }
  return 1;
}

int td__snapshot_build(const td__registry *reg, const char *prefix,
                       uint64_t gen, uint8_t **out, size_t *outlen) {
  td__snap *sn = td__snap_begin(prefix, gen);
  if (sn == NULL || td__snap_keys(reg, prefix, sn, SIZE_MAX) < 0) {
    td__snap_free(sn);
    return TD_ENOMEM;
  }
  *out = sn->buf;
  *outlen = sn->len;
  sn->buf = NULL;
  td__snap_free(sn);
  return 0;
}




static int put_eq(const td__hnode *n, const void *key) {
  const ProtobufCBinaryData *a =
      &td__container_of(n, td__putent, node)->r->put->key;
  const ProtobufCBinaryData *b = key;
  /* An empty key's data is NULL: no memcmp on it. */
  return a->len == b->len &&
         (a->len == 0 || memcmp(a->data, b->data, a->len) == 0);
}

static td__putent *find_put(const td__loaded *l, const ProtobufCBinaryData *key) {
  td__hnode *n =
      td__htab_find(&l->puts, td__hash_bytes(key->data, key->len), put_eq, key);
  return n ? td__container_of(n, td__putent, node) : NULL;
}

static int name_eq(const td__hnode *n, const void *key) {
  return strcmp(td__container_of(n, td__nameent, node)->s->name, key) == 0;
}

td__storage *td__loaded_name(const td__loaded *l, const char *name) {
  td__hnode *n = td__htab_find(&l->names, td__hash_bytes(name, strlen(name)),
                               name_eq, name);
  return n ? td__container_of(n, td__nameent, node)->s : NULL;
}

static int keep(td__loaded *l, Tensord__StateRecord *r) {
  if (l->nall == l->allcap) {
    size_t cap = l->allcap ? l->allcap * 2 : 64;
    void *p = realloc(l->all, cap * sizeof(*l->all));
    if (p == NULL)
      return TD_ENOMEM;
    l->all = p;
    l->allcap = cap;
  }
  l->all[l->nall++] = r;
  return 0;
}

size_t td__replay(td__loaded *l, const uint8_t *buf, size_t len,
                     const char *name) {
  size_t off = 0;
  while (off + TD__REC_HDR <= len) {
    uint32_t n = get32(buf + off);
    if (n > TD__REC_MAX || off + TD__REC_HDR + n > len ||
        crc32c(buf + off + TD__REC_HDR, n) != get32(buf + off + 4))
      break;
    Tensord__StateRecord *r =
        tensord__state_record__unpack(NULL, n, buf + off + TD__REC_HDR);
    if (r == NULL || keep(l, r) < 0) {
      if (r)
        tensord__state_record__free_unpacked(r, NULL);
      break;
    }
    off += TD__REC_HDR + n;
    switch (r->body_case) {
    case TENSORD__STATE_RECORD__BODY_GENERATION:
      l->gen = r->generation;
      break;
    case TENSORD__STATE_RECORD__BODY_PREFIX:
      if (td__segment_prefix_valid(r->prefix)) {
        void *p = realloc(l->prefixes, (l->nprefixes + 1) * 64);
        if (p != NULL) {
          l->prefixes = p;
          snprintf(l->prefixes[l->nprefixes++], 64, "%s", r->prefix);
        }
      }
      break;
    case TENSORD__STATE_RECORD__BODY_PUT: {
      td__putent *e = find_put(l, &r->put->key);
      if (e != NULL) {
        e->r = r;
        break;
      }
      e = calloc(1, sizeof(*e));
      const ProtobufCBinaryData *k = &r->put->key;
      if (e == NULL || td__htab_insert(&l->puts, &e->node,
                                       td__hash_bytes(k->data, k->len)) < 0) {
        free(e);
        break;
      }
      e->r = r;
      e->prev = l->last;
      if (l->last)
        l->last->next = e;
      else
        l->first = e;
      l->last = e;
      break;
    }
    case TENSORD__STATE_RECORD__BODY_DEL: {
      td__putent *e = find_put(l, &r->del);
      if (e == NULL)
        break;
      td__htab_remove(&l->puts, &e->node);
      if (e->prev)
        e->prev->next = e->next;
      else
        l->first = e->next;
      if (e->next)
        e->next->prev = e->prev;
      else
        l->last = e->prev;
      free(e);
      break;
    }
    default:
      break;
    }
  }
  if (off < len)
    td__warn("state: %s: %zu byte(s) after the last whole record ignored "
             "(a write cut short by a crash)",
             name, len - off);
  return off;
}

void td__loaded_free(td__loaded *l) {
  for (td__putent *e = l->first, *next; e; e = next) {
    next = e->next;
    free(e);
  }
  td__htab_free(&l->puts);
  for (size_t i = 0; i < l->names.nbuckets; i++) {
    for (td__hnode *n = l->names.buckets[i], *next; n; n = next) {
      next = n->next;
      free(td__container_of(n, td__nameent, node));
    }
  }
  td__htab_free(&l->names);
  for (size_t i = 0; i < l->nall; i++)
    tensord__state_record__free_unpacked(l->all[i], NULL);
  free(l->all);
  free(l->prefixes);
}
