/* test_durability.c: --state-dir under stress: a stop while a journal sync
 * or a compaction is still running, replies held until their change is on
 * disk (a crash that also loses what was never synced), a sync that fails,
 * compaction of a long journal, and a crash in the middle of a compaction.
 *
 * Disk syncs are steered with the LD_PRELOAD library syncshim (see
 * tests/lib/syncshim.c): tensord itself has no test hook. */
#include "harness.h"
#include "raw.h"

#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>

static tdt_daemon d;
static char state_dir[64]; /* --state-dir */
static char ctl[64];       /* the shim's control files */
static uint64_t instances[8];
static int ninstances;

static void remember(uint64_t instance) {
  if (ninstances < 8)
    instances[ninstances++] = instance;
}

static void rm_dir(char *dir) {
  tdt_rmdir(dir);
  dir[0] = '\0';
}

static void setup(void) {
  memset(&d, 0, sizeof(d));
  state_dir[0] = ctl[0] = '\0';
  ninstances = 0;
}

/* Whatever a failed test left goes: daemon, segments, directories. */
static void teardown(void) {
  if (d.pid > 0) {
    kill(d.pid, SIGKILL);
    tdt_wait(d.pid);
    d.pid = 0;
  }
  for (int i = 0; i < ninstances; i++)
    tdt_unlink_segments(instances[i]);
  rm_dir(state_dir);
  rm_dir(ctl);
  if (d.dir[0] != '\0')
    tdt_kill(&d);
}

TestSuite(durability, .init = setup, .fini = teardown, .timeout = 60);

/* ---- the shim's control files ---- */

static void ctl_path(char *buf, size_t len, const char *name) {
  snprintf(buf, len, "%s/%s", ctl, name);
}

static void touch(const char *name) {
  char p[128];
  ctl_path(p, sizeof(p), name);
  int fd = open(p, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
  cr_assert_geq(fd, 0, "%s: %s", p, strerror(errno));
  close(fd);
}

static void rm(const char *name) {
  char p[128];
  ctl_path(p, sizeof(p), name);
  unlink(p);
}

static int ctl_exists(const char *name) {
  char p[128];
  struct stat sb;
  ctl_path(p, sizeof(p), name);
  return stat(p, &sb) == 0;
}

/* Waits until the shim says a sync is stuck at the gate. */
static void wait_gate_reached(void) {
  for (int i = 0; i < 10000 && !ctl_exists("gate.reached"); i++)
    tdt_sleep_ms(1);
  cr_assert(ctl_exists("gate.reached"), "no sync reached the gate; see %s",
            d.log);
}

/* ---- starting and restarting tensord ---- */

/* Starts tensord with a fresh --state-dir; with the shim preloaded if
 * match is not NULL: the pattern of the files whose syncs it steers, with
 * %s for the state directory. */
static void start(const char *match) {
  snprintf(state_dir, sizeof(state_dir), "/tmp/tensord-state.XXXXXX");
  cr_assert_not_null(mkdtemp(state_dir));
  if (match != NULL) {
    snprintf(ctl, sizeof(ctl), "/tmp/tensord-sync.XXXXXX");
    cr_assert_not_null(mkdtemp(ctl));
    char p[128];
    tdt_preload(TDT_SYNCSHIM);
    snprintf(p, sizeof(p), match, state_dir);
    setenv("TDT_SYNC_MATCH", p, 1);
    ctl_path(p, sizeof(p), "gate");
    setenv("TDT_SYNC_GATE", p, 1);
    ctl_path(p, sizeof(p), "fail");
    setenv("TDT_SYNC_FAIL", p, 1);
    ctl_path(p, sizeof(p), "log");
    setenv("TDT_SYNC_LOG", p, 1);
  }
  tdt_start(&d, (const char *const[]){"--state-dir", state_dir, NULL});
  tdt_preload(NULL);
  remember(d.instance);
}

/* Starts a new tensord (no shim) on d's socket and state directory, logging
 * to d's log; returns its pid without waiting. */
static pid_t spawn(void) {
  return tdt_spawn(&d, (const char *const[]){"--state-dir", state_dir, NULL});
}

/* Starts a new tensord (no shim) as spawn() does, and waits until it
 * serves. */
static void restart(void) {
  tdt_restart(&d, (const char *const[]){"--state-dir", state_dir, NULL});
  remember(d.instance);
}

static void kill9(void) {
  cr_assert_eq(kill(d.pid, SIGKILL), 0);
  cr_assert_eq(tdt_wait(d.pid), 128 + SIGKILL);
  d.pid = 0;
}

/* Ends a test with the daemon running: unpublishes every key (so that the
 * stop keeps nothing), stops it with tdt_stop's checks, and checks that no
 * instance of the test left a segment. */
static void finish(const char *const *keys, int nkeys) {
  td_client *c = tdt_connect(&d);
  for (int i = 0; i < nkeys; i++) {
    int err = td_unpublish(c, keys[i]);
    cr_assert(err == 0 || err == TD_ENOENT, "unpublish %s: %s", keys[i],
              td_last_error(c));
  }
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.keys, 0, "%llu key(s) the test did not expect",
               (unsigned long long)st.keys);
  td_close(c);
  tdt_stop(&d);
  for (int i = 0; i < ninstances; i++)
    cr_assert_eq(tdt_segments_of(instances[i]), 0, "instance %d left segments",
                 i);
  rm_dir(state_dir);
  rm_dir(ctl);
  memset(&d, 0, sizeof(d));
}

/* ---- keys with values: a view offset per change ---- */

enum { NKEYS = 64 };

/* A long key (about 250 bytes) so that the journal grows fast. */
static const char *key_name(int i) {
  static char names[NKEYS][256];
  if (names[i][0] == '\0') {
    int n = snprintf(names[i], sizeof(names[i]), "durability/%02d/", i);
    memset(names[i] + n, 'x', 250 - (size_t)n);
    names[i][250] = '\0';
  }
  return names[i];
}

/* What one connection did to the keys: for each, the offset (round) of the
 * last change sent and of the last one acknowledged (-1: none). */
typedef struct churn {
  tdt_raw r;
  uint64_t id; /* the storage every key names */
  int64_t sent[NKEYS], acked[NKEYS];
  uint64_t first_seq; /* of the first publish: seqs map to (key, round) */
  int round;          /* rounds sent */
  int errors;
} churn;

static void churn_open(churn *ch) {
  memset(ch, 0, sizeof(*ch));
  tdt_raw_open(&ch->r, &d);
  ch->id = tdt_raw_create_now(&ch->r, 4096);
  for (int i = 0; i < NKEYS; i++)
    ch->sent[i] = ch->acked[i] = -1;
  ch->first_seq = ch->r.seq + 1;
}

/* Counts reply rep: an Ok acknowledges the publish its seq names. */
static void churn_count(churn *ch, Tensord__Response *rep) {
  uint64_t n = rep->seq - ch->first_seq;
  int key = (int)(n % NKEYS);
  int64_t round = (int64_t)(n / NKEYS);
  if (rep->body_case == TENSORD__RESPONSE__BODY_OK) {
    cr_assert_gt(round, ch->acked[key], "key %d: an Ok out of order", key);
    ch->acked[key] = round;
  } else {
    ch->errors++;
  }
  tensord__response__free_unpacked(rep, NULL);
}

/* Sends one round: every key published again with the round as offset. */
static void churn_send_round(churn *ch) {
  for (int i = 0; i < NKEYS; i++) {
    uint64_t seq = tdt_raw_publish(&ch->r, key_name(i), ch->id, ch->round);
    cr_assert_eq(seq, ch->first_seq + (uint64_t)ch->round * NKEYS + i);
    ch->sent[i] = ch->round;
  }
  ch->round++;
  tdt_raw_flush(&ch->r);
}

/* Reads replies until every change sent is answered; or, if stop_at_gate,
 * until a sync is stuck at the gate and no reply comes for a while. */
static void churn_wait(churn *ch, int stop_at_gate) {
  uint64_t want = (uint64_t)ch->round * NKEYS;
  uint64_t got = 0;
  for (int i = 0; i < NKEYS; i++)
    got += (uint64_t)(ch->acked[i] + 1);
  got += (uint64_t)ch->errors;
  while (got < want) {
    Tensord__Response *rep = tdt_raw_reply(&ch->r, stop_at_gate ? 200 : 20000);
    if (rep == NULL) {
      cr_assert(stop_at_gate && !ch->r.eof, "replies stopped at %llu of %llu",
                (unsigned long long)got, (unsigned long long)want);
      if (ctl_exists("gate.reached"))
        return;
      continue;
    }
    churn_count(ch, rep);
    got++;
  }
}

/* After tensord died: every reply it sent before is counted. */
static void churn_drain(churn *ch) {
  Tensord__Response *rep;
  while ((rep = tdt_raw_reply(&ch->r, 5000)) != NULL)
    churn_count(ch, rep);
  cr_assert(ch->r.eof, "the dead daemon's connection ends");
}

static int64_t offset_of(td_client *c, const char *key) {
  td_storage *s;
  td_view v;
  int err = td_lookup(c, key, TD_RDONLY, 0, &s, &v);
  if (err == TD_ENOENT)
    return -1;
  cr_assert_eq(err, 0, "lookup: %s", td_last_error(c));
  td_storage_release(s);
  return v.offset;
}

/* After a restart: each key holds its last acknowledged value, or a later
 * one that was sent (it may have reached the disk unacknowledged). */
static void check_acked(const churn *ch) {
  td_client *c = tdt_connect(&d);
  for (int i = 0; i < NKEYS; i++) {
    int64_t off = offset_of(c, key_name(i));
    cr_assert_geq(off, ch->acked[i],
                  "key %d: round %lld was acknowledged, the restart serves "
                  "%lld",
                  i, (long long)ch->acked[i], (long long)off);
    cr_assert_leq(off, ch->sent[i], "key %d: round %lld was never sent", i,
                  (long long)off);
  }
  td_close(c);
}

static const char *const *all_keys(void) {
  static const char *keys[NKEYS];
  for (int i = 0; i < NKEYS; i++)
    keys[i] = key_name(i);
  return keys;
}

/* The journals in the state directory: their count, and the lowest
 * generation in *lowest. */
static int journals(unsigned long long *lowest) {
  DIR *dir = opendir(state_dir);
  cr_assert_not_null(dir);
  int n = 0;
  *lowest = ~0ull;
  struct dirent *e;
  while ((e = readdir(dir)) != NULL) {
    unsigned long long g;
    char tail;
    if (sscanf(e->d_name, "journal.%llu%c", &g, &tail) == 1) {
      n++;
      if (g < *lowest)
        *lowest = g;
    }
  }
  closedir(dir);
  return n;
}

/* Publishes rounds until the log says a compaction started. */
static void churn_until_compaction(churn *ch, int stop_at_gate) {
  for (int i = 0; i < 1000; i++) {
    churn_send_round(ch);
    if (ch->round % 16 == 0) {
      churn_wait(ch, stop_at_gate);
      if (tdt_log_has(&d, "compacting"))
        return;
    }
  }
  cr_assert_fail("no compaction after %d rounds; see %s", ch->round, d.log);
}

/* ---- a stop while work is in flight ---- */

/* Waits until tensord closed the connection: by then its stop has run (the
 * socket closes in a later turn of its loop than the stop itself). */
static void wait_hung_up(tdt_raw *r) {
  Tensord__Response *rep;
  while ((rep = tdt_raw_reply(r, 10000)) != NULL) {
    cr_assert_neq(rep->body_case, TENSORD__RESPONSE__BODY_OK,
                  "an Ok for a change that is not on disk");
    tensord__response__free_unpacked(rep, NULL);
  }
  cr_assert(r->eof, "tensord did not hang up after SIGTERM");
}

TDT_TEST(durability, stop_during_a_journal_sync_waits_for_it) {
  start("%s/journal.*");
  tdt_raw r;
  tdt_raw_open(&r, &d);
  uint64_t id = tdt_raw_create_now(&r, 4096);
  touch("gate");
  tdt_raw_publish(&r, "stop/k", id, 7);
  tdt_raw_flush(&r);
  wait_gate_reached();
  /* The sync is stuck: stop tensord under it, then let the sync go on. */
  cr_assert_eq(kill(d.pid, SIGTERM), 0);
  wait_hung_up(&r);
  tdt_raw_close(&r);
  rm("gate");
  int st = tdt_wait(d.pid);
  d.pid = 0;
  cr_assert_eq(st, 0, "tensord exited %d; see %s", st, d.log);
  cr_assert(tdt_log_has(&d, "kept 1 key(s) on 1 storage(s)"), "see %s", d.log);
  /* Its final snapshot has the change the sync was writing. */
  restart();
  td_client *c = tdt_connect(&d);
  cr_assert_eq(offset_of(c, "stop/k"), 7);
  td_close(c);
  finish((const char *const[]){"stop/k"}, 1);
}

TDT_TEST(durability, stop_during_a_compaction_waits_for_it) {
  start("%s/snapshot.tmp");
  touch("gate");
  churn ch;
  churn_open(&ch);
  churn_until_compaction(&ch, 1);
  wait_gate_reached();
  cr_assert_eq(kill(d.pid, SIGTERM), 0);
  wait_hung_up(&ch.r);
  tdt_raw_close(&ch.r);
  rm("gate");
  int st = tdt_wait(d.pid);
  d.pid = 0;
  cr_assert_eq(st, 0, "tensord exited %d; see %s", st, d.log);
  restart();
  check_acked(&ch);
  finish(all_keys(), NKEYS);
}

/* ---- replies wait for the disk ---- */

/* The length of journal path that the shim last saw synced (0 if none). */
static long long synced_length(const char *journal) {
  char p[128], line[512];
  ctl_path(p, sizeof(p), "log");
  FILE *f = fopen(p, "r");
  long long len = 0;
  while (f && fgets(line, sizeof(line), f)) {
    long long n;
    char path[400];
    if (sscanf(line, "%lld %399s", &n, path) == 2 && strcmp(path, journal) == 0)
      len = n;
  }
  if (f)
    fclose(f);
  return len;
}

static void newest_journal(char *path, size_t len) {
  unsigned long long lowest, best = 0;
  journals(&lowest);
  DIR *dir = opendir(state_dir);
  struct dirent *e;
  while ((e = readdir(dir)) != NULL) {
    unsigned long long g;
    if (sscanf(e->d_name, "journal.%llu", &g) == 1 && g > best)
      best = g;
  }
  closedir(dir);
  cr_assert_gt(best, 0);
  snprintf(path, len, "%s/journal.%llu", state_dir, best);
}

TDT_TEST(durability, replies_wait_until_the_change_is_synced) {
  start("%s/journal.*");
  churn ch;
  churn_open(&ch);
  churn_send_round(&ch); /* round 0: synced and acknowledged */
  churn_wait(&ch, 0);
  char journal[128];
  newest_journal(journal, sizeof(journal));
  long long synced = synced_length(journal);
  cr_assert_gt(synced, 0, "the shim saw %s synced", journal);

  /* Round 1 is written to the journal, but its sync never completes. */
  touch("gate");
  churn_send_round(&ch);
  wait_gate_reached();
  struct stat sb;
  cr_assert_eq(stat(journal, &sb), 0);
  cr_assert_gt(sb.st_size, synced_length(journal),
               "round 1 is in the page cache, not yet on disk");
  kill9();
  churn_drain(&ch);
  for (int i = 0; i < NKEYS; i++)
    cr_assert_eq(ch.acked[i], 0,
                 "key %d: round %lld was acknowledged before its sync", i,
                 (long long)ch.acked[i]);
  tdt_raw_close(&ch.r);

  /* The power cut: what was not synced is lost. */
  cr_assert_eq(truncate(journal, synced_length(journal)), 0);
  rm("gate");
  restart();
  check_acked(&ch);
  td_client *c = tdt_connect(&d);
  for (int i = 0; i < NKEYS; i++)
    cr_assert_eq(offset_of(c, key_name(i)), 0, "key %d", i);
  td_close(c);
  finish(all_keys(), NKEYS);
}

TDT_TEST(durability, failed_sync_answers_eio_naming_the_state_dir) {
  start("%s/journal.*");
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  cr_assert_eq(td_publish(c, "eio/before", s, NULL), 0);
  touch("fail");
  cr_assert_eq(td_publish(c, "eio/failed", s, NULL), TD_EIO);
  cr_assert(strstr(td_last_error(c), state_dir) != NULL, "message: %s",
            td_last_error(c));
  rm("fail");
  /* Nothing else is disturbed. */
  cr_assert_eq(td_publish(c, "eio/after", s, NULL), 0, "%s", td_last_error(c));
  td_storage_release(s);
  td_close(c);
  finish((const char *const[]){"eio/before", "eio/failed", "eio/after"}, 3);
}

/* A failed sync may have lost what it wrote (the kernel can drop the pages
 * of a failed write-back), leaving a hole in the middle of the journal that
 * replay stops at. So a change acknowledged after the failure must not sit
 * behind it in the same journal: it must survive the hole. */
TDT_TEST(durability,
         change_acknowledged_after_a_failed_sync_survives_its_hole) {
  start("%s/journal.*");
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  cr_assert_eq(td_publish(c, "hole/before", s, NULL), 0);
  char journal[128];
  newest_journal(journal, sizeof(journal));
  long long synced = synced_length(journal);
  touch("fail");
  cr_assert_eq(td_publish(c, "hole/failed", s, NULL), TD_EIO);
  rm("fail");
  struct stat sb;
  cr_assert_eq(stat(journal, &sb), 0);
  long long written = (long long)sb.st_size;
  cr_assert_gt(written, synced, "the failed change was written, not synced");
  cr_assert_eq(td_publish(c, "hole/after", s, NULL), 0, "%s", td_last_error(c));
  td_storage_release(s);
  td_close(c);
  kill9();

  /* The power cut: the failed sync's bytes never reached the disk; the
   * blocks hold whatever they held before. */
  int fd = open(journal, O_WRONLY | O_CLOEXEC);
  if (fd >= 0) { /* still the journal in use */
    char junk[4096];
    memset(junk, 0xa5, sizeof(junk));
    for (long long at = synced; at < written; at += (long long)sizeof(junk)) {
      size_t n = (size_t)(written - at) < sizeof(junk) ? (size_t)(written - at)
                                                       : sizeof(junk);
      cr_assert_eq(pwrite(fd, junk, n, (off_t)at), (ssize_t)n);
    }
    close(fd);
  }
  restart();
  c = tdt_connect(&d);
  cr_assert_geq(offset_of(c, "hole/after"), 0,
                "'hole/after' was acknowledged after the failed sync, and "
                "the restart lost it; see %s",
                d.log);
  cr_assert_geq(offset_of(c, "hole/before"), 0);
  td_close(c);
  finish((const char *const[]){"hole/before", "hole/failed", "hole/after"}, 3);
}

/* ---- compaction ---- */

TDT_TEST(durability, compaction_folds_the_journal_and_keys_survive) {
  start(NULL);
  unsigned long long first;
  cr_assert_eq(journals(&first), 1);
  churn ch;
  churn_open(&ch);
  churn_until_compaction(&ch, 0);
  /* A few more changes go to the journal after the snapshot. */
  churn_send_round(&ch);
  churn_wait(&ch, 0);
  unsigned long long lowest;
  for (int i = 0; i < 5000 && journals(&lowest) != 1; i++)
    tdt_sleep_ms(2);
  cr_assert_eq(journals(&lowest), 1, "the folded journal is removed");
  cr_assert_gt(lowest, first, "journal.%llu follows journal.%llu", lowest,
               first);
  kill9();
  churn_drain(&ch);
  tdt_raw_close(&ch.r);
  restart();
  check_acked(&ch);
  td_client *c = tdt_connect(&d);
  for (int i = 0; i < NKEYS; i++)
    cr_assert_eq(offset_of(c, key_name(i)), ch.round - 1, "key %d", i);
  td_close(c);
  finish(all_keys(), NKEYS);
}

/* Keys enough that a snapshot takes several loop turns to build (2048 keys
 * a turn), changed by a second connection that keeps two rounds in flight,
 * so that changes land between the slices of the build. */
enum { NBULK = 6000 };

static const char *bulk_name(int i) {
  static char names[NBULK][16];
  if (names[i][0] == '\0')
    snprintf(names[i], sizeof(names[i]), "bulk/%04d", i);
  return names[i];
}

static struct bulk {
  tdt_raw r;
  uint64_t id[16]; /* key i names storage i % 16: a build slices storages */
  int64_t sent[NBULK], acked[NBULK];
  uint64_t first_seq;
  int round;
} bulk;

static void bulk_send_round(void) {
  for (int i = 0; i < NBULK; i++) {
    tdt_raw_publish(&bulk.r, bulk_name(i), bulk.id[i % 16], bulk.round);
    bulk.sent[i] = bulk.round;
  }
  bulk.round++;
  tdt_raw_flush(&bulk.r);
}

/* Reads replies until at most rounds_in_flight rounds are unanswered, or
 * (drain) until the connection ends. */
static void bulk_wait(int rounds_in_flight, int drain) {
  int done = bulk.round > rounds_in_flight ? bulk.round - rounds_in_flight : 0;
  uint64_t want = (uint64_t)done * NBULK, got = 0;
  for (int i = 0; i < NBULK; i++)
    got += (uint64_t)(bulk.acked[i] + 1);
  while (drain || got < want) {
    Tensord__Response *rep = tdt_raw_reply(&bulk.r, drain ? 5000 : 20000);
    if (rep == NULL) {
      cr_assert(drain, "bulk replies stopped at %llu of %llu",
                (unsigned long long)got, (unsigned long long)want);
      cr_assert(bulk.r.eof, "the dead daemon's connection ends");
      return;
    }
    uint64_t n = rep->seq - bulk.first_seq;
    cr_assert_eq(rep->body_case, TENSORD__RESPONSE__BODY_OK, "publish %llu",
                 (unsigned long long)n);
    bulk.acked[n % NBULK] = (int64_t)(n / NBULK);
    tensord__response__free_unpacked(rep, NULL);
    got++;
  }
}

TDT_TEST(durability, a_snapshot_built_in_slices_keeps_what_changed_meanwhile,
         .timeout = 120) {
  start(NULL);
  /* NBULK keys published once and never again: after the crash they come
   * back from the snapshot alone, so a build that skips a storage between
   * two slices loses some. */
  memset(&bulk, 0, sizeof(bulk));
  tdt_raw_open(&bulk.r, &d);
  for (int i = 0; i < 16; i++)
    bulk.id[i] = tdt_raw_create_now(&bulk.r, 4096);
  for (int i = 0; i < NBULK; i++)
    bulk.sent[i] = bulk.acked[i] = -1;
  bulk.first_seq = bulk.r.seq + 1;
  bulk_send_round();
  bulk_wait(0, 0);
  /* The churn's keys change while the snapshot is built (its rounds are in
   * flight): the journal after it has the changes. */
  churn ch;
  churn_open(&ch);
  churn_until_compaction(&ch, 0);
  for (int i = 0; i < 1000 && !tdt_log_has(&d, "compacted into snapshot");
       i++) {
    churn_send_round(&ch);
    churn_wait(&ch, 0);
  }
  cr_assert(tdt_log_has(&d, "loop turns"),
            "the snapshot was not built over several loop turns; see %s",
            d.log);
  cr_assert(tdt_log_has(&d, "compacted into snapshot"), "see %s", d.log);
  churn_send_round(&ch);
  kill9();
  churn_drain(&ch);
  tdt_raw_close(&ch.r);
  bulk_wait(0, 1);
  tdt_raw_close(&bulk.r);
  restart();
  check_acked(&ch);
  td_client *c = tdt_connect(&d);
  for (int i = 0; i < NBULK; i++)
    cr_assert_eq(offset_of(c, bulk_name(i)), 0, "key %s lost", bulk_name(i));
  td_close(c);
  static const char *keys[NBULK + NKEYS];
  for (int i = 0; i < NBULK; i++)
    keys[i] = bulk_name(i);
  for (int i = 0; i < NKEYS; i++)
    keys[NBULK + i] = key_name(i);
  finish(keys, NBULK + NKEYS);
}

/* SIGKILL while the compaction's snapshot is being synced (before its
 * rename), or while the state directory is (after the rename, before the
 * old journals go). */
static void crash_during_compaction(const char *match) {
  start(match);
  touch("gate");
  churn ch;
  churn_open(&ch);
  churn_until_compaction(&ch, 1);
  wait_gate_reached();
  /* Changes made while it compacts: held, maybe written, never synced. */
  churn_send_round(&ch);
  kill9();
  churn_drain(&ch);
  tdt_raw_close(&ch.r);
  rm("gate");
  restart();
  check_acked(&ch);
  finish(all_keys(), NKEYS);
}

TDT_TEST(durability, sigkill_while_the_compacted_snapshot_is_written) {
  crash_during_compaction("%s/snapshot.tmp");
}

TDT_TEST(durability, sigkill_after_the_compacted_snapshot_is_renamed) {
  crash_during_compaction("%s");
}

/* ---- a start that fails ---- */

TDT_TEST(durability, start_that_cannot_write_its_snapshot_keeps_the_segments) {
  start(NULL);
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0);
  uint8_t *p = td_storage_data(s);
  for (int i = 0; i < 4096; i++)
    p[i] = (uint8_t)(i * 7 + 1);
  cr_assert_eq(td_publish(c, "kept/k", s, NULL), 0);
  td_storage_release(s);
  td_close(c);
  uint64_t inst = d.instance;
  cr_assert_eq(kill(d.pid, SIGTERM), 0);
  cr_assert_eq(tdt_wait(d.pid), 0);
  d.pid = 0;
  cr_assert_eq(tdt_segments_of(inst), 1,
               "a clean stop keeps the key's segment");

  /* The next start serves the key, then cannot write its snapshot. */
  char tmp[96];
  snprintf(tmp, sizeof(tmp), "%s/snapshot.tmp", state_dir);
  cr_assert_eq(mkdir(tmp, 0700), 0);
  int st = tdt_wait(spawn());
  cr_assert_eq(st, 1, "tensord exited %d; see %s", st, d.log);
  cr_assert(tdt_log_has(&d, "writing snapshot"), "see %s", d.log);
  cr_assert_eq(tdt_segments_of(inst), 1,
               "the failed start unlinked the segment its state names");

  /* Once the operator fixes it, the key is served with its bytes. */
  cr_assert_eq(rmdir(tmp), 0);
  restart();
  c = tdt_connect(&d);
  td_view v;
  cr_assert_eq(td_lookup(c, "kept/k", TD_RDONLY, 0, &s, &v), 0, "%s",
               td_last_error(c));
  p = td_storage_data(s);
  for (int i = 0; i < 4096; i++)
    cr_assert_eq(p[i], (uint8_t)(i * 7 + 1), "byte %d", i);
  td_storage_release(s);
  td_close(c);
  finish((const char *const[]){"kept/k"}, 1);
}

/* ---- scopes: keys in flight are never journaled ---- */

/* Whether any file in the state directory holds the bytes of needle. */
static int state_has(const char *needle) {
  DIR *dir = opendir(state_dir);
  cr_assert_not_null(dir);
  int found = 0;
  struct dirent *e;
  while (!found && (e = readdir(dir)) != NULL) {
    char p[512];
    snprintf(p, sizeof(p), "%s/%s", state_dir, e->d_name);
    struct stat sb;
    if (stat(p, &sb) != 0 || !S_ISREG(sb.st_mode) || sb.st_size == 0)
      continue;
    FILE *f = fopen(p, "rb");
    cr_assert_not_null(f, "%s: %s", p, strerror(errno));
    char *buf = malloc((size_t)sb.st_size);
    cr_assert_not_null(buf);
    size_t n = fread(buf, 1, (size_t)sb.st_size, f);
    fclose(f);
    found = memmem(buf, n, needle, strlen(needle)) != NULL;
    free(buf);
  }
  closedir(dir);
  return found;
}

static td_storage *scope_storage(td_client *c, uint8_t v) {
  td_storage *s = NULL;
  cr_assert_eq(td_storage_create(c, 4096, &s), 0, "%s", td_last_error(c));
  memset(td_storage_data(s), v, 4096);
  return s;
}

static void publish_scoped(td_client *c, const char *key, td_storage *s,
                           uint64_t scope) {
  td_publish_opts o = {0};
  o.scope = scope;
  cr_assert_eq(td_publish_ex(c, key, s, NULL, &o), 0, "publish '%s': %s", key,
               td_last_error(c));
}

/* After a restart: "scope/kept" is served with its bytes, "scope/flight" is
 * not, and of instance inst's segments only the kept key's is left. */
static void only_the_ordinary_key_is_back(uint64_t inst) {
  td_client *c = tdt_connect(&d);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "scope/kept", TD_RDONLY, 0, &s, NULL), 0,
               "the ordinary key was lost: %s", td_last_error(c));
  cr_assert_eq(((const uint8_t *)td_storage_data(s))[4095], 0x11);
  td_storage_release(s);
  cr_assert_eq(td_lookup(c, "scope/flight", TD_RDONLY, 0, &s, NULL), TD_ENOENT,
               "a scoped key came back after a restart");
  td_close(c);
  cr_assert_eq(tdt_segments_of(inst), 1,
               "%d segment(s) of the first instance left; the scoped key's "
               "should be swept",
               tdt_segments_of(inst));
}

TDT_TEST(durability, scoped_keys_are_never_journaled_and_gone_after_a_crash) {
  start(NULL);
  uint64_t inst = d.instance;
  td_client *c = tdt_connect(&d);
  uint64_t t = 0;
  cr_assert_eq(td_scope_open(c, &t), 0, "%s", td_last_error(c));
  td_storage *kept = scope_storage(c, 0x11), *flying = scope_storage(c, 0x22);
  cr_assert_eq(td_publish(c, "scope/kept", kept, NULL), 0);
  publish_scoped(c, "scope/flight", flying, t);
  /* Taken and unpublished scoped keys leave no record either. */
  publish_scoped(c, "scope/taken", flying, t);
  publish_scoped(c, "scope/unpublished", flying, t);
  td_storage *got;
  cr_assert_eq(td_lookup(c, "scope/taken", TD_TAKE, 0, &got, NULL), 0, "%s",
               td_last_error(c));
  td_storage_release(got);
  cr_assert_eq(td_unpublish(c, "scope/unpublished"), 0);
  td_storage_release(kept);
  td_storage_release(flying);
  /* Every reply above came after its change reached the journal. */
  cr_assert(state_has("scope/kept"), "the ordinary key is not journaled");
  cr_assert(!state_has("scope/flight"), "a scoped key was journaled");
  cr_assert(!state_has("scope/taken"));
  cr_assert(!state_has("scope/unpublished"));
  cr_assert_eq(tdt_segments(&d), 2);

  kill9(); /* the scope's owner is still connected */
  td_close(c);
  restart();
  only_the_ordinary_key_is_back(inst);
  finish((const char *const[]){"scope/kept"}, 1);
}

TDT_TEST(durability, a_stop_drops_scoped_keys_and_keeps_ordinary_ones) {
  start(NULL);
  uint64_t inst = d.instance;
  td_client *c = tdt_connect(&d);
  uint64_t t = 0;
  cr_assert_eq(td_scope_open(c, &t), 0, "%s", td_last_error(c));
  td_storage *kept = scope_storage(c, 0x11), *flying = scope_storage(c, 0x22);
  cr_assert_eq(td_publish(c, "scope/kept", kept, NULL), 0);
  publish_scoped(c, "scope/flight", flying, t);
  td_storage_release(kept);
  td_storage_release(flying);
  /* A stop with the scope's owner connected: the scope ends with it. */
  cr_assert_eq(kill(d.pid, SIGTERM), 0);
  cr_assert_eq(tdt_wait(d.pid), 0, "see %s", d.log);
  d.pid = 0;
  td_close(c);
  cr_assert_eq(tdt_segments_of(inst), 1,
               "the stop kept the scoped key's segment, or lost the other");
  cr_assert(!state_has("scope/flight"), "the final snapshot has it");
  restart();
  only_the_ordinary_key_is_back(inst);
  finish((const char *const[]){"scope/kept"}, 1);
}

/* A failed journal sync starts a compaction at once: its snapshot, built
 * while the scoped key lives, must leave it out. */
TDT_TEST(durability, a_compacted_snapshot_leaves_scoped_keys_out) {
  start("%s/journal.*");
  uint64_t inst = d.instance;
  td_client *c = tdt_connect(&d);
  uint64_t t = 0;
  cr_assert_eq(td_scope_open(c, &t), 0, "%s", td_last_error(c));
  td_storage *kept = scope_storage(c, 0x11), *flying = scope_storage(c, 0x22);
  publish_scoped(c, "scope/flight", flying, t);
  cr_assert_eq(td_publish(c, "scope/kept", kept, NULL), 0);
  touch("fail");
  cr_assert_eq(td_publish(c, "scope/failed", kept, NULL), TD_EIO);
  rm("fail");
  for (int i = 0; i < 5000 && !tdt_log_has(&d, "compacted into snapshot"); i++)
    tdt_sleep_ms(2);
  cr_assert(tdt_log_has(&d, "compacted into snapshot"), "see %s", d.log);
  char snap[128];
  snprintf(snap, sizeof(snap), "%s/snapshot", state_dir);
  struct stat sb;
  cr_assert_eq(stat(snap, &sb), 0, "no snapshot in %s", state_dir);
  cr_assert(state_has("scope/kept"));
  cr_assert(!state_has("scope/flight"), "the snapshot has the scoped key");
  td_storage_release(kept);
  td_storage_release(flying);

  kill9();
  td_close(c);
  restart();
  only_the_ordinary_key_is_back(inst);
  finish((const char *const[]){"scope/kept", "scope/failed"}, 2);
}

/* ---- channels: never journaled ---- */

/* A restart closes every connection, so every end of every channel goes,
 * and each channel with them; its slots are storages no key names, freed
 * like any other. With crash, tensord is killed instead of stopped: the
 * next start's sweep unlinks them. Either way the channel's name is free,
 * the keys are back, and no slot's segment is left. */
static void restart_with_a_channel(int crash) {
  start(NULL);
  uint64_t inst = d.instance;
  td_client *c = tdt_connect(&d);
  td_storage *k = scope_storage(c, 0x5a);
  cr_assert_eq(td_publish(c, "chan/kept", k, NULL), 0, "%s", td_last_error(c));
  td_storage_release(k);
  td_chan_opts o = {.capacity = 8, .slots = 3, .slot_bytes = 4096};
  td_chan *ch;
  cr_assert_eq(td_chan_create(c, "chan/pipe", &o, &ch), 0, "%s",
               td_last_error(c));
  /* A slot in the ring, one on loan, and a storage in flight. */
  td_view v;
  int64_t shape[1] = {4096};
  cr_assert_eq(td_view_contiguous(TD_UINT8, 1, shape, &v), 0);
  td_storage *sent, *loaned, *plain;
  cr_assert_eq(td_chan_loan(ch, 0, &sent), 0, "%s", td_last_error(c));
  cr_assert_eq(td_chan_send(ch, sent, &v, 0), 0, "%s", td_last_error(c));
  cr_assert_eq(td_chan_loan(ch, 0, &loaned), 0, "%s", td_last_error(c));
  plain = scope_storage(c, 0x77);
  cr_assert_eq(td_chan_send(ch, plain, &v, 0), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_segments(&d), 5, "the key's, 3 slots and one in flight");
  cr_assert(state_has("chan/kept"));
  cr_assert(!state_has("chan/pipe"), "a channel was journaled");

  if (crash) {
    kill9();
  } else {
    cr_assert_eq(kill(d.pid, SIGTERM), 0);
    cr_assert_eq(tdt_wait(d.pid), 0, "see %s", d.log);
    d.pid = 0;
    /* The stop itself freed the channel's storages: only the key's is kept
     * for the next start, and nothing is pooled. */
    cr_assert_eq(tdt_segments_of(inst), 1,
                 "%d segment(s) kept; only the key's should be",
                 tdt_segments_of(inst));
    cr_assert_eq(tdt_pooled_of(inst), 0);
  }
  td_storage_release(loaned);
  td_chan_close(ch);
  td_close(c);
  restart();

  c = tdt_connect(&d);
  td_chan *again = NULL;
  cr_assert_eq(td_chan_open(c, "chan/pipe", 0, 0, &again), TD_ENOENT,
               "the channel came back: %s", td_last_error(c));
  cr_assert_null(again);
  td_storage *s;
  cr_assert_eq(td_lookup(c, "chan/kept", TD_RDONLY, 0, &s, NULL), 0,
               "the key was lost: %s", td_last_error(c));
  cr_assert_eq(((const uint8_t *)td_storage_data(s))[4095], 0x5a);
  td_storage_release(s);
  td_stat st;
  cr_assert_eq(td_stat_get(c, &st), 0);
  cr_assert_eq(st.storages, 1, "%llu storage(s) after the restart",
               (unsigned long long)st.storages);
  /* The name is free for a channel of this instance. */
  td_chan_opts o2 = {.capacity = 4};
  cr_assert_eq(td_chan_create(c, "chan/pipe", &o2, &again), 0, "%s",
               td_last_error(c));
  td_chan_close(again);
  td_close(c);
  cr_assert_eq(tdt_segments_of(inst), 1,
               "%d segment(s) of the first instance left; the slots' should "
               "be gone",
               tdt_segments_of(inst));
  cr_assert_eq(tdt_pooled_of(inst), 0);
  finish((const char *const[]){"chan/kept"}, 1);
}

TDT_TEST(durability, a_restart_closes_channels_and_frees_their_slots) {
  restart_with_a_channel(0);
}

TDT_TEST(durability, a_crash_loses_channels_and_the_start_sweeps_their_slots) {
  restart_with_a_channel(1);
}
