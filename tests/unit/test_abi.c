/* test_abi.c: what a binary built against tensord.h may rely on: the version
 * it reports, and the layout of the structs that cross the library's ABI. */
#include "tensord.h"

#include <criterion/criterion.h>
#include <errno.h>
#include <limits.h>
#include <libgen.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- version ---- */

Test(version, run_time_version_is_the_headers) {
  cr_assert_eq(td_version(), TD_VERSION_HEX,
               "td_version() 0x%06x, header 0x%06x", td_version(),
               TD_VERSION_HEX);
  cr_assert_str_eq(td_version_string(), TD_VERSION_STRING);
}

Test(version, hex_and_string_come_from_the_three_numbers) {
  cr_assert_eq(TD_VERSION_HEX, (TD_VERSION_MAJOR << 16) |
                                   (TD_VERSION_MINOR << 8) | TD_VERSION_PATCH);
  char want[32];
  snprintf(want, sizeof(want), "%d.%d.%d", TD_VERSION_MAJOR, TD_VERSION_MINOR,
           TD_VERSION_PATCH);
  cr_assert_str_eq(TD_VERSION_STRING, want);
}

/* CMake takes the project's version from tensord.h; the package files, the
 * pkg-config file and the library's file name all say the same. */
Test(version, cmake_project_version_is_the_headers) {
  cr_assert_str_eq(TD_CMAKE_VERSION, TD_VERSION_STRING);
}

Test(version, shared_library_file_is_named_by_the_version) {
  char real[PATH_MAX];
  cr_assert_not_null(realpath(TD_LIBTENSORD_SO, real), "%s", TD_LIBTENSORD_SO);
  cr_assert_str_eq(basename(real), "libtensord.so." TD_VERSION_STRING);
}

/* ---- struct layouts ---- */

/* Sizes and offsets of the structs that cross the ABI, as built on LP64
 * (x86_64, aarch64). A change here breaks binaries built against an older
 * tensord.h: a new field must take the place of reserved words instead. */
#define FIELD(type, field, off)                                                \
  cr_expect_eq(offsetof(type, field), (size_t)(off),                           \
               #type "." #field " at %zu, was %d", offsetof(type, field),      \
               (off))
#define SIZE(type, size, align)                                                \
  do {                                                                         \
    cr_expect_eq(sizeof(type), (size_t)(size),                                 \
                 "sizeof(" #type ") %zu, was %d", sizeof(type), (size));       \
    cr_expect_eq(_Alignof(type), (size_t)(align),                              \
                 "_Alignof(" #type ") %zu, was %d", _Alignof(type), (align));  \
  } while (0)

Test(abi, struct_layouts_are_those_released) {
  if (sizeof(void *) != 8 || sizeof(long) != 8)
    cr_skip_test("layouts are pinned for LP64 only");
  SIZE(td_view, 272, 8);
  FIELD(td_view, ndim, 4);
  FIELD(td_view, shape, 8);
  FIELD(td_view, stride, 136);
  FIELD(td_view, offset, 264);

  SIZE(td_create_opts, 64, 8);
  FIELD(td_create_opts, mode, 8);
  FIELD(td_create_opts, device, 12);
  FIELD(td_create_opts, flags, 16);        /* was reserved[0] (recycling) */
  FIELD(td_create_opts, device_index, 24); /* was reserved[0] (CUDA) */
  FIELD(td_create_opts, reserved, 32);

  SIZE(td_publish_opts, 64, 8);
  FIELD(td_publish_opts, scope, 0);
  FIELD(td_publish_opts, event, 8); /* was reserved[0] (CUDA events) */
  FIELD(td_publish_opts, reserved, 16);

  SIZE(td_connect_opts, 64, 8); /* new with client names */
  FIELD(td_connect_opts, name, 0);
  FIELD(td_connect_opts, reserved, 8);

  SIZE(td_holder, 32, 8);
  FIELD(td_holder, uid, 4);
  FIELD(td_holder, refs, 8);
  FIELD(td_holder, name, 16); /* was reserved[0] (client names) */
  FIELD(td_holder, reserved, 24);

  SIZE(td_storage_info, 152, 8);
  FIELD(td_storage_info, nbytes, 8);
  FIELD(td_storage_info, device, 16);
  FIELD(td_storage_info, refs, 20);
  FIELD(td_storage_info, owner_pid, 24);
  FIELD(td_storage_info, owner_uid, 28);
  FIELD(td_storage_info, owner_gid, 32);
  FIELD(td_storage_info, mode, 36);
  FIELD(td_storage_info, created_unix_ms, 40);
  FIELD(td_storage_info, nholders, 48);
  FIELD(td_storage_info, holders, 56);
  FIELD(td_storage_info, nkeys, 64);
  FIELD(td_storage_info, nkeys_total, 72);
  FIELD(td_storage_info, keys, 80);
  FIELD(td_storage_info, device_uuid, 88); /* was reserved[0..1] (CUDA) */
  FIELD(td_storage_info, device_mig, 104); /* was reserved[0] (MIG) */
  FIELD(td_storage_info, reserved, 112);

  SIZE(td_device_stat, 80, 8);
  FIELD(td_device_stat, device, 0);
  FIELD(td_device_stat, index, 4);
  FIELD(td_device_stat, uuid, 8);
  FIELD(td_device_stat, bytes_used, 24);
  FIELD(td_device_stat, capacity, 32);
  FIELD(td_device_stat, storages, 40);
  FIELD(td_device_stat, mig, 48); /* was reserved[0] (MIG) */
  /* pool_bytes and pool_allocs took two more of the reserved words. */
  FIELD(td_device_stat, pool_bytes, 56);
  FIELD(td_device_stat, pool_allocs, 64);
  FIELD(td_device_stat, reserved, 72);

  SIZE(td_upgrade_info, 104, 8);
  FIELD(td_upgrade_info, old_pid, 0);
  FIELD(td_upgrade_info, new_pid, 4);
  FIELD(td_upgrade_info, old_version, 8);
  FIELD(td_upgrade_info, new_version, 40);
  FIELD(td_upgrade_info, reserved, 72);

  SIZE(td_key_info, 328, 8);
  FIELD(td_key_info, id, 8);
  FIELD(td_key_info, view, 16);
  FIELD(td_key_info, published_unix_ms, 288);
  FIELD(td_key_info, reserved, 296);

  SIZE(td_stat, 704, 8);
  FIELD(td_stat, bytes_used, 8);
  FIELD(td_stat, capacity, 16);
  FIELD(td_stat, shm_free, 24);
  FIELD(td_stat, clients, 32);
  FIELD(td_stat, keys, 40);
  FIELD(td_stat, waiters, 48);
  FIELD(td_stat, uptime_ms, 56);
  FIELD(td_stat, pid, 64);
  FIELD(td_stat, instance, 72);
  FIELD(td_stat, quota, 80);
  FIELD(td_stat, max_clients, 88);
  FIELD(td_stat, max_storages_per_client, 92);
  FIELD(td_stat, state_dir, 96);
  FIELD(td_stat, version, 352);
  FIELD(td_stat, socket, 384);
  FIELD(td_stat, pool_segments, 640); /* was reserved[0..4] (recycling) */
  FIELD(td_stat, pool_bytes, 648);
  FIELD(td_stat, pool_limit, 656);
  FIELD(td_stat, pool_hits, 664);
  FIELD(td_stat, pool_misses, 672);
  FIELD(td_stat, daemon_rss_bytes, 680); /* was reserved[0..1] (memory) */
  FIELD(td_stat, daemon_heap_bytes, 688);
  FIELD(td_stat, reserved, 696);

  SIZE(td_event, 112, 8);
  FIELD(td_event, pid, 4);
  FIELD(td_event, uid, 8);
  FIELD(td_event, code, 12);
  FIELD(td_event, unix_ms, 16);
  FIELD(td_event, id, 24);
  FIELD(td_event, nbytes, 32);
  FIELD(td_event, device, 40);
  FIELD(td_event, key, 48);
  FIELD(td_event, name, 56);
  FIELD(td_event, message, 64);
  FIELD(td_event, dropped, 72);
  FIELD(td_event, reserved, 80);

  SIZE(td_state_dict_entry, 336, 8);
  FIELD(td_state_dict_entry, dtype_name, 8);
  FIELD(td_state_dict_entry, dtype, 16);
  FIELD(td_state_dict_entry, ndim, 20);
  FIELD(td_state_dict_entry, shape, 24);
  FIELD(td_state_dict_entry, stride, 152);
  FIELD(td_state_dict_entry, storage_offset, 280);
  FIELD(td_state_dict_entry, region, 288);
  FIELD(td_state_dict_entry, itemsize, 292);
  FIELD(td_state_dict_entry, nbytes, 296);
  FIELD(td_state_dict_entry, reserved, 304);
}

/* Enum values travel on the wire and in binaries: they never change. */
Test(abi, enum_values_never_change) {
  cr_expect_eq(TD_CPU, 0);
  cr_expect_eq(TD_CUDA, 1);
  cr_expect_eq(TD_BOOL, 1);
  cr_expect_eq(TD_FLOAT32, 9);
  cr_expect_eq(TD_FLOAT8_E5M2, 17);
  cr_expect_eq(TD_EINVAL, -EINVAL);
  cr_expect_eq(TD_ENAMETOOLONG, -ENAMETOOLONG);
  cr_expect_eq(TD_EEXIST, -EEXIST);
  cr_expect_eq(TD_EFORKED, -4001);
  cr_expect_eq(TD_RDONLY, 0x1u);
  cr_expect_eq(TD_TAKE, 0x2u);
  cr_expect_eq(TD_UNINIT, 0x4u);
  cr_expect_eq(TD_COW, 0x8u);
  cr_expect_eq(TD_DLPACK_CONSUME, 0x100u);
  cr_expect_eq(TD_EVENT_CREATE, 1);
  cr_expect_eq(TD_EVENT_PUBLISH, 2);
  cr_expect_eq(TD_EVENT_TAKE, 3);
  cr_expect_eq(TD_EVENT_UNPUBLISH, 4);
  cr_expect_eq(TD_EVENT_FREE, 5);
  cr_expect_eq(TD_EVENT_CONNECT, 6);
  cr_expect_eq(TD_EVENT_DISCONNECT, 7);
  cr_expect_eq(TD_EVENT_REFUSED, 8);
  cr_expect_eq(TD_EVENT_LOOKUP, 9);
}

/* "Zero-initialise, then set": a zeroed td_create_opts asks for the
 * defaults, whatever fields a later header adds. */
Test(abi, zeroed_create_opts_have_zero_reserved_words) {
  td_create_opts o = {0};
  o.nbytes = 64;
  for (size_t i = 0; i < sizeof(o.reserved) / sizeof(o.reserved[0]); i++)
    cr_assert_eq(o.reserved[i], 0);
  cr_assert_eq(o.mode, 0);
  cr_assert_eq(o.device, TD_CPU);
}

Test(abi, zeroed_publish_opts_publish_an_ordinary_key) {
  td_publish_opts o = {0};
  cr_assert_eq(o.scope, 0, "scope 0: an ordinary key, as td_publish");
  cr_assert_null(o.event, "no event: the producer synchronised");
  for (size_t i = 0; i < sizeof(o.reserved) / sizeof(o.reserved[0]); i++)
    cr_assert_eq(o.reserved[i], 0);
  cr_assert_eq(sizeof(o.reserved) / sizeof(o.reserved[0]), 6);
}

/* A zeroed td_connect_opts connects as td_connect does: the default
 * name. */
Test(abi, zeroed_connect_opts_ask_for_the_default_name) {
  td_connect_opts o = {0};
  cr_assert_null(o.name);
  cr_assert_eq(sizeof(o.reserved) / sizeof(o.reserved[0]), 7);
  for (size_t i = 0; i < sizeof(o.reserved) / sizeof(o.reserved[0]); i++)
    cr_assert_eq(o.reserved[i], 0);
  cr_assert_eq(TD_CLIENT_NAME_MAX, 63);
}

/* A new code is named like the others. */
Test(abi, eexist_is_named) {
  cr_assert_str_eq(td_err_name(TD_EEXIST), "EEXIST");
  cr_assert_str_eq(td_strerror(TD_EEXIST), "already exists");
}
