/* Encoding and decoding of protocol messages with the tensor field (number
 * 15, bytes) kept out of protobuf-c: the header fields are packed/unpacked
 * by protobuf-c, and the tensor bytes go straight between the caller's
 * buffer and gRPC's slices. */
#ifndef PS_COMMON_WIRE_H
#define PS_COMMON_WIRE_H

#include <protobuf-c/protobuf-c.h>

#include "rpc.h"
#include "util.h"

#define WIRE_TENSOR_FIELD 15
/* Bumped only when a client of the previous version would be misread.
 * The 16-bit encodings of field 15 (RequestHeader.encoding, proto/ps.proto)
 * did not need it: the field's default, 0, is float32, which is what a
 * client without it sends and expects, and a shard refuses a client whose
 * encoding is not its job's, naming the job's. */
#define PS_PROTOCOL_VERSION 2

/* Replicated shards: a replica that is not its shard's primary answers a
 * worker's call UNAVAILABLE, its message ending with this tag naming the
 * primary it knows (a replica index within the shard, -1 when it knows
 * none). */
#define PS_REDIRECT_FMT " [primary=replica %d]"
/* The replica a message's tag names (>= 0); -1 when the tag names none;
 * -2 when the message has no tag (or msg is NULL). */
int ps_redirect_parse(const char *msg);

/* Builds an outgoing message: `hdr` (whose tensor field must be empty) is
 * packed into a fresh buffer, followed by the tag and length of field 15 and
 * then `tensor` as its own segment, sent without a copy (release(user) is
 * called when gRPC is done with it; release NULL means the tensor is copied).
 * tensor may be NULL with tensor_bytes 0 for messages without one.
 * Without release the tensor is copied into the header's segment (one
 * segment); an empty tensor is left out (as protobuf-c does) and its release
 * called at once. Returns PS_EINVAL (nothing released) when the header
 * already sets field 15 or declares it as something other than bytes. */
int wire_encode(const ProtobufCMessage *hdr, const void *tensor, size_t tensor_bytes,
                void (*release)(void *user), void *user, rpc_msg *out);

/* wire_encode with field 15 made of several parts (at most
 * RPC_MAX_SEGS - 1), each its own segment sent without a copy
 * (release(user) of each part when gRPC is done with it; an empty part's
 * at once). On error every part's release has been called. */
typedef struct {
  const void *ptr;
  size_t len;
  void (*release)(void *user);
  void *user;
} wire_part;
int wire_encode_parts(const ProtobufCMessage *hdr, const wire_part *parts, int nparts,
                      rpc_msg *out);

/* Answers call with the small message m (no field 15), packed into a
 * fresh buffer; RESOURCE_EXHAUSTED when it cannot be encoded. The call is
 * answered in every case. */
void wire_reply(rpc_call *call, const ProtobufCMessage *m);

/* Decodes `msg`: every field but 15 is unpacked by protobuf-c with `desc`
 * (the returned message, free with protobuf_c_message_free_unpacked(m, NULL));
 * the bytes of field 15 (the last occurrence, as protobuf specifies) are
 * returned as a view into msg (field 15 counts as the tensor when the
 * message type declares it as bytes or not at all), using tsegs[0 .. max_tsegs) for storage
 * (max_tsegs >= msg->nsegs is always enough). A message with no field 15
 * gives an empty view. NULL with a message in err for malformed input
 * (bad varint, truncated field, bad wire type, a `string` field anywhere in
 * the message, nested ones included, that is not valid UTF-8 or holds a NUL
 * byte, protobuf-c refusal); nothing is left to free then. */
ProtobufCMessage *wire_decode(const ProtobufCMessageDescriptor *desc, const ps_segview *msg,
                              ps_seg *tsegs, int max_tsegs, ps_segview *tensor, char *err);

#endif
