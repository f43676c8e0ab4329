/* state_input.h: the layout of a fuzz_state input and the framing of
 * --state-dir records, shared by the target and its seed corpus generator.
 *
 * An input is four header bytes, then the files of a state directory:
 *
 *   byte 0  SF_SNAPSHOT  a file "snapshot" comes first
 *           bits 1-2     how many journals follow it (0-3), named
 *                        journal.<byte 3>, journal.<byte 3 + 1>, ...
 *           SF_ORPHANS   an unnamed segment "<prefix>orphan" exists for each
 *                        prefix the records name: the load must unlink it
 *           SF_LOCKED    another process holds the directory's lock: the
 *                        load must fail with TD_EBUSY and touch nothing
 *           SF_SEAL      the harness rewrites the CRC of every record whose
 *                        length fits its file, so that mutated payloads
 *                        pass the CRC check and reach the parser
 *   byte 1  bit i set: the i-th distinct segment the records' puts name
 *           (i < 8) does not exist
 *   byte 2  bit i set: it exists with the wrong size
 *   byte 3  the generation of the first journal
 * Then each file but the last is a little-endian u16 length and that many
 * bytes; the last file takes the rest (fewer files if the input ends).
 *
 * A file is a sequence of records: a little-endian u32 payload length, a
 * u32 CRC-32C of the payload, and the payload, a Tensord__StateRecord (see
 * proto/tensord.proto and docs/protocol.md). */
#ifndef TD_STATE_INPUT_H
#define TD_STATE_INPUT_H

#include <stddef.h>
#include <stdint.h>

#define SF_SNAPSHOT 0x01
#define SF_JOURNALS(n) ((n) << 1)
#define SF_NJOURNALS(f) (((f) >> 1) & 3)
#define SF_ORPHANS 0x08
#define SF_LOCKED 0x10
#define SF_SEAL 0x20

#define SF_HDR 4
#define SF_FILES_MAX 4
#define SF_REC_HDR 8
#define SF_REC_MAX (1u << 20) /* longer records end a replay (state.c) */

/* The unnamed segment SF_ORPHANS puts under each prefix. */
#define SF_ORPHAN "orphan"

/* CRC-32C (Castagnoli), as the records carry it. */
static inline uint32_t sf_crc32c(const uint8_t *p, size_t n) {
  uint32_t c = 0xffffffffu;
  while (n--) {
    c ^= *p++;
    for (int k = 0; k < 8; k++)
      c = c & 1 ? (c >> 1) ^ 0x82f63b78u : c >> 1;
  }
  return c ^ 0xffffffffu;
}

static inline uint32_t sf_get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}

static inline void sf_put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++)
    p[i] = (uint8_t)(v >> (8 * i));
}

/* Rewrites the CRC of each record of buf, up to the first whose length
 * runs past the end. */
static inline void sf_seal(uint8_t *buf, size_t len) {
  size_t off = 0;
  while (len - off >= SF_REC_HDR) {
    uint32_t n = sf_get32(buf + off);
    if (len - off - SF_REC_HDR < n)
      return;
    sf_put32(buf + off + 4, sf_crc32c(buf + off + SF_REC_HDR, n));
    off += SF_REC_HDR + n;
  }
}

#endif /* TD_STATE_INPUT_H */
