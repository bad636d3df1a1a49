"""LoRA goldens: PEFT adapters on transformers models (CPU, float32), their
files (what PEFT's save_pretrained writes) and the log-softmax of the last
position of a few prompts with each adapter and with none.

    python gen_lora.py MODELS_DIR OUT_DIR

- qwen2-tiny/: a tiny random Qwen2 (q/k/v biases), saved with
  save_pretrained; qwen2-tiny-lora-{1,2,3}/: random adapters (r 8, alpha 16,
  every linear projection; adapter 3 with rsLoRA).
- smollm2-lora/: an adapter (r 4, alpha 8, q_proj and v_proj; bf16) on the
  real SmolLM2-135M-Instruct GGUF, which transformers dequantizes to f32.
- goldens.json: per model and adapter (or "base"), per prompt, the ids and
  the file under logprobs/ holding the last position's log-softmax (from
  the f32 logits in f64, stored as little-endian f32).
"""

import json
import pathlib
import sys

import torch
import transformers
import peft
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

torch.set_num_threads(2)
MODELS, OUT = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
OUT.mkdir(parents=True, exist_ok=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


FILES = []


def logprobs(model, ids):
    """The last position's log-softmax, written as little-endian f32 to
    OUT/logprobs/<n>.f32; the file's name."""
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits[0, -1].double()
    lp = torch.log_softmax(out, -1).float().numpy()
    (OUT / "logprobs").mkdir(exist_ok=True)
    name = f"{len(FILES)}.f32"
    (OUT / "logprobs" / name).write_bytes(lp.astype("<f4").tobytes())
    FILES.append(name)
    return name


def random_adapter(base, seed, r, alpha, targets, rslora=False, b_scale=1.0, dtype=None):
    torch.manual_seed(seed)
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                     use_rslora=rslora, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    m = get_peft_model(base, cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "lora_B" in n:
                p.mul_(b_scale)
            if "lora_" in n and dtype is not None:
                p.copy_(p.to(dtype).to(p.dtype))
    return m


def main():
    goldens = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "peft": peft.__version__}}
    # The tiny random Qwen2.
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      rope_theta=10000.0, tie_word_embeddings=False, rms_norm_eps=1e-6)
    base = Qwen2ForCausalLM(cfg).eval()
    base.save_pretrained(OUT / "qwen2-tiny", safe_serialization=True)
    prompts = [[1, 5, 9, 200, 33, 7, 7, 100, 64, 3], list(range(10, 60, 3))]
    g = {"base": [{"ids": p, "logprobs": logprobs(base, p)} for p in prompts]}
    for k, rs in [(1, False), (2, False), (3, True)]:
        m = random_adapter(base, 100 + k, 8, 16, ALL, rslora=rs, b_scale=0.2).eval()
        g[f"qwen2-tiny-lora-{k}"] = [{"ids": p, "logprobs": logprobs(m, p)} for p in prompts]
        m.save_pretrained(OUT / f"qwen2-tiny-lora-{k}", safe_serialization=True)
        (OUT / f"qwen2-tiny-lora-{k}" / "README.md").unlink(missing_ok=True)
        base = m.unload()
    goldens["qwen2-tiny"] = g
    # The real SmolLM2.
    smol = AutoModelForCausalLM.from_pretrained(MODELS, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
                                                dtype=torch.float32).eval()
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 7018, 28, 7018, 411, 407,
                19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520,
                9531, 198], [504, 2365, 1412, 28, 253, 1345, 4719]]
    g = {"base": [{"ids": p, "logprobs": logprobs(smol, p)} for p in prompts]}
    m = random_adapter(smol, 7, 4, 8, ["q_proj", "v_proj"], b_scale=0.05, dtype=torch.bfloat16).eval()
    g["smollm2-lora"] = [{"ids": p, "logprobs": logprobs(m, p)} for p in prompts]
    m.save_pretrained(OUT / "smollm2-lora", safe_serialization=True)
    (OUT / "smollm2-lora" / "README.md").unlink(missing_ok=True)
    # Saved as bf16 (its values are bf16 already): half the bytes.
    from safetensors.torch import load_file, save_file
    f = OUT / "smollm2-lora" / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(f).items()}, f)
    goldens["smollm2"] = g
    (OUT / "goldens.json").write_text(json.dumps(goldens))
    print("ok")


if __name__ == "__main__":
    main()
