/* Protocol messages with the tensor (field 15, bytes) kept out of protobuf-c.
 *
 * A `bytes` field on the wire is a tag, a varint length and the raw bytes, so
 * a message can be written as the packed header followed by field 15, and read
 * by scanning the top-level fields: the header fields are gathered into one
 * small buffer for protobuf-c, the tensor is only pointed at. Copying a 40 MB
 * tensor through protobuf-c costs tens of milliseconds (GRPC-NOTES.md). */
#include "wire.h"

#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#define WIRE_TENSOR_TAG ((WIRE_TENSOR_FIELD << 3) | 2) /* 0x7a: one byte */
#define VARINT_MAX_BYTES 10

enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_SGROUP = 3, WT_EGROUP = 4, WT_I32 = 5 };

static size_t varint_put(uint8_t *p, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    p[n++] = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  p[n++] = (uint8_t)v;
  return n;
}

/* Field 15 is the tensor unless the message type declares it as something
 * other than bytes (ps.proto keeps 15 for tensors, but a message may not):
 * then it is an ordinary header field and must go through protobuf-c. */
static const ProtobufCFieldDescriptor *tensor_field(const ProtobufCMessageDescriptor *desc,
                                                    int *is_tensor) {
  const ProtobufCFieldDescriptor *fd =
      protobuf_c_message_descriptor_get_field(desc, WIRE_TENSOR_FIELD);
  *is_tensor =
      fd == NULL || (fd->type == PROTOBUF_C_TYPE_BYTES && fd->label != PROTOBUF_C_LABEL_REPEATED);
  return fd;
}

/* On error nothing is released: the caller still owns `tensor`. A tensor of
 * 0 bytes is not written at all (as protobuf-c omits an empty proto3 bytes
 * field) and its release, if any, is called before returning. */
void wire_reply(rpc_call *call, const ProtobufCMessage *m) {
  rpc_msg out;
  if (wire_encode(m, NULL, 0, NULL, NULL, &out) != 0) {
    rpc_call_fail(call, RPC_RESOURCE_EXHAUSTED, "out of memory encoding the reply");
    return;
  }
  rpc_call_reply(call, &out);
}

int wire_encode(const ProtobufCMessage *hdr, const void *tensor, size_t tensor_bytes,
                void (*release)(void *user), void *user, rpc_msg *out) {
  if (hdr == NULL || out == NULL || (tensor == NULL && tensor_bytes > 0))
    return PS_EINVAL;
  int is_tensor;
  const ProtobufCFieldDescriptor *fd = tensor_field(hdr->descriptor, &is_tensor);
  if (!is_tensor && tensor_bytes > 0)
    return PS_EINVAL;
  if (is_tensor && fd != NULL) {
    const ProtobufCBinaryData *b = (const void *)((const char *)hdr + fd->offset);
    if (b->len != 0)
      return PS_EINVAL; /* would be written twice */
  }

  size_t hlen = protobuf_c_message_get_packed_size(hdr);
  size_t copied = (tensor_bytes > 0 && release == NULL) ? tensor_bytes : 0;
  size_t room = hlen + (tensor_bytes > 0 ? 1 + VARINT_MAX_BYTES : 0) + copied;
  uint8_t *buf = malloc(room > 0 ? room : 1);
  if (buf == NULL)
    return PS_ENOMEM;
  size_t n = protobuf_c_message_pack(hdr, buf);
  if (n != hlen) {
    free(buf);
    return PS_EINVAL;
  }
  if (tensor_bytes > 0) {
    buf[n++] = WIRE_TENSOR_TAG;
    n += varint_put(buf + n, (uint64_t)tensor_bytes);
  }
  /* Without a release function the caller's buffer may go away as soon as
   * we return, so its bytes join the header buffer: one copy, one segment. */
  if (copied > 0) {
    memcpy(buf + n, tensor, copied);
    n += copied;
  }

  memset(out, 0, sizeof(*out));
  out->seg[0] = (rpc_seg){.ptr = buf, .len = n, .release = free, .user = buf};
  out->nseg = 1;
  if (tensor_bytes > 0 && release != NULL) {
    out->seg[1] = (rpc_seg){.ptr = tensor, .len = tensor_bytes, .release = release, .user = user};
    out->nseg = 2;
  } else if (release != NULL) {
    release(user);
  }
  return PS_OK;
}

int wire_encode_parts(const ProtobufCMessage *hdr, const wire_part *parts, int nparts,
                      rpc_msg *out) {
  size_t total = 0;
  int ok = hdr && out && nparts >= 0 && nparts < RPC_MAX_SEGS;
  for (int i = 0; ok && i < nparts; i++) {
    if (!parts[i].release || (!parts[i].ptr && parts[i].len)) ok = 0;
    total += parts[i].len;
  }
  int is_tensor = 0;
  if (ok) {
    const ProtobufCFieldDescriptor *fd = tensor_field(hdr->descriptor, &is_tensor);
    if ((!is_tensor && total) ||
        (is_tensor && fd && ((const ProtobufCBinaryData *)(const void *)((const char *)hdr +
                                                                          fd->offset))->len))
      ok = 0;
  }
  uint8_t *buf = NULL;
  size_t hlen = ok ? protobuf_c_message_get_packed_size(hdr) : 0;
  if (ok) buf = malloc(hlen + 1 + VARINT_MAX_BYTES);
  if (!ok || !buf || protobuf_c_message_pack(hdr, buf) != hlen) {
    free(buf);
    for (int i = 0; i < nparts; i++)
      if (parts[i].release) parts[i].release(parts[i].user);
    return ok && !buf ? PS_ENOMEM : PS_EINVAL;
  }
  size_t n = hlen;
  if (total > 0) {
    buf[n++] = WIRE_TENSOR_TAG;
    n += varint_put(buf + n, (uint64_t)total);
  }
  memset(out, 0, sizeof(*out));
  out->seg[0] = (rpc_seg){.ptr = buf, .len = n, .release = free, .user = buf};
  out->nseg = 1;
  for (int i = 0; i < nparts; i++) {
    if (parts[i].len == 0) {
      parts[i].release(parts[i].user);
      continue;
    }
    out->seg[out->nseg++] =
        (rpc_seg){.ptr = parts[i].ptr, .len = parts[i].len, .release = parts[i].release,
                  .user = parts[i].user};
  }
  return PS_OK;
}

/* ---- reading scattered bytes ---- */

/* A position in a segment view. Empty segments are skipped lazily. */
typedef struct {
  const ps_segview *v;
  int seg;
  size_t off; /* within segs[seg] */
  size_t pos; /* from the start of the message */
} cursor;

static int cur_settle(cursor *c) {
  while (c->seg < c->v->nsegs && c->off == c->v->segs[c->seg].len) {
    c->seg++;
    c->off = 0;
  }
  return c->seg < c->v->nsegs;
}

static int cur_at_end(cursor *c) { return !cur_settle(c); }

static int cur_byte(cursor *c, uint8_t *b) {
  if (!cur_settle(c))
    return -1;
  *b = c->v->segs[c->seg].ptr[c->off++];
  c->pos++;
  return 0;
}

/* Advances n bytes, copying them to dst when dst is not NULL; -1 if the
 * segments end first. */
static int cur_take(cursor *c, size_t n, uint8_t *dst) {
  while (n > 0) {
    if (!cur_settle(c))
      return -1;
    const ps_seg *s = &c->v->segs[c->seg];
    size_t k = s->len - c->off;
    if (k > n)
      k = n;
    if (dst != NULL) {
      memcpy(dst, s->ptr + c->off, k);
      dst += k;
    }
    c->off += k;
    c->pos += k;
    n -= k;
  }
  return 0;
}

static size_t cur_left(const cursor *c) { return c->v->total - c->pos; }

static int cur_varint(cursor *c, uint64_t *out, char *err) {
  size_t start = c->pos;
  uint64_t v = 0;
  for (int i = 0; i < VARINT_MAX_BYTES; i++) {
    uint8_t b;
    if (cur_byte(c, &b) != 0)
      return ps_seterr(err, PS_EINVAL, "wire: truncated varint at byte %zu", start);
    /* The tenth byte holds bit 63 only. */
    if (i == VARINT_MAX_BYTES - 1 && (b & 0x7e) != 0)
      return ps_seterr(err, PS_EINVAL, "wire: varint at byte %zu overflows 64 bits", start);
    v |= (uint64_t)(b & 0x7f) << (7 * i);
    if ((b & 0x80) == 0) {
      *out = v;
      return 0;
    }
  }
  return ps_seterr(err, PS_EINVAL, "wire: varint at byte %zu is longer than 10 bytes", start);
}

/* One top-level field: its number, wire type, where it starts, and (for
 * length-delimited fields) where its payload starts and how long it is. */
typedef struct {
  uint32_t number;
  int wtype;
  size_t start;
  size_t payload_len; /* WT_LEN only */
  cursor payload;     /* WT_LEN only: positioned at the payload */
} field;

/* Reads one field and leaves the cursor after it. */
static int next_field(cursor *c, field *f, char *err) {
  uint64_t tag, len;
  f->start = c->pos;
  if (cur_varint(c, &tag, err) != 0)
    return PS_EINVAL;
  f->wtype = (int)(tag & 7);
  if ((tag >> 3) == 0 || (tag >> 3) > 0x1fffffff)
    return ps_seterr(err, PS_EINVAL, "wire: invalid field number %llu at byte %zu",
                     (unsigned long long)(tag >> 3), f->start);
  f->number = (uint32_t)(tag >> 3);
  switch (f->wtype) {
  case WT_VARINT:
    return cur_varint(c, &len, err) == 0 ? 0 : PS_EINVAL;
  case WT_I64:
  case WT_I32: {
    size_t n = f->wtype == WT_I64 ? 8 : 4;
    if (cur_take(c, n, NULL) != 0)
      return ps_seterr(err, PS_EINVAL, "wire: field %u at byte %zu: truncated %zu-byte value",
                       f->number, f->start, n);
    return 0;
  }
  case WT_LEN:
    if (cur_varint(c, &len, err) != 0)
      return PS_EINVAL;
    if (len > cur_left(c))
      return ps_seterr(err, PS_EINVAL,
                       "wire: field %u at byte %zu has length %llu but only %zu bytes follow",
                       f->number, f->start, (unsigned long long)len, cur_left(c));
    f->payload = *c;
    f->payload_len = (size_t)len;
    if (cur_take(c, (size_t)len, NULL) != 0)
      return ps_seterr(err, PS_EINVAL, "wire: field %u at byte %zu runs past the segments",
                       f->number, f->start);
    return 0;
  case WT_SGROUP:
  case WT_EGROUP:
    return ps_seterr(err, PS_EINVAL,
                     "wire: field %u at byte %zu uses groups (wire type %d), "
                     "which this protocol never does",
                     f->number, f->start, f->wtype);
  default:
    return ps_seterr(err, PS_EINVAL, "wire: field %u at byte %zu has invalid wire type %d",
                     f->number, f->start, f->wtype);
  }
}

/* Points tsegs at `len` bytes from the cursor on; -1 if more than max
 * segments would be needed. */
static int view_of(cursor c, size_t len, ps_seg *tsegs, int max_tsegs, ps_segview *out) {
  int n = 0;
  size_t left = len;
  while (left > 0) {
    if (!cur_settle(&c) || n == max_tsegs)
      return -1;
    const ps_seg *s = &c.v->segs[c.seg];
    size_t k = s->len - c.off;
    if (k > left)
      k = left;
    tsegs[n++] = (ps_seg){.ptr = s->ptr + c.off, .len = k};
    c.off += k;
    left -= k;
  }
  out->segs = tsegs;
  out->nsegs = n;
  out->total = len;
  return 0;
}

/* protobuf-c checks neither that a `string` is valid UTF-8 (which proto3
 * requires, and which other protobuf libraries refuse to parse otherwise)
 * nor that it holds no NUL byte (it hands out C strings, so a job id
 * "job\0evil" would read as "job"). Both are checked here, on the wire
 * bytes of every string field, in nested messages too. Schemas that nest a
 * message in itself could recurse without end: the depth is bounded. */
#define STRING_CHECK_DEPTH 16

static int check_strings(const ProtobufCMessageDescriptor *desc, const uint8_t *buf, size_t len,
                         int depth, char *err) {
  if (depth > STRING_CHECK_DEPTH)
    return ps_seterr(err, PS_EINVAL, "wire: messages nested more than %d deep",
                     STRING_CHECK_DEPTH);
  ps_seg seg = {.ptr = buf, .len = len};
  ps_segview v = {.segs = &seg, .nsegs = 1, .total = len};
  cursor c = {.v = &v};
  field f;
  while (!cur_at_end(&c)) {
    if (next_field(&c, &f, err) != 0)
      return PS_EINVAL;
    const ProtobufCFieldDescriptor *fd = protobuf_c_message_descriptor_get_field(desc, f.number);
    /* Other wire types for a string or message field: protobuf-c refuses. */
    if (fd == NULL || f.wtype != WT_LEN)
      continue;
    const uint8_t *p = buf + f.payload.pos;
    if (fd->type == PROTOBUF_C_TYPE_STRING) {
      size_t ok = ps_utf8_valid_len(p, f.payload_len);
      if (ok != f.payload_len)
        return ps_seterr(err, PS_EINVAL, "wire: string field %s.%s is not valid UTF-8 (byte %zu)",
                         desc->short_name, fd->name, ok);
      if (memchr(p, 0, f.payload_len) != NULL)
        return ps_seterr(err, PS_EINVAL, "wire: string field %s.%s holds a NUL byte",
                         desc->short_name, fd->name);
    } else if (fd->type == PROTOBUF_C_TYPE_MESSAGE) {
      /* Its byte offsets count from the start of the nested message. */
      char inner[PS_ERRLEN];
      if (check_strings(fd->descriptor, p, f.payload_len, depth + 1, inner) != 0)
        return ps_seterr(err, PS_EINVAL, "wire: in %s.%s, %s", desc->short_name, fd->name,
                         strncmp(inner, "wire: ", 6) == 0 ? inner + 6 : inner);
    }
  }
  return 0;
}

#define HDR_STACK 512

ProtobufCMessage *wire_decode(const ProtobufCMessageDescriptor *desc, const ps_segview *msg,
                              ps_seg *tsegs, int max_tsegs, ps_segview *tensor, char *err) {
  if (desc == NULL || msg == NULL || tensor == NULL || (tsegs == NULL && max_tsegs > 0)) {
    ps_seterr(err, PS_EINVAL, "wire_decode: bad arguments");
    return NULL;
  }
  int is_tensor;
  tensor_field(desc, &is_tensor);

  /* Pass 1: validate every field, size the header, find the last tensor. */
  cursor c = {.v = msg};
  size_t hlen = 0;
  int have_tensor = 0;
  field f, tf = {0};
  while (!cur_at_end(&c)) {
    if (next_field(&c, &f, err) != 0)
      return NULL;
    if (is_tensor && f.number == WIRE_TENSOR_FIELD) {
      if (f.wtype != WT_LEN) {
        ps_seterr(err, PS_EINVAL,
                  "wire: field %d (tensor) at byte %zu has wire type %d, "
                  "expected 2 (length-delimited)",
                  WIRE_TENSOR_FIELD, f.start, f.wtype);
        return NULL;
      }
      tf = f;
      have_tensor = 1;
    } else {
      hlen += c.pos - f.start;
    }
  }
  if (c.pos != msg->total) {
    ps_seterr(err, PS_EINVAL, "wire: segments hold %zu bytes but the view says %zu", c.pos,
              msg->total);
    return NULL;
  }

  ps_segview tv = {.segs = tsegs, .nsegs = 0, .total = 0};
  if (have_tensor && view_of(tf.payload, tf.payload_len, tsegs, max_tsegs, &tv) != 0) {
    ps_seterr(err, PS_EINVAL, "wire: the tensor spans more than %d segments", max_tsegs);
    return NULL;
  }

  /* Pass 2: gather the header fields (already validated) into one buffer.
   * Messages rarely carry more than a few hundred header bytes. */
  uint8_t stackbuf[HDR_STACK];
  uint8_t *hbuf = hlen <= HDR_STACK ? stackbuf : malloc(hlen);
  if (hbuf == NULL) {
    ps_seterr(err, PS_ENOMEM, "wire: out of memory for a %zu-byte header", hlen);
    return NULL;
  }
  size_t h = 0;
  c = (cursor){.v = msg};
  while (!cur_at_end(&c)) {
    cursor start = c;
    next_field(&c, &f, NULL);
    if (!(is_tensor && f.number == WIRE_TENSOR_FIELD)) {
      size_t n = c.pos - f.start;
      cur_take(&start, n, hbuf + h);
      h += n;
    }
  }

  if (check_strings(desc, hbuf, h, 0, err) != 0) {
    if (hbuf != stackbuf)
      free(hbuf);
    return NULL;
  }
  /* protobuf-c copies strings and bytes out, so hbuf can go at once. */
  ProtobufCMessage *m = protobuf_c_message_unpack(desc, NULL, h, hbuf);
  if (hbuf != stackbuf)
    free(hbuf);
  if (m == NULL) {
    ps_seterr(err, PS_EINVAL, "wire: protobuf-c refused the %zu header bytes of a %s", h,
              desc->name);
    return NULL;
  }
  *tensor = tv;
  return m;
}

int ps_redirect_parse(const char *msg) {
  const char *tag = msg ? strstr(msg, " [primary=replica ") : NULL;
  if (!tag) return -2;
  int n = 0;
  char close = 0;
  if (sscanf(tag, " [primary=replica %d%c", &n, &close) != 2 || close != ']') return -2;
  return n >= 0 && n < 1000 ? n : -1;
}
