/* clitext.h: the text tensorctl's commands print: messages, sizes, ages,
 * JSON strings and views, and the test for a storage id. Private to
 * tensorctl (and td_show). */
#ifndef TD_CLIENT_CLITEXT_H
#define TD_CLIENT_CLITEXT_H

#include "tensord.h"

#include <stddef.h>
#include <stdint.h>

/* Longest message kept, with its NUL: as long as td_last_error's. */
#define TD__CLI_MSG_MAX 1024

/* Formats fmt into msg (if not NULL and len > 0) and returns err. */
int td__cli_msg(char *msg, size_t len, int err, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Formats n bytes as "512 B", "1.5 GiB" (binary units, one decimal, up to
 * PiB) into buf, as tensord's own messages do; returns buf. */
char *td__cli_bytes(uint64_t n, char *buf, size_t len);

/* A duration of ms as "5s", "1m05s", "3h02m", "2d04h" (truncated; < 0 is
 * 0s) into buf. Returns buf. */
char *td__cli_age(int64_t ms, char *buf, size_t len);

/* Writes s to stdout as a JSON string: quoted, '"' and '\' escaped, control
 * characters (and 0x7f) as \u00XX; other bytes (UTF-8) as they are. */
void td__cli_json_str(const char *s);

/* Copies s into buf (len bytes, cut short if too small) with each control
 * character (below 0x20, and 0x7f) as '?', so that nobody's key or client
 * name can drive the terminal it is printed on. Returns buf. */
const char *td__cli_printable(const char *s, char *buf, size_t len);

/* Writes v to stdout as a JSON object: {"dtype":"float32","shape":[2,3],
 * "stride":[3,1],"offset":0} ("?" for a dtype without a name). */
void td__cli_json_view(const td_view *v);

/* Whether s is one or more decimal digits and nothing else. */
int td__cli_is_digits(const char *s);

#endif /* TD_CLIENT_CLITEXT_H */
