/* Shard checkpoints (ps/ckpt/checkpoint.c): the byte layout, round trips,
 * retention, refusal of damaged files with a message that says so, the
 * search for the newest usable checkpoint, restoring onto another number of
 * shards, failed writes that leave nothing behind, and the .npy export;
 * set ids and cut records (format 2), format 1 files, the choice of a
 * consistent group to restore from, the pruning of sets, and the deletion
 * of sets that will not be complete (which shard 0 names, which a shard
 * deletes).
 * Everything happens in a mkdtemp directory removed at the end. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "common/crc32c.h"
#include "common/model_spec.h"
#include "common/util.h"
#include "ps/ckpt/checkpoint.h"

static char g_root[256]; /* the test's temporary directory */

/* ---------------------------------------------------------------- helpers */

static void rm_tree(const char *path) {
  struct stat st;
  if (lstat(path, &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    DIR *d = opendir(path);
    if (d) {
      struct dirent *de;
      while ((de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        char sub[1024];
        snprintf(sub, sizeof sub, "%s/%s", path, de->d_name);
        rm_tree(sub);
      }
      closedir(d);
    }
    rmdir(path);
  } else {
    unlink(path);
  }
}

/* A new, empty directory under the root. */
static void fresh_dir(char *out, size_t len, const char *name) {
  snprintf(out, len, "%s/%s", g_root, name);
  rm_tree(out);
  CHECK(mkdir(out, 0777) == 0);
}

/* Entries of dir other than . and ..; those starting with prefix when it
 * is not NULL. */
static int count_entries(const char *dir, const char *prefix) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  struct dirent *de;
  while ((de = readdir(d)) != NULL) {
    if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
    if (prefix && strncmp(de->d_name, prefix, strlen(prefix)) != 0) continue;
    n++;
  }
  closedir(d);
  return n;
}

static int exists(const char *dir, const char *name) {
  char p[1024];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  struct stat st;
  return stat(p, &st) == 0;
}

static void remove_in(const char *dir, const char *name) {
  char p[1024];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  CHECK_MSG(unlink(p) == 0, "unlink %s", p);
}

static int write_file(const char *path, const void *buf, size_t len) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  size_t w = len ? fwrite(buf, 1, len, f) : 0;
  return fclose(f) == 0 && w == len ? 0 : -1;
}

static uint32_t le32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t le64(const uint8_t *p) { return le32(p) | (uint64_t)le32(p + 4) << 32; }

/* Notes collected from the search functions. */
typedef struct {
  int n;
  char msg[64][1024];
  int level[64];
} notes;

static void collect_note(int level, const char *msg, void *user) {
  notes *ns = user;
  if (ns->n < 64) {
    snprintf(ns->msg[ns->n], sizeof ns->msg[0], "%s", msg);
    ns->level[ns->n++] = level;
  }
}

/* A note that contains both a and b (b may be NULL). */
static int has_note(const notes *ns, const char *a, const char *b) {
  for (int i = 0; i < ns->n; i++)
    if (strstr(ns->msg[i], a) && (!b || strstr(ns->msg[i], b))) return 1;
  return 0;
}

static void dump_notes(const notes *ns) {
  for (int i = 0; i < ns->n; i++) fprintf(stderr, "  note[%d]: %s\n", i, ns->msg[i]);
}

/* The model-wide arrays a test checkpoints: values that differ everywhere
 * and per array, so a misplaced copy shows. */
typedef struct {
  size_t P;
  int n_slots;
  float *params;
  float *slots[PS_CKPT_MAX_SLOTS];
} model_state;

static model_state model_make(size_t P, int n_slots, float sign) {
  model_state m = {P, n_slots, NULL, {NULL}};
  m.params = malloc((P ? P : 1) * sizeof(float));
  for (size_t i = 0; i < P; i++) m.params[i] = sign * ((float)i * 0.25f - 7.0f);
  for (int k = 0; k < n_slots; k++) {
    m.slots[k] = malloc((P ? P : 1) * sizeof(float));
    for (size_t i = 0; i < P; i++) m.slots[k][i] = sign * (1000.0f * (float)(k + 1) + (float)i);
  }
  return m;
}

static void model_free(model_state *m) {
  free(m->params);
  for (int k = 0; k < m->n_slots; k++) free(m->slots[k]);
}

/* A checkpoint view of shard index of S of the model (arrays borrowed). */
static ps_ckpt shard_view(const model_state *m, const char *job, const char *opt, int index, int S,
                          uint64_t version) {
  ps_ckpt ck;
  memset(&ck, 0, sizeof ck);
  ck.meta.index = index;
  ck.meta.num_shards = S;
  ck.meta.P = m->P;
  ps_shard_range(m->P, S, index, &ck.meta.begin, &ck.meta.end);
  ck.meta.version = version;
  snprintf(ck.meta.optimizer, sizeof ck.meta.optimizer, "%s", opt);
  snprintf(ck.meta.job_id, sizeof ck.meta.job_id, "%s", job);
  ck.params = m->params + ck.meta.begin;
  ck.n_slots = m->n_slots;
  for (int k = 0; k < m->n_slots; k++) ck.slots[k] = m->slots[k] + ck.meta.begin;
  return ck;
}

static int write_shard(const char *dir, const model_state *m, const char *job, const char *opt,
                       int index, int S, uint64_t version, int keep) {
  ps_ckpt ck = shard_view(m, job, opt, index, S, version);
  char err[PS_ERRLEN] = "";
  int rc = ps_ckpt_write(dir, &ck, keep, NULL, err);
  CHECK_MSG(rc == PS_OK, "write shard %d of %d v%llu: %s", index, S, (unsigned long long)version,
            err);
  return rc;
}

/* Flips one byte of dir/name in place. */
static void flip_byte(const char *dir, const char *name, long at_from_end) {
  char p[1024];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  char *buf;
  size_t len;
  char err[PS_ERRLEN];
  if (ps_read_file(p, &buf, &len, err) != PS_OK) {
    CHECK_MSG(0, "%s", err);
    return;
  }
  buf[len - (size_t)at_from_end] ^= 0x20;
  CHECK(write_file(p, buf, len) == 0);
  free(buf);
}

/* ---------------------------------------------------------------- crc */

static void test_crc32c(void) {
  /* The check value of CRC-32C, and 32 zero bytes (RFC 3720, B.4). */
  CHECK(ps_crc32c(0, "123456789", 9) == 0xE3069283u);
  CHECK(ps_crc32c_sw(0, "123456789", 9) == 0xE3069283u);
  uint8_t z[32] = {0};
  CHECK(ps_crc32c(0, z, 32) == 0x8A9136AAu);
  uint8_t ff[32];
  memset(ff, 0xff, sizeof ff);
  CHECK(ps_crc32c(0, ff, 32) == 0x62A8AB43u);
  CHECK(ps_crc32c(0, NULL, 0) == 0);
  /* Hardware and tables agree at every length and alignment, and pieces
   * chain. */
  uint8_t buf[300];
  for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)(i * 131u + 7u);
  int bad = 0;
  for (size_t off = 0; off < 9; off++)
    for (size_t len = 0; len + off <= sizeof buf; len += 7) {
      uint32_t a = ps_crc32c(0, buf + off, len), b = ps_crc32c_sw(0, buf + off, len);
      uint32_t c = ps_crc32c(ps_crc32c(0, buf + off, len / 3), buf + off + len / 3, len - len / 3);
      bad += a != b || a != c;
    }
  CHECK_MSG(bad == 0, "%d mismatches", bad);
}

/* ---------------------------------------------------------------- layout */

static void test_round_trip(void) {
  char dir[512], err[PS_ERRLEN] = "", path[PS_CKPT_PATHLEN] = "";
  fresh_dir(dir, sizeof dir, "roundtrip");
  model_state m = model_make(1000, 2, 1.0f);
  ps_ckpt ck = shard_view(&m, "job-a", "adam", 1, 3, 42);
  static const char extra[] = "lease\0state\xff\x01";
  ck.extra = (void *)extra;
  ck.extra_len = sizeof extra; /* 15, with the embedded and final NULs */
  double before_ms = ps_wall_s() * 1000.0;
  int rc = ps_ckpt_write(dir, &ck, 0, path, err);
  CHECK_MSG(rc == PS_OK, "%s", err);
  double after_ms = ps_wall_s() * 1000.0;
  char want[PS_CKPT_PATHLEN];
  snprintf(want, sizeof want, "%s/shard-1-of-3-v42.ckpt", dir);
  CHECK_MSG(strcmp(path, want) == 0, "%s", path);
  CHECK(count_entries(dir, NULL) == 1); /* no temporary file left */
  size_t n = ck.meta.end - ck.meta.begin;
  CHECK(ck.meta.begin == 320 && ck.meta.end == 656); /* 1000/3 and 2000/3, rounded to 16 */

  /* The bytes on disk, field by field. */
  char *raw;
  size_t len;
  CHECK(ps_read_file(path, &raw, &len, err) == PS_OK);
  const uint8_t *b = (const uint8_t *)raw;
  size_t E = sizeof extra;
  CHECK(len == 192 + E + n * 4 * 3 + 4);
  CHECK(memcmp(b, "PSCKPT\0\1", 8) == 0);
  CHECK(le32(b + 8) == 2 && le32(b + 12) == 192);
  CHECK(le32(b + 16) == 1 && le32(b + 20) == 3);
  CHECK(le64(b + 24) == 1000 && le64(b + 32) == 320 && le64(b + 40) == 656);
  CHECK(le64(b + 48) == 42);
  CHECK((double)le64(b + 56) >= before_ms - 1 && (double)le64(b + 56) <= after_ms + 1);
  CHECK(le32(b + 64) == 2 && le32(b + 68) == 0 && le64(b + 72) == E);
  CHECK(strcmp(raw + 80, "adam") == 0 && strcmp(raw + 96, "job-a") == 0);
  CHECK(le32(b + 188) == ps_crc32c(0, b, 188));
  CHECK(memcmp(b + 192, extra, E) == 0);
  CHECK(memcmp(b + 192 + E, m.params + 320, n * 4) == 0);
  CHECK(memcmp(b + 192 + E + n * 4, m.slots[0] + 320, n * 4) == 0);
  CHECK(memcmp(b + 192 + E + n * 8, m.slots[1] + 320, n * 4) == 0);
  CHECK(le32(b + len - 4) == ps_crc32c(0, b, len - 4));
  free(raw);

  /* Read back: the same state, bytes equal. */
  ps_ckpt got;
  rc = ps_ckpt_read(path, &got, err);
  CHECK_MSG(rc == PS_OK, "%s", err);
  if (rc == PS_OK) {
    CHECK(got.meta.index == 1 && got.meta.num_shards == 3 && got.meta.P == 1000);
    CHECK(got.meta.begin == 320 && got.meta.end == 656 && got.meta.version == 42);
    CHECK(strcmp(got.meta.optimizer, "adam") == 0 && strcmp(got.meta.job_id, "job-a") == 0);
    CHECK(got.n_slots == 2 && got.extra_len == E);
    CHECK(got.extra && memcmp(got.extra, extra, E) == 0);
    CHECK(memcmp(got.params, m.params + 320, n * 4) == 0);
    CHECK(memcmp(got.slots[0], m.slots[0] + 320, n * 4) == 0);
    CHECK(memcmp(got.slots[1], m.slots[1] + 320, n * 4) == 0);
    CHECK(got.slots[2] == NULL);
  }
  ps_ckpt_free(&got);
  ps_ckpt_free(&got); /* twice is harmless */

  ps_ckpt_meta meta;
  int k = -1;
  size_t elen = 0;
  CHECK(ps_ckpt_read_header(path, &meta, &k, &elen, err) == PS_OK);
  CHECK(meta.version == 42 && k == 2 && elen == E);

  /* No extra, no slots, an empty range. */
  ps_ckpt ck2 = shard_view(&m, "job-a", "sgd", 0, 1, 7);
  ck2.n_slots = 0;
  CHECK(ps_ckpt_write(dir, &ck2, 0, path, err) == PS_OK);
  CHECK(ps_ckpt_read(path, &got, err) == PS_OK);
  CHECK(got.extra == NULL && got.extra_len == 0 && got.n_slots == 0);
  CHECK(got.params && memcmp(got.params, m.params, 1000 * 4) == 0);
  ps_ckpt_free(&got);
  model_state tiny = model_make(8, 1, 1.0f);
  ps_ckpt ck3 = shard_view(&tiny, "job-a", "momentum", 0, 2, 3); /* [0, 0): 8/2 rounds to 0 */
  CHECK(ck3.meta.begin == 0 && ck3.meta.end == 0);
  CHECK(ps_ckpt_write(dir, &ck3, 0, path, err) == PS_OK);
  CHECK(ps_ckpt_read(path, &got, err) == PS_OK);
  CHECK(got.meta.end == 0 && got.n_slots == 1);
  ps_ckpt_free(&got);
  model_free(&tiny);

  /* A large extra blob with every byte value. */
  size_t big = 100000;
  uint8_t *blob = malloc(big);
  for (size_t i = 0; i < big; i++) blob[i] = (uint8_t)(i * 7 + i / 256);
  ck.extra = blob;
  ck.extra_len = big;
  ck.meta.version = 43;
  CHECK(ps_ckpt_write(dir, &ck, 0, path, err) == PS_OK);
  CHECK(ps_ckpt_read(path, &got, err) == PS_OK);
  CHECK(got.extra_len == big && got.extra && memcmp(got.extra, blob, big) == 0);
  CHECK(memcmp(got.params, m.params + 320, n * 4) == 0);
  ps_ckpt_free(&got);
  free(blob);
  model_free(&m);
}

static void test_keep(void) {
  char dir[512];
  fresh_dir(dir, sizeof dir, "keep");
  model_state m = model_make(100, 1, 1.0f);
  /* Neighbours that retention must not touch. */
  write_shard(dir, &m, "job-a", "momentum", 0, 2, 9, 0);     /* newer, from an earlier run */
  write_shard(dir, &m, "other-job", "momentum", 0, 2, 0, 0); /* another job's */
  write_shard(dir, &m, "job-a", "momentum", 1, 2, 1, 0);     /* another shard */
  write_shard(dir, &m, "job-a", "momentum", 1, 2, 2, 0);
  write_shard(dir, &m, "job-a", "momentum", 0, 3, 1, 0); /* another number of shards */
  char other[1024];
  snprintf(other, sizeof other, "%s/shard-0-of-2-v1.ckpt.notes", dir);
  CHECK(write_file(other, "hi", 2) == 0);

  for (uint64_t v = 1; v <= 6; v++) write_shard(dir, &m, "job-a", "momentum", 0, 2, v, 3);
  CHECK(!exists(dir, "shard-0-of-2-v1.ckpt") && !exists(dir, "shard-0-of-2-v2.ckpt") &&
        !exists(dir, "shard-0-of-2-v3.ckpt"));
  CHECK(exists(dir, "shard-0-of-2-v4.ckpt") && exists(dir, "shard-0-of-2-v5.ckpt") &&
        exists(dir, "shard-0-of-2-v6.ckpt"));
  CHECK(exists(dir, "shard-0-of-2-v9.ckpt"));
  CHECK(exists(dir, "shard-0-of-2-v0.ckpt"));
  CHECK(exists(dir, "shard-1-of-2-v1.ckpt") && exists(dir, "shard-1-of-2-v2.ckpt"));
  CHECK(exists(dir, "shard-0-of-3-v1.ckpt"));
  CHECK(exists(dir, "shard-0-of-2-v1.ckpt.notes"));
  CHECK(count_entries(dir, ".") == 0); /* no temporary files */
  CHECK(count_entries(dir, NULL) == 9);

  /* keep = 1: only the new one of this run's line remains. */
  write_shard(dir, &m, "job-a", "momentum", 0, 2, 7, 1);
  CHECK(!exists(dir, "shard-0-of-2-v4.ckpt") && !exists(dir, "shard-0-of-2-v5.ckpt") &&
        !exists(dir, "shard-0-of-2-v6.ckpt"));
  CHECK(exists(dir, "shard-0-of-2-v7.ckpt") && exists(dir, "shard-0-of-2-v9.ckpt"));
  /* keep = 0: nothing deleted. Rewriting a version replaces the file. */
  write_shard(dir, &m, "job-a", "momentum", 0, 2, 8, 0);
  write_shard(dir, &m, "job-a", "momentum", 0, 2, 8, 2);
  CHECK(exists(dir, "shard-0-of-2-v7.ckpt") && exists(dir, "shard-0-of-2-v8.ckpt"));
  CHECK(count_entries(dir, NULL) == 8);
  char err[PS_ERRLEN] = "";
  ps_ckpt ck = shard_view(&m, "job-a", "momentum", 0, 2, 10);
  CHECK(ps_ckpt_write(dir, &ck, -1, NULL, err) == PS_EINVAL);
  model_free(&m);
}

/* ---------------------------------------------------------------- damage */

static void test_corruption(void) {
  char dir[512], err[PS_ERRLEN] = "", path[PS_CKPT_PATHLEN];
  fresh_dir(dir, sizeof dir, "corrupt");
  model_state m = model_make(37, 2, 1.0f);
  ps_ckpt ck = shard_view(&m, "job-a", "adam", 0, 1, 5);
  ck.extra = (void *)"12345";
  ck.extra_len = 5;
  CHECK(ps_ckpt_write(dir, &ck, 0, path, err) == PS_OK);
  char *good;
  size_t len;
  if (ps_read_file(path, &good, &len, err) != PS_OK) {
    CHECK_MSG(0, "%s", err);
    model_free(&m);
    return;
  }
  CHECK(len == 192 + 5 + 37 * 4 * 3 + 4);

  /* Every single flipped byte is refused, each with a message that names
   * the file and says checksum or magic. */
  char bad_path[1024];
  snprintf(bad_path, sizeof bad_path, "%s/damaged.ckpt", dir);
  int accepted = 0, unclear = 0;
  size_t first_unclear = 0;
  char unclear_msg[PS_ERRLEN] = "";
  for (size_t at = 0; at < len; at++) {
    good[at] ^= 0x01;
    CHECK(write_file(bad_path, good, len) == 0);
    good[at] ^= 0x01;
    ps_ckpt got;
    err[0] = '\0';
    int rc = ps_ckpt_read(bad_path, &got, err);
    if (rc == PS_OK) {
      accepted++;
      ps_ckpt_free(&got);
      continue;
    }
    CHECK(got.params == NULL && got.extra == NULL); /* *out zeroed */
    int says = (strstr(err, "checksum mismatch") || strstr(err, "bad magic")) &&
               strstr(err, "damaged.ckpt");
    if (!says && !unclear++) {
      first_unclear = at;
      snprintf(unclear_msg, sizeof unclear_msg, "%s", err);
    }
  }
  CHECK_MSG(accepted == 0, "%d damaged files accepted", accepted);
  CHECK_MSG(unclear == 0, "%d unclear messages, first at byte %zu: %s", unclear, first_unclear,
            unclear_msg);

  /* The messages, in the three regions. */
  struct {
    size_t at;
    const char *says;
    int code;
  } cases[] = {
      {3, "bad magic in", PS_EPROTO},                         /* magic */
      {8, "newer version", PS_EPROTO},                        /* format version */
      {30, "header checksum mismatch", PS_EINVAL},            /* P */
      {100, "the file is corrupt (stored 0x", PS_EINVAL},     /* job id */
      {189, "header checksum mismatch", PS_EINVAL},           /* header checksum */
      {194, "checksum mismatch in", PS_EINVAL},               /* extra */
      {192 + 5 + 60, "checksum mismatch in", PS_EINVAL},      /* parameters */
      {len - 10, "checksum mismatch in", PS_EINVAL},          /* last slot */
      {len - 2, "the file is corrupt (stored 0x", PS_EINVAL}, /* checksum */
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    good[cases[i].at] ^= 0x80;
    CHECK(write_file(bad_path, good, len) == 0);
    good[cases[i].at] ^= 0x80;
    ps_ckpt got;
    int rc = ps_ckpt_read(bad_path, &got, err);
    CHECK_MSG(rc == cases[i].code && strstr(err, cases[i].says), "byte %zu: rc %d: %s", cases[i].at,
              rc, err);
  }
  CHECK(ps_ckpt_read_header(bad_path, &(ps_ckpt_meta){0}, NULL, NULL, err) == PS_OK);
  free(good);
  model_free(&m);
}

static void test_truncated(void) {
  char dir[512], err[PS_ERRLEN] = "", path[PS_CKPT_PATHLEN];
  fresh_dir(dir, sizeof dir, "truncated");
  model_state m = model_make(1000, 1, 1.0f);
  ps_ckpt ck = shard_view(&m, "job-a", "momentum", 0, 1, 5);
  CHECK(ps_ckpt_write(dir, &ck, 0, path, err) == PS_OK);
  char *good;
  size_t len;
  if (ps_read_file(path, &good, &len, err) != PS_OK) {
    CHECK_MSG(0, "%s", err);
    model_free(&m);
    return;
  }
  char cut_path[1024];
  snprintf(cut_path, sizeof cut_path, "%s/cut.ckpt", dir);
  size_t cuts[] = {0, 5, 8, 100, 191, 192, 196, 1200, len - 4, len - 1};
  for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
    CHECK(write_file(cut_path, good, cuts[i]) == 0);
    ps_ckpt got;
    int rc = ps_ckpt_read(cut_path, &got, err);
    CHECK_MSG(rc != PS_OK && strstr(err, "truncated") && strstr(err, "cut.ckpt"), "cut at %zu: %s",
              cuts[i], err);
  }
  /* The message gives the sizes: 4000 bytes of parameters and 4000 of the
   * slot, and what is there. */
  CHECK(write_file(cut_path, good, 1392) == 0);
  ps_ckpt_read(cut_path, &(ps_ckpt){0}, err);
  CHECK_MSG(strstr(err, "header says 8000 bytes") && strstr(err, "file has 1200"), "%s", err);
  /* A byte too many. */
  FILE *f = fopen(cut_path, "wb");
  if (f) {
    fwrite(good, 1, len, f);
    fputc(0, f);
    fclose(f);
  }
  CHECK(ps_ckpt_read(cut_path, &(ps_ckpt){0}, err) == PS_EINVAL);
  CHECK_MSG(strstr(err, "1 bytes longer than its header says"), "%s", err);
  /* Not a file at all. */
  snprintf(cut_path, sizeof cut_path, "%s/missing.ckpt", dir);
  CHECK(ps_ckpt_read(cut_path, &(ps_ckpt){0}, err) == PS_EIO);
  CHECK_MSG(strstr(err, "cannot open") && strstr(err, "missing.ckpt"), "%s", err);
  CHECK(ps_ckpt_read(dir, &(ps_ckpt){0}, err) != PS_OK);
  free(good);
  model_free(&m);
}

/* ---------------------------------------------------------------- search */

static void test_find_latest(void) {
  char dir[512], err[PS_ERRLEN] = "", used[PS_CKPT_PATHLEN] = "";
  fresh_dir(dir, sizeof dir, "find");
  model_state m = model_make(100, 2, 1.0f), other_p = model_make(200, 2, 1.0f);
  notes ns = {0};
  ps_ckpt_source src = {dir, "job-a", 100, "adam", collect_note, &ns, 0};
  ps_ckpt got;

  /* Nothing there yet, or no directory at all: a fresh start. */
  CHECK(ps_ckpt_find_latest(&src, 1, 2, &got, used, err) == PS_ENOTFOUND);
  ps_ckpt_source nodir = src;
  nodir.dir = "/nonexistent/ckpt";
  CHECK(ps_ckpt_find_latest(&nodir, 1, 2, &got, used, err) == PS_ENOTFOUND);
  CHECK_MSG(strstr(err, "/nonexistent/ckpt"), "%s", err);

  write_shard(dir, &m, "job-a", "adam", 1, 2, 10, 0);       /* the good one */
  write_shard(dir, &m, "job-b", "adam", 1, 2, 20, 0);       /* another job */
  write_shard(dir, &other_p, "job-a", "adam", 1, 2, 30, 0); /* another P */
  write_shard(dir, &m, "job-a", "adam", 1, 2, 40, 0);       /* corrupt, below */
  flip_byte(dir, "shard-1-of-2-v40.ckpt", 50);
  write_shard(dir, &m, "job-a", "sgd", 1, 2, 50, 0);  /* another optimizer */
  write_shard(dir, &m, "job-a", "adam", 0, 2, 99, 0); /* another shard */
  write_shard(dir, &m, "job-a", "adam", 1, 3, 99, 0); /* another S */

  int rc = ps_ckpt_find_latest(&src, 1, 2, &got, used, err);
  CHECK_MSG(rc == PS_OK, "%s", err);
  CHECK(got.meta.version == 10 && got.meta.index == 1 && got.meta.num_shards == 2);
  CHECK_MSG(strstr(used, "/shard-1-of-2-v10.ckpt") != NULL, "%s", used);
  size_t b = got.meta.begin, n = got.meta.end - got.meta.begin;
  CHECK(b == 48 && n == 52);
  CHECK(got.params && memcmp(got.params, m.params + b, n * 4) == 0);
  CHECK(got.n_slots == 2 && memcmp(got.slots[1], m.slots[1] + b, n * 4) == 0);
  ps_ckpt_free(&got);
  int ok = has_note(&ns, "v50.ckpt", "optimizer 'sgd'") &&
           has_note(&ns, "v40.ckpt", "checksum mismatch") && has_note(&ns, "v30.ckpt", "P=200") &&
           has_note(&ns, "v20.ckpt", "job 'job-b'") &&
           has_note(&ns, "older checkpoint", "v10.ckpt") &&
           has_note(&ns, "4 newer ones skipped", NULL) && !has_note(&ns, "v99", NULL);
  CHECK(ok);
  if (!ok) dump_notes(&ns);
  for (int i = 0; i < ns.n - 1; i++) CHECK(ns.level[i] == PS_LOG_WARN);

  /* Any optimizer: the newest, v50. */
  src.optimizer = NULL;
  ns.n = 0;
  CHECK(ps_ckpt_find_latest(&src, 1, 2, &got, NULL, err) == PS_OK);
  CHECK(got.meta.version == 50 && strcmp(got.meta.optimizer, "sgd") == 0);
  CHECK(ns.n == 1 && ns.level[0] == PS_LOG_INFO && has_note(&ns, "v50.ckpt", NULL));
  ps_ckpt_free(&got);

  /* Without the good one, none is usable: not a fresh start. */
  src.optimizer = "adam";
  remove_in(dir, "shard-1-of-2-v10.ckpt");
  ns.n = 0;
  rc = ps_ckpt_find_latest(&src, 1, 2, &got, used, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "none of the 4 checkpoints of shard 1 of 2"), "%d %s",
            rc, err);
  CHECK(got.params == NULL);
  /* Only another job's files: a fresh start. */
  ps_ckpt_source job_c = src;
  job_c.job_id = "job-c";
  remove_in(dir, "shard-1-of-2-v40.ckpt");
  remove_in(dir, "shard-1-of-2-v30.ckpt");
  remove_in(dir, "shard-1-of-2-v50.ckpt");
  CHECK(ps_ckpt_find_latest(&job_c, 1, 2, &got, used, err) == PS_ENOTFOUND);
  CHECK(ps_ckpt_find_latest(&src, 2, 2, &got, used, err) == PS_EINVAL);
  model_free(&m);
  model_free(&other_p);
}

/* Loads [begin, end) with n_slots and compares it with the model. */
static int range_equals(const ps_ckpt_source *src, const model_state *m, size_t begin, size_t end,
                        int n_slots, ps_ckpt_restored *info, int want_extra) {
  size_t n = end - begin;
  float *p = malloc((n ? n : 1) * 4), *sl[PS_CKPT_MAX_SLOTS] = {0};
  for (int k = 0; k < n_slots; k++) sl[k] = malloc((n ? n : 1) * 4);
  char err[PS_ERRLEN] = "";
  int rc = ps_ckpt_load_range(src, begin, end, p, sl, n_slots, want_extra, info, err);
  CHECK_MSG(rc == PS_OK, "load [%zu, %zu): %s", begin, end, err);
  int same = rc == PS_OK && memcmp(p, m->params + begin, n * 4) == 0;
  free(info->cut); /* the cut records are checked elsewhere */
  info->cut = NULL;
  for (int k = 0; k < n_slots; k++) same = same && memcmp(sl[k], m->slots[k] + begin, n * 4) == 0;
  free(p);
  for (int k = 0; k < n_slots; k++) free(sl[k]);
  return same;
}

static void test_reshard(void) {
  char dir[512], err[PS_ERRLEN] = "";
  fresh_dir(dir, sizeof dir, "reshard");
  const size_t P = 1000;
  model_state now = model_make(P, 2, 1.0f), old = model_make(P, 2, -1.0f);
  notes ns = {0};
  ps_ckpt_source src = {dir, "job-a", P, "adam", collect_note, &ns, 0};
  ps_ckpt_restored info;

  /* An older complete set with 2 shards, then the current one with 3, its
   * shard 0 carrying the extra state. */
  write_shard(dir, &old, "job-a", "adam", 0, 2, 100, 0);
  write_shard(dir, &old, "job-a", "adam", 1, 2, 101, 0);
  ps_sleep_ms(20); /* write times differ by more than the clock's step */
  uint64_t versions[3] = {7, 9, 8};
  for (int s = 0; s < 3; s++) {
    ps_ckpt ck = shard_view(&now, "job-a", "adam", s, 3, versions[s]);
    if (s == 0) {
      ck.extra = (void *)"leases-v3";
      ck.extra_len = 9;
    }
    CHECK(ps_ckpt_write(dir, &ck, 0, NULL, err) == PS_OK);
  }

  /* Onto 2 shards and onto 1: bytes equal, from the newer set. */
  for (int s = 0; s < 2; s++) {
    size_t b, e;
    ps_shard_range(P, 2, s, &b, &e);
    ns.n = 0;
    CHECK(range_equals(&src, &now, b, e, 2, &info, s == 0));
    CHECK(info.num_shards == 3 && info.version == 9);
    CHECK(info.files_used == 2); /* [0,496) spans old 0 and 1; [496,1000) old 1 and 2 */
    if (s == 0) {
      CHECK(info.extra_len == 9 && info.extra && memcmp(info.extra, "leases-v3", 9) == 0);
      CHECK(has_note(&ns, "shard-0-of-3-v7.ckpt", "[0, 320)") &&
            has_note(&ns, "shard-1-of-3-v9.ckpt", "[320, 496)"));
    } else {
      CHECK(info.extra == NULL);
      CHECK(has_note(&ns, "shard-1-of-3-v9.ckpt", "[496, 656)") &&
            has_note(&ns, "shard-2-of-3-v8.ckpt", "[656, 1000)"));
    }
    free(info.extra);
  }
  ns.n = 0;
  CHECK(range_equals(&src, &now, 0, P, 2, &info, 1));
  CHECK(info.num_shards == 3 && info.files_used == 3 && info.version == 9);
  free(info.extra);
  CHECK(has_note(&ns, "restored [0, 1000) from 3 files of the 3-shard", NULL));
  /* The parameters alone, any optimizer (as ps-export asks). */
  ps_ckpt_source any = src;
  any.optimizer = NULL;
  CHECK(range_equals(&any, &now, 0, P, 0, &info, 0));
  /* Odd ranges: empty, one value, across two boundaries. */
  int same = range_equals(&src, &now, 500, 500, 2, &info, 0);
  CHECK_MSG(same && info.files_used == 0, "%d %d", same, info.files_used);
  CHECK(range_equals(&src, &now, 655, 656, 2, &info, 0) && info.version == 9);

  /* A newer but corrupt checkpoint of one shard: the older one of that
   * shard is used, and a note says so. */
  write_shard(dir, &now, "job-a", "adam", 1, 3, 12, 0);
  flip_byte(dir, "shard-1-of-3-v12.ckpt", 100);
  ns.n = 0;
  CHECK(range_equals(&src, &now, 0, P, 2, &info, 0));
  CHECK(info.num_shards == 3 && info.version == 9);
  int ok = has_note(&ns, "v12.ckpt", "checksum mismatch") &&
           has_note(&ns, "shard-1-of-3-v9.ckpt", "an older one");
  CHECK(ok);
  if (!ok) dump_notes(&ns);

  /* A set with a shard missing gives way to a complete older one... */
  remove_in(dir, "shard-2-of-3-v8.ckpt");
  ns.n = 0;
  CHECK(range_equals(&src, &old, 0, P, 2, &info, 0));
  CHECK(info.num_shards == 2 && info.version == 101);
  /* ...and serves, alone, a range its shards cover. */
  remove_in(dir, "shard-0-of-2-v100.ckpt");
  remove_in(dir, "shard-1-of-2-v101.ckpt");
  ns.n = 0;
  CHECK(range_equals(&src, &now, 0, 600, 2, &info, 0));
  CHECK(info.num_shards == 3 && info.files_used == 2);
  float *buf = malloc(P * 4), *sl[2] = {malloc(P * 4), malloc(P * 4)};
  int rc = ps_ckpt_load_range(&src, 0, P, buf, sl, 2, 0, &info, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "no checkpoint of shard 2"), "%s", err);
  /* Another slot count: nothing fits, and it is not a fresh start. */
  rc = ps_ckpt_load_range(&src, 0, 100, buf, sl, 1, 0, &info, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "fits job 'job-a'"), "%s", err);
  /* Another job only, or no directory: a fresh start. */
  ps_ckpt_source job_c = src;
  job_c.job_id = "job-c";
  CHECK(ps_ckpt_load_range(&job_c, 0, 100, buf, sl, 2, 0, &info, err) == PS_ENOTFOUND);
  job_c.dir = "/nonexistent/ckpt";
  CHECK(ps_ckpt_load_range(&job_c, 0, 100, buf, sl, 2, 0, &info, err) == PS_ENOTFOUND);
  /* Bad arguments. */
  CHECK(ps_ckpt_load_range(&src, 10, 5, buf, sl, 2, 0, &info, err) == PS_ERANGE);
  CHECK(ps_ckpt_load_range(&src, 0, P + 1, buf, sl, 2, 0, &info, err) == PS_ERANGE);
  CHECK(ps_ckpt_load_range(&src, 0, 10, buf, NULL, 2, 0, &info, err) == PS_EINVAL);
  free(buf);
  free(sl[0]);
  free(sl[1]);
  model_free(&now);
  model_free(&old);
}

/* ---------------------------------------------------------------- sets and cuts */

static void put_le32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Recomputes the header checksum (at 188) and the whole file's (the last
 * 4 bytes) of a checkpoint's bytes after an edit. */
static void reseal(uint8_t *b, size_t len) {
  put_le32(b + 188, ps_crc32c(0, b, 188));
  put_le32(b + len - 4, ps_crc32c(0, b, len - 4));
}

/* A model whose values all differ from those of another offset. */
static model_state model_offset(size_t P, int n_slots, float off) {
  model_state m = model_make(P, n_slots, 1.0f);
  for (size_t i = 0; i < P; i++) m.params[i] += off;
  for (int k = 0; k < n_slots; k++)
    for (size_t i = 0; i < P; i++) m.slots[k][i] += off;
  return m;
}

/* Writes shard index of S of the model with a set id and a cut record
 * (cut NULL: none); the file's name (not its directory) goes to name
 * (NULL or PS_CKPT_PATHLEN bytes). */
static int write_set_shard(const char *dir, const model_state *m, const char *job, int index, int S,
                           uint64_t version, uint64_t set_id, const char *cut, char *name) {
  ps_ckpt ck = shard_view(m, job, "momentum", index, S, version);
  ck.meta.set_id = set_id;
  ck.cut = (void *)cut;
  ck.cut_len = cut ? strlen(cut) : 0;
  char err[PS_ERRLEN] = "", path[PS_CKPT_PATHLEN] = "";
  int rc = ps_ckpt_write(dir, &ck, 0, path, err);
  CHECK_MSG(rc == PS_OK, "write shard %d of %d v%llu set %llu: %s", index, S,
            (unsigned long long)version, (unsigned long long)set_id, err);
  if (name) {
    const char *slash = strrchr(path, '/');
    snprintf(name, PS_CKPT_PATHLEN, "%s", slash ? slash + 1 : path);
  }
  return rc;
}

/* A note at level that contains a (and b when not NULL). */
static int has_note_at(const notes *ns, int level, const char *a, const char *b) {
  for (int i = 0; i < ns->n; i++)
    if (ns->level[i] == level && strstr(ns->msg[i], a) && (!b || strstr(ns->msg[i], b))) return 1;
  return 0;
}

/* Loads [0, P) with one slot; 1 when params and slot equal want's. */
static int load_equals(const ps_ckpt_source *src, const model_state *want, ps_ckpt_restored *info) {
  size_t P = want->P;
  float *p = malloc(P * 4), *sl[1] = {malloc(P * 4)};
  char err[PS_ERRLEN] = "";
  int rc = ps_ckpt_load_range(src, 0, P, p, sl, 1, 0, info, err);
  CHECK_MSG(rc == PS_OK, "load [0, %zu): %s", P, err);
  int same = rc == PS_OK && memcmp(p, want->params, P * 4) == 0 &&
             memcmp(sl[0], want->slots[0], P * 4) == 0;
  /* The cut record of the first file comes back with the values. */
  if (rc == PS_OK && info->cut_len > 0) CHECK(info->cut != NULL);
  free(info->cut);
  info->cut = NULL;
  free(p);
  free(sl[0]);
  return same;
}

static void test_set_and_cut(void) {
  char dir[512], err[PS_ERRLEN] = "", path[PS_CKPT_PATHLEN] = "";
  fresh_dir(dir, sizeof dir, "setcut");
  model_state m = model_make(300, 1, 1.0f);
  ps_ckpt ck = shard_view(&m, "job-a", "momentum", 1, 2, 17);
  const uint64_t set_id = 0x0123456789abcdefull;
  static const char extra[] = "xtra";
  static const uint8_t cut[] = {'c', 'u', 't', 0, 0xff, 0x80, 'r', 'e', 'c', 0x01, 0};
  const size_t E = sizeof extra, C = sizeof cut;
  ck.meta.set_id = set_id;
  ck.extra = (void *)extra;
  ck.extra_len = E;
  ck.cut = (void *)cut;
  ck.cut_len = C;
  int rc = ps_ckpt_write(dir, &ck, 0, path, err);
  CHECK_MSG(rc == PS_OK, "%s", err);
  size_t b0 = ck.meta.begin, n = ck.meta.end - ck.meta.begin;

  /* The bytes on disk: set id, cut length and cut checksum in the header,
   * the cut after the extra blob, then the arrays. */
  char *raw;
  size_t len;
  if (ps_read_file(path, &raw, &len, err) != PS_OK) {
    CHECK_MSG(0, "%s", err);
    model_free(&m);
    return;
  }
  uint8_t *b = (uint8_t *)raw;
  CHECK(len == 192 + E + C + n * 4 * 2 + 4);
  CHECK(le32(b + 8) == 2 && PS_CKPT_FORMAT_VERSION == 3); /* no tables: format 2 */
  CHECK(le64(b + 160) == set_id);
  CHECK(le64(b + 168) == C);
  CHECK(le32(b + 176) == ps_crc32c(0, cut, C));
  int zero = 1;
  for (int i = 180; i < 188; i++) zero = zero && b[i] == 0;
  CHECK(zero);
  CHECK(le32(b + 188) == ps_crc32c(0, b, 188));
  CHECK(memcmp(b + 192, extra, E) == 0);
  CHECK(memcmp(b + 192 + E, cut, C) == 0);
  CHECK(memcmp(b + 192 + E + C, m.params + b0, n * 4) == 0);
  CHECK(memcmp(b + 192 + E + C + n * 4, m.slots[0] + b0, n * 4) == 0);
  CHECK(le32(b + len - 4) == ps_crc32c(0, b, len - 4));

  /* Read back: set id and cut record as written. */
  ps_ckpt got;
  rc = ps_ckpt_read(path, &got, err);
  CHECK_MSG(rc == PS_OK, "%s", err);
  if (rc == PS_OK) {
    CHECK(got.meta.set_id == set_id);
    CHECK(got.cut_len == C && got.meta.cut_len == C && got.cut && memcmp(got.cut, cut, C) == 0);
    CHECK(got.meta.cut_crc == ps_crc32c(0, cut, C));
    CHECK(got.extra_len == E && got.extra && memcmp(got.extra, extra, E) == 0);
    CHECK(memcmp(got.params, m.params + b0, n * 4) == 0);
  }
  ps_ckpt_free(&got);
  CHECK(got.cut == NULL && got.cut_len == 0);
  ps_ckpt_meta meta;
  CHECK(ps_ckpt_read_header(path, &meta, NULL, NULL, err) == PS_OK);
  CHECK(meta.set_id == set_id && meta.cut_len == C && meta.cut_crc == ps_crc32c(0, cut, C));

  /* No cut: none read back, zeros in the header. */
  ps_ckpt plain = shard_view(&m, "job-a", "momentum", 0, 2, 3);
  CHECK(ps_ckpt_write(dir, &plain, 0, path, err) == PS_OK);
  CHECK(ps_ckpt_read(path, &got, err) == PS_OK);
  CHECK(got.meta.set_id == 0 && got.cut == NULL && got.cut_len == 0 && got.meta.cut_len == 0);
  ps_ckpt_free(&got);
  char *raw2;
  size_t len2;
  if (ps_read_file(path, &raw2, &len2, err) == PS_OK) {
    const uint8_t *p = (const uint8_t *)raw2;
    CHECK(le64(p + 160) == 0 && le64(p + 168) == 0 && le32(p + 176) == 0);
    free(raw2);
  }

  /* A flipped byte of the cut record: the whole file's checksum says so. */
  char bad_path[1024];
  snprintf(bad_path, sizeof bad_path, "%s/shard-1-of-2-v18.ckpt", dir);
  b[192 + E + 4] ^= 0x10;
  CHECK(write_file(bad_path, raw, len) == 0);
  rc = ps_ckpt_read(bad_path, &got, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "checksum mismatch") && strstr(err, "v18.ckpt"), "%d %s",
            rc, err);
  CHECK(got.cut == NULL && got.params == NULL);
  /* ... and with the whole file's checksum redone, the cut's own in the
   * header does. */
  reseal(b, len);
  CHECK(write_file(bad_path, raw, len) == 0);
  rc = ps_ckpt_read(bad_path, &got, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "cut record"), "%d %s", rc, err);
  b[192 + E + 4] ^= 0x10;
  /* A cut length over the limit in a header: refused before it is used. */
  put_le64(b + 168, (uint64_t)PS_CKPT_MAX_CUT + 1);
  reseal(b, len);
  CHECK(write_file(bad_path, raw, len) == 0);
  rc = ps_ckpt_read(bad_path, &got, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "inconsistent header"), "%d %s", rc, err);
  CHECK(ps_ckpt_read_header(bad_path, &meta, NULL, NULL, err) == PS_EINVAL);
  free(raw);

  /* Writes refused: a cut over PS_CKPT_MAX_CUT, a cut length without
   * bytes; nothing is left in the directory. The largest allowed works. */
  char empty[512];
  fresh_dir(empty, sizeof empty, "setcut-big");
  uint8_t *big = malloc(PS_CKPT_MAX_CUT + 1);
  for (size_t i = 0; i < PS_CKPT_MAX_CUT + 1; i++) big[i] = (uint8_t)(i * 13 + 5);
  ps_ckpt over = shard_view(&m, "job-a", "momentum", 0, 1, 1);
  over.cut = big;
  over.cut_len = PS_CKPT_MAX_CUT + 1;
  err[0] = '\0';
  rc = ps_ckpt_write(empty, &over, 0, NULL, err);
  CHECK_MSG(rc == PS_EINVAL && err[0], "%d %s", rc, err);
  CHECK(count_entries(empty, NULL) == 0);
  over.cut = NULL;
  over.cut_len = 4;
  CHECK(ps_ckpt_write(empty, &over, 0, NULL, err) == PS_EINVAL);
  CHECK(count_entries(empty, NULL) == 0);
  over.cut = big;
  over.cut_len = PS_CKPT_MAX_CUT;
  CHECK(ps_ckpt_write(empty, &over, 0, path, err) == PS_OK);
  CHECK(ps_ckpt_read(path, &got, err) == PS_OK);
  CHECK(got.cut_len == PS_CKPT_MAX_CUT && got.cut && memcmp(got.cut, big, PS_CKPT_MAX_CUT) == 0);
  ps_ckpt_free(&got);
  CHECK(count_entries(empty, NULL) == 1);
  free(big);
  model_free(&m);
}

static void test_format_1(void) {
  char dir[512], err[PS_ERRLEN] = "", path[PS_CKPT_PATHLEN] = "";
  fresh_dir(dir, sizeof dir, "format1");
  const size_t P = 100;
  model_state m = model_offset(P, 1, 50.0f);
  ps_ckpt ck = shard_view(&m, "job-a", "momentum", 0, 1, 9);
  ck.extra = (void *)"old-leases";
  ck.extra_len = 10;
  CHECK(ps_ckpt_write(dir, &ck, 0, path, err) == PS_OK);
  char *raw;
  size_t len;
  if (ps_read_file(path, &raw, &len, err) != PS_OK) {
    CHECK_MSG(0, "%s", err);
    model_free(&m);
    return;
  }
  uint8_t *b = (uint8_t *)raw;
  CHECK(le64(b + 160) == 0 && le64(b + 168) == 0 && le32(b + 176) == 0);
  /* As format 1 wrote it: the same bytes but the version. */
  put_le32(b + 8, 1);
  reseal(b, len);
  CHECK(write_file(path, raw, len) == 0);
  ps_ckpt got;
  int rc = ps_ckpt_read(path, &got, err);
  CHECK_MSG(rc == PS_OK, "%s", err);
  if (rc == PS_OK) {
    CHECK(got.meta.version == 9 && got.meta.set_id == 0 && got.cut == NULL && got.cut_len == 0);
    CHECK(got.extra_len == 10 && memcmp(got.extra, "old-leases", 10) == 0);
    CHECK(memcmp(got.params, m.params, P * 4) == 0 && memcmp(got.slots[0], m.slots[0], P * 4) == 0);
  }
  ps_ckpt_free(&got);
  /* Found and restored. */
  notes ns = {0};
  ps_ckpt_source src = {dir, "job-a", P, "momentum", collect_note, &ns, 0};
  rc = ps_ckpt_find_latest(&src, 0, 1, &got, NULL, err);
  CHECK_MSG(rc == PS_OK && got.meta.version == 9, "%s", err);
  ps_ckpt_free(&got);
  ps_ckpt_restored info;
  CHECK(load_equals(&src, &m, &info));
  CHECK(info.files_used == 1 && info.version == 9 && info.set_id == 0 && info.num_shards == 1);

  /* Format 1 with a set id, or with a cut length: not written by format 1. */
  char bad_path[1024];
  snprintf(bad_path, sizeof bad_path, "%s/f1-bad.ckpt", dir);
  put_le64(b + 160, 7);
  reseal(b, len);
  CHECK(write_file(bad_path, raw, len) == 0);
  rc = ps_ckpt_read(bad_path, &got, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "inconsistent header"), "%d %s", rc, err);
  CHECK(ps_ckpt_read_header(bad_path, &(ps_ckpt_meta){0}, NULL, NULL, err) == PS_EINVAL);
  put_le64(b + 160, 0);
  put_le64(b + 168, 1);
  reseal(b, len);
  CHECK(write_file(bad_path, raw, len) == 0);
  rc = ps_ckpt_read(bad_path, &got, err);
  CHECK_MSG(rc == PS_EINVAL && strstr(err, "inconsistent header"), "%d %s", rc, err);
  /* Format 2 with the same set id is fine; an unknown format is not. */
  put_le64(b + 168, 0);
  put_le64(b + 160, 7);
  put_le32(b + 8, 2);
  reseal(b, len);
  CHECK(write_file(bad_path, raw, len) == 0);
  rc = ps_ckpt_read(bad_path, &got, err);
  CHECK_MSG(rc == PS_OK && got.meta.set_id == 7, "%d %s", rc, err);
  ps_ckpt_free(&got);
  /* Format 3 without rows reads as format 2. */
  put_le32(b + 8, 3);
  reseal(b, len);
  CHECK(write_file(bad_path, raw, len) == 0);
  rc = ps_ckpt_read(bad_path, &got, err);
  CHECK_MSG(rc == PS_OK && got.meta.format == 3 && got.tables == NULL, "%d %s", rc, err);
  ps_ckpt_free(&got);
  put_le32(b + 8, PS_CKPT_FORMAT_VERSION + 1);
  reseal(b, len);
  CHECK(write_file(bad_path, raw, len) == 0);
  rc = ps_ckpt_read(bad_path, &got, err);
  CHECK_MSG(rc == PS_EPROTO && strstr(err, "newer version"), "%d %s", rc, err);
  free(raw);
  model_free(&m);
}

static void test_consistent_groups(void) {
  char dir[512];
  fresh_dir(dir, sizeof dir, "groups");
  const size_t P = 100;
  size_t b1, e1;
  ps_shard_range(P, 2, 1, &b1, &e1);
  CHECK(b1 == 48 && e1 == P);
  model_state s7 = model_offset(P, 1, 100.0f), s8 = model_offset(P, 1, 200.0f);
  model_state solo = model_offset(P, 1, 300.0f), eq = model_offset(P, 1, 400.0f);
  notes ns = {0};
  ps_ckpt_source src = {dir, "job-a", P, "momentum", collect_note, &ns, 0};
  ps_ckpt_restored info;
  char n7a[PS_CKPT_PATHLEN], n7b[PS_CKPT_PATHLEN];

  /* Set 7 complete; set 8 on shard 0 only; then files of both shards
   * written alone, newer still, whose cut records differ. */
  write_set_shard(dir, &s7, "job-a", 0, 2, 10, 7, "cut-A", n7a);
  write_set_shard(dir, &s7, "job-a", 1, 2, 11, 7, "cut-A", n7b);
  ps_sleep_ms(5);
  write_set_shard(dir, &s8, "job-a", 0, 2, 20, 8, "cut-B", NULL);
  ps_sleep_ms(5);
  write_set_shard(dir, &solo, "job-a", 0, 2, 30, 0, "cut-C0", NULL);
  write_set_shard(dir, &solo, "job-a", 1, 2, 31, 0, "cut-C1", NULL);
  int same = load_equals(&src, &s7, &info);
  CHECK(same);
  CHECK_MSG(info.set_id == 7 && info.consistent == 1 && info.num_shards == 2 &&
                info.files_used == 2 && info.version == 11,
            "set %llu consistent %d S %d files %d version %llu", (unsigned long long)info.set_id,
            info.consistent, info.num_shards, info.files_used, (unsigned long long)info.version);
  int ok = has_note_at(&ns, PS_LOG_INFO, "restored [0, 100)", "set 7") &&
           !has_note(&ns, "different moments", NULL) && has_note(&ns, n7a, "[0, 48)") &&
           has_note(&ns, n7b, "[48, 100)");
  CHECK(ok);
  if (!ok || !same) dump_notes(&ns);
  /* A range within one shard too; set 8, on shard 0 only, is no set even
   * for shard 0's range. */
  ns.n = 0;
  CHECK(range_equals(&src, &s7, 50, 90, 1, &info, 0));
  CHECK(info.set_id == 7 && info.consistent == 1 && info.files_used == 1);
  ns.n = 0;
  CHECK(range_equals(&src, &s7, 0, 48, 1, &info, 0));
  CHECK(info.set_id == 7 && info.consistent == 1 && info.files_used == 1);

  /* Newer files written alone with equal cut records: they win. */
  ps_sleep_ms(5);
  write_set_shard(dir, &eq, "job-a", 0, 2, 40, 0, "cut-D", NULL);
  write_set_shard(dir, &eq, "job-a", 1, 2, 41, 0, "cut-D", NULL);
  ns.n = 0;
  same = load_equals(&src, &eq, &info);
  CHECK(same);
  CHECK_MSG(info.set_id == 0 && info.consistent == 1 && info.files_used == 2 && info.version == 41,
            "set %llu consistent %d", (unsigned long long)info.set_id, info.consistent);
  ok = has_note_at(&ns, PS_LOG_INFO, "restored [0, 100)", "equal cut records") &&
       !has_note(&ns, "different moments", NULL) && !has_note(&ns, "set 7", NULL);
  CHECK(ok);
  if (!ok || !same) dump_notes(&ns);

  /* Cut records of equal length but other bytes are not equal: set 7
   * again. */
  ps_sleep_ms(5);
  write_set_shard(dir, &solo, "job-a", 0, 2, 50, 0, "cut-E0", NULL);
  write_set_shard(dir, &solo, "job-a", 1, 2, 51, 0, "cut-E1", NULL);
  ns.n = 0;
  CHECK(load_equals(&src, &s7, &info));
  CHECK(info.set_id == 7 && info.consistent == 1);

  /* A set's time is its oldest file's: set 9 begun first and finished
   * last is older than set 5 written in between. */
  char dir3[512];
  fresh_dir(dir3, sizeof dir3, "groups-time");
  src.dir = dir3;
  write_set_shard(dir3, &s8, "job-a", 0, 2, 1, 9, "cut-9", NULL);
  ps_sleep_ms(5);
  write_set_shard(dir3, &s7, "job-a", 0, 2, 2, 5, "cut-5", NULL);
  write_set_shard(dir3, &s7, "job-a", 1, 2, 2, 5, "cut-5", NULL);
  ps_sleep_ms(5);
  write_set_shard(dir3, &s8, "job-a", 1, 2, 1, 9, "cut-9", NULL);
  ns.n = 0;
  CHECK(load_equals(&src, &s7, &info));
  CHECK_MSG(info.set_id == 5 && info.consistent == 1, "set %llu", (unsigned long long)info.set_id);

  /* Files without cut records (as format 1 wrote them) of different
   * moments: combined, with a warning. */
  char dir2[512];
  fresh_dir(dir2, sizeof dir2, "groups-mixed");
  src.dir = dir2;
  model_state e = model_offset(P, 1, 500.0f), f = model_offset(P, 1, 600.0f);
  write_set_shard(dir2, &e, "job-a", 0, 2, 5, 0, NULL, NULL);
  ps_sleep_ms(5);
  write_set_shard(dir2, &f, "job-a", 1, 2, 6, 0, NULL, NULL);
  model_state want = model_offset(P, 1, 0.0f);
  memcpy(want.params, e.params, b1 * 4);
  memcpy(want.params + b1, f.params + b1, (P - b1) * 4);
  memcpy(want.slots[0], e.slots[0], b1 * 4);
  memcpy(want.slots[0] + b1, f.slots[0] + b1, (P - b1) * 4);
  ns.n = 0;
  same = load_equals(&src, &want, &info);
  CHECK(same);
  CHECK_MSG(info.consistent == 0 && info.set_id == 0 && info.files_used == 2 && info.version == 6,
            "consistent %d set %llu", info.consistent, (unsigned long long)info.set_id);
  ok = has_note_at(&ns, PS_LOG_WARN, "restored [0, 100)", "different moments");
  CHECK(ok);
  if (!ok || !same) dump_notes(&ns);
  /* Both without a cut record and of one moment is no proof: still mixed. */
  write_set_shard(dir2, &e, "job-a", 1, 2, 7, 0, NULL, NULL);
  ns.n = 0;
  CHECK(load_equals(&src, &e, &info));
  CHECK(info.consistent == 0 && has_note_at(&ns, PS_LOG_WARN, "different moments", NULL));
  /* One shard's file written alone, without a cut record (a starting
   * checkpoint from ps-import-keras): one moment by itself, no warning. */
  char dir4[512];
  fresh_dir(dir4, sizeof dir4, "groups-one");
  src.dir = dir4;
  write_set_shard(dir4, &f, "job-a", 0, 1, 0, 0, NULL, NULL);
  ns.n = 0;
  CHECK(load_equals(&src, &f, &info));
  CHECK_MSG(info.consistent == 1 && info.files_used == 1 && info.version == 0 &&
                !has_note_at(&ns, PS_LOG_WARN, "different moments", NULL),
            "consistent %d files %d", info.consistent, info.files_used);
  src.dir = dir2;

  model_free(&want);
  model_free(&e);
  model_free(&f);
  model_free(&s7);
  model_free(&s8);
  model_free(&solo);
  model_free(&eq);
}

static void test_corrupt_set(void) {
  char dir[512];
  fresh_dir(dir, sizeof dir, "corrupt-set");
  const size_t P = 100;
  model_state s3 = model_offset(P, 1, 30.0f), s4 = model_offset(P, 1, 40.0f);
  notes ns = {0};
  ps_ckpt_source src = {dir, "job-a", P, "momentum", collect_note, &ns, 0};
  ps_ckpt_restored info;
  write_set_shard(dir, &s3, "job-a", 0, 2, 10, 3, "cut-3", NULL);
  write_set_shard(dir, &s3, "job-a", 1, 2, 10, 3, "cut-3", NULL);
  ps_sleep_ms(5);
  char n4[PS_CKPT_PATHLEN];
  write_set_shard(dir, &s4, "job-a", 0, 2, 20, 4, "cut-4", NULL);
  write_set_shard(dir, &s4, "job-a", 1, 2, 20, 4, "cut-4", n4);
  CHECK(load_equals(&src, &s4, &info));
  CHECK(info.set_id == 4 && info.consistent == 1);

  /* Set 4's file of shard 1 damaged in its body (its header still reads):
   * set 3 whole, not set 4's shard 0 with set 3's shard 1. */
  flip_byte(dir, n4, 20);
  ns.n = 0;
  int same = load_equals(&src, &s3, &info);
  CHECK(same);
  CHECK_MSG(info.set_id == 3 && info.consistent == 1 && info.version == 10,
            "set %llu consistent %d version %llu", (unsigned long long)info.set_id, info.consistent,
            (unsigned long long)info.version);
  int ok = has_note(&ns, n4, "checksum mismatch") &&
           has_note_at(&ns, PS_LOG_WARN, "cannot restore", "set 4") &&
           has_note_at(&ns, PS_LOG_INFO, "restored [0, 100)", "set 3") &&
           !has_note(&ns, "different moments", NULL);
  CHECK(ok);
  if (!ok || !same) dump_notes(&ns);
  /* Only shard 0's range is wanted: set 4 serves it. */
  ns.n = 0;
  CHECK(range_equals(&src, &s4, 0, 48, 1, &info, 0));
  CHECK(info.set_id == 4 && info.consistent == 1 && info.files_used == 1);
  /* Its header damaged (the file then is not listed at all): set 4 is no
   * longer complete, and set 3 serves even shard 0's range. */
  flip_byte(dir, n4, 20); /* undo */
  char p[PS_CKPT_PATHLEN + 600];
  snprintf(p, sizeof p, "%s/%s", dir, n4);
  char *raw, err[PS_ERRLEN];
  size_t len;
  if (ps_read_file(p, &raw, &len, err) == PS_OK) {
    raw[100] ^= 0x01; /* job id */
    CHECK(write_file(p, raw, len) == 0);
    free(raw);
  }
  ns.n = 0;
  CHECK(load_equals(&src, &s3, &info));
  CHECK(info.set_id == 3 && info.consistent == 1);
  ns.n = 0;
  CHECK(range_equals(&src, &s3, 0, 48, 1, &info, 0));
  CHECK(info.set_id == 3 && info.consistent == 1);
  model_free(&s3);
  model_free(&s4);
}

/* The files test_prune_sets starts from, by name. */
typedef struct {
  char b_set[PS_CKPT_PATHLEN], b_solo[PS_CKPT_PATHLEN], b_other_s[PS_CKPT_PATHLEN]; /* job-b */
  char shard1[PS_CKPT_PATHLEN];                              /* job-a, shard 1 of 2 */
  char other_s0[PS_CKPT_PATHLEN], other_s2[PS_CKPT_PATHLEN]; /* job-a, of 3 shards */
  char s3[PS_CKPT_PATHLEN], s4[PS_CKPT_PATHLEN], s5[PS_CKPT_PATHLEN], s6[PS_CKPT_PATHLEN];
  char solo_old[PS_CKPT_PATHLEN], solo_mid[PS_CKPT_PATHLEN], solo_new[PS_CKPT_PATHLEN];
} prune_files;

/* Writes them into dir (shard 0 of 2 of job-a unless said otherwise), in
 * this order of time; with_mid adds a file written alone between sets 5
 * and 6. */
static void prune_fixture(const char *dir, const model_state *m, int with_mid, prune_files *f) {
  memset(f, 0, sizeof *f);
  /* Other jobs' files: older than everything of job-a. */
  write_set_shard(dir, m, "job-b", 0, 2, 100, 3, "b3", f->b_set);
  write_set_shard(dir, m, "job-b", 0, 2, 101, 0, "b0", f->b_solo);
  write_set_shard(dir, m, "job-b", 1, 3, 1, 3, "b3", f->b_other_s);
  ps_sleep_ms(5);
  write_set_shard(dir, m, "job-a", 1, 2, 1, 3, "a3", f->shard1);
  write_set_shard(dir, m, "job-a", 0, 3, 1, 3, "a3", f->other_s0);
  write_set_shard(dir, m, "job-a", 2, 3, 2, 0, "a0", f->other_s2);
  write_set_shard(dir, m, "job-a", 0, 2, 1, 3, "a3", f->s3);
  ps_sleep_ms(5);
  write_set_shard(dir, m, "job-a", 0, 2, 2, 4, "a4", f->s4);
  ps_sleep_ms(5);
  write_set_shard(dir, m, "job-a", 0, 2, 3, 0, "solo-old", f->solo_old);
  ps_sleep_ms(5);
  write_set_shard(dir, m, "job-a", 0, 2, 4, 5, "a5", f->s5);
  ps_sleep_ms(5);
  if (with_mid) {
    write_set_shard(dir, m, "job-a", 0, 2, 5, 0, "solo-mid", f->solo_mid);
    ps_sleep_ms(5);
  }
  write_set_shard(dir, m, "job-a", 0, 2, 6, 6, "a6", f->s6);
  ps_sleep_ms(5);
  write_set_shard(dir, m, "job-a", 0, 2, 7, 0, "solo-new", f->solo_new);
  /* A file whose header cannot be read: left for a person. */
  char p[1024];
  snprintf(p, sizeof p, "%s/shard-0-of-2-v50.ckpt", dir);
  CHECK(write_file(p, "not a checkpoint", 16) == 0);
}

static void test_prune_sets(void) {
  char dir[512], err[PS_ERRLEN] = "";
  fresh_dir(dir, sizeof dir, "prune-sets");
  model_state m = model_make(100, 1, 1.0f);
  prune_files f;
  prune_fixture(dir, &m, 1, &f);
  const int total = 14;
  CHECK(count_entries(dir, NULL) == total);
  const uint64_t keep[2] = {5, 6};
  int deleted = -1;

  /* The sets a shard has a file of (what it tells shard 0 at a PREPARE):
   * this job's, this shard's, this layout's, newest first; files written
   * alone, other jobs', other shards' and unreadable ones not counted. */
  uint64_t sets[8];
  int n_sets = -1;
  CHECK(ps_ckpt_list_sets(dir, 0, 2, "job-a", sets, 8, &n_sets, err) == PS_OK);
  CHECK_MSG(n_sets == 4 && sets[0] == 6 && sets[1] == 5 && sets[2] == 4 && sets[3] == 3,
            "%d sets", n_sets);
  CHECK(ps_ckpt_list_sets(dir, 0, 2, "job-a", sets, 2, &n_sets, err) == PS_OK && n_sets == 2 &&
        sets[0] == 6 && sets[1] == 5);
  CHECK(ps_ckpt_list_sets(dir, 1, 2, "job-a", sets, 8, &n_sets, err) == PS_OK && n_sets == 1 &&
        sets[0] == 3);
  CHECK(ps_ckpt_list_sets(dir, 0, 3, "job-a", sets, 8, &n_sets, err) == PS_OK && n_sets == 1 &&
        sets[0] == 3);
  CHECK(ps_ckpt_list_sets(dir, 0, 2, "job-c", sets, 8, &n_sets, err) == PS_OK && n_sets == 0);
  CHECK(ps_ckpt_list_sets(dir, 2, 2, "job-a", sets, 8, &n_sets, err) == PS_EINVAL);

  /* No kept sets known: nothing deleted, even with drop_other_s. */
  CHECK(ps_ckpt_prune_sets(dir, 0, 2, "job-a", keep, 0, 6, 1, &deleted, err) == PS_OK);
  CHECK(deleted == 0 && count_entries(dir, NULL) == total);

  /* Keep 5 and 6: sets 3 and 4 go, and the files written alone before
   * set 6's; the newer one stays. */
  int rc = ps_ckpt_prune_sets(dir, 0, 2, "job-a", keep, 2, 6, 0, &deleted, err);
  CHECK_MSG(rc == PS_OK && deleted == 4, "%d deleted %d: %s", rc, deleted, err);
  CHECK(!exists(dir, f.s3) && !exists(dir, f.s4));
  CHECK(!exists(dir, f.solo_old) && !exists(dir, f.solo_mid));
  CHECK(exists(dir, f.s5) && exists(dir, f.s6) && exists(dir, f.solo_new));
  CHECK(exists(dir, "shard-0-of-2-v50.ckpt"));
  CHECK(exists(dir, f.shard1)); /* another shard's */
  CHECK(exists(dir, f.b_set) && exists(dir, f.b_solo) && exists(dir, f.b_other_s)); /* job-b's */
  CHECK(exists(dir, f.other_s0) && exists(dir, f.other_s2));
  CHECK(count_entries(dir, NULL) == total - 4);
  CHECK(count_entries(dir, ".") == 0);
  /* Again: nothing more. */
  CHECK(ps_ckpt_prune_sets(dir, 0, 2, "job-a", keep, 2, 6, 0, &deleted, err) == PS_OK &&
        deleted == 0);
  /* With drop_other_s: this job's files of another S, not another job's. */
  rc = ps_ckpt_prune_sets(dir, 0, 2, "job-a", keep, 2, 6, 1, &deleted, err);
  CHECK_MSG(rc == PS_OK && deleted == 2, "%d deleted %d: %s", rc, deleted, err);
  CHECK(!exists(dir, f.other_s0) && !exists(dir, f.other_s2));
  CHECK(exists(dir, f.b_other_s) && exists(dir, f.b_set) && exists(dir, f.b_solo));
  CHECK(exists(dir, f.s5) && exists(dir, f.s6) && exists(dir, f.solo_new) && exists(dir, f.shard1));
  CHECK(count_entries(dir, NULL) == total - 6);

  /* The current set is kept though not in keep_sets; without it, it goes. */
  fresh_dir(dir, sizeof dir, "prune-sets-2");
  prune_fixture(dir, &m, 0, &f);
  CHECK(count_entries(dir, NULL) == total - 1);
  rc = ps_ckpt_prune_sets(dir, 0, 2, "job-a", keep, 1, 6, 0, &deleted, err);
  CHECK_MSG(rc == PS_OK && deleted == 3, "%d deleted %d: %s", rc, deleted, err);
  CHECK(!exists(dir, f.s3) && !exists(dir, f.s4) && !exists(dir, f.solo_old));
  CHECK(exists(dir, f.s5) && exists(dir, f.s6) && exists(dir, f.solo_new));
  /* A set newer than the newest kept one stays, whatever is written now
   * (it may have completed since shard 0 named the sets to keep). */
  const uint64_t keep5 = 5;
  rc = ps_ckpt_prune_sets(dir, 0, 2, "job-a", &keep5, 1, 4, 0, &deleted, err);
  CHECK_MSG(rc == PS_OK && deleted == 0 && exists(dir, f.s6), "%d deleted %d: %s", rc, deleted,
            err);
  rc = ps_ckpt_prune_sets(dir, 0, 2, "job-a", keep, 1, 0, 0, &deleted, err);
  CHECK_MSG(rc == PS_OK && deleted == 0, "%d deleted %d: %s", rc, deleted, err);
  /* Keeping 6, set 5 goes (older than the newest kept, not kept). */
  const uint64_t keep6 = 6;
  rc = ps_ckpt_prune_sets(dir, 0, 2, "job-a", &keep6, 1, 0, 0, &deleted, err);
  CHECK_MSG(rc == PS_OK && deleted == 1, "%d deleted %d: %s", rc, deleted, err);
  CHECK(exists(dir, f.s6) && !exists(dir, f.s5) && exists(dir, f.solo_new));
  /* Shard 1's files are its own to prune. */
  const uint64_t keep9 = 9;
  rc = ps_ckpt_prune_sets(dir, 1, 2, "job-a", &keep9, 1, 9, 0, &deleted, err);
  CHECK_MSG(rc == PS_OK && deleted == 1, "%d deleted %d: %s", rc, deleted, err);
  CHECK(!exists(dir, f.shard1) && exists(dir, f.s6));
  CHECK(exists(dir, f.b_set) && exists(dir, f.b_solo) && exists(dir, f.b_other_s));

  /* No directory: nothing to do; bad arguments. */
  char missing[1024];
  snprintf(missing, sizeof missing, "%s/no-such-dir", dir);
  CHECK(ps_ckpt_prune_sets(missing, 0, 2, "job-a", keep, 2, 6, 1, &deleted, err) == PS_OK &&
        deleted == 0);
  CHECK(ps_ckpt_list_sets(missing, 0, 2, "job-a", sets, 8, &n_sets, err) == PS_OK && n_sets == 0);
  CHECK(ps_ckpt_prune_sets(dir, 2, 2, "job-a", keep, 2, 6, 0, &deleted, err) == PS_EINVAL);
  CHECK(ps_ckpt_prune_sets(dir, 0, 2, NULL, keep, 2, 6, 0, &deleted, err) == PS_EINVAL);
  CHECK(ps_ckpt_prune_sets(dir, 0, 2, "job-a", NULL, 2, 6, 0, &deleted, err) == PS_EINVAL);
  model_free(&m);
}

/* The sets shard 0 names for deletion in a CUT (abandoned_sets), from the
 * PREPARE answers: every set some shards have and others lack, whatever its
 * age and whoever cut it (a set an earlier coordinator abandoned, which
 * this one never knew of: shard 0's deposed primary, or its process before
 * a restart); never one every shard has, nor one known complete. */
static void test_sets_to_drop(void) {
  /* Shard 0 has 9 7 6 5 3, shard 1 has 10 9 6 5 4 2. */
  const uint64_t d0[] = {9, 7, 6, 5, 3}, d1[] = {10, 9, 6, 5, 4, 2};
  const uint64_t *on_disk[2] = {d0, d1};
  const size_t n_on_disk[2] = {5, 6};
  const uint64_t complete[3] = {6, 5, 4};
  uint64_t drop[16];
  int n = ps_ckpt_sets_to_drop(on_disk, n_on_disk, 2, complete, 2, drop, 16);
  /* 7 and 10: on one shard, newer than the newest complete set 6 (sets
   * abandoned after their CUT, by this coordinator or another). 3, 4, 2:
   * on one shard, older. Not 9 (on both: complete, though not known so
   * yet), nor 6 and 5 (complete). */
  CHECK_MSG(n == 5 && drop[0] == 7 && drop[1] == 3 && drop[2] == 10 && drop[3] == 4 && drop[4] == 2,
            "%d sets: %llu %llu %llu %llu %llu", n, (unsigned long long)drop[0],
            (unsigned long long)drop[1], (unsigned long long)drop[2], (unsigned long long)drop[3],
            (unsigned long long)drop[4]);
  /* At most max. */
  CHECK(ps_ckpt_sets_to_drop(on_disk, n_on_disk, 2, complete, 2, drop, 2) == 2 && drop[0] == 7 &&
        drop[1] == 3);
  /* No complete set known (a fresh coordinator that learned none): the
   * incomplete ones all the same. */
  n = ps_ckpt_sets_to_drop(on_disk, n_on_disk, 2, complete, 0, drop, 16);
  CHECK_MSG(n == 5, "%d sets", n);
  /* 4, known complete (pruned on shard 0 since): not named; the CUT's kept
   * sets decide (it is older than the newest kept one). */
  n = ps_ckpt_sets_to_drop(on_disk, n_on_disk, 2, complete, 3, drop, 16);
  CHECK_MSG(n == 4 && drop[0] == 7 && drop[1] == 3 && drop[2] == 10 && drop[3] == 2, "%d sets", n);
  /* One shard: every set it has is complete. */
  n = ps_ckpt_sets_to_drop(on_disk, n_on_disk, 1, complete, 2, drop, 16);
  CHECK_MSG(n == 0, "%d sets", n);
  /* Every shard has every set: nothing. */
  const uint64_t *same[2] = {d0, d0};
  const size_t n_same[2] = {5, 5};
  CHECK(ps_ckpt_sets_to_drop(same, n_same, 2, complete, 0, drop, 16) == 0);
}

/* A shard deletes its files of the sets a CUT names as never to be
 * complete (abandoned_sets), whatever their age, but never those of a set
 * the CUT keeps, of the set it writes, or of a set every shard has a file
 * of by now (complete after all), and nothing of another shard, another
 * layout or another job, nor files written alone; another layout's or
 * another job's files do not make a set complete. */
static void test_drop_sets(void) {
  char dir[512], err[PS_ERRLEN] = "";
  fresh_dir(dir, sizeof dir, "drop-sets");
  model_state m = model_make(100, 1, 1.0f);
  char s3[PS_CKPT_PATHLEN], s4[PS_CKPT_PATHLEN], s5[PS_CKPT_PATHLEN], s6[PS_CKPT_PATHLEN],
      s7[PS_CKPT_PATHLEN], solo[PS_CKPT_PATHLEN], sh1[PS_CKPT_PATHLEN], sh1_4[PS_CKPT_PATHLEN],
      lay[PS_CKPT_PATHLEN], job[PS_CKPT_PATHLEN];
  write_set_shard(dir, &m, "job-a", 0, 2, 1, 3, "a3", s3);
  write_set_shard(dir, &m, "job-a", 0, 2, 2, 4, "a4", s4);
  write_set_shard(dir, &m, "job-a", 0, 2, 3, 5, "a5", s5);
  write_set_shard(dir, &m, "job-a", 0, 2, 4, 6, "a6", s6);
  write_set_shard(dir, &m, "job-a", 0, 2, 5, 7, "a7", s7);
  write_set_shard(dir, &m, "job-a", 0, 2, 6, 0, "solo", solo);
  write_set_shard(dir, &m, "job-a", 1, 2, 1, 8, "a8", sh1);
  write_set_shard(dir, &m, "job-a", 1, 2, 2, 4, "a4", sh1_4); /* set 4: whole */
  write_set_shard(dir, &m, "job-a", 1, 3, 1, 7, "a7", lay);   /* another layout's set 7 */
  write_set_shard(dir, &m, "job-b", 1, 2, 7, 3, "b3", job);   /* another job's set 3 */
  const int total = 10;
  CHECK(count_entries(dir, NULL) == total);
  int deleted = -1, whole = -1;
  /* Nothing named: nothing goes. */
  const uint64_t keep[1] = {5};
  CHECK(ps_ckpt_drop_sets(dir, 0, 2, "job-a", NULL, 0, keep, 1, 8, &deleted, &whole, err) ==
            PS_OK &&
        deleted == 0 && whole == 0 && count_entries(dir, NULL) == total);
  /* 7 (newer than the kept set 5) and 3 go; 5 (kept), 6 (being written),
   * 4 (shard 1 has it too: complete) and 99 (none) do not. */
  const uint64_t drop[7] = {7, 5, 6, 3, 4, 8, 99};
  int rc = ps_ckpt_drop_sets(dir, 0, 2, "job-a", drop, 7, keep, 1, 6, &deleted, &whole, err);
  CHECK_MSG(rc == PS_OK && deleted == 2 && whole == 1, "%d deleted %d whole %d: %s", rc, deleted,
            whole, err);
  CHECK(!exists(dir, s7) && !exists(dir, s3));
  CHECK(exists(dir, s4) && exists(dir, s5) && exists(dir, s6) && exists(dir, solo));
  CHECK(exists(dir, sh1) && exists(dir, sh1_4) && exists(dir, lay) && exists(dir, job));
  CHECK(count_entries(dir, NULL) == total - 2);
  /* Shard 1's files are its own to delete: 8 goes, 4 (whole) stays. */
  rc = ps_ckpt_drop_sets(dir, 1, 2, "job-a", drop, 7, NULL, 0, 9, &deleted, NULL, err);
  CHECK_MSG(rc == PS_OK && deleted == 1 && !exists(dir, sh1) && exists(dir, sh1_4),
            "%d deleted %d: %s", rc, deleted, err);
  CHECK(exists(dir, lay) && exists(dir, job) && exists(dir, s4));
  /* Once shard 1's file of set 4 is gone, shard 0's goes. */
  char path[PS_CKPT_PATHLEN + 600];
  snprintf(path, sizeof path, "%s/%s", dir, sh1_4);
  CHECK(unlink(path) == 0);
  rc = ps_ckpt_drop_sets(dir, 0, 2, "job-a", drop, 7, keep, 1, 6, &deleted, &whole, err);
  CHECK_MSG(rc == PS_OK && deleted == 1 && whole == 0 && !exists(dir, s4), "%d deleted %d: %s", rc,
            deleted, err);
  /* No directory: nothing to do; bad arguments. */
  char missing[1024];
  snprintf(missing, sizeof missing, "%s/no-such-dir", dir);
  CHECK(ps_ckpt_drop_sets(missing, 0, 2, "job-a", drop, 7, keep, 1, 6, &deleted, NULL, err) ==
            PS_OK &&
        deleted == 0);
  CHECK(ps_ckpt_drop_sets(dir, 2, 2, "job-a", drop, 7, keep, 1, 6, &deleted, NULL, err) ==
        PS_EINVAL);
  CHECK(ps_ckpt_drop_sets(dir, 0, 2, NULL, drop, 7, keep, 1, 6, &deleted, NULL, err) == PS_EINVAL);
  CHECK(ps_ckpt_drop_sets(dir, 0, 2, "job-a", NULL, 7, keep, 1, 6, &deleted, NULL, err) ==
        PS_EINVAL);
  CHECK(ps_ckpt_drop_sets(dir, 0, 2, "job-a", drop, 7, NULL, 1, 6, &deleted, NULL, err) ==
        PS_EINVAL);
  model_free(&m);
}

/* ---------------------------------------------------------------- failures */

static void test_write_failures(void) {
  char dir[512], err[PS_ERRLEN] = "";
  fresh_dir(dir, sizeof dir, "failures");
  model_state m = model_make(4096, 1, 1.0f);

  /* A directory that does not exist: refused, nothing created. */
  char missing[1024];
  snprintf(missing, sizeof missing, "%s/no-such-dir", dir);
  ps_ckpt ck = shard_view(&m, "job-a", "momentum", 0, 1, 1);
  int rc = ps_ckpt_write(missing, &ck, 3, NULL, err);
  CHECK_MSG(rc == PS_EIO && strstr(err, "no-such-dir"), "%d %s", rc, err);
  CHECK(count_entries(dir, NULL) == 0);

  /* Inconsistent state: refused before anything is written. */
  ps_ckpt bad = ck;
  bad.meta.begin = 10;
  bad.meta.end = 5;
  CHECK(ps_ckpt_write(dir, &bad, 0, NULL, err) == PS_EINVAL);
  bad = ck;
  bad.meta.end = m.P + 1;
  CHECK(ps_ckpt_write(dir, &bad, 0, NULL, err) == PS_EINVAL);
  bad = ck;
  bad.meta.index = 1;
  CHECK(ps_ckpt_write(dir, &bad, 0, NULL, err) == PS_EINVAL);
  bad = ck;
  bad.meta.job_id[0] = '\0';
  CHECK(ps_ckpt_write(dir, &bad, 0, NULL, err) == PS_EINVAL);
  bad = ck;
  memset(bad.meta.optimizer, 'x', sizeof bad.meta.optimizer);
  CHECK(ps_ckpt_write(dir, &bad, 0, NULL, err) == PS_EINVAL);
  bad = ck;
  bad.n_slots = PS_CKPT_MAX_SLOTS + 1;
  CHECK(ps_ckpt_write(dir, &bad, 0, NULL, err) == PS_EINVAL);
  bad = ck;
  bad.slots[0] = NULL;
  CHECK(ps_ckpt_write(dir, &bad, 0, NULL, err) == PS_EINVAL);
  bad = ck;
  bad.extra_len = 3;
  CHECK(ps_ckpt_write(dir, &bad, 0, NULL, err) == PS_EINVAL);
  CHECK(count_entries(dir, NULL) == 0);

  /* The disk fills up in the middle of a write (a file size limit stands
   * in for it): the earlier checkpoint stays, no temporary file is left. */
  ps_ckpt small = ck;
  small.meta.end = 16; /* P stays 4096: a short range of it */
  CHECK(ps_ckpt_write(dir, &small, 1, NULL, err) == PS_OK);
  struct rlimit saved;
  getrlimit(RLIMIT_FSIZE, &saved);
  struct rlimit lim = saved;
  lim.rlim_cur = 8192;
  void (*old_handler)(int) = signal(SIGXFSZ, SIG_IGN);
  if (setrlimit(RLIMIT_FSIZE, &lim) == 0) {
    ck.meta.version = 2; /* 4096 values and a slot: 32 KiB */
    rc = ps_ckpt_write(dir, &ck, 1, NULL, err);
    setrlimit(RLIMIT_FSIZE, &saved);
    CHECK_MSG(rc == PS_EIO && strstr(err, "cannot write checkpoint"), "%d %s", rc, err);
    CHECK(count_entries(dir, NULL) == 1 && exists(dir, "shard-0-of-1-v1.ckpt"));
    char p[1024];
    snprintf(p, sizeof p, "%s/shard-0-of-1-v1.ckpt", dir);
    ps_ckpt got;
    CHECK(ps_ckpt_read(p, &got, err) == PS_OK);
    ps_ckpt_free(&got);
  } else {
    printf("note: cannot lower RLIMIT_FSIZE; the full-disk case is not tested\n");
  }
  signal(SIGXFSZ, old_handler);
  /* And then it works again, and keep = 1 removes the older one. */
  ck.meta.version = 3;
  CHECK(ps_ckpt_write(dir, &ck, 1, NULL, err) == PS_OK);
  CHECK(count_entries(dir, NULL) == 1 && exists(dir, "shard-0-of-1-v3.ckpt"));
  model_free(&m);
}

/* ---------------------------------------------------------------- stale temporaries */

/* dir/name with the first len bytes of src (a file), or len bytes of 'x'
 * when src is NULL. */
static void plant(const char *dir, const char *name, const char *src, size_t len) {
  char p[1024], *buf = NULL, err[PS_ERRLEN];
  size_t have = 0;
  snprintf(p, sizeof p, "%s/%s", dir, name);
  if (src && ps_read_file(src, &buf, &have, err) != PS_OK) {
    CHECK_MSG(0, "%s", err);
    return;
  }
  if (!src) {
    buf = malloc(len ? len : 1);
    memset(buf, 'x', len);
    have = len;
  }
  CHECK(have >= len && write_file(p, buf, len) == 0);
  free(buf);
}

/* A process id that was in use a moment ago and is gone now. */
static long dead_pid(void) {
  pid_t child = fork();
  if (child == 0) _exit(0);
  CHECK(child > 0);
  int st;
  CHECK(waitpid(child, &st, 0) == child);
  return (long)child;
}

static void test_stale_temps(void) {
  char dir[512], src[512], err[PS_ERRLEN] = "", name[256], path[1024];
  fresh_dir(dir, sizeof dir, "stale");
  fresh_dir(src, sizeof src, "stale-src");
  model_state m = model_make(300, 1, 1.0f);
  write_shard(dir, &m, "job-a", "momentum", 0, 2, 3, 0); /* valid checkpoints stay */
  write_shard(dir, &m, "job-a", "momentum", 1, 2, 3, 0);
  write_shard(src, &m, "job-a", "momentum", 0, 2, 4, 0); /* headers to plant */
  write_shard(src, &m, "job-b", "momentum", 0, 2, 4, 0);
  char ours[1024], theirs[1024];
  snprintf(ours, sizeof ours, "%s/shard-0-of-2-v4.ckpt", src);
  snprintf(theirs, sizeof theirs, "%s/shard-0-of-2-v4.ckpt.b", src);
  CHECK(rename(ours, theirs) == 0);
  write_shard(src, &m, "job-a", "momentum", 0, 2, 4, 0);
  const long gone = dead_pid(), me = (long)getpid(), alive = (long)getppid();

  /* Stale: a dead writer's, cut before its header was whole, and after. */
  snprintf(name, sizeof name, ".shard-0-of-2-v4.ckpt.tmp-%ld-0badf00d", gone);
  plant(dir, name, NULL, 100);
  char stale2[256];
  snprintf(stale2, sizeof stale2, ".shard-0-of-2-v5.ckpt.tmp-%ld-00c0ffee", gone);
  plant(dir, stale2, ours, 700);
  /* Not to be touched: another job's (its header says so), another
   * shard's, another S's, a live process's, a writer's whose lock is held
   * (a live one in another pid namespace), names that are not ours. */
  char keep[8][64];
  snprintf(keep[0], sizeof keep[0], ".shard-0-of-2-v6.ckpt.tmp-%ld-00000001", gone);
  plant(dir, keep[0], theirs, 700);
  snprintf(keep[1], sizeof keep[1], ".shard-1-of-2-v4.ckpt.tmp-%ld-00000002", gone);
  plant(dir, keep[1], NULL, 10);
  snprintf(keep[2], sizeof keep[2], ".shard-0-of-3-v4.ckpt.tmp-%ld-00000003", gone);
  plant(dir, keep[2], NULL, 10);
  snprintf(keep[3], sizeof keep[3], ".shard-0-of-2-v7.ckpt.tmp-%ld-00000004", alive);
  plant(dir, keep[3], NULL, 10);
  snprintf(keep[4], sizeof keep[4], ".shard-0-of-2-v8.ckpt.tmp-%ld-00000005", gone);
  plant(dir, keep[4], NULL, 10);
  snprintf(keep[5], sizeof keep[5], ".shard-0-of-2-v9.ckpt.tmp-%ld-0000006", gone); /* 7 digits */
  plant(dir, keep[5], NULL, 10);
  snprintf(keep[6], sizeof keep[6], "shard-0-of-2-v9.ckpt.tmp-%ld-00000007", gone); /* no dot */
  plant(dir, keep[6], NULL, 10);
  snprintf(keep[7], sizeof keep[7], ".shard-0-of-2-v9.ckpt.tmp-%ld-00000008", me);
  plant(dir, keep[7], NULL, 10);
  snprintf(path, sizeof path, "%s/%s", dir, keep[4]);
  int locked = open(path, O_RDONLY);
  CHECK(locked >= 0 && flock(locked, LOCK_EX | LOCK_NB) == 0);
  snprintf(path, sizeof path, "%s/%s", dir, keep[7]);
  int mine = open(path, O_RDONLY);
  CHECK(mine >= 0 && flock(mine, LOCK_EX | LOCK_NB) == 0);

  int removed = -1;
  CHECK(ps_ckpt_remove_stale_temps(dir, 0, 2, "job-a", &removed, err) == PS_OK);
  CHECK_MSG(removed == 2, "removed %d", removed);
  CHECK(!exists(dir, name) && !exists(dir, stale2));
  for (int i = 0; i < 8; i++) CHECK_MSG(exists(dir, keep[i]), "%s was removed", keep[i]);
  CHECK(exists(dir, "shard-0-of-2-v3.ckpt") && exists(dir, "shard-1-of-2-v3.ckpt"));
  CHECK(count_entries(dir, NULL) == 10);

  /* This process's own pid with the lock free: an earlier process's (pid
   * reused, as pid 1 in a container); the lock let go: the writer died. */
  close(mine);
  close(locked);
  CHECK(ps_ckpt_remove_stale_temps(dir, 0, 2, "job-a", &removed, err) == PS_OK);
  CHECK_MSG(removed == 2, "removed %d", removed);
  CHECK(!exists(dir, keep[4]) && !exists(dir, keep[7]));
  /* The checkpoint is still found, and a write works beside the rest. */
  ps_ckpt got;
  CHECK(ps_ckpt_find_latest(&(ps_ckpt_source){.dir = dir, .job_id = "job-a", .P = m.P}, 0, 2,
                            &got, NULL, err) == PS_OK &&
        got.meta.version == 3);
  ps_ckpt_free(&got);
  write_shard(dir, &m, "job-a", "momentum", 0, 2, 10, 0);
  CHECK(count_entries(dir, NULL) == 9);

  /* A directory that does not exist holds nothing stale; bad arguments. */
  snprintf(path, sizeof path, "%s/no-such-dir", dir);
  CHECK(ps_ckpt_remove_stale_temps(path, 0, 2, "job-a", &removed, err) == PS_OK && removed == 0);
  CHECK(ps_ckpt_remove_stale_temps(dir, 2, 2, "job-a", &removed, err) == PS_EINVAL);
  model_free(&m);
}

/* ---------------------------------------------------------------- npy */

/* Reads an .npy file and checks its preamble and header against the dict
 * text expected; the data bytes must equal want[0 .. count). */
static void check_npy(const char *path, const char *dict, const float *want, size_t count) {
  char *raw, err[PS_ERRLEN];
  size_t len;
  if (ps_read_file(path, &raw, &len, err) != PS_OK) {
    CHECK_MSG(0, "%s", err);
    return;
  }
  const uint8_t *b = (const uint8_t *)raw;
  CHECK_MSG(len >= 10 && memcmp(b, "\x93NUMPY", 6) == 0 && b[6] == 1 && b[7] == 0, "%s", path);
  size_t hl = (size_t)b[8] | (size_t)b[9] << 8;
  CHECK_MSG((10 + hl) % 64 == 0, "%s: header %zu", path, hl);
  CHECK(10 + hl + count * 4 == len);
  size_t dl = strlen(dict);
  CHECK_MSG(hl > dl && memcmp(raw + 10, dict, dl) == 0, "%s: %.*s", path,
            (int)(hl < 200 ? hl : 200), raw + 10);
  int pad_ok = raw[10 + hl - 1] == '\n';
  for (size_t i = 10 + dl; i < 10 + hl - 1; i++) pad_ok = pad_ok && raw[i] == ' ';
  CHECK_MSG(pad_ok, "%s: padding", path);
  if (10 + hl + count * 4 == len) CHECK(memcmp(raw + 10 + hl, want, count * 4) == 0);
  free(raw);
}

static void test_npy(void) {
  char dir[512], out[600], err[PS_ERRLEN] = "", p[1024];
  fresh_dir(dir, sizeof dir, "npy");
  snprintf(out, sizeof out, "%s/model", dir);
  ps_model_spec spec;
  int rc = ps_model_spec_parse(
      "{\"input\": [2, 6, 6], \"classes\": 5, \"layers\": ["
      "{\"type\": \"conv2d\", \"filters\": 3, \"kernel\": 3, \"padding\": \"same\"},"
      "{\"type\": \"relu\"}, {\"type\": \"maxpool\", \"size\": 2}, {\"type\": \"flatten\"},"
      "{\"type\": \"dense\", \"units\": 4}, {\"type\": \"relu\"}, {\"type\": \"dense\", \"units\": "
      "5},"
      "{\"type\": \"softmax_xent\"}]}",
      &spec, err);
  CHECK_MSG(rc == PS_OK, "%s", err);
  if (rc) return;
  /* conv 3x2x3x3 + 3, dense 4x27 + 4, dense 5x4 + 5 */
  CHECK(spec.n_params == 54 + 3 + 108 + 4 + 20 + 5);
  model_state m = model_make(spec.n_params, 0, 1.0f);
  int files = 0;
  rc = ps_ckpt_export_npy(&spec, m.params, out, &files, err);
  CHECK_MSG(rc == PS_OK, "%s", err);
  CHECK(files == 6);
  CHECK(count_entries(out, NULL) == 6); /* no temporary files */
  const ps_layer *conv = &spec.layers[0], *d0 = &spec.layers[4], *d1 = &spec.layers[6];
  CHECK(strcmp(conv->name, "conv2d_0") == 0 && strcmp(d1->name, "dense_1") == 0);
  static const char *pre = "{'descr': '<f4', 'fortran_order': False, 'shape': ";
  char dict[256];
  snprintf(p, sizeof p, "%s/conv2d_0.w.npy", out);
  snprintf(dict, sizeof dict, "%s(3, 2, 3, 3), }", pre);
  check_npy(p, dict, m.params + conv->w_off, 54);
  snprintf(p, sizeof p, "%s/conv2d_0.b.npy", out);
  snprintf(dict, sizeof dict, "%s(3,), }", pre);
  check_npy(p, dict, m.params + conv->b_off, 3);
  snprintf(p, sizeof p, "%s/dense_0.w.npy", out);
  snprintf(dict, sizeof dict, "%s(4, 27), }", pre);
  check_npy(p, dict, m.params + d0->w_off, 108);
  snprintf(p, sizeof p, "%s/dense_1.w.npy", out);
  snprintf(dict, sizeof dict, "%s(5, 4), }", pre);
  check_npy(p, dict, m.params + d1->w_off, 20);
  snprintf(p, sizeof p, "%s/dense_1.b.npy", out);
  snprintf(dict, sizeof dict, "%s(5,), }", pre);
  check_npy(p, dict, m.params + d1->b_off, 5);

  /* A scalar and a long shape. */
  float one = 2.5f;
  snprintf(p, sizeof p, "%s/scalar.npy", dir);
  CHECK(ps_npy_write(p, &one, NULL, 0, err) == PS_OK);
  snprintf(dict, sizeof dict, "%s(), }", pre);
  check_npy(p, dict, &one, 1);
  size_t shape8[8] = {1, 2, 1, 3, 1, 1, 2, 1};
  snprintf(p, sizeof p, "%s/eight.npy", dir);
  CHECK(ps_npy_write(p, m.params, shape8, 8, err) == PS_OK);
  snprintf(dict, sizeof dict, "%s(1, 2, 1, 3, 1, 1, 2, 1), }", pre);
  check_npy(p, dict, m.params, 12);
  CHECK(ps_npy_write(p, m.params, shape8, 9, err) == PS_EINVAL);

  /* NumPy itself, where it is installed. */
  if (system("python3 -c 'import numpy' >/dev/null 2>&1") == 0) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "python3 -c \"import numpy as np; a = np.load('%s/conv2d_0.w.npy'); "
             "assert a.shape == (3, 2, 3, 3) and a.dtype == np.float32; "
             "assert a[1, 0, 2, 1] == np.float32(%.9g); "
             "b = np.load('%s/dense_0.w.npy'); assert b.shape == (4, 27) and "
             "b[3, 26] == np.float32(%.9g)\"",
             out, (double)m.params[conv->w_off + 1 * 18 + 0 * 9 + 2 * 3 + 1], out,
             (double)m.params[d0->w_off + 3 * 27 + 26]);
    CHECK_MSG(system(cmd) == 0, "np.load disagrees: %s", cmd);
  } else {
    printf("note: python3 with numpy not available; np.load check skipped\n");
  }

  /* The output directory's parent must exist; a file in the way is named. */
  snprintf(p, sizeof p, "%s/no/such", dir);
  CHECK(ps_ckpt_export_npy(&spec, m.params, p, NULL, err) == PS_EIO);
  CHECK_MSG(strstr(err, "no/such"), "%s", err);
  snprintf(p, sizeof p, "%s/scalar.npy", dir);
  CHECK(ps_ckpt_export_npy(&spec, m.params, p, NULL, err) == PS_EIO);
  CHECK_MSG(strstr(err, "a file of that name exists"), "%s", err);
  model_free(&m);
}

int main(void) {
  ps_log_init("test_checkpoint", PS_LOG_ERROR); /* warnings go to the notes */
  snprintf(g_root, sizeof g_root, "/tmp/test_checkpoint.XXXXXX");
  if (!mkdtemp(g_root)) {
    perror("mkdtemp");
    return 1;
  }
  RUN(test_crc32c);
  RUN(test_round_trip);
  RUN(test_keep);
  RUN(test_corruption);
  RUN(test_truncated);
  RUN(test_find_latest);
  RUN(test_reshard);
  RUN(test_set_and_cut);
  RUN(test_format_1);
  RUN(test_consistent_groups);
  RUN(test_corrupt_set);
  RUN(test_prune_sets);
  RUN(test_sets_to_drop);
  RUN(test_drop_sets);
  RUN(test_write_failures);
  RUN(test_stale_temps);
  RUN(test_npy);
  rm_tree(g_root);
  struct stat st;
  CHECK(stat(g_root, &st) != 0); /* nothing left behind */
  return check_summary();
}
