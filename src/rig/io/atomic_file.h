// Atomic writes: data goes to a temporary name beside the target, is fsynced, then renamed over
// it, and the folder is fsynced. A killed process leaves the old file or none, never half a file.
#pragma once
#include <cstdio>
#include <string>
#include <string_view>

namespace rig {

class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();  // removes the temporary file unless commit() ran
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t n);
  void write(std::string_view s) { write(s.data(), s.size()); }
  void commit();  // flush, fsync, rename, fsync the folder
  const std::string& path() const { return path_; }

 private:
  std::string path_, tmp_;
  std::FILE* f_ = nullptr;
};

void write_file_atomic(const std::string& path, std::string_view content);
std::string read_file(const std::string& path);  // throws InputError naming the path
void fsync_dir(const std::string& dir);

}  // namespace rig
