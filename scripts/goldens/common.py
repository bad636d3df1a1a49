"""Helpers the golden scripts share."""
import json
import os


def write_tokenizer(out, vocab_size):
    """A word-level tokenizer of `vocab_size` words `t0`, `t1`, ...: enough for
    the engine and server to run a random checkpoint (token ids are what tests use)."""
    tok = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab_size)},
                  "unk_token": "t0"},
    }
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tok, f)


def sigmoid_routing_margins(module, run, k, groups, keep):
    """DeepSeek-V3-style routers (sigmoid keys plus `e_score_correction_bias`,
    the best `keep` of `groups` groups by their two largest keys): the
    smallest gaps, over the `mlp.gate` routers of `module` while `run()` runs
    and every token, between the kept and the first dropped group score
    (`groups` > 1) and between the k-th and (k+1)-th key of the kept groups.
    A test tolerance means nothing if f32 rounding could flip a choice."""
    import torch

    gaps = {"groups": [], "experts": []} if groups > 1 else {"experts": []}

    def hook(mod, inp, out):
        keys = out[0].double().sigmoid() + mod.e_score_correction_bias.double()
        if groups > 1:
            g = keys.view(keys.shape[0], groups, -1).topk(2, dim=-1).values.sum(-1)
            top = g.topk(keep + 1, dim=-1)
            gaps["groups"].append((top.values[:, keep - 1] - top.values[:, keep]).min().item())
            mask = torch.zeros_like(g, dtype=torch.bool).scatter_(1, top.indices[:, :keep], True)
            keys = keys.masked_fill(~mask.repeat_interleave(keys.shape[1] // groups, 1), float("-inf"))
        t = keys.topk(k + 1, dim=-1).values
        gaps["experts"].append((t[:, k - 1] - t[:, k]).min().item())

    hooks = [m.register_forward_hook(hook) for n, m in module.named_modules() if n.endswith("mlp.gate")]
    with torch.no_grad():
        run()
    for h in hooks:
        h.remove()
    return {key: min(v) for key, v in gaps.items()}


def add_stacked_experts(writer, names, experts):
    """Each layer's experts as llama.cpp stacks them, one 3-D F32 tensor a
    projection (experts outermost), named by the `gguf` package's map
    `names` (a `TensorNameMap`). `experts`: {(layer, proj): {e: matrix}}."""
    import numpy as np

    for (layer, proj), by_e in sorted(experts.items()):
        stacked = np.stack([by_e[e] for e in range(len(by_e))]).astype(np.float32)
        g = names.get_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", try_suffixes=(".weight",))
        assert g is not None, (layer, proj)
        writer.add_tensor(g, stacked)
