/* test_abi.c: what a binary built against tensord.h may rely on: the version
 * it reports, and the layout of the structs that cross the library's ABI. */
#include "tensord.h"

#include <criterion/criterion.h>
#include <limits.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- version ---- */

Test(version, run_time_version_is_the_headers) {
  cr_assert_eq(td_version(), TD_VERSION_HEX, "td_version() 0x%06x, header 0x%06x",
               td_version(), TD_VERSION_HEX);
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
