/* Embedding tables on live shards (jobs/tables.json: 2 shards, a bounded
 * table "cat" (100000 x 8, adagrad) and an unbounded one "hashed" (dim 4,
 * adam, at most 3000 rows per shard)), through the worker's client and as
 * a careless client:
 *   - rows pulled before any push are the initial values (ps_table_init_row);
 *   - a push of rows and dense gradients moves each row by exactly one
 *     lazy optimizer step (the optimizer's own apply, bit for bit), leaves
 *     rows not named as they were, and moves each shard's version by one;
 *   - rows of both tables land on the shard placement says, and Status
 *     counts them;
 *   - refused, each with a message, and nothing changed (each shard's
 *     version, state CRC and tables' CRC and rows): a table that is not
 *     the job's, a table twice, ids not in 8-byte units, an id beyond the
 *     table, an id of the other shard, an id twice, a NaN row gradient (its
 *     dense gradient valid: the push is all or nothing), too few and too
 *     many gradient bytes, rows beyond max_rows_per_shard; the client
 *     refuses a bad table and an id beyond the table.
 *
 *   table_check JOB HOST:PORT0,HOST:PORT1
 *
 * And for restarts from checkpoints (run_tests.sh tables): --save pulls
 * the dense values and a fixed list of rows of both tables (those the
 * checks push, some never pushed) and writes them to FILE, with each
 * shard's version on stdout ("versions V0 V1 ..."); --compare pulls the
 * same from shards restarted from the checkpoints (any number of them:
 * ADDRS lists them all) and checks every value bit for bit.
 *
 *   table_check --save FILE JOB ADDRS
 *   table_check --compare FILE JOB ADDRS
 *
 * --big pushes 40,000 rows (as the end of the checks does) to shards of
 * any number and checks each moved by one step, bit for bit (on a 16-bit
 * wire: the step of the gradient as it travels, read back as it travels).
 *
 *   table_check --big JOB ADDRS */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/cluster.h"
#include "../../common/emb.h"
#include "../../common/half.h"
#include "../../common/job.h"
#include "../../common/optim.h"
#include "../../common/util.h"
#include "worker/client/ps_client.h"
#include "../unit/check.h"
#include "raw_client.h"
#include "env_token.h"

enum { S = 2, NCAT = 600, NHASH = 300 };

static ps_job job;
static raw_client raw[S];
static raw_identity who[S];
static ps_token token, *tok; /* from PS_TOKEN_FILE when set */

typedef struct {
  uint64_t version;
  uint32_t state_crc;
  uint32_t crc[PS_MAX_TABLES];
  uint64_t held[PS_MAX_TABLES], rejected[PS_MAX_TABLES];
} shard_state;

static int status_of(int s, shard_state *out) {
  Ps__RequestHeader h;
  raw_header(&raw[s], &h, tok, NULL);
  Ps__StatusRequest req = PS__STATUS_REQUEST__INIT;
  req.header = &h;
  char detail[PS_ERRLEN];
  uint8_t *resp = NULL;
  size_t len = 0;
  int st = raw_call_on(&raw[s], NULL, RAW_METHOD("Status"), &req.base, NULL, 0, detail, &resp,
                       &len);
  Ps__StatusResponse *r = st == RPC_OK ? ps__status_response__unpack(NULL, len, resp) : NULL;
  free(resp);
  if (!r) {
    fprintf(stderr, "Status of shard %d: %s %s\n", s, rpc_status_name(st), detail);
    return -1;
  }
  memset(out, 0, sizeof *out);
  out->version = r->version;
  out->state_crc = r->state_crc;
  for (size_t i = 0; i < r->n_tables && i < PS_MAX_TABLES; i++) {
    out->crc[i] = r->tables[i]->crc;
    out->held[i] = r->tables[i]->rows_held;
    out->rejected[i] = r->tables[i]->rejected;
  }
  ps__status_response__free_unpacked(r, NULL);
  return 0;
}

/* A raw Push to shard s: dense gradient g (count values from the range's
 * start), row sections secs (ids as given, any bytes), then extra row
 * gradient bytes rg (rbytes). */
static int raw_push_rows(int s, const float *g, size_t count, Ps__TableRows **secs, size_t nsec,
                         const void *rg, size_t rbytes, char *detail) {
  Ps__RequestHeader h;
  raw_header(&raw[s], &h, tok, &who[s]);
  Ps__PushRequest req = PS__PUSH_REQUEST__INIT;
  req.header = &h;
  req.offset = raw[s].range_off;
  req.count = count;
  req.batch_size = 1;
  req.base_version = raw[s].base_version;
  req.n_rows = nsec;
  req.rows = secs;
  size_t db = count * sizeof(float);
  uint8_t *buf = malloc(db + rbytes + 1);
  memcpy(buf, g, db);
  memcpy(buf + db, rg, rbytes);
  int st = raw_call_on(&raw[s], NULL, RAW_METHOD("Push"), &req.base, buf, db + rbytes, detail,
                       NULL, NULL);
  free(buf);
  return st;
}

static int raw_pull_rows(int s, Ps__TableRows **secs, size_t nsec, char *detail) {
  Ps__RequestHeader h;
  Ps__PullRequest req;
  raw_pull_request(&raw[s], &req, &h, tok, &who[s], 0);
  req.n_rows = nsec;
  req.rows = secs;
  return raw_call_on(&raw[s], NULL, RAW_METHOD("Pull"), &req.base, NULL, 0, detail, NULL, NULL);
}

/* n ids of table t placed on shard s (from start, stepping by step). */
static size_t ids_on(int t, int s, uint64_t start, uint64_t step, uint64_t *out, size_t n) {
  size_t k = 0;
  for (uint64_t id = start; k < n; id += step) {
    uint64_t local;
    if (ps_table_place(&job.tables[t], S, id, &local) == s) out[k++] = id;
  }
  return k;
}

static int same_state(const shard_state *a, const shard_state *b) {
  return a->version == b->version && a->state_crc == b->state_crc &&
         memcmp(a->crc, b->crc, sizeof a->crc) == 0 && memcmp(a->held, b->held, sizeof a->held) == 0;
}

/* The rows --save and --compare pull: every 7th id of "cat" and its last
 * row (pushed by the checks), the 4 rows of shard 0 of 2 the control push
 * pushed, 4 never pushed; the "hashed" ids the checks pushed. */
enum { NSAVE_CAT = NCAT + 8 };
static void saved_ids(uint64_t *cat, uint64_t *hsh) {
  for (int i = 0; i < NCAT; i++) cat[i] = (uint64_t)i * 7;
  cat[NCAT - 1] = job.tables[0].rows - 1;
  ids_on(0, 0, 5, 7, cat + NCAT, 4);
  const uint64_t never[4] = {1, 2, 3, 99998};
  memcpy(cat + NCAT + 4, never, sizeof never);
  for (int i = 0; i < NHASH; i++) hsh[i] = 0x9e3779b97f4a7c15ULL * (uint64_t)(i + 1);
}

/* --save / --compare (see the top). */
static int save_or_compare(int save, const char *file, const char *list) {
  char err[PS_ERRLEN];
  char first[256];
  snprintf(first, sizeof first, "%.*s", (int)strcspn(list, ","), list);
  ps_client_opts o = {.host = "table-check-restart", .role = "worker", .task_index = -1,
                      .timeout_ms = 20000, .connect_timeout_ms = 30000, .token = tok};
  ps_client *c = ps_client_connect(first, &o, err);
  if (!c) {
    fprintf(stderr, "connect: %s\n", err);
    return 1;
  }
  const size_t P = ps_client_param_count(c);
  const size_t dc = (size_t)job.tables[0].dim, dh = (size_t)job.tables[1].dim;
  uint64_t cat[NSAVE_CAT], hsh[NHASH];
  saved_ids(cat, hsh);
  const size_t n_vals = P + NSAVE_CAT * dc + NHASH * dh;
  float *now = calloc(n_vals, sizeof(float)), *then = calloc(n_vals, sizeof(float));
  ps_client_rows secs[2] = {{0, cat, NSAVE_CAT, now + P, NULL},
                            {1, hsh, NHASH, now + P + NSAVE_CAT * dc, NULL}};
  CHECK_MSG(ps_client_set_rows(c, secs, 2, err) == 0, "%s", err);
  uint64_t versions[PS_MAX_TASKS] = {0};
  int rc = ps_client_pull(c, now, versions, NULL, err);
  CHECK_MSG(rc == 0, "pull: %s", err);
  int n_shards = 1;
  for (const char *q = list; *q; q++) n_shards += *q == ',';
  if (rc == 0 && save) {
    FILE *f = fopen(file, "wb");
    CHECK_MSG(f && fwrite(&P, sizeof P, 1, f) == 1 && fwrite(now, sizeof(float), n_vals, f) == n_vals,
              "cannot write '%s'", file);
    if (f) CHECK(fclose(f) == 0);
    printf("versions");
    for (int s = 0; s < n_shards; s++) printf(" %" PRIu64, versions[s]);
    printf("\n");
    printf("saved %zu dense values and %d + %d rows to %s\n", P, NSAVE_CAT, NHASH, file);
  } else if (rc == 0) {
    FILE *f = fopen(file, "rb");
    size_t P0 = 0;
    CHECK_MSG(f && fread(&P0, sizeof P0, 1, f) == 1 && P0 == P &&
                  fread(then, sizeof(float), n_vals, f) == n_vals,
              "cannot read '%s' (or another P)", file);
    if (f) fclose(f);
    CHECK_MSG(memcmp(now, then, P * sizeof(float)) == 0,
              "the dense values differ from those before the restart");
    size_t bad_c = 0, bad_h = 0;
    for (size_t i = 0; i < NSAVE_CAT; i++)
      bad_c += memcmp(now + P + i * dc, then + P + i * dc, dc * sizeof(float)) != 0;
    for (size_t i = 0; i < NHASH; i++)
      bad_h += memcmp(now + P + NSAVE_CAT * dc + i * dh, then + P + NSAVE_CAT * dc + i * dh,
                      dh * sizeof(float)) != 0;
    CHECK_MSG(bad_c == 0 && bad_h == 0,
              "after the restart on %d shard(s), %zu of %d rows of 'cat' and %zu of %d of "
              "'hashed' differ from before",
              n_shards, bad_c, NSAVE_CAT, bad_h, NHASH);
    printf("restarted on %d shard(s): %zu dense values and %d + %d rows as before, bit for bit\n",
           n_shards, P, NSAVE_CAT, NHASH);
  }
  ps_client_leave(c);
  ps_client_destroy(c);
  free(now);
  free(then);
  return check_summary();
}

/* A large push, many times the size of a gRPC slice on each shard: the
 * shards read its rows' gradients where they lie in the request, rows
 * split between two slices put together. Every row moved by exactly one
 * step, bit for bit. Rows 5000 + 2i of "cat", none pushed before. */
/* out = in as the job's wire carries it (float32: as it is). */
static void round_wire(const float *in, float *out, int n) {
  if (job.wire == PS_WIRE_FP32) {
    memcpy(out, in, (size_t)n * sizeof(float));
    return;
  }
  uint16_t h[PS_TABLE_MAX_DIM];
  ps_half_encode(job.wire, in, h, (size_t)n);
  ps_half_decode(job.wire, h, out, (size_t)n);
}

static void big_push(ps_client *c, size_t P, float *params, float *grads, uint64_t *versions,
                     uint64_t *v2) {
  enum { NBIG = 40000 };
  char err[PS_ERRLEN];
  const int dc = job.tables[0].dim;
  ps_push_result res;
  uint64_t *big = malloc(NBIG * sizeof *big);
  float *vb = malloc((size_t)NBIG * dc * sizeof(float)), *gb = malloc((size_t)NBIG * dc * sizeof(float));
  float *wb = malloc((size_t)NBIG * dc * sizeof(float));
  const ps_optimizer *opt = ps_optimizer_find(job.table_optim[0].name);
  for (int i = 0; i < NBIG; i++) {
    big[i] = 5000 + 2 * (uint64_t)i;
    float rec[PS_TABLE_MAX_DIM * 3];
    ps_table_init_row(&job.tables[0], job.seed, big[i], rec);
    float *sl[2] = {rec + dc, rec + 2 * dc};
    for (int k = 0; k < opt->n_slots; k++)
      for (int j = 0; j < dc; j++) sl[k][j] = opt->slot_init(&job.table_optim[0], k);
    for (int j = 0; j < dc; j++) gb[(size_t)i * dc + j] = 0.001f * (float)((i * 7 + j) % 19 - 9);
    /* On a 16-bit wire the shard takes the gradient as the worker rounds
     * it, and the rows come back rounded the same way. */
    float gr[PS_TABLE_MAX_DIM];
    round_wire(gb + (size_t)i * dc, gr, dc);
    opt->apply(&job.table_optim[0], 1, job.table_optim[0].lr, rec, sl, gr, (size_t)dc);
    round_wire(rec, wb + (size_t)i * dc, dc);
  }
  ps_client_rows bs = {0, big, NBIG, vb, gb};
  CHECK_MSG(ps_client_set_wire(c, job.wire, err) == 0, "%s", err);
  CHECK_MSG(ps_client_set_rows(c, &bs, 1, err) == 0, "%s", err);
  CHECK_MSG(ps_client_pull(c, params, versions, NULL, err) == 0, "pull: %s", err);
  memset(grads, 0, P * sizeof(float));
  CHECK_MSG(ps_client_push(c, grads, versions, 2, 32, &res, err) == 0, "big push: %s", err);
  memset(vb, 0, (size_t)NBIG * dc * sizeof(float));
  CHECK_MSG(ps_client_pull(c, params, v2, NULL, err) == 0, "pull: %s", err);
  CHECK_MSG(memcmp(vb, wb, (size_t)NBIG * dc * sizeof(float)) == 0,
            "a push of %d rows to %d shard(s) (%s): rows differ from one adagrad step", NBIG,
            ps_client_num_shards(c), ps_wire_name(job.wire));
  printf("a push of %d rows (%zu gradient values) to %d shard(s) (%s): each moved by one step, "
         "bit for bit\n",
         NBIG, (size_t)NBIG * dc, ps_client_num_shards(c), ps_wire_name(job.wire));
  free(big), free(vb), free(gb), free(wb);
}

int main(int argc, char **argv) {
  if (argc == 5 && (strcmp(argv[1], "--save") == 0 || strcmp(argv[1], "--compare") == 0)) {
    char err[PS_ERRLEN];
    if (ps_job_load(argv[3], &job, NULL, err) != 0) {
      fprintf(stderr, "%s\n", err);
      return 2;
    }
    rpc_global_init();
    if (env_token_load(&token, &tok)) return 2;
    return save_or_compare(argv[1][2] == 's', argv[2], argv[4]);
  }
  if (argc == 4 && strcmp(argv[1], "--big") == 0) {
    /* The large push alone, on shards of any number (one: the worker
     * reads and sends each section whole). */
    char err[PS_ERRLEN];
    if (ps_job_load(argv[2], &job, NULL, err) != 0) {
      fprintf(stderr, "%s\n", err);
      return 2;
    }
    rpc_global_init();
    if (env_token_load(&token, &tok)) return 2;
    ps_client_opts o = {.host = "table-check", .role = "worker", .task_index = -1,
                        .timeout_ms = 20000, .connect_timeout_ms = 30000, .token = tok};
    ps_client *c = ps_client_connect(argv[3], &o, err);
    if (!c) {
      fprintf(stderr, "connect: %s\n", err);
      return 1;
    }
    const size_t P = ps_client_param_count(c);
    const int ns = ps_client_num_shards(c);
    float *params = calloc(P, sizeof(float)), *grads = calloc(P, sizeof(float));
    uint64_t *versions = calloc((size_t)ns, sizeof *versions), *v2 = calloc((size_t)ns, sizeof *v2);
    big_push(c, P, params, grads, versions, v2);
    ps_client_leave(c);
    ps_client_destroy(c);
    free(params), free(grads), free(versions), free(v2);
    return check_summary();
  }
  if (argc != 3) {
    fprintf(stderr, "usage: table_check JOB HOST:PORT0,HOST:PORT1\n"
                    "       table_check --big JOB HOST:PORT,...\n"
                    "       table_check --save|--compare FILE JOB HOST:PORT,...\n");
    return 2;
  }
  char err[PS_ERRLEN], detail[PS_ERRLEN];
  if (ps_job_load(argv[1], &job, NULL, err) != 0) {
    fprintf(stderr, "%s\n", err);
    return 2;
  }
  char addrs[2][128];
  const char *comma = strchr(argv[2], ',');
  if (!comma) return 2;
  snprintf(addrs[0], sizeof addrs[0], "%.*s", (int)(comma - argv[2]), argv[2]);
  snprintf(addrs[1], sizeof addrs[1], "%s", comma + 1);

  rpc_global_init();
  if (env_token_load(&token, &tok)) return 2;
  /* The worker's client. */
  ps_client_opts o = {.host = "table-check", .role = "worker", .task_index = -1,
                      .timeout_ms = 20000, .connect_timeout_ms = 30000, .token = tok};
  ps_client *c = ps_client_connect(addrs[0], &o, err);
  if (!c) {
    fprintf(stderr, "connect: %s\n", err);
    return 1;
  }
  const size_t P = ps_client_param_count(c);
  const int dc = job.tables[0].dim, dh = job.tables[1].dim;
  /* Ids of both shards: every 7th id of "cat" (and 2 near its end),
   * arbitrary 64-bit ones of "hashed". */
  uint64_t *cat = malloc(NCAT * sizeof *cat), *hsh = malloc(NHASH * sizeof *hsh);
  for (int i = 0; i < NCAT; i++) cat[i] = (uint64_t)i * 7;
  cat[NCAT - 1] = job.tables[0].rows - 1;
  for (int i = 0; i < NHASH; i++) hsh[i] = 0x9e3779b97f4a7c15ULL * (uint64_t)(i + 1);
  float *vc = calloc(NCAT * (size_t)dc, sizeof(float)), *vh = calloc(NHASH * (size_t)dh, sizeof(float));
  float *gc = calloc(NCAT * (size_t)dc, sizeof(float)), *gh = calloc(NHASH * (size_t)dh, sizeof(float));
  ps_client_rows secs[2] = {{0, cat, NCAT, vc, gc}, {1, hsh, NHASH, vh, gh}};
  CHECK_MSG(ps_client_set_rows(c, secs, 2, err) == 0, "%s", err);
  float *params = calloc(P, sizeof(float)), *grads = calloc(P, sizeof(float));
  uint64_t versions[S] = {0}, v2[S];
  CHECK_MSG(ps_client_pull(c, params, versions, NULL, err) == 0, "pull: %s", err);
  int init_ok = 1;
  for (int i = 0; i < NCAT; i++) {
    float want[PS_TABLE_MAX_DIM];
    ps_table_init_row(&job.tables[0], job.seed, cat[i], want);
    if (memcmp(want, vc + (size_t)i * dc, (size_t)dc * sizeof(float))) init_ok = 0;
  }
  for (int i = 0; i < NHASH; i++) {
    float want[PS_TABLE_MAX_DIM];
    ps_table_init_row(&job.tables[1], job.seed, hsh[i], want);
    if (memcmp(want, vh + (size_t)i * dh, (size_t)dh * sizeof(float))) init_ok = 0;
  }
  CHECK_MSG(init_ok, "rows pulled before any push are not the initial values");
  printf("pulled %d + %d rows (initial values) with %zu dense values\n", NCAT, NHASH, P);

  /* One push: every row's gradient a function of its id. Expected rows:
   * the optimizer's apply on the initial record, t = 1. */
  for (int i = 0; i < NCAT * dc; i++) gc[i] = 0.01f * (float)((i % 13) - 6);
  for (int i = 0; i < NHASH * dh; i++) gh[i] = 0.02f * (float)((i % 5) - 2);
  for (size_t i = 0; i < P; i++) grads[i] = 0.001f;
  float *want_c = malloc(NCAT * (size_t)dc * sizeof(float));
  float *want_h = malloc(NHASH * (size_t)dh * sizeof(float));
  for (int t = 0; t < 2; t++) {
    const ps_optimizer *opt = ps_optimizer_find(job.table_optim[t].name);
    int d = job.tables[t].dim, n = t ? NHASH : NCAT;
    const uint64_t *ids = t ? hsh : cat;
    float *want = t ? want_h : want_c;
    const float *g = t ? gh : gc;
    float rec[PS_TABLE_MAX_DIM * 3];
    for (int i = 0; i < n; i++) {
      ps_table_init_row(&job.tables[t], job.seed, ids[i], rec);
      float *sl[2] = {rec + d, rec + 2 * d};
      for (int k = 0; k < opt->n_slots; k++)
        for (int j = 0; j < d; j++) sl[k][j] = opt->slot_init(&job.table_optim[t], k);
      opt->apply(&job.table_optim[t], 1, job.table_optim[t].lr, rec, sl, g + (size_t)i * d,
                 (size_t)d);
      memcpy(want + (size_t)i * d, rec, (size_t)d * sizeof(float));
    }
  }
  ps_push_result res;
  CHECK_MSG(ps_client_push(c, grads, versions, 1, 32, &res, err) == 0, "push: %s", err);
  CHECK_MSG(ps_client_pull(c, params, v2, NULL, err) == 0, "pull: %s", err);
  for (int s = 0; s < S; s++) CHECK(v2[s] == versions[s] + 1);
  CHECK_MSG(memcmp(vc, want_c, NCAT * (size_t)dc * sizeof(float)) == 0,
            "table 'cat' rows differ from one adagrad step");
  CHECK_MSG(memcmp(vh, want_h, NHASH * (size_t)dh * sizeof(float)) == 0,
            "table 'hashed' rows differ from one adam step");
  printf("one push: %d + %d rows moved by one lazy optimizer step each, bit for bit\n", NCAT,
         NHASH);
  /* Rows not named stay at their initial values. */
  uint64_t other[4] = {1, 2, 3, 99998};
  float vo[4 * 8];
  ps_client_rows one = {0, other, 4, vo, NULL};
  CHECK(ps_client_set_rows(c, &one, 1, err) == 0);
  CHECK(ps_client_pull(c, params, v2, NULL, err) == 0);
  int untouched = 1;
  for (int i = 0; i < 4; i++) {
    float want[8];
    ps_table_init_row(&job.tables[0], job.seed, other[i], want);
    if (memcmp(want, vo + i * 8, sizeof want)) untouched = 0;
  }
  CHECK_MSG(untouched, "rows not pushed changed");
  /* Placement: each shard holds the rows placement gives it. */
  shard_state st0[S];
  for (int s = 0; s < S; s++) {
    raw[s].timeout_ms = 20000;
    raw[s].q = rpc_queue_create();
    rpc_channel_opts plain = {.keepalive_ms = RPC_DEFAULT_KEEPALIVE_MS};
    raw[s].ch = rpc_channel_create(addrs[s], &plain, err);
    CHECK_MSG(raw_register(&raw[s], tok, "worker", "table-check-raw", NULL, &who[s], detail) ==
                  RPC_OK,
              "register with shard %d: %s", s, detail);
    CHECK(status_of(s, &st0[s]) == 0);
    uint64_t want_held[2] = {0, 0}, local;
    for (int i = 0; i < NCAT; i++) want_held[0] += ps_table_place(&job.tables[0], S, cat[i], &local) == s;
    for (int i = 0; i < NHASH; i++) want_held[1] += ps_table_place(&job.tables[1], S, hsh[i], &local) == s;
    CHECK_MSG(st0[s].held[0] == want_held[0] && st0[s].held[1] == want_held[1],
              "shard %d holds %" PRIu64 " + %" PRIu64 " rows, placement says %" PRIu64
              " + %" PRIu64, s, st0[s].held[0], st0[s].held[1], want_held[0], want_held[1]);
    printf("shard %d holds %" PRIu64 " rows of 'cat' and %" PRIu64 " of 'hashed'\n", s,
           st0[s].held[0], st0[s].held[1]);
    raw[s].base_version = st0[s].version;
  }

  /* Bad input, on shard 0: each refused, nothing changed. */
  uint64_t mine[4], theirs[1];
  ids_on(0, 0, 5, 7, mine, 4); /* none a multiple of 7: not pushed yet */
  ids_on(0, 1, 5, 1, theirs, 1);
  uint8_t ib[64];
  for (int i = 0; i < 4; i++) ps_put_le64(ib + 8 * i, mine[i]);
  size_t dense0 = raw[0].range_cnt;
  float *g0 = calloc(dense0 + 1, sizeof(float));
  for (size_t i = 0; i < dense0; i++) g0[i] = 0.01f;
  float rg[64]; /* room for the "too many bytes" case */
  for (int i = 0; i < 64; i++) rg[i] = 0.1f;
  Ps__TableRows a = PS__TABLE_ROWS__INIT, b = PS__TABLE_ROWS__INIT;
  Ps__TableRows *one_sec[1] = {&a}, *two_sec[2] = {&a, &b};
  typedef struct {
    const char *what;
    int table;
    const uint8_t *ids;
    size_t idlen;
    int twice;
    size_t rbytes;
    int nan;
    int code;
    const char *substr;
  } bad_case;
  bad_case cases[8];
  uint8_t far[8], theirs_b[8], dup[16];
  ps_put_le64(far, job.tables[0].rows);
  ps_put_le64(theirs_b, theirs[0]);
  ps_put_le64(dup, mine[0]);
  ps_put_le64(dup + 8, mine[0]);
  int nc = 0;
  cases[nc++] = (bad_case){"a table the job does not have", 5, ib, 8, 0, 32, 0,
                                   RPC_INVALID_ARGUMENT, "names table 5"};
  cases[nc++] = (bad_case){"a table twice", 0, ib, 8, 1, 64, 0, RPC_INVALID_ARGUMENT,
                                   "two row sections"};
  cases[nc++] = (bad_case){"ids not in 8-byte units", 0, ib, 12, 0, 32, 0,
                                   RPC_INVALID_ARGUMENT, "not a multiple of 8"};
  cases[nc++] = (bad_case){"an id beyond the table", 0, far, 8, 0, 32, 0,
                                   RPC_OUT_OF_RANGE, "is not a row"};
  cases[nc++] = (bad_case){"an id of the other shard", 0, theirs_b, 8, 0, 32, 0,
                                   RPC_INVALID_ARGUMENT, "lives on shard 1"};
  cases[nc++] = (bad_case){"an id twice", 0, dup, 16, 0, 64, 0, RPC_INVALID_ARGUMENT,
                                   "named twice"};
  cases[nc++] = (bad_case){"a NaN row gradient (valid dense one)", 0, ib, 32, 0, 128, 1,
                                   RPC_INVALID_ARGUMENT, "is NaN"};
  cases[nc++] = (bad_case){"too few gradient bytes for the rows", 0, ib, 32, 0, 120, 0,
                                   RPC_INVALID_ARGUMENT, "expected"};
  for (int k = 0; k < nc; k++) {
    a.table = (uint32_t)cases[k].table;
    a.ids = (ProtobufCBinaryData){cases[k].idlen, (uint8_t *)cases[k].ids};
    b = a;
    float rgk[64];
    for (int i = 0; i < 64; i++) rgk[i] = 0.1f;
    if (cases[k].nan) rgk[9] = NAN;
    int stc = raw_push_rows(0, g0, dense0, cases[k].twice ? two_sec : one_sec,
                            cases[k].twice ? 2 : 1, rgk, cases[k].rbytes, detail);
    CHECK_MSG(stc == cases[k].code && strstr(detail, cases[k].substr),
              "push, %s: got %s '%s', want %s with '%s'", cases[k].what, rpc_status_name(stc),
              detail, rpc_status_name(cases[k].code), cases[k].substr);
    printf("  push, %-40s -> %s: %.70s\n", cases[k].what, rpc_status_name(stc), detail);
    shard_state now;
    CHECK(status_of(0, &now) == 0);
    CHECK_MSG(same_state(&now, &st0[0]), "shard 0 changed after: %s", cases[k].what);
  }
  /* Too many bytes: the dense part's check refuses the total. */
  a.table = 0;
  a.ids = (ProtobufCBinaryData){32, ib};
  int stx = raw_push_rows(0, g0, dense0, one_sec, 1, rg, 4 * 8 * 4 + 4, detail);
  CHECK_MSG(stx == RPC_INVALID_ARGUMENT && strstr(detail, "expected"), "too many bytes: %s '%s'",
            rpc_status_name(stx), detail);
  printf("  push, %-40s -> %s: %.70s\n", "too many gradient bytes", rpc_status_name(stx), detail);
  /* Pulls of bad rows. */
  a.ids = (ProtobufCBinaryData){8, theirs_b};
  stx = raw_pull_rows(0, one_sec, 1, detail);
  CHECK_MSG(stx == RPC_INVALID_ARGUMENT && strstr(detail, "lives on shard 1"), "pull: %s '%s'",
            rpc_status_name(stx), detail);
  a.ids = (ProtobufCBinaryData){16, dup};
  stx = raw_pull_rows(0, one_sec, 1, detail);
  CHECK_MSG(stx == RPC_INVALID_ARGUMENT && strstr(detail, "named twice"), "pull: %s '%s'",
            rpc_status_name(stx), detail);
  /* Beyond max_rows_per_shard: 3000 rows on a shard at most; this push
   * would make more. Refused whole. */
  {
    shard_state before;
    CHECK(status_of(0, &before) == 0);
    size_t want_new = 3000 - (size_t)before.held[1] + 5;
    uint64_t *many = malloc(want_new * sizeof *many);
    ids_on(1, 0, 1ULL << 40, 977, many, want_new);
    uint8_t *mb = malloc(want_new * 8);
    for (size_t i = 0; i < want_new; i++) ps_put_le64(mb + 8 * i, many[i]);
    float *mg = calloc(want_new * (size_t)dh, sizeof(float));
    a.table = 1;
    a.ids = (ProtobufCBinaryData){want_new * 8, mb};
    stx = raw_push_rows(0, g0, dense0, one_sec, 1, mg, want_new * (size_t)dh * 4, detail);
    CHECK_MSG(stx == RPC_OUT_OF_RANGE && strstr(detail, "max_rows_per_shard"),
              "cap: %s '%s'", rpc_status_name(stx), detail);
    printf("  push, %-40s -> %s: %.70s\n", "rows beyond max_rows_per_shard", rpc_status_name(stx),
           detail);
    shard_state now;
    CHECK(status_of(0, &now) == 0);
    CHECK_MSG(same_state(&now, &before), "shard 0 changed after a push beyond the cap");
    free(many);
    free(mb);
    free(mg);
  }
  /* The client's own checks. */
  ps_client_rows bad = {7, cat, 1, vc, gc};
  CHECK(ps_client_set_rows(c, &bad, 1, err) == PS_EINVAL);
  uint64_t beyond = job.tables[0].rows;
  ps_client_rows bad2 = {0, &beyond, 1, vc, gc};
  CHECK(ps_client_set_rows(c, &bad2, 1, err) == PS_ERANGE && strstr(err, "is not a row"));
  /* Control: a valid raw push of the same rows is applied (the cases above
   * could fail only for their fault). */
  a.table = 0;
  a.ids = (ProtobufCBinaryData){32, ib};
  stx = raw_push_rows(0, g0, dense0, one_sec, 1, rg, 128, detail);
  CHECK_MSG(stx == RPC_OK, "valid push: %s '%s'", rpc_status_name(stx), detail);
  shard_state after;
  CHECK(status_of(0, &after) == 0);
  CHECK(after.version == st0[0].version + 1 && after.crc[0] != st0[0].crc[0] &&
        after.held[0] == st0[0].held[0] + 4);
  printf("control: a valid push of the same 4 rows applied (version %" PRIu64 " -> %" PRIu64
         ")\n", st0[0].version, after.version);

  big_push(c, P, params, grads, versions, v2);

  ps_client_leave(c);
  ps_client_destroy(c);
  for (int s = 0; s < S; s++) {
    rpc_channel_destroy(raw[s].ch);
    rpc_queue_destroy(raw[s].q);
  }
  free(cat), free(hsh), free(vc), free(vh), free(gc), free(gh), free(params), free(grads);
  free(want_c), free(want_h), free(g0);
  return check_summary();
}
