/* viewmsg.h: td_view to and from its wire message. */
#ifndef TD_VIEWMSG_H
#define TD_VIEWMSG_H

#include "tensord.h"
#include "tensord.pb-c.h"

/* Copies m into *v. Returns 0, or TD_EINVAL with msg filled if m has more
 * than TD_MAX_DIMS dims or as many strides as sizes. The view itself is not
 * checked: see td_view_check. */
int td__view_from_msg(const Tensord__View *m, td_view *v, char *msg,
                      size_t len);
/* Points m at v's arrays (no copy: v must outlive m). */
void td__view_to_msg(const td_view *v, Tensord__View *m);

#endif /* TD_VIEWMSG_H */
