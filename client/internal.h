/* internal.h: libtensord's private declarations, shared with the daemon where
 * both need the same rule. */
#ifndef TD_CLIENT_INTERNAL_H
#define TD_CLIENT_INTERNAL_H

#include "tensord.h"

#include <stddef.h>
#include <stdint.h>

/* Formats fmt into msg (if not NULL and len > 0) and returns err. */
int td__msg(char *msg, size_t len, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* td_view_check that also says why, naming the dimension and values. */
int td__view_check_msg(const td_view *v, size_t nbytes, char *msg, size_t len);

/* cache.c: the process's mappings, one per (daemon, storage, mode). */
typedef struct td__mapping td__mapping;
/* Finds the process's mapping of the storage, or maps fd (nbytes, shared,
 * read-only or read-write) if there is none. Adds one handle to it. Always
 * closes fd (when >= 0). Returns 0, TD_ENOENT if there is no mapping and fd
 * is -1, or the mmap error. */
int td__map_acquire(uint64_t instance, uint64_t id, int readonly, size_t nbytes,
                    int fd, td__mapping **out);
/* Drops one handle; the last unmaps. NULL ok. */
void td__map_release(td__mapping *m);
void *td__map_addr(const td__mapping *m);
/* Mappings the process has now (for tests). */
size_t td__map_count(void);

#endif /* TD_CLIENT_INTERNAL_H */
