// The GPU catalog: a YAML data file (configs/catalog/gpus.yaml, compiled in) that users extend or
// override with their own file.
#pragma once
#include <map>
#include <string>
#include <vector>

namespace rig::plan {

enum class NvLink { none, bridge, sxm };

struct GpuSpec {
  std::string key, name;
  std::vector<std::string> aliases;
  double memory_gb = 0;      // nominal, for error rates
  double memory_mib = 0;     // total, as nvidia-smi reports
  double bandwidth_gbs = 0;  // memory bandwidth, GB/s
  double bf16_tflops = 0;    // dense, fp32 accumulate
  double tdp_w = 0;
  double transient = 1.0;  // ms-scale spike, × TDP
  double price_usd = 0, cloud_usd_hour = 0;
  int pcie_gen = 4;
  bool p2p = false;
  NvLink nvlink = NvLink::none;
  double nvlink_gbs = 0;  // per direction
  bool ecc = false;
  double fit_per_gb = 0;

  double memory_bytes() const { return memory_mib * 1024.0 * 1024.0; }
};

class Catalog {
 public:
  // The compiled-in catalog.
  static Catalog builtin();
  // Adds or overrides cards from YAML text; `source` names the file in error messages.
  void merge_yaml(const std::string& text, const std::string& source);
  void merge_file(const std::string& path);
  // By key or alias, case-insensitive, "rtx" and "nvidia" prefixes optional. Throws InputError
  // listing the known cards.
  const GpuSpec& find(const std::string& name) const;
  const std::map<std::string, GpuSpec>& gpus() const { return gpus_; }

 private:
  std::map<std::string, GpuSpec> gpus_;
};

const char* builtin_catalog_yaml();  // catalog_data.cpp

}  // namespace rig::plan
