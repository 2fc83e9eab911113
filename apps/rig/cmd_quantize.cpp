// rig quantize: a bf16/fp32 model folder written once in bitsandbytes' 4-bit (NF4) form.
#include "command.h"
#include "flags.h"
#include "rig/core/allocator.h"
#include "rig/quant/quantize_model.h"

namespace {

struct Opts {
  std::string model, out, type = "nf4", compute_dtype = "bfloat16";
  int64_t blocksize = 64;
  bool no_double_quant = false;
  double max_shard_gb = 5;
};

int run(const Opts& o) {
  rig::quant::QuantizeModelOptions qo;
  if (!rig::quant::parse_quant_type(o.type, &qo.config.type))
    rig::bad_input("--quant-type '{}' is not nf4 or fp4", o.type);
  if (o.blocksize < 16 || (o.blocksize & (o.blocksize - 1)))
    rig::bad_input("--blocksize {} must be a power of two from 16", o.blocksize);
  if (o.compute_dtype != "bfloat16" && o.compute_dtype != "float16" && o.compute_dtype != "float32")
    rig::bad_input("--compute-dtype '{}' is not bfloat16, float16 or float32", o.compute_dtype);
  qo.config.blocksize = o.blocksize;
  qo.config.double_quant = !o.no_double_quant;
  qo.config.compute_dtype = o.compute_dtype;
  qo.max_shard_bytes = size_t(o.max_shard_gb * 1e9);
  auto r = rig::quant::quantize_model(o.model, o.out, qo);
  fmt::print(
      "quantized {} linear weights ({} parameters) to {}{}, blocks of {}; kept {} tensors; "
      "{} -> {} in {} file(s): {}\n",
      r.quantized, r.quantized_params, rig::quant::quant_type_name(qo.config.type),
      qo.config.double_quant ? " with double quantization" : "", qo.config.blocksize, r.kept,
      rig::format_bytes(double(r.bytes_in)), rig::format_bytes(double(r.bytes_out)), r.shards,
      o.out);
  return 0;
}

rig::cli::Registrar reg(
    "quantize",
    "Write a model folder in bitsandbytes 4-bit form (NF4, double quantization), as transformers "
    "saves it",
    [](CLI::App& app) {
      auto o = std::make_shared<Opts>();
      app.add_option("--model", o->model, "Hugging Face model folder (bf16/fp16/fp32)")->required();
      app.add_option("--out", o->out, "output folder")->required();
      app.add_option("--quant-type", o->type, "nf4 or fp4")->capture_default_str();
      using namespace rig::cli;
      add_number(app, "--blocksize", o->blocksize, "weights per absmax block (a power of two)",
                 in_range(16, 1 << 20))
          ->capture_default_str();
      app.add_flag("--no-double-quant", o->no_double_quant, "keep the block scales in float32");
      app.add_option("--compute-dtype", o->compute_dtype,
                     "bnb_4bit_compute_dtype recorded in config.json")
          ->capture_default_str();
      add_number(app, "--max-shard-size", o->max_shard_gb, "GB per safetensors file",
                 in_range(0, 1e6).open_low())
          ->capture_default_str();
      return [o] { return run(*o); };
    });

}  // namespace
