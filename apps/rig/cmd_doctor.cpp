#include <unistd.h>

#include <iostream>

#include "command.h"
#include "rig/hw/doctor.h"

namespace {

rig::cli::Registrar reg(
    "doctor",
    "Check that this machine is ready to train: driver, CUDA, NCCL, GPUs, PCIe, heat, power, ECC",
    [](CLI::App& app) {
      auto opt = std::make_shared<rig::hw::DoctorOptions>();
      auto js = std::make_shared<bool>(false);
      auto no_p2p = std::make_shared<bool>(false);
      app.add_flag("--json", *js, "print one JSON object");
      app.add_flag("--strict", opt->strict, "treat warnings as failures");
      app.add_flag("--no-p2p", *no_p2p, "skip the peer-to-peer bandwidth measurement");
      app.add_option("--nvml", opt->nvml_library,
                     "NVML library to load (default: $RIG_NVML_LIBRARY or libnvidia-ml.so.1)");
      app.add_option("--topology-xml", opt->topology_xml,
                     "read the topology from an hwloc XML export (lstopo --of xml)");
      app.add_option("--sysfs", opt->sysfs_root, "sysfs root for network and InfiniBand discovery")
          ->capture_default_str();
      return [=] {
        rig::hw::DoctorOptions o = *opt;
        o.measure_p2p = !*no_p2p;
        auto report = rig::hw::run_doctor(o);
        if (*js)
          std::cout << report.to_json().dump(1) << "\n";
        else
          std::cout << report.to_text(isatty(STDOUT_FILENO)) << std::flush;
        return report.exit_code();
      };
    });

}  // namespace
