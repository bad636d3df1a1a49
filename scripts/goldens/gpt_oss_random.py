"""Random gpt-oss checkpoints and what transformers computes on them.

Makes the test data of `crates/kiln-models/tests/gpt_oss.rs`: a small
random `GptOssForCausalLM` (attention sinks, alternating sliding and full
layers with a 4-token window, q/k/v/o biases, YaRN RoPE, a biased router
with softmax over the top k, experts with biases and the clamped SwiGLU
over interleaved gate/up columns), saved two ways:

- `plain/`: `save_pretrained` as f32 safetensors (experts as transformers
  stores them: `gate_up_proj [E, hidden, 2i]`, `down_proj [E, i, hidden]`);
- `mxfp4/`: the same model with its experts in MXFP4 as the released
  checkpoints ship them (`*_blocks [E, out, in/32, 16]` of packed e2m1
  nibbles, `*_scales [E, out, in/32]` of e8m0 exponents), quantized here
  by rounding to the nearest e2m1 value under a per-32 power-of-two scale;

and for each the log-softmax of transformers' logits (eager attention,
float64, no cache) over a prompt five times the window, the MXFP4 one on
the weights transformers' own dequantizer (`convert_moe_packed_tensors`)
reads from those bytes.

Run once with transformers >= 5.24 and CPU torch; the outputs are committed
and tests never run this:

    PYTHONPATH=<site-packages> python3 scripts/goldens/gpt_oss_random.py crates/kiln-models/tests/data/gpt_oss
"""

import json
import os
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors
from common import write_tokenizer  # scripts/goldens/common.py

CONFIG = {
    "vocab_size": 96, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                        "truncate": False, "original_max_position_embeddings": 64,
                        "rope_theta": 150000.0},
}

PROMPT = [1, 17, 93, 5, 64, 11, 33, 8, 77, 90, 45, 3, 88, 19, 56, 60, 27, 71, 9, 42]


def randomise(model, gen):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("router.weight"):
                p.copy_(1.0 * torch.randn(p.shape, generator=gen))
            elif name.endswith("sinks"):
                p.copy_(1.0 * torch.randn(p.shape, generator=gen))
            elif name.endswith("gate_up_proj") or name.endswith("down_proj"):
                # Wide enough that the clamp at 7 is reached now and then.
                p.copy_(0.6 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))


def mxfp4(w):
    """`w [E, out, in]` as MXFP4 blocks `[E, out, in/32, 16]` and scales
    `[E, out, in/32]`: each 32 values share 2^(s-127), each value the
    nearest e2m1 code (low nibble first)."""
    lut = np.array(FP4_VALUES, dtype=np.float64)
    e, o, i = w.shape
    g = w.reshape(e, o, i // 32, 32).astype(np.float64)
    amax = np.abs(g).max(-1, keepdims=True)
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127)
    exp = np.clip(exp, -127, 127)
    scaled = g / np.exp2(exp)
    codes = np.abs(scaled[..., None] - lut).argmin(-1).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    scales = (exp[..., 0] + 127).astype(np.uint8)
    return blocks, scales


def golden(model, out, note):
    model = model.to(torch.float64)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits[0]
    logprobs = torch.log_softmax(logits, dim=-1)
    gaps = []

    def hook(mod, inp, o):
        top = torch.topk(o[0].double(), model.config.num_experts_per_tok + 1, dim=-1).values
        gaps.append((top[..., -2] - top[..., -1]).min().item())

    hooks = [m.register_forward_hook(hook) for n, m in model.named_modules() if n.endswith("mlp.router")]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in hooks:
        h.remove()
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump({
            "transformers": transformers.__version__, "torch": torch.__version__, "note": note,
            "prompt": PROMPT, "min_routing_margin": min(gaps),
            "logprobs": [[round(v, 7) for v in row] for row in logprobs.tolist()],
        }, f)
    print(out, "routing margin", min(gaps), "argmax", logits.argmax(-1).tolist())


def main(out_root):
    torch.set_num_threads(2)
    cfg = GptOssConfig(**CONFIG, attn_implementation="eager", experts_implementation="eager")
    gen = torch.Generator().manual_seed(20261207)
    model = GptOssForCausalLM(cfg).to(torch.float32).eval()
    randomise(model, gen)

    plain = os.path.join(out_root, "plain")
    model.save_pretrained(plain, safe_serialization=True)
    write_tokenizer(plain, cfg.vocab_size)

    # MXFP4: the checkpoint's experts, and the model given what they hold.
    quant = os.path.join(out_root, "mxfp4")
    os.makedirs(quant, exist_ok=True)
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    for l in range(cfg.num_hidden_layers):
        p = f"model.layers.{l}.mlp.experts"
        for proj in ("gate_up_proj", "down_proj"):
            w = sd.pop(f"{p}.{proj}")  # [E, in, out] as transformers multiplies
            blocks, scales = mxfp4(w.transpose(1, 2).numpy())
            sd[f"{p}.{proj}_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            sd[f"{p}.{proj}_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
            deq = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                             dtype=torch.float32)
            with torch.no_grad():
                dict(model.named_parameters())[f"{p}.{proj}"].copy_(deq)
    save_file(sd, os.path.join(quant, "model.safetensors"), metadata={"format": "pt"})
    conf = json.loads(cfg.to_json_string())
    conf["quantization_config"] = {"quant_method": "mxfp4",
                                   "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                              "model.embed_tokens", "lm_head"]}
    for key in ("attn_implementation", "experts_implementation", "_attn_implementation", "_experts_implementation"):
        conf.pop(key, None)
    with open(os.path.join(quant, "config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    write_tokenizer(quant, cfg.vocab_size)

    golden(model, quant, "experts dequantized from the MXFP4 bytes by transformers")
    model32 = GptOssForCausalLM.from_pretrained(plain, attn_implementation="eager",
                                                experts_implementation="eager").to(torch.float32).eval()
    golden(model32, plain, "f32 weights as saved")


if __name__ == "__main__":
    main(sys.argv[1])
