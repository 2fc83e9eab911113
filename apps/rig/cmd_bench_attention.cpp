// rig bench attention: forward and backward TFLOP/s of each attention implementation on a shape.
#include <memory>
#include <nlohmann/json.hpp>

#include "command.h"
#include "flags.h"
#include "rig/core/error.h"
#include "rig/ops/attention_bench.h"

namespace {

struct Opts {
  rig::ops::AttentionBenchOptions b;
  std::string impls = "cudnn,flash";
  bool json = false;
};

int run(const Opts& o) {
#ifndef RIG_WITH_CUDA
  (void)o;
  rig::bad_input("rig bench attention needs a build with the CUDA backend");
#else
  rig::ops::AttentionBenchOptions b = o.b;
  b.impls.clear();
  for (size_t p = 0; p <= o.impls.size();) {
    size_t c = o.impls.find(',', p);
    if (c == std::string::npos) c = o.impls.size();
    if (c > p) b.impls.push_back(o.impls.substr(p, c - p));
    p = c + 1;
  }
  for (const auto& r : rig::ops::bench_attention(b)) {
    if (o.json) {
      nlohmann::json j{{"impl", r.impl},
                       {"B", b.batch},
                       {"T", b.seq},
                       {"Hq", b.heads},
                       {"Hk", b.kv_heads},
                       {"D", b.head_dim},
                       {"causal", true},
                       {"packed_avg", b.packed_avg},
                       {"deterministic", b.deterministic}};
      if (!r.segment_lengths.empty()) j["segment_lengths"] = r.segment_lengths;
      if (r.skipped.empty()) {
        j["fwd_ms"] = r.fwd_ms;
        j["bwd_ms"] = r.bwd_ms;
        j["fwd_tflops"] = r.fwd_tflops;
        j["bwd_tflops"] = r.bwd_tflops;
      } else {
        j["skipped"] = r.skipped;
      }
      fmt::print("{}\n", j.dump());
    } else if (r.skipped.empty()) {
      fmt::print("{:<10} fwd {:8.3f} ms {:7.1f} TFLOP/s   bwd {:8.3f} ms {:7.1f} TFLOP/s\n", r.impl,
                 r.fwd_ms, r.fwd_tflops, r.bwd_ms, r.bwd_tflops);
    } else {
      fmt::print("{:<10} skipped: {}\n", r.impl, r.skipped);
    }
  }
  return 0;
#endif
}

rig::cli::Registrar reg(
    "bench attention", "Measure attention forward/backward TFLOP/s per implementation",
    [](CLI::App& app) {
      using namespace rig::cli;
      auto o = std::make_shared<Opts>();
      add_number(app, "--batch", o->b.batch, "batch", in_range(1, 1 << 20))->capture_default_str();
      add_number(app, "--seq", o->b.seq, "sequence length", in_range(1, 1 << 24))
          ->capture_default_str();
      add_number(app, "--heads", o->b.heads, "query heads", in_range(1, 4096))
          ->capture_default_str();
      add_number(app, "--kv-heads", o->b.kv_heads, "key/value heads", in_range(1, 4096))
          ->capture_default_str();
      add_number(app, "--head-dim", o->b.head_dim, "head dimension", in_range(1, 4096))
          ->capture_default_str();
      add_number(app, "--packed", o->b.packed_avg,
                 "packed segments of this average length (0: one causal sequence per row)",
                 in_range(0, 1 << 24))
          ->capture_default_str();
      app.add_option("--impl", o->impls, "comma-separated: cudnn, flash, reference")
          ->capture_default_str();
      add_number(app, "--iters", o->b.iters, "timed repetitions (the median is reported)",
                 in_range(1, 1000000))
          ->capture_default_str();
      add_number(app, "--warmup", o->b.warmup, "untimed repetitions first", in_range(0, 1000000))
          ->capture_default_str();
      add_number(app, "--device", o->b.device, "CUDA device index", in_range(0, 1023))
          ->capture_default_str();
      app.add_flag("--deterministic", o->b.deterministic, "cuDNN's bitwise-repeatable backward");
      app.add_flag("--json", o->json, "one JSON line per implementation");
      return [o] { return run(*o); };
    });

}  // namespace
