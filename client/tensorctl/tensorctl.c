/* tensorctl.c: the operator's view of tensord: ls, stat, info, show, rm,
 * ping, metrics, top, watch; and models: load, save, unload. */
#include "clitext.h"
#include "show.h"
#include "tensord.h"
#include "top.h"

#include <errno.h>
#include <getopt.h>
#include <grp.h>
#include <pwd.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static int json;
static int longfmt;     /* ls -l */
static long long count; /* watch -n: stop after this many events; 0: never */
static int64_t now_ms;

/* One subcommand: its synopsis (after "tensorctl"), the line or lines the
 * command list gives it, and what its own usage adds (tensorctl CMD -h,
 * tensorctl help CMD). show's usage is show.c's. */
typedef struct command {
  const char *name;
  const char *synopsis;
  const char *summary;
  const char *details;
} command;

static const command commands[] = {
    {"ls", "ls [-l]",
     "every live storage: id, device, size, references,\n"
     "holders (pids and names), keys, age; -l adds mode,\n"
     "owner, group; then every channel: depth, slots, ends",
     "  -l   mode, owner and group in front of each row\n"
     "\n"
     "HOLDERS are PID (NAME), NAME the name each client connected with:\n"
     "td_connect_opts.name, tensord.connect(name=...), $TENSORD_CLIENT_NAME,\n"
     "else its program (a Python script's name; DataLoader workers are\n"
     "PROGRAM worker N). A channel holds its slots and the storages sent\n"
     "on it and not yet received: it shows as chan:NAME.\n"
     "\n"
     "Channels follow, one row each: DEPTH entries in its ring of its\n"
     "capacity; SLOTS, how many, then free, on loan, in the ring and held\n"
     "by receivers; IN FLIGHT, storages sent (not slots) and not received;\n"
     "ENDS, each open end: PID (NAME), its side, and slots it has out.\n"},
    {"stat", "stat",
     "totals: storages, bytes used / capacity, clients,\n"
     "keys, uptime, version, instance and the prefixes\n"
     "of its segments in /dev/shm",
     NULL},
    {"info", "info ID|KEY",
     "everything about one storage, with its published\n"
     "views; a state dict's tensors",
     "An argument made only of digits is tried as an id first, then as a\n"
     "key. A view that holds a state dict of tensord.torch's\n"
     "publish_state_dict lists its tensors: name, dtype, shape, bytes\n"
     "(tensorctl show KEY TENSOR shows one).\n"},
    {"show", "show KEY|ID [INDEX]",
     "a view's statistics and first and last elements;\n"
     "a state dict's tensors, or with TENSOR one of them\n"
     "(tensorctl show --help)",
     NULL},
    {"rm", "rm KEY", "unpublish KEY", NULL},
    {"load", "load PATH [--as NAME] [options]",
     "load a safetensors checkpoint (a file, an index\n"
     "json, or a directory) as model NAME: a new version,\n"
     "switched to atomically",
     "  --as NAME        the model's name (default: the file's stem, or the\n"
     "                   directory's name for an index json or a directory)\n"
     "  --device DEV     cpu (default) or cuda:K: daemon-owned GPU storages,\n"
     "                   read through a pinned buffer of at most 256 MiB\n"
     "  --mode OCTAL     the storages' mode, e.g. 0640 (default 0600)\n"
     "  --force          load even if NAME already holds this file (same\n"
     "                   size and mtime), which otherwise does nothing\n"
     "  --wait SECONDS   another process is loading NAME: wait this long for\n"
     "                   it (default: as long as it takes; 0: fail at once)\n"
     "  --threads N      parallel readers (default: one per CPU, 2 to 8)\n"
     "  --quiet          no progress bar (shown on stderr if a terminal)\n"
     "\n"
     "Keys: NAME (the manifest), NAME@V/<shard file> (each shard's bytes,\n"
     "verbatim), NAME/<tensor> (each tensor's view); docs/models.md.\n"
     "Every rule of the format is checked first: an error names the file,\n"
     "the tensor and the field, and leaves nothing in tensord.\n"},
    {"save", "save NAME OUT",
     "write model NAME (or a publish_state_dict key) as\n"
     "safetensors: OUT a file, or a directory of shards\n"
     "and model.safetensors.index.json",
     "A model's shards are written as loaded (byte for byte); a state dict\n"
     "whose tensors are dense becomes one file. Each file goes to a temporary\n"
     "name first and is renamed when whole.\n"},
    {"unload", "unload NAME",
     "unpublish model NAME: its manifest, tensor and shard\n"
     "keys, of every version",
     "Storages go when the last process holding them lets go.\n"},
    {"ping", "ping", "round trip to tensord", NULL},
    {"metrics", "metrics",
     "the metrics in the Prometheus text format (what\n"
     "tensord --metrics serves)",
     "With --json: the request count, uptime and every connected client\n"
     "(pid, uid, name, requests, references, bytes held), busiest first,\n"
     "and the text.\n"},
    {"top", "top [--interval MS] [--once]",
     "a live view: largest storages, busiest clients,\n"
     "request rate; redrawn every MS (default 1000)\n"
     "until q or Ctrl-C; --once: one plain frame",
     "  --interval MS   redraw every MS milliseconds (10 to 3600000)\n"
     "  --once          one plain frame (rates over one interval), for a\n"
     "                  pipe or a log; without it stdout must be a terminal\n"
     "top takes no --json (tensorctl metrics --json has the figures).\n"},
    {"watch", "watch [-n N] [PREFIX]",
     "events as they happen, one line each (with --json:\n"
     "one JSON object each): create, publish, lookup,\n"
     "take, unpublish, free, connect, disconnect, refused;\n"
     "with PREFIX only those of keys that begin with it;\n"
     "-n N stops after N events",
     "Each event names the client that caused it: PID (NAME).\n"},
    {"upgrade", "upgrade [--binary PATH]",
     "live upgrade: tensord runs PATH (default: the\n"
     "path it was started from) with its arguments plus\n"
     "--upgrade and hands everything to it; clients\n"
     "notice nothing",
     NULL},
    {"help", "help [COMMAND]", "this text, or COMMAND's usage", NULL},
};
#define NCOMMANDS (sizeof(commands) / sizeof(commands[0]))

static const command *find_command(const char *name) {
  for (size_t i = 0; i < NCOMMANDS; i++)
    if (strcmp(commands[i].name, name) == 0)
      return &commands[i];
  return NULL;
}

/* Writes text, each of its lines after the first indented by indent
 * spaces. */
static void indented(FILE *f, const char *text, int indent) {
  for (const char *p = text; *p;) {
    size_t n = strcspn(p, "\n");
    fprintf(f, "%.*s\n", (int)n, p);
    p += n;
    if (*p == '\n')
      p++;
    if (*p)
      fprintf(f, "%*s", indent, "");
  }
}

static const char socket_option[] =
    "  --socket PATH  tensord's socket (default: $TENSORD_SOCKET, else\n"
    "                 $XDG_RUNTIME_DIR/tensord.sock, else\n"
    "                 /tmp/tensord-<uid>/tensord.sock)\n";
static const char json_option[] =
    "  --json         one JSON document on stdout (see docs/cli.md)\n";

static void usage(FILE *f) {
  fprintf(f, "usage: tensorctl [--socket PATH] [--json] COMMAND [ARG]\n"
             "\n"
             "commands:\n");
  for (size_t i = 0; i < NCOMMANDS; i++) {
    const command *c = &commands[i];
    if (strlen(c->synopsis) <= 11)
      fprintf(f, "  %-11s ", c->synopsis);
    else
      fprintf(f, "  %s\n%14s", c->synopsis, "");
    indented(f, c->summary, 14);
  }
  fprintf(f,
          "\n%s%s\n"
          "tensorctl COMMAND --help (or tensorctl help COMMAND): "
          "COMMAND's usage\n"
          "exit status: 0 ok, 1 error, 2 usage\n",
          socket_option, json_option);
}

/* COMMAND's own usage: tensorctl COMMAND -h, tensorctl help COMMAND. */
static void command_usage(const command *c, FILE *f) {
  if (strcmp(c->name, "show") == 0) {
    td__show_usage(f);
    return;
  }
  if (strcmp(c->name, "help") == 0) {
    usage(f);
    return;
  }
  int has_json = strcmp(c->name, "top") != 0;
  fprintf(f, "usage: tensorctl %s%s [--socket PATH]\n\n", c->synopsis,
          has_json ? " [--json]" : "");
  indented(f, c->summary, 0);
  if (c->details != NULL) {
    fputc('\n', f);
    fputs(c->details, f);
  }
  fprintf(f, "\n%s%s", socket_option, has_json ? json_option : "");
}

static const char *device_name(td_device d) {
  return d == TD_CUDA ? "cuda" : "cpu";
}

/* The daemon's GPUs, read once (for the cuda:K of its storages). */
static td_client *conn;
static td_device_stat gpus[64];
static size_t ngpus;
static int gpus_read;

/* "cpu", or "cuda:K" with K the daemon's ordinal of the storage's GPU
 * ("cuda:?" if the daemon does not list it). */
static const char *device_label(const td_storage_info *s, char *buf,
                                size_t len) {
  if (s->device != TD_CUDA)
    return device_name(s->device);
  if (!gpus_read) {
    gpus_read = 1;
    if (td_stat_devices(conn, gpus, sizeof(gpus) / sizeof(gpus[0]), &ngpus) < 0)
      ngpus = 0;
    if (ngpus > sizeof(gpus) / sizeof(gpus[0]))
      ngpus = sizeof(gpus) / sizeof(gpus[0]);
  }
  for (size_t i = 0; i < ngpus; i++)
    if (memcmp(gpus[i].uuid, s->device_uuid, 16) == 0) {
      snprintf(buf, len, "cuda:%d", gpus[i].index);
      return buf;
    }
  snprintf(buf, len, "cuda:?");
  return buf;
}

static void json_storage(const td_storage_info *s) {
  char us[48];
  if (s->device == TD_CUDA)
    printf("{\"device_uuid\":\"%s\",",
           td_gpu_uuid_str(s->device_uuid, (int)s->device_mig, us, sizeof(us)));
  else
    putchar('{');
  printf("\"id\":%" PRIu64 ",\"device\":\"%s\",\"nbytes\":%" PRIu64
         ",\"refs\":%u,\"owner_pid\":%d,\"owner_uid\":%u,"
         "\"owner_gid\":%u,\"mode\":\"%04o\","
         "\"created_unix_ms\":%" PRId64 ",\"age_ms\":%" PRId64 ",\"holders\":[",
         s->id, device_name(s->device), s->nbytes, s->refs, s->owner_pid,
         s->owner_uid, s->owner_gid, s->mode, s->created_unix_ms,
         now_ms - s->created_unix_ms);
  for (size_t i = 0; i < s->nholders; i++) {
    printf("%s{\"pid\":%d,\"uid\":%u,\"refs\":%u,\"name\":", i ? "," : "",
           s->holders[i].pid, s->holders[i].uid, s->holders[i].refs);
    td__cli_json_str(s->holders[i].name ? s->holders[i].name : "");
    putchar('}');
  }
  printf("],\"keys\":[");
  for (size_t i = 0; i < s->nkeys; i++) {
    if (i)
      putchar(',');
    td__cli_json_str(s->keys[i]);
  }
  printf("],\"nkeys\":%zu}", s->nkeys_total);
}

/* Returns the name of uid, or the number; valid until the next call. */
static const char *user_name(uint32_t uid) {
  static char buf[32];
  struct passwd *pw = getpwuid(uid);
  if (pw != NULL)
    return pw->pw_name;
  snprintf(buf, sizeof(buf), "%u", uid);
  return buf;
}

static const char *group_name(uint32_t gid) {
  static char buf[32];
  struct group *gr = getgrgid(gid);
  if (gr != NULL)
    return gr->gr_name;
  snprintf(buf, sizeof(buf), "%u", gid);
  return buf;
}

/* "4242 (loader)", or "4242" for a client that gave no name. */
static const char *pid_at(const void *arg, size_t i, char *buf, size_t len) {
  const td_holder *h = &((const td_storage_info *)arg)->holders[i];
  char name[TD_KEY_MAX + 8];
  if (h->pid == 0 && h->name != NULL && strncmp(h->name, "chan:", 5) == 0)
    snprintf(buf, len, "%s", td__cli_printable(h->name, name, sizeof(name)));
  else if (h->name != NULL && h->name[0] != '\0')
    snprintf(buf, len, "%d (%s)", h->pid,
             td__cli_printable(h->name, name, sizeof(name)));
  else
    snprintf(buf, len, "%d", h->pid);
  return buf;
}

static const char *key_at(const void *arg, size_t i, char *buf, size_t len) {
  return td__cli_printable(((const td_storage_info *)arg)->keys[i], buf, len);
}

/* Joins items 0..n-1 with commas into buf, whole items only; if some do not
 * fit, or total > n, ends with " (+K more)". "-" if there are none. */
static void join_list(char *buf, size_t len, size_t n, size_t total,
                      const char *(*at)(const void *, size_t, char *, size_t),
                      const void *arg) {
  const size_t tail = 24; /* room for " (+K more)" */
  size_t used = 0, shown = 0;
  buf[0] = '\0';
  for (; shown < n; shown++) {
    char tmp[TD_KEY_MAX + 1];
    const char *item = at(arg, shown, tmp, sizeof(tmp));
    size_t need = strlen(item) + (shown ? 1 : 0);
    if (used + need + tail >= len)
      break;
    used += (size_t)snprintf(buf + used, len - used, "%s%s", shown ? "," : "",
                             item);
  }
  if (shown < total)
    snprintf(buf + used, len - used, "%s(+%zu more)", shown ? " " : "",
             total - shown);
  if (buf[0] == '\0')
    snprintf(buf, len, "-");
}

/* ---- ls ---- */

typedef struct ls_state {
  size_t n;
} ls_state;

static int ls_row(const td_storage_info *s, void *arg) {
  ls_state *st = arg;
  if (json) {
    if (st->n)
      putchar(',');
    json_storage(s);
    st->n++;
    return 0;
  }
  char size[32], ag[32], holders[256], keys[256];
  join_list(holders, sizeof(holders), s->nholders, s->nholders, pid_at, s);
  join_list(keys, sizeof(keys), s->nkeys, s->nkeys_total, key_at, s);
  if (st->n++ == 0) {
    if (longfmt)
      printf("%-10s %-8s %-8s ", "MODE", "OWNER", "GROUP");
    printf("%-8s %-7s %10s %5s %-24s %-24s %s\n", "ID", "DEVICE", "SIZE",
           "REFS", "HOLDERS", "KEYS", "AGE");
  }
  if (longfmt) {
    char mode[11] = "----------";
    for (int i = 0; i < 3; i++) {
      unsigned bits = (s->mode >> (6 - 3 * i)) & 7;
      mode[1 + 3 * i] = bits & 4 ? 'r' : '-';
      mode[2 + 3 * i] = bits & 2 ? 'w' : '-';
    }
    printf("%-10s %-8s %-8s ", mode, user_name(s->owner_uid),
           group_name(s->owner_gid));
  }
  char dl[32];
  printf("%-8" PRIu64 " %-7s %10s %5u %-24s %-24s %s\n", s->id,
         device_label(s, dl, sizeof(dl)),
         td__cli_bytes(s->nbytes, size, sizeof(size)), s->refs, holders, keys,
         td__cli_age(now_ms - s->created_unix_ms, ag, sizeof(ag)));
  return 0;
}

/* "4242 (loader) send", with what it has out: "4242 (main) recv held 3". */
static const char *end_at(const void *arg, size_t i, char *buf, size_t len) {
  const td_chan_end_info *e = &((const td_chan_info *)arg)->ends[i];
  char name[TD_CLIENT_NAME_MAX + 1];
  int n = e->name[0] ? snprintf(buf, len, "%d (%s) ", e->pid,
                                td__cli_printable(e->name, name, sizeof(name)))
                     : snprintf(buf, len, "%d ", e->pid);
  const char *side = e->flags == TD_CHAN_SEND   ? "send"
                     : e->flags == TD_CHAN_RECV ? "recv"
                                                : "send+recv";
  n += snprintf(buf + n, len - (size_t)n, "%s%s", side, e->left ? " left" : "");
  if (e->loaned)
    n += snprintf(buf + n, len - (size_t)n, " loaned %u", e->loaned);
  if (e->held)
    snprintf(buf + n, len - (size_t)n, " held %u", e->held);
  return buf;
}

static void json_chan(const td_chan_info *ch) {
  printf("{\"name\":");
  td__cli_json_str(ch->name);
  printf(",\"id\":%" PRIu64 ",\"capacity\":%u,\"depth\":%u,\"slots\":%u,"
         "\"slots_free\":%u,\"slots_loaned\":%u,\"slots_queued\":%u,"
         "\"slots_held\":%u,\"slot_bytes\":%" PRIu64 ",\"senders\":%u,"
         "\"receivers\":%u,\"mode\":%u,\"owner_uid\":%u,\"owner_pid\":%d,"
         "\"in_flight\":%" PRIu64 ",\"corrupt\":%s,\"sent\":%" PRIu64
         ",\"received\":%" PRIu64 ",\"ends\":[",
         ch->id, ch->capacity, ch->depth, ch->slots, ch->slots_free,
         ch->slots_loaned, ch->slots_queued, ch->slots_held, ch->slot_bytes,
         ch->senders, ch->receivers, ch->mode, ch->owner_uid, ch->owner_pid,
         ch->in_flight, ch->corrupt ? "true" : "false", ch->sent, ch->received);
  for (size_t i = 0; i < ch->nends; i++) {
    const td_chan_end_info *e = &ch->ends[i];
    printf("%s{\"end\":%u,\"pid\":%d,\"uid\":%u,\"name\":", i ? "," : "",
           e->end, e->pid, e->uid);
    td__cli_json_str(e->name);
    printf(",\"send\":%s,\"recv\":%s,\"left\":%s,\"loaned\":%u,"
           "\"held\":%u}",
           e->flags & TD_CHAN_SEND ? "true" : "false",
           e->flags & TD_CHAN_RECV ? "true" : "false",
           e->left ? "true" : "false", e->loaned, e->held);
  }
  printf("],\"slot_ids\":[");
  for (size_t i = 0; i < ch->nslot_ids; i++)
    printf("%s%" PRIu64, i ? "," : "", ch->slot_ids[i]);
  printf("]}");
}

static int ls_chan(const td_chan_info *ch, void *arg) {
  ls_state *st = arg;
  if (json) {
    if (st->n)
      putchar(',');
    json_chan(ch);
    st->n++;
    return 0;
  }
  if (st->n++ == 0)
    printf("\n%-20s %9s %-24s %10s %9s %s\n", "CHANNEL", "DEPTH",
           "SLOTS free/loan/ring/held", "SLOT SIZE", "IN FLIGHT", "ENDS");
  char name[TD_KEY_MAX + 1], depth[32], slots[48], size[32], ends[512];
  snprintf(depth, sizeof(depth), "%u/%u", ch->depth, ch->capacity);
  if (ch->slots)
    snprintf(slots, sizeof(slots), "%u: %u/%u/%u/%u", ch->slots, ch->slots_free,
             ch->slots_loaned, ch->slots_queued, ch->slots_held);
  else
    snprintf(slots, sizeof(slots), "-");
  join_list(ends, sizeof(ends), ch->nends, ch->nends, end_at, ch);
  printf("%-20s %9s %-24s %10s %9" PRIu64 " %s%s\n",
         td__cli_printable(ch->name, name, sizeof(name)), depth, slots,
         ch->slots ? td__cli_bytes(ch->slot_bytes, size, sizeof(size)) : "-",
         ch->in_flight, ends, ch->corrupt ? " CORRUPT (closed)" : "");
  return 0;
}

static int cmd_ls(td_client *c) {
  ls_state st = {0}, cst = {0};
  if (json)
    printf("{\"storages\":[");
  int err = td_list(c, ls_row, &st);
  if (json)
    printf("],\"count\":%zu,\"channels\":[", st.n);
  else if (err == 0 && st.n == 0)
    printf("no storages\n");
  /* Channels, each a holder of its slots and of what is in flight. */
  if (err == 0)
    err = td_chan_list(c, ls_chan, &cst);
  if (json) {
    /* Always a whole document, even when the listing was cut short. */
    printf("]");
    if (err < 0) {
      printf(",\"error\":");
      td__cli_json_str(td_last_error(c));
    }
    printf("}\n");
  }
  return err;
}

/* ---- stat ---- */

static int cmd_stat(td_client *c) {
  td_stat st;
  int err = td_stat_get(c, &st);
  if (err < 0)
    return err;
  char a[32], b[32], d[32], u[48];
  gpus_read = 1;
  if ((err = td_stat_devices(c, gpus, sizeof(gpus) / sizeof(gpus[0]), &ngpus)) <
      0)
    return err;
  if (ngpus > sizeof(gpus) / sizeof(gpus[0]))
    ngpus = sizeof(gpus) / sizeof(gpus[0]);
  static char prefixes[256][TD_PREFIX_MAX];
  size_t np;
  if ((err = td_stat_prefixes(c, prefixes, 256, &np)) < 0)
    return err;
  size_t shown = np < 256 ? np : 256;
  if (json) {
    printf("{\"storages\":%" PRIu64 ",\"bytes_used\":%" PRIu64
           ",\"capacity\":%" PRIu64 ",\"shm_free\":%" PRIu64
           ",\"clients\":%" PRIu64 ",\"keys\":%" PRIu64 ",\"waiters\":%" PRIu64
           ",\"uptime_ms\":%" PRId64 ",\"pid\":%d,\"quota\":%" PRIu64
           ",\"max_clients\":%u,\"max_storages_per_client\":%u,"
           "\"daemon_rss_bytes\":%" PRIu64 ",\"daemon_heap_bytes\":%" PRIu64
           ",\"version\":",
           st.storages, st.bytes_used, st.capacity, st.shm_free, st.clients,
           st.keys, st.waiters, st.uptime_ms, st.pid, st.quota, st.max_clients,
           st.max_storages_per_client, st.daemon_rss_bytes,
           st.daemon_heap_bytes);
    td__cli_json_str(st.version);
    printf(",\"socket\":");
    td__cli_json_str(st.socket);
    printf(",\"state_dir\":");
    td__cli_json_str(st.state_dir);
    printf(",\"instance\":\"%016" PRIx64 "\",\"prefixes\":[", st.instance);
    for (size_t i = 0; i < shown; i++) {
      printf("%s", i ? "," : "");
      td__cli_json_str(prefixes[i]);
    }
    printf("]");
    printf(",\"pool\":{\"segments\":%" PRIu64 ",\"bytes\":%" PRIu64
           ",\"limit\":%" PRIu64 ",\"hits\":%" PRIu64 ",\"misses\":%" PRIu64
           "},\"devices\":[",
           st.pool_segments, st.pool_bytes, st.pool_limit, st.pool_hits,
           st.pool_misses);
    for (size_t i = 0; i < ngpus; i++)
      printf("%s{\"device\":\"cuda:%d\",\"uuid\":\"%s\",\"bytes_used\":%" PRIu64
             ",\"capacity\":%" PRIu64 ",\"storages\":%" PRIu64
             ",\"pool_bytes\":%" PRIu64 ",\"pool_allocs\":%" PRIu64 "}",
             i ? "," : "", gpus[i].index,
             td_gpu_uuid_str(gpus[i].uuid, (int)gpus[i].mig, u, sizeof(u)),
             gpus[i].bytes_used, gpus[i].capacity, gpus[i].storages,
             gpus[i].pool_bytes, gpus[i].pool_allocs);
    printf("]}\n");
    return 0;
  }
  printf("storages  %" PRIu64 "\n", st.storages);
  printf("used      %s / %s (%.1f%%)\n",
         td__cli_bytes(st.bytes_used, a, sizeof(a)),
         td__cli_bytes(st.capacity, b, sizeof(b)),
         st.capacity ? 100.0 * (double)st.bytes_used / (double)st.capacity
                     : 0.0);
  printf("shm free  %s\n", td__cli_bytes(st.shm_free, d, sizeof(d)));
  printf("clients   %" PRIu64 "\n", st.clients);
  printf("keys      %" PRIu64 "\n", st.keys);
  printf("waiters   %" PRIu64 "\n", st.waiters);
  printf("uptime    %s\n", td__cli_age(st.uptime_ms, u, sizeof(u)));
  printf("version   %s (pid %d)\n", st.version, st.pid);
  if (st.daemon_rss_bytes)
    printf("memory    %s resident, %s heap (tensord itself)\n",
           td__cli_bytes(st.daemon_rss_bytes, a, sizeof(a)),
           td__cli_bytes(st.daemon_heap_bytes, b, sizeof(b)));
  printf("socket    %s\n", st.socket);
  printf("instance  %016" PRIx64 "\n", st.instance);
  /* Where its segments are: a clean-up by hand spares all of these. */
  for (size_t i = 0; i < shown; i++)
    printf("%s/dev/shm%s*\n", i ? "          " : "segments  ", prefixes[i]);
  if (np > shown)
    printf("          ... and %zu more prefix(es)\n", np - shown);
  printf("state     %s\n",
         st.state_dir[0] ? st.state_dir : "none (keys end with tensord)");
  if (st.pool_limit) {
    uint64_t tries = st.pool_hits + st.pool_misses;
    printf("pool      %" PRIu64 " segment(s), %s of %s; %" PRIu64
           " hit(s), %" PRIu64 " miss(es)",
           st.pool_segments, td__cli_bytes(st.pool_bytes, a, sizeof(a)),
           td__cli_bytes(st.pool_limit, b, sizeof(b)), st.pool_hits,
           st.pool_misses);
    if (tries)
      printf(" (%.0f%% hits)", 100.0 * (double)st.pool_hits / (double)tries);
    printf("\n");
  } else {
    printf("pool      off (--recycle-bytes 0)\n");
  }
  for (size_t i = 0; i < ngpus; i++) {
    printf("cuda:%-4d %s / %s, %" PRIu64 " storage(s) (%s)\n", gpus[i].index,
           td__cli_bytes(gpus[i].bytes_used, a, sizeof(a)),
           td__cli_bytes(gpus[i].capacity, b, sizeof(b)), gpus[i].storages,
           td_gpu_uuid_str(gpus[i].uuid, (int)gpus[i].mig, u, sizeof(u)));
    if (gpus[i].pool_allocs)
      printf("          pool %" PRIu64 " allocation(s), %s\n",
             gpus[i].pool_allocs,
             td__cli_bytes(gpus[i].pool_bytes, a, sizeof(a)));
  }
  if (st.quota)
    printf("quota     %s per uid\n", td__cli_bytes(st.quota, a, sizeof(a)));
  if (st.max_clients)
    printf("clients   at most %u\n", st.max_clients);
  if (st.max_storages_per_client)
    printf("storages  at most %u per client\n", st.max_storages_per_client);
  return 0;
}

/* ---- info ---- */

/* A key naming the storage, kept from td_info's callback: its views are
 * printed after the call, when the storage's bytes may be read (a state
 * dict's tensors). */
typedef struct info_key_rec {
  char *key;
  uint64_t id;
  td_view view;
  int64_t published_unix_ms;
} info_key_rec;

typedef struct info_state {
  size_t nkeys, cap;
  info_key_rec *keys;
  td_device device;
  int oom;
} info_state;

static int info_storage(const td_storage_info *s, void *arg) {
  info_state *st = arg;
  st->device = s->device;
  if (json) {
    printf("{\"storage\":");
    json_storage(s);
    printf(",\"views\":[");
    return 0;
  }
  char size[32], ag[32];
  printf("storage   %" PRIu64 "\n", s->id);
  char dl[32], us[48];
  if (s->device == TD_CUDA)
    printf("device    %s (%s)\n", device_label(s, dl, sizeof(dl)),
           td_gpu_uuid_str(s->device_uuid, (int)s->device_mig, us, sizeof(us)));
  else
    printf("device    %s\n", device_name(s->device));
  printf("size      %s (%" PRIu64 " bytes)\n",
         td__cli_bytes(s->nbytes, size, sizeof(size)), s->nbytes);
  printf("refs      %u\n", s->refs);
  printf("owner     pid %d, uid %u (%s)", s->owner_pid, s->owner_uid,
         user_name(s->owner_uid));
  printf(", gid %u (%s)\n", s->owner_gid, group_name(s->owner_gid));
  printf("mode      %04o\n", s->mode);
  printf("age       %s\n",
         td__cli_age(now_ms - s->created_unix_ms, ag, sizeof(ag)));
  printf("holders  ");
  if (s->nholders == 0)
    printf(" -");
  for (size_t i = 0; i < s->nholders; i++) {
    const td_holder *h = &s->holders[i];
    char name[TD_CLIENT_NAME_MAX + 1];
    printf(" %d (", h->pid);
    if (h->name != NULL && h->name[0] != '\0')
      printf("%s, ", td__cli_printable(h->name, name, sizeof(name)));
    printf("uid %u, %u ref%s)%s", h->uid, h->refs, h->refs == 1 ? "" : "s",
           i + 1 < s->nholders ? "," : "");
  }
  printf("\nkeys      %zu\n", s->nkeys_total);
  return 0;
}

static int info_key(const td_key_info *k, void *arg) {
  info_state *st = arg;
  if (st->nkeys == st->cap) {
    size_t cap = st->cap ? st->cap * 2 : 8;
    info_key_rec *r = realloc(st->keys, cap * sizeof(*r));
    if (r == NULL) {
      st->oom = 1;
      return 0;
    }
    st->keys = r;
    st->cap = cap;
  }
  info_key_rec *r = &st->keys[st->nkeys];
  if ((r->key = strdup(k->key)) == NULL) {
    st->oom = 1;
    return 0;
  }
  r->id = k->id;
  r->view = k->view;
  r->published_unix_ms = k->published_unix_ms;
  st->nkeys++;
  return 0;
}

/* Prints key r's view and, if its bytes (in s, NULL if unreadable) are a
 * state dict, its tensors. */
static void print_info_key(const info_key_rec *r, size_t i, td_storage *s) {
  td_state_dict *sd = NULL;
  char why[TD__CLI_MSG_MAX] = "";
  int is_sd = s != NULL && td_state_dict_is(s, &r->view), err = 0;
  if (is_sd && (err = td_state_dict_parse(s, &r->view, &sd)) < 0)
    snprintf(why, sizeof(why), "%s", td_last_error(NULL));
  char kb[TD_KEY_MAX + 1];
  if (json) {
    if (i)
      putchar(',');
    printf("{\"key\":");
    td__cli_json_str(r->key);
    printf(",\"view\":");
    td__cli_json_view(&r->view);
    printf(",\"published_unix_ms\":%" PRId64, r->published_unix_ms);
    if (is_sd && err < 0) {
      printf(",\"state_dict\":{\"error\":");
      td__cli_json_str(why);
      putchar('}');
    } else if (is_sd) {
      printf(",\"state_dict\":");
      td__show_sd_json(sd);
    }
    putchar('}');
  } else {
    char vb[600];
    td__cli_printable(r->key, kb, sizeof(kb));
    printf("  %s: %s\n", kb, td_view_format(&r->view, vb, sizeof(vb)));
    if (is_sd && err < 0)
      printf("    state dict, %s: %s\n",
             err == TD_ENODEV ? "on a GPU" : "corrupt",
             td__cli_printable(why, vb, sizeof(vb)));
    else if (is_sd) {
      size_t nt = td_state_dict_count(sd), nr = td_state_dict_nregions(sd);
      printf("    state dict: %zu tensor%s in %zu region%s (tensorctl show %s "
             "TENSOR shows one)\n",
             nt, nt == 1 ? "" : "s", nr, nr == 1 ? "" : "s", kb);
      td__show_sd_text(sd, "    ");
    }
  }
  td_state_dict_free(sd);
}

static int cmd_info(td_client *c, const char *arg) {
  info_state st = {0};
  int err;
  if (td__cli_is_digits(arg)) {
    uint64_t id = strtoull(arg, NULL, 10);
    err = td_info(c, id, NULL, info_storage, info_key, &st);
    if (err == TD_ENOENT) /* maybe a key made of digits */
      err = td_info(c, 0, arg, info_storage, info_key, &st);
  } else {
    err = td_info(c, 0, arg, info_storage, info_key, &st);
  }
  if (err == 0) {
    /* The bytes, read-only and lazily (only the pages read are mapped), if
     * a key's view could be a state dict; none if they cannot be had. */
    td_storage *s = NULL;
    for (size_t i = 0; i < st.nkeys && s == NULL; i++)
      if (st.device == TD_CPU && td_state_dict_is(NULL, &st.keys[i].view) &&
          td_storage_open(c, st.keys[i].id, TD_RDONLY | TD_LAZY, &s) < 0)
        break;
    for (size_t i = 0; i < st.nkeys; i++)
      print_info_key(&st.keys[i], i, s);
    td_storage_release(s);
    if (st.oom)
      fprintf(stderr, "tensorctl info: out of memory: some keys not shown\n");
    if (json)
      printf("]}\n");
  }
  for (size_t i = 0; i < st.nkeys; i++)
    free(st.keys[i].key);
  free(st.keys);
  return err;
}

static int cmd_rm(td_client *c, const char *key) {
  int err = td_unpublish(c, key);
  if (err == 0) {
    if (json) {
      printf("{\"removed\":");
      td__cli_json_str(key);
      printf("}\n");
    } else {
      printf("removed '%s'\n", key);
    }
  }
  return err;
}

static int cmd_metrics(td_client *c) {
  td_metrics *m;
  int err = td_metrics_get(c, 0, 0, &m);
  if (err < 0)
    return err;
  if (!json) {
    fwrite(m->text, 1, m->text_len, stdout);
    td_metrics_free(m);
    return 0;
  }
  printf("{\"requests\":%" PRIu64 ",\"uptime_ms\":%" PRId64
         ",\"clients_total\":%" PRIu64 ",\"clients\":[",
         m->requests, m->uptime_ms, m->clients_total);
  for (size_t i = 0; i < m->nclients; i++) {
    const td_client_stat *s = &m->clients[i];
    printf("%s{\"pid\":%d,\"uid\":%u,\"name\":", i ? "," : "", s->pid, s->uid);
    td__cli_json_str(s->name);
    printf(",\"requests\":%" PRIu64 ",\"refs\":%" PRIu64
           ",\"bytes_held\":%" PRIu64 "}",
           s->requests, s->refs, s->bytes_held);
  }
  printf("],\"text\":");
  td__cli_json_str(m->text);
  printf("}\n");
  td_metrics_free(m);
  return 0;
}

static int cmd_ping(td_client *c) {
  uint64_t rtt;
  int err = td_ping(c, &rtt);
  if (err < 0)
    return err;
  if (json)
    printf("{\"rtt_us\":%.1f}\n", (double)rtt / 1000.0);
  else
    printf("tensord answered in %.1f us\n", (double)rtt / 1000.0);
  return 0;
}

/* ---- watch ---- */

static volatile sig_atomic_t stop_signal;

static void on_stop(int sig) {
  stop_signal = sig;
}

/* Prints one event as a line of text or of JSON. Returns 0, or -1 if
 * stdout is gone (a reader that quit: head). */
static int print_event(const td_event *ev) {
  const char *type = td_event_type_name(ev->type);
  if (json) {
    printf("{\"type\":\"%s\",\"unix_ms\":%" PRId64, type, ev->unix_ms);
    if (ev->dropped)
      printf(",\"dropped\":%" PRIu64, ev->dropped);
    if (ev->id)
      printf(",\"id\":%" PRIu64 ",\"nbytes\":%" PRIu64 ",\"device\":\"%s\"",
             ev->id, ev->nbytes, device_name(ev->device));
    if (ev->key[0]) {
      printf(",\"key\":");
      td__cli_json_str(ev->key);
    }
    printf(",\"pid\":%d,\"uid\":%u,\"name\":", ev->pid, ev->uid);
    td__cli_json_str(ev->name);
    if (ev->type == TD_EVENT_REFUSED)
      printf(",\"code\":%d,\"error\":\"%s\"", ev->code, td_err_name(ev->code));
    if (ev->message[0]) {
      printf(",\"message\":");
      td__cli_json_str(ev->message);
    }
    printf("}\n");
  } else {
    char when[32] = "", size[32];
    time_t t = (time_t)(ev->unix_ms / 1000);
    struct tm tm;
    if (localtime_r(&t, &tm) != NULL)
      strftime(when, sizeof(when), "%H:%M:%S", &tm);
    if (ev->dropped)
      printf("%s.%03d ... %" PRIu64 " event%s dropped (watcher too slow)\n",
             when, (int)(ev->unix_ms % 1000), ev->dropped,
             ev->dropped == 1 ? "" : "s");
    printf("%s.%03d %s", when, (int)(ev->unix_ms % 1000), type);
    if (ev->type == TD_EVENT_REFUSED)
      printf(" %s", td_err_name(ev->code));
    char text[TD__CLI_MSG_MAX];
    if (ev->key[0])
      printf(" key='%s'", td__cli_printable(ev->key, text, sizeof(text)));
    if (ev->id)
      printf(" storage=%" PRIu64 " %s%s", ev->id,
             td__cli_bytes(ev->nbytes, size, sizeof(size)),
             ev->device == TD_CUDA ? " cuda" : "");
    if (ev->pid) {
      printf(" %s pid %d", ev->type == TD_EVENT_FREE ? "for" : "by", ev->pid);
      if (ev->name[0])
        printf(" (%s)", td__cli_printable(ev->name, text, sizeof(text)));
      if (ev->type == TD_EVENT_CONNECT)
        printf(" uid %u", ev->uid);
    }
    if (ev->message[0])
      printf(": %s", td__cli_printable(ev->message, text, sizeof(text)));
    putchar('\n');
  }
  return fflush(stdout) == 0 ? 0 : -1;
}

/* Streams events until a signal (SIGINT, SIGTERM, SIGHUP), a reader that
 * quits (SIGPIPE: stdout is gone), -n N events, or tensord going. Returns 0
 * in the first three cases, else the error (the daemon's going is one). */
static int cmd_watch(const char *socket, const char *prefix) {
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = on_stop; /* no SA_RESTART: the wait returns */
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGHUP, &sa, NULL);
  signal(SIGPIPE, SIG_IGN); /* a failed write says so instead */
  td_watch *w;
  int err = td_watch_open(socket, prefix, &w);
  if (err < 0) {
    fprintf(stderr, "tensorctl watch: %s\n", td_last_error(NULL));
    return err;
  }
  long long seen = 0;
  while (!stop_signal) {
    td_event ev;
    err = td_watch_next(w, -1, &ev);
    if (err == TD_EAGAIN || err == TD_ETIMEDOUT) {
      err = 0;
      continue;
    }
    if (err < 0) {
      fprintf(stderr, "tensorctl watch: %s\n", td_last_error(NULL));
      break;
    }
    if (print_event(&ev) < 0)
      break; /* the reader quit: that ends a watch, it is no error */
    if (count && ++seen >= count)
      break;
  }
  td_watch_close(w);
  return err;
}

static int cmd_upgrade(td_client *c, const char *binary) {
  td_upgrade_info u;
  int err = td_upgrade(c, binary, &u);
  if (err < 0)
    return err;
  if (json) {
    printf("{\"old_pid\":%d,\"old_version\":", (int)u.old_pid);
    td__cli_json_str(u.old_version);
    printf(",\"new_pid\":%d,\"new_version\":", (int)u.new_pid);
    td__cli_json_str(u.new_version);
    printf("}\n");
  } else {
    printf("tensord upgraded: pid %d (version %s) -> pid %d (version %s)\n",
           (int)u.old_pid, u.old_version, (int)u.new_pid, u.new_version);
  }
  return 0;
}

/* ---- models ---- */

/* The progress bar: bytes, rate and ETA, redrawn in place on stderr. */
typedef struct bar {
  double start;
  int drawn;
} bar;

static double mono_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void draw_bar(const td_load_progress *p, void *arg) {
  bar *b = arg;
  double t = mono_now() - b->start;
  double frac = p->bytes_total ? (double)p->bytes_done / p->bytes_total : 1;
  double rate = t > 0 ? (double)p->bytes_done / t : 0;
  char done[32], total[32], eta[32] = "?";
  if (rate > 0)
    td__cli_age(
        (int64_t)((double)(p->bytes_total - p->bytes_done) / rate * 1e3), eta,
        sizeof(eta));
  int w = (int)(frac * 30);
  fprintf(stderr, "\r[%.*s%*s] %s / %s  %.2f GB/s  ETA %s  shards %u/%u ", w,
          "##############################", 30 - w, "",
          td__cli_bytes(p->bytes_done, done, sizeof(done)),
          td__cli_bytes(p->bytes_total, total, sizeof(total)), rate / 1e9, eta,
          p->shards_done, p->shards_total);
  b->drawn = 1;
}

/* Parses a count for option opt; returns -1 (said) if it is not one from
 * lo to hi. */
static long long option_count(const char *opt, const char *v, long long lo,
                              long long hi, int base) {
  char *end = NULL;
  errno = 0;
  long long n = v ? strtoll(v, &end, base) : 0;
  if (v == NULL || end == v || *end != '\0' || errno != 0 || n < lo || n > hi) {
    fprintf(stderr,
            "tensorctl load: %s '%s': not a%s number from %lld to "
            "%lld\n",
            opt, v ? v : "", base == 8 ? "n octal" : "", lo, hi);
    return -1;
  }
  return n;
}

/* tensorctl load PATH [options] (argv: what follows "load"). */
static int cmd_load(const char *socket, int argc, char **argv) {
  const char *path = NULL, *name = NULL;
  td_load_opts o = {.wait_ms = -1};
  int quiet = 0, dashdash = 0;
  for (int i = 0; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (dashdash || a[0] != '-') {
      if (path != NULL) {
        fprintf(stderr, "tensorctl load: unexpected argument '%s'\n", a);
        return 2;
      }
      path = a;
      continue;
    }
    if (strcmp(a, "--") == 0) {
      dashdash = 1;
    } else if (strcmp(a, "--json") == 0) {
      json = 1;
    } else if (strcmp(a, "--quiet") == 0 || strcmp(a, "-q") == 0) {
      quiet = 1;
    } else if (strcmp(a, "--force") == 0) {
      o.flags |= TD_MODEL_FORCE;
    } else if (strcmp(a, "--as") == 0 || strcmp(a, "--socket") == 0 ||
               strcmp(a, "--device") == 0 || strcmp(a, "--mode") == 0 ||
               strcmp(a, "--wait") == 0 || strcmp(a, "--threads") == 0) {
      if (v == NULL) {
        fprintf(stderr, "tensorctl load: %s needs a value\n", a);
        return 2;
      }
      i++;
      long long n;
      if (strcmp(a, "--as") == 0) {
        name = v;
      } else if (strcmp(a, "--socket") == 0) {
        socket = v;
      } else if (strcmp(a, "--device") == 0) {
        if (strcmp(v, "cpu") == 0) {
          o.device = TD_CPU;
        } else if (strncmp(v, "cuda:", 5) == 0 &&
                   (n = option_count("--device cuda:", v + 5, 0, 1023, 10)) >=
                       0) {
          o.device = TD_CUDA;
          o.device_index = n;
        } else {
          fprintf(stderr, "tensorctl load: --device '%s': cpu or cuda:K\n", v);
          return 2;
        }
      } else if (strcmp(a, "--mode") == 0) {
        if ((n = option_count(a, v, 0, 0666, 8)) < 0)
          return 2;
        o.mode = (uint32_t)n;
      } else if (strcmp(a, "--wait") == 0) {
        if ((n = option_count(a, v, 0, 2000000, 10)) < 0)
          return 2;
        o.wait_ms = (int32_t)(n * 1000);
      } else if ((n = option_count(a, v, 1, 64, 10)) < 0) {
        return 2;
      } else {
        o.threads = (uint32_t)n;
      }
    } else {
      fprintf(stderr,
              "tensorctl load: unknown option '%s' (tensorctl load "
              "--help)\n",
              a);
      return 2;
    }
  }
  if (path == NULL) {
    fprintf(stderr, "tensorctl load: needs a PATH (usage: tensorctl load "
                    "PATH [--as NAME] [options])\n");
    return 2;
  }
  char derived[TD_KEY_MAX + 1];
  if (name == NULL) {
    if (td_model_default_name(path, derived, sizeof(derived)) < 0) {
      fprintf(stderr, "tensorctl load: %s\n", td_last_error(NULL));
      return 1;
    }
    name = derived;
  }
  td_client *c;
  if (td_connect(socket, &c) < 0) {
    fprintf(stderr, "tensorctl: %s\n", td_last_error(NULL));
    return 1;
  }
  bar b = {mono_now(), 0};
  if (!quiet && isatty(2)) {
    o.progress = draw_bar;
    o.progress_arg = &b;
  }
  td_load_result r;
  int err = td_model_load(c, path, name, &o, &r);
  if (b.drawn)
    fputc('\n', stderr);
  if (err < 0) {
    fprintf(stderr, "tensorctl load: %s\n", td_last_error(c));
    td_close(c);
    return 1;
  }
  char real[PATH_MAX];
  if (realpath(path, real) == NULL)
    snprintf(real, sizeof(real), "%s", path);
  double gbs =
      r.seconds > 0 && !r.unchanged ? (double)r.bytes / r.seconds / 1e9 : 0;
  if (json) {
    printf("{\"name\":");
    td__cli_json_str(name);
    printf(",\"version\":%" PRIu64 ",\"tensors\":%" PRIu64 ",\"bytes\":%" PRIu64
           ",\"shards\":%u,\"seconds\":%.6f,"
           "\"gb_per_s\":%.3f,\"unchanged\":%s,\"waited\":%s}\n",
           r.version, r.tensors, r.bytes, r.shards, r.seconds, gbs,
           r.unchanged ? "true" : "false", r.waited ? "true" : "false");
  } else if (r.unchanged) {
    char nb[TD_KEY_MAX + 1], pb[PATH_MAX];
    printf("%s: version %" PRIu64 " already holds %s (same size and mtime); "
           "--force reloads\n",
           td__cli_printable(name, nb, sizeof(nb)), r.version,
           td__cli_printable(real, pb, sizeof(pb)));
  } else {
    char nb[TD_KEY_MAX + 1], hs[32];
    printf("%s: version %" PRIu64 ", %" PRIu64 " tensors, %s in %u shard%s, "
           "%.2f s (%.2f GB/s)%s\n",
           td__cli_printable(name, nb, sizeof(nb)), r.version, r.tensors,
           td__cli_bytes(r.bytes, hs, sizeof(hs)), r.shards,
           r.shards == 1 ? "" : "s", r.seconds, gbs,
           r.waited ? " (after waiting for another load)" : "");
  }
  td_close(c);
  return 0;
}

static int cmd_save(td_client *c, const char *name, const char *out) {
  int err = td_model_save(c, name, out, 0);
  if (err < 0)
    return err;
  char nb[TD_KEY_MAX + 1];
  if (json) {
    printf("{\"name\":");
    td__cli_json_str(name);
    printf(",\"out\":");
    td__cli_json_str(out);
    printf("}\n");
  } else {
    printf("%s -> %s\n", td__cli_printable(name, nb, sizeof(nb)), out);
  }
  return 0;
}

static int cmd_unload(td_client *c, const char *name) {
  int err = td_model_unload(c, name);
  if (err < 0)
    return err;
  char nb[TD_KEY_MAX + 1];
  if (json) {
    printf("{\"name\":");
    td__cli_json_str(name);
    printf(",\"unloaded\":true}\n");
  } else {
    printf("%s: unloaded\n", td__cli_printable(name, nb, sizeof(nb)));
  }
  return 0;
}

int main(int argc, char **argv) {
  static const struct option opts[] = {
      {"socket", required_argument, NULL, 's'},
      {"json", no_argument, NULL, 'j'},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  const char *socket = NULL;
  int ch;
  while ((ch = getopt_long(argc, argv, "+s:jh", opts, NULL)) != -1) {
    switch (ch) {
    case 's':
      socket = optarg;
      break;
    case 'j':
      json = 1;
      break;
    case 'h':
      usage(stdout);
      return 0;
    default:
      usage(stderr);
      return 2;
    }
  }
  if (optind >= argc) {
    usage(stderr);
    return 2;
  }
  const char *cmd = argv[optind++];
  const command *known = find_command(cmd);
  if (known == NULL) {
    fprintf(stderr, "tensorctl: unknown command '%s'\n", cmd);
    usage(stderr);
    return 2;
  }
  /* -h or --help anywhere before "--" asks for the command's usage, which
   * needs no daemon and no valid rest of the line. */
  for (int i = optind; i < argc && strcmp(argv[i], "--") != 0; i++)
    if (strcmp(argv[i], "-h") == 0 || strcmp(argv[i], "--help") == 0) {
      command_usage(known, stdout);
      return 0;
    }
  if (strcmp(cmd, "help") == 0) {
    if (optind >= argc) {
      usage(stdout);
      return 0;
    }
    if (optind + 1 < argc) {
      fprintf(stderr, "tensorctl help: takes one COMMAND, not '%s %s'\n",
              argv[optind], argv[optind + 1]);
      return 2;
    }
    const command *c = find_command(argv[optind]);
    if (c == NULL) {
      fprintf(stderr,
              "tensorctl help: unknown command '%s' (tensorctl --help "
              "lists them)\n",
              argv[optind]);
      return 2;
    }
    command_usage(c, stdout);
    return 0;
  }
  if (strcmp(cmd, "show") == 0) /* show parses its own options (show.c) */
    return td__show_main(socket, json, argc - optind + 1, argv + optind - 1);
  /* Options may also follow the command: "tensorctl ls --json". After
   * "--", everything is an argument (a key that begins with '-'). */
  if (strcmp(cmd, "load") == 0)
    return cmd_load(socket, argc - optind, argv + optind);
  const char *arg = NULL, *arg2 = NULL, *binary = NULL;
  int interval_ms = 1000, once = 0, dashdash = 0;
  int is_top = strcmp(cmd, "top") == 0;
  for (int i = optind; i < argc; i++) {
    if (dashdash) {
      /* an argument, below */
    } else if (strcmp(argv[i], "--") == 0) {
      dashdash = 1;
      continue;
    } else if (strcmp(argv[i], "--json") == 0) {
      json = 1;
      continue;
    } else if (is_top && strcmp(argv[i], "--once") == 0) {
      once = 1;
      continue;
    } else if (is_top && strcmp(argv[i], "--interval") == 0) {
      char *end = NULL;
      long v = i + 1 < argc ? strtol(argv[++i], &end, 10) : 0;
      if (end == NULL || end == argv[i] || *end != '\0' || v < 10 ||
          v > 3600000) {
        fprintf(stderr,
                "tensorctl top: --interval '%s': not a count of "
                "milliseconds from 10 to 3600000\n",
                end ? argv[i] : "");
        return 2;
      }
      interval_ms = (int)v;
      continue;
    } else if (strcmp(argv[i], "-l") == 0 && strcmp(cmd, "ls") == 0) {
      longfmt = 1;
      continue;
    } else if (strcmp(argv[i], "-n") == 0 && strcmp(cmd, "watch") == 0) {
      char *end = NULL;
      errno = 0;
      if (i + 1 < argc)
        count = strtoll(argv[++i], &end, 10);
      if (end == NULL || *end != '\0' || end == argv[i] || errno != 0 ||
          count < 1) {
        fprintf(stderr, "tensorctl watch: -n needs a count of events (1 or "
                        "more)\n");
        return 2;
      }
      continue;
    } else if (strcmp(argv[i], "--socket") == 0 ||
               (strcmp(argv[i], "--binary") == 0 &&
                strcmp(cmd, "upgrade") == 0)) {
      if (i + 1 >= argc) {
        fprintf(stderr, "tensorctl %s: %s needs a PATH\n", cmd, argv[i]);
        return 2;
      }
      if (argv[i][2] == 's')
        socket = argv[++i];
      else
        binary = argv[++i];
      continue;
    }
    if (arg == NULL) {
      arg = argv[i];
    } else if (arg2 == NULL && strcmp(cmd, "save") == 0) {
      arg2 = argv[i];
    } else {
      fprintf(stderr, "tensorctl: unexpected argument '%s'\n", argv[i]);
      return 2;
    }
  }
  int needs_arg = strcmp(cmd, "info") == 0 || strcmp(cmd, "rm") == 0 ||
                  strcmp(cmd, "save") == 0 || strcmp(cmd, "unload") == 0;
  if (strcmp(cmd, "save") == 0 && arg != NULL && arg2 == NULL) {
    fprintf(stderr,
            "tensorctl save: needs NAME and OUT (usage: tensorctl "
            "%s)\n",
            known->synopsis);
    return 2;
  }
  int watch = strcmp(cmd, "watch") == 0;
  if (is_top && json) {
    fprintf(stderr, "tensorctl top: --json does not apply (try tensorctl "
                    "metrics --json)\n");
    return 2;
  }
  if (watch) /* a connection of its own (td_watch_open) */
    return cmd_watch(socket, arg) < 0 ? 1 : 0;
  if (needs_arg != (arg != NULL)) {
    fprintf(stderr, "tensorctl %s: %s (usage: tensorctl %s)\n", cmd,
            needs_arg ? "needs an argument" : "takes no argument",
            known->synopsis);
    return 2;
  }

  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  now_ms = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;

  td_client *c;
  int err = td_connect(socket, &c);
  if (err < 0) {
    fprintf(stderr, "tensorctl: %s\n", td_last_error(NULL));
    return 1;
  }
  conn = c;
  if (strcmp(cmd, "ls") == 0)
    err = cmd_ls(c);
  else if (strcmp(cmd, "stat") == 0)
    err = cmd_stat(c);
  else if (strcmp(cmd, "info") == 0)
    err = cmd_info(c, arg);
  else if (strcmp(cmd, "rm") == 0)
    err = cmd_rm(c, arg);
  else if (strcmp(cmd, "metrics") == 0)
    err = cmd_metrics(c);
  else if (is_top)
    err = td__top(c, interval_ms, once);
  else if (strcmp(cmd, "upgrade") == 0)
    err = cmd_upgrade(c, binary);
  else if (strcmp(cmd, "save") == 0)
    err = cmd_save(c, arg, arg2);
  else if (strcmp(cmd, "unload") == 0)
    err = cmd_unload(c, arg);
  else
    err = cmd_ping(c);
  if (err < 0 && !is_top) /* top says why itself */
    fprintf(stderr, "tensorctl %s: %s\n", cmd, td_last_error(c));
  td_close(c);
  return err < 0 ? 1 : 0;
}
