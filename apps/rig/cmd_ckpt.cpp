#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "command.h"
#include "flags.h"
#include "rig/core/allocator.h"
#include "rig/train/checkpoint.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// DIR is a checkpoint folder, or a run folder whose checkpoints/step-* are all verified.
std::vector<std::string> checkpoint_dirs(const std::string& dir) {
  if (!fs::is_directory(dir)) rig::bad_input("{}: no such folder", dir);
  fs::path root = fs::path(dir) / "checkpoints";
  if (!fs::is_directory(root)) return {dir};
  std::vector<std::pair<int64_t, std::string>> found;
  for (const auto& e : fs::directory_iterator(root)) {
    std::string n = e.path().filename().string();
    if (!e.is_directory() || n.rfind("step-", 0) != 0) continue;
    int64_t step = -1;
    try {
      step = std::stoll(n.substr(5));
    } catch (...) {
    }
    found.emplace_back(step, e.path().string());
  }
  if (found.empty()) rig::bad_input("{}: no checkpoints in {}", dir, root.string());
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& [s, p] : found) out.push_back(p);
  return out;
}

int run_verify(const std::string& dir, bool as_json, double max_abs, bool scan) {
  rig::VerifyOptions opt;
  opt.max_abs = max_abs;
  opt.scan_values = scan;
  bool all_ok = true;
  json out = json::array();
  for (const auto& d : checkpoint_dirs(dir)) {
    rig::VerifyReport r = rig::verify_checkpoint(d, opt);
    all_ok = all_ok && r.ok();
    if (as_json)
      out.push_back(r.to_json());
    else
      std::cout << r.to_text();
  }
  if (as_json) std::cout << out.dump(1) << "\n";
  return all_ok ? 0 : 2;
}

int run_list(const std::string& run_dir) {
  auto all = rig::list_checkpoints(run_dir);
  if (all.empty()) {
    fmt::print("{}: no complete checkpoints\n", run_dir);
    return 1;
  }
  for (const auto& c : all) fmt::print("{:>10}  {}\n", c.step, c.dir);
  return 0;
}

rig::cli::Registrar verify_reg(
    "ckpt verify",
    "Check a checkpoint (or every checkpoint of a run folder): manifest, checksums, NaN/Inf and "
    "implausible magnitudes. Exits 2 on any problem",
    [](CLI::App& app) {
      using namespace rig::cli;
      auto dir = std::make_shared<std::string>();
      auto js = std::make_shared<bool>(false);
      auto max_abs = std::make_shared<double>(1e4);
      auto no_scan = std::make_shared<bool>(false);
      app.add_option("dir", *dir, "checkpoint folder (step-N) or run folder")->required();
      app.add_flag("--json", *js, "print JSON");
      add_number(app, "--max-abs", *max_abs, "flag float values above this magnitude (0: off)",
                 at_least(0))
          ->capture_default_str();
      app.add_flag("--no-scan", *no_scan, "only check the manifest and checksums");
      return [=] { return run_verify(*dir, *js, *max_abs, !*no_scan); };
    });

rig::cli::Registrar list_reg("ckpt list", "List the complete checkpoints of a run folder",
                             [](CLI::App& app) {
                               auto dir = std::make_shared<std::string>();
                               app.add_option("run_dir", *dir, "run folder")->required();
                               return [=] { return run_list(*dir); };
                             });

}  // namespace
