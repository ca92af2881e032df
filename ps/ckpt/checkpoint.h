/* Shard checkpoints: one file per shard and version, written atomically,
 * verified completely when read, and restorable onto any number of shards;
 * and the export of a whole model as NumPy .npy files (ps-export).
 *
 * File name: <dir>/shard-<index>-of-<S>-v<version>.ckpt, or for a set's file
 * <dir>/shard-<index>-of-<S>-v<version>-s<set id>.ckpt
 *
 * Sets. The files the shards write at one cut (ps/ckpt/cut.c: shard 0 picks
 * the point, every shard writes its state there) carry the same set id;
 * every file also carries its cut record, what its shard had applied (the
 * same bytes on every shard of a consistent group). A restore takes the
 * newest consistent group: the files of one set id, one per shard, or the
 * newest file of each shard when their cut records are equal (the final
 * checkpoints of a stop after the workers left). Only when no consistent
 * group can fill the range are files of different moments combined, with
 * a warning.
 *
 * Layout (format version 3; integers little-endian, floats IEEE float32
 * little-endian; n = end - begin; E = extra_len; C = cut_len; R =
 * tables_len; T = total bytes). A file without embedding rows (R = 0) is
 * written as format 2, which is format 3 with R = 0 and zeros at 68 and
 * 180, so that builds from before tables still read it; format 1 is
 * format 2 with set id 0 and C = 0. All three are read.
 *
 *   offset      bytes   field
 *   0           8       magic "PSCKPT\0\1"
 *   8           4       u32 format version (1)
 *   12          4       u32 header bytes (192)
 *   16          4       i32 shard index
 *   20          4       i32 number of shards S
 *   24          8       u64 P, the model's parameter count
 *   32          8       u64 begin  } the flat range [begin, end) of the
 *   40          8       u64 end    } parameter vector held here
 *   48          8       u64 shard version (updates applied)
 *   56          8       i64 written at, Unix time in milliseconds
 *   64          4       u32 number of optimizer slots K (<= PS_CKPT_MAX_SLOTS)
 *   68          4       u32 CRC-32C of the tables section (0 when R = 0)
 *   72          8       u64 E, length of the extra blob
 *   80          16      optimizer name, NUL-padded (at most 15 characters)
 *   96          64      job id, NUL-padded (at most 63 characters)
 *   160         8       u64 set id (0: written alone, e.g. at a stop)
 *   168         8       u64 C, length of the cut record
 *   176         4       u32 CRC-32C of the cut record (0 when C = 0)
 *   180         8       u64 R, length of the tables section (format 3)
 *   188         4       u32 CRC-32C of bytes [0, 188): the header alone
 *   192         E       extra blob (opaque; shard 0 keeps its data leases here)
 *   192+E       C       cut record (opaque here; compared byte for byte)
 *   192+E+C     4n      parameters [begin, end)
 *   192+E+C+4n  4n*K    slot 0, slot 1, ... (each n values)
 *   T-4-R       R       tables section: the shard's embedding rows (below)
 *   T-4         4       u32 CRC-32C of bytes [0, T-4): everything before it
 *   T = 192 + E + C + 4n(1 + K) + R + 4
 *
 * The header has a checksum of its own so that a damaged size field is
 * reported as damage, not as a truncated file, before any size in it is
 * trusted; the tables section has one too (at 68), so that damage there
 * is reported as damaged rows.
 *
 * Tables section (the rows the shard holds of each table: every row pushed
 * at least once, taken with the dense values under the lock pushes take,
 * so of the same version; rows never pushed are not stored, they read as
 * their initial values):
 *
 *   0    4   magic "PSTB"
 *   4    4   u32 section version (1)
 *   8    4   u32 number of tables NT (<= PS_MAX_TABLES)
 *   12   4   u32 reserved, 0
 *   then NT times: a 72-byte table header
 *     0    32  table name, NUL-padded
 *     32   16  its optimizer's name, NUL-padded
 *     48   8   u64 rows (0: unbounded ids)
 *     56   4   u32 dim (1..PS_TABLE_MAX_DIM)
 *     60   4   u32 optimizer slots K (<= PS_CKPT_MAX_SLOTS)
 *     64   8   u64 n, rows in this file
 *   followed by n records of 12 + 4 dim (1 + K) bytes: u64 id, u32 the
 *   row's update count t, then dim values, then each slot's dim values.
 *
 * Nothing here keeps state between calls: every function may be called from
 * any thread, on different directories or files. Functions return 0 or a
 * negative PS_E* code (common/util.h) with a message in err (NULL or
 * PS_ERRLEN bytes). */
#ifndef PS_PS_CHECKPOINT_H
#define PS_PS_CHECKPOINT_H

#include <stddef.h>
#include <stdint.h>

#include "common/emb.h"
#include "common/model_spec.h"
#include "common/util.h"

#define PS_CKPT_FORMAT_VERSION 3
#define PS_CKPT_HEADER_BYTES 192
#define PS_CKPT_MAX_SLOTS 8
/* The largest cut record a file may carry. */
#define PS_CKPT_MAX_CUT ((size_t)1 << 20)
/* Size of the path buffers (path_out, used_path). */
#define PS_CKPT_PATHLEN 4096

typedef struct {
  int index, num_shards; /* shard index of S */
  size_t P;              /* model size */
  size_t begin, end;     /* range held: [begin, end) */
  uint64_t version;      /* updates applied to the shard */
  int64_t written_ms;    /* Unix ms; set by ps_ckpt_write, ignored on input */
  char optimizer[16];    /* "adam", ... */
  char job_id[64];
  uint64_t set_id;       /* the cut it was written at; 0: written alone */
  size_t cut_len;        /* its cut record: set by the reader (ps_ckpt.cut_len on write) */
  uint32_t cut_crc;      /* ... and its CRC-32C; set by the reader */
  int format;            /* the file's format version; set by the reader */
  size_t tables_len;     /* its tables section: set by the reader (ps_ckpt.tables_len on write) */
  uint32_t tables_crc;   /* ... and its CRC-32C; set by the reader */
} ps_ckpt_meta;

/* One shard's state. On write the pointers are borrowed from the caller; on
 * read they are allocated and released by ps_ckpt_free. */
typedef struct {
  ps_ckpt_meta meta;
  float *params;                   /* (end - begin) */
  float *slots[PS_CKPT_MAX_SLOTS]; /* n_slots arrays of (end - begin) */
  int n_slots;
  void *extra; /* extra_len opaque bytes; NULL when extra_len is 0 */
  size_t extra_len;
  void *cut; /* cut_len bytes (<= PS_CKPT_MAX_CUT); NULL when cut_len is 0 */
  size_t cut_len;
  /* The tables section (ps_ckpt_tables_*), tables_len bytes; NULL when 0
   * (no embedding rows: a format 2 file). Checked when read. */
  void *tables;
  size_t tables_len;
} ps_ckpt;

/* Releases what ps_ckpt_read (or find_latest) allocated and zeroes *c.
 * Safe on a zeroed or already freed struct. */
void ps_ckpt_free(ps_ckpt *c);

/* Writes ck as dir/shard-<index>-of-<S>-v<version>.ckpt: into a temporary
 * file in dir, fsync, rename over the final name, fsync dir. Then deletes
 * older checkpoints of the same shard (same index, same S, same job id, a
 * lower version) so that the newest `keep` remain, this one included;
 * keep = 0 deletes nothing. Files of a higher version than this one (left
 * by an earlier run) are not touched; a failed deletion is logged, not
 * returned. The path written goes to path_out (NULL or PS_CKPT_PATHLEN
 * bytes). The write time stored is the clock's now (ck->meta.written_ms is
 * ignored).
 * With a tables section (ck->tables_len > 0) the file is format 3, else
 * format 2 (readable by builds from before tables).
 * Errors: PS_EINVAL (inconsistent meta: index >= S, begin > end > P, names
 * too long, n_slots out of range, NULL arrays), PS_EIO (any system call),
 * with nothing changed in dir: no temporary file is left and the earlier
 * checkpoints are as they were. (If only the final fsync of the directory
 * fails, the new file is in place but may not survive a crash.) */
int ps_ckpt_write(const char *dir, const ps_ckpt *ck, int keep, char *path_out, char *err);

/* Deletes the files of shard `index` of `num_shards` of job_id in dir that
 * belong to no set worth keeping, once shard 0 knows which sets are
 * complete: the set files (set id != 0) whose set is not in keep_sets
 * (n_keep ids), not `current` (the one just written) and older than the
 * newest kept set (a newer one may have completed since shard 0 named
 * them), and the files
 * written alone (set id 0) before the newest file of a kept set. With
 * drop_other_s, also every file of the job written with another number of
 * shards (any index): from before a reshard, once enough complete sets of
 * the new layout exist. Nothing is deleted when n_keep is 0. Files whose
 * header cannot be read are left alone. *deleted (may be NULL) counts the
 * files deleted. Returns 0; PS_EINVAL (bad arguments), PS_EIO (dir cannot
 * be listed). A file that cannot be deleted is logged and skipped. */
int ps_ckpt_prune_sets(const char *dir, int index, int num_shards, const char *job_id,
                       const uint64_t *keep_sets, int n_keep, uint64_t current, int drop_other_s,
                       int *deleted, char *err);

/* Deletes the files of shard `index` of `num_shards` of job_id in dir
 * whose set is in drop (n_drop ids: sets shard 0 knows no shard will
 * complete, CheckpointRequest.abandoned_sets), except those of a set in
 * keep_sets (n_keep ids), of `current` (the set being written) and of a
 * set every shard of the layout has a file of in dir now (complete after
 * all: *whole, may be NULL, counts them). Whatever their age: unlike
 * ps_ckpt_prune_sets, a set newer than the kept ones goes too. Files
 * written alone, other shards', other layouts', other jobs' and unreadable
 * ones are left. *deleted (may be NULL) counts the files deleted. Returns
 * 0 (also when dir does not exist); PS_EINVAL (bad arguments), PS_EIO (dir
 * cannot be listed), PS_ENOMEM. A file that cannot be deleted is logged
 * and skipped. */
int ps_ckpt_drop_sets(const char *dir, int index, int num_shards, const char *job_id,
                      const uint64_t *drop, int n_drop, const uint64_t *keep_sets, int n_keep,
                      uint64_t current, int *deleted, int *whole, char *err);

/* Shard 0 (ps/ckpt/cut.c): the sets its next CUT names for the shards to
 * delete (CheckpointRequest.abandoned_sets; ps_ckpt_drop_sets), from the
 * PREPARE answers of its S shards: on_disk[s] (n_on_disk[s] ids) are the
 * sets shard s has a file of. A set some shards have and others lack when
 * every shard accepted the PREPARE is incomplete and stays so: no shard's
 * primary is writing then, none takes an older set's CUT any more, and a
 * replica deposed since it prepared a set writes none. Every such set is
 * named, whichever coordinator cut it and however new, but never a set of
 * complete (n_complete ids: the sets known complete; one some shard lacks
 * now was pruned there, as the CUT's kept sets say). At most max ids go
 * to drop; returns how many. */
int ps_ckpt_sets_to_drop(const uint64_t *const *on_disk, const size_t *n_on_disk, int S,
                         const uint64_t *complete, int n_complete, uint64_t *drop, int max);

/* The sets of which shard `index` of `num_shards` of job_id has a file in
 * dir: their ids, newest first, at most max of them, into sets (*n: how
 * many). Files written alone (set id 0) and files whose header cannot be
 * read are not counted. A missing dir has none. Returns 0; PS_EINVAL (bad
 * arguments), PS_EIO (dir cannot be listed), PS_ENOMEM. */
int ps_ckpt_list_sets(const char *dir, int index, int num_shards, const char *job_id,
                      uint64_t *sets, int max, int *n, char *err);

/* Removes the temporary files that writers of shard `index` of
 * `num_shards` left in dir when they died in the middle of a write
 * (SIGKILL, a crash, a power cut before the rename): files named
 * ".shard-<index>-of-<S>-v<V>.ckpt.tmp-<pid>-<nonce>" by ps_ckpt_write,
 * whose writer is gone. Left alone: a file whose lock is held (a writer
 * holds one on its temporary file until it is renamed or removed), whose
 * pid is a live process other than the caller's, whose complete header
 * names another job than job_id, and every file of another shard or
 * another S, and anything not named so. Call it at start, before this
 * shard writes (a write of the caller's in flight keeps its lock, so it is
 * safe then too). Each file removed is logged (INFO); one that cannot be
 * removed is logged (WARN) and skipped. *removed (may be NULL) counts the
 * files removed. Returns 0, also when dir does not exist; PS_EINVAL
 * (index not below num_shards, NULL dir or job), PS_EIO (dir cannot be
 * listed), with nothing removed. */
int ps_ckpt_remove_stale_temps(const char *dir, int index, int num_shards, const char *job_id,
                               int *removed, char *err);

/* Reads path completely and verifies it: magic, header checksum, format
 * version, field consistency, sizes against the file's length, the tables
 * section's checksum, checksum of the whole, then the tables section's
 * contents (ps_ckpt_tables_parse). On success *out owns the arrays
 * (ps_ckpt_free). On error *out is zeroed, and the message names the file,
 * the problem and a hint: PS_EPROTO (bad magic, unknown format version),
 * PS_EINVAL (checksum mismatch, "its embedding rows are corrupt",
 * inconsistent header, length differs, a malformed tables section),
 * PS_EIO, PS_ENOMEM. */
int ps_ckpt_read(const char *path, ps_ckpt *out, char *err);

/* Reads and verifies only the header (192 bytes) and checks the sizes
 * against the file's length; the body is not read, so its checksum is not
 * verified. For listing. *extra_len and *n_slots may be NULL. */
int ps_ckpt_read_header(const char *path, ps_ckpt_meta *meta, int *n_slots, size_t *extra_len,
                        char *err);

/* Notes from the search functions: a checkpoint skipped and why (WARN), or
 * which files were used (INFO). level is PS_LOG_INFO or PS_LOG_WARN. */
typedef void (*ps_ckpt_note_fn)(int level, const char *msg, void *user);

/* Where to look and what to accept. */
typedef struct {
  const char *dir;
  const char *job_id;    /* checkpoints of other jobs are skipped */
  size_t P;              /* and those of another model size */
  const char *optimizer; /* NULL: any; else others are skipped */
  ps_ckpt_note_fn note;  /* NULL: notes go to ps_log */
  void *note_user;
  int want_tables;       /* ps_ckpt_load_range also hands back the tables section of
                          * every shard's file of the group used (ps_ckpt_restored.parts) */
} ps_ckpt_source;

/* The newest valid checkpoint of shard `index` of `num_shards` in src->dir:
 * candidates by version from the file name, newest first (equal versions:
 * newest mtime first); each one that is corrupt or belongs to another job,
 * another P, another optimizer, or whose header names another shard, is
 * skipped with a WARN note, and the next older one is tried. The one used
 * is named in a note (INFO; WARN when newer ones were skipped) and in
 * used_path (NULL or PS_CKPT_PATHLEN bytes). *out owns its arrays (ps_ckpt_free).
 * Errors: PS_ENOTFOUND when dir (missing: also PS_ENOTFOUND) holds no
 * checkpoint file of that shard, or only other jobs' ones: a fresh start;
 * PS_EINVAL when there are some that may be this job's but none is usable
 * (corrupt, other P, other optimizer; the message counts them and gives the
 * last reason): the caller should not silently start afresh; PS_EIO,
 * PS_ENOMEM. */
int ps_ckpt_find_latest(const ps_ckpt_source *src, int index, int num_shards, ps_ckpt *out,
                        char *used_path, char *err);

/* What ps_ckpt_load_range restored. */
typedef struct {
  uint64_t version; /* the maximum version of the files read (0 if none) */
  int num_shards;   /* S' of the set of checkpoints used */
  int files_used;
  void *extra; /* with want_extra: a copy of the set's shard 0 extra blob
                  (malloc'd, caller frees; NULL if it was empty) */
  size_t extra_len;
  uint64_t set_id; /* the set restored (0: files written alone) */
  int consistent;  /* 1: one consistent group (a set, or equal cut records);
                      0: files of different moments combined */
  void *cut;       /* a copy of the cut record of the first file used (malloc'd,
                      caller frees; NULL if it had none) */
  size_t cut_len;
  /* With src->want_tables: one part per shard of the group (num_shards of
   * them, by index), each that file's tables section (moved out of it;
   * NULL when the file holds none). Freed by ps_ckpt_restored_free. */
  struct ps_ckpt_part *parts;
  int n_parts;
} ps_ckpt_restored;

typedef struct ps_ckpt_part {
  char path[PS_CKPT_PATHLEN];
  int index, num_shards; /* the shard that wrote it */
  uint64_t version;
  void *tables;
  size_t tables_len;
} ps_ckpt_part;

/* Frees what ps_ckpt_load_range handed back (extra, cut, parts) and zeroes
 * *r. Safe on a zeroed struct. */
void ps_ckpt_restored_free(ps_ckpt_restored *r);

/* Fills params[0 .. end-begin) (and slots[k][0 .. end-begin) for k <
 * n_slots; n_slots 0 and slots NULL for the parameters only) with the
 * global range [begin, end) from the checkpoints in src->dir, whatever the
 * number of shards S' they were written with (resharding).
 *
 * Groups, tried in this order until one can fill the range:
 *  1. consistent groups, the most recent first (a group's time is the
 *     oldest write time among its files): the files of one set id, one for
 *     each of the S' shards; and, for each S', the newest file of every
 *     shard when all S' carry equal cut records;
 *  2. then, with a WARN note that moments may differ, the files grouped by
 *     S' as shards wrote them on their own: complete groups (a file for
 *     every shard) first, the most recent first; for each shard the newest
 *     valid file, falling back to older versions of that shard.
 * A group is usable when each of its shards that overlaps [begin, end)
 * (and shard 0, with want_extra; every shard, with src->want_tables: the
 * rows of a table may be on any of them) has a valid file in it. When n_slots > 0,
 * a checkpoint must hold exactly n_slots slots. The files used are named
 * in INFO notes.
 *
 * Version: each shard counts its own updates, so versions of different
 * shards are not comparable; the maximum is returned so that a version
 * never goes backwards for any value restored.
 *
 * Errors: PS_ENOTFOUND when dir does not exist or holds no checkpoint, or
 * only other jobs' ones (a fresh start); PS_EINVAL when there are some that
 * may be this job's but none fits (corrupt headers, other P, other
 * optimizer or slot count), or when none of the sets can fill the range
 * (the message says why for the last one tried); PS_EIO, PS_ENOMEM. On error the contents of
 * params and slots are unspecified and out->extra is NULL. */
int ps_ckpt_load_range(const ps_ckpt_source *src, size_t begin, size_t end, float *params,
                       float *const *slots, int n_slots, int want_extra, ps_ckpt_restored *out,
                       char *err);

/* ---------------------------------------------------------------- tables */

/* One table of a tables section, as parsed (pointing into the section). */
typedef struct {
  char name[32];
  char optimizer[16];
  uint64_t rows; /* 0: unbounded ids */
  int dim, n_slots;
  uint64_t n;          /* rows held in this file */
  size_t rec_bytes;    /* 12 + 4 * dim * (1 + n_slots) */
  const uint8_t *recs; /* n records */
} ps_ckpt_table;

/* Checks a tables section (len bytes) completely: magic, version, table
 * headers (names valid and distinct, dim and slots in range), sizes
 * adding up to len exactly, and every record's id valid for its table
 * (below rows) and every value finite. On success fills out[0 .. *n) (room
 * for PS_MAX_TABLES). PS_EINVAL with a message that names `what` (the
 * file) and the table or row. */
int ps_ckpt_tables_parse(const void *sec, size_t len, const char *what, ps_ckpt_table *out,
                         int *n, char *err);

/* Record r of a parsed table: returns its id, writes its count and its
 * dim * (1 + n_slots) floats into rec. */
uint64_t ps_ckpt_table_row(const ps_ckpt_table *t, uint64_t r, uint32_t *count, float *rec);

/* Builds a tables section: begin, then for each table add_table followed
 * by its rows (add_row), then finish, which hands the section over
 * (malloc'd). rows_hint: the number of rows expected over all tables
 * (memory reserved at once; more are taken too). PS_ENOMEM, PS_EINVAL
 * (a bad table, or a row before any table); after an error, finish
 * returns it, and the builder holds nothing after finish. */
typedef struct {
  uint8_t *buf;
  size_t len, cap;
  size_t head;     /* offset of the current table's header */
  uint64_t n;      /* rows of the current table */
  size_t rec_bytes;
  int n_tables, failed;
  char err[PS_ERRLEN];
} ps_ckpt_tables_builder;
void ps_ckpt_tables_begin(ps_ckpt_tables_builder *b, size_t bytes_hint);
int ps_ckpt_tables_add_table(ps_ckpt_tables_builder *b, const char *name, const char *optimizer,
                             uint64_t rows, int dim, int n_slots);
int ps_ckpt_tables_add_row(ps_ckpt_tables_builder *b, uint64_t id, uint32_t count,
                           const float *rec);
int ps_ckpt_tables_finish(ps_ckpt_tables_builder *b, void **out, size_t *len, char *err);

/* ---------------------------------------------------------------- export */

/* Writes a NumPy .npy file (format 1.0, '<f4', C order) of the values
 * data[0 .. prod(shape)) with shape[0 .. ndim) (ndim 0..8): through a
 * temporary file, fsynced and renamed into place. The header is padded
 * with spaces and ends with '\n' so that magic + header is a multiple of 64
 * bytes. PS_EINVAL, PS_EIO. */
int ps_npy_write(const char *path, const float *data, const size_t *shape, int ndim, char *err);
/* The same for uint64 values ('<u8'). */
int ps_npy_write_u64(const char *path, const uint64_t *data, const size_t *shape, int ndim,
                     char *err);

/* Writes one .npy file per parameter tensor of the model into out_dir
 * (created if missing; its parent must exist): "<layer>.w.npy" with shape
 * (OC, IC, KH, KW) for conv2d and (OUT, IN) for dense, "<layer>.b.npy"
 * with shape (OC) or (OUT) (none for a layer without bias); for batchnorm
 * "<layer>.gamma.npy", ".beta.npy", ".moving_mean.npy" and
 * ".moving_variance.npy", each (C). params holds the whole vector [0, P). The
 * directory is fsynced at the end. *files_written (may be NULL) counts the
 * files written. PS_EINVAL, PS_EIO. */
int ps_ckpt_export_npy(const ps_model_spec *spec, const float *params, const char *out_dir,
                       int *files_written, char *err);

#endif
