// Training checkpoints: RUN_DIR/checkpoints/step-N/ holding
//   state.safetensors   every tensor the loop hands over (weights or adapters, optimizer moments)
//   trainer_state.json  what the loop needs to continue (optimizer step, schedule, RNG state,
//                       data position, config hash), plus "step"
//   manifest.json       XXH3-64 of every tensor and every file; written last
// A checkpoint is written into checkpoints/.step-N.tmp/, every file fsynced, the manifest last,
// then the folder is renamed into place and the parent fsynced. A process killed at any point
// leaves either the previous checkpoints or a dot-folder that nothing reads as complete.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rig/core/tensor.h"

namespace rig {

inline constexpr const char* kCheckpointFormat = "rig-checkpoint/1";

// Writes RUN_DIR/checkpoints/step-N atomically and returns its path. `tensors` may live on any
// device. `state` must be a JSON object; "step" is added. keep_last > 0 then deletes the oldest
// complete checkpoints beyond that count (0 keeps all). Leftover .step-*.tmp folders of killed
// writers are removed. Only one process (rank 0) may save into a run folder at a time.
// `extra_files` (written already, e.g. by every rank of a sharded run, under a .step-N.* folder)
// are moved into the checkpoint and covered by the manifest. `before_manifest`, when set, runs
// after the data files are written and before the manifest (fault injection kills there).
std::string save_checkpoint(const std::string& run_dir, int64_t step,
                            const std::vector<std::pair<std::string, Tensor>>& tensors,
                            const nlohmann::json& state, int64_t keep_last = 0,
                            const std::vector<std::string>& extra_files = {},
                            const std::function<void()>& before_manifest = {});

struct CheckpointRef {
  int64_t step = 0;
  std::string dir;
};

// Complete checkpoints of a run (a step-N folder whose manifest parses and whose files are all
// present at the recorded sizes), oldest first. Temporary and incomplete folders are skipped.
// This is a cheap check: checksums are compared by load_checkpoint and verify_checkpoint.
std::vector<CheckpointRef> list_checkpoints(const std::string& run_dir);
// The newest of those, or nothing.
std::optional<CheckpointRef> latest_checkpoint(const std::string& run_dir);

struct LoadedCheckpoint {
  int64_t step = 0;
  std::string dir;
  // Read-only views into the mapped state.safetensors (writing to them faults): copy them into
  // the model's and optimizer's own tensors. They keep the mapping alive while held.
  std::vector<std::pair<std::string, Tensor>> tensors;
  nlohmann::json state;
  const Tensor* find(const std::string& name) const;
};

// Reads a checkpoint folder, checking the manifest and every checksum (not the value ranges).
// Throws InputError naming the file or tensor that does not match.
LoadedCheckpoint load_checkpoint(const std::string& dir);

// What verify_checkpoint looks for besides checksums.
struct VerifyOptions {
  double max_abs = 1e4;  // |x| above this in a float tensor is implausible for weights/moments
  // Per-tensor limits: the first pattern that is a substring of the tensor's name wins.
  std::vector<std::pair<std::string, double>> max_abs_for;
  bool scan_values = true;
};

struct VerifyProblem {
  std::string where;  // "manifest.json", "state.safetensors", "tensor 'lm_head.weight'"
  std::string what;
};

struct VerifyReport {
  std::string dir;
  int64_t step = -1;
  bool manifest_ok = false;
  size_t tensors = 0, tensors_scanned = 0;
  uint64_t bytes = 0;
  std::vector<VerifyProblem> problems;
  bool ok() const { return manifest_ok && problems.empty(); }
  std::string to_text() const;  // one line per problem, then a summary line
  nlohmann::json to_json() const;
};

// Checks everything and reports every problem found (never throws for a bad checkpoint; throws
// only when `dir` is not a folder).
VerifyReport verify_checkpoint(const std::string& dir, const VerifyOptions& opt = {});

// NaN/Inf counts and the largest magnitude of a float tensor (any device; F32, F16, BF16, F64).
struct ValueStats {
  size_t nan = 0, inf = 0;
  double max_abs = 0;       // over finite values
  int64_t max_abs_at = -1;  // flat index of max_abs
  int64_t first_bad_at = -1;
  bool finite() const { return nan == 0 && inf == 0; }
};
ValueStats value_stats(const Tensor& t);
bool is_float_dtype(DType d);

// XXH3-64 as 16 lowercase hex digits, as stored in manifests.
std::string xxh3_hex(const void* data, size_t n);
std::string xxh3_file_hex(const std::string& path);

}  // namespace rig
