"""A random Qwen3-MoE-shaped GGUF for CPU benchmarks against llama.cpp.

Writes a `qwen3moe` GGUF in llama.cpp's layout (stacked `ffn_*_exps`
experts, experts outermost) with random weights in Q8_0 (norms F32), and
the tokenizer metadata of a Qwen2.5 GGUF copied in, so both engines can
load it. The shape is OLMoE/Qwen3-MoE-like, cut to a few layers to fit a
small machine: hidden 2048, 64 experts of 768, 8 a token, 32 query heads
of 128 over 4 KV heads.

    PYTHONPATH=<site-packages with numpy, gguf> python3 bench/moe/make_moe_gguf.py \
        models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf OUT.gguf [LAYERS]
"""

import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

H, E, K, I, HEADS, KV, HD = 2048, 64, 8, 768, 32, 4, 128


def main(tok_src, out, layers=6):
    rng = np.random.default_rng(20261205)
    src = gguf.GGUFReader(tok_src)
    field = lambda k: src.fields[k]
    tokens = [bytes(field("tokenizer.ggml.tokens").parts[i]).decode("utf-8", "replace")
              for i in field("tokenizer.ggml.tokens").data]
    merges = [bytes(field("tokenizer.ggml.merges").parts[i]).decode("utf-8", "replace")
              for i in field("tokenizer.ggml.merges").data]
    types = [int(field("tokenizer.ggml.token_type").parts[i][0]) for i in field("tokenizer.ggml.token_type").data]
    scalar = lambda k: int(field(k).parts[field(k).data[0]][0])
    vocab = len(tokens)
    w = gguf.GGUFWriter(out, "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_key_length(HD)
    w.add_value_length(HD)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_expert_feed_forward_length(I)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(scalar("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(scalar("tokenizer.ggml.eos_token_id"))
    tmpl = field("tokenizer.chat_template")
    w.add_chat_template(bytes(tmpl.parts[tmpl.data[0]]).decode("utf-8"))

    def q8(name, shape, std):
        a = (std * rng.standard_normal(shape, dtype=np.float32))
        w.add_tensor(name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)

    def ones(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    q8("token_embd.weight", (vocab, H), 0.02)
    ones("output_norm.weight", H)
    q8("output.weight", (vocab, H), 0.02)
    for l in range(layers):
        b = f"blk.{l}"
        ones(f"{b}.attn_norm.weight", H)
        ones(f"{b}.ffn_norm.weight", H)
        ones(f"{b}.attn_q_norm.weight", HD)
        ones(f"{b}.attn_k_norm.weight", HD)
        q8(f"{b}.attn_q.weight", (HEADS * HD, H), 0.02)
        q8(f"{b}.attn_k.weight", (KV * HD, H), 0.02)
        q8(f"{b}.attn_v.weight", (KV * HD, H), 0.02)
        q8(f"{b}.attn_output.weight", (H, HEADS * HD), 0.02)
        w.add_tensor(f"{b}.ffn_gate_inp.weight", (0.5 * rng.standard_normal((E, H))).astype(np.float32))
        q8(f"{b}.ffn_gate_exps.weight", (E, I, H), 0.02)
        q8(f"{b}.ffn_up_exps.weight", (E, I, H), 0.02)
        q8(f"{b}.ffn_down_exps.weight", (E, H, I), 0.02)
        print("layer", l, file=sys.stderr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 6)
