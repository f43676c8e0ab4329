/* events.c: an event as the wire's Event message. */
#include "events.h"

#include "log.h"

void td__event_message(const td__event *ev, Tensord__Event *e) {
  e->type = (Tensord__Event__Type)ev->type;
  e->unix_ms = td__now_ms();
  if (ev->s != NULL) {
    e->id = ev->s->id;
    e->nbytes = ev->s->nbytes;
    e->device = (Tensord__Device)ev->s->device;
  }
  if (ev->key != NULL) {
    e->key.data = (uint8_t *)ev->key;
    e->key.len = ev->key_len;
  }
  const td__peer *peer = ev->by != NULL ? &ev->by->peer : ev->peer;
  if (peer != NULL) {
    e->pid = peer->pid;
    e->uid = peer->uid;
  }
  e->name = ev->by != NULL ? (char *)ev->by->name : "";
  e->code = ev->code;
  e->message = ev->message != NULL ? (char *)ev->message : "";
}
