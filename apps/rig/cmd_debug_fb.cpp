// rig debug forward-backward: one forward and backward (float32 unless --dtype bf16), written as
// Hugging Face names them, so a model port can be checked against transformers.
#include "command.h"
#include "device_flags.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/train/inference.h"

namespace {

struct O {
  std::string model, adapter, batch, out, device = "auto", dtype = "f32";
};

int run(const O& o) {
  const rig::ComputeTarget target =
      rig::resolve_compute(o.device, o.dtype, "debug forward-backward");
  auto m = rig::LlamaModel::load(o.model);
  if (!o.adapter.empty()) m->load_adapter(o.adapter);
  auto batch_file = rig::SafeTensorsFile::open(o.batch);
  rig::TokenBatch b;
  for (const char* key : {"input_ids", "labels"}) {
    if (!batch_file.has(key)) rig::bad_input("{}: missing tensor '{}'", o.batch, key);
    rig::Tensor t = batch_file.get(key);
    if (t.dtype() != rig::DType::I64 || t.ndim() != 2)
      rig::bad_input("{}: '{}' must be int64 [B, T], found {} {}", o.batch, key,
                     rig::dtype_name(t.dtype()), rig::shape_str(t.shape()));
    (std::string(key) == "input_ids" ? b.input_ids : b.labels) = t.clone(key);
  }
  if (b.labels.shape() != b.input_ids.shape())
    rig::bad_input("{}: labels {} and input_ids {} differ in shape", o.batch,
                   rig::shape_str(b.labels.shape()), rig::shape_str(b.input_ids.shape()));
  // The trainable parameters keep their float32 values and get float32 gradients on any target.
  rig::place_for_inference(*m, target, /*keep_trainable=*/true);
  m->zero_grad();
  rig::Tensor logits;
  rig::StepOptions opt;
  opt.logits = &logits;
  auto r = m->step(b, opt);
  std::vector<std::pair<std::string, rig::Tensor>> outs;
  outs.emplace_back("loss", rig::Tensor::from_f32({float(r.loss())}, {1}));
  outs.emplace_back("logits", logits);
  for (auto& p : m->params())
    if (p.grad.defined())
      outs.emplace_back("grad." + p.name, p.grad.to(rig::Device::cpu(), p.name));
  rig::save_safetensors(o.out, outs);
  fmt::print("loss {:.6f} over {} tokens; wrote {} tensors to {} (computed on {})\n", r.loss(),
             r.tokens, outs.size(), o.out, target.str());
  return 0;
}

rig::cli::Registrar reg(
    "debug forward-backward",
    "One forward and backward (float32 by default); writes loss, logits and "
    "gradients",
    [](CLI::App& app) {
      auto o = std::make_shared<O>();
      app.add_option("--model", o->model, "Hugging Face model folder")->required();
      app.add_option("--adapter", o->adapter, "PEFT LoRA adapter folder");
      app.add_option("--batch", o->batch, "safetensors with input_ids, labels")->required();
      app.add_option("--out", o->out, "output safetensors file")->required();
      rig::cli::add_device_flag(app, o->device);
      rig::cli::add_compute_dtype_flag(
          app, o->dtype,
          "default f32, the precision transformers is checked in; auto: bf16 on "
          "CUDA, f32 on the CPU");
      return [o] { return run(*o); };
    });

}  // namespace
