/* Keras models as model specs: the JSON of Keras's model.to_json() (tf_keras
 * / Keras 2 and Keras 3 formats; Sequential, and functional models whose
 * layers branch and join with Add, as residual blocks do) translated into
 * the model spec of model_spec.h; the spec's layers keep the Keras names.
 *
 * Keras tensors are channels-last (H, W, C); here activations are (C, H, W).
 * The translation keeps every layer's function: the input [H, W, C] becomes
 * [C, H, W], and a Flatten gives the same features in (C, H, W) order, so a
 * Dense layer after it has the same function with its input columns
 * permuted (which matters only to weights brought over from Keras).
 *
 * Layers: InputLayer, Conv2D, Dense, MaxPooling2D, AveragePooling2D,
 * GlobalAveragePooling2D, Flatten, Dropout, Activation, ReLU, Softmax,
 * Add and BatchNormalization. Conv2D and Dense with use_bias false become
 * "bias": false. BatchNormalization must normalize the channel axis (-1,
 * or 3 of a 4-D input, 1 of a 2-D one: each feature after Flatten, Dense
 * or GlobalAveragePooling2D) with gamma and beta (center and scale true),
 * no renormalization and epsilon >= 1e-5; it becomes batchnorm with
 * Keras's momentum and epsilon.
 * The model must end in a Dense layer giving the class scores, with a
 * softmax (as activation or layer) or as logits: either becomes
 * softmax_xent. Anything else is refused with a message naming the layer
 * and what is not supported (a layer type, an activation, dilation,
 * padding that would differ from Keras's, a regularizer, ...). Keras's
 * initializers are not carried over: the spec's own initialisation applies.
 */
#ifndef PS_COMMON_KERAS_H
#define PS_COMMON_KERAS_H

#include <stddef.h>
#include <stdint.h>

#include "model_spec.h"

/* Translates Keras model JSON text into a model spec JSON object (a
 * jansson json_t *, returned in *spec_out with one reference the caller
 * owns). On error returns PS_EINVAL with a message naming the layer;
 * *spec_out is then NULL. notes, when not NULL, receives one line per
 * choice the translation made that a user should know (empty if none). */
int ps_keras_to_spec(const char *keras_json, void **spec_out, char *notes, size_t notes_len,
                     char *err);

/* One array of Keras's model.get_weights(): float32, C order. */
typedef struct {
  const float *data;
  int ndim;
  int64_t shape[4];
} ps_keras_tensor;

/* The parameters of spec (which must be the translation of keras_json, as
 * in a job whose model came from ps-import-keras) from the model's weights:
 * tensors are model.get_weights() in order, a kernel and (unless use_bias
 * is false) a bias per Conv2D and Dense layer, gamma, beta, moving_mean and
 * moving_variance per BatchNormalization (Conv2D kernels (KH, KW, IC, OC)
 * become (OC, IC, KH, KW); Dense kernels (IN, OUT) become (OUT, IN), their
 * columns reordered from (h, w, c) to (c, h, w) after a Flatten, and so
 * are a BatchNormalization's four arrays there; batchnorm's moving mean
 * and variance go to its s range). Writes every parameter of
 * params[0 .. spec->n_params). PS_EINVAL with a message naming the array
 * and the shapes when a count or a shape differs, the layer when the job's
 * epsilon differs or a moving variance is negative (params then partly
 * written). */
int ps_keras_weights(const char *keras_json, const ps_model_spec *spec,
                     const ps_keras_tensor *tensors, int n_tensors, float *params, char *err);

#endif
