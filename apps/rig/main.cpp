#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <vector>

#include "command.h"
#include "flags.h"
#include "rig/core/allocator.h"
#include "rig/core/error.h"

namespace rig::cli {

namespace {
struct Entry {
  std::string help;
  Setup setup;
};
std::map<std::string, Entry>& registry() {
  static std::map<std::string, Entry> r;
  return r;
}
}  // namespace

Registrar::Registrar(std::string name, std::string help, Setup setup) {
  registry()[std::move(name)] = Entry{std::move(help), std::move(setup)};
}

}  // namespace rig::cli

int main(int argc, char** argv) {
  using namespace rig::cli;
  // Spinning OpenMP workers starve BLAS threads and other processes on small machines (15x
  // slower training on a loaded 2-core box). libgomp reads the policy before main, so set it and
  // start again once.
  if (!std::getenv("OMP_WAIT_POLICY")) {
    setenv("OMP_WAIT_POLICY", "PASSIVE", 1);
    execv("/proc/self/exe", argv);
  }
  CLI::App app{"rig: from a box of gaming GPUs to a fine-tuned LLM"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("rig ") + RIG_VERSION);
  app.failure_message(failure_message);  // one line per error; subcommands inherit it
  app.add_flag_callback(
         "--list-numeric-flags",
         [&app] {
           list_numeric_flags(app, std::cout);
           throw CLI::Success();
         },
         "every numeric option of every subcommand (for tests)")
      ->group("");
  std::map<std::string, CLI::App*> groups;
  std::vector<std::pair<CLI::App*, Runner>> runners;
  for (auto& [name, entry] : registry()) {
    CLI::App* parent = &app;
    std::string leaf = name;
    if (auto sp = name.find(' '); sp != std::string::npos) {
      std::string group = name.substr(0, sp);
      leaf = name.substr(sp + 1);
      auto& g = groups[group];
      if (!g) {
        g = app.add_subcommand(group, group + " tools");
        g->require_subcommand(1);
      }
      parent = g;
    }
    CLI::App* sub = parent->add_subcommand(leaf, entry.help);
    runners.emplace_back(sub, entry.setup(*sub));
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& [sub, run] : runners)
      if (sub->parsed()) return run();
  } catch (const rig::Error& e) {
    std::fprintf(stderr, "rig: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rig: internal error: %s\n", e.what());
    return 1;
  }
  return 0;
}
