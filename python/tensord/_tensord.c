/* _tensord.c: the tensord Python extension, Client and Tensor over the public
 * API of libtensord (tensord.h) and DLPack; see docs/python.md. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <dlpack/dlpack.h>
#include <tensord.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* A lookup that waits is cut into waits of at most this many ms, so that
 * Ctrl-C, close() and a cancelled alookup are seen within that long. */
#define SLICE_MS 50

/* ---- module state ---- */

static PyObject *Error, *NotFound, *Timeout, *PermissionDenied, *OutOfMemory,
    *QuotaExceeded, *Closed, *Exists, *BrokenPipe;
/* Imported at first use: the extension needs neither numpy nor torch. */
static PyObject *np_asarray, *np_dtype, *torch_from_dlpack, *torch_bool;

/* Clients' state (c, closed, inflight, gen). Taken only WITHOUT the GIL (or
 * by a thread that never waits for the GIL while holding it), so that a
 * thread holding it never waits for a thread holding the GIL. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
/* Signalled when a closing Client's last call leaves. */
static pthread_cond_t g_cv = PTHREAD_COND_INITIALIZER;
/* Bumped in every forked child: a Client made in another generation holds
 * its parent's connection. */
static atomic_uint g_forkgen;

/* ---- storage references and the registry behind find() ---- */

/* One td_storage reference, shared by the Tensors, numpy exporters and
 * DLPack exports made from it, each of which counts in refs. Pure C: it may
 * be dropped without the GIL (a DLPack deleter). */
typedef struct store {
  td_storage *s; /* NULL once sent through a channel (a slot's hand-over) */
  atomic_long refs;
  char *base;
  size_t len;
  uint64_t instance; /* the daemon's (td_client_instance): ids are per daemon */
  int cuda;          /* a GPU's storage: base is a device pointer */
  int device_index;  /* and the GPU's ordinal in this process */
  /* A slot of a channel (Channel.loan, or a slot Channel.recv got): sending
   * it hands over s itself, which must then be the only reference. */
  int slot;
  /* Under the GIL: calls that use s without the GIL (publish, copy_,
   * share, wait) in progress, and a Channel.send handing s over. */
  int busy;
  int handing;
  int listed;                /* in g_stores, under g_reg_mu */
  struct store *prev, *next; /* g_stores, under g_reg_mu */
} store;

static pthread_mutex_t g_reg_mu = PTHREAD_MUTEX_INITIALIZER;
static store *g_stores;

static void atfork_child(void) {
  pthread_mutex_init(&g_mu, NULL);
  pthread_cond_init(&g_cv, NULL);
  pthread_mutex_init(&g_reg_mu, NULL);
  atomic_fetch_add(&g_forkgen, 1);
}

/* Returns a store holding s's reference (taken over), or NULL when out of
 * memory, in which case s is released. */
static store *store_new(td_storage *s) {
  store *p = calloc(1, sizeof(*p));
  if (p == NULL) {
    td_storage_release(s);
    return NULL;
  }
  p->s = s;
  atomic_init(&p->refs, 1);
  p->base = td_storage_data(s);
  p->len = td_storage_nbytes(s);
  p->instance = td_client_instance(td_storage_client(s));
  p->cuda = td_storage_device(s) == TD_CUDA;
  p->device_index = td_storage_device_index(s);
  pthread_mutex_lock(&g_reg_mu);
  p->listed = 1;
  p->next = g_stores;
  if (g_stores != NULL)
    g_stores->prev = p;
  g_stores = p;
  pthread_mutex_unlock(&g_reg_mu);
  return p;
}

/* Takes one more reference; the caller holds one already. */
static store *store_ref(store *p) {
  atomic_fetch_add(&p->refs, 1);
  return p;
}

/* Takes a reference on a store found in g_stores (under g_reg_mu) by a
 * caller that holds none: only from a count above zero. Returns p, or NULL
 * when the count has reached zero: its last holder is on its way to unlink
 * and free it (store_unref) and waits for g_reg_mu to do so. */
static store *store_revive(store *p) {
  long n = atomic_load(&p->refs);
  while (n > 0)
    if (atomic_compare_exchange_weak(&p->refs, &n, n + 1))
      return p;
  return NULL;
}

/* Takes p out of g_stores, so that find() no longer sees it. Needs
 * g_reg_mu. */
static void store_unlist(store *p) {
  if (!p->listed)
    return;
  p->listed = 0;
  if (p->prev != NULL)
    p->prev->next = p->next;
  else
    g_stores = p->next;
  if (p->next != NULL)
    p->next->prev = p->prev;
}

/* Drops one reference; the last releases the td_storage (without the GIL
 * if the caller holds it: a release may send a message), unless a channel
 * took it. The count reaches zero before the store leaves g_stores, so
 * find() revives a store only with store_revive, never with store_ref. */
static void store_unref(store *p) {
  if (p == NULL || atomic_fetch_sub(&p->refs, 1) != 1)
    return;
  pthread_mutex_lock(&g_reg_mu);
  store_unlist(p);
  pthread_mutex_unlock(&g_reg_mu);
  if (p->s == NULL) {
  } else if (Py_IsInitialized() && PyGILState_Check()) {
    Py_BEGIN_ALLOW_THREADS
      td_storage_release(p->s);
    Py_END_ALLOW_THREADS
  } else {
    td_storage_release(p->s);
  }
  free(p);
}

/* With the GIL: a reference for a call that uses p->s without the GIL, which
 * a Channel.send of the same storage meanwhile refuses (store_done ends it). */
static store *store_use(store *p) {
  p->busy++;
  return store_ref(p);
}

static void store_done(store *p) {
  p->busy--;
  store_unref(p);
}

/* ---- errors ---- */

static PyObject *error_class(int err) {
  switch (err) {
  case TD_ENOENT:
    return NotFound;
  case TD_ETIMEDOUT:
    return Timeout;
  case TD_EACCES:
  case TD_EPERM:
    return PermissionDenied;
  case TD_ENOMEM:
  case TD_ENOSPC:
    return OutOfMemory;
  case TD_EDQUOT:
    return QuotaExceeded;
  case TD_ENOTCONN:
  case TD_ECONNRESET:
    return Closed;
  case TD_EPIPE:
    return BrokenPipe;
  case TD_EEXIST:
    return Exists;
  default:
    return Error;
  }
}

/* Returns a new instance of the tensord.Error subclass of err, with .code,
 * .name and .message (msg, or td_strerror(err) when msg is empty); NULL
 * with an exception set on failure. */
static PyObject *err_object(int err, const char *msg) {
  if (msg == NULL || *msg == '\0')
    msg = td_strerror(err);
  PyObject *cls = error_class(err);
  PyObject *m = PyUnicode_DecodeUTF8(msg, (Py_ssize_t)strlen(msg), "replace");
  if (m == NULL)
    return NULL;
  PyObject *e = PyObject_CallOneArg(cls, m);
  PyObject *code = PyLong_FromLong(err);
  PyObject *name = PyUnicode_FromString(td_err_name(err));
  if (e == NULL || code == NULL || name == NULL ||
      PyObject_SetAttrString(e, "code", code) < 0 ||
      PyObject_SetAttrString(e, "name", name) < 0 ||
      PyObject_SetAttrString(e, "message", m) < 0)
    Py_CLEAR(e);
  Py_XDECREF(code);
  Py_XDECREF(name);
  Py_DECREF(m);
  return e;
}

/* Raises err_object(err, msg). Returns NULL. */
static PyObject *raise_err(int err, const char *msg) {
  PyObject *e = err_object(err, msg);
  if (e != NULL) {
    PyErr_SetObject((PyObject *)Py_TYPE(e), e);
    Py_DECREF(e);
  }
  return NULL;
}

/* A view operation failed: ValueError, or IndexError for an index or range
 * outside its dimension, with libtensord's message. Returns NULL. */
static PyObject *raise_view(int err) {
  PyErr_SetString(err == TD_ERANGE ? PyExc_IndexError : PyExc_ValueError,
                  td_view_last_error());
  return NULL;
}

/* ---- dtypes ---- */

static int import_numpy(void) {
  if (np_asarray != NULL)
    return 0;
  PyObject *np = PyImport_ImportModule("numpy");
  if (np == NULL)
    return -1;
  np_asarray = PyObject_GetAttrString(np, "asarray");
  np_dtype = PyObject_GetAttrString(np, "dtype");
  Py_DECREF(np);
  if (np_asarray == NULL || np_dtype == NULL) {
    Py_CLEAR(np_asarray);
    Py_CLEAR(np_dtype);
    return -1;
  }
  return 0;
}

/* Parses any dtype spelling: a string (torch's or numpy's names, numpy's
 * type strings), a torch dtype, a numpy dtype or scalar type, a Python type
 * numpy understands. Returns 0, or -1 with TypeError. */
static int parse_dtype(PyObject *o, td_dtype *out) {
  td_dtype d = TD_DTYPE_INVALID;
  if (PyUnicode_Check(o)) {
    const char *name = PyUnicode_AsUTF8(o);
    if (name == NULL)
      return -1;
    d = td_dtype_from_name(name);
  } else {
    /* torch.float16 and np.dtype("float16") say their name in str(). */
    PyObject *s = PyObject_Str(o);
    if (s == NULL)
      return -1;
    const char *name = PyUnicode_AsUTF8(s);
    if (name != NULL)
      d = td_dtype_from_name(name);
    Py_DECREF(s);
    if (name == NULL)
      return -1;
    if (d == TD_DTYPE_INVALID && import_numpy() == 0) {
      PyObject *nd = PyObject_CallOneArg(np_dtype, o);
      PyObject *nn = nd ? PyObject_GetAttrString(nd, "name") : NULL;
      const char *n = nn ? PyUnicode_AsUTF8(nn) : NULL;
      if (n != NULL)
        d = td_dtype_from_name(n);
      Py_XDECREF(nn);
      Py_XDECREF(nd);
    }
    PyErr_Clear();
  }
  if (d == TD_DTYPE_INVALID) {
    PyErr_Format(PyExc_TypeError,
                 "unknown dtype %R: give a torch or numpy dtype or its name "
                 "(\"float32\", \"bfloat16\", \"uint8\", ...)",
                 o);
    return -1;
  }
  *out = d;
  return 0;
}

/* numpy's array-protocol type string of d, or NULL where numpy has none. */
static const char *np_typestr(td_dtype d) {
  switch (d) {
  case TD_BOOL:
    return "|b1";
  case TD_UINT8:
    return "|u1";
  case TD_INT8:
    return "|i1";
  case TD_INT16:
    return "<i2";
  case TD_INT32:
    return "<i4";
  case TD_INT64:
    return "<i8";
  case TD_FLOAT16:
    return "<f2";
  case TD_FLOAT32:
    return "<f4";
  case TD_FLOAT64:
    return "<f8";
  case TD_COMPLEX64:
    return "<c8";
  case TD_COMPLEX128:
    return "<c16";
  case TD_UINT16:
    return "<u2";
  case TD_UINT32:
    return "<u4";
  case TD_UINT64:
    return "<u8";
  default:
    return NULL;
  }
}

/* The struct-module format of d for the buffer protocol, or NULL. */
static const char *buf_format(td_dtype d) {
  switch (d) {
  case TD_BOOL:
    return "?";
  case TD_UINT8:
    return "B";
  case TD_INT8:
    return "b";
  case TD_INT16:
    return "h";
  case TD_INT32:
    return "i";
  case TD_INT64:
    return "q";
  case TD_FLOAT16:
    return "e";
  case TD_FLOAT32:
    return "f";
  case TD_FLOAT64:
    return "d";
  case TD_COMPLEX64:
    return "Zf";
  case TD_COMPLEX128:
    return "Zd";
  case TD_UINT16:
    return "H";
  case TD_UINT32:
    return "I";
  case TD_UINT64:
    return "Q";
  default:
    return NULL;
  }
}

/* The dtype of a buffer's struct format ("<f", "Zd", "?"), or invalid. */
static td_dtype dtype_of_format(const char *f, Py_ssize_t itemsize) {
  if (f == NULL)
    f = "B";
  if (*f == '@' || *f == '=' || *f == '<')
    f++;
  td_dtype d = TD_DTYPE_INVALID;
  if (strcmp(f, "Zf") == 0)
    d = TD_COMPLEX64;
  else if (strcmp(f, "Zd") == 0)
    d = TD_COMPLEX128;
  else if (strlen(f) == 1 && strchr("?bBhHiIlLqQefd", *f) != NULL)
    d = td_dtype_from_name(f);
  if (d != TD_DTYPE_INVALID && (Py_ssize_t)td_dtype_size(d) != itemsize)
    return TD_DTYPE_INVALID;
  return d;
}

/* The dtype of a DLPack type, or invalid. bool travels as uint8. */
static td_dtype dtype_of_dl(DLDataType t) {
  if (t.lanes != 1)
    return TD_DTYPE_INVALID;
  switch (t.code) {
  case kDLUInt:
    return t.bits == 8    ? TD_UINT8
           : t.bits == 16 ? TD_UINT16
           : t.bits == 32 ? TD_UINT32
           : t.bits == 64 ? TD_UINT64
                          : TD_DTYPE_INVALID;
  case kDLInt:
    return t.bits == 8    ? TD_INT8
           : t.bits == 16 ? TD_INT16
           : t.bits == 32 ? TD_INT32
           : t.bits == 64 ? TD_INT64
                          : TD_DTYPE_INVALID;
  case kDLFloat:
    return t.bits == 16   ? TD_FLOAT16
           : t.bits == 32 ? TD_FLOAT32
           : t.bits == 64 ? TD_FLOAT64
                          : TD_DTYPE_INVALID;
  case kDLBfloat:
    return t.bits == 16 ? TD_BFLOAT16 : TD_DTYPE_INVALID;
  case kDLComplex:
    return t.bits == 64    ? TD_COMPLEX64
           : t.bits == 128 ? TD_COMPLEX128
                           : TD_DTYPE_INVALID;
  case 6: /* kDLBool of DLPack 0.8 */
    return t.bits == 8 ? TD_BOOL : TD_DTYPE_INVALID;
  }
  return TD_DTYPE_INVALID;
}

/* ---- time ---- */

static int64_t mono_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* The mono_ms() at which a wait of secs from start (a mono_ms()) is over.
 * mono_ms() truncates to the millisecond, so start may lie up to 1 ms
 * before the true start: one more keeps a wait from ending early (none
 * for 0, which does not wait). */
static int64_t deadline_of(int64_t start, double secs) {
  return secs > 0 ? start + (int64_t)(secs * 1000.0 + 0.999) + 1 : start;
}

static int64_t real_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* ---- types ---- */

typedef struct Client {
  PyObject_HEAD td_client *c; /* NULL once closed */
  char *path;                 /* the socket, resolved at connect */
  char *name;                 /* asked for, or NULL: a forked child's too */
  unsigned gen;               /* g_forkgen of c's process */
  int closed;
  long inflight; /* calls on c in progress */
  PyObject *weakrefs;
} Client;

typedef struct Tensor {
  PyObject_HEAD store *st; /* this Tensor's reference; NULL once dropped */
  td_view v;
  PyObject *key;    /* str or NULL */
  PyObject *client; /* Client or NULL */
  uint64_t sid;
  uint64_t instance; /* the daemon's that sid belongs to */
  size_t snbytes;
  int readonly;
  int released;  /* release() was called */
  int exports;   /* buffers exported and not yet released */
  int interface; /* __array_interface__ was handed out */
  Py_ssize_t bshape[TD_MAX_DIMS], bstrides[TD_MAX_DIMS];
  PyObject *weakrefs;
} Tensor;

/* What numpy() hands numpy: its own reference and __array_interface__. */
typedef struct Exporter {
  PyObject_HEAD store *st;
  PyObject *iface;
} Exporter;

static PyTypeObject ClientType, TensorType, ExporterType;

/* ---- Client: calls, fork and close ---- */

/* Room for a failed call's message, read right after the call. */
typedef struct call {
  td_client *c;
  char msg[1024];
} call;

/* Called WITHOUT the GIL. Counts a call in flight on self and sets x->c, or
 * returns TD_ENOTCONN if self is closed. In a forked child the first call
 * closes the child's copy of the parent's connection (which leaves the
 * parent's alone) and connects again to the same path; its failure is
 * returned. */
static int cl_enter(Client *self, call *x) {
  int err = 0;
  x->msg[0] = '\0';
  pthread_mutex_lock(&g_mu);
  if (self->closed) {
    snprintf(x->msg, sizeof(x->msg), "client of %s is closed", self->path);
    err = TD_ENOTCONN;
  } else if (self->gen != atomic_load(&g_forkgen)) {
    /* The parent's threads are not here: none of its calls is ours. */
    td_client *old = self->c, *c = NULL;
    self->c = NULL;
    self->inflight = 0;
    td_close(old);
    td_connect_opts o = {.name = self->name};
    err = td_connect_ex(self->path, &o, &c);
    if (err < 0)
      snprintf(x->msg, sizeof(x->msg), "after fork(): %s", td_last_error(NULL));
    else {
      self->c = c;
      self->gen = atomic_load(&g_forkgen);
    }
  }
  if (err == 0) {
    self->inflight++;
    x->c = self->c;
  }
  pthread_mutex_unlock(&g_mu);
  return err;
}

/* Called WITHOUT the GIL: the call cl_enter counted is over. */
static void cl_leave(Client *self) {
  pthread_mutex_lock(&g_mu);
  if (--self->inflight == 0 && self->closed)
    pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
}

/* Called WITHOUT the GIL. Marks self closed, waits for the calls in flight
 * to leave (a waiting lookup leaves within SLICE_MS) and closes the
 * connection. No call begins on it afterwards. */
static void cl_close(Client *self) {
  pthread_mutex_lock(&g_mu);
  if (self->closed) {
    pthread_mutex_unlock(&g_mu);
    return;
  }
  self->closed = 1;
  while (self->inflight > 0 && self->gen == atomic_load(&g_forkgen))
    pthread_cond_wait(&g_cv, &g_mu);
  td_client *c = self->c;
  self->c = NULL;
  pthread_mutex_unlock(&g_mu);
  td_close(c); /* in a forked child: its own copy of the socket only */
}

/* Runs expr (which may use x.c) as a call on self without the GIL; err gets
 * its result and x.msg the message of a failure. */
#define CALL(self, x, err, expr)                                               \
  do {                                                                         \
    Py_BEGIN_ALLOW_THREADS                                                     \
      err = cl_enter((self), &(x));                                            \
      if (err == 0) {                                                          \
        err = (expr);                                                          \
        if (err < 0)                                                           \
          snprintf((x).msg, sizeof((x).msg), "%s", td_last_error((x).c));      \
        cl_leave(self);                                                        \
      }                                                                        \
    Py_END_ALLOW_THREADS                                                       \
  } while (0)

/* ---- Tensor construction ---- */

static void tensor_fill_buffer_dims(Tensor *t) {
  size_t es = td_dtype_size(t->v.dtype);
  for (int i = 0; i < t->v.ndim; i++) {
    t->bshape[i] = (Py_ssize_t)t->v.shape[i];
    t->bstrides[i] = (Py_ssize_t)(t->v.stride[i] * (int64_t)es);
  }
}

/* Returns a new Tensor over view v of p, taking over the caller's reference
 * on p (dropped on failure). */
static PyObject *tensor_new(store *p, const td_view *v, PyObject *key,
                            PyObject *client) {
  Tensor *t = PyObject_GC_New(Tensor, &TensorType);
  if (t == NULL) {
    store_unref(p);
    return NULL;
  }
  t->st = p;
  t->v = *v;
  t->key = key;
  Py_XINCREF(key);
  t->client = client;
  Py_XINCREF(client);
  t->sid = td_storage_id(p->s);
  t->instance = p->instance;
  t->snbytes = td_storage_nbytes(p->s);
  t->readonly = td_storage_is_readonly(p->s) != 0;
  t->released = 0;
  t->exports = 0;
  t->interface = 0;
  t->weakrefs = NULL;
  tensor_fill_buffer_dims(t);
  PyObject_GC_Track(t);
  return (PyObject *)t;
}

/* Returns a new Tensor over handle s (its reference taken over). */
static PyObject *tensor_of_handle(td_storage *s, const td_view *v,
                                  PyObject *key, PyObject *client) {
  store *p = store_new(s);
  if (p == NULL)
    return PyErr_NoMemory();
  return tensor_new(p, v, key, client);
}

/* A Tensor whose storage a Channel.send handed over (or is handing over):
 * its bytes belong to the channel's receivers now. */
static int store_gone(const store *p) {
  return p->s == NULL || p->handing;
}

static int tensor_live(Tensor *t) {
  if (t->released || t->st == NULL) {
    PyErr_SetString(PyExc_ValueError,
                    "tensord.Tensor: released (release() or the end of its "
                    "'with' block); its bytes are no longer reachable");
    return -1;
  }
  if (store_gone(t->st)) {
    PyErr_Format(PyExc_ValueError,
                 "tensord.Tensor: storage %llu was sent through a channel "
                 "(Channel.send hands it over): neither this Tensor nor any "
                 "view of it may be used any more",
                 (unsigned long long)t->sid);
    return -1;
  }
  return 0;
}

/* Refuses (TypeError) a GPU tensor to what reads its bytes from the CPU. */
static int tensor_on_cpu(Tensor *t, const char *what) {
  if (!t->st->cuda)
    return 0;
  PyErr_Format(PyExc_TypeError,
               "%s: the tensor is on cuda:%d, and its bytes are device "
               "memory; use torch() or __dlpack__ to reach them",
               what, t->st->device_index);
  return -1;
}

static char *tensor_data(const Tensor *t) {
  return t->st->base + t->v.offset * (int64_t)td_dtype_size(t->v.dtype);
}

/* Drops the Tensor's storage reference if nothing defers it. */
static void tensor_maybe_drop(Tensor *t) {
  if (t->released && t->exports == 0 && !t->interface && t->st != NULL) {
    store *p = t->st;
    t->st = NULL;
    store_unref(p);
  }
}

/* ---- Client methods ---- */

static PyObject *Client_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"path", "name", NULL};
  PyObject *pathobj = Py_None, *nameobj = Py_None, *bytes = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|OO:Client", kwlist, &pathobj,
                                   &nameobj))
    return NULL;
  const char *name = NULL;
  if (nameobj != Py_None) {
    Py_ssize_t n;
    if (!PyUnicode_Check(nameobj))
      return PyErr_Format(PyExc_TypeError, "name must be a str or None, not %s",
                          Py_TYPE(nameobj)->tp_name);
    if ((name = PyUnicode_AsUTF8AndSize(nameobj, &n)) == NULL)
      return NULL;
    if ((size_t)n != strlen(name))
      return PyErr_Format(PyExc_ValueError, "name contains a NUL character");
  }
  char dflt[4096];
  const char *path;
  if (pathobj == Py_None) {
    int err = td_default_socket_path(dflt, sizeof(dflt));
    if (err < 0)
      return raise_err(err, td_last_error(NULL));
    path = dflt;
  } else {
    if (!PyUnicode_FSConverter(pathobj, &bytes))
      return NULL;
    path = PyBytes_AS_STRING(bytes);
  }
  Client *self = (Client *)type->tp_alloc(type, 0);
  if (self == NULL || (self->path = strdup(path)) == NULL ||
      (name != NULL && (self->name = strdup(name)) == NULL)) {
    Py_XDECREF(bytes);
    Py_XDECREF(self);
    return PyErr_NoMemory();
  }
  Py_XDECREF(bytes);
  self->closed = 1; /* until connected: dealloc has nothing to close */
  td_client *c = NULL;
  int err;
  char msg[1024] = "";
  td_connect_opts o = {.name = self->name};
  Py_BEGIN_ALLOW_THREADS
    err = td_connect_ex(self->path, &o, &c);
    if (err < 0)
      snprintf(msg, sizeof(msg), "%s", td_last_error(NULL));
  Py_END_ALLOW_THREADS
  if (err < 0) {
    Py_DECREF(self);
    return raise_err(err, msg);
  }
  self->c = c;
  self->gen = atomic_load(&g_forkgen);
  self->closed = 0;
  return (PyObject *)self;
}

static void Client_dealloc(Client *self) {
  if (self->weakrefs != NULL)
    PyObject_ClearWeakRefs((PyObject *)self);
  Py_BEGIN_ALLOW_THREADS
    cl_close(self);
  Py_END_ALLOW_THREADS
  free(self->path);
  free(self->name);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Client_close(Client *self, PyObject *unused) {
  Py_BEGIN_ALLOW_THREADS
    cl_close(self);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *Client_enter(Client *self, PyObject *unused) {
  Py_INCREF(self);
  return (PyObject *)self;
}

static PyObject *Client_exit(Client *self, PyObject *args) {
  return Client_close(self, NULL);
}

static PyObject *Client_get_closed(Client *self, void *unused) {
  return PyBool_FromLong(self->closed);
}

static PyObject *Client_get_path(Client *self, void *unused) {
  return PyUnicode_DecodeFSDefault(self->path);
}

static PyObject *Client_repr(Client *self) {
  return PyUnicode_FromFormat("<tensord.Client %s%s>", self->path,
                              self->closed ? " (closed)" : "");
}

static PyObject *Client_ping(Client *self, PyObject *unused) {
  call x;
  int err;
  uint64_t rtt = 0;
  CALL(self, x, err, td_ping(x.c, &rtt));
  if (err < 0)
    return raise_err(err, x.msg);
  return PyFloat_FromDouble((double)rtt / 1e9);
}

/* Parses an int or a sequence of ints into shape; returns ndim or -1. */
static int parse_shape(PyObject *o, int64_t *shape, const char *what) {
  if (PyIndex_Check(o)) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) {
      if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: size %R does not fit int64", what,
                     o);
      }
      return -1;
    }
    shape[0] = v;
    return 1;
  }
  PyObject *seq = PySequence_Fast(o, "shape must be an int or a sequence of "
                                     "ints");
  if (seq == NULL)
    return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n > TD_MAX_DIMS) {
    Py_DECREF(seq);
    PyErr_Format(PyExc_ValueError,
                 "%s: %zd dims; tensord views have at most "
                 "%d",
                 what, n, TD_MAX_DIMS);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
    PyObject *idx = PyNumber_Index(item);
    long long v = idx ? PyLong_AsLongLong(idx) : -1;
    Py_XDECREF(idx);
    if (v == -1 && PyErr_Occurred()) {
      if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: size %R does not fit int64", what,
                     item);
      }
      Py_DECREF(seq);
      return -1;
    }
    shape[i] = v;
  }
  Py_DECREF(seq);
  return (int)n;
}

/* Parses "cpu", "cuda" or "cuda:K" (None: "cpu"). Returns 0 or -1 with an
 * exception. */
static int parse_device(const char *d, td_device *dev, int64_t *index) {
  *dev = TD_CPU;
  *index = 0;
  if (d == NULL || strcmp(d, "cpu") == 0)
    return 0;
  if (strncmp(d, "cuda", 4) == 0) {
    *dev = TD_CUDA;
    if (d[4] == '\0')
      return 0;
    char *end;
    long long k = d[4] == ':' && d[5] >= '0' && d[5] <= '9'
                      ? strtoll(d + 5, &end, 10)
                      : -1;
    if (k >= 0 && *end == '\0' && k <= INT32_MAX) {
      *index = k;
      return 0;
    }
  }
  PyErr_Format(PyExc_ValueError,
               "device '%s': use 'cpu', 'cuda' or 'cuda:K' (K this "
               "process's ordinal of the GPU)",
               d);
  return -1;
}

static PyObject *Client_empty(Client *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"shape", "dtype", "uninit", "mode", "device", NULL};
  PyObject *shapeobj, *dtypeobj = NULL;
  int uninit = 0;
  unsigned int mode = 0600;
  const char *devname = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OpIz:empty", kwlist, &shapeobj,
                                   &dtypeobj, &uninit, &mode, &devname))
    return NULL;
  td_device dev;
  int64_t devindex;
  if (parse_device(devname, &dev, &devindex) < 0)
    return NULL;
  td_dtype dt = TD_FLOAT32;
  if (dtypeobj != NULL && dtypeobj != Py_None && parse_dtype(dtypeobj, &dt) < 0)
    return NULL;
  int64_t shape[TD_MAX_DIMS];
  int ndim = parse_shape(shapeobj, shape, "empty");
  if (ndim < 0)
    return NULL;
  td_view v;
  int err = td_view_contiguous(dt, ndim, shape, &v);
  if (err < 0)
    return raise_view(err);
  int64_t numel = td_view_numel(&v);
  size_t nbytes = (size_t)numel * td_dtype_size(dt);
  td_create_opts o = {.nbytes = nbytes ? nbytes : 1,
                      .mode = mode,
                      .device = dev,
                      .device_index = devindex};
  if (uninit)
    o.flags = TD_UNINIT;
  td_storage *s = NULL;
  call x;
  CALL(self, x, err, td_storage_create_ex(x.c, &o, &s));
  if (err < 0)
    return raise_err(err, x.msg);
  return tensor_of_handle(s, &v, NULL, (PyObject *)self);
}

/* Key argument as UTF-8; NULL with an exception on a bad one. */
static const char *key_utf8(PyObject *key) {
  if (!PyUnicode_Check(key)) {
    PyErr_Format(PyExc_TypeError, "key must be a str, not %.100s",
                 Py_TYPE(key)->tp_name);
    return NULL;
  }
  Py_ssize_t n;
  const char *k = PyUnicode_AsUTF8AndSize(key, &n);
  if (k != NULL && (Py_ssize_t)strlen(k) != n) {
    PyErr_SetString(PyExc_ValueError, "key contains a NUL character");
    return NULL;
  }
  return k;
}

/* The DLPack capsule protocol of the consumer: the capsule is renamed
 * "used_dltensor" once its tensor is ours, and we call its deleter. */
static DLManagedTensor *take_capsule(PyObject *cap) {
  DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
  if (m == NULL)
    return NULL;
  if (PyCapsule_SetName(cap, "used_dltensor") < 0)
    return NULL;
  return m;
}

/* Copies src (a DLPack tensor) into a new storage of self, publishing it
 * under key if not NULL; returns the new Tensor of dtype dt. */
static PyObject *share_dl(Client *self, DLManagedTensor *m, td_dtype dt,
                          const char *key, PyObject *keyobj) {
  DLTensor *t = &m->dl_tensor;
  td_view v;
  int err;
  if (t->ndim < 0 || t->ndim > TD_MAX_DIMS) {
    PyErr_Format(PyExc_ValueError,
                 "share: %d dims; tensord views have at "
                 "most %d",
                 t->ndim, TD_MAX_DIMS);
    return NULL;
  }
  if ((err = td_view_contiguous(dt, t->ndim, t->shape, &v)) < 0)
    return raise_view(err);
  td_storage *s = NULL;
  call x;
  CALL(self, x, err, td_from_dlpack(x.c, m, key, 0, &s));
  if (err < 0) {
    if (err == TD_EINVAL || err == TD_ENODEV) {
      PyErr_SetString(PyExc_ValueError, x.msg);
      return NULL;
    }
    return raise_err(err, x.msg);
  }
  return tensor_of_handle(s, &v, keyobj, (PyObject *)self);
}

/* share() of a tensord.Tensor: td_copy, for every dtype (DLPack 0.6 lacks
 * float8). */
static PyObject *share_tensor(Client *self, Tensor *src, const char *key,
                              PyObject *keyobj) {
  if (tensor_live(src) < 0)
    return NULL;
  td_view v;
  int err = td_view_contiguous(src->v.dtype, src->v.ndim, src->v.shape, &v);
  if (err < 0)
    return raise_view(err);
  size_t nbytes = (size_t)td_view_numel(&v) * td_dtype_size(v.dtype);
  td_create_opts o = {.nbytes = nbytes ? nbytes : 1, .flags = TD_UNINIT};
  td_storage *s = NULL;
  call x;
  store *sp = store_use(src->st);
  td_view sv = src->v;
  Py_BEGIN_ALLOW_THREADS
    err = cl_enter(self, &x);
    if (err == 0) {
      err = td_storage_create_ex(x.c, &o, &s);
      if (err < 0)
        snprintf(x.msg, sizeof(x.msg), "%s", td_last_error(x.c));
      if (err == 0 && (err = td_copy(s, &v, sp->s, &sv)) < 0)
        snprintf(x.msg, sizeof(x.msg), "%s", td_view_last_error());
      if (err == 0 && key != NULL && (err = td_publish(x.c, key, s, &v)) < 0)
        snprintf(x.msg, sizeof(x.msg), "%s", td_last_error(x.c));
      if (err < 0 && s != NULL) {
        td_storage_release(s);
        s = NULL;
      }
      cl_leave(self);
    }
  Py_END_ALLOW_THREADS
  store_done(sp);
  if (err < 0)
    return raise_err(err, x.msg);
  return tensor_of_handle(s, &v, keyobj, (PyObject *)self);
}

static int is_torch_bool(PyObject *obj) {
  PyObject *d = PyObject_GetAttrString(obj, "dtype");
  if (d == NULL) {
    PyErr_Clear();
    return 0;
  }
  PyObject *s = PyObject_Str(d);
  Py_DECREF(d);
  if (s == NULL) {
    PyErr_Clear();
    return 0;
  }
  int r = PyUnicode_CompareWithASCIIString(s, "torch.bool") == 0;
  Py_DECREF(s);
  return r;
}

static PyObject *share_buffer(Client *self, Py_buffer *b, const char *key,
                              PyObject *keyobj) {
  td_dtype dt = dtype_of_format(b->format, b->itemsize);
  if (dt == TD_DTYPE_INVALID) {
    PyErr_Format(PyExc_TypeError,
                 "share: buffer format '%s' of %zd-byte items has no tensord "
                 "dtype",
                 b->format ? b->format : "B", b->itemsize);
    return NULL;
  }
  if (b->ndim > TD_MAX_DIMS) {
    PyErr_Format(PyExc_ValueError,
                 "share: %d dims; tensord views have at "
                 "most %d",
                 b->ndim, TD_MAX_DIMS);
    return NULL;
  }
  int64_t shape[TD_MAX_DIMS], strides[TD_MAX_DIMS];
  for (int i = 0; i < b->ndim; i++) {
    shape[i] = b->shape ? b->shape[i] : b->len / b->itemsize;
    if (b->strides != NULL) {
      if (b->strides[i] % b->itemsize != 0) {
        PyErr_Format(PyExc_ValueError,
                     "share: dim %d: stride of %zd bytes is not a multiple of "
                     "the %zd-byte item",
                     i, b->strides[i], b->itemsize);
        return NULL;
      }
      strides[i] = b->strides[i] / b->itemsize;
    }
  }
  DLManagedTensor m = {0};
  m.dl_tensor.data = b->buf;
  m.dl_tensor.device.device_type = kDLCPU;
  m.dl_tensor.ndim = b->ndim;
  m.dl_tensor.shape = shape;
  m.dl_tensor.strides = b->strides ? strides : NULL;
  /* The DLPack type of dt: only code and bits matter to td_from_dlpack. */
  static const uint8_t codes[TD_DTYPE_COUNT_] = {
      [TD_BOOL] = 6,
      [TD_UINT8] = kDLUInt,
      [TD_INT8] = kDLInt,
      [TD_INT16] = kDLInt,
      [TD_INT32] = kDLInt,
      [TD_INT64] = kDLInt,
      [TD_FLOAT16] = kDLFloat,
      [TD_FLOAT32] = kDLFloat,
      [TD_FLOAT64] = kDLFloat,
      [TD_COMPLEX64] = kDLComplex,
      [TD_COMPLEX128] = kDLComplex,
      [TD_UINT16] = kDLUInt,
      [TD_UINT32] = kDLUInt,
      [TD_UINT64] = kDLUInt,
  };
  m.dl_tensor.dtype.code = codes[dt];
  m.dl_tensor.dtype.bits = (uint8_t)(td_dtype_size(dt) * 8);
  m.dl_tensor.dtype.lanes = 1;
  return share_dl(self, &m, dt, key, keyobj);
}

static PyObject *Client_share(Client *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"obj", "key", NULL};
  PyObject *obj, *keyobj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:share", kwlist, &obj,
                                   &keyobj))
    return NULL;
  const char *key = NULL;
  if (keyobj != Py_None && (key = key_utf8(keyobj)) == NULL)
    return NULL;
  PyObject *k = keyobj == Py_None ? NULL : keyobj;
  if (key != NULL && (key[0] == '\0' || strlen(key) > TD_KEY_MAX)) {
    char m[128];
    snprintf(m, sizeof(m), "share: key of %zu bytes (a key has 1 to %d)",
             strlen(key), TD_KEY_MAX);
    return raise_err(TD_EINVAL, m);
  }
  if (PyObject_TypeCheck(obj, &TensorType))
    return share_tensor(self, (Tensor *)obj, key, k);
  if (PyObject_CheckBuffer(obj)) {
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_RECORDS_RO) < 0) {
      /* numpy refuses datetimes, objects... as ValueError: a type error. */
      PyObject *type, *value, *tb;
      PyErr_Fetch(&type, &value, &tb);
      PyErr_Format(PyExc_TypeError, "share: %.100s has no tensord dtype: %S",
                   Py_TYPE(obj)->tp_name, value ? value : Py_None);
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(tb);
      return NULL;
    }
    PyObject *r = share_buffer(self, &b, key, k);
    PyBuffer_Release(&b);
    return r;
  }
  if (PyObject_HasAttrString(obj, "__dlpack__")) {
    PyObject *src = obj, *u8 = NULL;
    int as_bool = is_torch_bool(obj);
    if (as_bool) { /* DLPack 0.6 has no bool: torch 1.13 refuses it */
      PyObject *torch = PyImport_ImportModule("torch");
      PyObject *uint8 = torch ? PyObject_GetAttrString(torch, "uint8") : NULL;
      Py_XDECREF(torch);
      u8 = uint8 ? PyObject_CallMethod(obj, "view", "O", uint8) : NULL;
      Py_XDECREF(uint8);
      if (u8 == NULL)
        return NULL;
      src = u8;
    }
    PyObject *cap = PyObject_CallMethod(src, "__dlpack__", NULL);
    Py_XDECREF(u8);
    if (cap == NULL)
      return NULL;
    DLManagedTensor *m = take_capsule(cap);
    if (m == NULL) {
      Py_DECREF(cap);
      return NULL;
    }
    td_dtype dt = as_bool ? TD_BOOL : dtype_of_dl(m->dl_tensor.dtype);
    PyObject *r;
    if (dt == TD_DTYPE_INVALID)
      r = PyErr_Format(PyExc_TypeError,
                       "share: DLPack type code %u of %u bits, %u lanes has "
                       "no tensord dtype",
                       m->dl_tensor.dtype.code, m->dl_tensor.dtype.bits,
                       m->dl_tensor.dtype.lanes);
    else
      r = share_dl(self, m, dt, key, k);
    if (m->deleter != NULL)
      m->deleter(m); /* with the GIL: numpy's and torch's may need it */
    Py_DECREF(cap);
    return r;
  }
  if (PyObject_HasAttrString(obj, "__array_interface__")) {
    if (import_numpy() < 0)
      return NULL;
    PyObject *a = PyObject_CallOneArg(np_asarray, obj);
    if (a == NULL)
      return NULL;
    PyObject *r = NULL;
    Py_buffer b;
    if (PyObject_GetBuffer(a, &b, PyBUF_RECORDS_RO) == 0) {
      r = share_buffer(self, &b, key, k);
      PyBuffer_Release(&b);
    }
    Py_DECREF(a);
    return r;
  }
  return PyErr_Format(PyExc_TypeError,
                      "share: %.100s has neither __dlpack__, the buffer "
                      "protocol nor __array_interface__",
                      Py_TYPE(obj)->tp_name);
}

static PyObject *Client_open(Client *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"storage_id", "readonly", "lazy", NULL};
  unsigned long long id;
  int ro = 0, lazy = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "K|pp:open", kwlist, &id, &ro,
                                   &lazy))
    return NULL;
  unsigned flags = (ro ? TD_RDONLY | TD_COW : 0) | (lazy ? TD_LAZY : 0);
  td_storage *s = NULL;
  call x;
  int err;
  CALL(self, x, err, td_storage_open(x.c, id, flags, &s));
  if (err < 0)
    return raise_err(err, x.msg);
  int64_t n = (int64_t)td_storage_nbytes(s);
  td_view v;
  td_view_contiguous(TD_UINT8, 1, &n, &v);
  return tensor_of_handle(s, &v, NULL, (PyObject *)self);
}

/* A CUDA handle (a CUevent, a CUstream) from an int, or from an object that
 * holds one in attr as an int (torch.cuda.Event.cuda_event,
 * torch.cuda.Stream.cuda_stream). None gives NULL. Returns 0, or -1 with
 * TypeError set. */
static int cuda_handle(PyObject *o, const char *attr, const char *what,
                       void **out) {
  *out = NULL;
  if (o == Py_None)
    return 0;
  PyObject *v =
      PyLong_Check(o) ? (Py_INCREF(o), o) : PyObject_GetAttrString(o, attr);
  if (v == NULL || !PyLong_Check(v)) {
    Py_XDECREF(v);
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError,
                 "%s: an int (the CUDA handle) or an object with an int "
                 ".%s, not %.100s",
                 what, attr, Py_TYPE(o)->tp_name);
    return -1;
  }
  uintptr_t h = (uintptr_t)PyLong_AsUnsignedLongLong(v);
  Py_DECREF(v);
  if (h == (uintptr_t)-1 && PyErr_Occurred())
    return -1;
  *out = (void *)h;
  return 0;
}

static PyObject *Client_publish(Client *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"key", "tensor", "scope", "event", NULL};
  PyObject *keyobj, *scopeobj = Py_None, *eventobj = Py_None;
  Tensor *t;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!|OO:publish", kwlist, &keyobj,
                                   &TensorType, &t, &scopeobj, &eventobj))
    return NULL;
  const char *key = key_utf8(keyobj);
  if (key == NULL || tensor_live(t) < 0)
    return NULL;
  td_publish_opts o = {0};
  if (cuda_handle(eventobj, "cuda_event", "publish: event", &o.event) < 0)
    return NULL;
  if (scopeobj != Py_None) {
    o.scope = PyLong_AsUnsignedLongLong(scopeobj);
    if (o.scope == (uint64_t)-1 && PyErr_Occurred())
      return NULL;
    if (o.scope == 0) {
      PyErr_SetString(PyExc_ValueError, "publish: scope 0 is no scope token");
      return NULL;
    }
  }
  if (t->readonly) {
    char m[512];
    snprintf(m, sizeof(m),
             "publish '%s': storage %llu is open read-only in this process",
             key, (unsigned long long)t->sid);
    return raise_err(TD_EACCES, m);
  }
  store *sp = store_use(t->st);
  td_view v = t->v;
  call x;
  int err;
  Py_BEGIN_ALLOW_THREADS
    err = cl_enter(self, &x);
    if (err == 0) {
      td_storage *s = sp->s, *tmp = NULL;
      uint64_t ours = td_client_instance(x.c);
      if (sp->instance != ours) {
        /* Ids are per daemon: the same id here is another storage. */
        snprintf(x.msg, sizeof(x.msg),
                 "publish '%s': storage %llu belongs to tensord instance "
                 "%016llx, and this client's daemon is instance %016llx "
                 "(storage ids are per daemon): share() copies it into this "
                 "daemon",
                 key, (unsigned long long)td_storage_id(s),
                 (unsigned long long)sp->instance, (unsigned long long)ours);
        err = TD_EINVAL;
      } else if (td_storage_client(s) != x.c) {
        /* Another client's handle of our daemon (another Client, or the
         * parent's before a fork): a reference of our own for the publish,
         * no copy. */
        err = td_storage_open(x.c, td_storage_id(s), 0, &tmp);
        s = tmp;
        if (err < 0)
          snprintf(x.msg, sizeof(x.msg), "%s", td_last_error(x.c));
      }
      if (err == 0 &&
          (err = o.scope || o.event ? td_publish_ex(x.c, key, s, &v, &o)
                                    : td_publish(x.c, key, s, &v)) < 0)
        snprintf(x.msg, sizeof(x.msg), "%s", td_last_error(x.c));
      td_storage_release(tmp);
      cl_leave(self);
    }
  Py_END_ALLOW_THREADS
  store_done(sp);
  if (err < 0)
    return raise_err(err, x.msg);
  Py_INCREF(keyobj);
  Py_XSETREF(t->key, keyobj);
  Py_RETURN_NONE;
}

static PyObject *Client_unpublish(Client *self, PyObject *args) {
  PyObject *keyobj;
  if (!PyArg_ParseTuple(args, "O:unpublish", &keyobj))
    return NULL;
  const char *key = key_utf8(keyobj);
  if (key == NULL)
    return NULL;
  call x;
  int err;
  CALL(self, x, err, td_unpublish(x.c, key));
  if (err < 0)
    return raise_err(err, x.msg);
  Py_RETURN_NONE;
}

static PyObject *Client_scope_open(Client *self, PyObject *unused) {
  uint64_t token = 0;
  call x;
  int err;
  CALL(self, x, err, td_scope_open(x.c, &token));
  if (err < 0)
    return raise_err(err, x.msg);
  return PyLong_FromUnsignedLongLong(token);
}

static PyObject *Client_scope_close(Client *self, PyObject *args) {
  unsigned long long token;
  if (!PyArg_ParseTuple(args, "K:scope_close", &token))
    return NULL;
  uint64_t dropped = 0;
  call x;
  int err;
  CALL(self, x, err, td_scope_close(x.c, token, &dropped));
  if (err < 0)
    return raise_err(err, x.msg);
  return PyLong_FromUnsignedLongLong(dropped);
}

/* Reads a timeout in seconds (None: forever) for what on name: 1, or 0
 * with ValueError for a bad value. */
static int parse_wait(PyObject *o, const char *what, const char *name,
                      int *forever, double *secs) {
  *forever = o == Py_None;
  *secs = 0;
  if (*forever)
    return 1;
  *secs = PyFloat_AsDouble(o);
  if (*secs == -1.0 && PyErr_Occurred())
    return 0;
  if (!(*secs >= 0) || *secs > 1e9) {
    PyErr_Format(PyExc_ValueError,
                 "%s '%s': timeout %R (seconds, >= 0; None waits forever)",
                 what, name, o);
    return 0;
  }
  return 1;
}

/* Looks key up with flags as lookup() does, waiting until deadline (a
 * mono_ms(); forever: no deadline) from start in slices of SLICE_MS, so
 * that a signal or cancel (an Event-like object, or None) is seen within
 * one. Returns 0 with *s and *v; a negative code with msg (len bytes) set;
 * or 1 with a Python exception set (a signal handler's, cancel's). */
static int lookup_wait(Client *self, const char *key, unsigned flags,
                       int forever, int64_t start, int64_t deadline,
                       PyObject *cancel, td_storage **s, td_view *v, char *msg,
                       size_t len) {
  for (int first = 1;; first = 0) {
    int slice = SLICE_MS;
    if (!forever) {
      int64_t left = deadline - mono_ms();
      if (left <= 0 && !first) {
        snprintf(msg, len, "key '%s': not published (waited %lld ms)", key,
                 (long long)(mono_ms() - start));
        return TD_ETIMEDOUT;
      }
      slice = left < 0 ? 0 : left < SLICE_MS ? (int)left : SLICE_MS;
    }
    call x;
    int err;
    *s = NULL;
    CALL(self, x, err, td_lookup(x.c, key, flags, slice, s, v));
    if (err == 0)
      return 0;
    if (err != TD_ETIMEDOUT || (!forever && deadline <= start)) {
      snprintf(msg, len, "%s", x.msg);
      return err;
    }
    if (PyErr_CheckSignals() < 0)
      return 1;
    if (cancel != Py_None) {
      PyObject *r = PyObject_CallMethod(cancel, "is_set", NULL);
      int set = r ? PyObject_IsTrue(r) : -1;
      Py_XDECREF(r);
      if (set < 0)
        return 1;
      if (set) {
        snprintf(msg, len, "lookup '%s': cancelled", key);
        return TD_ECANCELED;
      }
    }
  }
}

static PyObject *Client_lookup(Client *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"key",  "timeout", "readonly", "take",
                           "lazy", "_cancel", NULL};
  PyObject *keyobj, *timeoutobj = Py_None, *cancel = Py_None;
  int ro = 0, take = 0, lazy = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|OpppO:lookup", kwlist, &keyobj,
                                   &timeoutobj, &ro, &take, &lazy, &cancel))
    return NULL;
  const char *key = key_utf8(keyobj);
  if (key == NULL)
    return NULL;
  int forever;
  double timeout;
  if (!parse_wait(timeoutobj, "lookup", key, &forever, &timeout))
    return NULL;
  unsigned flags = (ro ? TD_RDONLY | TD_COW : 0) | (take ? TD_TAKE : 0) |
                   (lazy ? TD_LAZY : 0);
  int64_t start = mono_ms();
  td_storage *s;
  td_view v;
  char msg[1024];
  int err = lookup_wait(self, key, flags, forever, start,
                        deadline_of(start, timeout), cancel, &s, &v, msg,
                        sizeof(msg));
  if (err == 0)
    return tensor_of_handle(s, &v, keyobj, (PyObject *)self);
  return err > 0 ? NULL : raise_err(err, msg);
}

/* lookup_many(keys, ...): one td_lookup_many for every key, then, for keys
 * not yet published, lookup()'s sliced wait within one deadline. */
static PyObject *Client_lookup_many(Client *self, PyObject *args,
                                    PyObject *kw) {
  static char *kwlist[] = {"keys", "timeout",           "readonly",
                           "lazy", "return_exceptions", NULL};
  PyObject *keysobj, *timeoutobj = Py_None;
  int ro = 0, lazy = 0, rexc = 0;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Oppp:lookup_many", kwlist,
                                   &keysobj, &timeoutobj, &ro, &lazy, &rexc))
    return NULL;
  if (PyUnicode_Check(keysobj)) {
    PyErr_SetString(PyExc_TypeError,
                    "lookup_many: keys must be a sequence of str, not a str");
    return NULL;
  }
  PyObject *seq =
      PySequence_Fast(keysobj, "lookup_many: keys must be a sequence of str");
  if (seq == NULL)
    return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject **items = PySequence_Fast_ITEMS(seq);
  PyObject *list = NULL;
  const char **keys = NULL;
  td_storage **out = NULL;
  td_view *views = NULL;
  int *errs = NULL;
  if (n > TD_LOOKUP_MANY_MAX) {
    PyErr_Format(PyExc_ValueError,
                 "lookup_many of %zd keys: at most %d in one call", n,
                 TD_LOOKUP_MANY_MAX);
    goto done;
  }
  int forever;
  double timeout;
  if (!parse_wait(timeoutobj, "lookup_many", "keys", &forever, &timeout))
    goto done;
  if (n == 0) {
    list = PyList_New(0);
    goto done;
  }
  keys = PyMem_Calloc((size_t)n, sizeof(*keys));
  out = PyMem_Calloc((size_t)n, sizeof(*out));
  views = PyMem_Calloc((size_t)n, sizeof(*views));
  errs = PyMem_Calloc((size_t)n, sizeof(*errs));
  if (keys == NULL || out == NULL || views == NULL || errs == NULL) {
    PyErr_NoMemory();
    goto done;
  }
  for (Py_ssize_t i = 0; i < n; i++)
    if ((keys[i] = key_utf8(items[i])) == NULL)
      goto done;
  unsigned flags = (ro ? TD_RDONLY | TD_COW : 0) | (lazy ? TD_LAZY : 0);
  int64_t start = mono_ms(), deadline = deadline_of(start, timeout);
  call x;
  int err;
  CALL(self, x, err,
       td_lookup_many(x.c, keys, (size_t)n, flags, 0, out, views, errs));
  /* The first failure's message: the call's, or a wait's. */
  char first_msg[1024];
  Py_ssize_t first = -1;
  if (err < 0) {
    snprintf(first_msg, sizeof(first_msg), "%s", x.msg);
    for (Py_ssize_t i = 0; i < n && first < 0; i++)
      if (errs[i] < 0)
        first = i;
  }
  for (Py_ssize_t i = 0; i < n && (forever || timeout > 0); i++) {
    if (errs[i] != TD_ENOENT)
      continue;
    char msg[1024];
    int e = lookup_wait(self, keys[i], flags, forever, start, deadline,
                        Py_None, &out[i], &views[i], msg, sizeof(msg));
    if (e > 0)
      goto done;
    errs[i] = e;
    if (i == first) /* this failure is over; a later one comes first */
      first = -1;
    if (e < 0 && first < 0) {
      first = i;
      snprintf(first_msg, sizeof(first_msg), "%s", msg);
    }
  }
  if (first < 0) {
    for (Py_ssize_t i = 0; i < n && first < 0; i++)
      if (errs[i] < 0) {
        first = i;
        snprintf(first_msg, sizeof(first_msg), "key '%s': %s", keys[i],
                 td_strerror(errs[i]));
      }
  }
  if (first >= 0 && !rexc) {
    raise_err(errs[first], first_msg);
    goto done; /* every handle made is released below */
  }
  if ((list = PyList_New(n)) == NULL)
    goto done;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *o;
    if (out[i] != NULL) {
      o = tensor_of_handle(out[i], &views[i], items[i], (PyObject *)self);
      out[i] = NULL; /* the Tensor has it, or it was dropped */
    } else {
      char m[512];
      snprintf(m, sizeof(m), "key '%s': %s", keys[i], td_strerror(errs[i]));
      o = err_object(errs[i], i == first ? first_msg : m);
    }
    if (o == NULL) {
      Py_CLEAR(list);
      goto done;
    }
    PyList_SET_ITEM(list, i, o);
  }
done:
  for (Py_ssize_t i = 0; out != NULL && i < n; i++)
    td_storage_release(out[i]);
  PyMem_Free(keys);
  PyMem_Free(out);
  PyMem_Free(views);
  PyMem_Free(errs);
  Py_DECREF(seq);
  return list;
}

/* ls(): the listing is copied out of the callback (which runs without the
 * GIL) and turned into dicts afterwards. */
typedef struct ls_item {
  td_storage_info info;
  td_holder *holders; /* their names point into names[] */
  char **names;
  char **keys;
} ls_item;

typedef struct ls_acc {
  ls_item *items;
  size_t n, cap;
} ls_acc;

static void ls_free(ls_acc *a) {
  for (size_t i = 0; i < a->n; i++) {
    for (size_t h = 0; a->items[i].names && h < a->items[i].info.nholders; h++)
      free(a->items[i].names[h]);
    free(a->items[i].names);
    free(a->items[i].holders);
    for (size_t k = 0; k < a->items[i].info.nkeys; k++)
      free(a->items[i].keys[k]);
    free(a->items[i].keys);
  }
  free(a->items);
}

static int ls_cb(const td_storage_info *info, void *arg) {
  ls_acc *a = arg;
  if (a->n == a->cap) {
    size_t cap = a->cap ? 2 * a->cap : 64;
    ls_item *n = realloc(a->items, cap * sizeof(*n));
    if (n == NULL)
      return TD_ENOMEM;
    a->items = n;
    a->cap = cap;
  }
  ls_item *it = &a->items[a->n];
  memset(it, 0, sizeof(*it));
  it->info = *info;
  it->info.nkeys = 0;
  it->holders = calloc(info->nholders + 1, sizeof(td_holder));
  it->names = calloc(info->nholders + 1, sizeof(char *));
  it->keys = calloc(info->nkeys + 1, sizeof(char *));
  a->n++;
  if (it->holders == NULL || it->names == NULL || it->keys == NULL)
    return TD_ENOMEM;
  memcpy(it->holders, info->holders, info->nholders * sizeof(td_holder));
  for (size_t h = 0; h < info->nholders; h++) {
    const char *name = info->holders[h].name ? info->holders[h].name : "";
    if ((it->names[h] = strdup(name)) == NULL)
      return TD_ENOMEM;
    it->holders[h].name = it->names[h];
  }
  for (size_t k = 0; k < info->nkeys; k++) {
    if ((it->keys[k] = strdup(info->keys[k])) == NULL)
      return TD_ENOMEM;
    it->info.nkeys = k + 1;
  }
  return 0;
}

/* Sets d[name] = v, stealing v; returns -1 on failure. */
static int set_item(PyObject *d, const char *name, PyObject *v) {
  if (v == NULL)
    return -1;
  int r = PyDict_SetItemString(d, name, v);
  Py_DECREF(v);
  return r;
}

/* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" (or "MIG-..." for a MIG
 * instance), as nvidia-smi -L writes it. */
static PyObject *uuid_str(const uint8_t u[16], int mig) {
  char buf[TD_UUID_STR_MAX];
  return PyUnicode_FromString(td_gpu_uuid_str(u, mig, buf, sizeof(buf)));
}

static PyObject *storage_dict(const ls_item *it, int64_t now) {
  const td_storage_info *s = &it->info;
  PyObject *d = PyDict_New();
  if (d == NULL)
    return NULL;
  char mode[8];
  snprintf(mode, sizeof(mode), "%04o", s->mode);
  PyObject *holders = PyList_New((Py_ssize_t)s->nholders);
  PyObject *keys = PyList_New((Py_ssize_t)s->nkeys);
  int ok = holders && keys;
  for (size_t i = 0; ok && i < s->nholders; i++) {
    PyObject *h =
        Py_BuildValue("{s:i,s:I,s:I,s:N}", "pid", it->holders[i].pid, "uid",
                      it->holders[i].uid, "refs", it->holders[i].refs, "name",
                      PyUnicode_DecodeUTF8(
                          it->holders[i].name,
                          (Py_ssize_t)strlen(it->holders[i].name), "replace"));
    ok = h != NULL;
    if (ok)
      PyList_SET_ITEM(holders, (Py_ssize_t)i, h);
  }
  for (size_t i = 0; ok && i < s->nkeys; i++) {
    PyObject *k = PyUnicode_DecodeUTF8(
        it->keys[i], (Py_ssize_t)strlen(it->keys[i]), "replace");
    ok = k != NULL;
    if (ok)
      PyList_SET_ITEM(keys, (Py_ssize_t)i, k);
  }
  if (!ok || set_item(d, "id", PyLong_FromUnsignedLongLong(s->id)) < 0 ||
      set_item(d, "device",
               PyUnicode_FromString(s->device == TD_CUDA ? "cuda" : "cpu")) <
          0 ||
      set_item(d, "nbytes", PyLong_FromUnsignedLongLong(s->nbytes)) < 0 ||
      set_item(d, "refs", PyLong_FromUnsignedLong(s->refs)) < 0 ||
      set_item(d, "owner_pid", PyLong_FromLong(s->owner_pid)) < 0 ||
      set_item(d, "owner_uid", PyLong_FromUnsignedLong(s->owner_uid)) < 0 ||
      set_item(d, "owner_gid", PyLong_FromUnsignedLong(s->owner_gid)) < 0 ||
      set_item(d, "mode", PyUnicode_FromString(mode)) < 0 ||
      set_item(d, "created_unix_ms", PyLong_FromLongLong(s->created_unix_ms)) <
          0 ||
      set_item(d, "age_ms", PyLong_FromLongLong(now - s->created_unix_ms)) <
          0 ||
      PyDict_SetItemString(d, "holders", holders) < 0 ||
      PyDict_SetItemString(d, "keys", keys) < 0 ||
      set_item(d, "nkeys", PyLong_FromSize_t(s->nkeys_total)) < 0 ||
      (s->device == TD_CUDA &&
       set_item(d, "device_uuid",
                uuid_str(s->device_uuid, (int)s->device_mig)) < 0)) {
    Py_XDECREF(holders);
    Py_XDECREF(keys);
    Py_DECREF(d);
    return NULL;
  }
  Py_DECREF(holders);
  Py_DECREF(keys);
  return d;
}

static PyObject *Client_ls(Client *self, PyObject *unused) {
  ls_acc a = {0};
  call x;
  int err;
  CALL(self, x, err, td_list(x.c, ls_cb, &a));
  if (err < 0) {
    ls_free(&a);
    return raise_err(err, x.msg);
  }
  int64_t now = real_ms();
  PyObject *list = PyList_New((Py_ssize_t)a.n);
  for (size_t i = 0; list != NULL && i < a.n; i++) {
    PyObject *d = storage_dict(&a.items[i], now);
    if (d == NULL)
      Py_CLEAR(list);
    else
      PyList_SET_ITEM(list, (Py_ssize_t)i, d);
  }
  ls_free(&a);
  return list;
}

static PyObject *Client_stat(Client *self, PyObject *unused) {
  td_stat st;
  call x;
  int err;
  CALL(self, x, err, td_stat_get(x.c, &st));
  if (err < 0)
    return raise_err(err, x.msg);
  td_device_stat ds[64];
  size_t nd = 0;
  CALL(self, x, err, td_stat_devices(x.c, ds, 64, &nd));
  if (err < 0)
    return raise_err(err, x.msg);
  if (nd > 64)
    nd = 64;
  PyObject *devices = PyList_New((Py_ssize_t)nd);
  for (size_t i = 0; devices != NULL && i < nd; i++) {
    char name[32];
    snprintf(name, sizeof(name), "cuda:%d", ds[i].index);
    PyObject *u = uuid_str(ds[i].uuid, (int)ds[i].mig);
    PyObject *e =
        u ? Py_BuildValue("{s:s,s:N,s:K,s:K,s:K}", "device", name, "uuid", u,
                          "bytes_used", ds[i].bytes_used, "capacity",
                          ds[i].capacity, "storages", ds[i].storages)
          : NULL;
    if (e == NULL)
      Py_CLEAR(devices);
    else
      PyList_SET_ITEM(devices, (Py_ssize_t)i, e);
  }
  if (devices == NULL)
    return NULL;
  char(*prefix)[TD_PREFIX_MAX] = malloc(64 * sizeof(*prefix));
  if (prefix == NULL) {
    Py_DECREF(devices);
    return PyErr_NoMemory();
  }
  size_t np = 0;
  CALL(self, x, err, td_stat_prefixes(x.c, prefix, 64, &np));
  if (err < 0) {
    free(prefix);
    Py_DECREF(devices);
    return raise_err(err, x.msg);
  }
  PyObject *prefixes = PyList_New(0);
  for (size_t i = 0; prefixes != NULL && i < np && i < 64; i++) {
    PyObject *e = PyUnicode_FromString(prefix[i]);
    if (e == NULL || PyList_Append(prefixes, e) < 0)
      Py_CLEAR(prefixes);
    Py_XDECREF(e);
  }
  free(prefix);
  if (prefixes == NULL) {
    Py_DECREF(devices);
    return NULL;
  }
  return Py_BuildValue(
      "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:L,s:i,s:K,s:I,s:I,s:s,s:s,s:s,"
      "s:{s:K,s:K,s:K,s:K,s:K},s:K,s:N,s:N,s:K,s:K}",
      "storages", st.storages, "bytes_used", st.bytes_used, "capacity",
      st.capacity, "shm_free", st.shm_free, "clients", st.clients, "keys",
      st.keys, "waiters", st.waiters, "uptime_ms", st.uptime_ms, "pid", st.pid,
      "quota", st.quota, "max_clients", st.max_clients,
      "max_storages_per_client", st.max_storages_per_client, "version",
      st.version, "socket", st.socket, "state_dir", st.state_dir, "pool",
      "segments", st.pool_segments, "bytes", st.pool_bytes, "limit",
      st.pool_limit, "hits", st.pool_hits, "misses", st.pool_misses, "instance",
      st.instance, "devices", devices, "prefixes", prefixes, "daemon_rss_bytes",
      st.daemon_rss_bytes, "daemon_heap_bytes", st.daemon_heap_bytes);
}

/* ---- models (docs/models.md) ---- */

static PyObject *Client_load_model(Client *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"path",    "name", "force",  "mode",
                           "threads", "wait", "device", NULL};
  PyObject *pathobj = NULL, *nameobj = Py_None, *waitobj = Py_None;
  int force = 0;
  unsigned int mode = 0, threads = 0;
  const char *devname = NULL;
  td_device dev;
  int64_t devindex;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O&|OpIIOz:load_model", kwlist,
                                   PyUnicode_FSConverter, &pathobj, &nameobj,
                                   &force, &mode, &threads, &waitobj, &devname))
    return NULL;
  if (parse_device(devname, &dev, &devindex) < 0) {
    Py_DECREF(pathobj);
    return NULL;
  }
  const char *path = PyBytes_AS_STRING(pathobj);
  const char *name = NULL;
  char derived[TD_KEY_MAX + 1];
  if (nameobj != Py_None && (name = key_utf8(nameobj)) == NULL) {
    Py_DECREF(pathobj);
    return NULL;
  }
  if (name == NULL) {
    int err = td_model_default_name(path, derived, sizeof(derived));
    if (err < 0) {
      Py_DECREF(pathobj);
      return raise_err(err, td_last_error(NULL));
    }
    name = derived;
  }
  int forever;
  double wait;
  if (!parse_wait(waitobj, "load_model", name, &forever, &wait)) {
    Py_DECREF(pathobj);
    return NULL;
  }
  td_load_opts o = {.mode = mode,
                    .flags = force ? TD_MODEL_FORCE : 0,
                    .threads = threads,
                    .device = dev,
                    .device_index = devindex};
  int64_t deadline = deadline_of(mono_ms(), wait);
  td_load_result r;
  call x;
  int err, retried = 0;
  /* Waits for another loader in slices, so that a signal interrupts. */
  for (;; retried = 1) {
    int64_t left = forever ? SLICE_MS : deadline - mono_ms();
    o.wait_ms = (int32_t)(left < 0 ? 0 : left < SLICE_MS ? left : SLICE_MS);
    CALL(self, x, err, td_model_load(x.c, path, name, &o, &r));
    if (err != TD_ETIMEDOUT || (!forever && mono_ms() >= deadline))
      break;
    if (PyErr_CheckSignals() < 0) {
      Py_DECREF(pathobj);
      return NULL;
    }
  }
  if (err < 0) {
    Py_DECREF(pathobj);
    return raise_err(err, x.msg);
  }
  PyObject *res = Py_BuildValue(
      "{sssKsKsKsIsNsNsd}", "name", name, "version",
      (unsigned long long)r.version, "tensors", (unsigned long long)r.tensors,
      "bytes", (unsigned long long)r.bytes, "shards", r.shards, "unchanged",
      PyBool_FromLong(r.unchanged), "waited",
      PyBool_FromLong(r.waited || retried), "seconds", r.seconds);
  Py_DECREF(pathobj);
  return res;
}

/* The tensors of m as a list of (name, Tensor): one store per shard
 * storage, shared by its tensors' Tensors. */
static PyObject *model_tensors(Client *self, const char *name, td_model *m) {
  size_t n = td_model_count(m), ns = 0;
  PyObject *list = PyList_New((Py_ssize_t)n);
  td_storage **seen = calloc(n ? n : 1, sizeof(*seen));
  store **stores = calloc(n ? n : 1, sizeof(*stores));
  if (list == NULL || seen == NULL || stores == NULL) {
    Py_XDECREF(list);
    list = PyErr_NoMemory();
    goto out;
  }
  for (size_t i = 0; i < n; i++) {
    const char *tname;
    td_storage *s;
    td_view v;
    td_model_tensor(m, i, &tname, &s, &v);
    size_t k = 0;
    while (k < ns && seen[k] != s)
      k++;
    if (k == ns) {
      stores[ns] = store_new(td_storage_retain(s));
      if (stores[ns] == NULL) {
        Py_CLEAR(list);
        PyErr_NoMemory();
        goto out;
      }
      seen[ns++] = s;
    }
    PyObject *key = PyUnicode_FromFormat("%s/%s", name, tname);
    PyObject *t =
        key ? tensor_new(store_ref(stores[k]), &v, key, (PyObject *)self)
            : NULL;
    Py_XDECREF(key);
    PyObject *item = t ? Py_BuildValue("(sN)", tname, t) : NULL;
    if (item == NULL) {
      Py_CLEAR(list);
      goto out;
    }
    PyList_SET_ITEM(list, (Py_ssize_t)i, item);
  }
out:
  for (size_t k = 0; k < ns; k++)
    store_unref(stores[k]);
  free(stores);
  free(seen);
  return list;
}

static PyObject *Client_open_model(Client *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"name", "timeout", "readonly", "lazy", NULL};
  PyObject *nameobj, *timeoutobj = Py_None;
  int ro = 1, lazy = 1;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Opp:open_model", kwlist,
                                   &nameobj, &timeoutobj, &ro, &lazy))
    return NULL;
  const char *name = key_utf8(nameobj);
  if (name == NULL)
    return NULL;
  int forever;
  double timeout;
  if (!parse_wait(timeoutobj, "open_model", name, &forever, &timeout))
    return NULL;
  unsigned flags = (ro ? TD_RDONLY | TD_COW : 0) | (lazy ? TD_LAZY : 0);
  int64_t start = mono_ms();
  int64_t deadline = deadline_of(start, timeout);
  td_model *m = NULL;
  for (int first = 1;; first = 0) {
    int slice = SLICE_MS;
    if (!forever) {
      int64_t left = deadline - mono_ms();
      if (left <= 0 && !first) {
        char msg[512];
        snprintf(msg, sizeof(msg), "model '%s': not loaded (waited %lld ms)",
                 name, (long long)(mono_ms() - start));
        return raise_err(TD_ETIMEDOUT, msg);
      }
      slice = left < 0 ? 0 : left < SLICE_MS ? (int)left : SLICE_MS;
    }
    call x;
    int err;
    CALL(self, x, err, td_model_open(x.c, name, flags, slice, &m));
    if (err == 0)
      break;
    if (err != TD_ETIMEDOUT || (!forever && timeout == 0))
      return raise_err(err, x.msg);
    if (PyErr_CheckSignals() < 0)
      return NULL;
  }
  PyObject *tensors = model_tensors(self, name, m);
  PyObject *out =
      tensors ? Py_BuildValue("(KsN)", (unsigned long long)td_model_version(m),
                              td_model_manifest(m), tensors)
              : NULL;
  Py_BEGIN_ALLOW_THREADS
    td_model_close(m); /* the Tensors hold their own references */
  Py_END_ALLOW_THREADS
  return out;
}

static PyObject *Client_unload_model(Client *self, PyObject *args) {
  PyObject *nameobj;
  if (!PyArg_ParseTuple(args, "O:unload_model", &nameobj))
    return NULL;
  const char *name = key_utf8(nameobj);
  if (name == NULL)
    return NULL;
  call x;
  int err;
  CALL(self, x, err, td_model_unload(x.c, name));
  if (err < 0)
    return raise_err(err, x.msg);
  Py_RETURN_NONE;
}

static PyObject *Client_channel(Client *self, PyObject *args, PyObject *kw);
static PyObject *Client_channels(Client *self, PyObject *unused);

static PyMethodDef Client_methods[] = {
    {"close", (PyCFunction)Client_close, METH_NOARGS,
     "close(): ends the connection; the daemon drops every reference it "
     "held. Calls waiting in other threads raise tensord.Closed. Idempotent."},
    {"__enter__", (PyCFunction)Client_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Client_exit, METH_VARARGS, NULL},
    {"ping", (PyCFunction)Client_ping, METH_NOARGS,
     "ping() -> float: a round trip to tensord, in seconds."},
    {"empty", (PyCFunction)(void (*)(void))Client_empty,
     METH_VARARGS | METH_KEYWORDS,
     "empty(shape, dtype='float32', uninit=False, mode=0o600, device='cpu') "
     "-> Tensor: a new storage and its contiguous view; zeroed unless uninit. "
     "device 'cuda:K' puts it on this process's GPU K (docs/cuda.md)."},
    {"share", (PyCFunction)(void (*)(void))Client_share,
     METH_VARARGS | METH_KEYWORDS,
     "share(obj, key=None) -> Tensor: one copy of obj (DLPack, buffer "
     "protocol or __array_interface__) into a new storage, contiguous; "
     "published under key if given."},
    {"open", (PyCFunction)(void (*)(void))Client_open,
     METH_VARARGS | METH_KEYWORDS,
     "open(storage_id, readonly=False, lazy=False) -> Tensor: a new "
     "reference to a storage, as uint8[nbytes]. readonly maps it "
     "copy-on-write; lazy maps it without populating it (each page is "
     "mapped when first touched)."},
    {"publish", (PyCFunction)(void (*)(void))Client_publish,
     METH_VARARGS | METH_KEYWORDS,
     "publish(key, tensor, scope=None, event=None): publishes the tensor's "
     "view of its storage under key (replacing it; with a scope token from "
     "scope_open() the key goes when the scope ends, and an existing key is "
     "not replaced). event: for a GPU tensor, a CUevent (an int, or a "
     "torch.cuda.Event(interprocess=True)) recorded after the last write to "
     "it, so that this thread need not synchronise: its IPC handle travels "
     "with the key and a consumer calls Tensor.wait() "
     "(td_publish_opts.event)."},
    {"unpublish", (PyCFunction)Client_unpublish, METH_VARARGS,
     "unpublish(key): removes key."},
    {"scope_open", (PyCFunction)Client_scope_open, METH_NOARGS,
     "scope_open() -> int: a scope token owned by this client."},
    {"scope_close", (PyCFunction)Client_scope_close, METH_VARARGS,
     "scope_close(token) -> int: ends the scope; returns how many keys it "
     "dropped."},
    {"lookup", (PyCFunction)(void (*)(void))Client_lookup,
     METH_VARARGS | METH_KEYWORDS,
     "lookup(key, timeout=None, readonly=False, take=False, lazy=False) -> "
     "Tensor: the tensor published under key, waiting up to timeout seconds "
     "(None: forever; 0: not at all) for it. readonly maps it "
     "copy-on-write; take unpublishes it atomically; lazy maps it without "
     "populating it (TD_LAZY: attaching costs the same for any size, and "
     "each page is mapped when first touched; for weights attached long "
     "before they are all read). A key is a str of 1 to KEY_MAX (255) "
     "bytes of UTF-8."},
    {"lookup_many", (PyCFunction)(void (*)(void))Client_lookup_many,
     METH_VARARGS | METH_KEYWORDS,
     "lookup_many(keys, timeout=None, readonly=False, lazy=False, "
     "return_exceptions=False) -> list of Tensor: the tensors published "
     "under keys (a sequence of str, at most 65,536), in their order, in "
     "one round trip to tensord (td_lookup_many): for attaching a model "
     "published a key per tensor. readonly and lazy are lookup()'s. Keys "
     "not published at once are waited for, one after another, until "
     "timeout seconds have passed since the call (None: forever; 0: not at "
     "all). A key that fails raises its error (NotFound, PermissionError, "
     "...) and no Tensor is kept; with return_exceptions=True its place in "
     "the list holds the exception instead (as asyncio.gather does)."},
    {"load_model", (PyCFunction)(void (*)(void))Client_load_model,
     METH_VARARGS | METH_KEYWORDS,
     "load_model(path, name=None, force=False, mode=0, threads=0, wait=None, "
     "device='cpu') -> dict: loads the safetensors checkpoint at path (a file, "
     "an "
     "*.index.json or a directory) into tensord as model name (None: from "
     "the path), as `tensorctl load` (td_model_load; docs/models.md): a new "
     "version unless name already holds this source (force reloads). wait: "
     "seconds to wait for another process loading name (None: forever). "
     "device: 'cpu', 'cuda' or 'cuda:K' (daemon-owned GPU storages, staged "
     "through a bounded pinned buffer). Returns version, tensors, bytes, "
     "shards, unchanged, waited, seconds."},
    {"open_model", (PyCFunction)(void (*)(void))Client_open_model,
     METH_VARARGS | METH_KEYWORDS,
     "open_model(name, timeout=None, readonly=True, lazy=True) -> (version, "
     "manifest, [(tensor name, Tensor), ...]): attaches every tensor of one "
     "version of model name (td_model_open), in the checkpoint's order, "
     "waiting up to timeout seconds for it to be loaded. readonly maps "
     "copy-on-write; lazy maps without populating."},
    {"unload_model", (PyCFunction)Client_unload_model, METH_VARARGS,
     "unload_model(name): unpublishes every key of model name (its "
     "storages go when their last holder lets go)."},
    {"ls", (PyCFunction)Client_ls, METH_NOARGS,
     "ls() -> list[dict]: every live storage, as `tensorctl ls --json`."},
    {"stat", (PyCFunction)Client_stat, METH_NOARGS,
     "stat() -> dict: the daemon's counters, as `tensorctl stat --json`, "
     "and its instance."},
    {"channel", (PyCFunction)(void (*)(void))Client_channel,
     METH_VARARGS | METH_KEYWORDS,
     "channel(name, capacity=None, slots=0, slot_bytes=0, mode=0o600, "
     "side='both', spin_us=0, timeout=None, create=None) -> Channel: an end "
     "of channel name (docs/channels.md). Creates it (Exists if a channel "
     "of that name is open) when create is True, or when create is None "
     "and capacity or slots is given: a ring of capacity entries (None: "
     "64; rounded up to a power of two) and slots storages of slot_bytes "
     "each, counted against this client's capacity and quota, that mode "
     "admits (the write bit senders, the read bit receivers). Otherwise "
     "opens it, waiting up to timeout seconds (None: forever; 0: not at "
     "all) for it to be created. side: 'send', 'recv' or 'both'. spin_us: "
     "how long this end spins before it sleeps on a futex."},
    {"channels", (PyCFunction)Client_channels, METH_NOARGS,
     "channels() -> list[dict]: every channel tensord has, with its ends "
     "and slot ids, as `tensorctl ls` shows them (td_chan_list)."},
    {NULL, NULL, 0, NULL},
};

static PyObject *Client_get_instance(Client *self, void *unused) {
  (void)unused;
  call x;
  int err;
  uint64_t inst = 0;
  /* Through cl_enter: a forked child reconnects first (same daemon). */
  CALL(self, x, err, (inst = td_client_instance(x.c), 0));
  if (err < 0)
    return raise_err(err, x.msg);
  return PyLong_FromUnsignedLongLong(inst);
}

static PyObject *Client_get_name(Client *self, void *unused) {
  (void)unused;
  call x;
  int err;
  char name[TD_CLIENT_NAME_MAX + 1] = "";
  /* Through cl_enter: a forked child reconnects first, and says its name. */
  CALL(self, x, err,
       (snprintf(name, sizeof(name), "%s", td_client_name(x.c)), 0));
  if (err < 0)
    return raise_err(err, x.msg);
  return PyUnicode_FromString(name);
}

static PyGetSetDef Client_getset[] = {
    {"closed", (getter)Client_get_closed, NULL, "True once close()d", NULL},
    {"path", (getter)Client_get_path, NULL, "the daemon's socket", NULL},
    {"instance", (getter)Client_get_instance, NULL,
     "the daemon's instance: storage ids are per instance", NULL},
    {"name", (getter)Client_get_name, NULL,
     "the name this client connected with, as tensorctl shows it", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ClientType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensord._tensord.Client",
    .tp_basicsize = sizeof(Client),
    .tp_dealloc = (destructor)Client_dealloc,
    .tp_repr = (reprfunc)Client_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Client(path=None, name=None): a connection to tensord, safe "
              "to share between threads, reconnected transparently in a "
              "forked child (with the same name).",
    .tp_weaklistoffset = offsetof(Client, weakrefs),
    .tp_methods = Client_methods,
    .tp_getset = Client_getset,
    .tp_new = Client_new,
};

/* ---- Exporter ---- */

static void Exporter_dealloc(Exporter *self) {
  Py_XDECREF(self->iface);
  store_unref(self->st);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef Exporter_members[] = {
    {"__array_interface__", T_OBJECT_EX, offsetof(Exporter, iface), READONLY,
     NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ExporterType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensord._tensord._Exporter",
    .tp_basicsize = sizeof(Exporter),
    .tp_dealloc = (destructor)Exporter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The owner of a numpy array made by Tensor.numpy(): it holds a "
              "reference to the storage.",
    .tp_members = Exporter_members,
};

/* ---- Tensor ---- */

static int Tensor_traverse(Tensor *self, visitproc visit, void *arg) {
  Py_VISIT(self->key);
  Py_VISIT(self->client);
  return 0;
}

static int Tensor_clear(Tensor *self) {
  Py_CLEAR(self->key);
  Py_CLEAR(self->client);
  return 0;
}

static void Tensor_dealloc(Tensor *self) {
  PyObject_GC_UnTrack(self);
  if (self->weakrefs != NULL)
    PyObject_ClearWeakRefs((PyObject *)self);
  store *p = self->st;
  self->st = NULL;
  store_unref(p);
  Tensor_clear(self);
  PyObject_GC_Del(self);
}

static PyObject *no_numpy_dtype(td_dtype d) {
  return PyErr_Format(PyExc_TypeError,
                      "numpy has no %s: use t.view_dtype('uint8') (or an int "
                      "of the same size) for the raw bytes, or t.torch()",
                      td_dtype_name(d));
}

/* The __array_interface__ dict of t (version 3, strides in bytes). */
static PyObject *iface_dict(Tensor *t) {
  const char *ts = np_typestr(t->v.dtype);
  if (ts == NULL)
    return no_numpy_dtype(t->v.dtype);
  PyObject *shape = PyTuple_New(t->v.ndim);
  PyObject *strides = PyTuple_New(t->v.ndim);
  if (shape == NULL || strides == NULL)
    goto fail;
  for (int i = 0; i < t->v.ndim; i++) {
    PyObject *a = PyLong_FromLongLong(t->v.shape[i]);
    PyObject *b = PyLong_FromSsize_t(t->bstrides[i]);
    if (a == NULL || b == NULL) {
      Py_XDECREF(a);
      Py_XDECREF(b);
      goto fail;
    }
    PyTuple_SET_ITEM(shape, i, a);
    PyTuple_SET_ITEM(strides, i, b);
  }
  PyObject *d = Py_BuildValue(
      "{s:i,s:s,s:N,s:N,s:(NO),s:[(ss)]}", "version", 3, "typestr", ts, "shape",
      shape, "strides", strides, "data", PyLong_FromVoidPtr(tensor_data(t)),
      t->readonly ? Py_True : Py_False, "descr", "", ts);
  return d;
fail:
  Py_XDECREF(shape);
  Py_XDECREF(strides);
  return NULL;
}

static PyObject *Tensor_numpy(Tensor *self, PyObject *unused) {
  if (tensor_live(self) < 0 || tensor_on_cpu(self, "numpy()") < 0)
    return NULL;
  if (np_typestr(self->v.dtype) == NULL)
    return no_numpy_dtype(self->v.dtype);
  if (import_numpy() < 0)
    return NULL;
  Exporter *e = PyObject_New(Exporter, &ExporterType);
  if (e == NULL)
    return NULL;
  e->st = store_ref(self->st);
  e->iface = iface_dict(self);
  if (e->iface == NULL) {
    Py_DECREF(e);
    return NULL;
  }
  PyObject *a = PyObject_CallOneArg(np_asarray, (PyObject *)e);
  Py_DECREF(e);
  return a;
}

static PyObject *Tensor_get_iface(Tensor *self, void *unused) {
  if (tensor_live(self) < 0 || tensor_on_cpu(self, "__array_interface__") < 0)
    return NULL;
  PyObject *d = iface_dict(self);
  if (d != NULL)
    self->interface = 1; /* whoever reads the pointer must keep us */
  return d;
}

/* DLPack: exported from the store's mapping, as td_to_dlpack does, but
 * holding a store reference rather than a td_storage one: find() sees the
 * bytes, and the store's handle stays its only reference, which a slot
 * needs to be sent (Channel.send). */
typedef struct dlwrap {
  DLManagedTensor m;
  store *st;
  int64_t shape[TD_MAX_DIMS];
  int64_t strides[TD_MAX_DIMS];
} dlwrap;

static void dlwrap_deleter(DLManagedTensor *m) {
  dlwrap *w = m->manager_ctx;
  store_unref(w->st);
  free(w);
}

static void capsule_destructor(PyObject *cap) {
  if (PyCapsule_IsValid(cap, "dltensor")) {
    DLManagedTensor *m = PyCapsule_GetPointer(cap, "dltensor");
    if (m != NULL && m->deleter != NULL)
      m->deleter(m);
  }
}

/* The DLPack 0.6 type of d: bool travels as uint8, as PyTorch did before
 * DLPack had a bool. Returns 0, or -1 where DLPack 0.6 has none (float8). */
static int dl_dtype(td_dtype d, DLDataType *out) {
  switch (d) {
  case TD_BOOL:
  case TD_UINT8:
  case TD_UINT16:
  case TD_UINT32:
  case TD_UINT64:
    out->code = kDLUInt;
    break;
  case TD_INT8:
  case TD_INT16:
  case TD_INT32:
  case TD_INT64:
    out->code = kDLInt;
    break;
  case TD_FLOAT16:
  case TD_FLOAT32:
  case TD_FLOAT64:
    out->code = kDLFloat;
    break;
  case TD_BFLOAT16:
    out->code = kDLBfloat;
    break;
  case TD_COMPLEX64:
  case TD_COMPLEX128:
    out->code = kDLComplex;
    break;
  default:
    return -1;
  }
  out->bits = (uint8_t)(td_dtype_size(d) * 8);
  out->lanes = 1;
  return 0;
}

/* A new "dltensor" capsule of view v of t's storage (live: the caller
 * checked). TypeError for a dtype DLPack 0.6 lacks or a malformed view,
 * ValueError for a view outside the storage. */
static PyObject *make_capsule(Tensor *t, const td_view *v) {
  store *p = t->st;
  int err = td_view_check(v, p->len);
  if (err < 0) {
    PyErr_Format(err == TD_EINVAL ? PyExc_TypeError : PyExc_ValueError,
                 "to_dlpack: storage %llu: %s", (unsigned long long)t->sid,
                 td_view_last_error());
    return NULL;
  }
  DLDataType dt;
  if (dl_dtype(v->dtype, &dt) < 0)
    return PyErr_Format(PyExc_TypeError,
                        "to_dlpack: DLPack 0.6 has no type for %s; "
                        "reinterpret the view as uint8 first",
                        td_dtype_name(v->dtype));
  dlwrap *w = calloc(1, sizeof(*w));
  if (w == NULL)
    return PyErr_NoMemory();
  memcpy(w->shape, v->shape, (size_t)v->ndim * sizeof(int64_t));
  memcpy(w->strides, v->stride, (size_t)v->ndim * sizeof(int64_t));
  w->st = store_ref(p);
  DLTensor *d = &w->m.dl_tensor;
  /* data at the first element, byte_offset 0: PyTorch 1.13 ignores
   * byte_offset on import. The view passed td_view_check: it fits. */
  d->data = p->base + (size_t)v->offset * td_dtype_size(v->dtype);
  d->device.device_type = p->cuda ? kDLCUDA : kDLCPU;
  d->device.device_id = p->cuda ? p->device_index : 0;
  d->ndim = v->ndim;
  d->dtype = dt;
  d->shape = w->shape;
  d->strides = w->strides;
  d->byte_offset = 0;
  w->m.manager_ctx = w;
  w->m.deleter = dlwrap_deleter;
  PyObject *cap = PyCapsule_New(&w->m, "dltensor", capsule_destructor);
  if (cap == NULL)
    dlwrap_deleter(&w->m);
  return cap;
}

/* Orders stream (NULL: this thread) after the work t's publisher recorded
 * in the event it published t's key with (td_storage_wait; nothing to do
 * without one). Returns 0, or -1 with tensord.Error set. */
static int tensor_wait(Tensor *t, void *stream) {
  store *sp = store_use(t->st);
  char msg[1024];
  int err;
  Py_BEGIN_ALLOW_THREADS
    err = td_storage_wait(sp->s, stream);
    if (err < 0)
      snprintf(msg, sizeof(msg), "%s", td_last_error(td_storage_client(sp->s)));
  Py_END_ALLOW_THREADS
  store_done(sp);
  if (err < 0) {
    raise_err(err, msg);
    return -1;
  }
  return 0;
}

/* The CUstream a DLPack consumer names for a CUDA tensor, as the array API
 * has it: None (the consumer assumes the legacy default stream) and 1 are
 * CU_STREAM_LEGACY, 2 CU_STREAM_PER_THREAD (the driver's handles for them
 * are these very values), a larger int the stream itself; -1 asks for no
 * synchronisation (*out NULL, *sync 0). Returns 0, or -1 with ValueError
 * set (0, which the array API leaves ambiguous, below -1, wider than a
 * pointer, or not an int). */
static int dlpack_stream(PyObject *stream, void **out, int *sync) {
  *out = NULL;
  *sync = 1;
  if (stream == Py_None) {
    *out = (void *)(uintptr_t)1; /* CU_STREAM_LEGACY */
    return 0;
  }
  if (!PyLong_Check(stream)) {
    PyErr_Format(PyExc_ValueError,
                 "__dlpack__: stream must be None or an int, not %.100s",
                 Py_TYPE(stream)->tp_name);
    return -1;
  }
  int overflow;
  long long v = PyLong_AsLongLongAndOverflow(stream, &overflow);
  if (v == -1 && PyErr_Occurred())
    return -1;
  unsigned long long u = (unsigned long long)v;
  if (overflow > 0) {
    u = PyLong_AsUnsignedLongLong(stream);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
      PyErr_Clear(); /* wider than a pointer: the ValueError below */
      overflow = -1;
    }
  }
  if (u > UINTPTR_MAX)
    overflow = -1;
  if (overflow == 0 && v == -1) {
    *sync = 0;
    return 0;
  }
  if (overflow < 0 || (overflow == 0 && v <= 0)) {
    PyErr_Format(PyExc_ValueError,
                 "__dlpack__: stream %S is not a CUDA stream: 1 is the legacy "
                 "default stream, 2 the per-thread one, a larger int a "
                 "CUstream, -1 no synchronisation (0 is ambiguous)",
                 stream);
    return -1;
  }
  *out = (void *)(uintptr_t)u;
  return 0;
}

static PyObject *Tensor_dlpack(Tensor *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"stream", NULL};
  PyObject *stream = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|$O:__dlpack__", kwlist, &stream))
    return NULL;
  if (tensor_live(self) < 0)
    return NULL;
  if (!self->st->cuda) {
    if (stream != Py_None) {
      PyErr_SetString(PyExc_ValueError,
                      "__dlpack__: stream must be None for a CPU tensor");
      return NULL;
    }
    return make_capsule(self, &self->v);
  }
  /* The consumer will use the memory on stream: make that stream wait for
   * the producer's work, if its key came with an event (docs/cuda.md). */
  void *cs;
  int sync;
  if (dlpack_stream(stream, &cs, &sync) < 0 ||
      (sync && tensor_wait(self, cs) < 0))
    return NULL;
  return make_capsule(self, &self->v);
}

static PyObject *Tensor_dlpack_device(Tensor *self, PyObject *unused) {
  if (self->st != NULL && self->st->cuda)
    return Py_BuildValue("(ii)", kDLCUDA, self->st->device_index);
  return Py_BuildValue("(ii)", kDLCPU, 0);
}

static int import_torch(void) {
  if (torch_from_dlpack != NULL)
    return 0;
  PyObject *m = PyImport_ImportModule("torch.utils.dlpack");
  if (m == NULL)
    return -1;
  torch_from_dlpack = PyObject_GetAttrString(m, "from_dlpack");
  Py_DECREF(m);
  PyObject *torch = PyImport_ImportModule("torch");
  if (torch != NULL) {
    torch_bool = PyObject_GetAttrString(torch, "bool");
    Py_DECREF(torch);
  }
  if (torch_from_dlpack == NULL || torch_bool == NULL) {
    Py_CLEAR(torch_from_dlpack);
    Py_CLEAR(torch_bool);
    return -1;
  }
  return 0;
}

/* Whether the imported torch was built with CUDA and sees a GPU
 * (torch.cuda.is_available()). Returns 1, 0, or -1 with an exception set. */
static int torch_has_cuda(void) {
  PyObject *m = PyImport_ImportModule("torch.cuda");
  if (m == NULL)
    return -1;
  PyObject *r = PyObject_CallMethod(m, "is_available", NULL);
  Py_DECREF(m);
  if (r == NULL)
    return -1;
  int yes = PyObject_IsTrue(r);
  Py_DECREF(r);
  return yes;
}

static PyObject *Tensor_torch(Tensor *self, PyObject *unused) {
  if (tensor_live(self) < 0)
    return NULL;
  td_dtype d = self->v.dtype;
  switch (d) {
  case TD_UINT16:
  case TD_UINT32:
  case TD_UINT64:
  case TD_FLOAT8_E4M3FN:
  case TD_FLOAT8_E5M2:
    return PyErr_Format(PyExc_TypeError,
                        "torch %s has no %s: use t.view_dtype('int%d') for the "
                        "same bytes, or t.numpy()",
                        "1.13", td_dtype_name(d), (int)td_dtype_size(d) * 8);
  default:
    break;
  }
  if (import_torch() < 0)
    return NULL;
  /* A GPU tensor goes to a CUDA torch as itself: its from_dlpack passes
   * its current stream on the tensor's GPU to __dlpack__, which makes that
   * stream wait on the key's event. A CPU-only torch gets the capsule, and
   * refuses it with its own error ("Torch not compiled with CUDA"). */
  int as_self = 0;
  if (self->st->cuda && (as_self = torch_has_cuda()) < 0)
    return NULL;
  PyObject *cap = as_self ? (Py_INCREF(self), (PyObject *)self)
                          : make_capsule(self, &self->v);
  if (cap == NULL)
    return NULL;
  PyObject *t = PyObject_CallOneArg(torch_from_dlpack, cap);
  Py_DECREF(cap);
  if (t != NULL && d == TD_BOOL) {
    PyObject *b = PyObject_CallMethod(t, "view", "O", torch_bool);
    Py_DECREF(t);
    t = b;
  }
  return t;
}

static PyObject *Tensor_wait(Tensor *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"stream", NULL};
  PyObject *streamobj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:wait", kwlist, &streamobj))
    return NULL;
  void *stream;
  if (tensor_live(self) < 0 ||
      cuda_handle(streamobj, "cuda_stream", "wait: stream", &stream) < 0 ||
      tensor_wait(self, stream) < 0)
    return NULL;
  Py_RETURN_NONE;
}

static PyObject *Tensor_release(Tensor *self, PyObject *unused) {
  self->released = 1;
  tensor_maybe_drop(self);
  Py_RETURN_NONE;
}

static PyObject *Tensor_enter(Tensor *self, PyObject *unused) {
  Py_INCREF(self);
  return (PyObject *)self;
}

static PyObject *Tensor_exit(Tensor *self, PyObject *args) {
  return Tensor_release(self, NULL);
}

static PyObject *Tensor_reduce(Tensor *self, PyObject *args) {
  PyErr_SetString(PyExc_TypeError,
                  "tensord.Tensor cannot be pickled: publish it under a key, "
                  "or send it (or its torch() tensor) through "
                  "multiprocessing after tensord.torch.install()");
  return NULL;
}

/* ---- views ---- */

/* Returns a new Tensor of v on self's storage, or raises for err (what the
 * td_view_* call that made v returned). */
static PyObject *derive(Tensor *self, const td_view *v, int err) {
  if (err < 0)
    return raise_view(err);
  return tensor_new(store_ref(self->st), v, NULL, self->client);
}

/* Parses "*dims" or one sequence of them; returns the count or -1. */
static int parse_dims(PyObject *args, int64_t *out, const char *what) {
  PyObject *src = args;
  if (PyTuple_GET_SIZE(args) == 1 && !PyIndex_Check(PyTuple_GET_ITEM(args, 0)))
    src = PyTuple_GET_ITEM(args, 0);
  return parse_shape(src, out, what);
}

static int as_dim(PyObject *o, int32_t *d) {
  long v = PyLong_AsLong(o);
  if (v == -1 && PyErr_Occurred())
    return -1;
  if (v < INT32_MIN || v > INT32_MAX) {
    PyErr_Format(PyExc_IndexError, "dim %ld out of range", v);
    return -1;
  }
  *d = (int32_t)v;
  return 0;
}

static PyObject *Tensor_transpose(Tensor *self, PyObject *args) {
  int d0, d1;
  if (!PyArg_ParseTuple(args, "ii:transpose", &d0, &d1) ||
      tensor_live(self) < 0)
    return NULL;
  td_view v = self->v;
  return derive(self, &v, td_view_transpose(&v, d0, d1));
}

static PyObject *Tensor_permute(Tensor *self, PyObject *args) {
  int64_t d[TD_MAX_DIMS];
  int n = parse_dims(args, d, "permute");
  if (n < 0 || tensor_live(self) < 0)
    return NULL;
  if (n != self->v.ndim) {
    PyErr_Format(PyExc_ValueError,
                 "permute: %d dims given for a view of %d dims", n,
                 self->v.ndim);
    return NULL;
  }
  int32_t dims[TD_MAX_DIMS];
  for (int i = 0; i < n; i++) {
    if (d[i] < INT32_MIN || d[i] > INT32_MAX) {
      PyErr_Format(PyExc_IndexError, "permute: dim %lld out of range",
                   (long long)d[i]);
      return NULL;
    }
    dims[i] = (int32_t)d[i];
  }
  td_view v = self->v;
  return derive(self, &v, td_view_permute(&v, dims));
}

/* view(*shape) and expand(*shape): fn, td_view_reshape or td_view_expand,
 * on a copy of self's view. */
static PyObject *to_shape(Tensor *self, PyObject *args, const char *what,
                          int (*fn)(td_view *, int32_t, const int64_t *)) {
  int64_t shape[TD_MAX_DIMS];
  int n = parse_dims(args, shape, what);
  if (n < 0 || tensor_live(self) < 0)
    return NULL;
  td_view v = self->v;
  return derive(self, &v, fn(&v, n, shape));
}

static PyObject *Tensor_view(Tensor *self, PyObject *args) {
  return to_shape(self, args, "view", td_view_reshape);
}

static PyObject *Tensor_expand(Tensor *self, PyObject *args) {
  return to_shape(self, args, "expand", td_view_expand);
}

static PyObject *Tensor_view_dtype(Tensor *self, PyObject *arg) {
  td_dtype d;
  if (parse_dtype(arg, &d) < 0 || tensor_live(self) < 0)
    return NULL;
  td_view v = self->v;
  return derive(self, &v, td_view_reinterpret(&v, d));
}

static PyObject *Tensor_unsqueeze(Tensor *self, PyObject *args) {
  int d;
  if (!PyArg_ParseTuple(args, "i:unsqueeze", &d) || tensor_live(self) < 0)
    return NULL;
  td_view v = self->v;
  return derive(self, &v, td_view_unsqueeze(&v, d));
}

static PyObject *Tensor_squeeze(Tensor *self, PyObject *args) {
  PyObject *dobj = Py_None;
  int32_t d;
  if (!PyArg_ParseTuple(args, "|O:squeeze", &dobj) || tensor_live(self) < 0)
    return NULL;
  if (dobj != Py_None && as_dim(dobj, &d) < 0)
    return NULL;
  td_view v = self->v;
  return derive(self, &v,
                dobj == Py_None ? td_view_squeeze_all(&v)
                                : td_view_squeeze(&v, d));
}

static PyObject *Tensor_narrow(Tensor *self, PyObject *args) {
  int d;
  long long start, len;
  if (!PyArg_ParseTuple(args, "iLL:narrow", &d, &start, &len) ||
      tensor_live(self) < 0)
    return NULL;
  td_view v = self->v;
  return derive(self, &v, td_view_narrow(&v, d, start, len));
}

/* copy_(src): td_copy of src's view into self's, in place; returns self.
 * Either may be a GPU's: two views on one GPU are copied device to device
 * (cuMemcpy2D), without a trip through the host. Raises TypeError for a src
 * that is not a tensord Tensor, ValueError / IndexError as td_copy refuses
 * (dtype or shape differ, a read-only self, a view outside its storage),
 * tensord.Error for a driver failure. */
static PyObject *Tensor_copy_(Tensor *self, PyObject *srcobj) {
  if (tensor_live(self) < 0)
    return NULL;
  if (!PyObject_TypeCheck(srcobj, &TensorType))
    return PyErr_Format(PyExc_TypeError,
                        "copy_: the source is a %.100s, not a tensord Tensor",
                        Py_TYPE(srcobj)->tp_name);
  Tensor *src = (Tensor *)srcobj;
  if (tensor_live(src) < 0)
    return NULL;
  store *dp = store_use(self->st), *sp = store_use(src->st);
  td_view dv = self->v, sv = src->v;
  int err;
  Py_BEGIN_ALLOW_THREADS
    err = td_copy(dp->s, &dv, sp->s, &sv);
  Py_END_ALLOW_THREADS
  store_done(dp);
  store_done(sp);
  if (err == TD_EINVAL || err == TD_ERANGE || err == TD_EACCES)
    return raise_view(err == TD_EACCES ? TD_EINVAL : err);
  if (err < 0)
    return raise_err(err, td_view_last_error());
  Py_INCREF(self);
  return (PyObject *)self;
}

static PyObject *Tensor_as_strided(Tensor *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"shape", "strides", "offset", "dtype", NULL};
  PyObject *shapeobj, *strideobj, *offobj = Py_None, *dtobj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OO:as_strided", kwlist,
                                   &shapeobj, &strideobj, &offobj, &dtobj) ||
      tensor_live(self) < 0)
    return NULL;
  int64_t shape[TD_MAX_DIMS], strides[TD_MAX_DIMS];
  int n = parse_shape(shapeobj, shape, "as_strided");
  if (n < 0)
    return NULL;
  int m = parse_shape(strideobj, strides, "as_strided");
  if (m < 0)
    return NULL;
  if (m != n) {
    PyErr_Format(PyExc_ValueError, "as_strided: %d sizes but %d strides", n, m);
    return NULL;
  }
  td_view v = self->v;
  if (dtobj != Py_None && parse_dtype(dtobj, &v.dtype) < 0)
    return NULL;
  int64_t offset;
  if (offobj != Py_None) {
    offset = PyLong_AsLongLong(offobj);
    if (offset == -1 && PyErr_Occurred())
      return NULL;
  } else {
    /* The same first byte, in elements of the new dtype. */
    int64_t byte = self->v.offset * (int64_t)td_dtype_size(self->v.dtype);
    int64_t es = (int64_t)td_dtype_size(v.dtype);
    if (byte % es != 0) {
      PyErr_Format(PyExc_ValueError,
                   "as_strided: offset of %lld bytes is not a whole number of "
                   "%s elements; give offset",
                   (long long)byte, td_dtype_name(v.dtype));
      return NULL;
    }
    offset = byte / es;
  }
  int err = td_view_as_strided(&v, n, shape, strides, offset);
  if (err == 0)
    err = td_view_check(&v, self->snbytes);
  if (err == TD_ERANGE) {
    char buf[600];
    PyErr_Format(PyExc_ValueError,
                 "as_strided: %s reaches outside storage %llu of %zu bytes",
                 td_view_format(&v, buf, sizeof(buf)),
                 (unsigned long long)self->sid, self->snbytes);
    return NULL;
  }
  return derive(self, &v, err);
}

/* t[idx]: ints, slices with positive steps, None, Ellipsis, tuples. */
static PyObject *Tensor_getitem(Tensor *self, PyObject *idx) {
  if (tensor_live(self) < 0)
    return NULL;
  PyObject *items;
  if (PyTuple_Check(idx)) {
    items = idx;
    Py_INCREF(items);
  } else {
    items = PyTuple_Pack(1, idx);
    if (items == NULL)
      return NULL;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(items);
  int consuming = 0, ellipses = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *it = PyTuple_GET_ITEM(items, i);
    if (it == Py_Ellipsis) {
      ellipses++;
    } else if (it == Py_None) {
    } else if (PySlice_Check(it) || (PyIndex_Check(it) && !PyBool_Check(it))) {
      consuming++;
    } else {
      Py_DECREF(items);
      return PyErr_Format(PyExc_IndexError,
                          "only integers, slices (`:`), ellipsis (`...`) and "
                          "None are valid indices of a tensord.Tensor, not "
                          "%.100s",
                          Py_TYPE(it)->tp_name);
    }
  }
  if (ellipses > 1) {
    Py_DECREF(items);
    PyErr_SetString(PyExc_IndexError,
                    "an index can only have a single ellipsis ('...')");
    return NULL;
  }
  if (consuming > self->v.ndim) {
    Py_DECREF(items);
    return PyErr_Format(PyExc_IndexError,
                        "too many indices for tensor: tensor is %d-"
                        "dimensional, but %d were indexed",
                        self->v.ndim, consuming);
  }
  td_view v = self->v;
  int d = 0, left = consuming, err = 0;
  for (Py_ssize_t i = 0; i < n && err == 0; i++) {
    PyObject *it = PyTuple_GET_ITEM(items, i);
    if (it == Py_Ellipsis) {
      d = v.ndim - left;
    } else if (it == Py_None) {
      err = td_view_unsqueeze(&v, d);
      d++;
    } else if (PySlice_Check(it)) {
      Py_ssize_t start, stop, step;
      if (PySlice_Unpack(it, &start, &stop, &step) < 0) {
        Py_DECREF(items);
        return NULL;
      }
      if (step <= 0) {
        Py_DECREF(items);
        PyErr_SetString(PyExc_ValueError,
                        "slice step must be positive (tensord views, like "
                        "torch's, cannot run backwards)");
        return NULL;
      }
      err = td_view_slice(&v, d, start, stop, step);
      d++;
      left--;
    } else {
      Py_ssize_t k = PyNumber_AsSsize_t(it, PyExc_IndexError);
      if (k == -1 && PyErr_Occurred()) {
        Py_DECREF(items);
        return NULL;
      }
      if (k < -v.shape[d] || k >= v.shape[d]) {
        Py_DECREF(items);
        return PyErr_Format(PyExc_IndexError,
                            "index %zd is out of bounds for dimension %d "
                            "with size %lld",
                            k, d, (long long)v.shape[d]);
      }
      err = td_view_select(&v, d, k);
      left--;
    }
  }
  Py_DECREF(items);
  return derive(self, &v, err);
}

/* The buffer protocol, for memoryview() and np.asarray(). */
static int f_contiguous(const td_view *v) {
  int64_t expect = 1;
  for (int i = 0; i < v->ndim; i++) {
    if (v->shape[i] == 0)
      return 1;
  }
  for (int i = 0; i < v->ndim; i++) {
    if (v->shape[i] != 1 && v->stride[i] != expect)
      return 0;
    expect *= v->shape[i];
  }
  return 1;
}

static int Tensor_getbuffer(Tensor *self, Py_buffer *b, int flags) {
  if (self->released || self->st == NULL) {
    PyErr_SetString(PyExc_BufferError, "tensord.Tensor: released");
    return -1;
  }
  if (store_gone(self->st)) {
    PyErr_SetString(PyExc_BufferError,
                    "tensord.Tensor: sent through a channel");
    return -1;
  }
  if (self->st->cuda) {
    PyErr_Format(PyExc_BufferError,
                 "tensord.Tensor on cuda:%d: device memory has no buffer "
                 "protocol (use torch() or __dlpack__)",
                 self->st->device_index);
    return -1;
  }
  const char *fmt = buf_format(self->v.dtype);
  if (fmt == NULL) {
    PyErr_Format(PyExc_BufferError,
                 "tensord.Tensor of %s: the buffer protocol has no such type "
                 "(use view_dtype('uint8') or torch())",
                 td_dtype_name(self->v.dtype));
    return -1;
  }
  if ((flags & PyBUF_WRITABLE) && self->readonly) {
    PyErr_Format(PyExc_BufferError,
                 "tensord.Tensor of storage %llu is mapped read-only "
                 "(lookup or open with readonly=True): no writable buffer",
                 (unsigned long long)self->sid);
    return -1;
  }
  int c = td_view_is_contiguous(&self->v) == 1;
  int f = f_contiguous(&self->v);
  if ((flags & PyBUF_STRIDES) != PyBUF_STRIDES && !c) {
    PyErr_SetString(PyExc_BufferError,
                    "tensord.Tensor: not C-contiguous (ask for strides)");
    return -1;
  }
  if (((flags & PyBUF_C_CONTIGUOUS) == PyBUF_C_CONTIGUOUS && !c) ||
      ((flags & PyBUF_F_CONTIGUOUS) == PyBUF_F_CONTIGUOUS && !f) ||
      ((flags & PyBUF_ANY_CONTIGUOUS) == PyBUF_ANY_CONTIGUOUS && !c && !f)) {
    PyErr_SetString(PyExc_BufferError,
                    "tensord.Tensor: not contiguous as asked");
    return -1;
  }
  size_t es = td_dtype_size(self->v.dtype);
  b->buf = tensor_data(self);
  b->obj = (PyObject *)self;
  Py_INCREF(self);
  b->len = (Py_ssize_t)(td_view_numel(&self->v) * (int64_t)es);
  b->readonly = self->readonly;
  b->itemsize = (Py_ssize_t)es;
  b->format = (flags & PyBUF_FORMAT) ? (char *)fmt : NULL;
  b->ndim = self->v.ndim;
  b->shape = (flags & PyBUF_ND) ? self->bshape : NULL;
  b->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? self->bstrides : NULL;
  b->suboffsets = NULL;
  b->internal = NULL;
  self->exports++;
  return 0;
}

static void Tensor_releasebuffer(Tensor *self, Py_buffer *b) {
  self->exports--;
  tensor_maybe_drop(self);
}

static PyBufferProcs Tensor_as_buffer = {
    (getbufferproc)Tensor_getbuffer,
    (releasebufferproc)Tensor_releasebuffer,
};

static PyMappingMethods Tensor_as_mapping = {
    .mp_subscript = (binaryfunc)Tensor_getitem,
};

static PyObject *tuple_of(const int64_t *a, int n) {
  PyObject *t = PyTuple_New(n);
  for (int i = 0; t != NULL && i < n; i++) {
    PyObject *x = PyLong_FromLongLong(a[i]);
    if (x == NULL)
      Py_CLEAR(t);
    else
      PyTuple_SET_ITEM(t, i, x);
  }
  return t;
}

static PyObject *Tensor_get_shape(Tensor *s, void *u) {
  return tuple_of(s->v.shape, s->v.ndim);
}
static PyObject *Tensor_get_strides(Tensor *s, void *u) {
  return tuple_of(s->v.stride, s->v.ndim);
}
static PyObject *Tensor_get_offset(Tensor *s, void *u) {
  return PyLong_FromLongLong(s->v.offset);
}
static PyObject *Tensor_get_dtype(Tensor *s, void *u) {
  return PyUnicode_FromString(td_dtype_name(s->v.dtype));
}
static PyObject *Tensor_get_itemsize(Tensor *s, void *u) {
  return PyLong_FromSize_t(td_dtype_size(s->v.dtype));
}
static PyObject *Tensor_get_ndim(Tensor *s, void *u) {
  return PyLong_FromLong(s->v.ndim);
}
static PyObject *Tensor_get_numel(Tensor *s, void *u) {
  return PyLong_FromLongLong(td_view_numel(&s->v));
}
static PyObject *Tensor_get_nbytes(Tensor *s, void *u) {
  return PyLong_FromLongLong(td_view_numel(&s->v) *
                             (int64_t)td_dtype_size(s->v.dtype));
}
static PyObject *Tensor_get_storage_nbytes(Tensor *s, void *u) {
  return PyLong_FromSize_t(s->snbytes);
}
static PyObject *Tensor_get_device(Tensor *s, void *u) {
  if (s->st == NULL || !s->st->cuda)
    return PyUnicode_FromString("cpu");
  return PyUnicode_FromFormat("cuda:%d", s->st->device_index);
}
static PyObject *Tensor_get_readonly(Tensor *s, void *u) {
  return PyBool_FromLong(s->readonly);
}
static PyObject *Tensor_get_released(Tensor *s, void *u) {
  return PyBool_FromLong(s->released);
}
static PyObject *Tensor_get_data_ptr(Tensor *s, void *u) {
  if (tensor_live(s) < 0)
    return NULL;
  return PyLong_FromVoidPtr(tensor_data(s));
}

static PyObject *Tensor_repr(Tensor *self) {
  char buf[700];
  td_view_format(&self->v, buf, sizeof(buf));
  if (self->key != NULL)
    return PyUnicode_FromFormat("tensord.Tensor(%s, storage %llu, key %R%s)",
                                buf, (unsigned long long)self->sid, self->key,
                                self->released ? ", released" : "");
  return PyUnicode_FromFormat("tensord.Tensor(%s, storage %llu%s)", buf,
                              (unsigned long long)self->sid,
                              self->released ? ", released" : "");
}

static Py_ssize_t Tensor_len(Tensor *self) {
  if (self->v.ndim == 0) {
    PyErr_SetString(PyExc_TypeError, "len() of a 0-d tensor");
    return -1;
  }
  return (Py_ssize_t)self->v.shape[0];
}

static PySequenceMethods Tensor_as_sequence = {
    .sq_length = (lenfunc)Tensor_len,
};

static PyMethodDef Tensor_methods[] = {
    {"numpy", (PyCFunction)Tensor_numpy, METH_NOARGS,
     "numpy() -> np.ndarray over the same bytes (not writeable if read-only); "
     "it keeps the storage alive."},
    {"torch", (PyCFunction)Tensor_torch, METH_NOARGS,
     "torch() -> torch.Tensor over the same bytes; it keeps the storage "
     "alive. On a GPU, torch's current stream there waits on the event the "
     "key was published with, if any (see __dlpack__)."},
    {"__dlpack__", (PyCFunction)(void (*)(void))Tensor_dlpack,
     METH_VARARGS | METH_KEYWORDS,
     "__dlpack__(*, stream=None): a DLPack capsule of this view. For a GPU "
     "tensor whose key was published with an event, stream (the array "
     "API's: None or 1 the legacy default stream, 2 the per-thread one, a "
     "larger int a CUstream) first waits on it on the device; -1 skips "
     "that. A CPU tensor takes None only."},
    {"__dlpack_device__", (PyCFunction)Tensor_dlpack_device, METH_NOARGS,
     "(kDLCPU, 0)"},
    {"wait", (PyCFunction)(void (*)(void))Tensor_wait,
     METH_VARARGS | METH_KEYWORDS,
     "wait(stream=None): orders this process after the work its publisher "
     "recorded in the event it published with (publish(..., event=...)): "
     "with stream (an int CUstream, or a torch.cuda.Stream) that stream "
     "waits on the device and the host goes on; with None this thread "
     "blocks until the work is done (td_storage_wait). Returns at once when "
     "there is nothing to wait for (no event, a CPU tensor, a tensor not "
     "from lookup)."},
    {"release", (PyCFunction)Tensor_release, METH_NOARGS,
     "release(): drops this Tensor's reference (idempotent; deferred while "
     "buffers are exported)."},
    {"__enter__", (PyCFunction)Tensor_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Tensor_exit, METH_VARARGS, NULL},
    {"__reduce__", (PyCFunction)Tensor_reduce, METH_NOARGS, NULL},
    {"__reduce_ex__", (PyCFunction)Tensor_reduce, METH_VARARGS, NULL},
    {"transpose", (PyCFunction)Tensor_transpose, METH_VARARGS,
     "transpose(d0, d1) -> Tensor"},
    {"permute", (PyCFunction)Tensor_permute, METH_VARARGS,
     "permute(*dims) -> Tensor"},
    {"view", (PyCFunction)Tensor_view, METH_VARARGS,
     "view(*shape) -> Tensor, as torch's Tensor.view(shape)"},
    {"view_dtype", (PyCFunction)Tensor_view_dtype, METH_O,
     "view_dtype(dtype) -> Tensor, as torch's Tensor.view(dtype)"},
    {"as_strided", (PyCFunction)(void (*)(void))Tensor_as_strided,
     METH_VARARGS | METH_KEYWORDS,
     "as_strided(shape, strides, offset=None, dtype=None) -> Tensor, checked "
     "against the storage"},
    {"expand", (PyCFunction)Tensor_expand, METH_VARARGS,
     "expand(*shape) -> Tensor"},
    {"unsqueeze", (PyCFunction)Tensor_unsqueeze, METH_VARARGS,
     "unsqueeze(dim) -> Tensor"},
    {"squeeze", (PyCFunction)Tensor_squeeze, METH_VARARGS,
     "squeeze(dim=None) -> Tensor"},
    {"narrow", (PyCFunction)Tensor_narrow, METH_VARARGS,
     "narrow(dim, start, length) -> Tensor"},
    {"copy_", (PyCFunction)Tensor_copy_, METH_O,
     "copy_(src) -> self: copies src (a tensord Tensor of the same dtype and "
     "shape) into this view in place (td_copy); two views on one GPU are "
     "copied device to device."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Tensor_getset[] = {
    {"shape", (getter)Tensor_get_shape, NULL, "sizes", NULL},
    {"strides", (getter)Tensor_get_strides, NULL, "strides in elements", NULL},
    {"offset", (getter)Tensor_get_offset, NULL, "offset in elements", NULL},
    {"dtype", (getter)Tensor_get_dtype, NULL, "torch's name", NULL},
    {"itemsize", (getter)Tensor_get_itemsize, NULL, NULL, NULL},
    {"ndim", (getter)Tensor_get_ndim, NULL, NULL, NULL},
    {"numel", (getter)Tensor_get_numel, NULL, NULL, NULL},
    {"nbytes", (getter)Tensor_get_nbytes, NULL, "numel * itemsize", NULL},
    {"storage_nbytes", (getter)Tensor_get_storage_nbytes, NULL, NULL, NULL},
    {"readonly", (getter)Tensor_get_readonly, NULL, NULL, NULL},
    {"device", (getter)Tensor_get_device, NULL,
     "'cpu', or 'cuda:K' with K this process's ordinal of the GPU", NULL},
    {"released", (getter)Tensor_get_released, NULL, NULL, NULL},
    {"data_ptr", (getter)Tensor_get_data_ptr, NULL,
     "address of the view's first element", NULL},
    {"__array_interface__", (getter)Tensor_get_iface, NULL,
     "numpy's array interface (version 3); reading it defers release() to "
     "garbage collection",
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* Fields read as they are (T_OBJECT reads NULL as None). */
static PyMemberDef Tensor_members[] = {
    {"storage_id", T_ULONGLONG, offsetof(Tensor, sid), READONLY, NULL},
    {"instance", T_ULONGLONG, offsetof(Tensor, instance), READONLY,
     "the instance of the daemon storage_id belongs to (Client.instance)"},
    {"key", T_OBJECT, offsetof(Tensor, key), READONLY,
     "the key it was looked up or published under, or None"},
    {"client", T_OBJECT, offsetof(Tensor, client), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject TensorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensord._tensord.Tensor",
    .tp_basicsize = sizeof(Tensor),
    .tp_dealloc = (destructor)Tensor_dealloc,
    .tp_repr = (reprfunc)Tensor_repr,
    .tp_as_sequence = &Tensor_as_sequence,
    .tp_as_mapping = &Tensor_as_mapping,
    .tp_as_buffer = &Tensor_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A view (dtype, shape, strides, offset in elements) of a "
              "tensord storage, holding a reference to it.",
    .tp_traverse = (traverseproc)Tensor_traverse,
    .tp_clear = (inquiry)Tensor_clear,
    .tp_weaklistoffset = offsetof(Tensor, weakrefs),
    .tp_methods = Tensor_methods,
    .tp_members = Tensor_members,
    .tp_getset = Tensor_getset,
};

/* ---- Watch: the daemon's events as they happen ---- */

/* A td_watch (a connection of its own) and a pipe that close() writes, so
 * that a next() blocked in another thread wakes at once. closed and busy are
 * under g_mu, taken without the GIL like a Client's state. */
typedef struct Watch {
  PyObject_HEAD td_watch *w; /* NULL once closed */
  int wake[2];               /* the pipe: [0] polled by next(), [1] written */
  unsigned gen;              /* g_forkgen at open: a forked child's is stale */
  int closed;
  int busy;         /* a next() is running: close() waits for it */
  PyObject *prefix; /* str */
  PyObject *path;   /* str: the socket */
  PyObject *weakrefs;
} Watch;

static PyTypeObject WatchType;
static PyTypeObject *WatchEventType;

static PyStructSequence_Field event_fields[] = {
    {"type", "what happened: 'create', 'publish', 'take', 'unpublish', "
             "'free', 'connect', 'disconnect', 'refused', 'lookup' "
             "('unknown' for a type this library does not know)"},
    {"key", "the key, or ''"},
    {"id", "the storage's id, or 0"},
    {"nbytes", "the storage's size, or 0"},
    {"device", "'cpu' or 'cuda'"},
    {"pid", "the process of the client that caused it"},
    {"uid", "its uid"},
    {"name", "its name (Hello's client_name), or ''"},
    {"message", "refused: the daemon's message; disconnect: why; else ''"},
    {"code", "refused: the negative TD_E* code; else 0"},
    {"unix_ms", "when, by the daemon's wall clock (ms since the epoch)"},
    {"dropped", "events lost just before this one (a reader too slow)"},
    {"type_id", "the numeric type (td_event_type)"},
    {NULL, NULL},
};

static PyStructSequence_Desc event_desc = {
    "tensord.WatchEvent",
    "One event of a watch (tensord.watch): what happened in the daemon.",
    event_fields,
    13,
};

static PyObject *str_or_empty(const char *s) {
  if (s == NULL)
    s = "";
  return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "replace");
}

/* A new WatchEvent of ev (whose strings are copied). */
static PyObject *event_new(const td_event *ev) {
  PyObject *e = PyStructSequence_New(WatchEventType);
  if (e == NULL)
    return NULL;
  PyObject *v[13] = {
      PyUnicode_FromString(td_event_type_name((int)ev->type)),
      str_or_empty(ev->key),
      PyLong_FromUnsignedLongLong(ev->id),
      PyLong_FromUnsignedLongLong(ev->nbytes),
      PyUnicode_FromString(ev->device == TD_CUDA ? "cuda" : "cpu"),
      PyLong_FromLong(ev->pid),
      PyLong_FromUnsignedLong(ev->uid),
      str_or_empty(ev->name),
      str_or_empty(ev->message),
      PyLong_FromLong(ev->code),
      PyLong_FromLongLong(ev->unix_ms),
      PyLong_FromUnsignedLongLong(ev->dropped),
      PyLong_FromLong((long)ev->type),
  };
  int ok = 1;
  for (int i = 0; i < 13; i++) {
    if (v[i] == NULL)
      ok = 0;
    else
      PyStructSequence_SET_ITEM(e, i, v[i]); /* stolen */
  }
  if (!ok) {
    Py_DECREF(e);
    return NULL;
  }
  return e;
}

static PyObject *Watch_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"prefix", "path", NULL};
  PyObject *prefixobj = NULL, *pathobj = Py_None, *bytes = NULL;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|UO:watch", kwlist, &prefixobj,
                                   &pathobj))
    return NULL;
  const char *prefix = "";
  Py_ssize_t plen = 0;
  if (prefixobj != NULL &&
      (prefix = PyUnicode_AsUTF8AndSize(prefixobj, &plen)) == NULL)
    return NULL;
  if ((size_t)plen != strlen(prefix))
    return PyErr_Format(PyExc_ValueError,
                        "watch: the prefix %R contains a NUL character",
                        prefixobj);
  char dflt[4096];
  const char *path;
  if (pathobj == Py_None) {
    int err = td_default_socket_path(dflt, sizeof(dflt));
    if (err < 0)
      return raise_err(err, td_last_error(NULL));
    path = dflt;
  } else {
    if (!PyUnicode_FSConverter(pathobj, &bytes))
      return NULL;
    path = PyBytes_AS_STRING(bytes);
  }
  Watch *self = (Watch *)type->tp_alloc(type, 0);
  if (self == NULL) {
    Py_XDECREF(bytes);
    return NULL;
  }
  self->wake[0] = self->wake[1] = -1;
  self->closed = 1; /* until open: dealloc has nothing to close */
  self->prefix =
      prefixobj != NULL ? Py_NewRef(prefixobj) : PyUnicode_FromString("");
  self->path = PyUnicode_DecodeFSDefault(path);
  if (self->prefix == NULL || self->path == NULL) {
    Py_XDECREF(bytes);
    Py_DECREF(self);
    return NULL;
  }
  if (pipe2(self->wake, O_CLOEXEC | O_NONBLOCK) < 0) {
    self->wake[0] = self->wake[1] = -1;
    Py_XDECREF(bytes);
    Py_DECREF(self);
    return PyErr_SetFromErrno(PyExc_OSError);
  }
  td_watch *w = NULL;
  int err;
  char msg[1024] = "";
  Py_BEGIN_ALLOW_THREADS
    err = td_watch_open(path, prefix, &w);
    if (err < 0)
      snprintf(msg, sizeof(msg), "%s", td_last_error(NULL));
  Py_END_ALLOW_THREADS
  Py_XDECREF(bytes);
  if (err < 0) {
    Py_DECREF(self);
    return raise_err(err, msg);
  }
  self->w = w;
  self->gen = atomic_load(&g_forkgen);
  self->closed = 0;
  return (PyObject *)self;
}

/* Called WITHOUT the GIL. Ends the watch: wakes a next() running in another
 * thread, waits for it to leave, closes the connection. In a forked child
 * only the child's copy of the socket is closed. */
static void watch_close(Watch *self) {
  pthread_mutex_lock(&g_mu);
  if (self->closed) {
    pthread_mutex_unlock(&g_mu);
    return;
  }
  self->closed = 1;
  /* The wake pipe is shared with the parent after fork(): a child's close
   * must not wake the parent's next() (no thread of the child can be in
   * one, threads do not survive fork). */
  if (self->wake[1] >= 0 && self->gen == atomic_load(&g_forkgen)) {
    ssize_t n = write(self->wake[1], "x", 1);
    (void)n; /* a full pipe is awake already */
  }
  while (self->busy && self->gen == atomic_load(&g_forkgen))
    pthread_cond_wait(&g_cv, &g_mu);
  td_watch *w = self->w;
  self->w = NULL;
  pthread_mutex_unlock(&g_mu);
  td_watch_close(w);
}

static void Watch_dealloc(Watch *self) {
  if (self->weakrefs != NULL)
    PyObject_ClearWeakRefs((PyObject *)self);
  Py_BEGIN_ALLOW_THREADS
    watch_close(self);
  Py_END_ALLOW_THREADS
  if (self->wake[0] >= 0)
    close(self->wake[0]);
  if (self->wake[1] >= 0)
    close(self->wake[1]);
  Py_XDECREF(self->prefix);
  Py_XDECREF(self->path);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Called WITHOUT the GIL. Marks a next() running, or returns a negative code
 * with msg set: closed, opened before fork(), or in use by another thread. */
static int watch_enter(Watch *self, char *msg, size_t len) {
  int err = 0;
  pthread_mutex_lock(&g_mu);
  if (self->closed) {
    snprintf(msg, len, "watch: closed");
    err = TD_ENOTCONN;
  } else if (self->gen != atomic_load(&g_forkgen)) {
    snprintf(msg, len,
             "watch: opened before fork(), in the parent: open one in this "
             "process");
    err = TD_ENOTCONN;
  } else if (self->busy) {
    snprintf(msg, len, "watch: next() is running in another thread");
    err = TD_EBUSY;
  } else {
    self->busy = 1;
  }
  pthread_mutex_unlock(&g_mu);
  return err;
}

/* Called WITHOUT the GIL: the next() watch_enter marked is over. */
static void watch_leave(Watch *self) {
  pthread_mutex_lock(&g_mu);
  self->busy = 0;
  if (self->closed)
    pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
}

/* What one wait of next() came to. */
enum { W_EVENT, W_AGAIN, W_SIGNAL, W_TIMEOUT, W_CLOSED, W_ERROR };

/* The next event, or None once timeout seconds have passed (forever: no
 * limit); NULL with an exception when closed, on an error or a signal whose
 * handler raised. */
static PyObject *watch_next(Watch *self, int forever, double timeout) {
  int64_t deadline = deadline_of(mono_ms(), timeout);
  char msg[1024] = "";
  int err;
  Py_BEGIN_ALLOW_THREADS
    err = watch_enter(self, msg, sizeof(msg));
  Py_END_ALLOW_THREADS
  if (err < 0)
    return raise_err(err, msg);
  PyObject *out = NULL;
  for (;;) {
    td_event ev;
    int what = W_ERROR;
    err = 0;
    Py_BEGIN_ALLOW_THREADS
      /* Events already received come first, then the socket is waited on
       * with the wake pipe: close() ends the wait. */
      err = td_watch_next(self->w, 0, &ev);
      if (err == 0) {
        what = W_EVENT;
      } else if (err == TD_EAGAIN) {
        what = W_SIGNAL;
      } else if (err != TD_ETIMEDOUT) {
        snprintf(msg, sizeof(msg), "%s", td_last_error(NULL));
      } else {
        /* -1 is forever: a deadline already past waits not at all. */
        int64_t left = forever ? -1 : deadline - mono_ms();
        if (!forever && left < 0)
          left = 0;
        struct pollfd p[2] = {{.fd = td_watch_fd(self->w), .events = POLLIN},
                              {.fd = self->wake[0], .events = POLLIN}};
        int n = left == 0 ? 0
                          : poll(p, 2,
                                 left < 0         ? -1
                                 : left > INT_MAX ? INT_MAX
                                                  : (int)left);
        if (n < 0 && errno == EINTR) {
          what = W_SIGNAL;
        } else if (n < 0) {
          err = -errno;
          snprintf(msg, sizeof(msg), "watch: poll: %s", strerror(errno));
        } else if (p[1].revents) {
          /* A close() wakes us; anything else on the pipe (a byte from a
           * process that shared it) is drained and the wait goes on. */
          pthread_mutex_lock(&g_mu);
          int closed = self->closed;
          pthread_mutex_unlock(&g_mu);
          if (!closed) {
            char junk[64];
            while (read(self->wake[0], junk, sizeof(junk)) > 0)
              ;
          }
          what = closed ? W_CLOSED : W_AGAIN;
        } else if (n == 0) {
          what = forever || mono_ms() < deadline ? W_AGAIN : W_TIMEOUT;
        } else {
          what = W_AGAIN; /* bytes came: read them */
        }
      }
      if (what != W_EVENT && what != W_ERROR && what != W_CLOSED) {
        pthread_mutex_lock(&g_mu);
        if (self->closed)
          what = W_CLOSED;
        pthread_mutex_unlock(&g_mu);
      }
    Py_END_ALLOW_THREADS
    if (what == W_EVENT) {
      out = event_new(&ev); /* before the next td_watch_next frees ev */
      break;
    }
    if (what == W_TIMEOUT) {
      out = Py_NewRef(Py_None);
      break;
    }
    if (what == W_CLOSED) {
      raise_err(TD_ENOTCONN, "watch: closed");
      break;
    }
    if (what == W_ERROR) {
      raise_err(err, msg);
      break;
    }
    if (what == W_SIGNAL && PyErr_CheckSignals() < 0)
      break;
  }
  Py_BEGIN_ALLOW_THREADS
    watch_leave(self);
  Py_END_ALLOW_THREADS
  return out;
}

static PyObject *Watch_next(Watch *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"timeout", NULL};
  PyObject *timeoutobj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "|O:next", kwlist, &timeoutobj))
    return NULL;
  int forever = timeoutobj == Py_None;
  double timeout = 0;
  if (!forever) {
    timeout = PyFloat_AsDouble(timeoutobj);
    if (timeout == -1.0 && PyErr_Occurred())
      return NULL;
    if (!(timeout >= 0) || timeout > 1e9)
      return PyErr_Format(PyExc_ValueError,
                          "watch.next: timeout %R (seconds, >= 0; None waits "
                          "forever)",
                          timeoutobj);
  }
  return watch_next(self, forever, timeout);
}

static PyObject *Watch_fileno(Watch *self, PyObject *unused) {
  int fd = -1;
  Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g_mu);
    if (!self->closed && self->gen == atomic_load(&g_forkgen))
      fd = td_watch_fd(self->w);
    pthread_mutex_unlock(&g_mu);
  Py_END_ALLOW_THREADS
  if (fd < 0)
    return raise_err(TD_ENOTCONN, "watch: closed");
  return PyLong_FromLong(fd);
}

static PyObject *Watch_close(Watch *self, PyObject *unused) {
  Py_BEGIN_ALLOW_THREADS
    watch_close(self);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *Watch_enter(Watch *self, PyObject *unused) {
  return Py_NewRef(self);
}

static PyObject *Watch_exit(Watch *self, PyObject *args) {
  return Watch_close(self, NULL);
}

/* Iteration: next() without a timeout; ends when the watch is closed. */
static PyObject *Watch_iternext(Watch *self) {
  PyObject *e = watch_next(self, 1, 0);
  if (e == NULL && PyErr_ExceptionMatches(Closed)) {
    pthread_mutex_lock(&g_mu); /* only held briefly: no GIL wait inside */
    int closed = self->closed;
    pthread_mutex_unlock(&g_mu);
    if (closed)
      PyErr_Clear(); /* StopIteration */
  }
  return e;
}

static PyObject *Watch_get_closed(Watch *self, void *unused) {
  return PyBool_FromLong(self->closed);
}

static PyObject *Watch_repr(Watch *self) {
  return PyUnicode_FromFormat("<tensord.Watch %R of %U%s>", self->prefix,
                              self->path, self->closed ? " (closed)" : "");
}

static PyMethodDef Watch_methods[] = {
    {"next", (PyCFunction)(void (*)(void))Watch_next,
     METH_VARARGS | METH_KEYWORDS,
     "next(timeout=None) -> WatchEvent | None: the next event, waiting up to "
     "timeout seconds (None: until one comes) without the GIL; None if none "
     "came in time. Raises tensord.Closed once the watch is closed (also "
     "from another thread, which wakes a next() waiting here) or tensord has "
     "gone."},
    {"fileno", (PyCFunction)Watch_fileno, METH_NOARGS,
     "fileno() -> int: the watch's socket, for select()/poll()/asyncio: "
     "readable when events may have come. Events may also be waiting "
     "already received: after it is readable, call next(timeout=0) until it "
     "returns None."},
    {"close", (PyCFunction)Watch_close, METH_NOARGS,
     "close(): ends the watch (idempotent); a next() waiting in another "
     "thread raises tensord.Closed."},
    {"__enter__", (PyCFunction)Watch_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Watch_exit, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Watch_members[] = {
    {"prefix", T_OBJECT_EX, offsetof(Watch, prefix), READONLY,
     "the key prefix watched ('' : every event)"},
    {"path", T_OBJECT_EX, offsetof(Watch, path), READONLY,
     "the daemon's socket"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Watch_getset[] = {
    {"closed", (getter)Watch_get_closed, NULL, "close() was called", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject WatchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensord.Watch",
    .tp_basicsize = sizeof(Watch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Watch(prefix='', path=None): the daemon's events whose key "
              "begins with prefix ('' : every event), as they happen, on a "
              "connection of its own (tensord.watch).",
    .tp_new = Watch_new,
    .tp_dealloc = (destructor)Watch_dealloc,
    .tp_repr = (reprfunc)Watch_repr,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)Watch_iternext,
    .tp_methods = Watch_methods,
    .tp_members = Watch_members,
    .tp_getset = Watch_getset,
    .tp_weaklistoffset = offsetof(Watch, weakrefs),
};

/* ---- Channel: a named FIFO of storages (docs/channels.md) ---- */

/* An end of a channel (a td_chan). closed and inflight are under g_mu, as
 * a Client's: close() waits for the calls in flight, which wait in slices of
 * SLICE_MS so that it, and Ctrl-C, are seen within that long. */
typedef struct Channel {
  PyObject_HEAD td_chan *ch; /* NULL once closed */
  PyObject *client;          /* the Client it was made through */
  PyObject *name;            /* str */
  char cname[TD_KEY_MAX + 1];
  unsigned flags; /* TD_CHAN_SEND | TD_CHAN_RECV */
  uint64_t id;
  uint32_t capacity;
  uint32_t nslots;
  uint64_t slot_bytes;
  uint64_t *slot_ids; /* nslots: tells a slot received from a storage */
  unsigned gen;       /* g_forkgen at open: a forked child's is stale */
  int closed;
  long inflight;
  PyObject *weakrefs;
} Channel;

/* Called WITHOUT the GIL. Counts a call in flight on self and sets *ch, or
 * returns TD_ENOTCONN with msg if self is closed. */
static int ch_enter(Channel *self, td_chan **ch, char *msg, size_t len) {
  int err = 0;
  pthread_mutex_lock(&g_mu);
  if (self->closed) {
    snprintf(msg, len, "channel '%s': this end is closed", self->cname);
    err = TD_ENOTCONN;
  } else {
    self->inflight++;
    *ch = self->ch;
  }
  pthread_mutex_unlock(&g_mu);
  return err;
}

/* Called WITHOUT the GIL: the call ch_enter counted is over. */
static void ch_leave(Channel *self) {
  pthread_mutex_lock(&g_mu);
  if (--self->inflight == 0 && self->closed)
    pthread_cond_broadcast(&g_cv);
  pthread_mutex_unlock(&g_mu);
}

/* Called WITHOUT the GIL. Marks self closed, waits for the calls in flight
 * (within SLICE_MS) and leaves the channel. Storages loaned or received
 * stay valid until released. */
static void ch_close(Channel *self) {
  pthread_mutex_lock(&g_mu);
  if (self->closed) {
    pthread_mutex_unlock(&g_mu);
    return;
  }
  self->closed = 1;
  while (self->inflight > 0 && self->gen == atomic_load(&g_forkgen))
    pthread_cond_wait(&g_cv, &g_mu);
  td_chan *ch = self->ch;
  self->ch = NULL;
  pthread_mutex_unlock(&g_mu);
  td_chan_close(ch); /* in a forked child: frees the child's copy only */
}

enum { OP_LOAN, OP_RECV, OP_SEND };
static const char *const op_names[] = {"loan", "receive", "send"};
static const char *const op_waits[] = {"no slot came free", "nothing came",
                                       "its ring stayed full"};
#define CHAN_PYERR 1 /* chan_wait: a signal handler raised */

/* Runs op on self without the GIL, waiting up to timeout seconds (forever:
 * no limit; 0: not at all) in slices of SLICE_MS between which signals are
 * handled. Returns 0, a negative TD_E* code with msg, or CHAN_PYERR with
 * the exception a signal handler raised. OP_SEND sends *s (view *v). */
static int chan_wait(Channel *self, int op, int forever, double timeout,
                     td_storage **s, td_view *v, char *msg, size_t len) {
  int64_t start = mono_ms();
  int64_t deadline = deadline_of(start, timeout);
  for (int first = 1;; first = 0) {
    int slice = SLICE_MS;
    if (!forever) {
      int64_t left = deadline - mono_ms();
      if (left <= 0 && !first) {
        snprintf(msg, len, "channel '%s': %s: %s (waited %lld ms)", self->cname,
                 op_names[op], op_waits[op], (long long)(mono_ms() - start));
        return TD_ETIMEDOUT;
      }
      slice = left < 0 ? 0 : left < SLICE_MS ? (int)left : SLICE_MS;
    }
    int err;
    Py_BEGIN_ALLOW_THREADS
      td_chan *ch;
      err = ch_enter(self, &ch, msg, len);
      if (err == 0) {
        err = op == OP_LOAN   ? td_chan_loan(ch, slice, s)
              : op == OP_RECV ? td_chan_recv(ch, slice, s, v)
                              : td_chan_send(ch, *s, v, slice);
        if (err < 0)
          snprintf(msg, len, "%s", td_last_error(NULL));
        ch_leave(self);
      }
    Py_END_ALLOW_THREADS
    if (err != TD_ETIMEDOUT || (!forever && timeout == 0))
      return err;
    if (PyErr_CheckSignals() < 0)
      return CHAN_PYERR;
  }
}

/* A new Tensor over handle s (its reference taken over): view v, or the
 * whole storage as uint8 for v NULL; slot says it is one of self's. */
static PyObject *chan_tensor(Channel *self, td_storage *s, const td_view *v,
                             int slot) {
  td_view whole;
  if (v == NULL) {
    int64_t n = (int64_t)td_storage_nbytes(s);
    td_view_contiguous(TD_UINT8, 1, &n, &whole);
    v = &whole;
  }
  store *p = store_new(s);
  if (p == NULL)
    return PyErr_NoMemory();
  p->slot = slot;
  return tensor_new(p, v, NULL, self->client);
}

static int chan_timeout(Channel *self, PyObject *args, PyObject *kw,
                        const char *fmt, int *forever, double *timeout) {
  static char *kwlist[] = {"timeout", NULL};
  PyObject *timeoutobj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, fmt, kwlist, &timeoutobj))
    return 0;
  return parse_wait(timeoutobj, "channel", self->cname, forever, timeout);
}

static PyObject *Channel_loan(Channel *self, PyObject *args, PyObject *kw) {
  int forever;
  double timeout;
  if (!chan_timeout(self, args, kw, "|O:loan", &forever, &timeout))
    return NULL;
  td_storage *s = NULL;
  char msg[1024];
  int err =
      chan_wait(self, OP_LOAN, forever, timeout, &s, NULL, msg, sizeof(msg));
  if (err == CHAN_PYERR)
    return NULL;
  if (err < 0)
    return raise_err(err, msg);
  return chan_tensor(self, s, NULL, 1);
}

static PyObject *Channel_recv(Channel *self, PyObject *args, PyObject *kw) {
  int forever;
  double timeout;
  if (!chan_timeout(self, args, kw, "|O:recv", &forever, &timeout))
    return NULL;
  td_storage *s = NULL;
  td_view v;
  char msg[1024];
  int err =
      chan_wait(self, OP_RECV, forever, timeout, &s, &v, msg, sizeof(msg));
  if (err == CHAN_PYERR)
    return NULL;
  if (err < 0)
    return raise_err(err, msg);
  uint64_t id = td_storage_id(s);
  int slot = 0;
  for (uint32_t i = 0; i < self->nslots && !slot; i++)
    slot = self->slot_ids[i] == id;
  return chan_tensor(self, s, &v, slot);
}

/* Reads where a CPU torch tensor begins, its shape, its strides in bytes
 * (stride() counts elements) and its dtype. Returns 0, or -1 with an
 * exception. */
static int torch_layout(PyObject *obj, char **ptr, int *ndim, int64_t *shape,
                        int64_t *bstrides, td_dtype *dt) {
  PyObject *dev = PyObject_GetAttrString(obj, "device");
  PyObject *type = dev ? PyObject_GetAttrString(dev, "type") : NULL;
  Py_XDECREF(dev);
  if (type == NULL)
    return -1;
  int cpu = PyUnicode_Check(type) &&
            PyUnicode_CompareWithASCIIString(type, "cpu") == 0;
  Py_DECREF(type);
  if (!cpu) {
    PyErr_SetString(PyExc_TypeError,
                    "send: the tensor is not on the CPU (send a tensord.Tensor "
                    "of the GPU storage instead)");
    return -1;
  }
  PyObject *dto = PyObject_GetAttrString(obj, "dtype");
  int bad = dto == NULL || parse_dtype(dto, dt) < 0;
  Py_XDECREF(dto);
  if (bad)
    return -1;
  const char *bits[] = {"is_conj", "is_neg"};
  for (int i = 0; i < 2; i++) {
    PyObject *r = PyObject_CallMethod(obj, bits[i], NULL);
    int set = r ? PyObject_IsTrue(r) : -1;
    Py_XDECREF(r);
    if (set < 0)
      PyErr_Clear(); /* an older torch without the bit */
    else if (set) {
      PyErr_Format(PyExc_TypeError,
                   "send: the tensor has its %s bit set: resolve_conj() / "
                   "resolve_neg() it first",
                   bits[i] + 3);
      return -1;
    }
  }
  PyObject *shp = PyObject_GetAttrString(obj, "shape");
  PyObject *str = PyObject_CallMethod(obj, "stride", NULL);
  PyObject *dp = PyObject_CallMethod(obj, "data_ptr", NULL);
  int n = shp ? parse_shape(shp, shape, "send") : -1;
  int m = n >= 0 && str ? parse_shape(str, bstrides, "send") : -1;
  *ptr = m >= 0 && dp ? PyLong_AsVoidPtr(dp) : NULL;
  Py_XDECREF(shp);
  Py_XDECREF(str);
  Py_XDECREF(dp);
  if (m < 0 || PyErr_Occurred())
    return -1;
  if (m != n) {
    PyErr_Format(PyExc_ValueError, "send: %d sizes but %d strides", n, m);
    return -1;
  }
  for (int i = 0; i < n; i++)
    bstrides[i] *= (int64_t)td_dtype_size(*dt);
  *ndim = n;
  return 0;
}

/* Returns a new Tensor of exactly the view that obj (a numpy array or
 * anything with the buffer protocol, or a CPU torch tensor) has of the
 * tensord storage its bytes lie in: no copy. TypeError when they lie in no
 * storage this process holds. */
static PyObject *tensor_of_array(PyObject *obj) {
  char *ptr = NULL;
  int ndim = 0;
  int64_t shape[TD_MAX_DIMS], bstrides[TD_MAX_DIMS];
  td_dtype dt = TD_DTYPE_INVALID;
  if (PyObject_CheckBuffer(obj)) {
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_RECORDS_RO) < 0)
      return NULL;
    dt = dtype_of_format(b.format, b.itemsize);
    ndim = b.ndim;
    ptr = b.buf;
    int64_t stride = b.itemsize;
    for (int i = ndim - 1; i >= 0 && i < TD_MAX_DIMS; i--) {
      shape[i] = b.shape[i];
      bstrides[i] = b.strides ? b.strides[i] : stride;
      stride *= b.shape[i];
    }
    PyBuffer_Release(&b);
    if (dt == TD_DTYPE_INVALID || ndim > TD_MAX_DIMS)
      return PyErr_Format(PyExc_TypeError,
                          "send: a %.100s of no tensord dtype, or of more "
                          "than %d dims",
                          Py_TYPE(obj)->tp_name, TD_MAX_DIMS);
  } else if (PyObject_HasAttrString(obj, "data_ptr")) {
    if (torch_layout(obj, &ptr, &ndim, shape, bstrides, &dt) < 0)
      return NULL;
  } else {
    return PyErr_Format(PyExc_TypeError,
                        "send: a %.100s is neither a tensord.Tensor, a numpy "
                        "array nor a torch tensor",
                        Py_TYPE(obj)->tp_name);
  }
  store *hit = NULL;
  pthread_mutex_lock(&g_reg_mu);
  for (store *s = g_stores; s != NULL; s = s->next)
    if (!s->cuda && !store_gone(s) && ptr >= s->base &&
        ptr < s->base + s->len && (hit = store_revive(s)) != NULL)
      break;
  pthread_mutex_unlock(&g_reg_mu);
  if (hit == NULL)
    return PyErr_Format(PyExc_TypeError,
                        "send: the %.100s's bytes lie in no tensord storage "
                        "of this process: write it into a slot "
                        "(Channel.loan) or copy it into a storage "
                        "(Client.share) first",
                        Py_TYPE(obj)->tp_name);
  int64_t es = (int64_t)td_dtype_size(dt), off = ptr - hit->base;
  int64_t estrides[TD_MAX_DIMS];
  int whole = off % es == 0;
  for (int i = 0; i < ndim; i++) {
    whole = whole && bstrides[i] % es == 0;
    estrides[i] = bstrides[i] / es;
  }
  td_view v;
  int err = whole ? td_view_contiguous(dt, 0, NULL, &v) : TD_EINVAL;
  if (err == 0)
    err = td_view_as_strided(&v, ndim, shape, estrides, off / es);
  if (err == 0)
    err = td_view_check(&v, hit->len);
  if (err < 0) {
    store_unref(hit);
    return PyErr_Format(PyExc_ValueError,
                        "send: the %.100s's view of its storage (%zu bytes) "
                        "is no tensord view: %s",
                        Py_TYPE(obj)->tp_name, hit->len,
                        whole ? td_view_last_error()
                              : "offset or strides not whole elements");
  }
  return tensor_new(hit, &v, NULL, NULL);
}

static PyObject *Channel_send(Channel *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"obj", "timeout", NULL};
  PyObject *obj, *timeoutobj = Py_None;
  if (!PyArg_ParseTupleAndKeywords(args, kw, "O|O:send", kwlist, &obj,
                                   &timeoutobj))
    return NULL;
  int forever;
  double timeout;
  if (!parse_wait(timeoutobj, "channel", self->cname, &forever, &timeout))
    return NULL;
  PyObject *own = NULL;
  if (!PyObject_TypeCheck(obj, &TensorType) &&
      (obj = own = tensor_of_array(obj)) == NULL)
    return NULL;
  Tensor *t = (Tensor *)obj;
  if (tensor_live(t) < 0) {
    Py_XDECREF(own);
    return NULL;
  }
  store *p = t->st;
  if (p->busy > 0) {
    char m[512];
    snprintf(m, sizeof(m),
             "channel '%s': send: storage %llu is in use by another thread "
             "(publish, copy_, share or wait): send it once that is over",
             self->cname, (unsigned long long)t->sid);
    Py_XDECREF(own);
    return raise_err(TD_EBUSY, m);
  }
  /* A slot moves as the handle itself: no other Tensor of this process may
   * reach the storage from now on (store_gone). Any other storage moves as
   * a reference of its own, and the views that remain stay valid. */
  td_storage *s;
  if (p->slot) {
    p->handing = 1;
    s = p->s;
  } else {
    s = td_storage_retain(p->s);
  }
  store_ref(p);
  td_view v = t->v;
  char msg[1024];
  int err =
      chan_wait(self, OP_SEND, forever, timeout, &s, &v, msg, sizeof(msg));
  if (err == 0) {
    if (p->slot) {
      pthread_mutex_lock(&g_reg_mu);
      store_unlist(p);
      p->s = NULL; /* the channel's now, freed by td_chan_send */
      pthread_mutex_unlock(&g_reg_mu);
    }
    t->released = 1;
    tensor_maybe_drop(t);
  } else if (!p->slot) {
    td_storage_release(s); /* not the last: the store holds one */
  }
  p->handing = 0;
  store_unref(p);
  Py_XDECREF(own);
  if (err == CHAN_PYERR)
    return NULL;
  if (err < 0)
    return raise_err(err, msg);
  Py_RETURN_NONE;
}

static PyObject *side_name(unsigned flags) {
  flags &= TD_CHAN_SEND | TD_CHAN_RECV;
  return PyUnicode_FromString(flags == TD_CHAN_SEND   ? "send"
                              : flags == TD_CHAN_RECV ? "recv"
                                                      : "both");
}

/* What td_chan_stat and td_chan_list say of a channel, as a dict; with
 * listed, also what only tensord knows (its ends, slot ids, owner pid). */
static PyObject *chan_dict(const td_chan_info *i, int listed) {
  char mode[8];
  snprintf(mode, sizeof(mode), "%04o", i->mode);
  PyObject *d = Py_BuildValue(
      "{s:N,s:K,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:s,s:K,s:I,s:N,s:K,"
      "s:K}",
      "name", str_or_empty(i->name), "id", (unsigned long long)i->id,
      "capacity", i->capacity, "depth", i->depth, "slots", i->slots,
      "slots_free", i->slots_free, "slots_loaned", i->slots_loaned,
      "slots_queued", i->slots_queued, "slots_held", i->slots_held, "senders",
      i->senders, "receivers", i->receivers, "mode", mode, "slot_bytes",
      (unsigned long long)i->slot_bytes, "owner_uid", i->owner_uid, "corrupt",
      PyBool_FromLong(i->corrupt), "sent", (unsigned long long)i->sent,
      "received", (unsigned long long)i->received);
  if (d == NULL || !listed)
    return d;
  PyObject *ends = PyList_New((Py_ssize_t)i->nends);
  PyObject *ids = PyList_New((Py_ssize_t)i->nslot_ids);
  int ok = ends != NULL && ids != NULL;
  for (size_t k = 0; ok && k < i->nends; k++) {
    const td_chan_end_info *e = &i->ends[k];
    PyObject *x = Py_BuildValue(
        "{s:I,s:i,s:I,s:N,s:N,s:N,s:I,s:I}", "end", e->end, "pid", e->pid,
        "uid", e->uid, "name", str_or_empty(e->name), "side",
        side_name(e->flags), "left", PyBool_FromLong(e->left), "loaned",
        e->loaned, "held", e->held);
    ok = x != NULL;
    if (ok)
      PyList_SET_ITEM(ends, (Py_ssize_t)k, x);
  }
  for (size_t k = 0; ok && k < i->nslot_ids; k++) {
    PyObject *x = PyLong_FromUnsignedLongLong(i->slot_ids[k]);
    ok = x != NULL;
    if (ok)
      PyList_SET_ITEM(ids, (Py_ssize_t)k, x);
  }
  if (!ok || set_item(d, "owner_pid", PyLong_FromLong(i->owner_pid)) < 0 ||
      set_item(d, "in_flight", PyLong_FromUnsignedLongLong(i->in_flight)) < 0 ||
      PyDict_SetItemString(d, "ends", ends) < 0 ||
      PyDict_SetItemString(d, "slot_ids", ids) < 0) {
    Py_XDECREF(ends);
    Py_XDECREF(ids);
    Py_DECREF(d);
    return NULL;
  }
  Py_DECREF(ends);
  Py_DECREF(ids);
  return d;
}

static PyObject *Channel_stat(Channel *self, PyObject *unused) {
  td_chan_info info;
  char msg[512];
  int err;
  Py_BEGIN_ALLOW_THREADS
    td_chan *ch;
    err = ch_enter(self, &ch, msg, sizeof(msg));
    if (err == 0) {
      err = td_chan_stat(ch, &info);
      if (err < 0)
        snprintf(msg, sizeof(msg), "%s", td_last_error(NULL));
      ch_leave(self);
    }
  Py_END_ALLOW_THREADS
  if (err < 0)
    return raise_err(err, msg);
  info.name = self->cname; /* valid as long as the td_chan, which we leave */
  return chan_dict(&info, 0);
}

static PyObject *Channel_close(Channel *self, PyObject *unused) {
  Py_BEGIN_ALLOW_THREADS
    ch_close(self);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

static PyObject *Channel_enter(Channel *self, PyObject *unused) {
  return Py_NewRef(self);
}

static PyObject *Channel_exit(Channel *self, PyObject *args) {
  return Channel_close(self, NULL);
}

static PyObject *Channel_reduce(Channel *self, PyObject *args) {
  PyErr_SetString(PyExc_TypeError,
                  "tensord.Channel cannot be pickled: open the channel by "
                  "its name in the other process (Client.channel(name))");
  return NULL;
}

static void Channel_dealloc(Channel *self) {
  if (self->weakrefs != NULL)
    PyObject_ClearWeakRefs((PyObject *)self);
  Py_BEGIN_ALLOW_THREADS
    ch_close(self);
  Py_END_ALLOW_THREADS
  Py_XDECREF(self->client);
  Py_XDECREF(self->name);
  free(self->slot_ids);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Channel_repr(Channel *self) {
  PyObject *side = side_name(self->flags);
  if (side == NULL)
    return NULL;
  PyObject *r = PyUnicode_FromFormat(
      "<tensord.Channel %R (%U; %u slots of %llu bytes)%s>", self->name, side,
      self->nslots, (unsigned long long)self->slot_bytes,
      self->closed ? " (closed)" : "");
  Py_DECREF(side);
  return r;
}

static PyObject *Channel_get_closed(Channel *self, void *unused) {
  return PyBool_FromLong(self->closed);
}

static PyObject *Channel_get_side(Channel *self, void *unused) {
  return side_name(self->flags);
}

static PyMethodDef Channel_methods[] = {
    {"loan", (PyCFunction)(void (*)(void))Channel_loan,
     METH_VARARGS | METH_KEYWORDS,
     "loan(timeout=None) -> Tensor: a free slot, uint8[slot_bytes] mapped "
     "read-write, waiting up to timeout seconds (None: forever; 0: not at "
     "all) for one. Write it and send() it, or release it to give it back. "
     "NotFound if the channel has no slots, PermissionDenied on an end "
     "that does not send, BrokenPipe once every receiver has left."},
    {"send", (PyCFunction)(void (*)(void))Channel_send,
     METH_VARARGS | METH_KEYWORDS,
     "send(obj, timeout=None): sends obj, a tensord.Tensor (a storage and "
     "its view, as publish() takes it), or a numpy array or CPU torch "
     "tensor whose bytes lie in a tensord storage (a loaned slot, a "
     "received one, any Tensor's), with its exact view; waits up to timeout "
     "seconds while the ring is full. Sending hands the reference over: the "
     "Tensor is released, and obj and every view of the same slot must not "
     "be used afterwards (the receiver writes or reuses those bytes); a "
     "storage that is not a slot travels as a reference of its own through "
     "tensord, and the views that remain keep it mapped. On failure "
     "nothing changed. BrokenPipe once every receiver has left."},
    {"recv", (PyCFunction)(void (*)(void))Channel_recv,
     METH_VARARGS | METH_KEYWORDS,
     "recv(timeout=None) -> Tensor: the oldest entry, the storage and view "
     "as sent, as lookup() returns a key's, waiting up to timeout seconds. "
     "A slot comes read-only unless this end also sends, and goes back to "
     "the channel when the Tensor and every numpy/torch view of it are "
     "gone (or released). BrokenPipe once the ring is empty and every "
     "sender has left; Timeout."},
    {"stat", (PyCFunction)Channel_stat, METH_NOARGS,
     "stat() -> dict: what the ring says now (depth, slots free, on loan, "
     "queued, held; senders, receivers; sent and received), read from "
     "shared memory without tensord."},
    {"close", (PyCFunction)Channel_close, METH_NOARGS,
     "close(): leaves the channel (idempotent); the other side sees "
     "BrokenPipe once all of this side have left. Calls waiting in other "
     "threads raise tensord.Closed. Tensors loaned or received stay valid "
     "until released."},
    {"__enter__", (PyCFunction)Channel_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)Channel_exit, METH_VARARGS, NULL},
    {"__reduce__", (PyCFunction)Channel_reduce, METH_NOARGS, NULL},
    {"__reduce_ex__", (PyCFunction)Channel_reduce, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Channel_members[] = {
    {"name", T_OBJECT_EX, offsetof(Channel, name), READONLY, NULL},
    {"client", T_OBJECT_EX, offsetof(Channel, client), READONLY, NULL},
    {"id", T_ULONGLONG, offsetof(Channel, id), READONLY, NULL},
    {"capacity", T_UINT, offsetof(Channel, capacity), READONLY,
     "entries the ring holds"},
    {"slots", T_UINT, offsetof(Channel, nslots), READONLY, NULL},
    {"slot_bytes", T_ULONGLONG, offsetof(Channel, slot_bytes), READONLY, NULL},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef Channel_getset[] = {
    {"closed", (getter)Channel_get_closed, NULL, "close() was called", NULL},
    {"side", (getter)Channel_get_side, NULL, "'send', 'recv' or 'both'", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ChannelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensord.Channel",
    .tp_basicsize = sizeof(Channel),
    .tp_dealloc = (destructor)Channel_dealloc,
    .tp_repr = (reprfunc)Channel_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An end of a channel (Client.channel): a named, bounded FIFO "
              "of storages with their views, from the processes that send "
              "to those that receive. Safe to share between threads.",
    .tp_weaklistoffset = offsetof(Channel, weakrefs),
    .tp_methods = Channel_methods,
    .tp_members = Channel_members,
    .tp_getset = Channel_getset,
};

/* Collects the slot ids of channel id from td_chan_list (without the GIL). */
typedef struct slot_ids_acc {
  uint64_t id;
  uint64_t *ids;
  uint32_t n;
} slot_ids_acc;

static int slot_ids_cb(const td_chan_info *info, void *arg) {
  slot_ids_acc *a = arg;
  if (info->id != a->id)
    return 0;
  a->ids = calloc(info->nslot_ids + 1, sizeof(uint64_t));
  if (a->ids == NULL)
    return TD_ENOMEM;
  memcpy(a->ids, info->slot_ids, info->nslot_ids * sizeof(uint64_t));
  a->n = (uint32_t)info->nslot_ids;
  return 1;
}

static PyObject *Client_channel(Client *self, PyObject *args, PyObject *kw) {
  static char *kwlist[] = {"name", "capacity", "slots",   "slot_bytes", "mode",
                           "side", "spin_us",  "timeout", "create",     NULL};
  PyObject *nameobj, *capobj = Py_None, *timeoutobj = Py_None,
                     *createobj = Py_None;
  unsigned int slots = 0, mode = 0600, spin = 0;
  unsigned long long slot_bytes = 0;
  const char *side = "both";
  if (!PyArg_ParseTupleAndKeywords(
          args, kw, "O|OIKIsIOO:channel", kwlist, &nameobj, &capobj, &slots,
          &slot_bytes, &mode, &side, &spin, &timeoutobj, &createobj))
    return NULL;
  const char *name = key_utf8(nameobj);
  if (name == NULL)
    return NULL;
  unsigned flags;
  if (strcmp(side, "both") == 0)
    flags = TD_CHAN_SEND | TD_CHAN_RECV;
  else if (strcmp(side, "send") == 0)
    flags = TD_CHAN_SEND;
  else if (strcmp(side, "recv") == 0)
    flags = TD_CHAN_RECV;
  else
    return PyErr_Format(PyExc_ValueError,
                        "channel '%s': side '%s' (give 'both', 'send' or "
                        "'recv')",
                        name, side);
  unsigned long capacity = 0;
  if (capobj != Py_None) {
    capacity = PyLong_AsUnsignedLong(capobj);
    if (capacity == (unsigned long)-1 && PyErr_Occurred())
      return NULL;
    if (capacity > UINT32_MAX)
      capacity = UINT32_MAX; /* td_chan_create names the limit */
  }
  int create = createobj == Py_None ? capobj != Py_None || slots > 0
                                    : PyObject_IsTrue(createobj);
  if (create < 0)
    return NULL;
  int forever;
  double timeout;
  if (!parse_wait(timeoutobj, "channel", name, &forever, &timeout))
    return NULL;
  td_chan *ch = NULL;
  call x;
  int err;
  if (create) {
    td_chan_opts o = {.capacity = (uint32_t)capacity,
                      .slots = slots,
                      .slot_bytes = slot_bytes,
                      .mode = mode,
                      .flags = flags,
                      .spin_us = spin};
    CALL(self, x, err, td_chan_create(x.c, name, &o, &ch));
    if (err < 0)
      return raise_err(err, x.msg);
  } else {
    int64_t start = mono_ms();
    int64_t deadline = deadline_of(start, timeout);
    for (int first = 1;; first = 0) {
      int slice = SLICE_MS;
      if (!forever) {
        int64_t left = deadline - mono_ms();
        if (left <= 0 && !first) {
          char m[512];
          snprintf(m, sizeof(m), "channel '%s': not created (waited %lld ms)",
                   name, (long long)(mono_ms() - start));
          return raise_err(TD_ETIMEDOUT, m);
        }
        slice = left < 0 ? 0 : left < SLICE_MS ? (int)left : SLICE_MS;
      }
      CALL(self, x, err, td_chan_open(x.c, name, flags, slice, &ch));
      if (err == 0)
        break;
      if (err != TD_ETIMEDOUT || (!forever && timeout == 0))
        return raise_err(err, x.msg);
      if (PyErr_CheckSignals() < 0)
        return NULL;
    }
    if (spin > 0)
      td_chan_set_spin(ch, spin);
  }
  td_chan_info info;
  td_chan_stat(ch, &info);
  slot_ids_acc acc = {.id = info.id};
  if (info.slots > 0) {
    CALL(self, x, err, td_chan_list(x.c, slot_ids_cb, &acc));
    if (err == 0 && acc.n != info.slots) {
      snprintf(x.msg, sizeof(x.msg),
               "channel '%s': tensord lists %u slot ids for its %u slots", name,
               (unsigned)acc.n, (unsigned)info.slots);
      err = TD_EPROTO;
    }
    if (err < 0) {
      free(acc.ids);
      Py_BEGIN_ALLOW_THREADS
        td_chan_close(ch);
      Py_END_ALLOW_THREADS
      return raise_err(err, x.msg);
    }
  }
  Channel *c = PyObject_New(Channel, &ChannelType);
  if (c == NULL) {
    free(acc.ids);
    Py_BEGIN_ALLOW_THREADS
      td_chan_close(ch);
    Py_END_ALLOW_THREADS
    return NULL;
  }
  c->ch = ch;
  c->client = Py_NewRef(self);
  c->name = Py_NewRef(nameobj);
  snprintf(c->cname, sizeof(c->cname), "%s", name);
  c->flags = flags;
  c->id = info.id;
  c->capacity = info.capacity;
  c->nslots = info.slots;
  c->slot_bytes = info.slot_bytes;
  c->slot_ids = acc.ids;
  c->gen = atomic_load(&g_forkgen);
  c->closed = 0;
  c->inflight = 0;
  c->weakrefs = NULL;
  return (PyObject *)c;
}

/* channels(): the listing is copied out of the callback (which runs without
 * the GIL) and turned into dicts afterwards. */
typedef struct chl_item {
  td_chan_info info; /* its pointers point into the fields below */
  char *name;
  td_chan_end_info *ends;
  char **end_names;
  uint64_t *slot_ids;
} chl_item;

typedef struct chl_acc {
  chl_item *items;
  size_t n, cap;
} chl_acc;

static void chl_free(chl_acc *a) {
  for (size_t i = 0; i < a->n; i++) {
    chl_item *it = &a->items[i];
    for (size_t e = 0; it->end_names && e < it->info.nends; e++)
      free(it->end_names[e]);
    free(it->end_names);
    free(it->ends);
    free(it->slot_ids);
    free(it->name);
  }
  free(a->items);
}

static int chl_cb(const td_chan_info *info, void *arg) {
  chl_acc *a = arg;
  if (a->n == a->cap) {
    size_t cap = a->cap ? 2 * a->cap : 16;
    chl_item *n = realloc(a->items, cap * sizeof(*n));
    if (n == NULL)
      return TD_ENOMEM;
    a->items = n;
    a->cap = cap;
  }
  chl_item *it = &a->items[a->n++];
  memset(it, 0, sizeof(*it));
  it->info = *info;
  it->name = strdup(info->name);
  it->ends = calloc(info->nends + 1, sizeof(*it->ends));
  it->end_names = calloc(info->nends + 1, sizeof(char *));
  it->slot_ids = calloc(info->nslot_ids + 1, sizeof(uint64_t));
  it->info.nends = 0;
  if (it->name == NULL || it->ends == NULL || it->end_names == NULL ||
      it->slot_ids == NULL)
    return TD_ENOMEM;
  it->info.name = it->name;
  it->info.ends = it->ends;
  it->info.slot_ids = it->slot_ids;
  if (info->nslot_ids > 0) /* slot_ids may be NULL when there are none */
    memcpy(it->slot_ids, info->slot_ids, info->nslot_ids * sizeof(uint64_t));
  for (size_t e = 0; e < info->nends; e++) {
    it->ends[e] = info->ends[e];
    if ((it->end_names[e] = strdup(info->ends[e].name)) == NULL)
      return TD_ENOMEM;
    it->ends[e].name = it->end_names[e];
    it->info.nends = e + 1;
  }
  return 0;
}

static PyObject *Client_channels(Client *self, PyObject *unused) {
  chl_acc a = {0};
  call x;
  int err;
  CALL(self, x, err, td_chan_list(x.c, chl_cb, &a));
  if (err < 0) {
    chl_free(&a);
    return raise_err(err, x.msg);
  }
  PyObject *list = PyList_New((Py_ssize_t)a.n);
  for (size_t i = 0; list != NULL && i < a.n; i++) {
    PyObject *d = chan_dict(&a.items[i].info, 1);
    if (d == NULL)
      Py_CLEAR(list);
    else
      PyList_SET_ITEM(list, (Py_ssize_t)i, d);
  }
  chl_free(&a);
  return list;
}

/* ---- module functions ---- */

static PyObject *mod_connect(PyObject *m, PyObject *args, PyObject *kw) {
  return PyObject_Call((PyObject *)&ClientType, args, kw);
}

static PyObject *mod_watch(PyObject *m, PyObject *args, PyObject *kw) {
  return PyObject_Call((PyObject *)&WatchType, args, kw);
}

static PyObject *mod_find(PyObject *m, PyObject *arg) {
  void *ptr = PyLong_AsVoidPtr(arg);
  if (ptr == NULL && PyErr_Occurred())
    return NULL;
  store *hit = NULL;
  char *p = ptr;
  pthread_mutex_lock(&g_reg_mu);
  for (store *s = g_stores; s != NULL; s = s->next)
    if (!s->cuda && !store_gone(s) && p >= s->base && p < s->base + s->len &&
        (hit = store_revive(s)) != NULL)
      break;
  pthread_mutex_unlock(&g_reg_mu);
  if (hit == NULL)
    Py_RETURN_NONE;
  int64_t off = p - hit->base, n = (int64_t)hit->len;
  td_view v;
  td_view_contiguous(TD_UINT8, 1, &n, &v);
  PyObject *t = tensor_new(hit, &v, NULL, NULL);
  if (t == NULL)
    return NULL;
  return Py_BuildValue("(NL)", t, (long long)off);
}

static PyObject *mod_dtype_size(PyObject *m, PyObject *arg) {
  td_dtype d;
  if (parse_dtype(arg, &d) < 0)
    return NULL;
  return PyLong_FromSize_t(td_dtype_size(d));
}

static PyObject *mod_dtype_name(PyObject *m, PyObject *arg) {
  td_dtype d;
  if (parse_dtype(arg, &d) < 0)
    return NULL;
  return PyUnicode_FromString(td_dtype_name(d));
}

static PyObject *mod_default_socket_path(PyObject *m, PyObject *unused) {
  char buf[4096];
  int err = td_default_socket_path(buf, sizeof(buf));
  if (err < 0)
    return raise_err(err, td_last_error(NULL));
  return PyUnicode_DecodeFSDefault(buf);
}

static PyMethodDef module_methods[] = {
    {"connect", (PyCFunction)(void (*)(void))mod_connect,
     METH_VARARGS | METH_KEYWORDS,
     "connect(path=None, name=None) -> Client (None: $TENSORD_SOCKET, "
     "$XDG_RUNTIME_DIR/tensord.sock, /tmp/tensord-<uid>/tensord.sock)"},
    {"find", (PyCFunction)mod_find, METH_O,
     "find(ptr) -> (Tensor, offset) | None: the storage this process maps "
     "at address ptr, as a uint8 Tensor of the whole storage holding its own "
     "reference, and ptr's byte offset in it."},
    {"watch", (PyCFunction)(void (*)(void))mod_watch,
     METH_VARARGS | METH_KEYWORDS,
     "watch(prefix='', path=None) -> Watch: the daemon's events whose key "
     "begins with prefix, on a connection of its own to the daemon at path "
     "(None: the default socket path)."},
    {"dtype_size", (PyCFunction)mod_dtype_size, METH_O,
     "dtype_size(dtype) -> int"},
    {"dtype_name", (PyCFunction)mod_dtype_name, METH_O,
     "dtype_name(dtype) -> str: torch's name of any dtype spelling"},
    {"default_socket_path", (PyCFunction)mod_default_socket_path, METH_NOARGS,
     "default_socket_path() -> str"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "tensord._tensord",
    .m_doc =
        "The C core of the tensord package (see tensord's docs/python.md).",
    .m_size = -1,
    .m_methods = module_methods,
};

/* Makes exception class name under base with the code/name/message
 * attributes defaulting to None, and adds it to m. */
static PyObject *add_error(PyObject *m, const char *name, PyObject *base,
                           const char *doc) {
  char full[64];
  snprintf(full, sizeof(full), "tensord.%s", name);
  PyObject *dict = Py_BuildValue("{s:O,s:O,s:O}", "code", Py_None, "name",
                                 Py_None, "message", Py_None);
  if (dict == NULL)
    return NULL;
  PyObject *cls = PyErr_NewExceptionWithDoc(full, doc, base, dict);
  Py_DECREF(dict);
  if (cls == NULL || PyModule_AddObjectRef(m, name, cls) < 0) {
    Py_XDECREF(cls);
    return NULL;
  }
  return cls;
}

/* BrokenPipe (TD_EPIPE: the other side of a channel has all left) is a
 * Closed, as EPIPE always was here, and a builtin BrokenPipeError. */
static PyObject *add_broken_pipe(PyObject *m) {
  PyObject *bases = PyTuple_Pack(2, Closed, PyExc_BrokenPipeError);
  if (bases == NULL)
    return NULL;
  PyObject *cls = add_error(m, "BrokenPipe", bases,
                            "TD_EPIPE: every end on the other side of a "
                            "channel has left (Closed, BrokenPipeError)");
  Py_DECREF(bases);
  return cls;
}

PyMODINIT_FUNC PyInit__tensord(void) {
  if (PyType_Ready(&ClientType) < 0 || PyType_Ready(&TensorType) < 0 ||
      PyType_Ready(&ExporterType) < 0 || PyType_Ready(&WatchType) < 0 ||
      PyType_Ready(&ChannelType) < 0)
    return NULL;
  if (WatchEventType == NULL &&
      (WatchEventType = PyStructSequence_NewType(&event_desc)) == NULL)
    return NULL;
  PyObject *m = PyModule_Create(&module);
  if (m == NULL)
    return NULL;
  if (!(Error = add_error(m, "Error", PyExc_Exception,
                          "A libtensord call failed: .code (negative TD_E*), "
                          ".name ('ENOENT'), .message")) ||
      !(NotFound = add_error(m, "NotFound", Error, "TD_ENOENT")) ||
      !(Timeout = add_error(m, "Timeout", Error, "TD_ETIMEDOUT")) ||
      !(PermissionDenied =
            add_error(m, "PermissionDenied", Error, "TD_EACCES, TD_EPERM")) ||
      !(OutOfMemory =
            add_error(m, "OutOfMemory", Error, "TD_ENOMEM, TD_ENOSPC")) ||
      !(QuotaExceeded = add_error(m, "QuotaExceeded", Error, "TD_EDQUOT")) ||
      !(Closed = add_error(m, "Closed", Error,
                           "TD_ENOTCONN, TD_ECONNRESET, TD_EPIPE")) ||
      !(Exists = add_error(m, "Exists", Error, "TD_EEXIST")) ||
      !(BrokenPipe = add_broken_pipe(m))) {
    Py_DECREF(m);
    return NULL;
  }
  if (PyModule_AddObjectRef(m, "Client", (PyObject *)&ClientType) < 0 ||
      PyModule_AddObjectRef(m, "Tensor", (PyObject *)&TensorType) < 0 ||
      PyModule_AddObjectRef(m, "Watch", (PyObject *)&WatchType) < 0 ||
      PyModule_AddObjectRef(m, "Channel", (PyObject *)&ChannelType) < 0 ||
      PyModule_AddObjectRef(m, "WatchEvent", (PyObject *)WatchEventType) < 0 ||
      PyModule_AddStringConstant(m, "libtensord_version", td_version_string()) <
          0 ||
      PyModule_AddIntConstant(m, "SLICE_MS", SLICE_MS) < 0 ||
      PyModule_AddIntConstant(m, "KEY_MAX", TD_KEY_MAX) < 0) {
    Py_DECREF(m);
    return NULL;
  }
  static int atfork_done;
  if (!atfork_done) {
    pthread_atfork(NULL, NULL, atfork_child);
    atfork_done = 1;
  }
  return m;
}
