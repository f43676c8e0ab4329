/* watch.c: td_watch, a connection that receives the daemon's events. */
#include "internal.h"

#include "tensord.pb-c.h"
#include "wire.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

struct td_watch {
  td_client *c;            /* owned; takes no other call */
  td__wire *wire;          /* c's */
  uint64_t seq;            /* the Watch's: every event carries it */
  Tensord__Response *last; /* the event *ev points into, until the next */
  char key[TD_KEY_MAX + 1];
};

int td_watch_open(const char *socket_path, const char *prefix, td_watch **out) {
  *out = NULL;
  size_t len = prefix != NULL ? strlen(prefix) : 0;
  if (len > TD_KEY_MAX)
    return td__fail(NULL, TD_EINVAL,
                    "watch: a prefix of %zu bytes; keys have at most %d", len,
                    TD_KEY_MAX);
  td_watch *w = calloc(1, sizeof(*w));
  if (w == NULL)
    return td__fail(NULL, TD_ENOMEM, "watch: out of memory");
  int err = td_connect(socket_path, &w->c);
  if (err < 0) {
    free(w);
    return err;
  }
  err = td__client_watch(w->c, prefix, len, &w->wire, &w->seq);
  if (err < 0) {
    char why[TD__ERRMSG_MAX];
    snprintf(why, sizeof(why), "%s", td_last_error(w->c));
    td__fail(NULL, err, "%s", why); /* it names the watch already */
    td_close(w->c);
    free(w);
    return err;
  }
  *out = w;
  return 0;
}

int td_watch_fd(const td_watch *w) {
  return w->wire->fd;
}

const char *td_event_type_name(int type) {
  static const char *const names[] = {
      "none", "create",  "publish",    "take",    "unpublish",
      "free", "connect", "disconnect", "refused", "lookup"};
  if (type < 1 || type >= (int)(sizeof(names) / sizeof(names[0])))
    return "unknown";
  return names[type];
}

/* Fills ev from e; strings point into e (and w->key). */
static void event_from_msg(td_watch *w, const Tensord__Event *e, td_event *ev) {
  memset(ev, 0, sizeof(*ev));
  ev->type = (td_event_type)e->type;
  ev->pid = e->pid;
  ev->uid = e->uid;
  ev->code = e->code;
  ev->unix_ms = e->unix_ms;
  ev->id = e->id;
  ev->nbytes = e->nbytes;
  ev->device = (td_device)e->device;
  size_t n = e->key.len < TD_KEY_MAX ? e->key.len : TD_KEY_MAX;
  if (n > 0)
    memcpy(w->key, e->key.data, n);
  w->key[n] = '\0';
  ev->key = w->key;
  ev->name = e->name;
  ev->message = e->message;
  ev->dropped = e->dropped;
}

int td_watch_next(td_watch *w, int timeout_ms, td_event *ev) {
  if (w->last != NULL) {
    tensord__response__free_unpacked(w->last, NULL);
    w->last = NULL;
  }
  for (;;) {
    td__frame f;
    int r = td__wire_frame(w->wire, &f);
    if (r < 0)
      return td__fail(w->c, r, "watch: a garbled frame from tensord");
    if (r == 1) {
      Tensord__Response *resp = tensord__response__unpack(NULL, f.len, f.data);
      td__close_fds(f.fds, f.nfds);
      td__wire_consume(w->wire, &f);
      if (resp == NULL)
        return td__fail(w->c, TD_EPROTO,
                        "watch: a frame that does not decode as a Response");
      if (resp->body_case == TENSORD__RESPONSE__BODY_EVENT &&
          resp->seq == w->seq) {
        w->last = resp;
        event_from_msg(w, resp->event, ev);
        return 0;
      }
      int err = TD_EPROTO;
      if (resp->body_case == TENSORD__RESPONSE__BODY_ERROR) {
        /* The daemon's last word before it hangs up (a protocol error). */
        err = resp->error->code < 0 ? resp->error->code : TD_EPROTO;
        td__fail(w->c, err, "watch: tensord says: %s", resp->error->message);
      } else {
        td__fail(w->c, err,
                 "watch: tensord sent body %d where events were "
                 "due",
                 (int)resp->body_case);
      }
      tensord__response__free_unpacked(resp, NULL);
      return err;
    }
    struct pollfd p = {.fd = w->wire->fd, .events = POLLIN};
    int n = poll(&p, 1, timeout_ms);
    if (n < 0 && errno == EINTR)
      return TD_EAGAIN;
    if (n < 0)
      return td__fail(w->c, -errno, "watch: poll: %s", strerror(errno));
    if (n == 0)
      return TD_ETIMEDOUT;
    ssize_t got = td__wire_recv(w->wire, MSG_DONTWAIT);
    if (got == TD_EAGAIN)
      continue;
    if (got == 0)
      return td__fail(w->c, TD_ECONNRESET,
                      "watch: tensord closed the "
                      "connection");
    if (got < 0)
      return td__fail(w->c, (int)got == TD_EPROTO ? TD_EPROTO : TD_ECONNRESET,
                      "watch: reading events: %s", td_strerror((int)got));
  }
}

void td_watch_close(td_watch *w) {
  if (w == NULL)
    return;
  if (w->last != NULL)
    tensord__response__free_unpacked(w->last, NULL);
  td_close(w->c);
  free(w);
}
