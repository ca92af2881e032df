/* libFuzzer target: the trust path of a shard. The input is a sequence of
 * Register and authorize steps against one membership table, each step a
 * RegisterRequest (or any bytes) run through the wire decoder, as the
 * server's dispatcher and its Register handler see them:
 *  - the header's token is compared with the job's (ps_ct_equal must agree
 *    with memcmp);
 *  - a registration of a new id gets a fresh, non-zero id and secret;
 *  - a registration of a known id without its secret is refused and
 *    changes nothing (the stored host stays);
 *  - authorize accepts exactly the secret the table handed out.
 * Any violation aborts. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/auth.h"
#include "../../common/util.h"
#include "../../common/wire.h"
#include "ps/state/membership.h"
#include "fuzz_util.h"
#include "proto/ps.pb-c.h"

static const uint8_t job_token[] = "0123456789abcdef-job-token";

typedef struct {
  uint64_t id;
  uint8_t session[PS_SESSION_LEN];
  char host[64];
} known;

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  ps_membership *m = ps_membership_create();
  if (!m) abort();
  ps_membership_set_limit(m, 8);
  known ks[8];
  int nk = 0;
  for (int step = 0; step < 16 && size > 2; step++) {
    size_t len = (size_t)fuzz_take(&data, &size, 2) % 512;
    if (len > size) len = size;
    const uint8_t *msg = data;
    data += len;
    size -= len;
    /* One request through the decoder. */
    ps_seg seg = {msg, len}, tseg[2];
    ps_segview v = {&seg, 1, len}, tensor;
    char err[PS_ERRLEN] = "";
    Ps__RegisterRequest *r = (Ps__RegisterRequest *)wire_decode(
        &ps__register_request__descriptor, &v, tseg, 2, &tensor, err);
    if (!r) {
      if (!err[0]) abort(); /* refused without a message */
      continue;
    }
    if (r->header) {
      const ProtobufCBinaryData *t = &r->header->token;
      int eq = ps_ct_equal(t->data, t->len, job_token, sizeof job_token - 1);
      int ref = t->len == sizeof job_token - 1 && memcmp(t->data, job_token, t->len) == 0;
      if (eq != ref) abort();
      /* Steer some steps to a known id, so that take-overs are tried. */
      uint64_t id = r->header->worker_id;
      if (nk && (id & 3) == 1) id = ks[id % (uint64_t)nk].id;
      ps_member_cred cred = {.session = r->header->session.data,
                             .session_len = r->header->session.len};
      uint64_t got = 0;
      int rank = 0;
      uint8_t secret[PS_SESSION_LEN];
      int at = -1;
      for (int i = 0; i < nk; i++)
        if (ks[i].id == id && id) at = i;
      int rc = ps_membership_join(m, id, r->host, r->role, r->task_index, step, &cred, &got, &rank,
                                  secret);
      if (at >= 0) {
        int shows = cred.session_len == PS_SESSION_LEN &&
                    memcmp(cred.session, ks[at].session, PS_SESSION_LEN) == 0;
        if (shows != (rc == PS_OK)) abort(); /* a take-over, or the owner refused */
        if (rc == PS_OK && memcmp(secret, ks[at].session, PS_SESSION_LEN) != 0) abort();
      } else if (rc == PS_OK) {
        if (got == 0 || (id && got != id) || nk == 8) abort();
        ks[nk].id = got;
        memcpy(ks[nk].session, secret, PS_SESSION_LEN);
        nk++;
      } else if (rc != PS_ERANGE || nk < 8) {
        abort(); /* only a full table may refuse a newcomer */
      }
      /* The table knows exactly the secrets it handed out. */
      for (int i = 0; i < nk; i++) {
        int reader = -1;
        if (ps_membership_authorize(m, ks[i].id, ks[i].session, PS_SESSION_LEN, &reader) != PS_OK)
          abort();
        uint8_t wrong[PS_SESSION_LEN];
        memcpy(wrong, ks[i].session, PS_SESSION_LEN);
        wrong[step % PS_SESSION_LEN] ^= 1;
        if (ps_membership_authorize(m, ks[i].id, wrong, PS_SESSION_LEN, &reader) != PS_EINVAL)
          abort();
        if (ps_membership_authorize(m, ks[i].id, cred.session, cred.session_len, &reader) ==
                PS_OK &&
            !(cred.session_len == PS_SESSION_LEN &&
              memcmp(cred.session, ks[i].session, PS_SESSION_LEN) == 0))
          abort();
      }
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
  }
  ps_membership_destroy(m);
  return 0;
}
