/* Small shared helpers: error codes, time, logging, allocation. */
#ifndef PS_COMMON_UTIL_H
#define PS_COMMON_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the wire format is little-endian float32; big-endian hosts are not supported"
#endif

/* Functions return 0 or one of these negative codes. Where a function takes
 * `char *err`, it is either NULL or a buffer of PS_ERRLEN bytes that receives
 * a message saying what went wrong. */
enum {
  PS_OK = 0,
  PS_EINVAL = -1,    /* bad argument or malformed input */
  PS_ENOMEM = -2,    /* allocation failed */
  PS_EIO = -3,       /* file or system call failed */
  PS_ERANGE = -4,    /* offset/count/shape out of range */
  PS_ENOTFOUND = -5, /* unknown worker, method, key */
  PS_EPROTO = -6,    /* protocol or version mismatch */
  PS_ESTATE = -7,    /* operation not valid in the current state */
  PS_ETIMEDOUT = -8, /* deadline passed */
  PS_EUNAVAIL = -9,  /* peer unreachable */
};
#define PS_ERRLEN 256

const char *ps_strerror(int code);

/* Writes a formatted message to err (if not NULL) and returns code. */
int ps_seterr(char *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Monotonic clock in milliseconds / seconds; wall clock in seconds. */
int64_t ps_now_ms(void);
double ps_now_s(void);
double ps_wall_s(void);
/* CPU seconds (user and system) this process has used. */
double ps_cpu_s(void);
void ps_sleep_ms(int64_t ms);

/* Keeps freed memory for reuse instead of handing it back to the kernel
 * at once (glibc's malloc: trim threshold 128 MiB, allocations up to
 * 32 MiB from the heap). Each message gRPC receives lands in buffers it
 * allocates and frees; with glibc's defaults those pages went back to the
 * kernel and every push faulted in fresh, zeroed ones. Call first in main;
 * a GLIBC_TUNABLES that sets either threshold is left to rule. */
void ps_malloc_tune(void);

/* 64-byte aligned allocation, zeroed; NULL on failure. Free with ps_free. */
void *ps_alloc(size_t bytes);
void ps_free(void *p);

/* Reads a whole file into a NUL-terminated buffer (malloc'd). */
int ps_read_file(const char *path, char **out, size_t *len, char *err);

/* Parses "host:port"; writes host (at most hostlen-1 chars) and port. */
int ps_parse_hostport(const char *s, char *host, size_t hostlen, int *port);
/* "[v6]" as a host becomes "v6", as getaddrinfo wants it (in place). */
void ps_host_unbracket(char *host);

/* UTF-8 (RFC 3629: no overlong forms, no surrogates, nothing above
 * U+10FFFF). ps_utf8_char_len: the length (1 to 4) of the character that
 * starts s (n bytes available, n > 0), or 0 when s does not start a valid
 * one. ps_utf8_valid_len: how many leading bytes of s[0..n) are valid UTF-8
 * (n when all are). Neither treats NUL specially. */
size_t ps_utf8_char_len(const uint8_t *s, size_t n);
size_t ps_utf8_valid_len(const void *s, size_t n);

/* Copies the NUL-terminated src into dst (cap bytes, cap > 0) as text that is
 * safe to store, show and send in a protobuf `string`: each byte that is not
 * part of valid UTF-8 and each control character (C0, DEL, C1) becomes
 * U+FFFD, and the copy is cut on a character boundary so that it fits with
 * its NUL. Returns the bytes written, the NUL not counted. src NULL is "". */
size_t ps_utf8_sanitize(char *dst, size_t cap, const char *src);

/* Logging to stderr with a timestamp and the program name. The formatted
 * message is escaped so that it stays on its one line whatever it holds:
 * newline, CR, tab, ESC and every other control character (C0, DEL, C1) and
 * every byte that is not valid UTF-8 are written as \n, \r, \t or \xNN (one
 * per byte), so that no caller can forge a line or drive the terminal. */
enum { PS_LOG_DEBUG = 0, PS_LOG_INFO = 1, PS_LOG_WARN = 2, PS_LOG_ERROR = 3 };
void ps_log_init(const char *prog, int level);
/* "debug", "info", "warn" or "error" as a PS_LOG_* level; -1 otherwise. */
int ps_log_level_parse(const char *name);
void ps_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
#define PS_DEBUG(...) ps_log(PS_LOG_DEBUG, __VA_ARGS__)
#define PS_INFO(...) ps_log(PS_LOG_INFO, __VA_ARGS__)
#define PS_WARN(...) ps_log(PS_LOG_WARN, __VA_ARGS__)
#define PS_ERROR(...) ps_log(PS_LOG_ERROR, __VA_ARGS__)

/* A read-only view of bytes scattered over several segments (gRPC slices). */
typedef struct {
  const uint8_t *ptr;
  size_t len;
} ps_seg;

typedef struct {
  const ps_seg *segs;
  int nsegs;
  size_t total; /* sum of segs[i].len */
} ps_segview;

/* 64-bit mixers (bijective: xor-shifts and odd multipliers). splitmix64's
 * finalizer drives the counter-based random numbers and the tables'
 * placement; MurmurHash3's fmix64 spreads keys over hash-table slots (ids
 * that differ only in their high bits, multiples of a power of two). */
static inline uint64_t ps_splitmix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
static inline uint64_t ps_fmix64(uint64_t z) {
  z ^= z >> 33;
  z *= 0xff51afd7ed558ccdULL;
  z ^= z >> 33;
  z *= 0xc4ceb9fe1a85ec53ULL;
  return z ^ (z >> 33);
}

/* Little-endian integers in byte buffers: the files' and blobs' layouts
 * (checkpoints, lease tables, cut records), and the row ids of requests.
 * On a little-endian CPU one unaligned load or store each (GCC left the
 * byte loops as loops: a request's 10,000 ids took 75 us to read). */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
static inline void ps_put_le32(uint8_t *p, uint32_t v) { memcpy(p, &v, sizeof v); }
static inline void ps_put_le64(uint8_t *p, uint64_t v) { memcpy(p, &v, sizeof v); }
static inline uint32_t ps_get_le32(const uint8_t *p) {
  uint32_t v;
  memcpy(&v, p, sizeof v);
  return v;
}
static inline uint64_t ps_get_le64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return v;
}
#else
static inline void ps_put_le32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void ps_put_le64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint32_t ps_get_le32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) v |= (uint32_t)p[i] << (8 * i);
  return v;
}
static inline uint64_t ps_get_le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}
#endif

/* Copies `len` bytes starting at byte `pos` of the view into dst.
 * Returns PS_ERANGE (dst untouched) if pos+len exceeds the view. */
int ps_segview_copy(const ps_segview *v, size_t pos, void *dst, size_t len);

/* A float that may sit at any address: gRPC's slices put tensor bytes
 * wherever the stream put them, and reading them in place (x86 loads do
 * not care) saves a copy; the type tells the compiler so. */
typedef float ps_ufloat __attribute__((aligned(1)));

/* Calls fn(values, n, first_index, user) over the view read as float32
 * values, in order, in pieces of contiguous floats read in place, at any
 * alignment (a value that straddles two segments is staged through a small
 * buffer). Stops and returns fn's value when it is non-zero.
 * The view's total must be a multiple of 4. */
typedef int (*ps_float_fn)(const ps_ufloat *values, size_t n, size_t first, void *user);
int ps_segview_each_float(const ps_segview *v, ps_float_fn fn, void *user);
/* The same over the floats [first, first+count) of the view only (first is
 * the index passed to fn for the first of them). PS_ERANGE if the view
 * holds fewer floats. */
/* Calls fn on the elements [first, first+count) of esz bytes each (1..8) in
 * order, in runs that lie within one segment (unaligned pointers), an element
 * split across segments staged in an aligned copy. */
typedef int (*ps_elem_fn)(const void *values, size_t n, size_t first, void *user);
int ps_segview_each_elem_range(const ps_segview *v, size_t esz, size_t first, size_t count,
                               ps_elem_fn fn, void *user);
int ps_segview_each_float_range(const ps_segview *v, size_t first, size_t count, ps_float_fn fn,
                                void *user);

#endif
