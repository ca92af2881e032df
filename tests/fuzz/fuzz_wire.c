/* libFuzzer target: wire_decode on any bytes, cut into up to 4 segments at
 * places the input chooses, against every message type of the protocol.
 * A decoded message's tensor view must lie inside the input and add up;
 * anything else must be refused with a message, never crash or leak. A
 * first byte 0xff makes it a round trip of wire_encode and wire_decode. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/util.h"
#include "../../common/wire.h"
#include "proto/ps.pb-c.h"

static const ProtobufCMessageDescriptor *const DESCS[] = {
    &ps__register_request__descriptor, &ps__heartbeat_request__descriptor,
    &ps__leave_request__descriptor,    &ps__pull_request__descriptor,
    &ps__push_request__descriptor,     &ps__status_request__descriptor,
    &ps__lease_request__descriptor,    &ps__pull_response__descriptor,
    &ps__push_response__descriptor,    &ps__register_response__descriptor,
};

/* The round trip: a Push request with fields and a tensor from the input,
 * encoded (tensor as its own segment) and decoded again, gives back the
 * same fields and the same tensor bytes. */
static void round_trip(const uint8_t *data, size_t size) {
  if (size < 8) return;
  Ps__RequestHeader h = PS__REQUEST_HEADER__INIT;
  h.protocol_version = data[0];
  h.job_id = "fuzz";
  h.worker_id = (uint64_t)data[1] << 40 | data[2];
  Ps__PushRequest req = PS__PUSH_REQUEST__INIT;
  req.header = &h;
  req.base_version = data[3];
  req.offset = (uint64_t)data[4] << 20;
  req.count = data[5];
  req.step = data[6];
  req.batch_size = data[7];
  rpc_msg msg;
  if (wire_encode(&req.base, data + 8, size - 8, NULL, NULL, &msg) != 0) abort();
  /* The segments as the receiver would see them, contiguous. */
  size_t total = 0;
  for (int i = 0; i < msg.nseg; i++) total += msg.seg[i].len;
  uint8_t *buf = malloc(total ? total : 1);
  if (!buf) abort();
  size_t at = 0;
  for (int i = 0; i < msg.nseg; i++) {
    memcpy(buf + at, msg.seg[i].ptr, msg.seg[i].len);
    at += msg.seg[i].len;
  }
  rpc_msg_release(&msg);
  ps_seg seg = {buf, total};
  ps_segview view = {&seg, 1, total};
  ps_seg tsegs[1];
  ps_segview tensor;
  char err[PS_ERRLEN] = "";
  Ps__PushRequest *r =
      (Ps__PushRequest *)wire_decode(&ps__push_request__descriptor, &view, tsegs, 1, &tensor, err);
  if (!r || !r->header || r->header->worker_id != h.worker_id ||
      r->base_version != req.base_version || r->offset != req.offset || r->count != req.count ||
      r->step != req.step || r->batch_size != req.batch_size || tensor.total != size - 8)
    abort();
  uint8_t *back = malloc(tensor.total ? tensor.total : 1);
  if (!back || ps_segview_copy(&tensor, 0, back, tensor.total) != 0 ||
      memcmp(back, data + 8, tensor.total) != 0)
    abort();
  free(back);
  protobuf_c_message_free_unpacked(&r->base, NULL);
  free(buf);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2) return 0;
  if (data[0] == 0xff) {
    round_trip(data + 1, size - 1);
    return 0;
  }
  const ProtobufCMessageDescriptor *desc = DESCS[data[0] % (sizeof DESCS / sizeof DESCS[0])];
  const int nsegs = 1 + data[1] % 4;
  data += 2;
  size -= 2;
  ps_seg segs[4];
  size_t at = 0;
  for (int i = 0; i < nsegs; i++) {
    size_t len = i == nsegs - 1 ? size - at : (size - at) / (size_t)(nsegs - i) + (size_t)i;
    if (len > size - at) len = size - at;
    segs[i] = (ps_seg){data + at, len};
    at += len;
  }
  ps_segview msg = {segs, nsegs, size};
  ps_seg tsegs[4];
  ps_segview tensor;
  char err[PS_ERRLEN] = "";
  ProtobufCMessage *m = wire_decode(desc, &msg, tsegs, 4, &tensor, err);
  if (!m) {
    if (!err[0]) abort(); /* refused without saying why */
    return 0;
  }
  size_t sum = 0;
  for (int i = 0; i < tensor.nsegs; i++) {
    const uint8_t *p = tensor.segs[i].ptr;
    if (p < data || p + tensor.segs[i].len > data + size) abort(); /* outside the input */
    sum += tensor.segs[i].len;
  }
  if (sum != tensor.total || tensor.total > size) abort();
  protobuf_c_message_free_unpacked(m, NULL);
  return 0;
}
