/* main.c: tensord's command line. */
#include "hugepages.h"
#include "common.h"
#include "cudastore.h"
#include "log.h"
#include "start.h"
#include "upgrade.h"

#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static void usage(FILE *f) {
  fprintf(
      f,
      "usage: tensord [OPTION]...\n"
      "\n"
      "Shares tensor storages between the processes of this machine.\n"
      "\n"
      "  --socket PATH          listen here (default: $TENSORD_SOCKET, else\n"
      "                         $XDG_RUNTIME_DIR/tensord.sock, else\n"
      "                         /tmp/tensord-<uid>/tensord.sock); ignored\n"
      "                         when systemd passes a socket (LISTEN_FDS)\n"
      "  --socket-group GROUP   give the socket to this group ...\n"
      "  --socket-mode MODE     ... with this mode, e.g. 0660 (default 0600)\n"
      "  --capacity SIZE        most bytes of live storages, e.g. 8G, 512MiB\n"
      "                         (default: half of /dev/shm)\n"
      "  --quota SIZE           most bytes of storages one uid may own\n"
      "  --max-clients N        most connected clients\n"
      "  --max-storages-per-client N\n"
      "                         most storages one client may hold at once,\n"
      "                         its creates in flight included (default:\n"
      "                         no limit)\n"
      "  --max-waiters-per-client N\n"
      "                         most lookups one client may have waiting\n"
      "                         for keys at once (default 4096)\n"
      "  --max-keys-per-uid N   most keys the processes of one uid may have\n"
      "                         published, whichever connection did it\n"
      "                         (default 100000)\n"
      "  --io-timeout MS        disconnect a client that leaves a request\n"
      "                         half-sent or its replies unread this long\n"
      "                         (default 30000)\n"
      "  --upgrade-timeout MS   give a live upgrade's handover up, and serve\n"
      "                         on, if the new tensord has not taken over\n"
      "                         this long after it began (default 10000)\n"
      "  --state-dir DIR        keep published keys here, durably, so that\n"
      "                         they survive a restart or a crash\n"
      "  --recycle-bytes SIZE   keep up to this many bytes of freed segments\n"
      "                         to serve later creates of the same uid from\n"
      "                         pages that exist; 0 turns recycling off\n"
      "                         (default: a quarter of the capacity)\n"
      "  --recycle-idle MS      unlink a pooled segment unused this long\n"
      "                         (default 30000)\n"
      "  --huge-pages auto|off  auto (default): look at what the host offers\n"
      "                         in huge pages for /dev/shm and log it at\n"
      "                         start; off: do not look (see\n"
      "                         docs/operations.md)\n"
      "  --cuda-devices LIST    the GPUs tensord may use, by ordinal or\n"
      "                         UUID (GPU-..., MIG-...), comma-separated\n"
      "                         (default: every GPU the driver shows)\n"
      "  --cuda-capacity K=SIZE most bytes of CUDA storages on GPU K (an\n"
      "                         ordinal or a UUID); repeat per GPU (default:\n"
      "                         the GPU's total memory)\n"
      "  --cuda-recycle-bytes SIZE\n"
      "                         per GPU, keep up to this many bytes of freed\n"
      "                         CUDA allocations to serve later creates of\n"
      "                         the same uid and size; 0 turns it off\n"
      "                         (default: a quarter of the GPU's capacity;\n"
      "                         --recycle-idle ages them out too)\n"
      "  --metrics PATH|ADDR    serve the metrics text (tensorctl metrics)\n"
      "                         over HTTP on a Unix socket PATH (one with\n"
      "                         a '/', mode as --socket-mode, else 0600) or\n"
      "                         a loopback ADDR: 127.0.0.1:PORT, [::1]:PORT\n"
      "                         or localhost:PORT (PORT 0: any free port,\n"
      "                         logged)\n"
      "  --upgrade              take over from the tensord serving the same\n"
      "                         socket, with its clients, storages, keys and\n"
      "                         limits (a live upgrade: see\n"
      "                         docs/operations.md); that tensord exits\n"
      "  --log-level L          error, warn, info (default) or debug\n"
      "  --version              print the version and exit\n");
}

static int parse_count(const char *opt, const char *s, uint64_t max,
                       uint64_t *out) {
  char *end;
  errno = 0;
  unsigned long long v = strtoull(s, &end, 10);
  if (*s == '\0' || *end != '\0' || errno != 0 || *s == '-' || v == 0 ||
      v > max) {
    fprintf(stderr, "tensord: %s '%s': not a count from 1 to %llu\n", opt, s,
            (unsigned long long)max);
    return -1;
  }
  *out = v;
  return 0;
}

static int parse_bytes(const char *opt, const char *s, uint64_t *out) {
  if (td__parse_size(s, out) < 0 || *out == 0) {
    fprintf(stderr, "tensord: %s '%s': not a size (e.g. 8G, 512MiB)\n", opt, s);
    return -1;
  }
  return 0;
}

/* Logs, as one info line, what the host offers in huge pages for the
 * segments and what follows from it (--huge-pages auto), or that it was not
 * looked at (off). The protocol carries none of it: a client reads the same
 * files itself (client/cache.c). */
static void log_huge_pages(int off) {
  if (off) {
    td__info("huge pages: not looked at (--huge-pages off)");
    return;
  }
  td__huge_info h;
  char line[512];
  td__huge_probe(&h);
  td__info("huge pages: %s", td__huge_describe(&h, line, sizeof(line)));
}

/* Raises the soft limit on open files to the hard limit: every client is an
 * fd, and so is every fd on its way to a client. */
static void raise_nofile(void) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl) < 0 || rl.rlim_cur == rl.rlim_max)
    return;
  rlim_t was = rl.rlim_cur;
  rl.rlim_cur = rl.rlim_max;
  if (setrlimit(RLIMIT_NOFILE, &rl) < 0)
    td__warn("cannot raise the open-file limit from %llu: %s",
             (unsigned long long)was, strerror(errno));
  else
    td__debug("open-file limit raised from %llu to %llu",
              (unsigned long long)was, (unsigned long long)rl.rlim_cur);
}

/* The path this tensord was started from, resolved now: after a package
 * upgrade it holds the new binary, which tensorctl upgrade runs (while
 * /proc/self/exe names the deleted old one). Returns buf, or NULL. */
static const char *resolve_binary(const char *argv0, char *buf, size_t len) {
  if (strchr(argv0, '/') != NULL)
    return realpath(argv0, buf) ? buf : NULL;
  ssize_t n = readlink("/proc/self/exe", buf, len - 1);
  if (n <= 0)
    return NULL;
  buf[n] = '\0';
  return buf;
}

int main(int argc, char **argv) {
  enum {
    OPT_QUOTA = 256,
    OPT_MAX_CLIENTS,
    OPT_MAX_STORAGES,
    OPT_MAX_WAITERS,
    OPT_MAX_KEYS,
    OPT_IO_TIMEOUT,
    OPT_UPGRADE_TIMEOUT,
    OPT_SOCKET_GROUP,
    OPT_SOCKET_MODE,
    OPT_STATE_DIR,
    OPT_RECYCLE_BYTES,
    OPT_RECYCLE_IDLE,
    OPT_HUGE_PAGES,
    OPT_CUDA_DEVICES,
    OPT_CUDA_CAPACITY,
    OPT_CUDA_RECYCLE_BYTES,
    OPT_METRICS,
    OPT_UPGRADE,
  };
  static const struct option opts[] = {
      {"socket", required_argument, NULL, 's'},
      {"socket-group", required_argument, NULL, OPT_SOCKET_GROUP},
      {"socket-mode", required_argument, NULL, OPT_SOCKET_MODE},
      {"capacity", required_argument, NULL, 'c'},
      {"quota", required_argument, NULL, OPT_QUOTA},
      {"max-clients", required_argument, NULL, OPT_MAX_CLIENTS},
      {"max-storages-per-client", required_argument, NULL, OPT_MAX_STORAGES},
      {"max-waiters-per-client", required_argument, NULL, OPT_MAX_WAITERS},
      {"max-keys-per-uid", required_argument, NULL, OPT_MAX_KEYS},
      {"io-timeout", required_argument, NULL, OPT_IO_TIMEOUT},
      {"upgrade-timeout", required_argument, NULL, OPT_UPGRADE_TIMEOUT},
      {"state-dir", required_argument, NULL, OPT_STATE_DIR},
      {"recycle-bytes", required_argument, NULL, OPT_RECYCLE_BYTES},
      {"recycle-idle", required_argument, NULL, OPT_RECYCLE_IDLE},
      {"huge-pages", required_argument, NULL, OPT_HUGE_PAGES},
      {"cuda-devices", required_argument, NULL, OPT_CUDA_DEVICES},
      {"cuda-capacity", required_argument, NULL, OPT_CUDA_CAPACITY},
      {"cuda-recycle-bytes", required_argument, NULL, OPT_CUDA_RECYCLE_BYTES},
      {"metrics", required_argument, NULL, OPT_METRICS},
      {"upgrade", no_argument, NULL, OPT_UPGRADE},
      {"log-level", required_argument, NULL, 'l'},
      {"version", no_argument, NULL, 'V'},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  td__options o = {0};
  int huge_off = 0, upgrade = 0;
  const char *cuda_devices = NULL;
  const char *cuda_caps[64];
  size_t ncuda_caps = 0;
  int cuda_recycle_set = 0;
  uint64_t cuda_recycle = 0;
  o.socket_mode = -1;
  uint64_t n;
  int ch;
  while ((ch = getopt_long(argc, argv, "s:c:l:Vh", opts, NULL)) != -1) {
    switch (ch) {
    case 's':
      o.socket_path = optarg;
      break;
    case OPT_SOCKET_GROUP:
      o.socket_group = optarg;
      break;
    case OPT_SOCKET_MODE: {
      char *end;
      long mode = strtol(optarg, &end, 8);
      if (*optarg == '\0' || *end != '\0' || mode < 0 || mode > 0777) {
        fprintf(stderr, "tensord: --socket-mode '%s': not an octal mode\n",
                optarg);
        return 2;
      }
      o.socket_mode = (int)mode;
      break;
    }
    case 'c':
      if (parse_bytes("--capacity", optarg, &o.capacity) < 0)
        return 2;
      break;
    case OPT_QUOTA:
      if (parse_bytes("--quota", optarg, &o.quota) < 0)
        return 2;
      break;
    case OPT_MAX_CLIENTS:
      if (parse_count("--max-clients", optarg, UINT32_MAX, &n) < 0)
        return 2;
      o.max_clients = (uint32_t)n;
      break;
    case OPT_MAX_STORAGES:
      if (parse_count("--max-storages-per-client", optarg, UINT32_MAX, &n) < 0)
        return 2;
      o.max_storages_per_client = (uint32_t)n;
      break;
    case OPT_MAX_WAITERS:
      if (parse_count("--max-waiters-per-client", optarg, UINT32_MAX, &n) < 0)
        return 2;
      o.max_waiters_per_client = (uint32_t)n;
      break;
    case OPT_MAX_KEYS:
      if (parse_count("--max-keys-per-uid", optarg, UINT64_MAX,
                      &o.max_keys_per_uid) < 0)
        return 2;
      break;
    case OPT_IO_TIMEOUT:
      if (parse_count("--io-timeout", optarg, 24ull * 3600 * 1000,
                      &o.io_timeout_ms) < 0)
        return 2;
      break;
    case OPT_UPGRADE_TIMEOUT:
      if (parse_count("--upgrade-timeout", optarg, 24ull * 3600 * 1000,
                      &o.upgrade_timeout_ms) < 0)
        return 2;
      break;
    case OPT_STATE_DIR:
      o.state_dir = optarg;
      break;
    case OPT_RECYCLE_BYTES:
      /* 0 is a size here: it turns recycling off. */
      if (strcmp(optarg, "0") != 0 &&
          parse_bytes("--recycle-bytes", optarg, &o.recycle_bytes) < 0)
        return 2;
      o.recycle_set = 1;
      break;
    case OPT_RECYCLE_IDLE:
      if (parse_count("--recycle-idle", optarg, 24ull * 3600 * 1000,
                      &o.recycle_idle_ms) < 0)
        return 2;
      break;
    case OPT_HUGE_PAGES:
      if (strcmp(optarg, "auto") != 0 && strcmp(optarg, "off") != 0) {
        fprintf(stderr, "tensord: --huge-pages '%s': use auto or off\n",
                optarg);
        return 2;
      }
      huge_off = strcmp(optarg, "off") == 0;
      break;
    case OPT_CUDA_DEVICES:
      cuda_devices = optarg;
      break;
    case OPT_UPGRADE:
      upgrade = 1;
      break;
    case OPT_CUDA_RECYCLE_BYTES:
      if (strcmp(optarg, "0") != 0 &&
          parse_bytes("--cuda-recycle-bytes", optarg, &cuda_recycle) < 0)
        return 2;
      cuda_recycle_set = 1;
      break;
    case OPT_CUDA_CAPACITY:
      if (ncuda_caps == sizeof(cuda_caps) / sizeof(cuda_caps[0])) {
        fprintf(stderr, "tensord: --cuda-capacity: more than %zu given\n",
                ncuda_caps);
        return 2;
      }
      cuda_caps[ncuda_caps++] = optarg;
      break;
    case OPT_METRICS:
      if (strchr(optarg, '/') == NULL) {
        struct sockaddr_storage ss;
        char msg[256];
        if (td__scrape_parse(optarg, &ss, msg, sizeof(msg)) < 0) {
          fprintf(stderr, "tensord: %s\n", msg);
          return 2;
        }
      }
      o.metrics = optarg;
      break;
    case 'l': {
      int level = td__log_level_parse(optarg);
      if (level < 0) {
        fprintf(stderr,
                "tensord: --log-level '%s': use error, warn, info or debug\n",
                optarg);
        return 2;
      }
      td__log_level = level;
      break;
    }
    case 'V':
      printf("tensord %s (protocol %d)\n", TD_VERSION_STRING,
             TD_PROTOCOL_VERSION);
      return 0;
    case 'h':
      usage(stdout);
      return 0;
    default:
      usage(stderr);
      return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "tensord: unexpected argument '%s'\n", argv[optind]);
    usage(stderr);
    return 2;
  }

  char msg[256];
  if (td__cuda_configure(cuda_devices, cuda_caps, ncuda_caps, msg,
                         sizeof(msg)) < 0) {
    fprintf(stderr, "tensord: %s\n", msg);
    return 2;
  }
  td__cuda_configure_pool(cuda_recycle_set, cuda_recycle,
                          (int64_t)o.recycle_idle_ms);

  signal(SIGPIPE, SIG_IGN);
  raise_nofile();
  log_huge_pages(huge_off);
  uv_loop_t *loop = uv_default_loop();
  static td__server srv;
  static char binary[PATH_MAX];
  o.argv = argv;
  o.binary = resolve_binary(argv[0], binary, sizeof(binary));
  if (upgrade) {
    int rc = td__upgrade_start(&srv, loop, &o, argv);
    if (rc != 0)
      return rc;
  } else if (td__server_start(&srv, loop, &o) < 0) {
    return 1;
  }
  uv_run(loop, UV_RUN_DEFAULT);
  td__server_finish(&srv);
  uv_loop_close(loop);
  td__info("stopped");
  return 0;
}
