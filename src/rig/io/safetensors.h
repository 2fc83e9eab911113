// safetensors: 8-byte little-endian header length N, N bytes of JSON header, then the data buffer.
// The header maps tensor names to {dtype, shape, data_offsets [begin, end)} relative to the buffer,
// plus an optional "__metadata__" string map. Offsets must tile the buffer exactly.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "rig/core/tensor.h"

namespace rig {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  Shape shape;
  size_t begin = 0, end = 0;  // relative to the data buffer
};

struct SafeTensorsHeader {
  std::vector<TensorInfo> tensors;  // in file order of data_offsets
  std::map<std::string, std::string> metadata;
  size_t data_start = 0;  // 8 + N
};

constexpr size_t kMaxSafeTensorsHeader = 100u << 20;

// Validates everything about the header against a file of `file_size` bytes; `data` holds at least
// min(file_size, 8 + N) bytes. Errors name `path` and what is wrong.
SafeTensorsHeader parse_safetensors_header(const uint8_t* data, size_t file_size,
                                           const std::string& path);

class SafeTensorsFile {
 public:
  // Maps the file read-only; tensors are zero-copy views into the mapping.
  static SafeTensorsFile open(const std::string& path);

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  bool has(const std::string& name) const { return index_.count(name) > 0; }
  const TensorInfo& info(const std::string& name) const;
  Tensor get(const std::string& name) const;      // view (a copy if unaligned), the file's dtype
  Tensor get_f32(const std::string& name) const;  // converted copy (or view when already F32)

 private:
  std::string path_;
  std::shared_ptr<void> map_;
  const uint8_t* base_ = nullptr;
  SafeTensorsHeader header_;
  std::map<std::string, size_t> index_;
};

// Writes tensors (CPU or GPU, any dtype) atomically, with data laid out in the given order.
// hf_order: laid out as the Python safetensors library writes them (by dtype, widest first, then
// by name; the header lists __metadata__ and then the tensors in data order), so a file
// transformers would write comes out byte for byte the same.
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {},
                      bool hf_order = false);

// A model's weights: one model.safetensors or shards listed by model.safetensors.index.json.
class WeightFiles {
 public:
  static WeightFiles open_dir(const std::string& dir);
  static WeightFiles open_file(const std::string& path);
  std::vector<std::string> names() const;
  bool has(const std::string& name) const { return where_.count(name) > 0; }
  const TensorInfo& info(const std::string& name) const;
  Tensor get(const std::string& name) const;
  Tensor get_f32(const std::string& name) const;
  // The file that holds `name` (for messages); the folder when no file does.
  const std::string& path_of(const std::string& name) const;
  const std::vector<SafeTensorsFile>& files() const { return files_; }

 private:
  std::vector<SafeTensorsFile> files_;
  std::map<std::string, size_t> where_;
  std::string where_desc_;
};

}  // namespace rig
