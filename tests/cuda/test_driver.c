/* test_driver.c: cuda/'s loader (td__cu_load and its helpers) with no
 * driver, with libraries that are not one, and with the driver's test double
 * (tests/cuda/README.md: the double is not the driver). Criterion runs each
 * test in a process of its own, so each loads the driver afresh under the
 * environment it sets. */
#include "common.h" /* td__uuid_parse */
#include "driver.h"

#include <criterion/criterion.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* Makes td__cu_load load the double, with these settings (NULL: unset). */
static void use_double(const char *devices, const char *visible) {
  setenv(TD__CU_DRIVER_ENV, TDCUDA_DOUBLE, 1);
  if (devices != NULL)
    setenv("TDCUDA_DEVICES", devices, 1);
  else
    unsetenv("TDCUDA_DEVICES");
  if (visible != NULL)
    setenv("CUDA_VISIBLE_DEVICES", visible, 1);
  else
    unsetenv("CUDA_VISIBLE_DEVICES");
}

static const td__cu *load_double(const char *devices, const char *visible) {
  use_double(devices, visible);
  char msg[512] = "";
  const td__cu *cu = td__cu_load(msg, sizeof msg);
  cr_assert_not_null(cu, "td__cu_load of the double: %s", msg);
  return cu;
}

/* The UUID the double gives physical device i (README.md). */
static void double_uuid(int i, uint8_t out[16]) {
  memcpy(out, "tdcudadouble", 12);
  out[12] = out[13] = out[14] = 0;
  out[15] = (uint8_t)i;
}

Test(loader, no_driver_is_null_naming_the_library) {
  setenv(TD__CU_DRIVER_ENV, "/nonexistent/libcuda.so.1", 1);
  char msg[512] = "";
  cr_assert_null(td__cu_load(msg, sizeof msg));
  cr_expect(strstr(msg, "no CUDA driver") != NULL, "message: %s", msg);
  cr_expect(strstr(msg, "/nonexistent/libcuda.so.1") != NULL, "message: %s",
            msg);
  /* Loaded once: a second call says the same, and msg may be NULL. */
  char again[512] = "";
  cr_expect_null(td__cu_load(again, sizeof again));
  cr_expect_str_eq(again, msg);
  cr_expect_null(td__cu_load(NULL, 0));
}

Test(loader, library_that_is_no_driver_names_the_missing_entry) {
  setenv(TD__CU_DRIVER_ENV, "libc.so.6", 1);
  char msg[512] = "";
  cr_assert_null(td__cu_load(msg, sizeof msg));
  cr_expect(strstr(msg, "libc.so.6 lacks cuInit") != NULL, "message: %s", msg);
}

Test(loader, no_device_is_cuinit_no_device) {
  use_double("0", NULL);
  char msg[512] = "";
  cr_assert_null(td__cu_load(msg, sizeof msg));
  cr_expect(strstr(msg, "cuInit: CUDA_ERROR_NO_DEVICE (no CUDA-capable device "
                        "is detected)") != NULL,
            "message: %s", msg);
}

Test(loader, empty_visible_devices_is_no_device) {
  use_double(NULL, "");
  char msg[512] = "";
  cr_assert_null(td__cu_load(msg, sizeof msg));
  cr_expect(strstr(msg, "CUDA_ERROR_NO_DEVICE") != NULL, "message: %s", msg);
}

Test(loader, every_entry_resolved_by_its_versioned_name) {
  const td__cu *cu = load_double(NULL, NULL);
  void (*fns[sizeof *cu / sizeof(void (*)(void))])(void);
  memcpy(fns, cu, sizeof fns);
  for (size_t i = 0; i < sizeof fns / sizeof fns[0]; i++)
    cr_expect_not_null(fns[i], "entry %zu of td__cu is NULL", i);
  /* The double exports only the versioned names cuda.h maps to: that the
   * load succeeded proves the loader asked for cuMemGetInfo_v2, not the old
   * cuMemGetInfo whose ABI differs. */
  void *lib = dlopen(TDCUDA_DOUBLE, RTLD_NOW | RTLD_NOLOAD);
  cr_assert_not_null(lib);
  cr_expect_null(dlsym(lib, "cuMemGetInfo"));
  cr_expect_not_null(dlsym(lib, "cuMemGetInfo_v2"));
  cr_expect_eq((void *)cu->MemGetInfo, dlsym(lib, "cuMemGetInfo_v2"));
  cr_expect_eq((void *)cu->DeviceGetUuid, dlsym(lib, "cuDeviceGetUuid_v2"));
  dlclose(lib);
}

struct racer {
  const td__cu *got;
};

static void *race_load(void *arg) {
  ((struct racer *)arg)->got = td__cu_load(NULL, 0);
  return NULL;
}

Test(loader, loads_once_across_threads) {
  use_double(NULL, NULL);
  pthread_t t[8];
  struct racer r[8];
  for (int i = 0; i < 8; i++)
    cr_assert_eq(pthread_create(&t[i], NULL, race_load, &r[i]), 0);
  for (int i = 0; i < 8; i++)
    pthread_join(t[i], NULL);
  const td__cu *cu = td__cu_load(NULL, 0);
  cr_assert_not_null(cu);
  for (int i = 0; i < 8; i++)
    cr_expect_eq(r[i].got, cu, "thread %d got another table", i);
}

Test(loader, devices_names_and_uuids) {
  const td__cu *cu = load_double("3", NULL);
  int n = -1;
  cr_assert_eq(cu->DeviceGetCount(&n), CUDA_SUCCESS);
  cr_assert_eq(n, 3);
  for (int i = 0; i < n; i++) {
    CUdevice d;
    CUuuid u;
    char name[64];
    uint8_t want[16];
    cr_assert_eq(cu->DeviceGet(&d, i), CUDA_SUCCESS);
    cr_assert_eq(cu->DeviceGetUuid(&u, d), CUDA_SUCCESS);
    double_uuid(i, want);
    cr_expect_arr_eq(u.bytes, want, 16, "device %d's UUID", i);
    cr_assert_eq(cu->DeviceGetName(name, sizeof name, d), CUDA_SUCCESS);
    cr_expect_str_eq(name, "tensord CUDA test double");
  }
  CUdevice d;
  cr_expect_eq(cu->DeviceGet(&d, 3), CUDA_ERROR_INVALID_DEVICE);
  int v = -1;
  cr_expect_eq(
      cu->DeviceGetAttribute(
          &v, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
          0),
      CUDA_SUCCESS);
  cr_expect_eq(v, 1);
  cr_expect_eq(cu->Init(0), CUDA_SUCCESS, "cuInit again is harmless");
}

Test(loader, code_maps_cuda_errors_to_td_codes) {
  cr_expect_eq(td__cu_code(CUDA_SUCCESS), 0);
  cr_expect_eq(td__cu_code(CUDA_ERROR_OUT_OF_MEMORY), TD_ENOMEM);
  cr_expect_eq(td__cu_code(CUDA_ERROR_INVALID_DEVICE), TD_ENODEV);
  cr_expect_eq(td__cu_code(CUDA_ERROR_NO_DEVICE), TD_ENODEV);
  cr_expect_eq(td__cu_code(CUDA_ERROR_NOT_SUPPORTED), TD_ENOSYS);
  cr_expect_eq(td__cu_code(CUDA_ERROR_INVALID_VALUE), TD_EINVAL);
  cr_expect_eq(td__cu_code(CUDA_ERROR_INVALID_CONTEXT), TD_EIO);
  cr_expect_eq(td__cu_code(CUDA_ERROR_ILLEGAL_ADDRESS), TD_EIO);
  cr_expect_eq(td__cu_code((CUresult)12345), TD_EIO);
}

Test(loader, strerror_names_code_and_text) {
  char buf[128];
  cr_expect_str_eq(
      td__cu_strerror(NULL, CUDA_ERROR_OUT_OF_MEMORY, buf, sizeof buf),
      "CUresult 2");
  const td__cu *cu = load_double(NULL, NULL);
  cr_expect_str_eq(
      td__cu_strerror(cu, CUDA_ERROR_OUT_OF_MEMORY, buf, sizeof buf),
      "CUDA_ERROR_OUT_OF_MEMORY (out of memory)");
  cr_expect_str_eq(
      td__cu_strerror(cu, CUDA_ERROR_INVALID_CONTEXT, buf, sizeof buf),
      "CUDA_ERROR_INVALID_CONTEXT (invalid device context)");
  cr_expect_str_eq(td__cu_strerror(cu, (CUresult)12345, buf, sizeof buf),
                   "CUresult 12345");
  char small[10];
  cr_expect_str_eq(
      td__cu_strerror(cu, CUDA_ERROR_OUT_OF_MEMORY, small, sizeof small),
      "CUDA_ERRO");
}

Test(loader, uuid_str_is_nvidia_smis_form) {
  const uint8_t u[16] = {0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
                         0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10};
  char buf[TD__CU_UUID_STRLEN];
  cr_expect_str_eq(td__cu_uuid_str(u, buf, sizeof buf),
                   "GPU-01234567-89ab-cdef-fedc-ba9876543210");
  cr_expect_eq(strlen(buf), TD__CU_UUID_STRLEN - 1);
}

Test(loader, uuids_parse_as_gpu_or_mig) {
  const uint8_t want[16] = {0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef,
                            0xfe, 0xdc, 0xba, 0x98, 0x76, 0x54, 0x32, 0x10};
  uint8_t u[16];
  cr_expect_eq(td__uuid_parse("GPU-01234567-89ab-cdef-fedc-ba9876543210", u),
               0);
  cr_expect_arr_eq(u, want, 16);
  memset(u, 0, sizeof u);
  cr_expect_eq(td__uuid_parse("MIG-01234567-89AB-CDEF-FEDC-BA9876543210", u),
               1);
  cr_expect_arr_eq(u, want, 16);
  char buf[TD_UUID_STR_MAX];
  cr_expect_str_eq(td_gpu_uuid_str(want, 1, buf, sizeof buf),
                   "MIG-01234567-89ab-cdef-fedc-ba9876543210");
  const char *bad[] = {
      "",
      "GPU-",
      "gpu-01234567-89ab-cdef-fedc-ba9876543210",
      "MIG-01234567-89ab-cdef-fedc-ba987654321",   /* a digit short */
      "MIG-01234567-89ab-cdef-fedc-ba98765432100", /* one too many */
      "MIG-0123456789ab-cdef-fedc-ba9876543210-",  /* a dash misplaced */
      "MIG-01234567-89ab-cdef-fedc-ba987654321g",  /* not hex */
      "MIG-GPU-01234567-89ab-cdef-fedc-ba98765432",
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    cr_expect_eq(td__uuid_parse(bad[i], u), -1, "'%s' parsed", bad[i]);
}

Test(loader, device_by_uuid_follows_visible_devices_renumbering) {
  const td__cu *cu = load_double(NULL, "1,0");
  uint8_t u0[16], u1[16];
  double_uuid(0, u0);
  double_uuid(1, u1);
  CUdevice d = -1;
  cr_expect_eq(td__cu_device_by_uuid(cu, u1, &d), 0);
  cr_expect_eq(d, 0, "physical device 1 is ordinal 0 here");
  cr_expect_eq(td__cu_device_by_uuid(cu, u0, &d), 0);
  cr_expect_eq(d, 1, "physical device 0 is ordinal 1 here");
  uint8_t other[16];
  double_uuid(7, other);
  d = 42;
  cr_expect_eq(td__cu_device_by_uuid(cu, other, &d), TD_ENODEV);
  cr_expect_eq(d, 42, "*out unchanged on failure");
}

Test(loader, device_by_uuid_of_a_hidden_device_is_enodev) {
  const td__cu *cu = load_double(NULL, "1");
  int n = -1;
  cr_assert_eq(cu->DeviceGetCount(&n), CUDA_SUCCESS);
  cr_expect_eq(n, 1);
  uint8_t u0[16], u1[16];
  double_uuid(0, u0);
  double_uuid(1, u1);
  CUdevice d = 42;
  cr_expect_eq(td__cu_device_by_uuid(cu, u0, &d), TD_ENODEV);
  cr_expect_eq(d, 42);
  cr_expect_eq(td__cu_device_by_uuid(cu, u1, &d), 0);
  cr_expect_eq(d, 0);
}

Test(loader, visible_devices_by_uuid_stop_at_the_first_unknown) {
  /* As the driver: UUIDs or indexes; the list ends at one naming nothing. */
  const td__cu *cu =
      load_double("3", "GPU-74646375-6461-646f-7562-6c6500000002,7,0");
  int n = -1;
  cr_assert_eq(cu->DeviceGetCount(&n), CUDA_SUCCESS);
  cr_expect_eq(n, 1);
  uint8_t u2[16];
  double_uuid(2, u2);
  CUdevice d = -1;
  cr_expect_eq(td__cu_device_by_uuid(cu, u2, &d), 0);
  cr_expect_eq(d, 0);
}
