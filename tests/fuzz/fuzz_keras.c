/* libFuzzer target: the JSON of a Keras model (model.to_json(), what
 * ps-import-keras and a job's "model": {"keras": FILE} read) through
 * ps_keras_to_spec, which must translate it or refuse it with a message;
 * a translation must be a spec that parses or is refused with a message. */
#include <jansson.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/keras.h"
#include "../../common/model_spec.h"
#include "../../common/util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *text = malloc(size + 1);
  if (!text) return 0;
  memcpy(text, data, size);
  text[size] = '\0';
  void *spec = NULL;
  char err[PS_ERRLEN] = "", notes[512];
  if (ps_keras_to_spec(text, &spec, notes, sizeof notes, err) != 0) {
    if (!err[0] || spec) abort();
  } else {
    ps_model_spec m;
    err[0] = '\0';
    if (!spec || (ps_model_spec_from_json(spec, &m, err) != 0 && !err[0])) abort();
    json_decref(spec);
  }
  free(text);
  return 0;
}
