/* prog.c: a program built against an installed libtensord; needs no daemon.
 * Usage: prog SOCKET, where nobody listens on SOCKET. */
#include <tensord.h>

#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
  if (argc != 2)
    return 2;
  if (td_version() != TD_VERSION_HEX ||
      strcmp(td_version_string(), TD_VERSION_STRING) != 0) {
    fprintf(stderr, "built against %s, runs with %s\n", TD_VERSION_STRING,
            td_version_string());
    return 1;
  }
  int64_t shape[2] = {4, 3};
  td_view v;
  char buf[128];
  if (td_view_contiguous(TD_FLOAT32, 2, shape, &v) != 0 ||
      td_view_transpose(&v, 0, 1) != 0 || td_view_is_contiguous(&v) != 0 ||
      td_view_numel(&v) != 12 || td_view_check(&v, 48) != 0 ||
      td_view_check(&v, 47) != TD_ERANGE) {
    fprintf(stderr, "view algebra: %s\n", td_view_last_error());
    return 1;
  }
  td_view_format(&v, buf, sizeof(buf));
  /* Pulls the client code (and with it protobuf-c) into a static link. */
  td_client *c = NULL;
  int err = td_connect(argv[1], &c);
  if (err >= 0 || c != NULL) {
    fprintf(stderr, "td_connect(%s) succeeded\n", argv[1]);
    return 1;
  }
  printf("libtensord %s: %s; connect: %s (%s)\n", td_version_string(), buf,
         td_err_name(err), td_strerror(err));
  return 0;
}
