/* The model as an ONNX file (ps-export --format onnx): the inference graph
 * of a model spec with a parameter vector as its initializers.
 *
 * The graph: input "input", float32 [N, C, H, W] with a symbolic batch
 * dimension N; per layer, conv2d -> Conv (explicit symmetric pads, strides,
 * bias unless "bias": false), relu -> Relu, maxpool -> MaxPool, avgpool -> AveragePool
 * (count_include_pad 0), global_avgpool -> GlobalAveragePool ((N, C, 1, 1)),
 * flatten -> Flatten (axis 1),
 * dense -> Gemm (transB = 1, after a Flatten when its input is 4-D; no C
 * without a bias), batchnorm -> BatchNormalization (inference: the moving
 * mean and variance; epsilon, momentum; on the 4-D or 2-D tensor as it
 * comes),
 * dropout -> nothing (inference), add -> Add (a chain of them, left to
 * right, for more than two inputs; a 2-D input beside a 4-D one
 * unsqueezed), each node reading the tensors of the layers the spec's
 * "inputs" name, softmax_xent -> Softmax (axis 1) into the
 * output "probabilities", float32 [N, classes]. Operator set 13 of the
 * default domain, IR version 7. Each parameter tensor is an initializer
 * named "<layer>.w" / "<layer>.b" (conv2d weights OIHW, dense weights
 * (OUT, IN)) or, for batchnorm, "<layer>.gamma", ".beta", ".moving_mean"
 * and ".moving_variance" (C each), its values little-endian float32 in
 * raw_data. */
#ifndef PS_PS_EXPORT_ONNX_H
#define PS_PS_EXPORT_ONNX_H

#include <stdint.h>

#include "common/model_spec.h"

/* What the file says about where it came from (metadata_props and the
 * producer fields); any pointer may be NULL. */
typedef struct {
  const char *producer_version; /* the program's version */
  const char *job_id;
  uint64_t version; /* the checkpoints' version */
  int num_shards;   /* how many shards wrote them; 0: not said */
} ps_onnx_meta;

/* 0 when every layer of spec has an ONNX form; otherwise PS_EINVAL with a
 * message that names the first layer that has none. Writes nothing. */
int ps_onnx_check_spec(const ps_model_spec *spec, char *err);

/* Writes the model (spec, params[0 .. spec->n_params)) to path as an ONNX
 * file: to a temporary file next to it, fsynced, renamed over path, and
 * the directory fsynced. On error (PS_EINVAL: a layer with no ONNX form,
 * a path that is a directory, a model beyond protobuf's 2 GiB; PS_EIO;
 * PS_ENOMEM) a message names the cause, and path is as it was: the
 * temporary file is removed. *bytes (may be NULL) receives the file's size. */
int ps_onnx_export(const ps_model_spec *spec, const float *params, const ps_onnx_meta *meta,
                   const char *path, uint64_t *bytes, char *err);

#endif
