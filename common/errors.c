/* errors.c: names and descriptions of the TD_E* codes, messages, and the
 * one error channel: each thread's last failure, of any call and per
 * client. */
#include "common.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *td_strerror(int err) {
  switch (err) {
  case 0:
    return "success";
#define XX(name, code, msg)                                                    \
  case code:                                                                   \
    return msg;
    TD_ERRNO_MAP(XX)
#undef XX
  }
  return "unknown error";
}

const char *td_err_name(int err) {
  switch (err) {
  case 0:
    return "OK";
#define XX(name, code, _)                                                      \
  case code:                                                                   \
    return #name;
    TD_ERRNO_MAP(XX)
#undef XX
  }
  return "EUNKNOWN";
}

int td__msg(char *msg, size_t len, int err, const char *fmt, ...) {
  if (msg != NULL && len > 0) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, len, fmt, ap);
    va_end(ap);
  }
  return err;
}

/* ---- the error channel ---- */

/* This thread's last failure of any call (td_last_error(NULL)), and whose
 * it was (NULL: no client's). Static, so that even a thread that cannot
 * allocate can say why it failed. */
static __thread char any[TD__ERRMSG_MAX];
static __thread const void *any_owner;

/* This thread's last failure on each of the TD__ERR_OWNERS owners it most
 * recently failed on; allocated at its first such failure, freed when the
 * thread exits. Owners are compared by address only, never dereferenced. */
typedef struct slot {
  const void *owner; /* NULL: unused */
  uint64_t used;     /* when it was last written, in writes of this thread */
  char msg[TD__ERRMSG_MAX];
} slot;
static __thread slot *slots;
static __thread uint64_t writes;

static pthread_key_t slots_key;
static pthread_once_t slots_once = PTHREAD_ONCE_INIT;
static int slots_key_ok;

static void slots_init(void) {
  slots_key_ok = pthread_key_create(&slots_key, free) == 0;
}

/* Returns this thread's slots, allocating them on first use; NULL if that
 * fails. */
static slot *thread_slots(void) {
  if (slots != NULL)
    return slots;
  pthread_once(&slots_once, slots_init);
  if (!slots_key_ok)
    return NULL;
  slot *s = calloc(TD__ERR_OWNERS, sizeof(*s));
  if (s == NULL)
    return NULL;
  if (pthread_setspecific(slots_key, s) != 0) {
    free(s);
    return NULL;
  }
  return slots = s;
}

int td__vfail(const void *owner, int err, const char *fmt, va_list ap) {
  /* Formatted apart first: an argument may be this thread's last message. */
  char msg[TD__ERRMSG_MAX];
  vsnprintf(msg, sizeof(msg), fmt, ap);
  memcpy(any, msg, sizeof(any));
  any_owner = owner;
  slot *s = owner != NULL ? thread_slots() : NULL;
  if (s == NULL)
    return err;
  slot *to = &s[0];
  for (int i = 0; i < TD__ERR_OWNERS; i++) {
    if (s[i].owner == owner) {
      to = &s[i];
      break;
    }
    if (s[i].used < to->used)
      to = &s[i]; /* unused slots have used 0: they go first */
  }
  to->owner = owner;
  to->used = ++writes;
  memcpy(to->msg, msg, sizeof(to->msg));
  return err;
}

int td__fail(const void *owner, int err, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  td__vfail(owner, err, fmt, ap);
  va_end(ap);
  return err;
}

const char *td__last_error(const void *owner) {
  if (owner == NULL || any_owner == owner)
    return any;
  for (int i = 0; slots != NULL && i < TD__ERR_OWNERS; i++)
    if (slots[i].owner == owner)
      return slots[i].msg;
  return "";
}

void td__err_forget(const void *owner) {
  if (any_owner == owner)
    any_owner = NULL;
  for (int i = 0; slots != NULL && i < TD__ERR_OWNERS; i++)
    if (slots[i].owner == owner)
      slots[i].owner = NULL;
}
