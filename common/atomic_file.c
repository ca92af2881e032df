/* Atomic file replacement; see atomic_file.h. */
#define _GNU_SOURCE
#include "atomic_file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util.h"

static int sync_dir_of(const char *path, const char *shown, char *err) {
  const char *slash = strrchr(path, '/');
  char dir[PATH_MAX];
  if (!slash)
    snprintf(dir, sizeof dir, ".");
  else if (slash == path)
    snprintf(dir, sizeof dir, "/");
  else
    snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return ps_seterr(err, PS_EIO, "wrote '%.200s' but cannot open its directory to sync it: %s",
                     shown, strerror(errno));
  int rc = 0;
  if (fsync(fd) != 0 && errno != EINVAL) /* some file systems cannot sync a directory */
    rc = ps_seterr(err, PS_EIO, "wrote '%.200s' but cannot sync its directory: %s", shown,
                   strerror(errno));
  close(fd);
  return rc;
}

int ps_atomic_open(ps_atomic_file *f, const char *path, char *err) {
  memset(f, 0, sizeof *f);
  f->fd = -1;
  f->shown = path;
  struct stat st;
  if (!path[0]) return ps_seterr(err, PS_EINVAL, "the file name is empty");
  if (stat(path, &st) == 0) {
    if (S_ISDIR(st.st_mode))
      return ps_seterr(err, PS_EINVAL, "'%.200s' is a directory: name the file to write", path);
    if (!S_ISREG(st.st_mode))
      return ps_seterr(err, PS_EINVAL, "'%.200s' exists and is not a regular file", path);
  }
  /* Replace what a symbolic link names, not the link. */
  if (!realpath(path, f->path)) {
    if (strlen(path) >= sizeof f->path)
      return ps_seterr(err, PS_EINVAL, "the path '%.200s' is too long", path);
    snprintf(f->path, sizeof f->path, "%s", path);
  }
  const char *slash = strrchr(f->path, '/');
  int dir_len = slash ? (int)(slash - f->path + 1) : 0;
  int n = snprintf(f->tmp, sizeof f->tmp, "%.*s.%s.tmp-%ld", dir_len, f->path, f->path + dir_len,
                   (long)getpid());
  if (n < 0 || (size_t)n >= sizeof f->tmp)
    return ps_seterr(err, PS_EINVAL, "the path '%.200s' is too long", path);
  /* The name holds this process's id: a file there is a dead process's. */
  f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0666);
  if (f->fd < 0) {
    int e = errno;
    if (dir_len > 0)
      return ps_seterr(err, PS_EIO, "cannot create a file in '%.*s': %s", dir_len - 1, f->path,
                       strerror(e));
    return ps_seterr(err, PS_EIO, "cannot create '%.200s': %s", f->tmp, strerror(e));
  }
  return 0;
}

void ps_atomic_write(ps_atomic_file *f, const void *data, size_t len) {
  const char *p = data;
  while (len > 0 && !f->error) {
    ssize_t w = write(f->fd, p, len);
    if (w < 0) {
      if (errno == EINTR) continue;
      f->error = errno;
      break;
    }
    p += w;
    len -= (size_t)w;
  }
}

void ps_atomic_abort(ps_atomic_file *f) {
  if (f->fd >= 0) {
    close(f->fd);
    unlink(f->tmp);
  }
  f->fd = -1;
}

int ps_atomic_commit(ps_atomic_file *f, char *err) {
  int e = f->error;
  const char *what = "write";
  if (!e && fsync(f->fd) != 0) e = errno, what = "sync";
  if (close(f->fd) != 0 && !e) e = errno, what = "close";
  f->fd = -1;
  if (!e && rename(f->tmp, f->path) != 0) e = errno, what = "rename the new file to";
  if (e) {
    unlink(f->tmp);
    int renaming = !strcmp(what, "rename the new file to");
    return ps_seterr(err, PS_EIO,
                     "cannot %s '%.200s': %s (the temporary file is removed; '%.200s' is as it "
                     "was)",
                     what, renaming ? f->shown : f->tmp, strerror(e), f->shown);
  }
  return sync_dir_of(f->path, f->shown, err);
}

int ps_write_file_atomic(const char *path, const void *data, size_t len, char *err) {
  ps_atomic_file f;
  int rc = ps_atomic_open(&f, path, err);
  if (rc) return rc;
  ps_atomic_write(&f, data, len);
  return ps_atomic_commit(&f, err);
}
