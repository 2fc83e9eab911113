#include <fmt/format.h>

#include <iostream>

#include "command.h"
#include "rig/train/report.h"

namespace {

rig::cli::Registrar reg(
    "report",
    "Write a self-contained HTML report of a run (loss, eval loss, learning rate, throughput, "
    "memory) to RUN_DIR/report.html",
    [](CLI::App& app) {
      auto dir = std::make_shared<std::string>();
      auto out = std::make_shared<std::string>();
      app.add_option("run_dir", *dir, "run folder holding metrics.jsonl")->required();
      app.add_option("--out", *out, "where to write the page (default RUN_DIR/report.html)");
      return [=] {
        std::string path = rig::write_report(*dir, *out);
        fmt::print("wrote {}\n", path);
        return 0;
      };
    });

}  // namespace
