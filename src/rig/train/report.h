// `rig report`: one self-contained HTML page about a run (no network: the charts are SVG drawn
// by an inline script from the metrics embedded in the page), so it can be mailed or archived.
#pragma once
#include <string>

namespace rig {

// The page for RUN_DIR: a summary, charts of loss and eval loss, learning rate, throughput, peak
// memory, gradient norm and any other numeric metric, the complete checkpoints and the resolved
// config. Throws InputError when RUN_DIR has no readable metrics.jsonl.
std::string render_report_html(const std::string& run_dir);

// Writes it atomically to `out` (default RUN_DIR/report.html) and returns the path.
std::string write_report(const std::string& run_dir, const std::string& out = "");

}  // namespace rig
