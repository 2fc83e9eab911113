#include <unistd.h>

#include <atomic>
#include <csignal>
#include <iostream>

#include "command.h"
#include "flags.h"
#include "rig/hw/watch.h"

namespace {

std::atomic<bool> g_stop{false};
extern "C" void on_signal(int) {
  g_stop = true;
}

rig::cli::Registrar reg(
    "watch",
    "Live GPU telemetry with throttle/ECC/XID alerts, a log, a Prometheus endpoint and a web "
    "dashboard",
    [](CLI::App& app) {
      using namespace rig::cli;
      auto o = std::make_shared<rig::hw::WatchOptions>();
      auto no_clear = std::make_shared<bool>(false);
      add_number(app, "--interval", o->interval_s, "seconds between samples",
                 in_range(0, 86400).open_low())
          ->capture_default_str();
      add_number(app, "--iterations,-n", o->iterations,
                 "stop after N samples (0: run until Ctrl-C)", at_least(0));
      add_number(app, "--duration", o->duration_s, "stop after this many seconds (0: no limit)",
                 at_least(0));
      app.add_option("--log", o->log_path, "append samples to FILE (.csv or .jsonl)");
      add_number(app, "--prometheus", o->prometheus_port,
                 "serve /metrics on PORT (0: any free port)", in_range(0, 65535));
      add_number(app, "--http", o->http_port, "serve the dashboard on PORT (0: any free port)",
                 in_range(0, 65535));
      app.add_option("--bind", o->bind, "address the servers listen on")->capture_default_str();
      app.add_option("--run", o->run_dir,
                     "training run folder: the dashboard plots DIR/metrics.jsonl");
      app.add_option("--nvml", o->nvml_library,
                     "NVML library to load (default: $RIG_NVML_LIBRARY or libnvidia-ml.so.1)");
      app.add_flag("--no-clear", *no_clear, "print frames one after another instead of redrawing");
      app.footer(
          "Exit status: 0 when no alert fired, 2 when at least one did (also after Ctrl-C), any "
          "other non-zero status on an error (a bad flag, no NVML, a port in use).");
      return [=] {
        rig::hw::WatchOptions opt = *o;
        bool tty = isatty(STDOUT_FILENO);
        opt.clear_screen = tty && !*no_clear;
        opt.color = tty;
        std::signal(SIGINT, on_signal);
        std::signal(SIGTERM, on_signal);
        const int alerts = rig::hw::run_watch(opt, std::cout, &g_stop);
        return alerts > 0 ? 2 : 0;
      };
    });

}  // namespace
