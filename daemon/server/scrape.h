/* scrape.h: tensord --metrics PATH|ADDR: the metrics text over minimal
 * HTTP/1.x on a Unix socket or a loopback TCP port, for a scraper. */
#ifndef TD_DAEMON_SCRAPE_H
#define TD_DAEMON_SCRAPE_H

#include <stddef.h>
#include <uv.h>

typedef struct td__server td__server;
typedef struct td__scraper td__scraper; /* scrape.c: one connection */

/* At most this many scrapers are served at once. One more displaces the
 * oldest of those that have not sent a request (scrape.c, displaced), or is
 * closed at once while all of them are being answered. */
#define TD__SCRAPERS_MAX 16
/* A request head longer than this is refused (431). */
#define TD__SCRAPE_HEAD_MAX 4096

/* The endpoint, all of its state: the listening handle (whose fd
 * uv_fileno gives), its address, and the scrapers being served. */
typedef struct td__scrape {
  td__server *srv;
  int tcp; /* 0: a Unix socket at path; 1: TCP */
  union {
    uv_handle_t handle;
    uv_stream_t stream;
    uv_pipe_t pipe;
    uv_tcp_t tcp;
  } listen;
  int open;            /* listen is initialised: close it at the stop */
  char path[108];      /* Unix: the socket, unlinked at the stop */
  char where[128];     /* for logs: the path or host:port bound */
  uint64_t timeout_ms; /* a scraper's whole exchange, at most */
  td__scraper *scrapers;
  unsigned nscrapers;
  uint64_t crowd_ms;  /* loop time a crowd was last logged (once a minute) */
  uint64_t displaced; /* scrapers closed for newcomers since */
  uint64_t refused;   /* newcomers closed since, all being answered */
} td__scrape;

/* Parses ADDR, a TCP address on the loopback: 127.x.y.z:PORT, [::1]:PORT
 * or localhost:PORT (PORT 0: any free port). Sets *ss (an IPv4 or IPv6
 * address) and returns 0, or TD_EINVAL with msg saying why. A spec
 * containing '/' is a Unix socket's path, not an ADDR. */
int td__scrape_parse(const char *addr, struct sockaddr_storage *ss, char *msg,
                     size_t len);
/* Listens on spec (a path if it contains '/', else an ADDR), Unix sockets
 * with mode (-1: 0600). Returns 0, or a negative code (logged) with
 * nothing left open. */
int td__scrape_open(td__scrape *sc, td__server *srv, const char *spec, int mode,
                    uint64_t timeout_ms);
/* Serves on fd, the listening socket of the endpoint a live upgrade handed
 * over (a TCP one if tcp; a Unix one at path otherwise), as
 * td__scrape_open would have set it up. Takes ownership of fd. Returns 0,
 * or a negative code (logged): then fd is closed and there is no endpoint
 * (the path is left in place for the next start to clear). */
int td__scrape_adopt(td__scrape *sc, td__server *srv, int fd, int tcp,
                     const char *path, const char *where, uint64_t timeout_ms);
/* Stops listening, unlinks the Unix socket and closes every scraper; their
 * memory goes in their close callbacks. sc->open unset: nothing. */
void td__scrape_close(td__scrape *sc);

#endif /* TD_DAEMON_SCRAPE_H */
