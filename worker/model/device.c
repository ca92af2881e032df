/* The device chooser (see device.h). The CUDA calls are compiled only when
 * the build has the CUDA backend (PS_WITH_CUDA, defined by CMake for the
 * targets that link ps_kernels_cuda); the CPU-only build answers every
 * request for cuda with an error naming the build option. Likewise the
 * oneDNN backend (PS_HAVE_DNNL): without it, cpu is the reference. */
#include "worker/model/device.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "common/util.h"
#include "kernels/emu/ops_emu.h"
#ifdef PS_HAVE_DNNL
#include "kernels/dnnl/ops_dnnl.h"
#endif
#ifdef PS_WITH_CUDA
#include "kernels/cuda/cuda_device.h"
#include "kernels/cuda/ops_cuda.h"
#endif

typedef enum { DEVICE_AUTO, DEVICE_CPU, DEVICE_CPU_REF, DEVICE_CUDA, DEVICE_EMU } device_kind;

/* The largest CUDA index accepted by the parser; far above any machine,
 * low enough that the digits cannot overflow an int. */
#define MAX_CUDA_INDEX 9999

/* Parses spec into *kind and, for cuda, *index. PS_EINVAL with a message
 * when it is none of the forms of device.h. */
static int parse_spec(const char *spec, device_kind *kind, int *index, char *err) {
  *index = 0;
  if (!spec || strcmp(spec, "auto") == 0) {
    *kind = DEVICE_AUTO;
    return 0;
  }
  if (strcmp(spec, "cpu") == 0) {
    *kind = DEVICE_CPU;
    return 0;
  }
  if (strcmp(spec, "cpu-ref") == 0) {
    *kind = DEVICE_CPU_REF;
    return 0;
  }
  if (strcmp(spec, "emu") == 0) {
    *kind = DEVICE_EMU;
    return 0;
  }
  *kind = DEVICE_CUDA;
  if (strcmp(spec, "cuda") == 0) return 0;
  if (strncmp(spec, "cuda:", 5) == 0 && spec[5] != '\0') {
    int v = 0;
    const char *p = spec + 5;
    for (; *p >= '0' && *p <= '9' && v <= MAX_CUDA_INDEX; p++) v = v * 10 + (*p - '0');
    if (*p == '\0' && v <= MAX_CUDA_INDEX) {
      *index = v;
      return 0;
    }
  }
  return ps_seterr(err, PS_EINVAL,
                   "bad device '%s': expected auto, cpu, cpu-ref, cuda, cuda:N or emu", spec);
}

static void set_desc(char *desc, size_t desc_len, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static void set_desc(char *desc, size_t desc_len, const char *fmt, ...) {
  if (!desc || desc_len == 0) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(desc, desc_len, fmt, ap);
  va_end(ap);
}

/* The reference cpu backend (im2col + OpenBLAS, its own threads), described
 * as `name`; `note` (may be "") is appended inside the parentheses of the
 * description. */
static ps_ops *open_cpu_ref(const char *name, int threads, const char *note, char *desc,
                            size_t desc_len, char *err) {
  ps_ops *ops = ps_ops_cpu_create(threads);
  if (!ops) {
    ps_seterr(err, PS_ENOMEM, "cannot create the cpu backend with %d threads: out of memory or "
              "threads", threads);
    return NULL;
  }
  if (threads > 0)
    set_desc(desc, desc_len, "%s (%d thread%s%s)", name, threads, threads > 1 ? "s" : "", note);
  else
    set_desc(desc, desc_len, "%s (OpenBLAS default threads%s)", name, note);
  return ops;
}

/* The cpu backend: oneDNN's when the build has it, else the reference. */
static ps_ops *open_cpu(int threads, const char *note, char *desc, size_t desc_len, char *err) {
#ifdef PS_HAVE_DNNL
  ps_ops *ops = ps_ops_dnnl_create(threads);
  if (!ops) {
    ps_seterr(err, PS_ENOMEM, "cannot create the oneDNN cpu backend with %d threads: out of "
              "memory, or oneDNN has no CPU engine", threads);
    return NULL;
  }
  char version[32];
  ps_dnnl_version(version, sizeof version);
  if (threads > 0)
    set_desc(desc, desc_len, "cpu (%d thread%s, oneDNN %s%s)", threads, threads > 1 ? "s" : "",
             version, note);
  else
    set_desc(desc, desc_len, "cpu (OpenMP default threads, oneDNN %s%s)", version, note);
  return ops;
#else
  return open_cpu_ref("cpu", threads, note, desc, desc_len, err);
#endif
}

#ifdef PS_WITH_CUDA
/* CUDA device `index`, which the caller has seen to exist. */
static ps_ops *open_cuda(int index, char *desc, size_t desc_len, char *err) {
  ps_ops *ops = ps_ops_cuda_create(index, err);
  if (!ops) return NULL;
  char name[128];
  size_t bytes = 0;
  if (ps_cuda_device_name(index, name, sizeof name, &bytes) != 0) snprintf(name, sizeof name, "?");
  set_desc(desc, desc_len, "cuda:%d (%s, %.0f GiB)", index, name,
           (double)bytes / (1024.0 * 1024.0 * 1024.0));
  return ops;
}
#endif

ps_ops *ps_device_open(const char *spec, int cpu_threads, char *desc, size_t desc_len, char *err) {
  device_kind kind;
  int index;
  if (desc && desc_len) desc[0] = '\0';
  if (parse_spec(spec, &kind, &index, err) != 0) return NULL;
  if (kind == DEVICE_CPU) return open_cpu(cpu_threads, "", desc, desc_len, err);
  if (kind == DEVICE_CPU_REF) return open_cpu_ref("cpu-ref", cpu_threads, "", desc, desc_len, err);
  if (kind == DEVICE_EMU) {
    ps_ops *ops = ps_ops_emu_create(cpu_threads);
    if (!ops)
      ps_seterr(err, PS_ENOMEM, "cannot create the emulated device: out of memory or threads");
    else
      set_desc(desc, desc_len, "emu (cpu ops on emulated device memory, %d thread%s)",
               cpu_threads > 1 ? cpu_threads : 1, cpu_threads > 1 ? "s" : "");
    return ops;
  }
#ifdef PS_WITH_CUDA
  char why[128] = "";
  const int count = ps_cuda_device_count(why);
  if (count == 0 && strcmp(why, "no CUDA device") == 0)
    snprintf(why, sizeof why, "none visible (see CUDA_VISIBLE_DEVICES)");
  if (kind == DEVICE_AUTO) {
    char note[PS_ERRLEN + 32];
    if (count == 0) {
      snprintf(note, sizeof note, "; no CUDA device: %s", why);
      return open_cpu(cpu_threads, note, desc, desc_len, err);
    }
    /* A device that is there but cannot be opened (no cuDNN, no memory):
     * compute on the cpu, and say why in the description. */
    char cuda_err[PS_ERRLEN] = "";
    ps_ops *ops = open_cuda(0, desc, desc_len, cuda_err);
    if (ops) return ops;
    snprintf(note, sizeof note, "; cuda:0 unusable: %s", cuda_err);
    return open_cpu(cpu_threads, note, desc, desc_len, err);
  }
  if (count == 0) {
    ps_seterr(err, PS_EUNAVAIL, "no CUDA device: %s", why);
    return NULL;
  }
  if (index >= count) {
    ps_seterr(err, PS_ERANGE, "cuda:%d but only %d device%s", index, count, count > 1 ? "s" : "");
    return NULL;
  }
  return open_cuda(index, desc, desc_len, err);
#else
  if (kind == DEVICE_AUTO) return open_cpu(cpu_threads, "", desc, desc_len, err);
  ps_seterr(err, PS_EUNAVAIL, "this ps-worker was built without CUDA (WITH_CUDA=OFF)");
  return NULL;
#endif
}
