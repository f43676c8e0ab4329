/* list.h: the daemon's intrusive lists: doubly linked, NULL-terminated,
 * reached from a head pointer (and a tail, for those kept in order). An
 * element links through a pair of fields the caller names, so that it can
 * be in several lists at once (a waiter in its key's and its owner's). */
#ifndef TD_DAEMON_LIST_H
#define TD_DAEMON_LIST_H

/* Puts e first in the list *head, through e's fields prev and next. */
#define TD__LIST_PUSH(head, e, prev, next)                                     \
  do {                                                                         \
    (e)->prev = NULL;                                                          \
    (e)->next = *(head);                                                       \
    if (*(head) != NULL)                                                       \
      (*(head))->prev = (e);                                                   \
    *(head) = (e);                                                             \
  } while (0)

/* Puts e last in the list *head whose last element is *tail. */
#define TD__LIST_APPEND(head, tail, e, prev, next)                             \
  do {                                                                         \
    (e)->next = NULL;                                                          \
    (e)->prev = *(tail);                                                       \
    if (*(tail) != NULL)                                                       \
      (*(tail))->next = (e);                                                   \
    else                                                                       \
      *(head) = (e);                                                           \
    *(tail) = (e);                                                             \
  } while (0)

/* Takes e out of the list *head; e's own fields are left as they were. */
#define TD__LIST_REMOVE(head, e, prev, next)                                   \
  do {                                                                         \
    if ((e)->prev != NULL)                                                     \
      (e)->prev->next = (e)->next;                                             \
    else                                                                       \
      *(head) = (e)->next;                                                     \
    if ((e)->next != NULL)                                                     \
      (e)->next->prev = (e)->prev;                                             \
  } while (0)

/* TD__LIST_REMOVE for a list whose last element is *tail. */
#define TD__LIST_REMOVE_TAIL(head, tail, e, prev, next)                        \
  do {                                                                         \
    if ((e)->next == NULL)                                                     \
      *(tail) = (e)->prev;                                                     \
    TD__LIST_REMOVE(head, e, prev, next);                                      \
  } while (0)

#endif /* TD_DAEMON_LIST_H */
