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
