/* What tests that write files share: removing a directory tree they made. */
#ifndef PS_TESTS_TMP_TREE_H
#define PS_TESTS_TMP_TREE_H

#include <dirent.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Removes path and everything below it (symbolic links are removed, not
 * followed); what cannot be removed stays. */
static inline void remove_tree(const char *path) {
  DIR *dir = opendir(path);
  if (!dir) return;
  struct dirent *e;
  char sub[PATH_MAX];
  while ((e = readdir(dir)) != NULL) {
    if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
    int len = snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
    if (len < 0 || (size_t)len >= sizeof sub) continue; /* too long: left */
    struct stat st;
    if (lstat(sub, &st) == 0 && S_ISDIR(st.st_mode))
      remove_tree(sub);
    else
      unlink(sub);
  }
  closedir(dir);
  rmdir(path);
}

#endif
