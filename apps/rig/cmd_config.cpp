// rig config reference: the training config keys from the parser's schema, as the markdown of
// docs/config-reference.md, so the page is regenerated rather than edited by hand.
#include <fmt/format.h>

#include <iostream>

#include "command.h"
#include "rig/io/atomic_file.h"
#include "rig/train/train_config_schema.h"

namespace {

rig::cli::Registrar reg(
    "config reference",
    "Print the training config keys (the tables of docs/config-reference.md) from the parser's "
    "schema",
    [](CLI::App& app) {
      auto write = std::make_shared<std::string>();
      auto check = std::make_shared<std::string>();
      app.add_option("--write", *write,
                     "rewrite the generated tables of this page in place "
                     "(docs/config-reference.md)");
      app.add_option("--check", *check, "exit 1 when this page's generated tables are out of date");
      app.get_option("--check")->excludes("--write");
      return [=] {
        if (!write->empty() || !check->empty()) {
          const std::string& path = write->empty() ? *check : *write;
          std::string page = rig::read_file(path);
          std::string updated = rig::update_config_reference(page, path);
          if (updated == page) {
            fmt::print("{} is up to date\n", path);
            return 0;
          }
          if (!check->empty()) {
            fmt::print(stderr, "{} is out of date; run: rig config reference --write {}\n", path,
                       path);
            return 1;
          }
          rig::write_file_atomic(path, updated);
          fmt::print("wrote {}\n", path);
          return 0;
        }
        std::cout << rig::config_reference_keys_markdown() << "\n"
                  << rig::config_reference_aliases_markdown();
        return 0;
      };
    });

}  // namespace
