/* main.c: tensord's command line. */
#include "daemon.h"

#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void usage(FILE *f) {
  fprintf(f,
          "usage: tensord [--socket PATH] [--capacity SIZE] "
          "[--log-level error|warn|info|debug] [--version]\n"
          "\n"
          "Shares tensor storages between the processes of this machine.\n"
          "\n"
          "  --socket PATH     listen here (default: $TENSORD_SOCKET, else\n"
          "                    $XDG_RUNTIME_DIR/tensord.sock, else\n"
          "                    /tmp/tensord-<uid>/tensord.sock); ignored when\n"
          "                    systemd passes a socket (LISTEN_FDS)\n"
          "  --capacity SIZE   most bytes of live storages, e.g. 8G, 512MiB\n"
          "                    (default: half of /dev/shm)\n"
          "  --log-level L     error, warn, info (default) or debug\n"
          "  --version         print the version and exit\n");
}

int main(int argc, char **argv) {
  static const struct option opts[] = {
      {"socket", required_argument, NULL, 's'},
      {"capacity", required_argument, NULL, 'c'},
      {"log-level", required_argument, NULL, 'l'},
      {"version", no_argument, NULL, 'V'},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  td__options o = {0};
  int ch;
  while ((ch = getopt_long(argc, argv, "s:c:l:Vh", opts, NULL)) != -1) {
    switch (ch) {
    case 's':
      o.socket_path = optarg;
      break;
    case 'c':
      if (td__parse_size(optarg, &o.capacity) < 0 || o.capacity == 0) {
        fprintf(stderr, "tensord: --capacity '%s': not a size (e.g. 8G)\n",
                optarg);
        return 2;
      }
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

  signal(SIGPIPE, SIG_IGN);
  uv_loop_t *loop = uv_default_loop();
  static td__server srv;
  if (td__server_start(&srv, loop, &o) < 0)
    return 1;
  uv_run(loop, UV_RUN_DEFAULT);
  /* Whatever a bug might have left behind goes too. */
  int n = td__shm_unlink_prefix(srv.prefix + 1);
  if (n > 0)
    td__warn("unlinked %d segment(s) still in /dev/shm at exit", n);
  uv_loop_close(loop);
  td__info("stopped");
  return 0;
}
