/* The table of workers (ps/state/membership.c): add, touch, push counts, remove,
 * time-outs, listing, and the ids it hands out. */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/util.h"
#include "ps/state/membership.h"

static void test_add_list(void) {
  ps_membership *m = ps_membership_create();
  CHECK(m != NULL);
  if (!m) return;
  uint64_t id[3];
  int rank[3];
  CHECK(ps_membership_add(m, 0, "gpu-a", "worker", 0, 1000, &id[0], &rank[0]) == PS_OK);
  CHECK(ps_membership_add(m, 0, "gpu-b", "worker", 1, 1001, &id[1], &rank[1]) == PS_OK);
  CHECK(ps_membership_add(m, 0, "cpu-c", "chief", 0, 1002, &id[2], &rank[2]) == PS_OK);
  CHECK(id[0] != 0 && id[1] != 0 && id[2] != 0);
  CHECK(id[0] != id[1] && id[1] != id[2] && id[0] != id[2]);
  CHECK(rank[0] == 0 && rank[1] == 1 && rank[2] == 2);
  CHECK(ps_membership_count(m) == 3);

  ps_member out[4];
  CHECK(ps_membership_list(m, out, 4) == 3);
  CHECK(out[0].id == id[0] && strcmp(out[0].host, "gpu-a") == 0 &&
        strcmp(out[0].role, "worker") == 0 && out[0].task_index == 0);
  CHECK(out[1].id == id[1] && out[1].task_index == 1 && out[1].last_seen_ms == 1001);
  CHECK(out[2].id == id[2] && strcmp(out[2].role, "chief") == 0 && out[2].rank == 2);
  CHECK(out[0].step == 0 && out[0].pushes == 0);
  /* max bounds the copy. */
  CHECK(ps_membership_list(m, out, 2) == 2);
  CHECK(ps_membership_list(m, out, 0) == 0);

  /* A host name longer than the field is cut, not overrun. */
  char longhost[200];
  memset(longhost, 'h', sizeof longhost - 1);
  longhost[sizeof longhost - 1] = '\0';
  uint64_t lid;
  CHECK(ps_membership_add(m, 0, longhost, "worker", 3, 1003, &lid, NULL) == PS_OK);
  CHECK(ps_membership_list(m, out, 4) == 4);
  CHECK(strlen(out[3].host) == sizeof out[3].host - 1);
  ps_membership_destroy(m);
}

static void test_given_id(void) {
  ps_membership *m = ps_membership_create();
  if (!m) return;
  uint64_t id = 0;
  int rank = -1;
  /* An id that shard 0 handed out, registering here. */
  CHECK(ps_membership_add(m, 0xabcdef, "gpu-a", "worker", 0, 10, &id, &rank) == PS_OK);
  CHECK(id == 0xabcdef && rank == 0);
  CHECK(ps_membership_add(m, 0, "gpu-b", "worker", 1, 11, &id, &rank) == PS_OK);
  CHECK(rank == 1);
  /* Registering the known id again refreshes it: same rank, no new entry. */
  CHECK(ps_membership_add(m, 0xabcdef, "gpu-a2", "worker", 5, 50, &id, &rank) == PS_OK);
  CHECK(id == 0xabcdef && rank == 0);
  CHECK(ps_membership_count(m) == 2);
  ps_member out[2];
  CHECK(ps_membership_list(m, out, 2) == 2);
  CHECK(strcmp(out[0].host, "gpu-a2") == 0 && out[0].task_index == 5 &&
        out[0].last_seen_ms == 50);
  ps_membership_destroy(m);
}

static void test_touch_push_remove(void) {
  ps_membership *m = ps_membership_create();
  if (!m) return;
  uint64_t a, b;
  CHECK(ps_membership_add(m, 0, "a", "worker", 0, 100, &a, NULL) == PS_OK);
  CHECK(ps_membership_add(m, 0, "b", "worker", 1, 100, &b, NULL) == PS_OK);

  CHECK(ps_membership_touch(m, a, 7, 200) == PS_OK);
  CHECK(ps_membership_touch(m, a, UINT64_MAX, 250) == PS_OK); /* keeps the step */
  CHECK(ps_membership_note_push(m, b, 3, 300) == PS_OK);
  CHECK(ps_membership_note_push(m, b, UINT64_MAX, 310) == PS_OK);
  ps_member out[2];
  CHECK(ps_membership_list(m, out, 2) == 2);
  CHECK(out[0].step == 7 && out[0].last_seen_ms == 250 && out[0].pushes == 0);
  CHECK(out[1].step == 3 && out[1].last_seen_ms == 310 && out[1].pushes == 2);

  /* Unknown ids: never registered, or gone. */
  uint64_t unknown = a ^ b ^ 1;
  if (unknown == a || unknown == b || unknown == 0) unknown = 12345;
  CHECK(ps_membership_touch(m, unknown, 1, 400) == PS_ENOTFOUND);
  CHECK(ps_membership_note_push(m, unknown, 1, 400) == PS_ENOTFOUND);
  CHECK(ps_membership_remove(m, unknown) == PS_ENOTFOUND);
  CHECK(ps_membership_remove(m, a) == PS_OK);
  CHECK(ps_membership_remove(m, a) == PS_ENOTFOUND);
  CHECK(ps_membership_touch(m, a, 1, 400) == PS_ENOTFOUND);
  CHECK(ps_membership_count(m) == 1);
  CHECK(ps_membership_list(m, out, 2) == 1 && out[0].id == b);
  /* Leaving is not a time-out. */
  CHECK(ps_membership_dropped_total(m) == 0);

  /* A worker coming back after leaving is a new member with a new rank. */
  int rank = -1;
  CHECK(ps_membership_add(m, a, "a", "worker", 0, 500, NULL, &rank) == PS_OK);
  CHECK(rank == 2);
  ps_membership_destroy(m);
}

static void test_sweep(void) {
  ps_membership *m = ps_membership_create();
  if (!m) return;
  uint64_t id[4];
  const int64_t seen[4] = {1000, 5000, 2000, 6000};
  for (int i = 0; i < 4; i++)
    CHECK(ps_membership_add(m, 0, "h", "worker", i, seen[i], &id[i], NULL) == PS_OK);

  /* At 7000 with a 4000 ms time-out: those seen at 1000 and 2000 (6000 and
   * 5000 ms ago) are stale; 5000 and 6000 are not. */
  uint64_t dropped[4] = {0, 0, 0, 0};
  CHECK(ps_membership_sweep(m, 7000, 4000, dropped, 4) == 2);
  CHECK(dropped[0] == id[0] && dropped[1] == id[2]);
  CHECK(ps_membership_count(m) == 2);
  CHECK(ps_membership_dropped_total(m) == 2);
  ps_member out[4];
  CHECK(ps_membership_list(m, out, 4) == 2);
  CHECK(out[0].id == id[1] && out[1].id == id[3]); /* order kept */
  CHECK(ps_membership_touch(m, id[0], 1, 7000) == PS_ENOTFOUND);

  /* 9000 - 5000 == 4000, exactly the time-out, is not "more than": kept;
   * a touch keeps id[3] alive. */
  CHECK(ps_membership_touch(m, id[3], 1, 8500) == PS_OK);
  CHECK(ps_membership_sweep(m, 9000, 4000, dropped, 4) == 0);
  /* More dropped than room: all are dropped and counted, max ids written. */
  uint64_t one[1] = {0};
  CHECK(ps_membership_sweep(m, 100000, 4000, one, 1) == 2);
  CHECK(one[0] == id[1]);
  CHECK(ps_membership_count(m) == 0);
  CHECK(ps_membership_dropped_total(m) == 4);
  CHECK(ps_membership_sweep(m, 200000, 4000, NULL, 0) == 0);
  ps_membership_destroy(m);
}

/* Ids are unique and non-zero across many registrations, and across two
 * tables of one process. */
static void test_ids_unique(void) {
  enum { N = 2000 };
  ps_membership *m1 = ps_membership_create(), *m2 = ps_membership_create();
  if (!m1 || !m2) goto done;
  static uint64_t ids[2 * N];
  int ok = 1;
  for (int i = 0; i < N; i++) {
    ok &= ps_membership_add(m1, 0, "x", "worker", i, 0, &ids[i], NULL) == PS_OK;
    ok &= ps_membership_add(m2, 0, "y", "worker", i, 0, &ids[N + i], NULL) == PS_OK;
  }
  CHECK(ok);
  int zero = 0, dup = 0;
  for (int i = 0; i < 2 * N; i++) {
    zero += ids[i] == 0;
    for (int j = 0; j < i; j++) dup += ids[i] == ids[j];
  }
  CHECK(zero == 0);
  CHECK(dup == 0);
  /* Neighbouring registrations give unrelated ids (not a plain counter):
   * about half the bits differ. */
  int bits = __builtin_popcountll(ids[0] ^ ids[1]);
  CHECK(bits > 8 && bits < 56);
  CHECK(ps_membership_count(m1) == N);
done:
  ps_membership_destroy(m1);
  ps_membership_destroy(m2);
}

/* Clocks: pushes count, a newcomer starts at the slowest live clock. */
static void test_clocks(void) {
  ps_membership *m = ps_membership_create();
  uint64_t a = 0, b = 0, c = 0, clock = 0, lo = 0;
  CHECK(ps_membership_add(m, 0, "a", "worker", 0, 0, &a, NULL) == 0);
  CHECK(ps_membership_add(m, 0, "b", "worker", 1, 0, &b, NULL) == 0);
  for (int i = 0; i < 5; i++) CHECK(ps_membership_note_push(m, a, (uint64_t)i, 1) == 0);
  for (int i = 0; i < 2; i++) CHECK(ps_membership_note_push(m, b, (uint64_t)i, 1) == 0);
  CHECK(ps_membership_clock(m, a, &clock, &lo) == 0 && clock == 5 && lo == 2);
  CHECK(ps_membership_add(m, 0, "c", "worker", 2, 0, &c, NULL) == 0);
  CHECK(ps_membership_clock(m, c, &clock, &lo) == 0 && clock == 2 && lo == 2);
  CHECK(ps_membership_remove(m, b) == 0);
  CHECK(ps_membership_clock(m, a, &clock, &lo) == 0 && lo == 2); /* c is slowest now */
  CHECK(ps_membership_clock(m, b, &clock, &lo) == PS_ENOTFOUND);
  /* an evaluator pushes nothing: it is not counted, and holds nobody back */
  uint64_t e = 0;
  int before = ps_membership_count(m);
  CHECK(ps_membership_add(m, 0, "e", "evaluator", 0, 0, &e, NULL) == 0);
  CHECK(ps_membership_count(m) == before);
  for (int i = 0; i < 3; i++) CHECK(ps_membership_note_push(m, c, (uint64_t)i, 1) == 0);
  CHECK(ps_membership_clock(m, c, &clock, &lo) == 0 && clock == 5 && lo == 5);
  CHECK(ps_membership_clock(m, e, &clock, &lo) == 0 && lo <= clock);
  ps_membership_destroy(m);
}

/* Host and role come from the worker and go out in Status replies (a
 * proto3 string: valid UTF-8 or the reply does not parse) and in logs. A
 * host of 70 bytes of multi-byte characters is cut on a character
 * boundary; invalid bytes and control characters are replaced (U+FFFD);
 * registering again stores the new names the same way. */
static void test_host_role_sanitized(void) {
  ps_membership *m = ps_membership_create();
  if (!m) return;
  char host[80] = "a";
  for (int i = 0; i < 23; i++) strcat(host, "\xe2\x82\xac"); /* 70 bytes */
  uint64_t id[3];
  CHECK(ps_membership_add(m, 0, host, "worker\xff", 0, 1, &id[0], NULL) == PS_OK);
  CHECK(ps_membership_add(m, 0, "evil\n12:00:00.000 ps-server info: forged\x1b[31m",
                          "w\r\x1b[2J\xc2\x9b", 1, 1, &id[1], NULL) == PS_OK);
  CHECK(ps_membership_add(m, 0, "h\xc0\xafst", "chief", 2, 1, &id[2], NULL) == PS_OK);
  ps_member out[3];
  CHECK(ps_membership_list(m, out, 3) == 3);
  for (int i = 0; i < 3; i++) {
    size_t hl = strlen(out[i].host), rl = strlen(out[i].role);
    CHECK(ps_utf8_valid_len(out[i].host, hl) == hl && ps_utf8_valid_len(out[i].role, rl) == rl);
    for (size_t k = 0; k < hl; k++)
      CHECK((unsigned char)out[i].host[k] >= 0x20 && out[i].host[k] != 0x7f);
    for (size_t k = 0; k < rl; k++)
      CHECK((unsigned char)out[i].role[k] >= 0x20 && out[i].role[k] != 0x7f);
  }
  CHECK(strlen(out[0].host) == 61 && memcmp(out[0].host, host, 61) == 0);
  CHECK(strcmp(out[0].role, "worker\xef\xbf\xbd") == 0);
  CHECK_MSG(strcmp(out[1].host,
                   "evil\xef\xbf\xbd"
                   "12:00:00.000 ps-server info: forged\xef\xbf\xbd[31m") == 0,
            "%s", out[1].host);
  CHECK(strcmp(out[1].role, "w\xef\xbf\xbd\xef\xbf\xbd[2J\xef\xbf\xbd") == 0);
  CHECK(strcmp(out[2].host, "h\xef\xbf\xbd\xef\xbf\xbdst") == 0);
  /* Registering again: the new names, sanitized too. */
  CHECK(ps_membership_add(m, id[2], "new\x7fhost", "chief", 2, 2, NULL, NULL) == PS_OK);
  CHECK(ps_membership_list(m, out, 3) == 3 && strcmp(out[2].host, "new\xef\xbf\xbdhost") == 0);
  ps_membership_destroy(m);
}

/* Request ids: a retry of an applied request gets its first answer; one
 * still being applied is said to be; a refused one may be tried again;
 * kinds and workers keep their ids apart; the window is bounded. */
static void test_request_window(void) {
  ps_membership *m = ps_membership_create();
  uint64_t a = 0, b = 0;
  CHECK(ps_membership_add(m, 0, "a", "worker", 0, 0, &a, NULL) == PS_OK);
  CHECK(ps_membership_add(m, 0, "b", "worker", 1, 0, &b, NULL) == PS_OK);
  uint8_t reply[PS_REPLY_MAX];
  size_t len = 0;
  CHECK(ps_membership_request_begin(m, a, 0, 7, reply, sizeof reply, &len) == PS_OK);
  CHECK(ps_membership_request_begin(m, a, 0, 7, reply, sizeof reply, &len) == PS_REQUEST_PENDING);
  CHECK(ps_membership_request_begin(m, a, 1, 7, reply, sizeof reply, &len) == PS_OK); /* kind */
  CHECK(ps_membership_request_begin(m, b, 0, 7, reply, sizeof reply, &len) == PS_OK); /* worker */
  ps_membership_request_end(m, a, 0, 7, "first", 5);
  len = 0;
  CHECK(ps_membership_request_begin(m, a, 0, 7, reply, sizeof reply, &len) == PS_REQUEST_ANSWERED);
  CHECK(len == 5 && memcmp(reply, "first", 5) == 0);
  ps_membership_request_end(m, a, 1, 7, NULL, 0); /* refused: forgotten */
  CHECK(ps_membership_request_begin(m, a, 1, 7, reply, sizeof reply, &len) == PS_OK);
  CHECK(ps_membership_request_begin(m, 12345, 0, 1, reply, sizeof reply, &len) == PS_ENOTFOUND);
  /* The window keeps the most recent PS_RECENT_REQUESTS ids of a worker. */
  for (uint64_t id = 100; id <= 100 + PS_RECENT_REQUESTS; id++) {
    CHECK(ps_membership_request_begin(m, b, 2, id, reply, sizeof reply, &len) == PS_OK);
    ps_membership_request_end(m, b, 2, id, "x", 1);
  }
  CHECK(ps_membership_request_begin(m, b, 2, 100 + PS_RECENT_REQUESTS, reply, sizeof reply,
                                    &len) == PS_REQUEST_ANSWERED);
  CHECK(ps_membership_request_begin(m, b, 2, 100, reply, sizeof reply, &len) == PS_OK);
  /* A worker that leaves takes its window with it (no leak: ASan). */
  CHECK(ps_membership_remove(m, a) == PS_OK);
  ps_membership_destroy(m);
}

/* An idle worker is not counted and holds no clock back; back, it starts
 * at the slowest active clock. */
static void test_idle(void) {
  ps_membership *m = ps_membership_create();
  uint64_t a = 0, b = 0, clock = 0, lo = 0;
  CHECK(ps_membership_add(m, 0, "a", "worker", 0, 0, &a, NULL) == PS_OK);
  CHECK(ps_membership_add(m, 0, "b", "worker", 1, 0, &b, NULL) == PS_OK);
  for (int i = 0; i < 5; i++) CHECK(ps_membership_note_push(m, a, (uint64_t)i, 0) == PS_OK);
  CHECK(ps_membership_count(m) == 2);
  CHECK(ps_membership_clock(m, a, &clock, &lo) == PS_OK && clock == 5 && lo == 0);
  CHECK(ps_membership_set_idle(m, b, 1) == 1);
  CHECK(ps_membership_set_idle(m, b, 1) == 0); /* no change */
  CHECK(ps_membership_count(m) == 1);
  int idle = -1;
  CHECK(ps_membership_count_both(m, &idle) == 1 && idle == 1); /* a trains, b waits */
  CHECK(ps_membership_clock(m, a, &clock, &lo) == PS_OK && lo == 5); /* b holds nothing back */
  CHECK(ps_membership_note_push(m, b, 9, 0) == PS_OK); /* back by pushing */
  CHECK(ps_membership_count(m) == 2);
  CHECK(ps_membership_count_both(m, &idle) == 2 && idle == 0);
  CHECK(ps_membership_clock(m, b, &clock, &lo) == PS_OK && clock == 6 && lo == 5);
  CHECK(ps_membership_set_idle(m, 99, 1) == PS_ENOTFOUND);
  ps_membership_destroy(m);
}

/* Push rounds: noted rounds never go back; rounds seeded from a checkpoint
 * go to a worker of that id when it registers (again), not to others. */
static void test_rounds_seeded(void) {
  ps_membership *m = ps_membership_create();
  uint64_t r = 99, got_id = 0;
  CHECK(ps_membership_round(m, 42, &r) == PS_ENOTFOUND && r == 99);
  const uint64_t ids[2] = {42, 43}, rounds[2] = {7, 9};
  CHECK(ps_membership_seed_rounds(m, ids, rounds, 2) == PS_OK);
  CHECK(ps_membership_add(m, 42, "h", "worker", 0, 0, &got_id, NULL) == PS_OK && got_id == 42);
  CHECK(ps_membership_round(m, 42, &r) == PS_OK && r == 7);
  CHECK(ps_membership_add(m, 0, "h", "worker", 1, 0, &got_id, NULL) == PS_OK);
  CHECK(ps_membership_round(m, got_id, &r) == PS_OK && r == 0);
  CHECK(ps_membership_note_round(m, 42, 5) == PS_OK);
  CHECK(ps_membership_round(m, 42, &r) == PS_OK && r == 7); /* never back */
  CHECK(ps_membership_note_round(m, 42, 8) == PS_OK);
  CHECK(ps_membership_round(m, 42, &r) == PS_OK && r == 8);
  CHECK(ps_membership_note_round(m, 77, 1) == PS_ENOTFOUND);
  CHECK(ps_membership_seed_rounds(m, NULL, NULL, 0) == PS_OK); /* cleared */
  ps_membership_destroy(m);
}

/* Replicated shards: a staged answer stays pending until settled; an
 * export carries it as answered; an import rebuilds the table (ids,
 * secrets, rounds, answers, ranks); install registers with a given secret. */
static void test_replication_table(void) {
  ps_membership *m = ps_membership_create();
  uint64_t a = 0, b = 0;
  uint8_t sa[PS_SESSION_LEN];
  int rank = -1;
  CHECK(ps_membership_join(m, 0, "ha", "worker", 0, 0, NULL, &a, &rank, sa) == PS_OK && rank == 0);
  CHECK(ps_membership_add(m, 0, "hb", "worker", 1, 0, &b, NULL) == PS_OK);
  uint8_t reply[PS_REPLY_MAX];
  size_t len = 0;
  const uint8_t answer[3] = {1, 2, 3};
  CHECK(ps_membership_request_begin(m, a, 4, 10, reply, sizeof reply, &len) == PS_OK);
  ps_membership_request_stage(m, a, 4, 10, answer, sizeof answer);
  CHECK(ps_membership_request_begin(m, a, 4, 10, reply, sizeof reply, &len) == PS_REQUEST_PENDING);
  CHECK(ps_membership_note_round(m, a, 10) == PS_OK);
  CHECK(ps_membership_note_push(m, a, 5, 0) == PS_OK);
  /* Another request pending (not staged): not exported. */
  CHECK(ps_membership_request_begin(m, b, 4, 3, reply, sizeof reply, &len) == PS_OK);

  ps_member_state *st = NULL;
  int n = 0, next_rank = 0;
  CHECK(ps_membership_export(m, &st, &n, &next_rank) == PS_OK && n == 2 && next_rank == 2);
  CHECK(st[0].member.id == a && st[0].n_recent == 1 && st[0].recent[0].id == 10 &&
        st[0].recent[0].len == 3 && st[0].member.round == 10 && st[0].member.pushes == 1);
  CHECK(st[1].member.id == b && st[1].n_recent == 0);

  ps_membership *copy = ps_membership_create();
  uint64_t other = 0;
  CHECK(ps_membership_add(copy, 0, "x", "worker", 0, 0, &other, NULL) == PS_OK);
  CHECK(ps_membership_import(copy, st, n, next_rank) == PS_OK);
  free(st);
  int reader = 1;
  CHECK(ps_membership_authorize(copy, a, sa, PS_SESSION_LEN, &reader) == PS_OK && reader == 0);
  CHECK(ps_membership_authorize(copy, other, sa, PS_SESSION_LEN, NULL) == PS_ENOTFOUND);
  CHECK(ps_membership_request_begin(copy, a, 4, 10, reply, sizeof reply, &len) ==
            PS_REQUEST_ANSWERED &&
        len == 3 && memcmp(reply, answer, 3) == 0);
  uint64_t r = 0;
  CHECK(ps_membership_round(copy, a, &r) == PS_OK && r == 10);
  /* A newcomer on the copy gets the next rank, as on the original. */
  uint64_t c1 = 0, c2 = 0;
  int r1 = -1, r2 = -2;
  CHECK(ps_membership_join(m, 0, "hc", "worker", 2, 0, NULL, &c1, &r1, NULL) == PS_OK);
  uint8_t sc[PS_SESSION_LEN] = {9, 9, 9};
  CHECK(ps_membership_install(copy, c1, "hc", "worker", 2, 0, sc, 0, &r2) == PS_OK);
  CHECK(r1 == 2 && r2 == 2);
  CHECK(ps_membership_authorize(copy, c1, sc, PS_SESSION_LEN, NULL) == PS_OK);
  (void)c2;

  /* Settled: the staged answer is the answer; the pending one is gone. */
  ps_membership_request_settle(m);
  CHECK(ps_membership_request_begin(m, a, 4, 10, reply, sizeof reply, &len) ==
        PS_REQUEST_ANSWERED);
  CHECK(ps_membership_request_begin(m, b, 4, 3, reply, sizeof reply, &len) == PS_OK);
  ps_membership_destroy(copy);
  ps_membership_destroy(m);
}

int main(void) {
  RUN(test_replication_table);
  RUN(test_idle);
  RUN(test_request_window);
  RUN(test_clocks);
  RUN(test_host_role_sanitized);
  RUN(test_add_list);
  RUN(test_given_id);
  RUN(test_touch_push_remove);
  RUN(test_sweep);
  RUN(test_ids_unique);
  RUN(test_rounds_seeded);
  return check_summary();
}
