/* fuzz_input.h: the layout of a fuzz_request input, shared by the target and
 * the seed corpus generator.
 *
 * An input is two header bytes, then what the client side sends:
 *
 *   byte 0  FZ_HELLO     a valid Hello goes first on every connection, so that
 *                        mutations spend their bytes past the handshake
 *           FZ_MULTI     two connections; the rest is segments (below)
 *                        instead of one connection's byte stream
 *           FZ_LIMITS    --quota FZ_QUOTA, --max-storages-per-client
 *                        FZ_MAX_STORAGES
 *           FZ_ONECLIENT --max-clients 1: the second connection is refused
 *           bits 4-5     who connection 0 is, bits 6-7 connection 1: 0 the
 *                        fuzzer's own credentials, else fz_classes[n]
 *   byte 1  FZ_IO_CAP    the daemon moves at most 1 << (byte 1 & 15) bytes
 *                        per recvmsg/sendmsg (td__wire.max_io): short reads
 *                        and writes
 *           FZ_IO_TIMEOUT --io-timeout of 1 ms: a client with half a request
 *                        or unread replies is dropped at the next tick
 *           FZ_TICKS     FZ_SEG_TICK takes effect (at most FZ_TICKS_MAX
 *                        times): sleeping is what slows fuzzing most, so
 *                        it takes two bits to ask for it
 *
 * Segments (FZ_MULTI): a selector byte, a length byte, then that many bytes
 * (fewer at the end of the input). The harness delivers each segment and lets
 * the daemon handle it before the next, so that a lookup can wait for a key
 * the other connection publishes.
 *   FZ_SEG_CONN  the segment goes to connection 1 (else 0)
 *   FZ_SEG_EOF   then the connection's write side is shut: the daemon sees
 *                end of stream and closes it; later segments for it drop
 *   FZ_SEG_FD    an fd (of /dev/null) travels with the segment's first byte
 *   FZ_SEG_DEAF  then the client stops reading replies (shutdown SHUT_RD):
 *                the daemon's next write to it fails with EPIPE
 *   FZ_SEG_TICK  then 2 ms pass (with FZ_TICKS): lookups waiting 1-2 ms
 *                time out, and with FZ_IO_TIMEOUT stalled clients are
 *                dropped
 *   FZ_SEG_MUTE  from this segment on, the client leaves its replies (and
 *                their fds) unread until the end of the input, so that
 *                they pile up in the daemon; its FZ_SEG_EOF waits till then
 * Without FZ_MULTI the one connection's bytes are sent, the daemon handles
 * them (thread-pool creates included), then it sees end of stream.
 */
#ifndef TD_FUZZ_INPUT_H
#define TD_FUZZ_INPUT_H

#include <stdint.h>
#include <sys/types.h>

#define FZ_HELLO 0x01
#define FZ_MULTI 0x02
#define FZ_LIMITS 0x04
#define FZ_ONECLIENT 0x08
#define FZ_CLASS0(n) ((n) << 4)
#define FZ_CLASS1(n) ((n) << 6)

#define FZ_IO_CAP 0x10
#define FZ_IO_TIMEOUT 0x20
#define FZ_TICKS 0x40
#define FZ_TICKS_MAX 2

#define FZ_SEG_CONN 0x01
#define FZ_SEG_EOF 0x02
#define FZ_SEG_FD 0x04
#define FZ_SEG_DEAF 0x08
#define FZ_SEG_TICK 0x10
#define FZ_SEG_MUTE 0x20

/* The daemon each input gets: small, so that creates stay cheap and most
 * fuzzed sizes fail at the capacity check; larger than the 256 KiB past
 * which creates go to the thread pool. */
#define FZ_CAPACITY (8u << 20)
#define FZ_QUOTA (1u << 20)
#define FZ_MAX_STORAGES 3

/* The scope tokens the harness's daemon draws: the nth scope opened in an
 * input (from 0) is FZ_SCOPE_TOKEN(n), so that seeds and mutations can
 * publish into it. */
#define FZ_SCOPE_TOKEN(n) ((uint64_t)(n) + 1)

/* Who a connection claims to be (its SO_PEERCRED, overridden): 1 and 2 share
 * a group, 3 is a stranger. Entry 0 is unused (the real credentials). */
static const struct {
  uid_t uid;
  gid_t gid;
} fz_classes[4] = {{0, 0}, {1000, 1000}, {1001, 1000}, {1002, 1002}};

#endif /* TD_FUZZ_INPUT_H */
