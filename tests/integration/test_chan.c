/* test_chan.c: channels (docs/channels.md) end to end: a real tensord,
 * forked producers and consumers, slots and plain storages through the
 * ring, EPIPE, and exact references when ends close. */
#include "cli.h"
#include "harness.h"

#include <signal.h>
#include <sys/wait.h>

static tdt_daemon d;

static void cleanup(void) {
  tdt_cleanup();
}

TestSuite(chan, .fini = cleanup, .timeout = 60);

static td_view bytes_view(int64_t n) {
  td_view v = {0};
  int64_t shape[1] = {n};
  td_view_contiguous(TD_UINT8, 1, shape, &v);
  return v;
}

typedef struct prod_args {
  const char *sock;
  const char *name;
  int n;         /* slots to send */
  int plain;     /* send plain storages instead */
  int hold_loan; /* loan one more slot and exit without sending it */
} prod_args;

static int producer(void *arg) {
  prod_args *a = arg;
  td_client *c;
  CHECK(td_connect(a->sock, &c) == 0);
  td_chan *ch;
  CHECK_ERR(c, td_chan_open(c, a->name, TD_CHAN_SEND, 5000, &ch), 0);
  for (int i = 0; i < a->n; i++) {
    td_storage *s;
    if (a->plain)
      CHECK_ERR(c, td_storage_create(c, 4096, &s), 0);
    else
      CHECK_ERR(c, td_chan_loan(ch, 5000, &s), 0);
    memset(td_storage_data(s), 'a' + i % 26, 4096);
    td_view v = bytes_view(4096);
    CHECK_ERR(c, td_chan_send(ch, s, &v, 5000), 0);
  }
  if (a->hold_loan) {
    td_storage *s;
    CHECK_ERR(c, td_chan_loan(ch, 5000, &s), 0);
    _exit(0); /* dies with a slot on loan */
  }
  td_chan_close(ch);
  td_close(c);
  return 0;
}

TDT_TEST(chan, slots_roundtrip) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 8, .slots = 4, .slot_bytes = 4096,
                    .flags = TD_CHAN_RECV};
  td_chan *ch;
  cr_assert_eq(td_chan_create(c, "work", &o, &ch), 0, "%s", td_last_error(c));
  prod_args a = {d.sock, "work", 100, 0, 0};
  pid_t p = tdt_fork(producer, &a);
  for (int i = 0; i < 100; i++) {
    td_storage *s;
    td_view v;
    cr_assert_eq(td_chan_recv(ch, 5000, &s, &v), 0, "%s", td_last_error(c));
    cr_assert_eq(td_view_numel(&v), 4096);
    cr_assert_eq(((char *)td_storage_data(s))[100], 'a' + i % 26);
    cr_assert(td_storage_is_readonly(s));
    td_storage_release(s);
  }
  cr_assert_eq(tdt_wait(p), 0);
  td_storage *s;
  td_view v;
  cr_assert_eq(td_chan_recv(ch, 2000, &s, &v), TD_EPIPE, "%s",
               td_last_error(c));
  td_chan_info info;
  cr_assert_eq(td_chan_stat(ch, &info), 0);
  cr_assert_eq(info.slots_free, 4);
  cr_assert_eq(info.sent, 100);
  /* The channel holds its 4 slots; closing its last end frees them. */
  cr_assert_eq(tdt_storages(&d), 4);
  td_chan_close(ch);
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}

TDT_TEST(chan, plain_storages) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 4, .flags = TD_CHAN_RECV};
  td_chan *ch;
  cr_assert_eq(td_chan_create(c, "plain", &o, &ch), 0, "%s", td_last_error(c));
  prod_args a = {d.sock, "plain", 20, 1, 0};
  pid_t p = tdt_fork(producer, &a);
  for (int i = 0; i < 20; i++) {
    td_storage *s;
    td_view v;
    cr_assert_eq(td_chan_recv(ch, 5000, &s, &v), 0, "%s", td_last_error(c));
    cr_assert_eq(((char *)td_storage_data(s))[7], 'a' + i % 26);
    td_storage_release(s);
  }
  cr_assert_eq(tdt_wait(p), 0);
  cr_assert_eq(tdt_storages(&d), 0);
  td_chan_close(ch);
  td_close(c);
}

TDT_TEST(chan, dead_producer_gives_back_its_loan) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 8, .slots = 2, .slot_bytes = 4096,
                    .flags = TD_CHAN_RECV};
  td_chan *ch;
  cr_assert_eq(td_chan_create(c, "dead", &o, &ch), 0, "%s", td_last_error(c));
  prod_args a = {d.sock, "dead", 1, 0, 1};
  pid_t p = tdt_fork(producer, &a);
  td_storage *s;
  td_view v;
  cr_assert_eq(td_chan_recv(ch, 5000, &s, &v), 0, "%s", td_last_error(c));
  cr_assert_eq(tdt_wait(p), 0);
  /* Its loan came back when its connection went; what it sent is ours. */
  td_chan_info info;
  for (int i = 0; i < 200; i++) {
    td_chan_stat(ch, &info);
    if (info.slots_free == 1)
      break;
    tdt_sleep_ms(10);
  }
  cr_assert_eq(info.slots_free, 1);
  cr_assert_eq(info.slots_held, 1);
  td_storage_release(s);
  td_chan_stat(ch, &info);
  cr_assert_eq(info.slots_free, 2);
  cr_assert_eq(td_chan_recv(ch, 0, &s, &v), TD_EPIPE);
  td_chan_close(ch);
  td_close(c);
}

/* tensorctl ls: the channel holds its slots (chan:NAME), and its own rows
 * say depth, slot use and who has what. */
TDT_TEST(chan, ls_shows_channels) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 4, .slots = 3, .slot_bytes = 8192};
  td_chan *ch;
  cr_assert_eq(td_chan_create(c, "lsq", &o, &ch), 0, "%s", td_last_error(c));
  td_storage *a, *b, *got;
  cr_assert_eq(td_chan_loan(ch, 1000, &a), 0, "%s", td_last_error(c));
  cr_assert_eq(td_chan_loan(ch, 1000, &b), 0, "%s", td_last_error(c));
  td_view v = bytes_view(8192);
  cr_assert_eq(td_chan_send(ch, b, &v, 1000), 0, "%s", td_last_error(c));
  td_storage *plain;
  cr_assert_eq(td_storage_create(c, 100, &plain), 0);
  td_view pv = bytes_view(100);
  cr_assert_eq(td_chan_send(ch, plain, &pv, 1000), 0, "%s", td_last_error(c));

  tdt_run_result r;
  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--socket", d.sock, "ls",
                                    NULL},
              &r);
  tdt_expect_ok(&r, "tensorctl ls");
  cr_assert(strstr(r.out, "chan:lsq") != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "CHANNEL") != NULL, "%s", r.out);
  /* 2 entries of 4; 3 slots: 1 free, 1 on loan, 1 in the ring, 0 held. */
  cr_assert(strstr(r.out, "2/4") != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "3: 1/1/1/0") != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "send+recv loaned 1") != NULL, "%s", r.out);
  tdt_run_free(&r);

  tdt_cli_run((const char *const[]){TENSORCTL_BIN, "--json", "--socket",
                                    d.sock, "ls", NULL},
              &r);
  tdt_expect_ok(&r, "tensorctl --json ls");
  tdt_expect_json_object(r.out);
  cr_assert(strstr(r.out, "\"channels\":[{\"name\":\"lsq\"") != NULL, "%s",
            r.out);
  cr_assert(strstr(r.out, "\"in_flight\":1") != NULL, "%s", r.out);
  cr_assert(strstr(r.out, "\"name\":\"chan:lsq\"") != NULL, "%s", r.out);
  tdt_run_free(&r);

  for (int i = 0; i < 2; i++) {
    cr_assert_eq(td_chan_recv(ch, 1000, &got, &v), 0, "%s", td_last_error(c));
    td_storage_release(got);
  }
  td_storage_release(a);
  td_chan_close(ch);
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}

/* An end loans the slot it loaned last again when it is free: its mapping
 * has that slot's pages warm, where round robin would walk it through all
 * the slots' (a DataLoader worker then writes cold pages every batch). */
TDT_TEST(chan, an_end_loans_its_last_slot_again) {
  tdt_start(&d, NULL);
  td_client *c = tdt_connect(&d);
  td_chan_opts o = {.capacity = 8, .slots = 4, .slot_bytes = 4096};
  td_chan *ch;
  cr_assert_eq(td_chan_create(c, "warm", &o, &ch), 0, "%s", td_last_error(c));
  td_storage *s, *t, *r;
  td_view v = bytes_view(4096), got;
  cr_assert_eq(td_chan_loan(ch, 0, &s), 0, "%s", td_last_error(c));
  uint64_t first = td_storage_id(s);
  td_storage_release(s); /* given back unsent */
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(td_chan_loan(ch, 0, &s), 0, "%s", td_last_error(c));
    cr_assert_eq(td_storage_id(s), first, "round %d", i);
    cr_assert_eq(td_chan_send(ch, s, &v, 0), 0, "%s", td_last_error(c));
    cr_assert_eq(td_chan_recv(ch, 0, &r, &got), 0, "%s", td_last_error(c));
    td_storage_release(r); /* received, then back to the ring */
  }
  /* While it is out, another; that one is then the end's first choice. */
  cr_assert_eq(td_chan_loan(ch, 0, &s), 0, "%s", td_last_error(c));
  cr_assert_eq(td_chan_loan(ch, 0, &t), 0, "%s", td_last_error(c));
  uint64_t second = td_storage_id(t);
  cr_assert_neq(second, first);
  td_storage_release(s);
  td_storage_release(t);
  cr_assert_eq(td_chan_loan(ch, 0, &t), 0, "%s", td_last_error(c));
  cr_assert_eq(td_storage_id(t), second);
  td_storage_release(t);
  td_chan_close(ch);
  cr_assert_eq(tdt_storages(&d), 0);
  td_close(c);
}
