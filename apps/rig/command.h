// Subcommands register themselves here: one file per subcommand, each defining a static
// rig::cli::Registrar. A name with a space ("debug forward-backward") nests under its parent.
#pragma once
#include <CLI/CLI.hpp>
#include <functional>
#include <string>

namespace rig::cli {

using Runner = std::function<int()>;
// Adds the subcommand's options to `app` and returns what runs it once parsed.
using Setup = std::function<Runner(CLI::App& app)>;

struct Registrar {
  Registrar(std::string name, std::string help, Setup setup);
};

}  // namespace rig::cli
