/* libFuzzer target: NumPy data (.npy pairs and .npz archives) parsed from
 * memory, the code ps_dataset_load_npy and ps_dataset_load_npz run on a
 * file's bytes. The first byte picks the container (bit 0: npz) and the
 * layout (bit 1: NCHW); for .npy the second byte says where the input
 * splits into the image file and the label file. A damaged or hostile file
 * must load or be refused with a message, never crash the worker. */
#include <stdint.h>
#include <stdlib.h>

#include "../../common/util.h"
#include "worker/data/data.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2) return 0;
  const int npz = data[0] & 1;
  const int layout = data[0] & 2 ? PS_LAYOUT_NCHW : PS_LAYOUT_NHWC;
  const size_t cut = size > 2 ? (size_t)data[1] * (size - 2) / 255 : 0;
  data += 2;
  size -= 2;
  ps_dataset d;
  char err[PS_ERRLEN] = "";
  int rc = npz ? ps_dataset_parse_npz(data, size, "fuzz.npz", "x", "y", layout, 10, &d, err)
               : ps_dataset_parse_npy(data, cut, "x.npy", data + cut, size - cut, "y.npy", layout,
                                      10, &d, err);
  if (rc == 0) {
    /* A set that loads is whole: every label in range. */
    for (int i = 0; i < d.n; i++)
      if (d.labels[i] >= 10) abort();
    ps_dataset_free(&d);
  } else if (!err[0]) {
    abort();
  }
  return 0;
}
