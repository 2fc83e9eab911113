#include "rig/plan/memory.h"

#include <bit>
#include <cmath>
#include <sstream>

#include "rig/core/error.h"
#include "rig/model/loss_chunk.h"

namespace rig::plan {
namespace {

struct TargetName {
  unsigned bit;
  const char* name;
};
constexpr TargetName kTargets[] = {{kQ, "q"},       {kK, "k"},   {kV, "v"},      {kO, "o"},
                                   {kGate, "gate"}, {kUp, "up"}, {kDown, "down"}};

// Input and output width of each LoRA target's linear layer.
std::pair<int64_t, int64_t> target_dims(const ModelConfig& m, unsigned t) {
  const int64_t h = m.hidden_size, f = m.intermediate_size;
  switch (t) {
    case kQ:
      return {h, m.q_dim()};
    case kK:
    case kV:
      return {h, m.kv_dim()};
    case kO:
      return {m.q_dim(), h};
    case kGate:
    case kUp:
      return {h, f};
    default:
      return {f, h};
  }
}

}  // namespace

unsigned parse_lora_targets(const std::string& text) {
  unsigned out = 0;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.ends_with("_proj")) item.resize(item.size() - 5);
    if (item == "all") {
      out |= 127;
      continue;
    }
    if (item == "attn") {
      out |= kQ | kK | kV | kO;
      continue;
    }
    if (item == "mlp") {
      out |= kGate | kUp | kDown;
      continue;
    }
    bool found = false;
    for (const auto& t : kTargets)
      if (item == t.name) out |= t.bit, found = true;
    if (!found)
      bad_input("LoRA targets '{}': '{}' is not one of q, k, v, o, gate, up, down, attn, mlp, all",
                text, item);
  }
  if (out == 0) bad_input("LoRA targets '{}': expected at least one of q,k,v,o,gate,up,down", text);
  return out;
}

std::string lora_targets_string(unsigned targets) {
  std::string s;
  for (const auto& t : kTargets)
    if (targets & t.bit) s += std::string(s.empty() ? "" : ",") + t.name;
  return s;
}

double nf4_bits_per_weight(bool double_quant) {
  // Without double quantization the absmax is fp32 per 64 weights.
  return double_quant ? 4.0 + 8.0 / 64 + 32.0 / (64.0 * 256) : 4.0 + 32.0 / 64;
}

ParamCounts count_params(const ModelConfig& m, const TrainSetup& s) {
  ParamCounts c;
  const int64_t h = m.hidden_size, f = m.intermediate_size, q = m.q_dim(), kv = m.kv_dim();
  c.layers = m.num_layers;
  c.linear_per_layer = h * q + 2 * h * kv + q * h + 3 * h * f;
  c.other_per_layer = 2 * h + (m.qkv_bias ? q + 2 * kv : 0) + (m.o_bias ? h : 0) +
                      (m.mlp_bias ? 2 * f + h : 0) + (m.qk_norm ? 2 * m.head_dim : 0);
  c.embedding = m.vocab_size * h;
  c.lm_head = m.tie_word_embeddings ? 0 : m.vocab_size * h;
  c.final_norm = h;
  if (s.method != Method::full) {
    for (const auto& t : kTargets) {
      if (!(s.lora_targets & t.bit)) continue;
      auto [in, out] = target_dims(m, t.bit);
      c.lora_per_layer += s.lora_rank * (in + out);
    }
  }
  return c;
}

LayerActivations layer_activations(const ModelConfig& m, const TrainSetup& s) {
  const double a = s.act_bytes();
  const double B = double(s.micro_batch), T = double(s.seq_len), BT = B * T;
  const double h = double(m.hidden_size), f = double(m.intermediate_size);
  const double q = double(m.q_dim()), kv = double(m.kv_dim()), heads = double(m.num_heads);
  const bool full = s.method == Method::full;
  const unsigned tg = full ? 0 : s.lora_targets;
  const bool keep_xn1 = full || (tg & (kQ | kK | kV));
  const bool keep_xn2 = full || (tg & (kGate | kUp));
  const bool keep_s = full || (tg & kDown);
  const double n_t = double(std::popcount(tg));
  const double r = full ? 0.0 : double(s.lora_rank);

  // q, k, v, attention output, g, u (always) in the activation dtype; the residual stream x and
  // h1 in float32 (the engine keeps the residual in float32 under bf16 too); fp32 rstd of both
  // norms; LoRA x·A; with qwen3's head norms, q and k before them and their rstd.
  double always = BT * (a * (2 * q + 2 * kv + 2 * f + n_t * r) + 4 * 2 * h + 2 * 4);
  if (m.qk_norm) always += BT * (a * (q + kv) + 4 * (heads + double(m.num_kv_heads)));
  double attn = s.flash_attention ? B * heads * T * 4 : B * heads * T * T * a;
  double recomputable = a * BT * ((keep_xn1 ? h : 0) + (keep_xn2 ? h : 0) + (keep_s ? f : 0));
  LayerActivations la;
  la.saved_none = always + attn + recomputable;
  la.saved_selective = always + attn;
  la.saved_full = BT * h * 4;  // the float32 layer input
  // MLP backward holds dY, dX, d(s), d(g), d(u); attention backward dY, dX, dO, dq, dk, dv.
  la.backward_work = a * BT * std::max(2 * h + 3 * f, 2 * h + 2 * q + 2 * kv);
  if (!s.flash_attention) la.backward_work += B * heads * T * T * a;  // dP
  return la;
}

MemoryEstimate estimate_memory(const ModelConfig& m, const TrainSetup& s) {
  RIG_CHECK(s.world_size >= 1, "world size {}", s.world_size);
  if (s.micro_batch < 1 || s.seq_len < 1) bad_input("micro-batch and sequence length must be >= 1");
  if (s.method != Method::full && s.lora_rank < 1) bad_input("LoRA rank must be >= 1");
  for (const auto& [name, v] :
       {std::pair{"bucket_bytes", s.bucket_bytes}, std::pair{"nccl_bytes", s.nccl_bytes},
        std::pair{"context_bytes", s.context_bytes},
        std::pair{"gemm_workspace_bytes", s.gemm_workspace_bytes}})
    if (!std::isfinite(v) || v < 0)
      bad_input("train setup {}: {} is not a finite number >= 0", name, v);
  MemoryEstimate e;
  e.params = count_params(m, s);
  const ParamCounts& c = e.params;
  const double p = s.param_bytes(), a = s.act_bytes();
  const double shard = s.strategy == Strategy::sharded ? 1.0 / s.world_size : 1.0;
  const double nf4 = nf4_bits_per_weight() / 8;

  const double L = double(c.layers);
  const double non_layer = double(c.embedding + c.lm_head + c.final_norm);
  double layer_weight_bytes = (s.method == Method::qlora)
                                  ? double(c.linear_per_layer) * nf4 + double(c.other_per_layer) * p
                                  : double(c.linear_per_layer + c.other_per_layer) * p;
  e.weights = (L * layer_weight_bytes + non_layer * p) * shard;

  const double trainable = s.trains_base() ? double(c.total()) : double(c.lora_total());
  e.lora = double(c.lora_total()) * p * shard;
  e.gradients = trainable * p * shard;
  e.master = trainable * s.master_bytes() * shard;
  // 8-bit AdamW: a byte per moment and a float32 absmax per 256 elements of each.
  e.optimizer = trainable * (s.optimizer == Optimizer::adamw ? 8.0 : 2.0 + 2 * 4.0 / 256) * shard;

  e.per_layer = layer_activations(m, s);
  const auto& la = e.per_layer;
  const double BT = double(s.micro_batch) * double(s.seq_len);
  const double h = double(m.hidden_size);
  const double final_block = BT * (h * 4 + h * a + 4);  // final norm input (fp32), output, rstd
  double saved = L * la.saved_none, recompute = 0;
  if (s.checkpointing == Checkpointing::selective) {
    saved = L * la.saved_selective;
    recompute = la.saved_none - la.saved_selective;
  } else if (s.checkpointing == Checkpointing::full) {
    // The first recompute_layers layers keep their input only; the others run selective.
    const double full = s.recompute_layers < 0 ? L : std::min(L, double(s.recompute_layers));
    saved = full * la.saved_full + (L - full) * la.saved_selective;
    recompute = la.saved_none - (full > 0 ? la.saved_full : la.saved_selective);
  }
  e.activations = saved + final_block;
  e.layer_peak = la.backward_work + recompute;
  // Sharded with a frozen, untied head: the loss reads lm_head a slice of vocabulary rows at a
  // time (two in flight), and its logits are those of one slice.
  const bool sliced =
      s.world_size > 1 && s.strategy == Strategy::sharded && !s.trains_base() && c.lm_head > 0;
  const int64_t slice_rows =
      sliced ? head_slice_rows_for(m.vocab_size, int64_t(h * p)) : m.vocab_size;
  const int64_t rows =
      s.loss_chunk_tokens > 0 ? s.loss_chunk_tokens : loss_chunk_rows_for(slice_rows, int64_t(a));
  e.logits = std::min(double(rows), BT) * double(slice_rows) * a;

  if (s.world_size > 1) {
    e.comm_buffers = s.nccl_bytes;
    if (s.strategy == Strategy::sharded) {
      const double unit = layer_weight_bytes + double(c.lora_per_layer) * p;
      double in_flight = (1 + s.prefetch_units) * unit;
      if (s.trains_base()) {
        // Trainable outer parameters stay gathered for the whole step.
        in_flight = (1 + s.prefetch_units) * std::max(unit, double(c.embedding) * p);
      } else {
        // Frozen ones only around their use: the embedding for its lookup, the head (final
        // norm and lm_head) for the loss, while no layer is gathered.
        const double head =
            (slice_rows < m.vocab_size ? 2.0 * double(slice_rows) * h
                                       : double(c.lm_head ? c.lm_head : c.embedding)) *
                p +
            h * p;
        in_flight = std::max(in_flight, head);
      }
      double grad_unit = s.trains_base() ? std::max(double(c.linear_per_layer + c.other_per_layer),
                                                    double(c.embedding))
                                         : double(c.lora_per_layer);
      e.comm_buffers += in_flight + grad_unit * p;
    } else {
      e.comm_buffers += 2 * std::min(s.bucket_bytes, trainable * p);
    }
  }
  e.workspace = s.gemm_workspace_bytes;
  if (s.method == Method::qlora) {
    const double biggest = std::max({h * double(m.intermediate_size), h * double(m.q_dim())});
    e.workspace += biggest * p;  // one linear weight dequantized for its GEMM
  }
  e.context = s.context_bytes;
  return e;
}

std::vector<std::pair<std::string, double>> MemoryEstimate::terms() const {
  return {{"weights", weights},       {"lora", lora},           {"gradients", gradients},
          {"master", master},         {"optimizer", optimizer}, {"activations", activations},
          {"layer_peak", layer_peak}, {"logits", logits},       {"comm_buffers", comm_buffers},
          {"workspace", workspace},   {"context", context}};
}

const char* to_string(Method v) {
  return v == Method::full ? "full" : v == Method::lora ? "lora" : "qlora";
}
const char* to_string(Checkpointing v) {
  return v == Checkpointing::none ? "none" : v == Checkpointing::full ? "full" : "selective";
}
const char* to_string(Optimizer v) {
  return v == Optimizer::adamw ? "adamw" : "adamw8bit";
}
const char* to_string(Strategy v) {
  return v == Strategy::sharded ? "sharded" : "data-parallel";
}
const char* to_string(Precision v) {
  return v == Precision::bf16 ? "bf16" : "fp32";
}

Method parse_method(const std::string& t) {
  if (t == "full") return Method::full;
  if (t == "lora") return Method::lora;
  if (t == "qlora") return Method::qlora;
  bad_input("method '{}': expected full, lora or qlora", t);
}
Checkpointing parse_checkpointing(const std::string& t) {
  if (t == "none" || t == "off") return Checkpointing::none;
  if (t == "full" || t == "on") return Checkpointing::full;
  if (t == "selective") return Checkpointing::selective;
  bad_input("checkpointing '{}': expected none, full or selective", t);
}
Optimizer parse_optimizer(const std::string& t) {
  if (t == "adamw" || t == "adamw-fp32") return Optimizer::adamw;
  if (t == "adamw8bit" || t == "adamw-8bit" || t == "adamw8") return Optimizer::adamw8bit;
  bad_input("optimizer '{}': expected adamw or adamw8bit", t);
}
Strategy parse_strategy(const std::string& t) {
  if (t == "data-parallel" || t == "ddp" || t == "dp") return Strategy::data_parallel;
  if (t == "sharded" || t == "fsdp" || t == "zero3") return Strategy::sharded;
  bad_input("strategy '{}': expected data-parallel (ddp) or sharded (fsdp)", t);
}
Precision parse_precision(const std::string& t) {
  if (t == "bf16") return Precision::bf16;
  if (t == "fp32") return Precision::fp32;
  bad_input("precision '{}': expected bf16 or fp32", t);
}

}  // namespace rig::plan
