"""A random Qwen3.5 text checkpoint with a multi-token-prediction head, and
what its head computes, built from transformers' own Qwen3.5 modules.

Makes `crates/kiln-models/tests/data/hybrid/qwen3_5_mtp`: the `qwen3_5`
shape of `hybrid_random.py` (three gated-DeltaNet layers, then a gated
full-attention layer) with `mtp_num_hidden_layers: 1` and the `mtp.*`
tensors Qwen3.5 checkpoints ship. transformers loads no MTP head (it drops
`mtp.*`), so the head is composed here from its modules as Qwen3.5's head is
defined (vLLM's `qwen3_5_mtp`): for position p with final hidden state h_p
(`last_hidden_state`: after the model's final norm) and the token t after
it,

    x = fc([norm_e(embed(t)), norm_h(h_p)])          (fc: [hidden, 2 * hidden], no bias)
    x = Qwen3_5DecoderLayer (full attention, its own KV; RoPE at p)
    out = norm(x);  logits = lm_head(out)             (the token two after p)

and a second depth feeds `out` back as the hidden state with the next
token. Norms are `Qwen3_5RMSNorm` (scale `1 + w`). Computed in float64 with
eager attention and a causal mask; the outputs are committed and tests never
run this:

    python3 scripts/goldens/mtp_random.py crates/kiln-models/tests/data/hybrid
"""

import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

sys.path.insert(0, os.path.dirname(__file__))
from hybrid_random import CONFIG, PROMPT, randomise  # noqa: E402
from common import write_tokenizer  # noqa: E402

# The token fed at the second depth (after the last prompt position's guess).
DEPTH2_TOKEN = 42


class MtpHead(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps)
        # A full-attention layer: the index of one in `layer_types`.
        full = cfg.layer_types.index("full_attention")
        self.layers = torch.nn.ModuleList([Qwen3_5DecoderLayer(cfg, full)])
        self.norm = Qwen3_5RMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, model, tokens, hidden, positions):
        """tokens[i] is the token after position positions[i]; hidden[i] its
        final hidden state. Returns (logits, out) of every row."""
        e = self.pre_fc_norm_embedding(model.model.embed_tokens(tokens))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        pos = positions.unsqueeze(0)
        # Multimodal RoPE's three position ids, equal for text.
        rope = model.model.rotary_emb(x, pos[None].expand(3, 1, -1))
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        x = self.layers[0](x, position_embeddings=rope, attention_mask=mask, position_ids=pos)
        out = self.norm(x)
        return model.lm_head(out), out


def main(root):
    torch.set_num_threads(2)
    out = os.path.join(root, "qwen3_5_mtp")
    cfg = Qwen3_5TextConfig(**CONFIG, attn_implementation="eager")
    gen = torch.Generator().manual_seed(20261211)
    model = Qwen3_5ForCausalLM(cfg).to(torch.float32).eval()
    randomise(model, gen)
    head = MtpHead(cfg).to(torch.float32).eval()
    randomise(head, gen)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    # The head's tensors beside the model's, under Qwen3.5's names.
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    tensors.update({f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items()})
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    config["mtp_num_hidden_layers"] = 1
    config["mtp_use_dedicated_embeddings"] = False
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    write_tokenizer(out, cfg.vocab_size)

    model, head = model.to(torch.float64), head.to(torch.float64)
    ids = torch.tensor([PROMPT])
    n = len(PROMPT)
    with torch.no_grad():
        hidden = model.model(ids, use_cache=False).last_hidden_state  # [1, n, h]
        logits = model.lm_head(hidden)[0]
        # Depth 1 at positions 0..n-2: the token after each, its hidden state.
        pos = torch.arange(n - 1)
        l1, o1 = head(model, ids[:, 1:], hidden[:, :-1], pos)
        # Depth 2 at position n-1: the guess after the last one, fed with
        # the head's own output at n-2 (rows 0..n-2 are as at depth 1).
        tokens2 = torch.cat([ids[:, 1:], torch.tensor([[DEPTH2_TOKEN]])], dim=1)
        hidden2 = torch.cat([hidden[:, :-1], o1[:, -1:]], dim=1)
        l2, _ = head(model, tokens2, hidden2, torch.arange(n))
        assert torch.allclose(l2[0, :-1], l1[0], atol=1e-9)
    ls = lambda t: [[round(v, 7) for v in row] for row in torch.log_softmax(t, -1).tolist()]
    with open(os.path.join(out, "golden.json"), "w") as f:
        json.dump({
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "prompt": PROMPT,
            "logprobs": ls(logits),
            "mtp_logprobs": ls(l1[0]),
            "depth2_token": DEPTH2_TOKEN,
            "depth2_logprobs": ls(l2[0, -1:])[0],
        }, f)
    print("saved to", out, "mtp argmax", l1[0].argmax(-1).tolist())
    # How often the head's guess is the model's own choice two ahead (random
    # weights: near chance).
    main_next = logits.argmax(-1)
    print("agreement with the model two ahead",
          (l1[0].argmax(-1) == main_next[1:]).float().mean().item())


if __name__ == "__main__":
    main(sys.argv[1])
