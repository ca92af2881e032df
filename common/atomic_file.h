/* Files replaced atomically: written to a temporary file next to the
 * target, synced, renamed over it, and the directory synced. A reader sees
 * the old file or the whole new one; on any error the target is as it was
 * and the temporary file is gone. */
#ifndef PS_COMMON_ATOMIC_FILE_H
#define PS_COMMON_ATOMIC_FILE_H

#include <limits.h>
#include <stddef.h>

typedef struct {
  int fd;
  int error;                /* the first write's errno, 0 if none */
  char path[PATH_MAX];      /* the target (a symbolic link's target) */
  char tmp[PATH_MAX + 40];  /* the temporary file */
  const char *shown;        /* the target as the caller named it */
} ps_atomic_file;

/* Creates the temporary file for path. Refuses a directory or a path that
 * exists and is not a regular file. 0, or an error with a message. */
int ps_atomic_open(ps_atomic_file *f, const char *path, char *err);

/* Appends; a failure is kept and reported by ps_atomic_commit. */
void ps_atomic_write(ps_atomic_file *f, const void *data, size_t len);

/* Syncs, closes and renames over the target, then syncs the directory.
 * On error (including an earlier write's) the temporary file is removed. */
int ps_atomic_commit(ps_atomic_file *f, char *err);

/* Gives up: closes and removes the temporary file. */
void ps_atomic_abort(ps_atomic_file *f);

/* The whole of data as path's new content. */
int ps_write_file_atomic(const char *path, const void *data, size_t len, char *err);

#endif
