/* libFuzzer target: shard 0's lease state as stored in a checkpoint must be
 * restored by ps_leases_load or refused with a message, never crash the
 * shard. Two modes, by the first byte:
 *  - even: the rest of the input is the blob itself;
 *  - odd: the input drives a real table (its configuration, then acquire,
 *    complete, release, expire, rejoin, refused and pushed calls by several
 *    workers), whose saved blob must load back and save again; then one
 *    byte of it,
 *    chosen by the input, is changed, and the changed blob must be loaded
 *    or refused with a message. Near-valid blobs reach the deep checks. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/util.h"
#include "ps/state/leases.h"
#include "fuzz_util.h"

static void load_or_refuse(const void *buf, size_t len) {
  char err[PS_ERRLEN] = "";
  ps_leases *t = ps_leases_load(buf, len, err);
  if (!t) {
    if (!err[0]) abort();
    return;
  }
  ps_lease l;
  (void)ps_leases_acquire(t, 7, 1000, &l); /* a restored table must work */
  ps_leases_destroy(t);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  const int mode = data[0] & 1;
  data++;
  size--;
  if (mode == 0) {
    load_or_refuse(data, size);
    return 0;
  }
  ps_lease_config cfg = {
      .n_examples = 1 + fuzz_take(&data, &size, 2) % 5000,
      .chunk_size = 1 + (uint32_t)(fuzz_take(&data, &size, 1) % 300),
      .epochs = (uint32_t)(fuzz_take(&data, &size, 1) % 4),
      .seed = fuzz_take(&data, &size, 2),
      .max_per_worker = 1 + (uint32_t)(fuzz_take(&data, &size, 1) % 3),
  };
  char err[PS_ERRLEN] = "";
  ps_leases *t = ps_leases_create(&cfg, err);
  if (!t) {
    if (!err[0]) abort();
    return 0;
  }
  uint64_t held[8] = {0};
  int64_t now = 0;
  for (int step = 0; step < 200 && size >= 2; step++) {
    const uint8_t op = (uint8_t)fuzz_take(&data, &size, 1);
    const uint64_t w = 1 + op % 8;
    now += (int64_t)fuzz_take(&data, &size, 1) * 10;
    ps_lease l;
    switch ((op >> 3) % 6) {
      case 0:
        if (ps_leases_acquire(t, w, now, &l) == 0) held[w - 1] = l.lease_id;
        break;
      case 1: (void)ps_leases_complete(t, w, held[w - 1], now); break;
      case 2: (void)ps_leases_release_worker(t, w); break;
      case 3: (void)ps_leases_expire(t, now, 500); break;
      case 4: { /* a worker registering again names chunks it completed and leases it holds */
        ps_lease_stats st;
        ps_leases_stats(t, &st);
        uint64_t named[2] = {(uint64_t)st.epoch << 32 | fuzz_take(&data, &size, 2),
                             fuzz_take(&data, &size, 8)};
        const uint64_t flags = fuzz_take(&data, &size, 1);
        ps_lease_held h = {.lease_id = flags & 4 ? held[w - 1] : fuzz_take(&data, &size, 8),
                           .epoch = st.epoch,
                           .chunk = (uint32_t)fuzz_take(&data, &size, 2),
                           .finished = (int)(flags & 1),
                           .trained = (uint32_t)fuzz_take(&data, &size, 2),
                           .refused = (int)(flags >> 1 & 1)};
        (void)ps_leases_rejoin(t, w, named, 2, &h, 1, now, NULL);
        ps_leases_note_refused(t, w, flags & 8 ? held[w - 1] : h.lease_id,
                               fuzz_take(&data, &size, 1));
        break;
      }
      case 5: /* a push of the worker's batch, on its lease or another id */
        ps_leases_note_pushed(t, w, op & 1 ? held[w - 1] : fuzz_take(&data, &size, 8),
                              (uint32_t)fuzz_take(&data, &size, 1));
        break;
    }
  }
  void *blob = NULL, *again = NULL;
  size_t len = 0, len2 = 0;
  if (ps_leases_save(t, &blob, &len) == 0) {
    ps_leases *u = ps_leases_load(blob, len, err);
    if (!u) abort(); /* its own blob refused */
    if (ps_leases_save(u, &again, &len2) != 0) abort();
    ps_leases_destroy(u);
    free(again);
    if (len > 0) {
      const uint64_t where = fuzz_take(&data, &size, 2), what = fuzz_take(&data, &size, 1);
      ((uint8_t *)blob)[where % len] ^= (uint8_t)(what | 1);
      load_or_refuse(blob, len);
      load_or_refuse(blob, where % len); /* truncated */
    }
    free(blob);
  }
  ps_leases_destroy(t);
  return 0;
}
