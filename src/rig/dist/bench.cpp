#include "rig/dist/bench.h"

#include <algorithm>
#include <chrono>
#include <cmath>

namespace rig::dist {

std::vector<std::string> all_comm_ops() { return {"all_reduce", "reduce_scatter", "all_gather", "broadcast"}; }

namespace {

// Small integers so every sum is exact in float32: rank r, element i -> (r + 1) + (i % 7).
float pattern(int r, int64_t i) { return float(r + 1) + float(i % 7); }

Tensor filled(int64_t n, int r, Device dev, int64_t base = 0) {
  auto t = Tensor::empty({n}, DType::F32);
  for (int64_t i = 0; i < n; i++) t.f32()[i] = pattern(r, base + i);
  return dev.is_cpu() ? t : t.to(dev, "bench buffer");
}

std::vector<float> host(const Tensor& t) {
  Tensor h = t.device().is_cpu() ? t : t.to(Device::cpu());
  return {h.f32(), h.f32() + h.numel()};
}

// Runs `op` once on fresh inputs and counts elements that differ from the closed form.
int64_t check(Communicator& c, const std::string& op, int64_t count) {
  int w = c.world(), r = c.rank();
  Device dev = c.device();
  int64_t wrong = 0;
  auto expect = [&](const std::vector<float>& got, auto f) {
    for (size_t i = 0; i < got.size(); i++) wrong += got[i] != f(int64_t(i));
  };
  float rank_sum = float(w * (w + 1) / 2);
  if (op == "all_reduce") {
    Tensor t = filled(count, r, dev);
    c.all_reduce(t, ReduceOp::Sum);
    expect(host(t), [&](int64_t i) { return rank_sum + float(w) * float(i % 7); });
  } else if (op == "reduce_scatter") {
    Tensor in = filled(count * w, r, dev), out = Tensor::zeros({count}, DType::F32, dev);
    c.reduce_scatter(in, out, ReduceOp::Sum);
    expect(host(out), [&](int64_t i) { return rank_sum + float(w) * float((r * count + i) % 7); });
  } else if (op == "all_gather") {
    Tensor in = filled(count, r, dev), out = Tensor::zeros({count * w}, DType::F32, dev);
    c.all_gather(in, out);
    expect(host(out), [&](int64_t i) { return pattern(int(i / count), i % count); });
  } else if (op == "broadcast") {
    int root = w - 1;  // not 0, so a broadcast that does nothing is caught on rank 0
    Tensor t = filled(count, r, dev);
    c.broadcast(t, root);
    expect(host(t), [&](int64_t i) { return pattern(root, i); });
  } else {
    bad_input("unknown collective '{}' (expected {})", op, "all_reduce, reduce_scatter, all_gather, broadcast");
  }
  return wrong;
}

}  // namespace

std::vector<CommBenchRow> bench_comm(Communicator& c, const CommBenchOptions& o) {
  if (o.min_bytes < 4 || o.max_bytes < o.min_bytes)
    bad_input("bench comm: sizes {}..{} bytes: need 4 <= min <= max", o.min_bytes, o.max_bytes);
  if (o.factor < 2) bad_input("bench comm: step factor {} must be at least 2", o.factor);
  if (o.iters < 1) bad_input("bench comm: --iters {} must be at least 1", o.iters);
  int w = c.world();
  Device dev = c.device();
  std::vector<CommBenchRow> rows;
  for (const auto& op : o.ops) {
    busbw_factor(op, w);  // rejects unknown names up front
    bool split = op == "reduce_scatter" || op == "all_gather";
    for (size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= size_t(o.factor)) {
      CommBenchRow row;
      row.op = op;
      // Whole-buffer elements, rounded down to a multiple of the world for split collectives.
      int64_t total = int64_t(bytes / 4);
      if (split) total = std::max<int64_t>(1, total / w) * w;
      row.count = split ? total / w : total;
      row.bytes = size_t(total) * 4;
      Tensor big = Tensor::zeros({total}, DType::F32, dev, "bench buffer");
      Tensor small = split ? Tensor::zeros({row.count}, DType::F32, dev, "bench buffer") : Tensor();
      auto issue = [&]() -> WorkPtr {
        if (op == "all_reduce") return c.all_reduce_async(big);
        if (op == "reduce_scatter") return c.reduce_scatter_async(big, small);
        if (op == "all_gather") return c.all_gather_async(small, big);
        return c.broadcast_async(big, 0);
      };
      for (int i = 0; i < o.warmup; i++) issue()->wait();
      c.barrier();
      auto t0 = std::chrono::steady_clock::now();
      std::vector<WorkPtr> ws;
      for (int i = 0; i < o.iters; i++) ws.push_back(issue());
      for (auto& wk : ws) wk->wait();
      double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / o.iters;
      // The slowest rank's time and the total wrong count, agreed on by all ranks.
      int64_t wrong = check(c, op, row.count);
      auto agg = Tensor::from_f32({float(secs), float(wrong)}, {2});
      if (!dev.is_cpu()) agg = agg.to(dev);
      auto t_max = agg.clone();
      c.all_reduce(t_max, ReduceOp::Max);
      c.all_reduce(agg, ReduceOp::Sum);
      auto mx = host(t_max), sm = host(agg);
      row.time_us = double(mx[0]) * 1e6;
      row.wrong = int64_t(std::llround(sm[1]));
      row.algbw = double(row.bytes) / (double(mx[0]) * 1e9);
      row.busbw = row.algbw * busbw_factor(op, w);
      rows.push_back(row);
      if (bytes > o.max_bytes / size_t(o.factor)) break;  // no overflow past max
    }
  }
  return rows;
}

}  // namespace rig::dist
