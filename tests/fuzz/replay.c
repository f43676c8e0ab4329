/* replay.c: runs fuzz_request's LLVMFuzzerTestOneInput over files, without
 * libFuzzer: ctest replays the seed corpus and every crash the fuzzer found
 * (tests/fuzz/regressions). Arguments are files or directories (their
 * files, in name order, skipping dot files). A failed check aborts; a
 * target that must clean up after a crash is replayed in a child (see
 * td_fuzz_replay_cleanup). */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) {
    perror(path);
    return -1;
  }
  uint8_t *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len == cap) {
      cap = cap ? cap * 2 : 4096;
      uint8_t *p = realloc(buf, cap);
      if (p == NULL) {
        fprintf(stderr, "%s: out of memory\n", path);
        free(buf);
        fclose(f);
        return -1;
      }
      buf = p;
    }
    size_t n = fread(buf + len, 1, cap - len, f);
    if (n == 0)
      break;
    len += n;
  }
  int bad = ferror(f);
  fclose(f);
  if (bad) {
    perror(path);
    free(buf);
    return -1;
  }
  printf("replay %s (%zu bytes)\n", path, len);
  fflush(stdout);
  LLVMFuzzerTestOneInput(buf, len);
  free(buf);
  return 0;
}

static int by_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Replays every file of dir; returns how many, or -1. */
static int replay_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (d == NULL) {
    perror(dir);
    return -1;
  }
  char **names = NULL;
  size_t n = 0, cap = 0;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.')
      continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 64;
      char **p = realloc(names, cap * sizeof(*p));
      if (p == NULL)
        break;
      names = p;
    }
    size_t len = strlen(dir) + strlen(e->d_name) + 2;
    if ((names[n] = malloc(len)) == NULL)
      break;
    snprintf(names[n++], len, "%s/%s", dir, e->d_name);
  }
  closedir(d);
  qsort(names, n, sizeof(*names), by_name);
  int count = 0;
  for (size_t i = 0; i < n; i++) {
    struct stat st;
    if (stat(names[i], &st) == 0 && S_ISREG(st.st_mode)) {
      if (replay_file(names[i]) < 0)
        count = -1;
      else if (count >= 0)
        count++;
    }
    free(names[i]);
  }
  free(names);
  return count;
}

/* A target that leaves files named after its process (fuzz_state's private
 * /dev/shm) defines this: replay then runs the inputs in a child and calls
 * it with the child's pid once the child has ended, however it ended. */
void td_fuzz_replay_cleanup(pid_t child) __attribute__((weak));

static int replay_all(int argc, char **argv) {
  int total = 0, failed = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    int n;
    if (stat(argv[i], &st) == 0 && S_ISDIR(st.st_mode))
      n = replay_dir(argv[i]);
    else
      n = replay_file(argv[i]) < 0 ? -1 : 1;
    if (n < 0)
      failed = 1;
    else
      total += n;
  }
  printf("replayed %d input(s)%s\n", total, failed ? "; some unreadable" : "");
  return failed;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s FILE|DIR...\n", argv[0]);
    return 2;
  }
  if (td_fuzz_replay_cleanup == NULL)
    return replay_all(argc, argv);
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) {
    perror("fork");
    return 1;
  }
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    _exit(replay_all(argc, argv));
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) {
      perror("waitpid");
      return 1;
    }
  td_fuzz_replay_cleanup(pid);
  if (WIFSIGNALED(status)) {
    fprintf(stderr, "replay: killed by signal %d (%s)\n", WTERMSIG(status),
            strsignal(WTERMSIG(status)));
    return 128 + WTERMSIG(status);
  }
  return WEXITSTATUS(status);
}
