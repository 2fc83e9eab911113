// rig debug forward-backward: one float32 forward and backward, written as Hugging Face names
// them, so a model port can be checked against transformers.
#include "command.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"

namespace {

int run(const std::string& model_dir, const std::string& adapter, const std::string& batch_path,
        const std::string& out) {
  auto m = rig::LlamaModel::load(model_dir);
  if (!adapter.empty()) m->load_adapter(adapter);
  auto batch_file = rig::SafeTensorsFile::open(batch_path);
  rig::TokenBatch b;
  for (const char* key : {"input_ids", "labels"}) {
    if (!batch_file.has(key)) rig::bad_input("{}: missing tensor '{}'", batch_path, key);
    rig::Tensor t = batch_file.get(key);
    if (t.dtype() != rig::DType::I64 || t.ndim() != 2)
      rig::bad_input("{}: '{}' must be int64 [B, T], found {} {}", batch_path, key,
                     rig::dtype_name(t.dtype()), rig::shape_str(t.shape()));
    (std::string(key) == "input_ids" ? b.input_ids : b.labels) = t.clone(key);
  }
  if (b.labels.shape() != b.input_ids.shape())
    rig::bad_input("{}: labels {} and input_ids {} differ in shape", batch_path,
                   rig::shape_str(b.labels.shape()), rig::shape_str(b.input_ids.shape()));
  m->zero_grad();
  rig::Tensor logits;
  rig::StepOptions opt;
  opt.logits = &logits;
  auto r = m->step(b, opt);
  std::vector<std::pair<std::string, rig::Tensor>> outs;
  outs.emplace_back("loss", rig::Tensor::from_f32({float(r.loss())}, {1}));
  outs.emplace_back("logits", logits);
  for (auto& p : m->params())
    if (p.grad.defined()) outs.emplace_back("grad." + p.name, p.grad);
  rig::save_safetensors(out, outs);
  fmt::print("loss {:.6f} over {} tokens; wrote {} tensors to {}\n", r.loss(), r.tokens, outs.size(), out);
  return 0;
}

rig::cli::Registrar reg("debug forward-backward",
                        "One float32 forward and backward; writes loss, logits and gradients",
                        [](CLI::App& app) {
                          struct O {
                            std::string model, adapter, batch, out;
                          };
                          auto o = std::make_shared<O>();
                          app.add_option("--model", o->model, "Hugging Face model folder")->required();
                          app.add_option("--adapter", o->adapter, "PEFT LoRA adapter folder");
                          app.add_option("--batch", o->batch, "safetensors with input_ids, labels")->required();
                          app.add_option("--out", o->out, "output safetensors file")->required();
                          return [o] { return run(o->model, o->adapter, o->batch, o->out); };
                        });

}  // namespace
