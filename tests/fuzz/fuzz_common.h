// What every fuzz target checks: bad input may only end in rig::InputError (the CLI's one clear
// line); any other exception, or a crash, is a bug. A harness calls run_input(f) and returns 0.
#pragma once
#include <cstdio>
#include <exception>
#include <string>

#include "rig/core/error.h"

// The replay driver defines it to save the input at hand as crash-*.bin (libFuzzer saves its own).
extern "C" __attribute__((weak)) void rig_fuzz_save_input();

namespace rig::fuzz {

[[noreturn]] inline void bug(const char* what) {
  std::fprintf(stderr, "fuzz: %s\n", what);
  if (rig_fuzz_save_input) rig_fuzz_save_input();
  __builtin_trap();
}

template <typename F>
void run_input(F&& f) {
  try {
    f();
  } catch (const rig::InputError&) {
  } catch (const std::exception& e) {
    bug((std::string("not an InputError: ") + e.what()).c_str());
  }
}

}  // namespace rig::fuzz
