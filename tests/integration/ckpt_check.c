/* Checkpoint calls as shard 0's coordinator sends them, on a live shard
 * that takes no set by itself (--checkpoint-secs 0): this program plays
 * the coordinator.
 *
 * Deposed coordinators: a PREPARE or a CUT whose coordinator_term is below
 * one the shard has seen (a deposed primary of shard 0's) is refused
 * FAILED_PRECONDITION with a message that says so, and changes nothing: no
 * hold is taken (a CUT of that set at the current term is then refused as
 * not prepared), no file is written or deleted (the checkpoint directory's
 * files are the same after), and the shard's Status (newest set, version,
 * state) is the same. The same calls at the current term go through, so
 * that each comparison can fail.
 *
 * Sets that will not be complete: the files of the sets a CUT names in
 * abandoned_sets are deleted, but not a set the CUT keeps nor its own, and
 * nothing when the CUT is refused.
 *
 *   ckpt_check HOST:PORT CHECKPOINT_DIR
 * The job's token comes from PS_TOKEN_FILE. The shard must be shard 0 of 2
 * with nothing serving shard 1 (so that its sets stay incomplete: a shard
 * keeps a set named abandoned whose files every shard has), and have taken
 * no set before. */
#include <dirent.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "../../common/auth.h"
#include "../../common/rpc.h"
#include "../../common/util.h"
#include "../../common/wire.h"
#include "../unit/check.h"
#include "proto/ps.pb-c.h"
#include "raw_client.h"

static raw_client C = {.timeout_ms = 20000};
static ps_token token;
static const char *g_dir;

/* What a refused call must leave as it was. */
typedef struct {
  uint64_t set, set_version, version;
  uint32_t crc;
  char files[4096]; /* the directory's set files: name, size, mtime; sorted */
} shard_view;

static int name_cmp(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* The checkpoint files of the directory, one "name size mtime_ns" line
 * each, sorted, into out. */
static void list_files(char *out, size_t len) {
  out[0] = '\0';
  DIR *d = opendir(g_dir);
  if (!d) {
    fprintf(stderr, "ckpt_check: cannot list %s\n", g_dir);
    exit(1);
  }
  char *names[256];
  int n = 0;
  struct dirent *de;
  while ((de = readdir(d)) != NULL && n < 256)
    if (strstr(de->d_name, ".ckpt")) names[n++] = strdup(de->d_name);
  closedir(d);
  qsort(names, (size_t)n, sizeof *names, name_cmp);
  size_t at = 0;
  for (int i = 0; i < n; i++) {
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", g_dir, names[i]);
    struct stat st;
    if (stat(path, &st) == 0 && at < len)
      at +=
          (size_t)snprintf(out + at, len - at, "%s %lld %lld.%09ld\n", names[i],
                           (long long)st.st_size, (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
    free(names[i]);
  }
}

/* Does the directory hold the file of set id (shard 0 of 1)? */
static int has_set(uint64_t id) {
  char files[4096], suffix[64];
  list_files(files, sizeof files);
  snprintf(suffix, sizeof suffix, "-s%" PRIu64 ".ckpt ", id);
  return strstr(files, suffix) != NULL;
}

static void get_view(shard_view *v) {
  Ps__RequestHeader h;
  raw_header(&C, &h, &token, NULL);
  Ps__StatusRequest r = PS__STATUS_REQUEST__INIT;
  r.header = &h;
  char detail[PS_ERRLEN];
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = raw_call_on(&C, NULL, RAW_METHOD("Status"), &r.base, NULL, 0, detail, &resp, &len);
  Ps__StatusResponse *s = st == RPC_OK ? ps__status_response__unpack(NULL, len, resp) : NULL;
  free(resp);
  if (!s) {
    fprintf(stderr, "ckpt_check: Status: %s: %s\n", rpc_status_name(st), detail);
    exit(1);
  }
  memset(v, 0, sizeof *v);
  v->set = s->checkpoint_set;
  v->set_version = s->checkpoint_set_version;
  v->version = s->version;
  v->crc = s->state_crc;
  snprintf(C.job_id, sizeof C.job_id, "%s", s->job_id ? s->job_id : "");
  ps__status_response__free_unpacked(s, NULL);
  list_files(v->files, sizeof v->files);
}

/* The shard's Status and directory are as in before. */
static void same_view(const shard_view *before, const char *what) {
  shard_view now;
  get_view(&now);
  CHECK_MSG(now.set == before->set && now.set_version == before->set_version &&
                now.version == before->version && now.crc == before->crc,
            "%s changed the shard: newest set %" PRIu64 " -> %" PRIu64 ", version %" PRIu64
            " -> %" PRIu64 ", state %08x -> %08x",
            what, before->set, now.set, before->version, now.version, before->crc, now.crc);
  CHECK_MSG(strcmp(now.files, before->files) == 0,
            "%s changed the checkpoint directory:\nbefore:\n%safter:\n%s", what, before->files,
            now.files);
  printf("ckpt_check: %s: the shard's Status and checkpoint files unchanged\n", what);
}

/* A Checkpoint call as a coordinator of term sends it. keep/drop: the
 * CUT's keep_sets and abandoned_sets (n ids each). *on_disk (may be NULL):
 * a PREPARE answer's sets_on_disk, as a string "a b c". */
static int ckpt_call(int phase, uint64_t set, uint64_t term, const uint64_t *keep, size_t n_keep,
                     const uint64_t *drop, size_t n_drop, char *on_disk, char *detail) {
  Ps__RequestHeader h;
  raw_header(&C, &h, &token, NULL);
  Ps__CheckpointRequest r = PS__CHECKPOINT_REQUEST__INIT;
  r.header = &h;
  r.set_id = set;
  r.phase = phase;
  r.coordinator_term = term;
  r.n_keep_sets = n_keep;
  r.keep_sets = (uint64_t *)keep;
  r.n_abandoned_sets = n_drop;
  r.abandoned_sets = (uint64_t *)drop;
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = raw_call_on(&C, NULL, RAW_METHOD("Checkpoint"), &r.base, NULL, 0, detail, &resp, &len);
  if (on_disk) on_disk[0] = '\0';
  if (st == RPC_OK && on_disk) {
    Ps__CheckpointResponse *a = ps__checkpoint_response__unpack(NULL, len, resp);
    if (!a) {
      snprintf(detail, PS_ERRLEN, "malformed Checkpoint answer");
      st = -1;
    } else {
      size_t at = 0;
      for (size_t i = 0; i < a->n_sets_on_disk && at < 200; i++)
        at += (size_t)snprintf(on_disk + at, 256 - at, "%s%" PRIu64, i ? " " : "",
                               a->sets_on_disk[i]);
      ps__checkpoint_response__free_unpacked(a, NULL);
    }
  }
  free(resp);
  return st;
}

#define PREPARE PS__CHECKPOINT_REQUEST__PHASE__PREPARE
#define CUT PS__CHECKPOINT_REQUEST__PHASE__CUT
#define ABORT PS__CHECKPOINT_REQUEST__PHASE__ABORT

/* A set taken whole at term: PREPARE, then CUT with keep and drop. */
static void take_set(uint64_t set, uint64_t term, const uint64_t *keep, size_t n_keep,
                     const uint64_t *drop, size_t n_drop, char *on_disk) {
  char detail[PS_ERRLEN], what[96];
  snprintf(what, sizeof what, "PREPARE of set %" PRIu64 " at term %" PRIu64, set, term);
  RAW_EXPECT(what, ckpt_call(PREPARE, set, term, NULL, 0, NULL, 0, on_disk, detail), RPC_OK, "");
  snprintf(what, sizeof what, "CUT of set %" PRIu64 " at term %" PRIu64, set, term);
  RAW_EXPECT(what, ckpt_call(CUT, set, term, keep, n_keep, drop, n_drop, NULL, detail), RPC_OK, "");
  CHECK_MSG(has_set(set), "no file of set %" PRIu64 " after its CUT", set);
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: ckpt_check HOST:PORT CHECKPOINT_DIR\n");
    return 2;
  }
  g_dir = argv[2];
  char detail[PS_ERRLEN], warn[PS_ERRLEN], on_disk[256];
  const char *tf = getenv("PS_TOKEN_FILE");
  if (!tf || ps_token_load(tf, &token, warn, detail) != 0) {
    fprintf(stderr, "ckpt_check: PS_TOKEN_FILE: %s\n", tf ? detail : "not set");
    return 2;
  }
  rpc_global_init();
  char err[PS_ERRLEN];
  C.ch = rpc_channel_create(argv[1], NULL, err);
  C.q = rpc_queue_create();
  if (!C.ch || !C.q) return 1;
  shard_view v;
  get_view(&v);
  CHECK_MSG(v.set == 0, "the shard has taken set %" PRIu64 " already", v.set);

  /* The coordinator of term 7 takes set 100: the shard has seen term 7. */
  take_set(100, 7, NULL, 0, NULL, 0, NULL);
  get_view(&v);
  CHECK_MSG(v.set == 100, "Status names set %" PRIu64 ", not 100", v.set);

  /* A deposed coordinator (term 6, and 0: one without replication) is
   * refused its PREPARE, which holds nothing: the current coordinator's CUT
   * of that set then finds no set under way. */
  RAW_EXPECT("PREPARE of set 101 at term 6 (7 seen)",
             ckpt_call(PREPARE, 101, 6, NULL, 0, NULL, 0, NULL, detail), RPC_FAILED_PRECONDITION,
             "comes from a deposed primary of shard 0 (its term 6, term 7 seen)");
  RAW_EXPECT("PREPARE of set 101 at term 0 (7 seen)",
             ckpt_call(PREPARE, 101, 0, NULL, 0, NULL, 0, NULL, detail), RPC_FAILED_PRECONDITION,
             "deposed primary");
  same_view(&v, "a PREPARE of a deposed coordinator");
  RAW_EXPECT("CUT of set 101 at term 7 after the refused PREPARE",
             ckpt_call(CUT, 101, 7, NULL, 0, NULL, 0, NULL, detail), RPC_FAILED_PRECONDITION,
             "is not prepared for set 101 (no set under way");
  same_view(&v, "a CUT of a set never prepared");

  /* The current coordinator prepares set 102; a deposed one's CUT of it
   * (naming set 100 abandoned) is refused: nothing written, nothing
   * deleted, and the hold is still the current coordinator's to end. */
  RAW_EXPECT("PREPARE of set 102 at term 7",
             ckpt_call(PREPARE, 102, 7, NULL, 0, NULL, 0, on_disk, detail), RPC_OK, "");
  CHECK_MSG(strcmp(on_disk, "100") == 0, "sets on disk: '%s', not '100'", on_disk);
  const uint64_t s100 = 100;
  RAW_EXPECT(
      "CUT of set 102 at term 6 naming set 100 abandoned",
      ckpt_call(CUT, 102, 6, NULL, 0, &s100, 1, NULL, detail), RPC_FAILED_PRECONDITION,
      "checkpoint set 102 comes from a deposed primary of shard 0 (its term 6, term 7 seen)");
  same_view(&v, "a CUT of a deposed coordinator");
  CHECK(has_set(100) && !has_set(102));
  RAW_EXPECT("ABORT of set 102 at term 7", ckpt_call(ABORT, 102, 7, NULL, 0, NULL, 0, NULL, detail),
             RPC_OK, "");
  RAW_EXPECT("CUT of set 102 at term 7 after its ABORT",
             ckpt_call(CUT, 102, 7, NULL, 0, &s100, 1, NULL, detail), RPC_FAILED_PRECONDITION,
             "is not prepared for set 102");
  same_view(&v, "an ABORT and a CUT of a set aborted (naming set 100 abandoned)");

  /* Sets that will not be complete. 103 is taken; 104's CUT names 100,
   * 103 and 104 abandoned and keeps 103: 100 goes, 103 (kept) and 104 (its
   * own) stay. */
  take_set(103, 7, NULL, 0, NULL, 0, on_disk);
  CHECK_MSG(strcmp(on_disk, "100") == 0, "sets on disk at 103's PREPARE: '%s'", on_disk);
  const uint64_t keep103 = 103, drop3[3] = {100, 103, 104};
  take_set(104, 7, &keep103, 1, drop3, 3, on_disk);
  CHECK_MSG(strcmp(on_disk, "103 100") == 0, "sets on disk at 104's PREPARE: '%s'", on_disk);
  CHECK_MSG(!has_set(100), "set 100, named abandoned, is still on disk");
  CHECK(has_set(103) && has_set(104));
  printf(
      "ckpt_check: a CUT naming sets 100, 103 and 104 abandoned, keeping 103: 100 deleted, 103 "
      "and 104 kept\n");
  /* Without a kept set: 103 goes, whatever is newer. */
  const uint64_t drop103 = 103;
  take_set(105, 7, NULL, 0, &drop103, 1, on_disk);
  CHECK_MSG(strcmp(on_disk, "104 103") == 0, "sets on disk at 105's PREPARE: '%s'", on_disk);
  CHECK(!has_set(103) && has_set(104) && has_set(105));

  /* A higher term (a new primary) is taken; the one before is deposed. */
  RAW_EXPECT("PREPARE of set 106 at term 8",
             ckpt_call(PREPARE, 106, 8, NULL, 0, NULL, 0, NULL, detail), RPC_OK, "");
  RAW_EXPECT("ABORT of set 106 at term 8", ckpt_call(ABORT, 106, 8, NULL, 0, NULL, 0, NULL, detail),
             RPC_OK, "");
  get_view(&v);
  const uint64_t drop104 = 104;
  RAW_EXPECT("PREPARE of set 107 at term 7 (8 seen)",
             ckpt_call(PREPARE, 107, 7, NULL, 0, NULL, 0, NULL, detail), RPC_FAILED_PRECONDITION,
             "(its term 7, term 8 seen)");
  RAW_EXPECT("CUT of set 107 at term 7 naming set 104 abandoned",
             ckpt_call(CUT, 107, 7, NULL, 0, &drop104, 1, NULL, detail), RPC_FAILED_PRECONDITION,
             "(its term 7, term 8 seen)");
  same_view(&v, "a PREPARE and a CUT of the coordinator deposed by term 8");
  CHECK(has_set(104) && has_set(105));

  rpc_queue_destroy(C.q);
  rpc_channel_destroy(C.ch);
  rpc_global_shutdown();
  if (check_failed_) {
    fprintf(stderr, "ckpt_check: %d check(s) failed\n", check_failed_);
    return 1;
  }
  printf("ckpt_check: all passed (%d checks)\n", check_passed_);
  return 0;
}
