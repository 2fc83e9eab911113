#include "rig/hw/topology.h"

#include <hwloc.h>

#include <cstdio>
#include <cstdlib>
#include <set>

namespace rig::hw {

bool Topology::spans_numa_nodes() const {
  std::set<int> nodes;
  for (const auto& g : gpus)
    if (g.found && g.numa_node >= 0) nodes.insert(g.numa_node);
  return nodes.size() > 1;
}

nlohmann::json Topology::to_json() const {
  nlohmann::json j = {{"ok", ok},       {"packages", packages}, {"numa_nodes", numa_nodes},
                      {"cores", cores}, {"pus", pus},           {"paths", paths}};
  if (!error.empty()) j["error"] = error;
  j["gpus"] = nlohmann::json::array();
  for (const auto& g : gpus) {
    nlohmann::json e = {{"gpu", g.gpu}, {"bus_id", g.bus_id}, {"found", g.found}};
    if (g.found) {
      e["numa_node"] = g.numa_node;
      e["cpus"] = g.cpus;
      e["link_gbps"] = g.link_gbps ? nlohmann::json(*g.link_gbps) : nlohmann::json(nullptr);
    }
    j["gpus"].push_back(e);
  }
  return j;
}

namespace {

struct TopoHandle {
  hwloc_topology_t t = nullptr;
  ~TopoHandle() {
    if (t) hwloc_topology_destroy(t);
  }
};

bool is_host_bridge(hwloc_obj_t o) {
  return o->type == HWLOC_OBJ_BRIDGE && o->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_HOST;
}

// Counts PCI-to-PCI bridges from `o` up to (not including) `stop`.
int bridges_between(hwloc_obj_t o, hwloc_obj_t stop) {
  int n = 0;
  for (hwloc_obj_t p = o->parent; p && p != stop; p = p->parent)
    if (p->type == HWLOC_OBJ_BRIDGE && !is_host_bridge(p)) ++n;
  return n;
}

int numa_of(hwloc_topology_t t, hwloc_obj_t o) {
  hwloc_obj_t a = hwloc_get_non_io_ancestor_obj(t, o);
  if (!a || !a->nodeset) return -1;
  // An ancestor spanning several nodes (the Machine on some boards) places the GPU on none.
  return hwloc_bitmap_weight(a->nodeset) == 1 ? hwloc_bitmap_first(a->nodeset) : -1;
}

std::string classify(hwloc_topology_t t, hwloc_obj_t a, hwloc_obj_t b) {
  hwloc_obj_t c = hwloc_get_common_ancestor_obj(t, a, b);
  if (!c) return "?";
  if (c->type == HWLOC_OBJ_BRIDGE && !is_host_bridge(c))
    return bridges_between(a, c) + bridges_between(b, c) <= 0 ? "PIX" : "PXB";
  if (is_host_bridge(c)) return "PHB";
  int na = numa_of(t, a), nb = numa_of(t, b);
  if (na >= 0 && na == nb) return "NODE";
  // Different NUMA nodes in one package still cross the package's interconnect; the socket link
  // is worse. hwloc gives both as "no common bridge", so use the package to tell them apart.
  hwloc_obj_t pa =
      hwloc_get_ancestor_obj_by_type(t, HWLOC_OBJ_PACKAGE, hwloc_get_non_io_ancestor_obj(t, a));
  hwloc_obj_t pb =
      hwloc_get_ancestor_obj_by_type(t, HWLOC_OBJ_PACKAGE, hwloc_get_non_io_ancestor_obj(t, b));
  if (pa && pa == pb) return "NODE";
  return "SYS";
}

}  // namespace

Topology probe_topology(const std::vector<std::string>& bus_ids, const std::string& xml) {
  Topology topo;
  TopoHandle h;
  if (hwloc_topology_init(&h.t) != 0) {
    topo.error = "hwloc_topology_init failed";
    return topo;
  }
  hwloc_topology_set_io_types_filter(h.t, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (!xml.empty() && hwloc_topology_set_xml(h.t, xml.c_str()) != 0) {
    topo.error = "hwloc cannot read " + xml;
    return topo;
  }
  if (hwloc_topology_load(h.t) != 0) {
    topo.error = "hwloc_topology_load failed";
    return topo;
  }
  topo.ok = true;
  topo.packages = hwloc_get_nbobjs_by_type(h.t, HWLOC_OBJ_PACKAGE);
  topo.numa_nodes = hwloc_get_nbobjs_by_type(h.t, HWLOC_OBJ_NUMANODE);
  topo.cores = hwloc_get_nbobjs_by_type(h.t, HWLOC_OBJ_CORE);
  topo.pus = hwloc_get_nbobjs_by_type(h.t, HWLOC_OBJ_PU);
  std::vector<hwloc_obj_t> objs;
  for (size_t i = 0; i < bus_ids.size(); ++i) {
    GpuPlacement g;
    g.gpu = int(i);
    g.bus_id = bus_ids[i];
    unsigned dom = 0, bus = 0, dev = 0, fn = 0;
    hwloc_obj_t o = nullptr;
    if (std::sscanf(bus_ids[i].c_str(), "%x:%x:%x.%x", &dom, &bus, &dev, &fn) == 4)
      o = hwloc_get_pcidev_by_busid(h.t, dom, bus, dev, fn);
    // Only an NVIDIA device counts: the bus id of a fake or stale GPU may name another device.
    if (o && o->attr->pcidev.vendor_id == 0x10de) {
      g.found = true;
      g.numa_node = numa_of(h.t, o);
      if (hwloc_obj_t a = hwloc_get_non_io_ancestor_obj(h.t, o); a && a->cpuset) {
        char* s = nullptr;
        hwloc_bitmap_list_asprintf(&s, a->cpuset);
        if (s) g.cpus = s;
        std::free(s);
      }
      if (o->attr->pcidev.linkspeed > 0) g.link_gbps = o->attr->pcidev.linkspeed;
    } else {
      o = nullptr;
    }
    objs.push_back(o);
    topo.gpus.push_back(g);
  }
  size_t n = objs.size();
  topo.paths.assign(n, std::vector<std::string>(n, "?"));
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < n; ++j)
      topo.paths[i][j] = i == j ? "X" : objs[i] && objs[j] ? classify(h.t, objs[i], objs[j]) : "?";
  return topo;
}

}  // namespace rig::hw
