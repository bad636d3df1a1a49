"""DeepSeek-style multi-token-prediction layers for the golden scripts
(`glm4_moe_random.py`, `deepseek_random.py`): one built and randomised by
transformers' own `MtpModel` (`modeling_layers.py`), saved beside a random
model under the names released checkpoints use (`model.layers.{N}.{enorm,
hnorm, eh_proj, shared_head.norm}` and the block, experts one by one), read
back with `MtpModel.from_pretrained` to prove the names, and its outputs:

- depth 1 at positions 0..n-2: position p's final hidden state
  (`hidden_states[-1]`, as transformers' `MTPCandidateGenerator` feeds it)
  with the token after it, at transformers' position p + 1;
- depth 2 at position n-1, fed with the layer's own output at n-2
  (transformers drafts with each layer once; a further guess with the same
  layer is what Kiln's proposer runs).
"""

import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers.modeling_layers import MtpModel

DEPTH2_TOKEN = 42


def new_layer(model, randomise):
    """An MTP layer for `model`, randomised by `randomise(layer, skip)`
    (`skip`: the prefixes of the tensors it shares with the model)."""
    mtp = MtpModel(model, 1).to(torch.float32).eval()
    randomise(mtp, ("embed_tokens", "shared_head"))
    return mtp


def add_layer(model, model_cls, out, randomise, inter):
    """A new MTP layer of `model` (saved at `out`) written into
    `out/model.safetensors`. Returns it (float32)."""
    mtp = new_layer(model, randomise)
    save_layer(mtp, model_cls, out, inter)
    return mtp


def save_layer(mtp, model_cls, out, inter):
    """`mtp` written into `out/model.safetensors` (the model's, saved there)
    under the released names, then read back by transformers."""
    mtp = mtp.to(torch.float32)
    with open(os.path.join(out, "config.json")) as f:
        n_layers = json.load(f)["num_hidden_layers"]
    path = os.path.join(out, "model.safetensors")
    tensors = load_file(path)
    for name, t in mtp.state_dict().items():
        if name.startswith(("embed_tokens", "shared_head")):
            continue
        rest = name.removeprefix("layers.0.")
        rest = rest.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        p = f"model.layers.{n_layers}.{rest}"
        if rest.endswith("experts.gate_up_proj"):
            base = p.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                tensors[f"{base}{e}.gate_proj.weight"] = t[e, :inter].contiguous()
                tensors[f"{base}{e}.up_proj.weight"] = t[e, inter:].contiguous()
        elif rest.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                tensors[f"{p.removesuffix('down_proj')}{e}.down_proj.weight"] = t[e].contiguous()
        else:
            tensors[p] = t.contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    # transformers reads the layer back from those names: the same values.
    # (It finds MTP layers by the released checkpoints' indices; this one's
    # is `n_layers`.)
    model_cls._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n_layers}\..*"]
    loaded = MtpModel.from_pretrained(model_cls.from_pretrained(out).eval())
    want = mtp.state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, want[name]), name


def golden(model, mtp, prompt):
    """The model's logits and the layer's at depths 1 and 2 (float64), and
    the depth-2 inputs (for routing margins)."""
    model, mtp = model.to(torch.float64), mtp.to(torch.float64)
    mtp.tie_with_main_model(model)
    ids = torch.tensor([prompt])
    n = len(prompt)
    with torch.no_grad():
        res = model(ids, use_cache=False, output_hidden_states=True)
        logits, hidden = res.logits[0], res.hidden_states[-1]
        assert torch.allclose(model.lm_head(hidden)[0], logits, atol=1e-12)

        def head(tokens, h, positions):
            o = mtp.forward_layer(0, h, positions[None], None, input_ids=tokens)
            return mtp._project_to_logits(o), o

        l1, o1 = head(ids[:, 1:], hidden[:, :-1], torch.arange(1, n))
        tokens2 = torch.cat([ids[:, 1:], torch.tensor([[DEPTH2_TOKEN]])], dim=1)
        hidden2 = torch.cat([hidden[:, :-1], o1[:, -1:]], dim=1)
        l2, _ = head(tokens2, hidden2, torch.arange(1, n + 1))
        assert torch.allclose(l2[0, :-1], l1[0], atol=1e-9)
    ls = lambda t: [[round(v, 7) for v in row] for row in torch.log_softmax(t, -1).tolist()]
    fields = {
        "logprobs": ls(logits),
        "mtp_logprobs": ls(l1[0]),
        "depth2_token": DEPTH2_TOKEN,
        "depth2_logprobs": ls(l2[0, -1:])[0],
    }
    return fields, lambda: head(tokens2, hidden2, torch.arange(1, n + 1))
