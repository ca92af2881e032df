/* JSON Lines metrics file: one object per line, flushed per record. */
#ifndef PS_COMMON_METRICS_H
#define PS_COMMON_METRICS_H

typedef struct ps_metrics ps_metrics;

/* Opens (appends to) path. NULL with a message in err on failure. */
ps_metrics *ps_metrics_open(const char *path, char *err);
/* Writes one record; `record` is a jansson json_t* object, to which a
 * "time" field (Unix seconds) is added when absent. Thread-safe. */
int ps_metrics_write(ps_metrics *m, void *record);
void ps_metrics_close(ps_metrics *m);

#endif
