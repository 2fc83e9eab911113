#include "rig/hw/p2p.h"

namespace rig::hw {

bool P2PMatrix::any_denied() const {
  for (size_t i = 0; i < can_access.size(); ++i)
    for (size_t j = 0; j < can_access[i].size(); ++j)
      if (i != j && can_access[i][j] == 0) return true;
  return false;
}

nlohmann::json P2PMatrix::to_json() const {
  return {{"measured", measured}, {"note", note}, {"can_access", can_access}, {"gbps", gbps}};
}

#ifndef RIG_WITH_CUDA
P2PMatrix measure_p2p(const std::vector<std::string>& bus_ids) {
  P2PMatrix m;
  m.note = "not measured (no CUDA)";
  size_t n = bus_ids.size();
  m.can_access.assign(n, std::vector<int>(n, -1));
  m.gbps.assign(n, std::vector<double>(n, 0.0));
  return m;
}
#endif

}  // namespace rig::hw
