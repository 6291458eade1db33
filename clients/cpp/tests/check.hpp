// A minimal test harness: CHECK counts failures and names the line; a test
// program exits non-zero if any failed, so CTest reports it.
#pragma once
#include <cstdio>
#include <string>

inline int g_failures = 0;

#define CHECK(cond, ...)                                                                 \
  do {                                                                                   \
    if (!(cond)) {                                                                       \
      g_failures++;                                                                      \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed %s\n", __FILE__, __LINE__, #cond,   \
                   std::string(__VA_ARGS__).c_str());                                    \
    }                                                                                    \
  } while (0)

template <typename E, typename F>
bool throws(F&& f) {
  try {
    f();
  } catch (const E&) {
    return true;
  } catch (...) {
    return false;
  }
  return false;
}
