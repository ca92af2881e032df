/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of
 * iSCSI, ext4 and Btrfs: checkpoints end with one.
 *
 * Computed with the SSE4.2 crc32 instruction where the CPU has it, else
 * with tables (slicing by 8); both give the same value. */
#ifndef PS_COMMON_CRC32C_H
#define PS_COMMON_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* Extends `crc` (0 to start) over len bytes at buf, which may sit at any
 * address: ps_crc32c(ps_crc32c(0, a, n), b, m) equals the CRC of a
 * followed by b. ps_crc32c(0, "123456789", 9) == 0xE3069283. Thread-safe. */
uint32_t ps_crc32c(uint32_t crc, const void *buf, size_t len);

/* The table version alone, whatever the CPU: for tests that compare the
 * two. */
uint32_t ps_crc32c_sw(uint32_t crc, const void *buf, size_t len);

#endif
