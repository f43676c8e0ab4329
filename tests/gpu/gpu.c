/* gpu.c: the real-GPU probe and the forked child's context (gpu.h). */
#include "gpu.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int gpu_probe(char *msg, size_t len) {
  const char *dbl = getenv("TENSORD_CUDA_DRIVER");
  if (dbl != NULL && dbl[0] != '\0') {
    snprintf(msg, len,
             "TENSORD_CUDA_DRIVER=%s names a driver stand-in: the gpu "
             "checks need the real driver and a GPU",
             dbl);
    return 0;
  }
  int p[2];
  if (pipe(p) < 0) {
    snprintf(msg, len, "pipe: %s", strerror(errno));
    return 0;
  }
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    snprintf(msg, len, "fork: %s", strerror(errno));
    close(p[0]);
    close(p[1]);
    return 0;
  }
  if (pid == 0) {
    char why[512] = "";
    int ok = 0;
    close(p[0]);
    const td__cu *cu = td__cu_load(why, sizeof(why));
    if (cu != NULL) {
      int n = 0;
      CUresult r = cu->DeviceGetCount(&n);
      if (r != CUDA_SUCCESS) {
        char e[256];
        snprintf(why, sizeof(why), "cuDeviceGetCount: %s",
                 td__cu_strerror(cu, r, e, sizeof(e)));
      } else if (n < 1) {
        snprintf(why, sizeof(why), "the CUDA driver sees no device");
      } else {
        ok = 1;
        snprintf(why, sizeof(why), "%d device(s)", n);
      }
    }
    size_t wl = strlen(why);
    if (write(p[1], why, wl) != (ssize_t)wl)
      _exit(2);
    _exit(ok ? 0 : 1);
  }
  close(p[1]);
  size_t got = 0;
  ssize_t n;
  while (got + 1 < len && (n = read(p[0], msg + got, len - 1 - got)) != 0) {
    if (n < 0) {
      if (errno == EINTR)
        continue;
      break;
    }
    got += (size_t)n;
  }
  msg[got] = '\0';
  close(p[0]);
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR)
    ;
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0)
    return 1;
  if (got == 0)
    snprintf(msg, len, "the probe child failed (status 0x%x)", st);
  return 0;
}

int gpu_ok(const td__cu *cu, CUresult r, const char *what) {
  if (r == CUDA_SUCCESS)
    return 1;
  char e[256];
  fprintf(stderr, "%s: %s\n", what, td__cu_strerror(cu, r, e, sizeof(e)));
  return 0;
}

const td__cu *gpu_enter(const unsigned char *uuid, CUdevice *dev) {
  char why[512];
  const td__cu *cu = td__cu_load(why, sizeof(why));
  if (cu == NULL) {
    fprintf(stderr, "td__cu_load: %s\n", why);
    return NULL;
  }
  CUdevice d = 0;
  if (uuid != NULL) {
    if (td__cu_device_by_uuid(cu, uuid, &d) < 0) {
      char s[48];
      fprintf(stderr, "this process sees no GPU %s\n",
              td__cu_uuid_str(uuid, s, sizeof(s)));
      return NULL;
    }
  } else if (!gpu_ok(cu, cu->DeviceGet(&d, 0), "cuDeviceGet(0)")) {
    return NULL;
  }
  CUcontext ctx = NULL;
  if (!gpu_ok(cu, cu->DevicePrimaryCtxRetain(&ctx, d),
              "cuDevicePrimaryCtxRetain") ||
      !gpu_ok(cu, cu->CtxPushCurrent(ctx), "cuCtxPushCurrent"))
    return NULL;
  if (dev != NULL)
    *dev = d;
  return cu;
}
