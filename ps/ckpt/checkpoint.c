/* Shard checkpoints and the .npy export; the format is in checkpoint.h.
 *
 * Writing goes through a temporary file in the same directory (so that the
 * rename is atomic) and the bytes are summed as they go out; reading sums
 * them as they come in, straight into the arrays handed back, so that a
 * checkpoint of hundreds of MB is never held twice in memory. */
#include "ps/ckpt/checkpoint.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/crc32c.h"

static const uint8_t CKPT_MAGIC[8] = {'P', 'S', 'C', 'K', 'P', 'T', 0, 1};

/* Header field offsets (see the table in checkpoint.h). */
enum {
  H_MAGIC = 0,
  H_FORMAT = 8,
  H_HEADER_BYTES = 12,
  H_INDEX = 16,
  H_NUM_SHARDS = 20,
  H_P = 24,
  H_BEGIN = 32,
  H_END = 40,
  H_VERSION = 48,
  H_WRITTEN_MS = 56,
  H_N_SLOTS = 64,
  H_TABLES_CRC = 68,
  H_EXTRA_LEN = 72,
  H_OPTIMIZER = 80,
  H_JOB_ID = 96,
  H_SET_ID = 160,
  H_CUT_LEN = 168,
  H_CUT_CRC = 176,
  H_TABLES_LEN = 180,
  H_HEADER_CRC = 188,
};
_Static_assert(H_JOB_ID + 64 <= H_SET_ID && H_CUT_CRC + 4 <= H_TABLES_LEN &&
                   H_TABLES_LEN + 8 == H_HEADER_CRC && H_HEADER_CRC + 4 == PS_CKPT_HEADER_BYTES,
               "header fields must fit before the header checksum");
_Static_assert(sizeof(((ps_ckpt_meta *)0)->optimizer) == 16 &&
                   sizeof(((ps_ckpt_meta *)0)->job_id) == 64,
               "the name fields of the header have these widths");

/* Arrays are summed and moved in pieces of this size, each still in cache
 * when the checksum reads it. */
#define IO_CHUNK ((size_t)4 << 20)

/* ---------------------------------------------------------------- files */

/* 0 or an errno value. */
static int write_all(int fd, const void *buf, size_t len) {
  const uint8_t *p = buf;
  while (len > 0) {
    ssize_t w = write(fd, p, len);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (w == 0) return EIO;
    p += w;
    len -= (size_t)w;
  }
  return 0;
}

/* Bytes read (short only at end of file), or -1 with errno. */
static ssize_t read_all(int fd, void *buf, size_t len) {
  uint8_t *p = buf;
  size_t got = 0;
  while (got < len) {
    ssize_t r = read(fd, p + got, len - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -1;
    }
    if (r == 0) break;
    got += (size_t)r;
  }
  return (ssize_t)got;
}

/* Sums and writes len bytes in pieces. 0 or an errno value. */
static int write_summed(int fd, const void *buf, size_t len, uint32_t *crc) {
  const uint8_t *p = buf;
  while (len > 0) {
    size_t k = len < IO_CHUNK ? len : IO_CHUNK;
    *crc = ps_crc32c(*crc, p, k);
    int e = write_all(fd, p, k);
    if (e) return e;
    p += k;
    len -= k;
  }
  return 0;
}

/* Reads exactly len bytes into buf, summing them. 0, or -1 with errno set
 * (0 for an early end of file). */
static int read_summed(int fd, void *buf, size_t len, uint32_t *crc) {
  uint8_t *p = buf;
  while (len > 0) {
    size_t k = len < IO_CHUNK ? len : IO_CHUNK;
    ssize_t r = read_all(fd, p, k);
    if (r < 0) return -1;
    if ((size_t)r < k) {
      errno = 0;
      return -1;
    }
    *crc = ps_crc32c(*crc, p, k);
    p += k;
    len -= k;
  }
  return 0;
}

/* dir + "/" + name into out (PS_CKPT_PATHLEN); PS_EINVAL if too long. */
static int join_path(char *out, const char *dir, const char *name, char *err) {
  int n = snprintf(out, PS_CKPT_PATHLEN, "%s/%s", dir, name);
  if (n < 0 || n >= PS_CKPT_PATHLEN)
    return ps_seterr(err, PS_EINVAL, "path '%s/%s' is too long", dir, name);
  return PS_OK;
}

static int fsync_dir(const char *dir, char *err) {
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    return ps_seterr(err, PS_EIO, "cannot open directory '%s' to sync it: %s", dir,
                     strerror(errno));
  int rc = PS_OK;
  if (fsync(fd) != 0 && errno != EINVAL) /* some file systems cannot sync a directory */
    rc = ps_seterr(err, PS_EIO, "cannot sync directory '%s': %s", dir, strerror(errno));
  close(fd);
  return rc;
}

/* Locks a temporary file just created as fd at path, for as long as fd is
 * open: 0, or -1 when a cleaner (ps_ckpt_remove_stale_temps) holds the
 * lock or has removed the name since (the file is then not ours to use).
 * File systems without flock are written to unlocked. */
static int temp_lock(int fd, const char *path) {
  if (flock(fd, LOCK_EX | LOCK_NB) != 0) return errno == EWOULDBLOCK ? -1 : 0;
  struct stat a, b;
  if (fstat(fd, &a) != 0 || lstat(path, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino)
    return -1;
  return 0;
}

/* Creates a new, empty temporary file next to final_path:
 * "<dir>/.<name>.tmp-<pid>-<nonce>", mode 0666 less the umask, and takes an
 * exclusive flock on it, held until the descriptor is closed (by the
 * process's death too): ps_ckpt_remove_stale_temps removes only temporary
 * files whose lock it can take. Returns the descriptor (name in tmp_out,
 * PS_CKPT_PATHLEN) or a negative PS_E* code. */
static int open_temp(const char *final_path, char *tmp_out, char *err) {
  const char *slash = strrchr(final_path, '/');
  int dir_len = slash ? (int)(slash - final_path + 1) : 0;
  const char *name = final_path + dir_len;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t nonce = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ (uintptr_t)&ts;
  for (int attempt = 0; attempt < 100; attempt++) {
    nonce = nonce * 6364136223846793005ull + 1442695040888963407ull;
    int n = snprintf(tmp_out, PS_CKPT_PATHLEN, "%.*s.%s.tmp-%ld-%08" PRIx32, dir_len, final_path,
                     name, (long)getpid(), (uint32_t)(nonce >> 32));
    if (n < 0 || n >= PS_CKPT_PATHLEN)
      return ps_seterr(err, PS_EINVAL, "path '%s' is too long for its temporary file", final_path);
    int fd = open(tmp_out, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) {
      if (temp_lock(fd, tmp_out) == 0) return fd;
      close(fd); /* a cleaner holds it, and removes it: another name */
      continue;
    }
    if (errno != EEXIST) {
      int e = errno;
      if (dir_len > 0)
        return ps_seterr(err, PS_EIO, "cannot create a file in '%.*s': %s", dir_len - 1, final_path,
                         strerror(e));
      return ps_seterr(err, PS_EIO, "cannot create '%s': %s", tmp_out, strerror(e));
    }
  }
  return ps_seterr(err, PS_EIO, "cannot find a free temporary name for '%s'", final_path);
}

/* Syncs and closes fd and renames tmp to final; on any failure removes tmp.
 * Always closes fd. */
static int commit_temp(int fd, const char *tmp, const char *final_path, char *err) {
  int rc = PS_OK;
  if (fsync(fd) != 0) rc = ps_seterr(err, PS_EIO, "cannot sync '%s': %s", tmp, strerror(errno));
  if (close(fd) != 0 && rc == PS_OK)
    rc = ps_seterr(err, PS_EIO, "cannot close '%s': %s", tmp, strerror(errno));
  if (rc == PS_OK && rename(tmp, final_path) != 0)
    rc = ps_seterr(err, PS_EIO, "cannot rename '%s' to '%s': %s", tmp, final_path, strerror(errno));
  if (rc != PS_OK) unlink(tmp);
  return rc;
}

/* ---------------------------------------------------------------- names */

/* Parses an unsigned decimal at *s (at least one digit, no sign, no
 * overflow), advancing *s. */
static int parse_u64(const char **s, uint64_t *out) {
  const char *p = *s;
  uint64_t v = 0;
  if (*p < '0' || *p > '9') return -1;
  for (; *p >= '0' && *p <= '9'; p++) {
    if (v > (UINT64_MAX - (uint64_t)(*p - '0')) / 10) return -1;
    v = v * 10 + (uint64_t)(*p - '0');
  }
  *s = p;
  *out = v;
  return 0;
}

static int skip_literal(const char **s, const char *lit) {
  size_t n = strlen(lit);
  if (strncmp(*s, lit, n) != 0) return -1;
  *s += n;
  return 0;
}

/* "shard-<index>-of-<S>-v<version>.ckpt" (written alone) or
 * "shard-<index>-of-<S>-v<version>-s<set>.ckpt" (a set's) exactly, with
 * index < S. */
static int parse_ckpt_name(const char *name, int *index, int *num_shards, uint64_t *version) {
  const char *p = name;
  uint64_t i, s, v, set;
  if (skip_literal(&p, "shard-") || parse_u64(&p, &i) || skip_literal(&p, "-of-") ||
      parse_u64(&p, &s) || skip_literal(&p, "-v") || parse_u64(&p, &v))
    return -1;
  if (skip_literal(&p, "-s") == 0 && (parse_u64(&p, &set) || set == 0)) return -1;
  if (skip_literal(&p, ".ckpt") || *p != '\0') return -1;
  if (s < 1 || s > INT32_MAX || i >= s) return -1;
  *index = (int)i;
  *num_shards = (int)s;
  *version = v;
  return 0;
}

/* ".<checkpoint name>.tmp-<pid>-<nonce>" as open_temp names them; the
 * checkpoint name's fields and the writer's pid. */
static int parse_temp_name(const char *name, int *index, int *num_shards, uint64_t *version,
                           long *pid) {
  const char *tail = strstr(name, ".ckpt.tmp-");
  if (name[0] != '.' || !tail) return -1;
  char ckpt_name[256];
  size_t len = (size_t)(tail - name) - 1 + strlen(".ckpt");
  if (len >= sizeof ckpt_name) return -1;
  memcpy(ckpt_name, name + 1, len);
  ckpt_name[len] = '\0';
  const char *p = tail + strlen(".ckpt.tmp-");
  uint64_t pid_v;
  if (parse_ckpt_name(ckpt_name, index, num_shards, version) || parse_u64(&p, &pid_v) ||
      pid_v < 1 || pid_v > INT32_MAX || skip_literal(&p, "-"))
    return -1;
  for (int i = 0; i < 8; i++, p++)
    if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'))) return -1;
  if (*p != '\0') return -1;
  *pid = (long)pid_v;
  return 0;
}

/* ---------------------------------------------------------------- header */

static int name_field_ok(const char *s, size_t cap) { return memchr(s, '\0', cap) != NULL; }

/* Bytes after the header: extra, cut, parameters, slots, tables,
 * checksum. PS_ERANGE if that does not fit in 63 bits. */
static int body_bytes(uint64_t n, uint64_t n_slots, uint64_t extra_len, uint64_t cut_len,
                      uint64_t tables_len, uint64_t *out) {
  const uint64_t max = (uint64_t)INT64_MAX - PS_CKPT_HEADER_BYTES - 4;
  uint64_t arrays = 1 + n_slots;
  if (n > max / 4 / arrays) return PS_ERANGE;
  uint64_t b = n * 4 * arrays;
  if (cut_len > PS_CKPT_MAX_CUT || extra_len > max - b - cut_len) return PS_ERANGE;
  b += extra_len + cut_len;
  if (tables_len > max - b) return PS_ERANGE;
  *out = b + tables_len + 4;
  return PS_OK;
}

/* Checks what a writer is asked to write. */
static int check_ckpt(const ps_ckpt *ck, char *err) {
  const ps_ckpt_meta *m = &ck->meta;
  if (m->num_shards < 1 || m->index < 0 || m->index >= m->num_shards)
    return ps_seterr(err, PS_EINVAL, "checkpoint: shard index %d invalid for %d shards", m->index,
                     m->num_shards);
  if (m->begin > m->end || m->end > m->P)
    return ps_seterr(err, PS_EINVAL, "checkpoint: range [%zu, %zu) not inside [0, P=%zu)", m->begin,
                     m->end, m->P);
  if (ck->n_slots < 0 || ck->n_slots > PS_CKPT_MAX_SLOTS)
    return ps_seterr(err, PS_EINVAL, "checkpoint: %d optimizer slots, at most %d", ck->n_slots,
                     PS_CKPT_MAX_SLOTS);
  if (!name_field_ok(m->optimizer, sizeof m->optimizer) ||
      !name_field_ok(m->job_id, sizeof m->job_id) || m->job_id[0] == '\0')
    return ps_seterr(err, PS_EINVAL,
                     "checkpoint: job id (1..63 characters) or optimizer name (0..15) invalid");
  size_t n = m->end - m->begin;
  if (n > 0 && !ck->params)
    return ps_seterr(err, PS_EINVAL, "checkpoint: no parameters given for %zu values", n);
  for (int k = 0; k < ck->n_slots; k++)
    if (n > 0 && !ck->slots[k])
      return ps_seterr(err, PS_EINVAL, "checkpoint: slot %d not given", k);
  if (ck->extra_len > 0 && !ck->extra)
    return ps_seterr(err, PS_EINVAL, "checkpoint: extra blob of %zu bytes not given",
                     ck->extra_len);
  if ((ck->cut_len > 0 && !ck->cut) || ck->cut_len > PS_CKPT_MAX_CUT)
    return ps_seterr(err, PS_EINVAL, "checkpoint: cut record of %zu bytes not given or over %zu",
                     ck->cut_len, PS_CKPT_MAX_CUT);
  if (ck->tables_len > 0 && !ck->tables)
    return ps_seterr(err, PS_EINVAL, "checkpoint: tables section of %zu bytes not given",
                     ck->tables_len);
  uint64_t body;
  if (body_bytes(n, (uint64_t)ck->n_slots, ck->extra_len, ck->cut_len, ck->tables_len, &body) !=
      PS_OK)
    return ps_seterr(err, PS_ERANGE, "checkpoint: %zu values with %d slots is too large", n,
                     ck->n_slots);
  return PS_OK;
}

static void header_encode(const ps_ckpt *ck, int64_t written_ms, uint8_t *h) {
  const ps_ckpt_meta *m = &ck->meta;
  memset(h, 0, PS_CKPT_HEADER_BYTES);
  memcpy(h + H_MAGIC, CKPT_MAGIC, sizeof CKPT_MAGIC);
  /* Without rows, format 2: builds from before tables read it. */
  ps_put_le32(h + H_FORMAT, ck->tables_len ? PS_CKPT_FORMAT_VERSION : 2);
  ps_put_le32(h + H_HEADER_BYTES, PS_CKPT_HEADER_BYTES);
  ps_put_le32(h + H_INDEX, (uint32_t)m->index);
  ps_put_le32(h + H_NUM_SHARDS, (uint32_t)m->num_shards);
  ps_put_le64(h + H_P, m->P);
  ps_put_le64(h + H_BEGIN, m->begin);
  ps_put_le64(h + H_END, m->end);
  ps_put_le64(h + H_VERSION, m->version);
  ps_put_le64(h + H_WRITTEN_MS, (uint64_t)written_ms);
  ps_put_le32(h + H_N_SLOTS, (uint32_t)ck->n_slots);
  ps_put_le64(h + H_EXTRA_LEN, ck->extra_len);
  ps_put_le64(h + H_SET_ID, m->set_id);
  ps_put_le64(h + H_CUT_LEN, ck->cut_len);
  ps_put_le32(h + H_CUT_CRC, ck->cut_len ? ps_crc32c(0, ck->cut, ck->cut_len) : 0);
  ps_put_le64(h + H_TABLES_LEN, ck->tables_len);
  ps_put_le32(h + H_TABLES_CRC, ck->tables_len ? ps_crc32c(0, ck->tables, ck->tables_len) : 0);
  /* strnlen: the fields are checked to hold a NUL, the rest stays zero. */
  memcpy(h + H_OPTIMIZER, m->optimizer, strnlen(m->optimizer, 15));
  memcpy(h + H_JOB_ID, m->job_id, strnlen(m->job_id, 63));
  ps_put_le32(h + H_HEADER_CRC, ps_crc32c(0, h, H_HEADER_CRC));
}

/* Verifies a header read from path, whose file has file_size bytes (at
 * least the header's), and decodes it. */
static int header_decode(const char *path, const uint8_t *h, uint64_t file_size, ps_ckpt_meta *m,
                         int *n_slots, size_t *extra_len, char *err) {
  if (memcmp(h + H_MAGIC, CKPT_MAGIC, sizeof CKPT_MAGIC) != 0)
    return ps_seterr(err, PS_EPROTO,
                     "bad magic in '%s': not a shard checkpoint, or written by a newer version",
                     path);
  uint32_t format = ps_get_le32(h + H_FORMAT);
  uint32_t stored = ps_get_le32(h + H_HEADER_CRC), computed = ps_crc32c(0, h, H_HEADER_CRC);
  if (stored != computed) {
    if (format < 1 || format > PS_CKPT_FORMAT_VERSION)
      return ps_seterr(err, PS_EPROTO,
                       "header checksum mismatch in '%s' with format version %" PRIu32
                       " (this build reads %d): corrupt, or written by a newer version",
                       path, format, PS_CKPT_FORMAT_VERSION);
    return ps_seterr(err, PS_EINVAL,
                     "header checksum mismatch in '%s': the file is corrupt (stored 0x%08" PRIx32
                     ", computed 0x%08" PRIx32 ")",
                     path, stored, computed);
  }
  if (format < 1 || format > PS_CKPT_FORMAT_VERSION)
    return ps_seterr(err, PS_EPROTO,
                     "'%s' has checkpoint format version %" PRIu32
                     ", this build reads %d: written by a newer version",
                     path, format, PS_CKPT_FORMAT_VERSION);
  /* From here on the header is as its writer made it; an inconsistency is
   * a writer's bug, reported as such. */
  uint32_t hb = ps_get_le32(h + H_HEADER_BYTES);
  int32_t index = (int32_t)ps_get_le32(h + H_INDEX), num = (int32_t)ps_get_le32(h + H_NUM_SHARDS);
  uint64_t P = ps_get_le64(h + H_P), b = ps_get_le64(h + H_BEGIN), e = ps_get_le64(h + H_END);
  uint32_t k = ps_get_le32(h + H_N_SLOTS);
  uint64_t elen = ps_get_le64(h + H_EXTRA_LEN);
  /* Format 1 wrote zeros where format 2 keeps the set id and the cut. */
  uint64_t set_id = ps_get_le64(h + H_SET_ID), clen = ps_get_le64(h + H_CUT_LEN);
  /* Formats 1 and 2 wrote zeros where format 3 keeps the tables section's. */
  uint64_t tlen = ps_get_le64(h + H_TABLES_LEN);
  uint32_t tcrc = ps_get_le32(h + H_TABLES_CRC);
  char opt[16], job[64];
  memcpy(opt, h + H_OPTIMIZER, sizeof opt);
  memcpy(job, h + H_JOB_ID, sizeof job);
  if (hb != PS_CKPT_HEADER_BYTES || num < 1 || index < 0 || index >= num || b > e || e > P ||
      P > SIZE_MAX || k > PS_CKPT_MAX_SLOTS || elen > SIZE_MAX || clen > PS_CKPT_MAX_CUT ||
      (format == 1 && (set_id != 0 || clen != 0)) || (format < 3 && (tlen != 0 || tcrc != 0)) ||
      tlen > SIZE_MAX || !name_field_ok(opt, 16) ||
      !name_field_ok(job, 64))
    return ps_seterr(err, PS_EINVAL,
                     "inconsistent header in '%s' (shard %" PRId32 " of %" PRId32
                     ", range [%" PRIu64 ", %" PRIu64 ") of P=%" PRIu64 ", %" PRIu32
                     " slots): not written by ps-server",
                     path, index, num, b, e, P, k);
  uint64_t body;
  if (body_bytes(e - b, k, elen, clen, tlen, &body) != PS_OK)
    return ps_seterr(err, PS_EINVAL, "inconsistent header in '%s': sizes overflow", path);
  uint64_t after = file_size - PS_CKPT_HEADER_BYTES;
  if (after < body)
    return ps_seterr(err, PS_EINVAL,
                     "truncated checkpoint '%s': header says %" PRIu64
                     " bytes of extra, cut, parameters, %" PRIu32
                     " slots and table rows (+4 of checksum), "
                     "file has %" PRIu64 " after the header: an interrupted copy?",
                     path, body - 4, k, after);
  if (after > body)
    return ps_seterr(err, PS_EINVAL,
                     "'%s' is %" PRIu64
                     " bytes longer than its header says: corrupt, or "
                     "not a checkpoint of this format",
                     path, after - body);
  memset(m, 0, sizeof *m);
  m->index = index;
  m->num_shards = num;
  m->P = (size_t)P;
  m->begin = (size_t)b;
  m->end = (size_t)e;
  m->version = ps_get_le64(h + H_VERSION);
  m->written_ms = (int64_t)ps_get_le64(h + H_WRITTEN_MS);
  memcpy(m->optimizer, opt, sizeof opt);
  memcpy(m->job_id, job, sizeof job);
  m->set_id = set_id;
  m->cut_len = (size_t)clen;
  m->cut_crc = ps_get_le32(h + H_CUT_CRC);
  m->format = (int)format;
  m->tables_len = (size_t)tlen;
  m->tables_crc = tcrc;
  if (n_slots) *n_slots = (int)k;
  if (extra_len) *extra_len = (size_t)elen;
  return PS_OK;
}

/* Opens path and reads and verifies its header. Returns the descriptor,
 * positioned after the header, or a negative code. */
static int open_checked(const char *path, uint8_t *h, ps_ckpt_meta *m, int *n_slots,
                        size_t *extra_len, char *err) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ps_seterr(err, PS_EIO, "cannot open '%s': %s", path, strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int rc = ps_seterr(err, PS_EIO, "cannot stat '%s': %s", path, strerror(errno));
    close(fd);
    return rc;
  }
  if (!S_ISREG(st.st_mode)) {
    close(fd);
    return ps_seterr(err, PS_EINVAL, "'%s' is not a regular file", path);
  }
  uint64_t size = (uint64_t)st.st_size;
  ssize_t got = read_all(fd, h, PS_CKPT_HEADER_BYTES);
  int rc;
  if (got < 0)
    rc = ps_seterr(err, PS_EIO, "cannot read '%s': %s", path, strerror(errno));
  else if ((size_t)got < sizeof CKPT_MAGIC)
    rc = ps_seterr(err, PS_EPROTO,
                   "bad magic in '%s': only %zd bytes, not a shard checkpoint (truncated?)", path,
                   got);
  else if (memcmp(h, CKPT_MAGIC, sizeof CKPT_MAGIC) != 0)
    rc =
        ps_seterr(err, PS_EPROTO,
                  "bad magic in '%s': not a shard checkpoint, or written by a newer version", path);
  else if ((size_t)got < PS_CKPT_HEADER_BYTES)
    rc = ps_seterr(err, PS_EINVAL,
                   "truncated checkpoint '%s': %zd bytes, less than the %d-byte header", path, got,
                   PS_CKPT_HEADER_BYTES);
  else
    rc = header_decode(path, h, size, m, n_slots, extra_len, err);
  if (rc != PS_OK) {
    close(fd);
    return rc;
  }
  return fd;
}

/* ---------------------------------------------------------------- write */

void ps_ckpt_free(ps_ckpt *c) {
  if (!c) return;
  free(c->params);
  for (int k = 0; k < PS_CKPT_MAX_SLOTS; k++) free(c->slots[k]);
  free(c->extra);
  free(c->cut);
  free(c->tables);
  memset(c, 0, sizeof *c);
}

typedef struct {
  uint64_t version;
  char name[256];
} prune_entry;

static int prune_cmp(const void *a, const void *b) {
  const prune_entry *x = a, *y = b;
  return x->version < y->version ? 1 : x->version > y->version ? -1 : 0;
}

/* Deletes checkpoints of the same shard and job with a lower version than
 * ck's, beyond the newest keep-1 of them. Failures are logged. */
static void prune_older(const char *dir, const ps_ckpt *ck, int keep) {
  DIR *d = opendir(dir);
  if (!d) {
    PS_WARN("checkpoint: cannot list '%s' to delete old checkpoints: %s", dir, strerror(errno));
    return;
  }
  prune_entry *list = NULL;
  size_t n = 0, cap = 0;
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    int index, num;
    uint64_t v;
    if (parse_ckpt_name(de->d_name, &index, &num, &v) != 0) continue;
    if (index != ck->meta.index || num != ck->meta.num_shards || v >= ck->meta.version) continue;
    if (strlen(de->d_name) >= sizeof list->name) continue;
    /* Only files this job wrote: another job may share the directory. A
     * file whose header cannot be read is left for a person to look at. */
    char path[PS_CKPT_PATHLEN];
    ps_ckpt_meta m;
    if (join_path(path, dir, de->d_name, NULL) != PS_OK ||
        ps_ckpt_read_header(path, &m, NULL, NULL, NULL) != PS_OK ||
        strcmp(m.job_id, ck->meta.job_id) != 0)
      continue;
    if (n == cap) {
      size_t ncap = cap ? 2 * cap : 16;
      prune_entry *nl = realloc(list, ncap * sizeof *nl);
      if (!nl) {
        PS_WARN("checkpoint: out of memory listing old checkpoints in '%s'", dir);
        break;
      }
      list = nl;
      cap = ncap;
    }
    list[n].version = v;
    snprintf(list[n].name, sizeof list[n].name, "%s", de->d_name);
    n++;
  }
  closedir(d);
  if (n > 0) qsort(list, n, sizeof *list, prune_cmp);
  size_t older_kept = (size_t)keep - 1; /* the file just written is the first kept */
  for (size_t i = older_kept; i < n; i++) {
    char path[PS_CKPT_PATHLEN];
    if (join_path(path, dir, list[i].name, NULL) != PS_OK) continue;
    if (unlink(path) != 0)
      PS_WARN("checkpoint: cannot delete old checkpoint '%s': %s", path, strerror(errno));
  }
  free(list);
}

int ps_ckpt_write(const char *dir, const ps_ckpt *ck, int keep, char *path_out, char *err) {
  if (!dir || !ck) return ps_seterr(err, PS_EINVAL, "checkpoint: no directory or state given");
  if (keep < 0) return ps_seterr(err, PS_EINVAL, "checkpoint: keep %d must be >= 0", keep);
  int rc = check_ckpt(ck, err);
  if (rc) return rc;
  const ps_ckpt_meta *m = &ck->meta;
  char name[128], final_path[PS_CKPT_PATHLEN], tmp[PS_CKPT_PATHLEN];
  if (m->set_id)
    snprintf(name, sizeof name, "shard-%d-of-%d-v%" PRIu64 "-s%" PRIu64 ".ckpt", m->index,
             m->num_shards, m->version, m->set_id);
  else
    snprintf(name, sizeof name, "shard-%d-of-%d-v%" PRIu64 ".ckpt", m->index, m->num_shards,
             m->version);
  if ((rc = join_path(final_path, dir, name, err))) return rc;
  int fd = open_temp(final_path, tmp, err);
  if (fd < 0) return fd;

  uint8_t h[PS_CKPT_HEADER_BYTES];
  header_encode(ck, (int64_t)(ps_wall_s() * 1000.0), h);
  size_t n = m->end - m->begin;
  uint32_t crc = 0;
  int e = write_summed(fd, h, sizeof h, &crc);
  if (!e && ck->extra_len) e = write_summed(fd, ck->extra, ck->extra_len, &crc);
  if (!e && ck->cut_len) e = write_summed(fd, ck->cut, ck->cut_len, &crc);
  if (!e && n) e = write_summed(fd, ck->params, n * sizeof(float), &crc);
  for (int k = 0; !e && n && k < ck->n_slots; k++)
    e = write_summed(fd, ck->slots[k], n * sizeof(float), &crc);
  if (!e && ck->tables_len) e = write_summed(fd, ck->tables, ck->tables_len, &crc);
  uint8_t trailer[4];
  ps_put_le32(trailer, crc);
  if (!e) e = write_all(fd, trailer, sizeof trailer);
  if (e) {
    close(fd);
    unlink(tmp);
    return ps_seterr(err, PS_EIO, "cannot write checkpoint '%s': %s", tmp, strerror(e));
  }
  if ((rc = commit_temp(fd, tmp, final_path, err))) return rc;
  if (path_out) snprintf(path_out, PS_CKPT_PATHLEN, "%s", final_path);
  if ((rc = fsync_dir(dir, err))) return rc;
  if (keep > 0) prune_older(dir, ck, keep);
  return PS_OK;
}

/* A temporary file (open as fd) whose header is complete and names a job
 * other than job_id. A header not written yet names no job. */
static int temp_of_other_job(int fd, const char *job_id) {
  uint8_t h[PS_CKPT_HEADER_BYTES];
  if (read_all(fd, h, sizeof h) != (ssize_t)sizeof h ||
      memcmp(h + H_MAGIC, CKPT_MAGIC, sizeof CKPT_MAGIC) != 0 ||
      ps_get_le32(h + H_HEADER_CRC) != ps_crc32c(0, h, H_HEADER_CRC))
    return 0;
  char job[64];
  memcpy(job, h + H_JOB_ID, sizeof job);
  return name_field_ok(job, sizeof job) && strcmp(job, job_id) != 0;
}

/* Whether process pid may still be writing: alive, and not the caller. */
static int writer_alive(long pid) {
  if (pid == (long)getpid()) return 0;
  return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

/* Removes dir/name when it is a stale temporary file (see the contract of
 * ps_ckpt_remove_stale_temps); 1 when it was removed. */
static int remove_if_stale(const char *dir, const char *name, long pid, const char *job_id) {
  char path[PS_CKPT_PATHLEN];
  if (join_path(path, dir, name, NULL) != PS_OK || writer_alive(pid)) return 0;
  int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno != ENOENT)
      PS_WARN("checkpoint: cannot open '%s' to check it: %s", path, strerror(errno));
    return 0;
  }
  int removed = 0;
  /* The lock: a writer holds it until its descriptor closes, so a free
   * one means nobody is writing this file (not even a writer whose pid
   * this process cannot see, in another pid namespace). */
  if (flock(fd, LOCK_EX | LOCK_NB) != 0 && errno == EWOULDBLOCK) {
    close(fd);
    return 0;
  }
  if (!temp_of_other_job(fd, job_id)) {
    if (unlink(path) == 0) {
      removed = 1;
      PS_INFO("checkpoint: removed '%s', a write that process %ld did not finish", path, pid);
    } else if (errno != ENOENT) {
      PS_WARN("checkpoint: cannot remove the stale temporary file '%s': %s", path,
              strerror(errno));
    }
  }
  close(fd);
  return removed;
}

int ps_ckpt_remove_stale_temps(const char *dir, int index, int num_shards, const char *job_id,
                               int *removed, char *err) {
  if (removed) *removed = 0;
  if (!dir || !job_id || index < 0 || index >= num_shards)
    return ps_seterr(err, PS_EINVAL, "checkpoint: no directory or job, or shard %d of %d", index,
                     num_shards);
  DIR *d = opendir(dir);
  if (!d) {
    if (errno == ENOENT) return PS_OK;
    return ps_seterr(err, PS_EIO, "cannot list checkpoint directory '%s': %s", dir,
                     strerror(errno));
  }
  int n = 0;
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    int i, S;
    uint64_t v;
    long pid;
    if (parse_temp_name(de->d_name, &i, &S, &v, &pid) != 0 || i != index || S != num_shards)
      continue;
    n += remove_if_stale(dir, de->d_name, pid, job_id);
  }
  closedir(d);
  if (removed) *removed = n;
  return PS_OK;
}

/* ---------------------------------------------------------------- read */

int ps_ckpt_read_header(const char *path, ps_ckpt_meta *meta, int *n_slots, size_t *extra_len,
                        char *err) {
  uint8_t h[PS_CKPT_HEADER_BYTES];
  int fd = open_checked(path, h, meta, n_slots, extra_len, err);
  if (fd < 0) return fd;
  close(fd);
  return PS_OK;
}

int ps_ckpt_read(const char *path, ps_ckpt *out, char *err) {
  memset(out, 0, sizeof *out);
  uint8_t h[PS_CKPT_HEADER_BYTES];
  ps_ckpt c;
  memset(&c, 0, sizeof c);
  int fd = open_checked(path, h, &c.meta, &c.n_slots, &c.extra_len, err);
  if (fd < 0) return fd;
  size_t n = c.meta.end - c.meta.begin;
  /* malloc, not ps_alloc: every byte is about to be overwritten. At least
   * one byte, so that NULL means failure. */
  size_t bytes = n ? n * sizeof(float) : 1;
  int rc = PS_OK;
  c.params = malloc(bytes);
  for (int k = 0; k < c.n_slots; k++) c.slots[k] = malloc(bytes);
  if (c.extra_len) c.extra = malloc(c.extra_len);
  c.cut_len = c.meta.cut_len;
  if (c.cut_len) c.cut = malloc(c.cut_len);
  c.tables_len = c.meta.tables_len;
  if (c.tables_len) c.tables = malloc(c.tables_len);
  int oom = !c.params || (c.extra_len && !c.extra) || (c.cut_len && !c.cut) ||
            (c.tables_len && !c.tables);
  for (int k = 0; k < c.n_slots; k++) oom |= !c.slots[k];
  if (oom) {
    rc = ps_seterr(err, PS_ENOMEM, "out of memory reading '%s' (%zu values, %d slots)", path, n,
                   c.n_slots);
    goto fail;
  }
  uint32_t crc = ps_crc32c(0, h, sizeof h);
  int bad = c.extra_len && read_summed(fd, c.extra, c.extra_len, &crc);
  if (!bad && c.cut_len) bad = read_summed(fd, c.cut, c.cut_len, &crc);
  if (!bad && n) bad = read_summed(fd, c.params, n * sizeof(float), &crc);
  for (int k = 0; !bad && n && k < c.n_slots; k++)
    bad = read_summed(fd, c.slots[k], n * sizeof(float), &crc);
  if (!bad && c.tables_len) bad = read_summed(fd, c.tables, c.tables_len, &crc);
  uint8_t trailer[4];
  if (!bad) {
    ssize_t got = read_all(fd, trailer, sizeof trailer);
    if (got != (ssize_t)sizeof trailer) {
      if (got >= 0) errno = 0;
      bad = 1;
    }
  }
  if (bad) {
    rc = errno ? ps_seterr(err, PS_EIO, "cannot read '%s': %s", path, strerror(errno))
               : ps_seterr(err, PS_EIO, "'%s' ended early while being read: changed meanwhile?",
                           path);
    goto fail;
  }
  /* The rows' own checksum first: damage there is named as such. */
  uint32_t tcrc = c.tables_len ? ps_crc32c(0, c.tables, c.tables_len) : 0;
  if (tcrc != c.meta.tables_crc) {
    rc = ps_seterr(err, PS_EINVAL,
                   "'%s': its embedding rows are corrupt (checksum of the %zu-byte tables section: "
                   "stored 0x%08" PRIx32 ", computed 0x%08" PRIx32 ")",
                   path, c.tables_len, c.meta.tables_crc, tcrc);
    goto fail;
  }
  uint32_t stored = ps_get_le32(trailer);
  if (stored != crc) {
    rc = ps_seterr(err, PS_EINVAL,
                   "checksum mismatch in '%s': the file is corrupt (stored 0x%08" PRIx32
                   ", computed 0x%08" PRIx32 ")",
                   path, stored, crc);
    goto fail;
  }
  if (c.cut_len && ps_crc32c(0, c.cut, c.cut_len) != c.meta.cut_crc) {
    rc = ps_seterr(err, PS_EINVAL, "'%s': its cut record does not match the header's checksum",
                   path);
    goto fail;
  }
  if (c.tables_len) {
    ps_ckpt_table tv[PS_MAX_TABLES];
    int nt;
    if ((rc = ps_ckpt_tables_parse(c.tables, c.tables_len, path, tv, &nt, err)) != PS_OK)
      goto fail;
  }
  close(fd);
  *out = c;
  return PS_OK;

fail:
  close(fd);
  ps_ckpt_free(&c);
  return rc;
}

/* ---------------------------------------------------------------- search */

static void note(const ps_ckpt_source *src, int level, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void note(const ps_ckpt_source *src, int level, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (src->note)
    src->note(level, msg, src->note_user);
  else
    ps_log(level, "%s", msg);
}

/* One checkpoint file found in the directory. */
typedef struct {
  int index, num_shards;
  uint64_t version; /* from the name (the header's, when peeked) */
  int64_t mtime_ns;
  int64_t written_ms; /* from the header; mtime when not peeked */
  size_t begin, end;  /* from the header, when peeked */
  uint64_t set_id;    /* from the header, when peeked */
  size_t cut_len;
  uint32_t cut_crc;
  char *name;
} ckpt_entry;

typedef struct {
  ckpt_entry *v;
  size_t n, cap;
} ckpt_list;

static void list_free(ckpt_list *l) {
  for (size_t i = 0; i < l->n; i++) free(l->v[i].name);
  free(l->v);
  memset(l, 0, sizeof *l);
}

/* Lists the checkpoint files of dir, of shard `index` of `num_shards`
 * (index < 0: all). PS_ENOTFOUND if dir does not exist. */
static int list_dir(const char *dir, int index, int num_shards, ckpt_list *out, char *err) {
  memset(out, 0, sizeof *out);
  DIR *d = opendir(dir);
  if (!d) {
    int e = errno;
    return ps_seterr(err, e == ENOENT ? PS_ENOTFOUND : PS_EIO,
                     "cannot open checkpoint directory '%s': %s", dir, strerror(e));
  }
  struct dirent *de;
  int rc = PS_OK;
  while ((de = readdir(d)) != NULL) {
    ckpt_entry e;
    memset(&e, 0, sizeof e);
    if (parse_ckpt_name(de->d_name, &e.index, &e.num_shards, &e.version) != 0) continue;
    if (index >= 0 && (e.index != index || e.num_shards != num_shards)) continue;
    char path[PS_CKPT_PATHLEN];
    struct stat st;
    if (join_path(path, dir, de->d_name, NULL) != PS_OK || stat(path, &st) != 0 ||
        !S_ISREG(st.st_mode))
      continue;
    e.mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000 + st.st_mtim.tv_nsec;
    e.written_ms = e.mtime_ns / 1000000;
    e.name = strdup(de->d_name);
    if (!e.name) {
      rc = ps_seterr(err, PS_ENOMEM, "out of memory listing '%s'", dir);
      break;
    }
    if (out->n == out->cap) {
      size_t ncap = out->cap ? 2 * out->cap : 16;
      ckpt_entry *nv = realloc(out->v, ncap * sizeof *nv);
      if (!nv) {
        free(e.name);
        rc = ps_seterr(err, PS_ENOMEM, "out of memory listing '%s'", dir);
        break;
      }
      out->v = nv;
      out->cap = ncap;
    }
    out->v[out->n++] = e;
  }
  closedir(d);
  if (rc != PS_OK) list_free(out);
  return rc;
}

/* Shards together, newest version first, then newest file. */
static int entry_cmp(const void *a, const void *b) {
  const ckpt_entry *x = a, *y = b;
  if (x->num_shards != y->num_shards) return x->num_shards < y->num_shards ? -1 : 1;
  if (x->index != y->index) return x->index < y->index ? -1 : 1;
  if (x->version != y->version) return x->version > y->version ? -1 : 1;
  if (x->mtime_ns != y->mtime_ns) return x->mtime_ns > y->mtime_ns ? -1 : 1;
  return strcmp(x->name, y->name);
}

/* Why a valid checkpoint does not fit what src asks for (into why,
 * PS_ERRLEN): 2 when it belongs to another job, 1 for any other reason, 0
 * when it fits. want_slots < 0: any number. */
static int mismatch(const ps_ckpt_source *src, const ps_ckpt_meta *m, int n_slots,
                    const ckpt_entry *e, int want_slots, char *why) {
  if (strcmp(m->job_id, src->job_id) != 0)
    return ps_seterr(why, 2, "written by job '%s', not '%.64s'", m->job_id, src->job_id);
  if (m->P != src->P)
    return ps_seterr(why, 1, "for a model of P=%zu values, this job's has P=%zu", m->P, src->P);
  if (m->index != e->index || m->num_shards != e->num_shards)
    return ps_seterr(why, 1, "its header says shard %d of %d, its name shard %d of %d: renamed?",
                     m->index, m->num_shards, e->index, e->num_shards);
  if (src->optimizer && strcmp(m->optimizer, src->optimizer) != 0)
    return ps_seterr(why, 1, "holds the slots of optimizer '%s', the job uses '%.16s'",
                     m->optimizer, src->optimizer);
  if (want_slots >= 0 && n_slots != want_slots)
    return ps_seterr(why, 1, "holds %d optimizer slots, %d wanted", n_slots, want_slots);
  return 0;
}

/* Reads entry e completely and checks that it fits; on failure notes why
 * (WARN) and returns non-zero with the reason in why: PS_ENOTFOUND when the
 * file is another job's. */
static int read_entry(const ps_ckpt_source *src, const ckpt_entry *e, int want_slots, ps_ckpt *out,
                      char *path, char *why) {
  int rc = join_path(path, src->dir, e->name, why);
  if (rc == PS_OK) rc = ps_ckpt_read(path, out, why);
  if (rc != PS_OK) {
    note(src, PS_LOG_WARN, "skipping checkpoint: %s", why);
    return rc;
  }
  char reason[PS_ERRLEN];
  int bad = mismatch(src, &out->meta, out->n_slots, e, want_slots, reason);
  if (bad) {
    ps_seterr(why, PS_EINVAL, "'%s': %s", path, reason);
    note(src, PS_LOG_WARN, "skipping checkpoint '%s': %s", path, reason);
    ps_ckpt_free(out);
    return bad == 2 ? PS_ENOTFOUND : PS_EINVAL;
  }
  return PS_OK;
}

static int check_source(const ps_ckpt_source *src, char *err) {
  if (!src || !src->dir || !src->job_id)
    return ps_seterr(err, PS_EINVAL, "checkpoint search: no directory or job id given");
  return PS_OK;
}

int ps_ckpt_find_latest(const ps_ckpt_source *src, int index, int num_shards, ps_ckpt *out,
                        char *used_path, char *err) {
  if (out) memset(out, 0, sizeof *out);
  int rc = check_source(src, err);
  if (rc) return rc;
  if (!out || num_shards < 1 || index < 0 || index >= num_shards)
    return ps_seterr(err, PS_EINVAL, "checkpoint search: shard index %d invalid for %d shards",
                     index, num_shards);
  ckpt_list l;
  if ((rc = list_dir(src->dir, index, num_shards, &l, err))) return rc;
  if (l.n == 0) {
    list_free(&l);
    return ps_seterr(err, PS_ENOTFOUND, "no checkpoint of shard %d of %d in '%s'", index,
                     num_shards, src->dir);
  }
  qsort(l.v, l.n, sizeof *l.v, entry_cmp);
  char path[PS_CKPT_PATHLEN], why[PS_ERRLEN] = "";
  rc = PS_EINVAL;
  size_t i, others = 0; /* files of other jobs */
  for (i = 0; i < l.n; i++) {
    int r = read_entry(src, &l.v[i], -1, out, path, why);
    if (r == PS_OK) {
      rc = PS_OK;
      break;
    }
    if (r == PS_ENOTFOUND) others++;
  }
  if (rc == PS_OK) {
    if (i > 0)
      note(src, PS_LOG_WARN,
           "restoring shard %d of %d from the older checkpoint '%s' (version %" PRIu64
           "): %zu newer one%s skipped",
           index, num_shards, path, out->meta.version, i, i == 1 ? "" : "s");
    else
      note(src, PS_LOG_INFO, "restoring shard %d of %d from '%s' (version %" PRIu64 ")", index,
           num_shards, path, out->meta.version);
    if (used_path) snprintf(used_path, PS_CKPT_PATHLEN, "%s", path);
  } else if (others == l.n) {
    /* Another job's files in a shared directory do not stop a fresh start. */
    rc = ps_seterr(err, PS_ENOTFOUND, "no checkpoint of job '%.64s', shard %d of %d, in '%s'",
                   src->job_id, index, num_shards, src->dir);
  } else {
    ps_seterr(err, PS_EINVAL,
              "none of the %zu checkpoints of shard %d of %d in '%s' is usable; the last: %s", l.n,
              index, num_shards, src->dir, why);
  }
  list_free(&l);
  return rc;
}

/* A group of checkpoints written with one number of shards, from which a
 * range may be restored. */
enum {
  GROUP_SET = 0,    /* the files of one set id, one per shard */
  GROUP_NEWEST = 1, /* each shard's newest file, their cut records equal */
  GROUP_MIXED = 2,  /* each shard's newest valid file, whatever its moment */
};
typedef struct {
  int kind;
  uint64_t set_id; /* GROUP_SET */
  int num_shards;
  size_t first, count; /* entries [first, first+count) of the sorted list */
  int complete;        /* every shard has a file */
  int64_t time_ms;     /* the oldest of the shards' (newest) write times */
} ckpt_set;

static int set_cmp(const void *a, const void *b) {
  const ckpt_set *x = a, *y = b;
  int xc = x->kind != GROUP_MIXED, yc = y->kind != GROUP_MIXED;
  if (xc != yc) return xc ? -1 : 1;
  if (x->complete != y->complete) return x->complete ? -1 : 1;
  if (x->time_ms != y->time_ms) return x->time_ms > y->time_ms ? -1 : 1;
  return x->num_shards < y->num_shards ? -1 : x->num_shards > y->num_shards;
}

typedef struct {
  const ps_ckpt_source *src;
  const ckpt_list *l;
  size_t begin, end;
  float *params;
  float *const *slots;
  int n_slots, want_extra;
} load_job;

/* Fills the range from one set, or says why it cannot (into why). */
static int load_from_set(const load_job *j, const ckpt_set *set, ps_ckpt_restored *out, char *why) {
  const ckpt_entry *v = j->l->v + set->first;
  size_t at = 0, covered = 0, prev_end = 0;
  int first_missing = -1;
  for (int i = 0; i < set->num_shards; i++) {
    size_t run = 0;
    while (at + run < set->count && v[at + run].index == i) run++;
    const ckpt_entry *e = v + at;
    at += run;
    if (set->kind == GROUP_NEWEST && run > 1) run = 1;
    if (set->kind == GROUP_SET) {
      size_t r = 0;
      while (r < run && e[r].set_id != set->set_id) r++;
      e += r;
      run = r < run ? 1 : 0;
    }
    if (run == 0) {
      if (first_missing < 0) first_missing = i;
      if (i == 0 && j->want_extra)
        return ps_seterr(why, PS_EINVAL, "no checkpoint of shard 0, which holds the extra state");
      if (j->src->want_tables)
        return ps_seterr(why, PS_EINVAL,
                         "no checkpoint of shard %d, whose embedding rows are wanted too", i);
      continue;
    }
    int overlaps = j->begin < j->end && e->begin < j->end && j->begin < e->end;
    if (!overlaps && !(i == 0 && j->want_extra) && !j->src->want_tables) continue;
    ps_ckpt ck;
    char path[PS_CKPT_PATHLEN], reason[PS_ERRLEN] = "";
    size_t r;
    for (r = 0; r < run; r++)
      if (read_entry(j->src, &e[r], j->n_slots > 0 ? j->n_slots : -1, &ck, path, reason) == PS_OK)
        break;
    if (r == run)
      return ps_seterr(why, PS_EINVAL, "no valid checkpoint of shard %d (%zu tried; last: %s)", i,
                       run, reason);
    size_t lo = ck.meta.begin > j->begin ? ck.meta.begin : j->begin;
    size_t hi = ck.meta.end < j->end ? ck.meta.end : j->end;
    if (lo < hi) {
      if (lo < prev_end) {
        ps_seterr(why, PS_EINVAL, "'%s' holds [%zu, %zu), overlapping the shard before it", path,
                  ck.meta.begin, ck.meta.end);
        ps_ckpt_free(&ck);
        return PS_EINVAL;
      }
      size_t off = lo - ck.meta.begin, len = hi - lo;
      memcpy(j->params + (lo - j->begin), ck.params + off, len * sizeof(float));
      for (int k = 0; k < j->n_slots; k++)
        memcpy(j->slots[k] + (lo - j->begin), ck.slots[k] + off, len * sizeof(float));
      covered += len;
      prev_end = hi;
      note(j->src, r > 0 ? PS_LOG_WARN : PS_LOG_INFO,
           "restoring [%zu, %zu) from '%s' (shard %d of %d, version %" PRIu64 "%s)", lo, hi, path,
           i, set->num_shards, ck.meta.version, r > 0 ? ", an older one: newer ones are bad" : "");
    } else if (i == 0 && j->want_extra) {
      note(j->src, PS_LOG_INFO,
           "reading the extra state from '%s' (shard 0 of %d, version %" PRIu64 ")", path,
           set->num_shards, ck.meta.version);
    } else {
      note(j->src, PS_LOG_INFO,
           "reading the embedding rows of '%s' (shard %d of %d, version %" PRIu64 ")", path, i,
           set->num_shards, ck.meta.version);
    }
    if (j->src->want_tables) {
      if (!out->parts) {
        out->parts = calloc((size_t)set->num_shards, sizeof *out->parts);
        if (!out->parts) {
          ps_ckpt_free(&ck);
          return ps_seterr(why, PS_ENOMEM, "out of memory for %d shards' rows", set->num_shards);
        }
        out->n_parts = set->num_shards;
      }
      ps_ckpt_part *pt = &out->parts[i];
      snprintf(pt->path, sizeof pt->path, "%s", path);
      pt->index = i;
      pt->num_shards = set->num_shards;
      pt->version = ck.meta.version;
      pt->tables = ck.tables; /* moved out of ck */
      pt->tables_len = ck.tables_len;
      ck.tables = NULL;
      ck.tables_len = 0;
    }
    if (!out->cut && ck.cut_len > 0) {
      out->cut = ck.cut; /* moved out of ck */
      out->cut_len = ck.cut_len;
      ck.cut = NULL;
    }
    if (i == 0 && j->want_extra && ck.extra_len > 0) {
      out->extra = ck.extra; /* moved out of ck */
      out->extra_len = ck.extra_len;
      ck.extra = NULL;
    }
    if (ck.meta.version > out->version) out->version = ck.meta.version;
    out->files_used++;
    ps_ckpt_free(&ck);
  }
  if (covered != j->end - j->begin) {
    if (first_missing >= 0)
      return ps_seterr(why, PS_EINVAL,
                       "they cover %zu of the %zu values of [%zu, %zu): no checkpoint of shard %d",
                       covered, j->end - j->begin, j->begin, j->end, first_missing);
    return ps_seterr(why, PS_EINVAL, "they cover only %zu of the %zu values of [%zu, %zu)", covered,
                     j->end - j->begin, j->begin, j->end);
  }
  out->num_shards = set->num_shards;
  out->set_id = set->kind == GROUP_SET ? set->set_id : 0;
  out->consistent = set->kind != GROUP_MIXED;
  return PS_OK;
}

/* Adds to sets the consistent groups of the S' shards whose files are
 * entries [first, first+count) (sorted by shard, newest first): one per
 * set id that every shard wrote, and the shards' newest files when their
 * cut records are equal (and they are not one set already). Returns how
 * many were added (at most count + 1). */
static size_t consistent_groups(const ckpt_list *l, size_t first, size_t count, int num_shards,
                                ckpt_set *sets) {
  const ckpt_entry *v = l->v + first;
  size_t added = 0;
  /* Set ids: each one found on shard 0 is checked on every other shard. */
  for (size_t a = 0; a < count && v[a].index == 0; a++) {
    uint64_t id = v[a].set_id;
    if (id == 0) continue;
    int shards = 0, last = -1;
    int64_t t = INT64_MAX;
    for (size_t b = 0; b < count; b++)
      if (v[b].set_id == id && v[b].index != last) {
        last = v[b].index;
        shards++;
        if (v[b].written_ms < t) t = v[b].written_ms;
      }
    if (shards != num_shards) continue;
    sets[added++] = (ckpt_set){.kind = GROUP_SET, .set_id = id, .num_shards = num_shards,
                               .first = first, .count = count, .complete = 1, .time_ms = t};
  }
  /* The newest file of each shard, when every shard has one and all carry
   * the same cut record (files without one, format 1, never match); a
   * single shard's file is one moment by itself (ps-import-keras writes
   * one without a cut record). */
  int shards = 0, equal = 1, same_set = 1;
  int64_t t = INT64_MAX;
  const ckpt_entry *head = NULL;
  for (size_t b = 0; b < count; b++) {
    if (b > 0 && v[b - 1].index == v[b].index) continue;
    if (!head) head = &v[b];
    shards++;
    equal &= v[b].cut_len == head->cut_len && v[b].cut_crc == head->cut_crc;
    same_set &= v[b].set_id == head->set_id && head->set_id != 0;
    if (v[b].written_ms < t) t = v[b].written_ms;
  }
  if (shards == num_shards && !same_set && head &&
      (num_shards == 1 || (equal && head->cut_len > 0)))
    sets[added++] = (ckpt_set){.kind = GROUP_NEWEST, .num_shards = num_shards, .first = first,
                               .count = count, .complete = 1, .time_ms = t};
  return added;
}

void ps_ckpt_restored_free(ps_ckpt_restored *r) {
  if (!r) return;
  free(r->extra);
  free(r->cut);
  for (int i = 0; i < r->n_parts; i++) free(r->parts[i].tables);
  free(r->parts);
  memset(r, 0, sizeof *r);
}

int ps_ckpt_load_range(const ps_ckpt_source *src, size_t begin, size_t end, float *params,
                       float *const *slots, int n_slots, int want_extra, ps_ckpt_restored *out,
                       char *err) {
  if (out) memset(out, 0, sizeof *out);
  int rc = check_source(src, err);
  if (rc) return rc;
  if (!out) return ps_seterr(err, PS_EINVAL, "checkpoint restore: no result given");
  if (begin > end || end > src->P)
    return ps_seterr(err, PS_ERANGE, "checkpoint restore: range [%zu, %zu) not inside [0, %zu)",
                     begin, end, src->P);
  if (n_slots < 0 || n_slots > PS_CKPT_MAX_SLOTS || (n_slots > 0 && !slots) ||
      (end > begin && !params))
    return ps_seterr(err, PS_EINVAL, "checkpoint restore: %d slots, or no arrays given", n_slots);
  for (int k = 0; k < n_slots; k++)
    if (end > begin && !slots[k])
      return ps_seterr(err, PS_EINVAL, "checkpoint restore: slot %d not given", k);

  ckpt_list l;
  if ((rc = list_dir(src->dir, -1, 0, &l, err))) return rc;
  /* Peek at every header: files of other jobs and sizes are dropped here,
   * and the ranges and write times are needed to choose. */
  size_t kept = 0, seen = l.n, others = 0;
  char damaged[PS_CKPT_PATHLEN] = ""; /* the last file whose header is bad (truncated, ...) */
  for (size_t i = 0; i < l.n; i++) {
    ckpt_entry *e = &l.v[i];
    char path[PS_CKPT_PATHLEN], why[PS_ERRLEN];
    ps_ckpt_meta m;
    int k;
    if (join_path(path, src->dir, e->name, why) != PS_OK ||
        ps_ckpt_read_header(path, &m, &k, NULL, why) != PS_OK) {
      note(src, PS_LOG_WARN, "skipping checkpoint: %s", why);
      snprintf(damaged, sizeof damaged, "%s", e->name);
      free(e->name);
      continue;
    }
    int bad = mismatch(src, &m, k, e, n_slots > 0 ? n_slots : -1, why);
    if (bad) {
      note(src, PS_LOG_WARN, "skipping checkpoint '%s': %s", path, why);
      others += bad == 2;
      free(e->name);
      continue;
    }
    e->version = m.version;
    e->written_ms = m.written_ms;
    e->begin = m.begin;
    e->end = m.end;
    e->set_id = m.set_id;
    e->cut_len = m.cut_len;
    e->cut_crc = m.cut_crc;
    l.v[kept++] = *e;
  }
  l.n = kept;
  if (l.n == 0) {
    list_free(&l);
    if (seen == others)
      return ps_seterr(err, PS_ENOTFOUND, "no checkpoint of job '%.64s' in '%s'%s", src->job_id,
                       src->dir, seen ? " (only other jobs')" : "");
    return ps_seterr(err, PS_EINVAL,
                     "none of the %zu checkpoints in '%s' fits job '%.64s' (P=%zu%s): see the "
                     "warnings",
                     seen, src->dir, src->job_id, src->P,
                     n_slots > 0 ? ", with the optimizer's slots" : "");
  }
  qsort(l.v, l.n, sizeof *l.v, entry_cmp);

  /* Group by number of shards: the consistent groups of each S', then the
   * files of each S' whatever their moments. */
  ckpt_set *sets = calloc(3 * l.n + 1, sizeof *sets);
  if (!sets) {
    list_free(&l);
    return ps_seterr(err, PS_ENOMEM, "out of memory choosing checkpoints");
  }
  size_t n_sets = 0;
  for (size_t i = 0; i < l.n;) {
    ckpt_set *s = &sets[n_sets++];
    s->num_shards = l.v[i].num_shards;
    s->first = i;
    s->time_ms = INT64_MAX;
    int shards_seen = 0;
    while (i < l.n && l.v[i].num_shards == s->num_shards) {
      int64_t newest = INT64_MIN;
      int idx = l.v[i].index;
      for (; i < l.n && l.v[i].num_shards == s->num_shards && l.v[i].index == idx; i++)
        if (l.v[i].written_ms > newest) newest = l.v[i].written_ms;
      if (newest < s->time_ms) s->time_ms = newest;
      shards_seen++;
    }
    s->count = i - s->first;
    s->complete = shards_seen == s->num_shards;
    s->kind = GROUP_MIXED;
    ckpt_set mixed = *s;
    n_sets--;
    n_sets += consistent_groups(&l, mixed.first, mixed.count, mixed.num_shards, &sets[n_sets]);
    sets[n_sets++] = mixed;
  }
  qsort(sets, n_sets, sizeof *sets, set_cmp);

  load_job job = {src, &l, begin, end, params, slots, n_slots, want_extra};
  char why[PS_ERRLEN] = "";
  rc = PS_EINVAL;
  for (size_t s = 0; s < n_sets; s++) {
    memset(out, 0, sizeof *out);
    if (load_from_set(&job, &sets[s], out, why) == PS_OK) {
      rc = PS_OK;
      char what[64];
      if (sets[s].kind == GROUP_SET)
        snprintf(what, sizeof what, "set %" PRIu64 " of the", sets[s].set_id);
      else if (sets[s].kind == GROUP_NEWEST)
        snprintf(what, sizeof what, "the newest (equal cut records) of the");
      else
        snprintf(what, sizeof what, "the%s", sets[s].complete ? "" : " incomplete");
      note(src, sets[s].kind == GROUP_MIXED ? PS_LOG_WARN : PS_LOG_INFO,
           "restored [%zu, %zu) from %d file%s of %s %d-shard checkpoints in '%s', version "
           "%" PRIu64 "%s",
           begin, end, out->files_used, out->files_used == 1 ? "" : "s", what,
           sets[s].num_shards, src->dir, out->version,
           sets[s].kind == GROUP_MIXED
               ? ": no consistent set could fill the range, so the shards' files may hold "
                 "different moments"
               : "");
      break;
    }
    ps_ckpt_restored_free(out);
    if (sets[s].kind == GROUP_SET)
      note(src, PS_LOG_WARN, "cannot restore [%zu, %zu) from set %" PRIu64 " of the %d-shard "
           "checkpoints in '%s': %s", begin, end, sets[s].set_id, sets[s].num_shards, src->dir, why);
    else
      note(src, PS_LOG_WARN, "cannot restore [%zu, %zu) from the %d-shard checkpoints in '%s': %s",
           begin, end, sets[s].num_shards, src->dir, why);
  }
  if (rc != PS_OK && damaged[0])
    ps_seterr(err, PS_EINVAL,
              "'%s' is damaged (see the warning), and no set of checkpoints in '%s' can restore "
              "[%zu, %zu) from the other files; the last tried: %s",
              damaged, src->dir, begin, end, why);
  else if (rc != PS_OK)
    ps_seterr(err, PS_EINVAL,
              "no set of checkpoints in '%s' can restore [%zu, %zu) (%zu set%s tried); the last: "
              "%s",
              src->dir, begin, end, n_sets, n_sets == 1 ? "" : "s", why);
  free(sets);
  list_free(&l);
  return rc;
}

/* The header of a listed file of job_id whose header agrees with its name
 * (index and number of shards): 1 with *m filled, else 0. */
static int job_entry_meta(const char *dir, const ckpt_entry *e, const char *job_id,
                          ps_ckpt_meta *m) {
  char path[PS_CKPT_PATHLEN];
  return join_path(path, dir, e->name, NULL) == PS_OK &&
         ps_ckpt_read_header(path, m, NULL, NULL, NULL) == PS_OK &&
         strcmp(m->job_id, job_id) == 0 && m->index == e->index &&
         m->num_shards == e->num_shards;
}

/* The files of dir (list_dir's, every shard's) with room for their
 * headers: meta and ok, l->n each (one at least), zeroed. PS_ENOTFOUND
 * when there is no dir; on any error nothing is left allocated. */
static int list_for_headers(const char *dir, ckpt_list *l, ps_ckpt_meta **meta, char **ok,
                            char *err) {
  int rc = list_dir(dir, -1, 0, l, err);
  if (rc) return rc;
  *meta = calloc(l->n ? l->n : 1, sizeof **meta);
  *ok = calloc(l->n ? l->n : 1, 1);
  if (!*meta || !*ok) {
    free(*meta);
    free(*ok);
    list_free(l);
    return ps_seterr(err, PS_ENOMEM, "out of memory listing '%s'", dir);
  }
  return PS_OK;
}

/* Is id one of v[0 .. n)? */
static int has_set(const uint64_t *v, size_t n, uint64_t id) {
  for (size_t i = 0; i < n; i++)
    if (v[i] == id) return 1;
  return 0;
}

int ps_ckpt_prune_sets(const char *dir, int index, int num_shards, const char *job_id,
                       const uint64_t *keep_sets, int n_keep, uint64_t current, int drop_other_s,
                       int *deleted, char *err) {
  if (deleted) *deleted = 0;
  if (!dir || !job_id || num_shards < 1 || index < 0 || index >= num_shards || n_keep < 0 ||
      (n_keep > 0 && !keep_sets))
    return ps_seterr(err, PS_EINVAL, "checkpoint prune: bad arguments");
  if (n_keep == 0) return PS_OK;
  ckpt_list l;
  ps_ckpt_meta *meta;
  char *ok;
  int rc = list_for_headers(dir, &l, &meta, &ok, err);
  if (rc == PS_ENOTFOUND) return PS_OK;
  if (rc) return rc;
  /* Headers first: the newest write time among this shard's kept sets. */
  int64_t newest_kept = INT64_MIN;
  uint64_t newest_set = 0;
  for (int k = 0; k < n_keep; k++)
    if (keep_sets[k] > newest_set) newest_set = keep_sets[k];
  for (size_t i = 0; i < l.n; i++) {
    ok[i] = (char)job_entry_meta(dir, &l.v[i], job_id, &meta[i]);
    if (!ok[i] || meta[i].num_shards != num_shards || meta[i].index != index ||
        meta[i].set_id == 0)
      continue;
    if (has_set(keep_sets, (size_t)n_keep, meta[i].set_id) && meta[i].written_ms > newest_kept)
      newest_kept = meta[i].written_ms;
  }
  for (size_t i = 0; i < l.n; i++) {
    if (!ok[i]) continue;
    const ps_ckpt_meta *m = &meta[i];
    int drop = 0;
    if (m->num_shards != num_shards) {
      drop = drop_other_s;
    } else if (m->index == index) {
      if (m->set_id == 0) {
        drop = m->written_ms < newest_kept;
      } else if (m->set_id != current) {
        /* Only a set older than the newest kept one: shard 0 named the
         * sets it knew complete when it began this set, and a newer one
         * may have completed since (a coordinator before it, deposed in
         * the middle of a cut, or the one after it while this CUT waited). */
        drop = m->set_id < newest_set && !has_set(keep_sets, (size_t)n_keep, m->set_id);
      }
    }
    if (!drop) continue;
    char path[PS_CKPT_PATHLEN];
    if (join_path(path, dir, l.v[i].name, NULL) != PS_OK) continue;
    if (unlink(path) != 0) {
      PS_WARN("checkpoint: cannot delete old checkpoint '%s': %s", path, strerror(errno));
      continue;
    }
    if (deleted) (*deleted)++;
  }
  free(meta);
  free(ok);
  list_free(&l);
  return PS_OK;
}

int ps_ckpt_drop_sets(const char *dir, int index, int num_shards, const char *job_id,
                      const uint64_t *drop, int n_drop, const uint64_t *keep_sets, int n_keep,
                      uint64_t current, int *deleted, int *whole, char *err) {
  if (deleted) *deleted = 0;
  if (whole) *whole = 0;
  if (!dir || !job_id || num_shards < 1 || index < 0 || index >= num_shards || n_drop < 0 ||
      n_keep < 0 || (n_drop > 0 && !drop) || (n_keep > 0 && !keep_sets))
    return ps_seterr(err, PS_EINVAL, "checkpoint sets: bad arguments to drop");
  if (n_drop == 0) return PS_OK;
  ckpt_list l;
  ps_ckpt_meta *meta;
  char *ok;
  int rc = list_for_headers(dir, &l, &meta, &ok, err);
  if (rc == PS_ENOTFOUND) return PS_OK;
  if (rc) return rc;
  /* The headers of this layout's files of the job, every shard's: a set
   * named whose files every shard has now is complete after all. */
  for (size_t i = 0; i < l.n; i++)
    ok[i] = (char)(l.v[i].num_shards == num_shards &&
                   job_entry_meta(dir, &l.v[i], job_id, &meta[i]) && meta[i].set_id != 0);
  for (size_t i = 0; i < l.n; i++) {
    const ps_ckpt_meta *m = &meta[i];
    if (!ok[i] || m->index != index || m->set_id == current ||
        !has_set(drop, (size_t)n_drop, m->set_id) || has_set(keep_sets, (size_t)n_keep, m->set_id))
      continue;
    int everywhere = 1;
    for (int t = 0; t < num_shards && everywhere; t++) {
      int has = t == index;
      for (size_t j = 0; j < l.n && !has; j++)
        has = ok[j] && meta[j].index == t && meta[j].set_id == m->set_id;
      everywhere = has;
    }
    if (everywhere) {
      if (whole) (*whole)++;
      continue;
    }
    char path[PS_CKPT_PATHLEN];
    if (join_path(path, dir, l.v[i].name, NULL) != PS_OK) continue;
    if (unlink(path) != 0) {
      PS_WARN("checkpoint: cannot delete '%s' of the incomplete set %" PRIu64 ": %s", path,
              m->set_id, strerror(errno));
      continue;
    }
    if (deleted) (*deleted)++;
  }
  free(meta);
  free(ok);
  list_free(&l);
  return PS_OK;
}

int ps_ckpt_sets_to_drop(const uint64_t *const *on_disk, const size_t *n_on_disk, int S,
                         const uint64_t *complete, int n_complete, uint64_t *drop, int max) {
  int n = 0;
  for (int s = 0; s < S; s++)
    for (size_t i = 0; i < n_on_disk[s]; i++) {
      uint64_t id = on_disk[s][i];
      if (has_set(drop, (size_t)n, id) || has_set(complete, (size_t)n_complete, id)) continue;
      int everywhere = 1;
      for (int t = 0; t < S && everywhere; t++) everywhere = has_set(on_disk[t], n_on_disk[t], id);
      if (!everywhere && n < max) drop[n++] = id;
    }
  return n;
}

static int u64_desc(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}

int ps_ckpt_list_sets(const char *dir, int index, int num_shards, const char *job_id,
                      uint64_t *sets, int max, int *n, char *err) {
  *n = 0;
  if (!dir || !job_id || num_shards < 1 || index < 0 || index >= num_shards || max < 0 ||
      (max > 0 && !sets))
    return ps_seterr(err, PS_EINVAL, "checkpoint sets: bad arguments");
  ckpt_list l;
  int rc = list_dir(dir, index, num_shards, &l, err);
  if (rc == PS_ENOTFOUND) return PS_OK;
  if (rc) return rc;
  uint64_t *ids = malloc((l.n ? l.n : 1) * sizeof *ids);
  if (!ids) {
    list_free(&l);
    return ps_seterr(err, PS_ENOMEM, "out of memory listing '%s'", dir);
  }
  size_t k = 0;
  for (size_t i = 0; i < l.n; i++) {
    ps_ckpt_meta m; /* list_dir kept this shard's names: the header must agree */
    if (job_entry_meta(dir, &l.v[i], job_id, &m) && m.set_id != 0) ids[k++] = m.set_id;
  }
  list_free(&l);
  qsort(ids, k, sizeof *ids, u64_desc);
  for (size_t i = 0; i < k && *n < max; i++)
    if (i == 0 || ids[i] != ids[i - 1]) sets[(*n)++] = ids[i];
  free(ids);
  return PS_OK;
}

/* ---------------------------------------------------------------- tables */

static const uint8_t TABLES_MAGIC[4] = {'P', 'S', 'T', 'B'};
enum { TABLES_VERSION = 1, TABLES_PREAMBLE = 16, TABLE_HEAD = 72 };

static size_t table_rec_bytes(int dim, int n_slots) {
  return 12 + 4 * (size_t)dim * (size_t)(1 + n_slots);
}

int ps_ckpt_tables_parse(const void *sec, size_t len, const char *what, ps_ckpt_table *out,
                         int *n, char *err) {
  const uint8_t *p = sec;
  *n = 0;
  if (len < TABLES_PREAMBLE || memcmp(p, TABLES_MAGIC, sizeof TABLES_MAGIC) != 0)
    return ps_seterr(err, PS_EINVAL, "'%s': its tables section (%zu bytes) has no 'PSTB' magic",
                     what, len);
  uint32_t version = ps_get_le32(p + 4), nt = ps_get_le32(p + 8);
  if (version != TABLES_VERSION)
    return ps_seterr(err, PS_EINVAL,
                     "'%s': tables section version %" PRIu32 ", this build reads %d: written by a "
                     "newer version",
                     what, version, TABLES_VERSION);
  if (nt > PS_MAX_TABLES || ps_get_le32(p + 12) != 0)
    return ps_seterr(err, PS_EINVAL, "'%s': tables section names %" PRIu32 " tables (at most %d)",
                     what, nt, PS_MAX_TABLES);
  size_t at = TABLES_PREAMBLE;
  for (uint32_t i = 0; i < nt; i++) {
    ps_ckpt_table *t = &out[i];
    memset(t, 0, sizeof *t);
    if (len - at < TABLE_HEAD)
      return ps_seterr(err, PS_EINVAL, "'%s': tables section ends inside table %" PRIu32 "'s header",
                       what, i);
    const uint8_t *h = p + at;
    memcpy(t->name, h, sizeof t->name);
    memcpy(t->optimizer, h + 32, sizeof t->optimizer);
    t->rows = ps_get_le64(h + 48);
    uint32_t dim = ps_get_le32(h + 56), k = ps_get_le32(h + 60);
    t->n = ps_get_le64(h + 64);
    if (!name_field_ok(t->name, sizeof t->name) || !ps_table_name_ok(t->name) ||
        !name_field_ok(t->optimizer, sizeof t->optimizer) || dim < 1 ||
        dim > PS_TABLE_MAX_DIM || k > PS_CKPT_MAX_SLOTS)
      return ps_seterr(err, PS_EINVAL,
                       "'%s': table %" PRIu32 " of its tables section has a bad header (name, "
                       "dim %" PRIu32 " or %" PRIu32 " slots)",
                       what, i, dim, k);
    for (uint32_t j = 0; j < i; j++)
      if (strcmp(out[j].name, t->name) == 0)
        return ps_seterr(err, PS_EINVAL, "'%s': table '%s' twice in its tables section", what,
                         t->name);
    t->dim = (int)dim;
    t->n_slots = (int)k;
    t->rec_bytes = table_rec_bytes(t->dim, t->n_slots);
    at += TABLE_HEAD;
    if (t->n > (len - at) / t->rec_bytes)
      return ps_seterr(err, PS_EINVAL,
                       "'%s': table '%s' says %" PRIu64 " rows, its tables section holds at most "
                       "%zu: truncated or corrupt",
                       what, t->name, t->n, (len - at) / t->rec_bytes);
    t->recs = p + at;
    size_t vals = (size_t)t->dim * (size_t)(1 + t->n_slots);
    for (uint64_t r = 0; r < t->n; r++) {
      const uint8_t *rec = t->recs + r * t->rec_bytes;
      uint64_t id = ps_get_le64(rec);
      if (t->rows && id >= t->rows)
        return ps_seterr(err, PS_EINVAL,
                         "'%s': table '%s' holds row %" PRIu64 ", beyond its %" PRIu64 " rows",
                         what, t->name, id, t->rows);
      for (size_t v = 0; v < vals; v++) {
        float x;
        memcpy(&x, rec + 12 + 4 * v, sizeof x);
        if (!isfinite(x))
          return ps_seterr(err, PS_EINVAL, "'%s': table '%s', row %" PRIu64 " holds a NaN or Inf",
                           what, t->name, id);
      }
    }
    at += (size_t)t->n * t->rec_bytes;
  }
  if (at != len)
    return ps_seterr(err, PS_EINVAL, "'%s': its tables section has %zu bytes after its last table",
                     what, len - at);
  *n = (int)nt;
  return PS_OK;
}

uint64_t ps_ckpt_table_row(const ps_ckpt_table *t, uint64_t r, uint32_t *count, float *rec) {
  const uint8_t *p = t->recs + r * t->rec_bytes;
  *count = ps_get_le32(p + 8);
  memcpy(rec, p + 12, t->rec_bytes - 12);
  return ps_get_le64(p);
}

static int builder_room(ps_ckpt_tables_builder *b, size_t more) {
  if (b->failed) return b->failed;
  if (more <= b->cap - b->len) return PS_OK;
  if (more > SIZE_MAX / 4 - b->len)
    return b->failed = ps_seterr(b->err, PS_ENOMEM, "tables section too large");
  /* Twice the room (rows beyond the hint), at least what is asked. */
  size_t need = b->len + more, cap = b->cap ? 2 * b->cap : 256;
  if (cap < need) cap = need;
  uint8_t *nb = realloc(b->buf, cap);
  if (!nb)
    return b->failed = ps_seterr(b->err, PS_ENOMEM, "out of memory for %zu bytes of table rows",
                                 cap);
  b->buf = nb;
  b->cap = cap;
  return PS_OK;
}

/* Completes the current table's header with its row count. */
static void builder_close_table(ps_ckpt_tables_builder *b) {
  if (b->n_tables > 0) ps_put_le64(b->buf + b->head + 64, b->n);
}

void ps_ckpt_tables_begin(ps_ckpt_tables_builder *b, size_t bytes_hint) {
  memset(b, 0, sizeof *b);
  if (builder_room(b, TABLES_PREAMBLE + bytes_hint) != PS_OK) return;
  memcpy(b->buf, TABLES_MAGIC, sizeof TABLES_MAGIC);
  ps_put_le32(b->buf + 4, TABLES_VERSION);
  ps_put_le32(b->buf + 8, 0);
  ps_put_le32(b->buf + 12, 0);
  b->len = TABLES_PREAMBLE;
}

int ps_ckpt_tables_add_table(ps_ckpt_tables_builder *b, const char *name, const char *optimizer,
                             uint64_t rows, int dim, int n_slots) {
  if (b->failed) return b->failed;
  if (b->n_tables >= PS_MAX_TABLES || !ps_table_name_ok(name) || strlen(optimizer) > 15 ||
      dim < 1 || dim > PS_TABLE_MAX_DIM || n_slots < 0 || n_slots > PS_CKPT_MAX_SLOTS)
    return b->failed = ps_seterr(b->err, PS_EINVAL,
                                 "checkpoint: table '%.32s' (dim %d, %d slots, optimizer '%.16s') "
                                 "cannot be written, or more than %d tables",
                                 name, dim, n_slots, optimizer, PS_MAX_TABLES);
  int rc = builder_room(b, TABLE_HEAD);
  if (rc) return rc;
  builder_close_table(b);
  uint8_t *h = b->buf + b->len;
  memset(h, 0, TABLE_HEAD);
  memcpy(h, name, strlen(name));
  memcpy(h + 32, optimizer, strlen(optimizer));
  ps_put_le64(h + 48, rows);
  ps_put_le32(h + 56, (uint32_t)dim);
  ps_put_le32(h + 60, (uint32_t)n_slots);
  b->head = b->len;
  b->len += TABLE_HEAD;
  b->n = 0;
  b->rec_bytes = table_rec_bytes(dim, n_slots);
  b->n_tables++;
  ps_put_le32(b->buf + 8, (uint32_t)b->n_tables);
  return PS_OK;
}

int ps_ckpt_tables_add_row(ps_ckpt_tables_builder *b, uint64_t id, uint32_t count,
                           const float *rec) {
  if (b->failed) return b->failed;
  if (b->n_tables == 0)
    return b->failed = ps_seterr(b->err, PS_EINVAL, "checkpoint: a table row before any table");
  int rc = builder_room(b, b->rec_bytes);
  if (rc) return rc;
  uint8_t *p = b->buf + b->len;
  ps_put_le64(p, id);
  ps_put_le32(p + 8, count);
  memcpy(p + 12, rec, b->rec_bytes - 12);
  b->len += b->rec_bytes;
  b->n++;
  return PS_OK;
}

int ps_ckpt_tables_finish(ps_ckpt_tables_builder *b, void **out, size_t *len, char *err) {
  *out = NULL;
  *len = 0;
  int rc = b->failed;
  if (rc) {
    ps_seterr(err, rc, "%s", b->err);
    free(b->buf);
  } else {
    builder_close_table(b);
    *out = b->buf;
    *len = b->len;
  }
  memset(b, 0, sizeof *b);
  return rc;
}

/* ---------------------------------------------------------------- export */

/* A .npy file of values of `elem` bytes described by descr ('<f4', '<u8'). */
static int npy_write(const char *path, const char *descr, size_t elem, const void *data,
                     const size_t *shape, int ndim, char *err) {
  if (!path || ndim < 0 || ndim > 8 || (ndim > 0 && !shape))
    return ps_seterr(err, PS_EINVAL, "npy: bad arguments");
  /* The header text as NumPy writes it: a Python dict literal, then spaces
   * and '\n' up to a multiple of 64 bytes counted from the file's start. */
  char hdr[512];
  int len = snprintf(hdr, sizeof hdr, "{'descr': '%s', 'fortran_order': False, 'shape': (", descr);
  size_t count = 1;
  for (int i = 0; i < ndim; i++) {
    if (shape[i] != 0 && count > SIZE_MAX / elem / shape[i])
      return ps_seterr(err, PS_EINVAL, "npy '%s': shape too large", path);
    count *= shape[i];
    len += snprintf(hdr + len, sizeof hdr - (size_t)len, i ? ", %zu" : "%zu", shape[i]);
  }
  len += snprintf(hdr + len, sizeof hdr - (size_t)len, "%s), }", ndim == 1 ? "," : "");
  const int prefix = 10; /* magic (6), version (2), header length (2) */
  int total = prefix + len + 1;
  int pad = (64 - total % 64) % 64;
  memset(hdr + len, ' ', (size_t)pad);
  len += pad;
  hdr[len++] = '\n';
  if (count > 0 && !data) return ps_seterr(err, PS_EINVAL, "npy '%s': no data given", path);

  uint8_t pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, 0, 0};
  pre[8] = (uint8_t)(len & 0xff);
  pre[9] = (uint8_t)(len >> 8);
  char tmp[PS_CKPT_PATHLEN];
  int fd = open_temp(path, tmp, err);
  if (fd < 0) return fd;
  int e = write_all(fd, pre, sizeof pre);
  if (!e) e = write_all(fd, hdr, (size_t)len);
  if (!e && count) e = write_all(fd, data, count * elem);
  if (e) {
    close(fd);
    unlink(tmp);
    return ps_seterr(err, PS_EIO, "cannot write '%s': %s", tmp, strerror(e));
  }
  return commit_temp(fd, tmp, path, err);
}

int ps_npy_write(const char *path, const float *data, const size_t *shape, int ndim, char *err) {
  return npy_write(path, "<f4", sizeof(float), data, shape, ndim, err);
}

int ps_npy_write_u64(const char *path, const uint64_t *data, const size_t *shape, int ndim,
                     char *err) {
  return npy_write(path, "<u8", sizeof(uint64_t), data, shape, ndim, err);
}

static int export_tensor(const char *out_dir, const char *layer, const char *suffix,
                         const float *data, const size_t *shape, int ndim, size_t count, int *files,
                         char *err) {
  size_t prod = 1;
  for (int i = 0; i < ndim; i++) prod *= shape[i];
  if (prod != count)
    return ps_seterr(err, PS_EINVAL, "%s: shape holds %zu values, the layout %zu", layer, prod,
                     count);
  char name[64], path[PS_CKPT_PATHLEN];
  snprintf(name, sizeof name, "%s.%s.npy", layer, suffix);
  int rc = join_path(path, out_dir, name, err);
  if (rc == PS_OK) rc = ps_npy_write(path, data, shape, ndim, err);
  if (rc == PS_OK && files) (*files)++;
  return rc;
}

int ps_ckpt_export_npy(const ps_model_spec *spec, const float *params, const char *out_dir,
                       int *files_written, char *err) {
  if (files_written) *files_written = 0;
  if (!spec || !out_dir || (spec->n_params > 0 && !params))
    return ps_seterr(err, PS_EINVAL, "export: no model, parameters or directory given");
  if (mkdir(out_dir, 0777) != 0) {
    struct stat st;
    if (errno != EEXIST || stat(out_dir, &st) != 0 || !S_ISDIR(st.st_mode))
      return ps_seterr(err, PS_EIO, "cannot create directory '%s': %s", out_dir,
                       errno == EEXIST ? "a file of that name exists" : strerror(errno));
  }
  for (int i = 0; i < spec->n_layers; i++) {
    const ps_layer *L = &spec->layers[i];
    if (L->w_count == 0 && L->b_count == 0) continue;
    if (L->w_off > spec->n_params || L->w_count > spec->n_params - L->w_off ||
        L->b_off > spec->n_params || L->b_count > spec->n_params - L->b_off ||
        L->s_off > spec->n_params || L->s_count > spec->n_params - L->s_off)
      return ps_seterr(err, PS_EINVAL, "export: %s lies outside the %zu parameters", L->name,
                       spec->n_params);
    size_t wshape[4], bshape[1] = {L->b_count};
    int wdim;
    if (L->type == PS_LAYER_CONV2D) {
      wshape[0] = (size_t)L->filters;
      wshape[1] = (size_t)L->in_c;
      wshape[2] = wshape[3] = (size_t)L->kernel;
      wdim = 4;
    } else if (L->type == PS_LAYER_DENSE) {
      wshape[0] = (size_t)L->units;
      wshape[1] = (size_t)L->in_c * (size_t)L->in_h * (size_t)L->in_w;
      wdim = 2;
    } else {
      wshape[0] = L->w_count;
      wdim = 1;
    }
    int rc;
    if (L->type == PS_LAYER_BATCHNORM) {
      /* Keras's names for the four (C) vectors, in model.get_weights()
       * order: gamma and beta where w and b are, the moving mean and
       * variance the two halves of s. */
      const size_t c = L->w_count, cshape[1] = {c};
      if ((rc = export_tensor(out_dir, L->name, "gamma", params + L->w_off, cshape, 1,
                              L->w_count, files_written, err)) ||
          (rc = export_tensor(out_dir, L->name, "beta", params + L->b_off, cshape, 1, L->b_count,
                              files_written, err)) ||
          (rc = export_tensor(out_dir, L->name, "moving_mean", params + L->s_off, cshape, 1,
                              L->s_count / 2, files_written, err)) ||
          (rc = export_tensor(out_dir, L->name, "moving_variance", params + L->s_off + c, cshape,
                              1, L->s_count - L->s_count / 2, files_written, err)))
        return rc;
      continue;
    }
    /* A conv2d or dense without a bias (b_count 0) has no b file. */
    if (L->w_count && (rc = export_tensor(out_dir, L->name, "w", params + L->w_off, wshape, wdim,
                                          L->w_count, files_written, err)))
      return rc;
    if (L->b_count && (rc = export_tensor(out_dir, L->name, "b", params + L->b_off, bshape, 1,
                                          L->b_count, files_written, err)))
      return rc;
  }
  return fsync_dir(out_dir, err);
}
