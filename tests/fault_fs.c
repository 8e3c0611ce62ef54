/* A fault-injecting file system layer for tests (tests/test_faults.py), loaded with LD_PRELOAD:
 * every write through libc (CPython's files, tensorstore's checkpoint arrays, TensorFlow's
 * files) to a file whose path contains a rule's pattern is counted, and the calls numbered
 * first .. first + count - 1 (from 0; count -1: all from first) fail with the rule's errno,
 * writing nothing: a remote file system that times out or drops a connection.
 *
 * Rules come from FAULT_FS ("pattern:errno:first:count;..."), read at start-up, or are set
 * later from the process itself: fault_fs_arm(rules) through ctypes. fault_fs_failed() is the
 * number of calls failed so far.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#define MAX_RULES 4
#define MAX_FDS 65536

struct rule {
  char pattern[512];
  int error, first, count, seen;
};

static struct rule rules[MAX_RULES];
static int num_rules, failed;
static signed char rule_of[MAX_FDS]; /* fd -> rule index + 1, 0: none */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

int fault_fs_arm(const char *spec) {
  pthread_mutex_lock(&lock);
  num_rules = 0;
  char copy[4096];
  snprintf(copy, sizeof copy, "%s", spec ? spec : "");
  char *save = NULL;
  for (char *item = strtok_r(copy, ";", &save); item && num_rules < MAX_RULES;
       item = strtok_r(NULL, ";", &save)) {
    struct rule *r = &rules[num_rules];
    char pattern[512];
    if (sscanf(item, "%511[^:]:%d:%d:%d", pattern, &r->error, &r->first, &r->count) == 4) {
      snprintf(r->pattern, sizeof r->pattern, "%s", pattern);
      r->seen = 0;
      num_rules++;
    }
  }
  memset(rule_of, 0, sizeof rule_of); /* files opened before keep writing */
  pthread_mutex_unlock(&lock);
  return num_rules;
}

int fault_fs_failed(void) { return failed; }

__attribute__((constructor)) static void init(void) { fault_fs_arm(getenv("FAULT_FS")); }

static void opened(int fd, const char *path) {
  if (fd < 0 || fd >= MAX_FDS || !path) return;
  pthread_mutex_lock(&lock);
  rule_of[fd] = 0;
  for (int i = 0; i < num_rules; i++)
    if (strstr(path, rules[i].pattern)) {
      rule_of[fd] = (signed char)(i + 1);
      break;
    }
  pthread_mutex_unlock(&lock);
}

/* Whether this write to `fd` fails (errno set). */
static int inject(int fd) {
  if (fd < 0 || fd >= MAX_FDS || !rule_of[fd]) return 0;
  pthread_mutex_lock(&lock);
  int hit = 0;
  if (rule_of[fd]) {
    struct rule *r = &rules[rule_of[fd] - 1];
    int n = r->seen++;
    hit = n >= r->first && (r->count < 0 || n < r->first + r->count);
    if (hit) {
      failed++;
      errno = r->error;
    }
  }
  pthread_mutex_unlock(&lock);
  return hit;
}

/* real_<name>: libc's function, which this layer's <name> wraps. */
#define REAL(name) static __typeof__(&name) real_##name; \
  if (!real_##name) real_##name = dlsym(RTLD_NEXT, #name)

static mode_t mode_of(int flags, va_list args) {
  return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(args, int) : 0;
}

int open(const char *path, int flags, ...) {
  REAL(open);
  va_list args;
  va_start(args, flags);
  mode_t mode = mode_of(flags, args);
  va_end(args);
  int fd = real_open(path, flags, mode);
  opened(fd, path);
  return fd;
}

int open64(const char *path, int flags, ...) {
  REAL(open64);
  va_list args;
  va_start(args, flags);
  mode_t mode = mode_of(flags, args);
  va_end(args);
  int fd = real_open64(path, flags, mode);
  opened(fd, path);
  return fd;
}

int openat(int dir, const char *path, int flags, ...) {
  REAL(openat);
  va_list args;
  va_start(args, flags);
  mode_t mode = mode_of(flags, args);
  va_end(args);
  int fd = real_openat(dir, path, flags, mode);
  opened(fd, path);
  return fd;
}

int openat64(int dir, const char *path, int flags, ...) {
  REAL(openat64);
  va_list args;
  va_start(args, flags);
  mode_t mode = mode_of(flags, args);
  va_end(args);
  int fd = real_openat64(dir, path, flags, mode);
  opened(fd, path);
  return fd;
}

ssize_t write(int fd, const void *buf, size_t n) {
  REAL(write);
  return inject(fd) ? -1 : real_write(fd, buf, n);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t offset) {
  REAL(pwrite);
  return inject(fd) ? -1 : real_pwrite(fd, buf, n, offset);
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t offset) {
  REAL(pwrite64);
  return inject(fd) ? -1 : real_pwrite64(fd, buf, n, offset);
}

ssize_t writev(int fd, const struct iovec *iov, int n) {
  REAL(writev);
  return inject(fd) ? -1 : real_writev(fd, iov, n);
}

ssize_t pwritev(int fd, const struct iovec *iov, int n, off_t offset) {
  REAL(pwritev);
  return inject(fd) ? -1 : real_pwritev(fd, iov, n, offset);
}
