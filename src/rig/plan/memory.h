// Per-GPU memory of one training rank: a library function the planner and the trainer share.
//
// How the engine stores tensors (the assumptions every formula here rests on):
//  - Frozen and trainable weights live on the device in the parameter dtype (`precision`: bf16 on
//    GPUs, fp32 in the CPU engine). QLoRA stores the linear weights of every decoder layer as NF4
//    with double quantization; embeddings, LM head and norms stay in the parameter dtype.
//  - Every trainable parameter has a gradient in the parameter dtype, an fp32 master copy when the
//    parameter dtype is narrower than fp32 (none in fp32), and AdamW's m and v: fp32 (8 bytes per
//    parameter) or 8-bit blockwise (2 bytes plus an fp32 absmax per 256 values per state).
//  - Data parallel keeps a full replica per rank. Sharded splits weights, gradients, master and
//    optimizer state evenly over the ranks and gathers one unit at a time (a decoder layer, the
//    embedding, the LM head) into a buffer that holds 1 + prefetch units of the largest size.
//  - Activations: each decoder layer saves the tensors listed at layer_activations() for its
//    backward; checkpointing decides which of them survive the forward (see Checkpointing).
//  - The loss is computed over `loss_chunk_tokens` tokens at a time (0: the engine's default,
//    loss_chunk_rows_for): logits in the activation dtype, their gradient written over them.
// All sizes are bytes per rank, as doubles because NF4 packs fractional bytes per value.
#pragma once
#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "rig/model/config.h"

namespace rig::plan {

enum class Method { full, lora, qlora };
enum class Checkpointing {
  none,       // every layer keeps all its saved tensors
  full,       // every layer keeps only its input; backward recomputes the layer's forward
  selective,  // keep GEMM and attention outputs, recompute the norms and the SwiGLU product
};
enum class Optimizer { adamw, adamw8bit };
enum class Strategy { data_parallel, sharded };
enum class Precision { bf16, fp32 };

// The seven linear layers of a LLaMA block, as LoRA targets.
enum LoraTarget : unsigned { kQ = 1, kK = 2, kV = 4, kO = 8, kGate = 16, kUp = 32, kDown = 64 };
// "q,k,v,o", "all" (all seven), "attn" (q,k,v,o), "mlp" (gate,up,down); "q_proj" is accepted too.
unsigned parse_lora_targets(const std::string& text);
std::string lora_targets_string(unsigned targets);

struct TrainSetup {
  Method method = Method::qlora;
  int64_t lora_rank = 16;
  unsigned lora_targets = kQ | kK | kV | kO;
  int64_t seq_len = 2048, micro_batch = 1, grad_accum = 1;
  Checkpointing checkpointing = Checkpointing::full;
  int64_t recompute_layers = -1;  // full: layers that recompute, the rest selective (-1: all)
  Optimizer optimizer = Optimizer::adamw;
  Strategy strategy = Strategy::data_parallel;
  Precision precision = Precision::bf16;
  int world_size = 1;
  bool flash_attention = true;       // false: eager attention saves the B·heads·T² probabilities
  int64_t loss_chunk_tokens = 0;     // tokens per logits chunk of the loss (0: the default)
  int prefetch_units = 1;            // sharded: units gathered ahead of the one in use
  double bucket_bytes = 25.0 * 1024 * 1024;  // data parallel: gradient all-reduce bucket
  double nccl_bytes = 64.0 * 1024 * 1024;    // NCCL's own buffers (channels × 2 × BUFFSIZE)
  // Device overheads outside tensors; set both to 0 to predict the CPU engine's allocator.
  double context_bytes = 512.0 * 1024 * 1024;  // CUDA context, kernels, cuBLAS handles
  double gemm_workspace_bytes = 32.0 * 1024 * 1024;

  int act_bytes() const { return precision == Precision::bf16 ? 2 : 4; }
  int param_bytes() const { return act_bytes(); }
  int master_bytes() const { return precision == Precision::fp32 ? 0 : 4; }
  bool trains_base() const { return method == Method::full; }
};

// Bits per weight of NF4 storage: 4 bits, an 8-bit absmax per 64 weights, and per 256 of those
// blocks an fp32 absmax-of-absmax (double quantization); 4 + 8/64 + 32/(64·256) = 4.127 bits.
double nf4_bits_per_weight(bool double_quant = true);

// Parameter counts of the model's parts.
struct ParamCounts {
  int64_t linear_per_layer = 0;  // the seven projections' weights (what NF4 quantizes)
  int64_t other_per_layer = 0;   // norms and biases
  int64_t embedding = 0, lm_head = 0, final_norm = 0;  // lm_head is 0 when tied
  int64_t lora_per_layer = 0;
  int64_t layers = 0;
  int64_t total() const {
    return layers * (linear_per_layer + other_per_layer) + embedding + lm_head + final_norm;
  }
  int64_t lora_total() const { return layers * lora_per_layer; }
};
ParamCounts count_params(const ModelConfig& m, const TrainSetup& s);

// The tensors one decoder layer saves for its backward, in bytes, per checkpointing mode.
// With a = activation bytes, BT = micro_batch · seq_len, q = heads·head_dim, kv =
// kv_heads·head_dim, f = intermediate, r = LoRA rank, n_t = number of LoRA targets, the layer saves
// (no checkpointing):
//   x      BT·h·4    layer input, fp32 residual (RMSNorm 1)    rstd1, rstd2   2·BT·4 (fp32)
//   xn1    BT·h·a    normed input of q,k,v  [full, or LoRA on q/k/v]
//   q,k,v  BT·(q+2kv)·a after RoPE          attn  BT·q·a   attention output (input of o)
//   lse    B·heads·T·4  flash-attention log-sum-exp (eager instead: B·heads·T²·a probabilities)
//   h1     BT·h·4    fp32 residual after attention (RMSNorm 2 backward)
//   xn2    BT·h·a    normed input of gate,up [full, or LoRA on gate/up]
//   g,u    2·BT·f·a  gate and up outputs (SwiGLU backward)
//   s      BT·f·a    silu(g)·u, input of down [full, or LoRA on down]
//   x·A    BT·r·a    per LoRA target (gradient of B)
// Full fine-tuning: BT·(a·(2h + 2q + 2kv + 3f) + 8h + 8 + 4·heads) bytes per layer.
struct LayerActivations {
  double saved_none = 0;       // all of the above
  double saved_selective = 0;  // without xn1, xn2, s (recomputed from x, h1, g, u)
  double saved_full = 0;       // x only
  double backward_work = 0;    // gradients alive while one layer runs backward
};
LayerActivations layer_activations(const ModelConfig& m, const TrainSetup& s);

struct MemoryEstimate {
  // Named byte terms, per rank.
  double weights = 0;          // frozen + trainable base weights (bf16/fp32 or NF4) this rank holds
  double lora = 0;             // LoRA A and B in the parameter dtype
  double gradients = 0;        // of the trainable parameters
  double master = 0;           // fp32 copies of the trainable parameters
  double optimizer = 0;        // AdamW m, v
  double activations = 0;      // saved by all layers across the forward, plus the final norm's
  double layer_peak = 0;       // one layer's recompute and backward working set
  double logits = 0;           // one loss chunk
  double comm_buffers = 0;     // gather / bucket / NCCL buffers
  double workspace = 0;        // GEMM workspace and the NF4 dequantization buffer
  double context = 0;          // device context outside the allocator
  LayerActivations per_layer;  // the per-layer activation formula's values
  ParamCounts params;

  // What the engine's allocator would count at its peak: everything but `context`.
  double allocator_peak() const {
    return weights + lora + gradients + master + optimizer + activations +
           std::max(layer_peak, logits) + comm_buffers + workspace;
  }
  double total() const { return allocator_peak() + context; }
  std::vector<std::pair<std::string, double>> terms() const;
};

MemoryEstimate estimate_memory(const ModelConfig& m, const TrainSetup& s);

const char* to_string(Method);
const char* to_string(Checkpointing);
const char* to_string(Optimizer);
const char* to_string(Strategy);
const char* to_string(Precision);
Method parse_method(const std::string&);
Checkpointing parse_checkpointing(const std::string&);
Optimizer parse_optimizer(const std::string&);
Strategy parse_strategy(const std::string&);
Precision parse_precision(const std::string&);

}  // namespace rig::plan
