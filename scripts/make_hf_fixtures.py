# Generates the Hugging Face reference fixtures in tests/data/hf from transformers + PEFT (float32, CPU).
# Run where PyTorch, transformers and PEFT are installed (pip install torch transformers peft safetensors),
# from the repository root: python3 scripts/make_hf_fixtures.py tests/data/hf [names...]. Tiny LLaMA-family
# models, their logits/loss/gradients, LoRA adapters, AdamW trajectories and a loss curve; with names, only
# those models (the others' fixtures stay as they are).
import os, sys, json, math, torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
from peft import LoraConfig, get_peft_model
torch.use_deterministic_algorithms(True)
OUT = sys.argv[1]
ONLY = set(sys.argv[2:])
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

def specs():
    return {
      'tiny-llama3': (LlamaConfig, LlamaForCausalLM, dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
          tie_word_embeddings=False, bos_token_id=1, eos_token_id=2), 11),
      'tiny-qwen2': (Qwen2Config, Qwen2ForCausalLM, dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=4096,
          tie_word_embeddings=True, use_sliding_window=False), 12),
      # head_dim 32 is not hidden/heads (16): the explicit head_dim of Qwen3 is exercised.
      'tiny-qwen3': (Qwen3Config, Qwen3ForCausalLM, dict(vocab_size=1000, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1000000.0,
          max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False, use_sliding_window=False), 13),
    }

def batch(V, seed, B=2, T=24):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=g)
    labels = ids.clone(); labels[0, :5] = -100; labels[1, -3:] = -100
    return ids, labels

def grads_of(model, prefix_filter=None):
    return {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters() if p.grad is not None and (prefix_filter is None or prefix_filter(n))}

for name, (C, M, kw, seed) in specs().items():
    if ONLY and name not in ONLY: continue
    d = os.path.join(OUT, name); os.makedirs(d, exist_ok=True)
    torch.manual_seed(seed)
    cfg = C(**kw); cfg._attn_implementation = "eager"
    model = M(cfg).float().eval()
    # make norms non-trivial so a missing norm weight shows up
    with torch.no_grad():
        for n, p in model.named_parameters():
            if 'norm' in n: p.add_(0.1 * torch.randn_like(p))
            if n.endswith('bias'): p.add_(0.05 * torch.randn_like(p))
    model.save_pretrained(os.path.join(d, 'model'), safe_serialization=True)
    ids, labels = batch(cfg.vocab_size, seed)
    ref = {'input_ids': ids.to(torch.int64), 'labels': labels.to(torch.int64)}
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    ref['logits'] = out.logits.detach().contiguous(); ref['loss'] = out.loss.detach().reshape(1)
    for n, g in grads_of(model).items(): ref['grad.' + n] = g
    save_file(ref, os.path.join(d, 'forward_backward.safetensors'))
    model.zero_grad(set_to_none=True)
    # full fine-tune trajectory: AdamW(lr=1e-3, betas=(0.9,0.95), eps=1e-8, weight_decay=0.1 on every parameter), clip 1.0, 5 steps
    m2 = M(cfg).float(); m2.load_state_dict(model.state_dict()); m2.train()
    opt = torch.optim.AdamW(m2.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    traj = {}; losses = []; norms = []
    for step in range(5):
        i2, l2 = batch(cfg.vocab_size, seed * 100 + step)
        loss = m2(input_ids=i2, labels=l2).loss; loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(m2.parameters(), 1.0)))
        opt.step(); opt.zero_grad(set_to_none=True); losses.append(float(loss))
        traj[f'input_ids.{step}'] = i2; traj[f'labels.{step}'] = l2
    for n, p in m2.named_parameters(): traj['param.' + n] = p.detach().clone().contiguous()
    save_file(traj, os.path.join(d, 'adamw_5steps.safetensors'))
    # LoRA (PEFT): r=4, alpha=8, all linear projections, B made non-zero
    base = M(cfg).float(); base.load_state_dict(model.state_dict())
    lcfg = LoraConfig(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    pm = get_peft_model(base, lcfg)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if 'lora_B' in n: p.copy_(0.05 * torch.randn(p.shape, generator=g))
    pm.save_pretrained(os.path.join(d, 'lora_adapter'))
    pm.eval()
    out = pm(input_ids=ids, labels=labels); out.loss.backward()
    lref = {'logits': out.logits.detach().contiguous(), 'loss': out.loss.detach().reshape(1)}
    for n, gr in grads_of(pm, lambda n: 'lora_' in n).items(): lref['grad.' + n] = gr
    # LoRA AdamW trajectory: lr=1e-2, betas=(0.9,0.999), eps=1e-8, weight_decay=0.0, clip 1.0, 5 steps
    pm.zero_grad(set_to_none=True); pm.train()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, foreach=False)
    llosses = []
    for step in range(5):
        i2, l2 = batch(cfg.vocab_size, seed * 100 + step)
        loss = pm(input_ids=i2, labels=l2).loss; loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in pm.parameters() if p.requires_grad], 1.0)
        opt.step(); opt.zero_grad(set_to_none=True); llosses.append(float(loss))
    for n, p in pm.named_parameters():
        if p.requires_grad: lref['trained.' + n] = p.detach().clone().contiguous()
    save_file(lref, os.path.join(d, 'lora_forward_backward.safetensors'))
    meta = {'model': name, 'hf_class': M.__name__, 'seed': seed,
            'forward_backward': 'input_ids/labels [2,24]; labels -100 are ignored; loss = mean token cross-entropy over positions whose shifted label != -100 (logits[:, :-1] vs labels[:, 1:])',
            'adamw_5steps': {'optimizer': 'torch.optim.AdamW', 'lr': 1e-3, 'betas': [0.9, 0.95], 'eps': 1e-8, 'weight_decay': 0.1, 'weight_decay_applies_to': 'every parameter', 'clip_grad_norm': 1.0, 'losses': losses, 'grad_norms_before_clip': norms},
            'lora': {'r': 4, 'alpha': 8, 'targets': ALL, 'lora_B_init': 'N(0, 0.05^2), not zero', 'adamw': {'lr': 1e-2, 'betas': [0.9, 0.999], 'eps': 1e-8, 'weight_decay': 0.0, 'clip_grad_norm': 1.0, 'steps': 5, 'losses': llosses}}}
    json.dump(meta, open(os.path.join(d, 'reference.json'), 'w'), indent=1)
    print(name, 'loss', float(ref['loss'][0]), 'adamw', losses, 'lora', llosses)

# loss curve: tiny-llama3 from its saved init, 300 steps, structured token stream, constant lr 3e-3 after 20 warmup steps
for name, seed in [('tiny-llama3', 11)]:
    if ONLY and name not in ONLY: continue
    d = os.path.join(OUT, name)
    C, M, kw, _ = specs()[name]
    cfg = C(**kw); cfg._attn_implementation = "eager"
    m = M.from_pretrained(os.path.join(d, 'model'), dtype=torch.float32, attn_implementation='eager').train()
    V = cfg.vocab_size; g = torch.Generator().manual_seed(seed + 7)
    # a learnable stream: runs of arithmetic progressions with random start and stride
    stream = []
    while len(stream) < 300 * 4 * 33:
        a = int(torch.randint(3, V, (1,), generator=g)); s = int(torch.randint(1, 7, (1,), generator=g))
        stream += [3 + (a + s * k - 3) % (V - 3) for k in range(int(torch.randint(8, 40, (1,), generator=g)))]
    data = torch.tensor(stream[:300 * 4 * 33]).view(300, 4, 33)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda st: min(1.0, (st + 1) / 20))
    curve = []
    for step in range(300):
        x = data[step, :, :32]; y = data[step, :, :32]
        loss = m(input_ids=x, labels=y).loss; loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step(); sched.step(); opt.zero_grad(set_to_none=True)
        curve.append(float(loss))
    save_file({'tokens': data.contiguous()}, os.path.join(d, 'loss_curve_data.safetensors'))
    json.dump({'steps': 300, 'batch': 4, 'seq': 32, 'tokens': 'loss_curve_data.safetensors: tokens[step, b, :32] is both input and label (HF shifts internally)',
               'optimizer': {'lr': 3e-3, 'warmup': 'linear, lr*min(1,(step+1)/20)', 'betas': [0.9, 0.95], 'eps': 1e-8, 'weight_decay': 0.0, 'clip_grad_norm': 1.0},
               'init': 'model/ (the saved initial weights)', 'losses': curve}, open(os.path.join(d, 'loss_curve.json'), 'w'), indent=1)
    print(name, 'curve', curve[0], curve[50], curve[-1])
