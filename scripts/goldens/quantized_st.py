"""Quantized Hugging Face checkpoints (AWQ, GPTQ with and without act-order, compressed-tensors
pack-quantized int4 and FP8 per channel, FP8 128x128-style blocks) and what
transformers computes on the weights they stand for.

Makes the test data of `crates/kiln-models/tests/quantized_st.rs`: one small random
Llama (f32, every projection quantized, embeddings, norms and lm_head left as they are),
written once per layout with the parts each layout stores, and transformers' log-softmax
(float64, eager attention) of the model whose projections are the dequantized weights.
The packing of every layout comes from code other than Kiln's:
- AWQ: the int weights and zeros packed in AutoAWQ's GEMM order, checked by unpacking them
  with AutoAWQ's own `dequantize_gemm` (autoawq installed --no-deps; pure torch);
- GPTQ: qweight/qzeros packed by AutoAWQ's `pack_exllama` (the GPTQ layout, zeros stored
  minus one), with a permuted `g_idx` (act-order);
- compressed-tensors: `pack_to_int32` of the compressed-tensors package, and transformers
  itself loads the pack-quantized and the FP8 checkpoints (compressed-tensors decompresses
  them) — its logits must equal the dequantized model's;
- FP8: the values through torch's float8_e4m3fn.

Run once with CPU torch, transformers >= 5.24, compressed-tensors and autoawq (--no-deps) on
PYTHONPATH; the outputs are committed and tests never run this:

    PYTHONPATH=<site-packages>:<autoawq> python3 scripts/goldens/quantized_st.py \\
        crates/kiln-models/tests/data/quantized [LAYOUT ...]

(naming layouts writes only those; only gptq draws from the generator after the base weights,
so writing any other alone gives the bytes the full run gives).
"""

import json
import os
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

def _awq_packing():
    """AutoAWQ's packing_utils.py alone (the package's __init__ pulls in its GPU stack)."""
    import importlib.util
    spec = next(p for p in sys.path if os.path.exists(os.path.join(p, "awq/utils/packing_utils.py")))
    s = importlib.util.spec_from_file_location("packing_utils", os.path.join(spec, "awq/utils/packing_utils.py"))
    m = importlib.util.module_from_spec(s)
    s.loader.exec_module(m)
    return m


_pu = _awq_packing()
AWQ_ORDER, dequantize_gemm, pack_exllama = _pu.AWQ_ORDER, _pu.dequantize_gemm, _pu.pack_exllama
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from common import write_tokenizer  # scripts/goldens/common.py

CONFIG = {
    "vocab_size": 96, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
}
GROUP = 32
BLOCK = [32, 32]
PROMPT = [1, 17, 93, 5, 64, 11, 33, 8, 77, 90, 45, 3, 88, 19, 56, 60, 27, 71, 9, 42]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def projections(model):
    for name, mod in model.named_modules():
        if name.split(".")[-1] in PROJ:
            yield name, mod


def awq(w, group=GROUP):
    """Asymmetric 4-bit groups along the input: parts and the dequantized weight."""
    out, inp = w.shape
    wt = w.t().reshape(inp // group, group, out)  # [groups, g, out]
    lo, hi = wt.amin(1), wt.amax(1)
    scale = ((hi - lo) / 15).clamp(min=1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(0, 15).to(torch.int32)
    q = (torch.round(wt / scale.float()[:, None]) + zero[:, None]).clamp(0, 15).to(torch.int32)
    q = q.reshape(inp, out)
    def pack_awq(x):  # [rows, out] -> [rows, out / 8], AutoAWQ's GEMM order
        p = torch.zeros(x.shape[0], x.shape[1] // 8, dtype=torch.int32)
        for col in range(x.shape[1] // 8):
            for i in range(8):
                p[:, col] |= x[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
        return p
    qweight, qzeros = pack_awq(q), pack_awq(zero)
    deq = ((q.reshape(inp // group, group, out) - zero[:, None]).float() * scale.float()[:, None])
    deq = deq.reshape(inp, out)
    theirs = dequantize_gemm(qweight, qzeros, scale, 4, group).float()
    # (AutoAWQ multiplies in f16: the same values rounded to f16.)
    assert torch.equal(theirs, deq.half().float()), "AutoAWQ unpacks what was packed"
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale}, deq.t().contiguous()


def gptq(w, gen, act_order=True):
    """Symmetric 4-bit; with act-order inputs are assigned to groups by a permutation."""
    out, inp = w.shape
    if act_order:
        perm = torch.randperm(inp, generator=gen)
        g_idx = (torch.argsort(perm) // GROUP).to(torch.int32)  # input i's group
    else:
        g_idx = (torch.arange(inp) // GROUP).to(torch.int32)
    groups = inp // GROUP
    scale = torch.zeros(groups, out)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        scale[g] = w[:, cols].abs().amax(1) / 7
    scale = scale.clamp(min=1e-6).half()
    s_in = scale.float()[g_idx.long()]  # [inp, out]
    q = (torch.round(w.t() / s_in) + 8).clamp(0, 15).to(torch.int32)  # [inp, out]
    zeros = torch.full((groups, out), 8, dtype=torch.int32)
    qweight, qzeros = pack_exllama(q, zeros - 1, 4)
    deq = ((q - 8).float() * s_in).t().contiguous()
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale, "g_idx": g_idx}, deq


def gptq_asym(w, group=128):
    """Asymmetric 4-bit groups in input order (no act-order), zero points 1..15 (GPTQ stores
    them minus one: a zero of 0 would not survive)."""
    out, inp = w.shape
    wt = w.t().reshape(inp // group, group, out)
    lo, hi = wt.amin(1), wt.amax(1)
    scale = ((hi - lo) / 14).clamp(min=1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(1, 15).to(torch.int32)  # [groups, out]
    q = (torch.round(wt / scale.float()[:, None]) + zero[:, None]).clamp(0, 15).to(torch.int32)
    deq = ((q - zero[:, None]).float() * scale.float()[:, None]).reshape(inp, out)
    q = q.reshape(inp, out)
    g_idx = (torch.arange(inp) // group).to(torch.int32)
    qweight, qzeros = pack_exllama(q, zero - 1, 4)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scale, "g_idx": g_idx}, deq.t().contiguous()


def packed(w):
    """compressed-tensors pack-quantized: symmetric int4 groups, int32 along the input."""
    out, inp = w.shape
    wg = w.reshape(out, inp // GROUP, GROUP)
    scale = (wg.abs().amax(2) / 7).clamp(min=1e-6).half()
    q = torch.round(wg / scale.float()[:, :, None]).clamp(-8, 7)
    deq = (q * scale.float()[:, :, None]).reshape(out, inp)
    q = q.reshape(out, inp).to(torch.int8)
    return {"weight_packed": pack_to_int32(q, 4), "weight_scale": scale,
            "weight_shape": torch.tensor([out, inp], dtype=torch.int64)}, deq


def fp8_channel(w):
    scale = (w.abs().amax(1, keepdim=True) / 448).clamp(min=1e-12)
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


def fp8_block(w):
    out, inp = w.shape
    bo, bi = BLOCK
    wb = w.reshape(out // bo, bo, inp // bi, bi)
    scale = (wb.abs().amax((1, 3)) / 448).clamp(min=1e-12)  # [out / bo, in / bi]
    q = (wb / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (q.float() * scale[:, None, :, None]).reshape(out, inp)
    return {"weight": q.reshape(out, inp), "weight_scale_inv": scale}, deq


CT_GROUP = {"targets": ["Linear"], "input_activations": None, "output_activations": None}
LAYOUTS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True,
            "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
             "sym": True, "checkpoint_format": "gptq"},
    "gptq_noact": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                   "sym": True, "checkpoint_format": "gptq"},
    "ct_int4": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "quantization_status": "compressed", "ignore": ["lm_head"],
                "config_groups": {"group_0": {**CT_GROUP, "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": GROUP, "dynamic": False}}}},
    "ct_fp8": {"quant_method": "compressed-tensors", "format": "float-quantized",
               "quantization_status": "compressed", "ignore": ["lm_head"],
               "config_groups": {"group_0": {**CT_GROUP, "weights": {
                   "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel",
                   "dynamic": False}}}},
    "fp8_block": {"quant_method": "fp8", "activation_scheme": "dynamic",
                  "weight_block_size": BLOCK},
    # Groups of 128 with zero points: Kiln's Q4_Z blocks.
    "awq_g128": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                 "version": "gemm"},
    "gptq_asym": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                  "sym": False, "checkpoint_format": "gptq"},
}


def logprobs_of(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(ids, use_cache=False).logits[0].double(), -1)


def main(out_root, only=()):
    torch.set_num_threads(2)
    cfg = LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")},
                      attn_implementation="eager")
    gen = torch.Generator().manual_seed(20261206)
    base = LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    ids = torch.tensor([PROMPT])
    for layout, qcfg in LAYOUTS.items():
        if only and layout not in only:
            continue
        out = os.path.join(out_root, layout)
        os.makedirs(out, exist_ok=True)
        model = LlamaForCausalLM(cfg).to(torch.float32).eval()
        model.load_state_dict(base.state_dict())
        tensors = {}
        with torch.no_grad():
            for name, mod in projections(model):
                w = mod.weight.detach().clone()
                parts, deq = {"awq": awq, "gptq": lambda w: gptq(w, gen),
                              "gptq_noact": lambda w: gptq(w, gen, False), "ct_int4": packed,
                              "ct_fp8": fp8_channel, "fp8_block": fp8_block,
                              "awq_g128": lambda w: awq(w, 128), "gptq_asym": gptq_asym}[layout](w)
                for k, v in parts.items():
                    tensors[f"{name}.{k}"] = v.contiguous()
                mod.weight.copy_(deq)
            for name, p in model.state_dict().items():
                if not any(f".{proj}." in name for proj in PROJ):
                    tensors[name] = p.contiguous()
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump({**CONFIG, "quantization_config": qcfg}, f, indent=1)
        write_tokenizer(out, cfg.vocab_size)
        lp = logprobs_of(model.to(torch.float64), ids)
        check = None
        if layout.startswith("ct_"):
            # transformers + compressed-tensors read the checkpoint themselves.
            theirs = transformers.AutoModelForCausalLM.from_pretrained(
                out, attn_implementation="eager", dtype=torch.float32).eval()
            tlp = logprobs_of(theirs.to(torch.float64), ids)
            check = float((tlp - lp).abs().max())
            assert check < 1e-4, f"{layout}: transformers' own load differs by {check}"
        with open(os.path.join(out, "golden.json"), "w") as f:
            json.dump({
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "prompt": PROMPT,
                "transformers_own_load_max_diff": check,
                "logprobs": [[round(v, 7) for v in row] for row in lp.tolist()],
            }, f)
        print(layout, "saved to", out, "own-load check", check, "argmax", lp.argmax(-1).tolist()[:8])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
