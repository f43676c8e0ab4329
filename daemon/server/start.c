/* start.c: the listening socket (bound or inherited from systemd), accepting
 * clients, readiness notification, and orderly shutdown. */
#include "start.h"

#include "chanops.h"
#include "common.h"
#include "cudastore.h"
#include "conn.h"
#include "drain.h"
#include "log.h"
#include "ops.h"
#include "segment.h"
#include "sock.h"
#include "state.h"
#include "upgrade.h"

#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#define SD_LISTEN_FDS_START 3
#define ACCEPT_RETRY_MS 100

static void on_accept(uv_poll_t *h, int status, int events);
static void stop_finish(td__server *srv);

static void accept_resume(uv_timer_t *t) {
  td__server *srv = td__container_of(t, td__server, accept_timer);
  if (!srv->stopping && !srv->quiesced)
    uv_poll_start(&srv->listen_poll, UV_READABLE, on_accept);
}

static void on_accept(uv_poll_t *h, int status, int events) {
  td__server *srv = td__container_of(h, td__server, listen_poll);
  for (int i = 0; i < 64; i++) {
    int fd = accept4(srv->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED)
        continue;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
          errno == ENOMEM) {
        /* Level-triggered poll would spin: stop accepting for a moment. */
        td__error("accept: %s; pausing new connections for %d ms",
                  strerror(errno), ACCEPT_RETRY_MS);
        uv_poll_stop(&srv->listen_poll);
        uv_timer_start(&srv->accept_timer, accept_resume, ACCEPT_RETRY_MS, 0);
      } else if (errno != EAGAIN) {
        td__error("accept: %s", strerror(errno));
      }
      return;
    }
    int err = td__conn_accept(srv, fd);
    if (err < 0)
      td__error("accepting a client: %s", td_strerror(err));
  }
}

void td__server_accepting(td__server *srv, int on) {
  if (!srv->listening || srv->stopping)
    return;
  if (on) {
    uv_poll_start(&srv->listen_poll, UV_READABLE, on_accept);
  } else {
    uv_poll_stop(&srv->listen_poll);
    uv_timer_stop(&srv->accept_timer);
  }
}

/* Unlinks path if it is a socket nobody listens on. */
static int clear_stale_socket(const char *path) {
  struct stat st;
  if (lstat(path, &st) < 0)
    return 0;
  if (!S_ISSOCK(st.st_mode)) {
    td__error("%s exists and is not a socket; not touching it", path);
    return TD_EBUSY;
  }
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -errno;
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", path);
  int live = connect(fd, (struct sockaddr *)&sa, sizeof(sa)) == 0;
  close(fd);
  if (live) {
    td__error("another tensord is already listening on %s", path);
    return TD_EBUSY;
  }
  unlink(path);
  return 0;
}

/* Binds and listens on path with mode (0600 as the unit's SocketMode=0600,
 * or --socket-mode's) from the start; --socket-group follows
 * (socket_access). */
static int bind_socket(td__server *srv, const char *path, mode_t mode) {
  if (strlen(path) >= sizeof(((struct sockaddr_un *)0)->sun_path)) {
    td__error("socket path %s is longer than %zu bytes", path,
              sizeof(((struct sockaddr_un *)0)->sun_path) - 1);
    return TD_ENAMETOOLONG;
  }
  int err = td__socket_dir(path, "socket", "--socket");
  if (err < 0)
    return err;
  err = clear_stale_socket(path);
  if (err < 0)
    return err;
  int fd = td__socket_bind(path, mode);
  if (fd < 0 || listen(fd, SOMAXCONN) < 0) {
    err = fd < 0 ? fd : -errno;
    td__error("cannot listen on %s: %s", path, strerror(-err));
    if (fd >= 0)
      close(fd);
    return err;
  }
  srv->listen_fd = fd;
  srv->own_socket = 1;
  snprintf(srv->socket_path, sizeof(srv->socket_path), "%s", path);
  return 0;
}

/* Adopts the listening socket systemd passed (LISTEN_FDS), if any. Returns
 * 1 if it did, 0 if there is none, or a negative code. */
static int adopt_socket(td__server *srv) {
  const char *pid = getenv("LISTEN_PID");
  const char *fds = getenv("LISTEN_FDS");
  if (pid == NULL || fds == NULL || atol(pid) != (long)getpid())
    return 0;
  int n = atoi(fds);
  unsetenv("LISTEN_PID");
  unsetenv("LISTEN_FDS");
  unsetenv("LISTEN_FDNAMES");
  if (n < 1)
    return 0;
  if (n > 1)
    td__warn("LISTEN_FDS=%d: using fd %d, ignoring the rest", n,
             SD_LISTEN_FDS_START);
  int fd = SD_LISTEN_FDS_START;
  int accepting = 0, type = 0;
  socklen_t len = sizeof(int);
  struct sockaddr_un sa;
  socklen_t salen = sizeof(sa);
  if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &accepting, &len) < 0 ||
      getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) < 0 ||
      getsockname(fd, (struct sockaddr *)&sa, &salen) < 0 ||
      sa.sun_family != AF_UNIX || type != SOCK_STREAM || !accepting) {
    td__error("inherited fd %d is not a listening Unix stream socket", fd);
    return TD_EINVAL;
  }
  fcntl(fd, F_SETFD, FD_CLOEXEC);
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  srv->listen_fd = fd;
  srv->own_socket = 0;
  snprintf(srv->socket_path, sizeof(srv->socket_path), "%s", sa.sun_path);
  return 1;
}

void td__server_notify(const char *state) {
  td__server_notify_pid(state, (int)getpid());
}

void td__server_notify_pid(const char *state, int pid) {
  const char *path = getenv("NOTIFY_SOCKET");
  if (path == NULL || (path[0] != '/' && path[0] != '@'))
    return;
  struct sockaddr_un sa = {.sun_family = AF_UNIX};
  size_t len = strlen(path);
  if (len >= sizeof(sa.sun_path))
    return;
  memcpy(sa.sun_path, path, len);
  if (sa.sun_path[0] == '@')
    sa.sun_path[0] = '\0';
  int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return;
  char msg[128];
  int n = snprintf(msg, sizeof(msg), "%s%sMAINPID=%d", state,
                   state[0] ? "\n" : "", pid);
  if (sendto(fd, msg, (size_t)n, MSG_NOSIGNAL, (struct sockaddr *)&sa,
             (socklen_t)(offsetof(struct sockaddr_un, sun_path) + len)) < 0)
    td__warn("notifying %s: %s", path, strerror(errno));
  close(fd);
}

static void on_signal(uv_signal_t *h, int signum) {
  td__server *srv = h->data;
  td__info("%s: shutting down", signum == SIGINT ? "SIGINT" : "SIGTERM");
  td__server_stop(srv);
}

/* Warns when --socket-mode lets the socket's group or others connect (the
 * write bit) but a directory on its path does not let them reach it (the
 * search bit): the first such directory, with its mode and owners, so that
 * the operator sees why a user's connect fails with "Permission denied".
 * Group members are judged by the directory's group bits when it belongs to
 * the socket's group, else by its other bits (the usual case; a member who
 * owns the directory or is in its group may still get in). Logs only. */
static void warn_unreachable(const char *path, mode_t mode, gid_t gid) {
  int grp = (mode & S_IWGRP) != 0, oth = (mode & S_IWOTH) != 0;
  if (!grp && !oth)
    return;
  char real[PATH_MAX];
  char dir[sizeof(((struct sockaddr_un *)0)->sun_path)];
  snprintf(dir, sizeof(dir), "%s", path);
  char *slash = strrchr(dir, '/');
  if (slash == NULL)
    snprintf(dir, sizeof(dir), ".");
  else if (slash == dir)
    dir[1] = '\0';
  else
    *slash = '\0';
  if (realpath(dir, real) == NULL)
    return;
  /* From the root down: the first that stops them is the one to fix. */
  size_t len = strlen(real);
  char at[PATH_MAX];
  for (size_t i = 0; i <= len; i++) {
    if (i < len && real[i] != '/')
      continue;
    if (i == 0)
      snprintf(at, sizeof(at), "/");
    else
      snprintf(at, sizeof(at), "%.*s", (int)i, real);
    struct stat st;
    if (stat(at, &st) < 0)
      return;
    int grp_in = st.st_gid == gid ? (st.st_mode & S_IXGRP) != 0
                                  : (st.st_mode & S_IXOTH) != 0;
    int oth_in = (st.st_mode & S_IXOTH) != 0;
    if ((grp && !grp_in) || (oth && !oth_in)) {
      char who[96];
      td__warn("--socket-mode %04o lets %s connect to %s, but directory %s "
               "(mode %04o, owner %s, group %u) does not let them reach it: "
               "give it the search bit (chmod o+x %s, or chgrp it to the "
               "socket's group and chmod g+x)",
               (unsigned)mode, oth ? "everyone" : "the socket's group", path,
               at, (unsigned)(st.st_mode & 07777),
               td__uid_name(st.st_uid, who, sizeof(who)), (unsigned)st.st_gid,
               at);
      return;
    }
  }
}

/* Gives the socket we bound (with --socket-mode already) to --socket-group,
 * and warns of what keeps others out all the same. */
static int socket_access(td__server *srv, const td__options *o) {
  gid_t gid = (gid_t)-1;
  if (o->socket_group != NULL) {
    struct group *g = getgrnam(o->socket_group);
    char *end;
    unsigned long n = strtoul(o->socket_group, &end, 10);
    if (g != NULL)
      gid = g->gr_gid;
    else if (*o->socket_group != '\0' && *end == '\0')
      gid = (gid_t)n;
    else {
      td__error("--socket-group %s: no such group", o->socket_group);
      return TD_EINVAL;
    }
  }
  if (gid != (gid_t)-1 && chown(srv->socket_path, (uid_t)-1, gid) < 0) {
    td__error("--socket-group %s: chown(%s): %s", o->socket_group,
              srv->socket_path, strerror(errno));
    return -errno;
  }
  struct stat st;
  if ((o->socket_group == NULL && o->socket_mode < 0) ||
      stat(srv->socket_path, &st) < 0)
    return 0;
  if (o->socket_group != NULL && !(st.st_mode & S_IWGRP))
    td__warn("--socket-group %s: the socket's mode %04o gives the group no "
             "write bit, so its members cannot connect (add --socket-mode "
             "0660)",
             o->socket_group, (unsigned)(st.st_mode & 07777));
  warn_unreachable(srv->socket_path, st.st_mode & 07777, st.st_gid);
  return 0;
}

/* A daemon that died without cleaning up (SIGKILL, a crash) leaves its
 * segments behind; the next one on the same socket finds its instance in
 * <socket>.instance and unlinks them (unless --state-dir serves them). */
static void sweep_previous(td__server *srv) {
  snprintf(srv->run_path, sizeof(srv->run_path), "%s.instance",
           srv->socket_path);
  FILE *f = fopen(srv->run_path, "r");
  if (f == NULL)
    return;
  char line[128];
  while (fgets(line, sizeof(line), f) != NULL) {
    line[strcspn(line, "\n")] = '\0';
    if (!td__segment_prefix_valid(line) || strcmp(line, srv->prefix) == 0)
      continue;
    char(*p)[TD__PREFIX_MAX] =
        realloc(srv->prev, (srv->nprev + 1) * sizeof(*srv->prev));
    if (p == NULL)
      break;
    srv->prev = p;
    memcpy(srv->prev[srv->nprev++], line, strlen(line) + 1); /* fits */
  }
  fclose(f);
}

/* Appends p to srv->prefixes unless it is there. Returns 0 or TD_ENOMEM
 * (the list is unchanged then). */
static int add_prefix(td__server *srv, const char *p) {
  for (size_t i = 0; i < srv->nprefixes; i++)
    if (strcmp(srv->prefixes[i], p) == 0)
      return 0;
  char(*l)[TD__PREFIX_MAX] =
      realloc(srv->prefixes, (srv->nprefixes + 1) * sizeof(*srv->prefixes));
  if (l == NULL)
    return TD_ENOMEM;
  srv->prefixes = l;
  snprintf(l[srv->nprefixes++], TD__PREFIX_MAX, "%s", p);
  return 0;
}

/* Without --state-dir, unlinks what the previous daemon on this socket left
 * (with it, td__state_open sweeps them, keeping what keys name). Then
 * records the prefixes this daemon's segments have: its own and those of
 * segments it adopted, in <socket>.instance and in srv->prefixes (for
 * tensorctl stat). */
static void record_instance(td__server *srv) {
  for (size_t i = 0; i < srv->nprev && srv->state == NULL; i++) {
    int n = td__segments_unlink_prefix(srv->prev[i] + 1, NULL, NULL);
    if (n > 0)
      td__warn("unlinked %d segment(s) left by the previous tensord on %s "
               "(%s*)",
               n, srv->socket_path, srv->prev[i]);
  }
  int ok = add_prefix(srv, srv->prefix) == 0 &&
           add_prefix(srv, srv->pool.prefix) == 0;
  char last[TD__PREFIX_MAX] = "";
  for (const td__storage *s = srv->reg.first; s && ok; s = s->next) {
    char p[TD__PREFIX_MAX];
    if (td__segment_prefix(s->name, p) == 0 && strcmp(p, last) != 0) {
      ok = add_prefix(srv, p) == 0;
      memcpy(last, p, sizeof(last));
    }
  }
  char tmp[sizeof(srv->run_path) + 8];
  snprintf(tmp, sizeof(tmp), "%s.tmp", srv->run_path);
  FILE *f = ok ? fopen(tmp, "w") : NULL;
  ok = f != NULL;
  for (size_t i = 0; i < srv->nprefixes && ok; i++)
    ok = fprintf(f, "%s\n", srv->prefixes[i]) > 0;
  if (f != NULL && fclose(f) != 0)
    ok = 0;
  if (!ok || rename(tmp, srv->run_path) < 0) {
    td__warn("cannot record this instance in %s: %s; a crash would leave "
             "its segments for the operator to remove",
             srv->run_path, strerror(errno));
    unlink(tmp);
  }
}

/* hooks.conn_gone. */
static void conn_gone(td__conn *c) {
  td__ops_conn_gone(c);
  td__chans_conn_gone(c);
  td__state_conn_gone(c->srv->state, c);
  td__upgrade_conn_gone(c);
}

const td__hooks td__serving = {td__dispatch, conn_gone, stop_finish};

void td__server_init(td__server *srv, uv_loop_t *loop, const td__options *o) {
  memset(srv, 0, sizeof(*srv));
  srv->loop = loop;
  srv->hooks = td__serving;
  srv->listen_fd = -1;
  srv->start_ms = td__now_ms();
  td__waits_init(&srv->waits);
  td__chans_init(&srv->chans);
  if (getrandom(&srv->instance, sizeof(srv->instance), 0) !=
      sizeof(srv->instance))
    srv->instance = (uint64_t)getpid() << 32 ^ (uint64_t)srv->start_ms;
  /* Names no other instance can produce: its own random instance id. */
  snprintf(srv->prefix, sizeof(srv->prefix), "/tensord.%016llx.",
           (unsigned long long)srv->instance);

  uint64_t shm_free = 0, shm_total = 0;
  td__backend_for(TD_CPU)->space(&shm_free, &shm_total);
  uint64_t capacity = o->capacity ? o->capacity : shm_total / 2;
  char a[32], b[32];
  if (o->capacity && o->capacity > shm_total)
    td__warn("--capacity %s is more than /dev/shm holds (%s); creates will "
             "fail with ENOSPC before they reach it",
             td__human_bytes(o->capacity, a, sizeof(a)),
             td__human_bytes(shm_total, b, sizeof(b)));
  srv->argv = o->argv;
  srv->binary = o->binary;
  td__registry_init(&srv->reg, capacity, td__storage_gone, srv);
  srv->reg.quota = o->quota;
  srv->max_clients = o->max_clients;
  srv->max_storages_per_client = o->max_storages_per_client;
  srv->max_waiters_per_client = o->max_waiters_per_client
                                    ? o->max_waiters_per_client
                                    : TD__MAX_WAITERS_PER_CLIENT;
  srv->max_keys_per_uid =
      o->max_keys_per_uid ? o->max_keys_per_uid : TD__MAX_KEYS_PER_UID;
  srv->io_timeout_ms = o->io_timeout_ms ? o->io_timeout_ms : 30000;
  srv->upgrade_timeout_ms =
      o->upgrade_timeout_ms ? o->upgrade_timeout_ms : TD__UPGRADE_TIMEOUT_MS;
  uint64_t recycle =
      o->recycle_set ? o->recycle_bytes : capacity / TD__RECYCLE_SHARE;
  if (recycle > capacity)
    recycle = capacity;
  td__pool_init(
      &srv->pool, recycle,
      (int64_t)(o->recycle_idle_ms ? o->recycle_idle_ms : TD__RECYCLE_IDLE_MS),
      srv->instance);
}

void td__server_listen(td__server *srv) {
  uv_loop_t *loop = srv->loop;
  srv->listening = 1;
  uv_poll_init(loop, &srv->listen_poll, srv->listen_fd);
  uv_timer_init(loop, &srv->accept_timer);
  uv_timer_init(loop, &srv->pool_timer);
  td__chans_listen(srv);
  uv_check_init(loop, &srv->unlink_check);
  uv_poll_start(&srv->listen_poll, UV_READABLE, on_accept);
  uv_signal_init(loop, &srv->sigint);
  uv_signal_init(loop, &srv->sigterm);
  srv->sigint.data = srv->sigterm.data = srv;
  uv_signal_start(&srv->sigint, on_signal, SIGINT);
  uv_signal_start(&srv->sigterm, on_signal, SIGTERM);
}

int td__server_start(td__server *srv, uv_loop_t *loop, const td__options *o) {
  char a[32];
  td__server_init(srv, loop, o);
  int err = adopt_socket(srv);
  if (err == 0) {
    char path[sizeof(srv->socket_path)];
    const char *p = o->socket_path;
    if (p == NULL) {
      err = td_default_socket_path(path, sizeof(path));
      if (err < 0) {
        td__error("default socket path too long");
        return err;
      }
      p = path;
    }
    err = bind_socket(srv, p,
                      (mode_t)(o->socket_mode >= 0 ? o->socket_mode : 0600));
    if (err == 0)
      err = socket_access(srv, o);
  } else if (err > 0 && (o->socket_group || o->socket_mode >= 0)) {
    td__warn("--socket-group and --socket-mode do not apply to a socket "
             "systemd passes: set SocketGroup= and SocketMode= in the unit");
  }
  if (err < 0)
    goto fail;
  if (o->metrics != NULL) {
    /* A scraper gets as long as a client, 10 s at most. */
    uint64_t t = srv->io_timeout_ms < 10000 ? srv->io_timeout_ms : 10000;
    err = td__scrape_open(&srv->scrape, srv, o->metrics, o->socket_mode, t);
    if (err < 0)
      goto fail;
  }
  sweep_previous(srv);
  if (o->state_dir != NULL) {
    snprintf(srv->state_dir, sizeof(srv->state_dir), "%s", o->state_dir);
    err = td__state_open(srv, o->state_dir);
    if (err < 0)
      goto fail;
  }
  record_instance(srv);
  td__server_listen(srv);

  td__info("tensord %s listening on %s%s (capacity %s, pid %d, instance "
           "%016llx)",
           TD_VERSION_STRING, srv->socket_path,
           srv->own_socket ? "" : " (inherited)",
           td__human_bytes(srv->reg.capacity, a, sizeof(a)), (int)getpid(),
           (unsigned long long)srv->instance);
  td__server_notify("READY=1");
  return 0;

fail:
  td__scrape_close(&srv->scrape);
  if (srv->listen_fd >= 0) {
    if (srv->own_socket)
      unlink(srv->socket_path);
    close(srv->listen_fd);
  }
  td__registry_free(&srv->reg);
  return err;
}

static void on_listen_closed(uv_handle_t *h) {
  td__server *srv = td__container_of((uv_poll_t *)h, td__server, listen_poll);
  close(srv->listen_fd);
  srv->listen_fd = -1;
}

/* The second half of td__server_stop, once no job is in flight. */
static void stop_finish(td__server *srv) {
  srv->stopped = 1;
  /* Pooled device memory never outlives tensord either; every job that
   * could pool more is done by now. */
  td__cuda_pool_drain();
  uint64_t storages = srv->reg.storages.count;
  uint64_t keys = srv->reg.keys.count;
  if (srv->state != NULL) {
    /* The keys' storages stay in /dev/shm for the next start. */
    td__state_close(srv->state);
    srv->state = NULL;
    srv->keep_segments = 1;
    td__info("kept %llu key(s) on %llu storage(s) for the next start",
             (unsigned long long)keys, (unsigned long long)storages);
  } else {
    td__info("released %llu storage(s)", (unsigned long long)storages);
  }
  td__chans_free(&srv->chans, &srv->reg);
  td__registry_free(&srv->reg);
  td__waits_free(&srv->waits);
  if (!srv->keep_segments && srv->run_path[0])
    unlink(srv->run_path);
  free(srv->prev);
  srv->prev = NULL;
  srv->nprev = 0;
  free(srv->prefixes);
  srv->prefixes = NULL;
  srv->nprefixes = 0;
}

void td__server_stop(td__server *srv) {
  if (srv->stopping)
    return;
  srv->stopping = 1;
  td__upgrade_stop(srv);
  if (srv->listening) {
    td__server_notify("STOPPING=1");
    uv_close((uv_handle_t *)&srv->listen_poll, on_listen_closed);
    uv_close((uv_handle_t *)&srv->accept_timer, NULL);
    uv_close((uv_handle_t *)&srv->pool_timer, NULL);
    td__chans_close(srv);
    uv_close((uv_handle_t *)&srv->unlink_check, NULL);
    uv_close((uv_handle_t *)&srv->sigint, NULL);
    uv_close((uv_handle_t *)&srv->sigterm, NULL);
    /* Closing them gave the signals their default action back: a second
     * one (timeout(1) signals the daemon and its process group) would kill
     * tensord before its segments are unlinked. The stop is under way:
     * ignore them; SIGKILL still ends it. */
    signal(SIGINT, SIG_IGN);
    signal(SIGTERM, SIG_IGN);
    td__scrape_close(&srv->scrape);
    if (srv->own_socket && unlink(srv->socket_path) < 0 && errno != ENOENT)
      td__warn("unlink(%s): %s", srv->socket_path, strerror(errno));
  }
  uint64_t n = srv->nconns;
  while (srv->conns != NULL)
    td__conn_close(srv->conns, "tensord is stopping");
  if (srv->ndrains > 0)
    td__info("dropping what %llu closed client(s) still held",
             (unsigned long long)srv->ndrains);
  td__drain_stop(srv);
  td__info("closed %llu client(s)", (unsigned long long)n);
  /* Pooled segments never outlive tensord, --state-dir or not (their
   * unlinks are jobs the stop waits for). */
  if (srv->pool.count > 0)
    td__info("unlinking %llu pooled segment(s) (%llu bytes)",
             (unsigned long long)srv->pool.count,
             (unsigned long long)srv->pool.bytes);
  td__pool_drain(srv);
  td__segment_unlink_flush(srv);
  /* A job still running on the thread pool would find the state or the
   * registry freed under it: its completion finishes the stop instead. */
  if (srv->pending_work > 0) {
    td__info("waiting for %llu job(s) on the thread pool to finish",
             (unsigned long long)srv->pending_work);
    return;
  }
  stop_finish(srv);
}

void td__server_finish(td__server *srv) {
  /* Whatever a bug might have left behind goes too; with --state-dir the
   * next start sweeps what no key names. */
  int n = td__segments_unlink_prefix(srv->pool.prefix + 1, NULL, NULL);
  if (n > 0)
    td__warn("unlinked %d pooled segment(s) still in /dev/shm at exit", n);
  if (srv->keep_segments)
    return;
  n = td__segments_unlink_prefix(srv->prefix + 1, NULL, NULL);
  if (n > 0)
    td__warn("unlinked %d segment(s) still in /dev/shm at exit", n);
}
