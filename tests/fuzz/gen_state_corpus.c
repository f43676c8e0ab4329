/* gen_state_corpus.c: writes fuzz_state's seed corpus: state directories as
 * state_input.h lays them out, valid (snapshots, journals, keys sharing a
 * segment, keys deleted and put again) and damaged (torn tails, bad CRCs,
 * oversize lengths, records that do not decode, missing and resized
 * segments, malformed keys, views and names, a held lock), and the inputs
 * that pin bugs fuzz_state found, each named for its bug. The output is
 * committed in tests/fuzz/state_corpus and tests/fuzz/state_regressions;
 * regenerate it with
 *   build/tests/fuzz/gen_state_corpus tests/fuzz/state_corpus \
 *     tests/fuzz/state_regressions */
#include "state_input.h"

#include "tensord.h"
#include "tensord.pb-c.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FILE_MAX 4000
#define INPUT_MAX 8192

/* Segments of a previous daemon: names state.c writes. */
#define PREFIX "/tensord.5eed000000000001."
#define PREFIX2 "/tensord.5eed000000000002."
#define SEG(n) PREFIX #n

typedef struct file {
  uint8_t b[FILE_MAX];
  size_t len;
} file;

static const char *outdir, *regdir;
static int nwritten;
static file f[SF_FILES_MAX];

static void rec(file *o, const Tensord__StateRecord *r) {
  size_t n = tensord__state_record__get_packed_size(r);
  if (o->len + SF_REC_HDR + n > sizeof(o->b)) {
    fprintf(stderr, "gen_state_corpus: file over %d bytes\n", FILE_MAX);
    exit(1);
  }
  uint8_t *p = o->b + o->len;
  tensord__state_record__pack(r, p + SF_REC_HDR);
  sf_put32(p, (uint32_t)n);
  sf_put32(p + 4, sf_crc32c(p + SF_REC_HDR, n));
  o->len += SF_REC_HDR + n;
}

static void generation(file *o, uint64_t g) {
  Tensord__StateRecord r = TENSORD__STATE_RECORD__INIT;
  r.body_case = TENSORD__STATE_RECORD__BODY_GENERATION;
  r.generation = g;
  rec(o, &r);
}

static void prefix(file *o, const char *p) {
  Tensord__StateRecord r = TENSORD__STATE_RECORD__INIT;
  r.body_case = TENSORD__STATE_RECORD__BODY_PREFIX;
  r.prefix = (char *)p;
  rec(o, &r);
}

/* A put of key on segment (nbytes), owner uid 1000 mode 0640, with a view
 * of dtype and shape (ndim < 0: no view at all). */
static void put_view(file *o, const char *key, size_t klen, const char *seg,
                     uint64_t nbytes, int dtype, int ndim, int64_t *shape,
                     int64_t *stride, int64_t offset) {
  Tensord__View v = TENSORD__VIEW__INIT;
  Tensord__StateKey m = TENSORD__STATE_KEY__INIT;
  Tensord__StateRecord r = TENSORD__STATE_RECORD__INIT;
  m.key.data = (uint8_t *)key;
  m.key.len = klen;
  m.segment = (char *)seg;
  m.nbytes = nbytes;
  m.owner_uid = 1000;
  m.owner_gid = 1000;
  m.owner_pid = 4242;
  m.mode = 0640;
  m.published_unix_ms = 1700000000000;
  m.created_unix_ms = 1699999999000;
  if (ndim >= 0) {
    v.dtype = dtype;
    v.n_shape = v.n_stride = (size_t)ndim;
    v.shape = shape;
    v.stride = stride;
    v.offset = offset;
    m.view = &v;
  }
  r.body_case = TENSORD__STATE_RECORD__BODY_PUT;
  r.put = &m;
  rec(o, &r);
}

/* A put whose view is the whole segment as bytes, as publish without a view
 * records it. */
static void put(file *o, const char *key, const char *seg, uint64_t nbytes) {
  int64_t shape[1] = {(int64_t)nbytes}, stride[1] = {1};
  put_view(o, key, strlen(key), seg, nbytes, TD_UINT8, 1, shape, stride, 0);
}

static void del(file *o, const char *key) {
  Tensord__StateRecord r = TENSORD__STATE_RECORD__INIT;
  r.body_case = TENSORD__STATE_RECORD__BODY_DEL;
  r.del.data = (uint8_t *)key;
  r.del.len = strlen(key);
  rec(o, &r);
}

/* Raw bytes: damage. */
static void raw(file *o, const void *p, size_t n) {
  memcpy(o->b + o->len, p, n);
  o->len += n;
}

static void reset(void) {
  for (int i = 0; i < SF_FILES_MAX; i++)
    f[i].len = 0;
}

/* Writes an input: header bytes, then nfiles of f[] (the snapshot first if
 * flags say so), each but the last with its u16 length. Inputs set SF_SEAL
 * (so that their mutations keep good CRCs) unless a bad CRC is their
 * point. */
static void emit(const char *name, uint8_t flags, uint8_t absent,
                 uint8_t resized, uint8_t gen0) {
  static uint8_t out[INPUT_MAX];
  size_t len = 0;
  int nfiles = (flags & SF_SNAPSHOT ? 1 : 0) + SF_NJOURNALS(flags);
  out[len++] = flags;
  out[len++] = absent;
  out[len++] = resized;
  out[len++] = gen0;
  for (int i = 0; i < nfiles; i++) {
    if (i < nfiles - 1) {
      out[len++] = (uint8_t)f[i].len;
      out[len++] = (uint8_t)(f[i].len >> 8);
    }
    memcpy(out + len, f[i].b, f[i].len);
    len += f[i].len;
  }
  char path[4096];
  snprintf(path, sizeof(path), "%s/%s", outdir, name);
  FILE *o = fopen(path, "wb");
  if (o == NULL || fwrite(out, 1, len, o) != len || fclose(o) != 0) {
    fprintf(stderr, "gen_state_corpus: %s: %s\n", path, strerror(errno));
    exit(1);
  }
  nwritten++;
  reset();
}

/* The snapshot a daemon writes: its generation, its prefix, its keys. */
static void snapshot(file *o, uint64_t g) {
  generation(o, g);
  prefix(o, PREFIX);
  put(o, "model/w", SEG(1), 4096);
  put(o, "model/b", SEG(2), 64);
}

static void gen_valid(void) {
  emit("empty", SF_SEAL, 0, 0, 0);

  snapshot(&f[0], 1);
  emit("snapshot", SF_SNAPSHOT | SF_SEAL, 0, 0, 0);

  /* Journals from the snapshot's generation on. */
  snapshot(&f[0], 3);
  put(&f[1], "model/c", SEG(3), 128);
  del(&f[1], "model/b");
  put(&f[2], "model/b", SEG(2), 64);   /* back, after model/c */
  put(&f[2], "model/w", SEG(4), 8192); /* replaced */
  emit("snapshot_journals", SF_SNAPSHOT | SF_JOURNALS(2) | SF_SEAL, 0, 0, 3);

  /* No snapshot: journal.1 on. */
  put(&f[0], "k", SEG(1), 16);
  put(&f[0], "j", SEG(2), 32);
  del(&f[0], "k");
  put(&f[1], "i", SEG(3), 48);
  emit("journals_only", SF_JOURNALS(2) | SF_SEAL, 0, 0, 1);

  /* Journals that are not the snapshot's: never read. */
  snapshot(&f[0], 7);
  put(&f[1], "stale", SEG(9), 16);
  emit("journal_other_generation", SF_SNAPSHOT | SF_JOURNALS(1) | SF_SEAL, 0, 0,
       9);

  /* Keys sharing a segment, with views of it. */
  {
    int64_t sh[2] = {4, 8}, st[2] = {8, 1}, sht[2] = {8, 4}, stt[2] = {1, 8};
    generation(&f[0], 1);
    prefix(&f[0], PREFIX);
    put_view(&f[0], "w", 1, SEG(1), 128, TD_FLOAT32, 2, sh, st, 0);
    put_view(&f[0], "w.T", 3, SEG(1), 128, TD_FLOAT32, 2, sht, stt, 0);
    put_view(&f[0], "w.row1", 6, SEG(1), 128, TD_FLOAT32, 1, sh + 1, st + 1, 8);
    emit("shared_segment", SF_SNAPSHOT | SF_SEAL, 0, 0, 0);
  }

  /* Two instances' segments, and unnamed ones to sweep. */
  generation(&f[0], 1);
  prefix(&f[0], PREFIX);
  prefix(&f[0], PREFIX2);
  put(&f[0], "a", SEG(1), 64);
  put(&f[0], "b", PREFIX2 "1", 64);
  emit("two_prefixes_orphans", SF_SNAPSHOT | SF_ORPHANS | SF_SEAL, 0, 0, 0);

  /* Another daemon holds the lock. */
  snapshot(&f[0], 1);
  emit("locked", SF_SNAPSHOT | SF_LOCKED | SF_ORPHANS | SF_SEAL, 0, 0, 0);

  /* Non-ASCII keys: valid UTF-8 and not. */
  put(&f[0], "caf\xc3\xa9", SEG(1), 16);
  put(&f[0], "\xe2\x82\xac/\xf0\x9f\x98\x80", SEG(2), 16);
  put(&f[0], "\xc3\x28", SEG(3), 16);
  put(&f[0], "\xed\xa0\x80", SEG(4), 16);
  emit("keys_utf8", SF_JOURNALS(1) | SF_SEAL, 0, 0, 1);
}

static void gen_damaged(void) {
  /* A torn tail: the last record cut short. */
  snapshot(&f[0], 2);
  put(&f[1], "c", SEG(3), 128);
  put(&f[1], "d", SEG(4), 128);
  f[1].len -= 5;
  emit("torn_tail", SF_SNAPSHOT | SF_JOURNALS(1) | SF_SEAL, 0, 0, 2);

  /* A torn header. */
  snapshot(&f[0], 2);
  put(&f[1], "c", SEG(3), 128);
  raw(&f[1], "\x20\x00\x00", 3);
  emit("torn_header", SF_SNAPSHOT | SF_JOURNALS(1) | SF_SEAL, 0, 0, 2);

  /* A bad CRC in the middle: what follows is not read. */
  snapshot(&f[0], 2);
  put(&f[1], "c", SEG(3), 128);
  size_t mid = f[1].len;
  put(&f[1], "d", SEG(4), 128);
  put(&f[1], "e", SEG(5), 128);
  f[1].b[mid + 4] ^= 0x01;
  emit("bad_crc", SF_SNAPSHOT | SF_JOURNALS(1), 0, 0, 2);

  /* A bad CRC in the snapshot: its keys after it are lost, the journal
   * still read. */
  snapshot(&f[0], 2);
  f[0].b[f[0].len - 1] ^= 0x80;
  put(&f[1], "c", SEG(3), 128);
  emit("bad_crc_snapshot", SF_SNAPSHOT | SF_JOURNALS(1), 0, 0, 2);

  /* A length past the record limit, and one past the file. */
  snapshot(&f[0], 2);
  raw(&f[0], "\x00\x00\x20\x00\x00\x00\x00\x00", 8);
  put(&f[1], "c", SEG(3), 128);
  raw(&f[1], "\xff\x0f\x00\x00\x00\x00\x00\x00xyz", 11);
  emit("bad_lengths", SF_SNAPSHOT | SF_JOURNALS(1) | SF_SEAL, 0, 0, 2);

  /* A record with a good CRC that does not decode. */
  {
    static const uint8_t junk[] = {0xff, 0xff, 0xff, 0xff};
    uint8_t h[8];
    sf_put32(h, sizeof(junk));
    sf_put32(h + 4, sf_crc32c(junk, sizeof(junk)));
    snapshot(&f[0], 1);
    raw(&f[0], h, 8);
    raw(&f[0], junk, sizeof(junk));
    put(&f[0], "after", SEG(3), 16);
    emit("undecodable", SF_SNAPSHOT | SF_SEAL, 0, 0, 0);
  }

  /* Segments gone (a reboot) or of another size. */
  snapshot(&f[0], 1);
  put(&f[0], "c", SEG(3), 128);
  emit("segments_missing", SF_SNAPSHOT | SF_SEAL, 0x05, 0, 0);
  snapshot(&f[0], 1);
  put(&f[0], "c", SEG(3), 128);
  emit("segments_resized", SF_SNAPSHOT | SF_SEAL, 0, 0x02, 0);

  /* Malformed keys, names and views. */
  {
    char longkey[TD_KEY_MAX + 2];
    memset(longkey, 'k', sizeof(longkey) - 1);
    longkey[sizeof(longkey) - 1] = '\0';
    int64_t sh[1] = {64}, st[1] = {1}, neg[1] = {-1}, far[1] = {1000};
    generation(&f[0], 1);
    prefix(&f[0], PREFIX);
    put(&f[0], "", SEG(1), 16);
    put(&f[0], longkey, SEG(2), 16);
    put_view(&f[0], "a\0b", 3, SEG(3), 64, TD_UINT8, 1, sh, st, 0);
    put(&f[0], "not-ours", "/other-app.7", 16);
    put(&f[0], "too-long",
        "/tensord.5eed000000000001.123456789012345678901234567890123456789",
        16);
    put_view(&f[0], "no-view", 7, SEG(4), 64, 0, -1, NULL, NULL, 0);
    put_view(&f[0], "bad-dtype", 9, SEG(5), 64, 99, 1, sh, st, 0);
    put_view(&f[0], "neg-size", 8, SEG(6), 64, TD_UINT8, 1, neg, st, 0);
    put_view(&f[0], "outside", 7, SEG(7), 64, TD_FLOAT32, 1, far, st, 0);
    put_view(&f[0], "ok", 2, SEG(8), 64, TD_UINT8, 1, sh, st, 0);
    emit("malformed_records", SF_SNAPSHOT | SF_ORPHANS | SF_SEAL, 0, 0, 0);
  }

  /* Prefix records that are no segment prefix. */
  generation(&f[0], 1);
  prefix(&f[0], PREFIX);
  prefix(&f[0], "/tensord.5eed000000000003");
  prefix(&f[0], "tensord.5eed000000000004.");
  put(&f[0], "a", SEG(1), 64);
  emit("prefixes_malformed", SF_SNAPSHOT | SF_ORPHANS | SF_SEAL, 0, 0, 0);
}

/* Bugs fuzz_state found, one input each. */
static void gen_regressions(void) {
  /* A prefix record that is empty: the sweep read from one byte past it,
   * beyond its buffer (ASan: heap-buffer-overflow in sweep). */
  prefix(&f[0], "");
  emit("empty_prefix", SF_SNAPSHOT | SF_SEAL, 0, 0, 0);

  /* Prefix records that are no "/tensord.<instance>." prefix: the sweep
   * unlinked every shm object whose name starts with them, another
   * program's ("/o": /dev/shm/other-app.1) or every tensord instance's
   * ("/tensord."). */
  generation(&f[0], 1);
  prefix(&f[0], "/o");
  prefix(&f[0], "/tensord.");
  put(&f[0], "a", SEG(1), 64);
  emit("prefix_not_a_segment_prefix", SF_SNAPSHOT | SF_SEAL, 0, 0, 0);

  /* Two keys on one segment whose records disagree on its size: the second
   * key's view was checked against its own record's 4096 bytes, not the
   * 64-byte segment adopted for the first, and served reaching past it. */
  generation(&f[0], 1);
  prefix(&f[0], PREFIX);
  put(&f[0], "small", SEG(1), 64);
  put(&f[0], "big", SEG(1), 4096);
  emit("shared_segment_sizes_disagree", SF_SNAPSHOT | SF_SEAL, 0, 0, 0);

  /* Two records with an empty key: matching them called memcmp on the
   * NULL data protobuf-c gives empty bytes (UBSan: null pointer passed as
   * argument 1). */
  put(&f[0], "", SEG(1), 16);
  del(&f[0], "");
  emit("empty_key_twice", SF_JOURNALS(1) | SF_SEAL, 0, 0, 1);

  /* Journals past a gap (the snapshot is generation 7, journal.7 missing):
   * never read by this load, yet left in place; the load then appended to
   * journal.8 as its own, and a crash or restart replayed them, serving
   * keys the load had not ("stale", on a kept segment). */
  snapshot(&f[0], 7);
  put(&f[1], "stale", SEG(1), 4096);
  emit("journal_after_gap_appended_to", SF_SNAPSHOT | SF_JOURNALS(1) | SF_SEAL,
       0, 0, 8);
  snapshot(&f[0], 7);
  put(&f[1], "stale", SEG(1), 4096);
  emit("journal_past_gap_replayed_later",
       SF_SNAPSHOT | SF_JOURNALS(1) | SF_SEAL, 0, 0, 9);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s CORPUS_DIR REGRESSIONS_DIR\n", argv[0]);
    return 2;
  }
  outdir = argv[1];
  gen_valid();
  gen_damaged();
  printf("gen_state_corpus: wrote %d inputs to %s\n", nwritten, outdir);
  outdir = regdir = argv[2];
  nwritten = 0;
  gen_regressions();
  printf("gen_state_corpus: wrote %d inputs to %s\n", nwritten, outdir);
  return 0;
}
