/* version.c: the version of the library a program runs with. */
#include "tensord.h"

unsigned int td_version(void) {
  return TD_VERSION_HEX;
}

const char *td_version_string(void) {
  return TD_VERSION_STRING;
}
