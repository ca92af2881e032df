/* wire_encode / wire_decode: round trips over awkwardly split segments,
 * equality with protobuf-c's own encoding, fields in any order, and
 * malformed input that must be refused with a message (run under ASan:
 * every segment is its own allocation, so an overread is caught). */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/wire.h"
#include "proto/ps.pb-c.h"

static int releases;
static void count_release(void *user) { (*(int *)user)++; }

/* ---- helpers ---- */

typedef struct {
  uint8_t *bytes;
  size_t len;
} blob;

static blob msg_bytes(const rpc_msg *m) {
  blob b = {0};
  for (int i = 0; i < m->nseg; i++)
    b.len += m->seg[i].len;
  b.bytes = malloc(b.len ? b.len : 1);
  size_t off = 0;
  for (int i = 0; i < m->nseg; i++) {
    memcpy(b.bytes + off, m->seg[i].ptr, m->seg[i].len);
    off += m->seg[i].len;
  }
  return b;
}

/* Bytes re-split at the given cut points (ascending, duplicates and
 * out-of-range cuts ignored), each piece in its own allocation. */
typedef struct {
  ps_seg *segs;
  uint8_t **owned;
  ps_segview view;
} split;

static split *split_at(const uint8_t *bytes, size_t len, const size_t *cuts, int ncuts) {
  split *s = calloc(1, sizeof(*s));
  s->segs = calloc((size_t)ncuts + 1, sizeof(ps_seg));
  s->owned = calloc((size_t)ncuts + 1, sizeof(uint8_t *));
  size_t start = 0;
  int n = 0;
  for (int i = 0; i <= ncuts; i++) {
    size_t end = i < ncuts ? cuts[i] : len;
    if (end > len || end < start || (i < ncuts && end == start))
      continue;
    size_t k = end - start;
    s->owned[n] = malloc(k ? k : 1);
    memcpy(s->owned[n], bytes + start, k);
    s->segs[n] = (ps_seg){.ptr = s->owned[n], .len = k};
    n++;
    start = end;
  }
  s->view = (ps_segview){.segs = s->segs, .nsegs = n, .total = len};
  return s;
}

static split *split_every(const uint8_t *bytes, size_t len, size_t step) {
  size_t *cuts = malloc((len / step + 1) * sizeof(size_t));
  int n = 0;
  for (size_t p = step; p < len; p += step)
    cuts[n++] = p;
  split *s = split_at(bytes, len, cuts, n);
  free(cuts);
  return s;
}

static void split_free(split *s) {
  for (int i = 0; i < s->view.nsegs; i++)
    free(s->owned[i]);
  free(s->segs);
  free(s->owned);
  free(s);
}

static int view_equals(const ps_segview *v, const uint8_t *want, size_t len) {
  if (v->total != len)
    return 0;
  size_t off = 0;
  for (int i = 0; i < v->nsegs; i++) {
    if (off + v->segs[i].len > len || memcmp(v->segs[i].ptr, want + off, v->segs[i].len) != 0)
      return 0;
    off += v->segs[i].len;
  }
  return off == len;
}

/* Every tensor segment points into one of the split's buffers. */
static int view_inside(const ps_segview *v, const split *s) {
  for (int i = 0; i < v->nsegs; i++) {
    int found = 0;
    for (int k = 0; k < s->view.nsegs && !found; k++)
      found = v->segs[i].ptr >= s->segs[k].ptr &&
              v->segs[i].ptr + v->segs[i].len <= s->segs[k].ptr + s->segs[k].len;
    if (!found)
      return 0;
  }
  return 1;
}

static float *make_floats(size_t n, float seed) {
  float *f = malloc((n ? n : 1) * sizeof(float));
  for (size_t i = 0; i < n; i++)
    f[i] = seed + (float)i * 0.25f - (float)(i % 7);
  return f;
}

/* ---- push requests of several tensor sizes ---- */

static void check_push(const Ps__PushRequest *got, size_t n) {
  CHECK(got->header != NULL);
  if (got->header != NULL) {
    CHECK(got->header->protocol_version == PS_PROTOCOL_VERSION);
    CHECK(strcmp(got->header->job_id, "job-é-1") == 0);
    CHECK(got->header->worker_id == 0x1234567890ull);
  }
  CHECK(got->base_version == 77);
  CHECK(got->offset == 1000001);
  CHECK(got->count == n);
  CHECK(got->step == 5);
  CHECK(got->batch_size == 64);
  CHECK(got->data.len == 0); /* the tensor is left out of the header */
}

static void test_push_roundtrip_sizes(void) {
  const size_t sizes[] = {0, 1, 3, 1023, (1u << 20) + 7};
  for (size_t si = 0; si < sizeof(sizes) / sizeof(sizes[0]); si++) {
    size_t n = sizes[si], tbytes = n * sizeof(float);
    float *t = make_floats(n, (float)si);
    Ps__RequestHeader rh = PS__REQUEST_HEADER__INIT;
    rh.protocol_version = PS_PROTOCOL_VERSION;
    rh.job_id = "job-é-1";
    rh.worker_id = 0x1234567890ull;
    Ps__PushRequest pr = PS__PUSH_REQUEST__INIT;
    pr.header = &rh;
    pr.base_version = 77;
    pr.offset = 1000001;
    pr.count = n;
    pr.step = 5;
    pr.batch_size = 64;

    releases = 0;
    rpc_msg m;
    CHECK(wire_encode(&pr.base, t, tbytes, count_release, &releases, &m) == PS_OK);
    CHECK(m.nseg == (n ? 2 : 1));
    CHECK(releases == (n ? 0 : 1)); /* an empty tensor is not sent: released at once */
    if (n)
      CHECK(m.seg[1].ptr == (const void *)t && m.seg[1].release == count_release); /* no copy */
    blob b = msg_bytes(&m);

    /* Same bytes as protobuf-c's pack of the whole message. */
    pr.data.data = (uint8_t *)t;
    pr.data.len = tbytes;
    size_t plen = ps__push_request__get_packed_size(&pr);
    uint8_t *packed = malloc(plen);
    ps__push_request__pack(&pr, packed);
    CHECK_MSG(plen == b.len && memcmp(packed, b.bytes, plen) == 0, "n=%zu: %zu vs %zu bytes", n,
              plen, b.len);
    free(packed);
    pr.data.len = 0;
    pr.data.data = NULL;

    /* The copying variant gives the same bytes in one segment. */
    rpc_msg mc;
    CHECK(wire_encode(&pr.base, t, tbytes, NULL, NULL, &mc) == PS_OK);
    CHECK(mc.nseg == 1);
    blob bc = msg_bytes(&mc);
    CHECK(bc.len == b.len && memcmp(bc.bytes, b.bytes, b.len) == 0);
    rpc_msg_release(&mc);
    free(bc.bytes);

    /* Awkward splits: before/after the tensor tag, inside its length
     * varint, inside a float, and the header itself in pieces. */
    size_t hdr = ps__push_request__get_packed_size(&pr);
    size_t tag = hdr, len0 = hdr + 1, data0 = b.len - tbytes;
    size_t cut_sets[][6] = {
        {0},
        {tag, data0},
        {len0 + 1, data0 + 2},
        {3, tag + 1, data0 + 6, data0 + 4097, b.len - 3},
        {1, 2, len0 + 2, data0 + 1, data0 + tbytes / 2 + 1},
    };
    for (size_t ci = 0; ci < sizeof(cut_sets) / sizeof(cut_sets[0]); ci++) {
      size_t cuts[6];
      int nc = 0;
      for (int k = 0; k < 6; k++)
        if (cut_sets[ci][k] > 0 && cut_sets[ci][k] < b.len &&
            (nc == 0 || cut_sets[ci][k] > cuts[nc - 1]))
          cuts[nc++] = cut_sets[ci][k];
      split *s = split_at(b.bytes, b.len, cuts, nc);
      ps_seg tsegs[8];
      ps_segview tv;
      char err[PS_ERRLEN] = "";
      ProtobufCMessage *got =
          wire_decode(&ps__push_request__descriptor, &s->view, tsegs, 8, &tv, err);
      CHECK_MSG(got != NULL, "n=%zu cuts %zu: %s", n, ci, err);
      if (got != NULL) {
        check_push((const Ps__PushRequest *)got, n);
        CHECK_MSG(view_equals(&tv, (const uint8_t *)t, tbytes), "n=%zu cuts %zu", n, ci);
        CHECK(view_inside(&tv, s));
        protobuf_c_message_free_unpacked(got, NULL);
      }
      split_free(s);
    }

    /* Small messages: every byte its own segment. */
    if (b.len < 4096) {
      split *s = split_every(b.bytes, b.len, 1);
      ps_seg *tsegs = malloc(sizeof(ps_seg) * (size_t)s->view.nsegs + 1);
      ps_segview tv;
      char err[PS_ERRLEN] = "";
      ProtobufCMessage *got =
          wire_decode(&ps__push_request__descriptor, &s->view, tsegs, s->view.nsegs, &tv, err);
      CHECK_MSG(got != NULL, "n=%zu bytewise: %s", n, err);
      if (got != NULL) {
        check_push((const Ps__PushRequest *)got, n);
        CHECK(view_equals(&tv, (const uint8_t *)t, tbytes));
        CHECK(tv.nsegs == (int)tbytes);
        protobuf_c_message_free_unpacked(got, NULL);
      }
      /* Too little room for the tensor's pieces is an error, not an overrun. */
      if (tbytes > 1) {
        err[0] = 0;
        got = wire_decode(&ps__push_request__descriptor, &s->view, tsegs, 1, &tv, err);
        CHECK(got == NULL && strstr(err, "segments") != NULL);
      }
      free(tsegs);
      split_free(s);
    }

    rpc_msg_release(&m);
    CHECK(releases == 1);
    free(b.bytes);
    free(t);
  }
}

static void test_pull_response_roundtrip(void) {
  size_t n = 1023;
  float *t = make_floats(n, 3.5f);
  Ps__PullResponse pr = PS__PULL_RESPONSE__INIT;
  pr.version = 12345678901ull;
  pr.offset = 3;
  pr.count = n;
  rpc_msg m;
  releases = 0;
  CHECK(wire_encode(&pr.base, t, n * 4, count_release, &releases, &m) == PS_OK);
  blob b = msg_bytes(&m);
  pr.data = (ProtobufCBinaryData){.len = n * 4, .data = (uint8_t *)t};
  uint8_t packed[8192];
  size_t plen = ps__pull_response__pack(&pr, packed);
  CHECK(plen == b.len && memcmp(packed, b.bytes, plen) == 0);
  for (size_t step = 1; step <= 13; step += 4) {
    split *s = split_every(b.bytes, b.len, step);
    ps_seg *tsegs = malloc(sizeof(ps_seg) * (size_t)s->view.nsegs);
    ps_segview tv;
    char err[PS_ERRLEN];
    Ps__PullResponse *got = (Ps__PullResponse *)wire_decode(
        &ps__pull_response__descriptor, &s->view, tsegs, s->view.nsegs, &tv, err);
    CHECK(got != NULL);
    if (got != NULL) {
      CHECK(got->version == 12345678901ull && got->offset == 3 && got->count == n);
      CHECK(view_equals(&tv, (const uint8_t *)t, n * 4));
      protobuf_c_message_free_unpacked(&got->base, NULL);
    }
    free(tsegs);
    split_free(s);
  }
  rpc_msg_release(&m);
  CHECK(releases == 1);
  free(b.bytes);
  free(t);
}

/* ---- hand-encoded messages ---- */

static size_t put_varint(uint8_t *p, uint64_t v) {
  size_t n = 0;
  do {
    p[n] = (uint8_t)(v & 0x7f);
    v >>= 7;
    if (v)
      p[n] |= 0x80;
    n++;
  } while (v);
  return n;
}

static size_t put_tag(uint8_t *p, uint32_t field, int wt) {
  return put_varint(p, ((uint64_t)field << 3) | (uint64_t)wt);
}

static void test_fields_in_any_order(void) {
  uint8_t buf[256];
  size_t n = 0;
  const uint8_t t1[] = {1, 2, 3, 4, 5, 6, 7, 8};
  const uint8_t t2[] = {9, 10, 11, 12};
  /* tensor first */
  n += put_tag(buf + n, 15, 2);
  n += put_varint(buf + n, sizeof(t1));
  memcpy(buf + n, t1, sizeof(t1));
  n += sizeof(t1);
  /* then the header fields, in reverse order, plus an unknown field 2000
   * (a two-byte tag) that protobuf-c must keep out of the known ones */
  n += put_tag(buf + n, 3, 0);
  n += put_varint(buf + n, 999);
  size_t unknown_at = n;
  n += put_tag(buf + n, 2000, 0);
  n += put_varint(buf + n, 5);
  n += put_tag(buf + n, 2, 0);
  n += put_varint(buf + n, 4);
  n += put_tag(buf + n, 1, 0);
  n += put_varint(buf + n, 17);
  /* a second tensor: the last one wins */
  size_t second = n;
  n += put_tag(buf + n, 15, 2);
  n += put_varint(buf + n, sizeof(t2));
  memcpy(buf + n, t2, sizeof(t2));
  n += sizeof(t2);
  /* and a header field after it */
  n += put_tag(buf + n, 3, 0);
  n += put_varint(buf + n, 1000);

  size_t cuts_a[] = {unknown_at + 1, second + 3};
  size_t cuts_b[] = {1, 5, 9};
  for (int pass = 0; pass < 3; pass++) {
    split *s = pass == 0   ? split_at(buf, n, NULL, 0)
               : pass == 1 ? split_at(buf, n, cuts_a, 2)
                           : split_at(buf, n, cuts_b, 3);
    ps_seg tsegs[8];
    ps_segview tv;
    char err[PS_ERRLEN];
    Ps__PullResponse *got = (Ps__PullResponse *)wire_decode(&ps__pull_response__descriptor,
                                                            &s->view, tsegs, 8, &tv, err);
    CHECK_MSG(got != NULL, "pass %d: %s", pass, err);
    if (got != NULL) {
      CHECK(got->version == 17 && got->offset == 4 && got->count == 1000);
      CHECK(view_equals(&tv, t2, sizeof(t2)));
      CHECK(view_inside(&tv, s));
      protobuf_c_message_free_unpacked(&got->base, NULL);
    }
    split_free(s);
  }
}

/* Message types without a tensor decode normally; StatusResponse numbers
 * a string `mode` 15, which must stay a header field, not a tensor. */
static void test_messages_without_tensor(void) {
  Ps__PushResponse pr = PS__PUSH_RESPONSE__INIT;
  pr.version = 9;
  pr.staleness = 2;
  rpc_msg m;
  CHECK(wire_encode(&pr.base, NULL, 0, NULL, NULL, &m) == PS_OK);
  CHECK(m.nseg == 1);
  blob b = msg_bytes(&m);
  ps_segview v = {.segs = &(ps_seg){.ptr = b.bytes, .len = b.len}, .nsegs = 1, .total = b.len};
  ps_segview tv;
  char err[PS_ERRLEN];
  Ps__PushResponse *got =
      (Ps__PushResponse *)wire_decode(&ps__push_response__descriptor, &v, NULL, 0, &tv, err);
  CHECK(got != NULL && got->version == 9 && got->staleness == 2 && tv.total == 0 && tv.nsegs == 0);
  if (got)
    protobuf_c_message_free_unpacked(&got->base, NULL);
  rpc_msg_release(&m);
  free(b.bytes);

  Ps__StatusResponse st = PS__STATUS_RESPONSE__INIT;
  st.mode = "ssp:3";
  st.job_id = "j";
  st.version = 4;
  CHECK(wire_encode(&st.base, NULL, 0, NULL, NULL, &m) == PS_OK);
  b = msg_bytes(&m);
  v = (ps_segview){.segs = &(ps_seg){.ptr = b.bytes, .len = b.len}, .nsegs = 1, .total = b.len};
  Ps__StatusResponse *sg =
      (Ps__StatusResponse *)wire_decode(&ps__status_response__descriptor, &v, NULL, 0, &tv, err);
  CHECK(sg != NULL);
  if (sg) {
    CHECK(strcmp(sg->mode, "ssp:3") == 0 && strcmp(sg->job_id, "j") == 0 && sg->version == 4);
    CHECK(tv.total == 0);
    protobuf_c_message_free_unpacked(&sg->base, NULL);
  }
  rpc_msg_release(&m);
  free(b.bytes);

  /* A header that already carries the tensor is refused. */
  float x = 1;
  rpc_msg m2;
  Ps__PullResponse pl = PS__PULL_RESPONSE__INIT;
  pl.data = (ProtobufCBinaryData){.len = 4, .data = (uint8_t *)&x};
  CHECK(wire_encode(&pl.base, &x, 4, NULL, NULL, &m2) == PS_EINVAL);
  CHECK(wire_encode(&pl.base, NULL, 4, NULL, NULL, &m2) == PS_EINVAL);
}

/* ---- malformed input ---- */

static void expect_refused(const char *what, const uint8_t *bytes, size_t len, const char *needle) {
  /* whole, and split after every byte */
  for (int pass = 0; pass < 2; pass++) {
    split *s = pass == 0 ? split_at(bytes, len, NULL, 0) : split_every(bytes, len, 1);
    ps_seg tsegs[64];
    ps_segview tv;
    char err[PS_ERRLEN] = "";
    ProtobufCMessage *got =
        wire_decode(&ps__push_request__descriptor, &s->view, tsegs, 64, &tv, err);
    CHECK_MSG(got == NULL, "%s was accepted", what);
    CHECK_MSG(err[0] != '\0' && (needle == NULL || strstr(err, needle) != NULL),
              "%s: message '%s', wanted '%s'", what, err, needle ? needle : "");
    if (got)
      protobuf_c_message_free_unpacked(got, NULL);
    split_free(s);
  }
}

static void test_malformed(void) {
  const uint8_t trunc_varint[] = {0x10, 0x80, 0x80};
  expect_refused("truncated varint", trunc_varint, sizeof(trunc_varint), "truncated varint");
  const uint8_t trunc_tag[] = {0x80};
  expect_refused("truncated tag", trunc_tag, sizeof(trunc_tag), "truncated varint");
  const uint8_t long_varint[] = {0x10, 0xff, 0xff, 0xff, 0xff, 0xff,
                                 0xff, 0xff, 0xff, 0xff, 0xff, 0x01};
  expect_refused("11-byte varint", long_varint, sizeof(long_varint), "varint");
  const uint8_t beyond[] = {0x10, 0x01, 0x7a, 0x05, 0x01, 0x02};
  expect_refused("length beyond end", beyond, sizeof(beyond), "only 2 bytes follow");
  const uint8_t huge_len[] = {0x7a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f};
  expect_refused("huge length", huge_len, sizeof(huge_len), "length");
  for (int wt = 3; wt <= 7; wt++) {
    if (wt == 5)
      continue;
    uint8_t bad[] = {0x10, 0x01, (uint8_t)((2 << 3) | wt), 0x00, 0x00};
    char what[32];
    snprintf(what, sizeof(what), "wire type %d", wt);
    expect_refused(what, bad, sizeof(bad), "wire type");
  }
  const uint8_t field0[] = {0x02, 0x00};
  expect_refused("field number 0", field0, sizeof(field0), "field number");
  const uint8_t trunc64[] = {0x11, 1, 2, 3};
  expect_refused("truncated fixed64", trunc64, sizeof(trunc64), "truncated");
  const uint8_t trunc32[] = {0x15, 1, 2};
  expect_refused("truncated fixed32", trunc32, sizeof(trunc32), "truncated");
  const uint8_t tensor_varint[] = {0x78, 0x01};
  expect_refused("tensor as varint", tensor_varint, sizeof(tensor_varint), "tensor");
  /* Well-formed at the top level: a nested header whose own bytes are a
   * truncated varint, refused by the walk that checks nested strings. */
  const uint8_t bad_nested[] = {0x0a, 0x02, 0x08, 0x80, 0x7a, 0x01, 0x00};
  expect_refused("bad nested header", bad_nested, sizeof(bad_nested),
                 "in PushRequest.header, truncated varint at byte 1");
  /* and a known field with the wrong wire type */
  const uint8_t wrong_type[] = {0x12, 0x01, 0x00};
  expect_refused("varint field as bytes", wrong_type, sizeof(wrong_type), "protobuf-c");
}

/* ---- strings: valid UTF-8, no NUL ---- */

/* m packed by protobuf-c with the first occurrence of `mark` replaced by
 * `with` (as many bytes: the framing stays valid); protobuf-c itself cannot
 * write a NUL into a string. The caller frees .bytes. */
static blob packed_with(const ProtobufCMessage *m, const char *mark, const char *with) {
  blob b = {.len = protobuf_c_message_get_packed_size(m)};
  b.bytes = malloc(b.len);
  protobuf_c_message_pack(m, b.bytes);
  size_t k = strlen(mark);
  for (size_t i = 0; i + k <= b.len; i++) {
    if (memcmp(b.bytes + i, mark, k) == 0) {
      memcpy(b.bytes + i, with, k);
      break;
    }
  }
  return b;
}

/* Decodes b as desc, whole and split after every byte; returns 1 if every
 * try was accepted, 0 if every one was refused with needle in the message. */
static int decode_strings(const ProtobufCMessageDescriptor *desc, blob b, const char *needle) {
  int accepted = 0, refused = 0;
  for (int pass = 0; pass < 2; pass++) {
    split *s = pass == 0 ? split_at(b.bytes, b.len, NULL, 0) : split_every(b.bytes, b.len, 1);
    ps_seg tsegs[256];
    ps_segview tv;
    char err[PS_ERRLEN] = "";
    ProtobufCMessage *got = wire_decode(desc, &s->view, tsegs, 256, &tv, err);
    if (got) {
      accepted++;
      protobuf_c_message_free_unpacked(got, NULL);
    } else {
      refused += needle != NULL && strstr(err, needle) != NULL;
      CHECK_MSG(needle != NULL && strstr(err, needle) != NULL, "message '%s', wanted '%s'", err,
                needle ? needle : "(accepted)");
    }
    split_free(s);
  }
  return accepted == 2 ? 1 : refused == 2 ? 0 : -1;
}

/* A PushRequest of `count` values in job `job`, with h as its header. */
static Ps__PushRequest push_request(Ps__RequestHeader *h, const char *job, uint64_t count) {
  ps__request_header__init(h);
  h->protocol_version = PS_PROTOCOL_VERSION;
  h->job_id = (char *)job;
  Ps__PushRequest r = PS__PUSH_REQUEST__INIT;
  r.header = h;
  r.count = count;
  return r;
}

static int push_with_job_id(const char *mark, const char *with, const char *needle) {
  Ps__RequestHeader h;
  Ps__PushRequest r = push_request(&h, mark, 1);
  blob b = packed_with(&r.base, mark, with);
  int rc = decode_strings(&ps__push_request__descriptor, b, needle);
  free(b.bytes);
  return rc;
}

/* A job id with a NUL inside would compare equal to its prefix (protobuf-c
 * hands out C strings); invalid UTF-8 breaks every other protobuf library.
 * Both are refused, in a nested message (the header) too. */
static void test_strings_checked(void) {
  CHECK(push_with_job_id("jobXevil", "job\0evil", "RequestHeader.job_id holds a NUL byte") == 0);
  CHECK(push_with_job_id("jobX", "job\0", "holds a NUL byte") == 0);
  CHECK(push_with_job_id("job-X", "job-\xff", "RequestHeader.job_id is not valid UTF-8 (byte 4)") ==
        0);
  /* in the header, so the message says where */
  CHECK(push_with_job_id("jobX", "job\xc3", "in PushRequest.header, string field") == 0);
  /* Each kind of invalid sequence: a lone continuation, an overlong '/', a
   * truncated 3-byte character, a surrogate (U+D800), above U+10FFFF, F5. */
  const char *bad[][2] = {{"aaXz", "aa\x80z"},     {"aaXXz", "aa\xc0\xafz"},
                          {"aaXXz", "aa\xe2\x82z"}, {"aXXXz", "a\xed\xa0\x80z"},
                          {"XXXX", "\xf4\x90\x80\x80"}, {"zyXwv", "zy\xf5wv"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    CHECK_MSG(push_with_job_id(bad[i][0], bad[i][1], "not valid UTF-8") == 0, "case %zu", i);
  /* Valid UTF-8 of every length goes through unchanged. */
  const char *good = "job-\xc3\xa9-\xe2\x82\xac-\xf0\x9d\x84\x9e"; /* é € 𝄞 */
  CHECK(push_with_job_id(good, good, NULL) == 1);

  /* A top-level string (RegisterRequest.host), a repeated one
   * (RegisterResponse.shards), one in a reply (StatusResponse.mode): all
   * checked. */
  Ps__RegisterRequest rr = PS__REGISTER_REQUEST__INIT;
  rr.host = "hostX";
  blob b = packed_with(&rr.base, "hostX", "host\n"); /* a control character is valid UTF-8 */
  CHECK(decode_strings(&ps__register_request__descriptor, b, NULL) == 1);
  free(b.bytes);
  b = packed_with(&rr.base, "hostX", "host\xfe");
  CHECK(decode_strings(&ps__register_request__descriptor, b, "RegisterRequest.host") == 0);
  free(b.bytes);
  Ps__RegisterResponse rs = PS__REGISTER_RESPONSE__INIT;
  char *shards[2] = {"a:1", "bX:2"};
  rs.n_shards = 2;
  rs.shards = shards;
  b = packed_with(&rs.base, "bX:2", "b\0:2");
  CHECK(decode_strings(&ps__register_response__descriptor, b, "RegisterResponse.shards") == 0);
  free(b.bytes);
  Ps__StatusResponse st = PS__STATUS_RESPONSE__INIT;
  st.mode = "asyncX";
  b = packed_with(&st.base, "asyncX", "async\0");
  CHECK(decode_strings(&ps__status_response__descriptor, b, "StatusResponse.mode") == 0);
  free(b.bytes);
}

/* The tensor (field 15 as bytes) is not a string: any bytes go through, and
 * still without a copy. */
static void test_tensor_not_checked(void) {
  const uint8_t raw[8] = {0x00, 0xff, 0xfe, 0xc0, 0x80, 0xed, 0xa0, 0x00};
  Ps__RequestHeader h;
  Ps__PushRequest r = push_request(&h, "j", 2);
  rpc_msg m;
  CHECK(wire_encode(&r.base, raw, sizeof raw, count_release, &releases, &m) == 0);
  ps_seg in[2] = {{m.seg[0].ptr, m.seg[0].len}, {m.seg[1].ptr, m.seg[1].len}};
  ps_segview v = {in, 2, in[0].len + in[1].len}, tv;
  ps_seg tsegs[2];
  char err[PS_ERRLEN] = "";
  ProtobufCMessage *got = wire_decode(&ps__push_request__descriptor, &v, tsegs, 2, &tv, err);
  CHECK_MSG(got != NULL, "%s", err);
  CHECK(tv.nsegs == 1 && tv.total == sizeof raw && tv.segs[0].ptr == in[1].ptr);
  if (got)
    protobuf_c_message_free_unpacked(got, NULL);
  rpc_msg_release(&m);
}

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t next_rand(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}

/* Random garbage and mutated valid messages: any answer is fine as long as
 * it comes without a crash, an overread, or a message-less NULL. */
static void test_garbage(void) {
  /* a valid message to mutate */
  float t[40];
  for (int i = 0; i < 40; i++)
    t[i] = (float)i;
  Ps__RequestHeader rh;
  Ps__PushRequest pr = push_request(&rh, "fuzz", 40);
  rpc_msg m;
  CHECK(wire_encode(&pr.base, t, sizeof(t), NULL, NULL, &m) == PS_OK);
  blob valid = msg_bytes(&m);
  rpc_msg_release(&m);

  int accepted = 0, refused = 0, silent = 0;
  uint8_t buf[256];
  for (int iter = 0; iter < 20000; iter++) {
    size_t len;
    if (iter % 2 == 0) {
      len = next_rand() % 64;
      for (size_t i = 0; i < len; i++)
        buf[i] = (uint8_t)next_rand();
    } else {
      len = valid.len;
      memcpy(buf, valid.bytes, len);
      int flips = 1 + (int)(next_rand() % 3);
      for (int f = 0; f < flips; f++)
        buf[next_rand() % len] = (uint8_t)next_rand();
      len -= next_rand() % 4 == 0 ? next_rand() % len : 0; /* sometimes truncated */
    }
    size_t cuts[3];
    int nc = 0;
    for (int k = 0; k < 3 && len > 1; k++) {
      size_t c = 1 + next_rand() % (len - 1);
      if (nc == 0 || c > cuts[nc - 1])
        cuts[nc++] = c;
    }
    split *s = split_at(buf, len, cuts, nc);
    ps_seg tsegs[4];
    ps_segview tv;
    char err[PS_ERRLEN] = "";
    ProtobufCMessage *got =
        wire_decode(&ps__push_request__descriptor, &s->view, tsegs, 4, &tv, err);
    if (got != NULL) {
      accepted++;
      CHECK(tv.total <= len);
      protobuf_c_message_free_unpacked(got, NULL);
    } else if (err[0] != '\0') {
      refused++;
    } else {
      silent++;
    }
    split_free(s);
  }
  free(valid.bytes);
  CHECK(silent == 0);
  CHECK(accepted > 0 && refused > 0);
  fprintf(stderr, "  garbage: %d accepted, %d refused\n", accepted, refused);
}

int main(void) {
  RUN(test_push_roundtrip_sizes);
  RUN(test_pull_response_roundtrip);
  RUN(test_fields_in_any_order);
  RUN(test_messages_without_tensor);
  RUN(test_malformed);
  RUN(test_strings_checked);
  RUN(test_tensor_not_checked);
  RUN(test_garbage);
  return check_summary();
}
