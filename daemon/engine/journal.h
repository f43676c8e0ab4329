/* journal.h: --state-dir's records as values: a record framed with its
 * length and CRC, a key as a record, a snapshot of a registry's keys, and
 * records replayed into what they say. No file is touched here: state.c
 * reads, writes and syncs them. */
#ifndef TD_DAEMON_JOURNAL_H
#define TD_DAEMON_JOURNAL_H

#include "backend.h"
#include "htab.h"
#include "registry.h"
#include "tensord.pb-c.h"

#include <stddef.h>
#include <stdint.h>

/* A record: its length and CRC32C (4 bytes each, little-endian), then the
 * packed StateRecord, at most TD__REC_MAX bytes. */
#define TD__REC_HDR 8
#define TD__REC_MAX (1u << 20)

/* Appends r, framed, to *buf (*len used of *cap). Returns 0 or TD_ENOMEM. */
int td__rec_append(uint8_t **buf, size_t *len, size_t *cap,
                   const Tensord__StateRecord *r);
/* Fills m (and vm) with what brings key back: its storage, owner, view,
 * publisher. m points into key, s and vm. */
void td__rec_key(const char *key, size_t len, const td__storage *s,
                 uid_t publisher, const td_view *view, int64_t published_ms,
                 Tensord__StateKey *m, Tensord__View *vm);

/* A snapshot being serialised: the records so far, and how far the walk
 * over storages (in id order) has come. */
typedef struct td__snap {
  uint8_t *buf;
  size_t len, cap;
  uint64_t after; /* the storages up to this id are in buf */
  size_t nkeys;
  unsigned slices;
  char (*prefixes)[TD__PREFIX_MAX]; /* of adopted segments, seen so far */
  size_t nprefixes;
} td__snap;

/* Starts a snapshot of generation gen: its generation and prefix, this
 * instance's. Returns it, or NULL (no memory). */
td__snap *td__snap_begin(const char *prefix, uint64_t gen);
/* Serialises the keys of reg's storages after sn->after, a whole storage at
 * a time, until at least max keys are in or no storage is left. Returns 1
 * when every storage is in (the prefixes of adopted segments, those not
 * prefix, then end the snapshot), 0 if some are left, or TD_ENOMEM. */
int td__snap_keys(const td__registry *reg, const char *prefix, td__snap *sn,
                  size_t max);
void td__snap_free(td__snap *sn);
/* Serialises every key and the prefixes in use as a snapshot of generation
 * gen, at once, into *out (malloc'd). Returns 0 or TD_ENOMEM. */
int td__snapshot_build(const td__registry *reg, const char *prefix,
                       uint64_t gen, uint8_t **out, size_t *outlen);

/* The last put of one live key, in the order keys were first put. */
typedef struct td__putent {
  td__hnode node;
  Tensord__StateRecord *r;
  struct td__putent *prev, *next;
} td__putent;

/* A segment adopted during the load, by name. */
typedef struct td__nameent {
  td__hnode node;
  td__storage *s;
} td__nameent;

/* What the records say, before any segment is looked at. */
typedef struct td__loaded {
  td__htab puts; /* td__putent by key */
  td__putent *first, *last;
  td__htab names; /* td__nameent by segment name */
  char (*prefixes)[64];
  size_t nprefixes;
  uint64_t gen;
  Tensord__StateRecord **all; /* every decoded record, to free */
  size_t nall, allcap;
} td__loaded;

/* Applies the records in buf (name says where they came from, for the
 * log) to l. Returns the bytes of whole, valid records: a torn or corrupt
 * tail (a crash mid-append) ends the replay there. */
size_t td__replay(td__loaded *l, const uint8_t *buf, size_t len,
                  const char *name);
/* The storage adopted for segment name (in l->names), or NULL. */
td__storage *td__loaded_name(const td__loaded *l, const char *name);
void td__loaded_free(td__loaded *l);

#endif /* TD_DAEMON_JOURNAL_H */
