"""Embedding goldens: sentence-transformers on CPU (float32) for the real
all-MiniLM-L6-v2 and EmbeddingGemma-300M directories that
`scripts/fetch-models.sh` unpacks, over 30 varied inputs (the empty string,
unicode, code, texts past the model's limit, EmbeddingGemma's task prompts).

    python gen_embeddings.py MODELS_DIR OUT_DIR

Writes OUT_DIR/<model>.json: per case the text, the prompt name (if any),
the token ids sentence-transformers fed the model (special tokens included,
after truncation) and the embedding, with the library versions.
"""

import json
import platform
import sys

import sentence_transformers
import tokenizers
import torch
import transformers
from sentence_transformers import SentenceTransformer

LONG = (
    "The history of printing starts with woodblock printing in East Asia, "
    "spreads with movable type in China and Korea, and reaches Europe in the "
    "fifteenth century, where Johannes Gutenberg's press changed how books, "
    "pamphlets and newspapers were made and read. "
)

CASES = [
    ("empty", ""),
    ("hello", "Hello world"),
    ("fox", "The quick brown fox jumps over the lazy dog."),
    ("question", "What is the capital of France?"),
    ("answer", "Paris is the capital and most populous city of France."),
    ("german", "Zürich ist die größte Stadt der Schweiz."),
    ("japanese", "東京は日本の首都です。"),
    ("russian", "Привет, как дела?"),
    ("emoji", "I love pizza 🍕🍕 and ☕ coffee!"),
    ("code", "def add(a, b):\n    return a + b"),
    ("spaces", "   leading and trailing spaces   "),
    ("tabs", "\t\ttabs\nand\nnewlines\n"),
    ("numbers", "3.14159 2.71828 1.41421 42 1e10"),
    ("punctuation", "!!! ??? ... ;;; ---"),
    ("url", "https://example.com/path?query=1&x=2#frag"),
    ("mixed_case", "HeLLo WoRLD SHOUTING lowercase"),
    ("sentence", "Embeddings map text to vectors so that texts with similar meanings end up close together, which lets a search engine find passages that answer a question even when they share no words with it."),
    ("repeated", "word " * 50),
    ("paragraph", LONG * 3),
    ("past_the_limit", LONG * 50),
    ("one_letter", "a"),
    ("one_mark", "?"),
    ("arabic", "مرحبا بالعالم"),
    ("hindi", "नमस्ते दुनिया"),
    ("math", "∑_{i=1}^n i = n(n+1)/2"),
    ("html", '<div class="x">Hello</div>'),
    ("json", '{"key": "value", "n": [1, 2, 3]}'),
]
# Task prompts (EmbeddingGemma's config_sentence_transformers.json); a model
# without them gets the plain text.
PROMPTED = [
    ("query_prompt", "how do embeddings work", "query"),
    ("document_prompt", "Embeddings are vectors that represent meaning.", "document"),
    ("sts_prompt", "A man is playing a guitar.", "STS"),
]


def run(model_dir, name):
    torch.set_num_threads(2)
    m = SentenceTransformer(model_dir, device="cpu", model_kwargs={"dtype": torch.float32})
    out = {
        "model": name,
        "max_seq_length": m.max_seq_length,
        "dimension": m.get_sentence_embedding_dimension(),
        "prompts": m.prompts,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "sentence_transformers": sentence_transformers.__version__,
        },
        "cases": [],
    }
    cases = [(n, t, None) for n, t in CASES]
    for n, t, p in PROMPTED:
        cases.append((n, t, p if p in m.prompts else None))
    for case_name, text, prompt_name in cases:
        prompt = m.prompts[prompt_name] if prompt_name else ""
        feats = m.tokenize([prompt + text])
        ids = feats["input_ids"][0][feats["attention_mask"][0].bool()].tolist()
        emb = m.encode([text], prompt_name=prompt_name, convert_to_tensor=True,
                       normalize_embeddings=False)[0]
        out["cases"].append({
            "name": case_name,
            "text": text,
            "prompt_name": prompt_name,
            "input_ids": ids,
            "embedding": [float(v) for v in emb.float().tolist()],
        })
    return out


if __name__ == "__main__":
    models_dir, out_dir = sys.argv[1], sys.argv[2]
    for name, sub in [("all-MiniLM-L6-v2", "all-MiniLM-L6-v2"), ("embeddinggemma-300m", "embeddinggemma-300m")]:
        g = run(f"{models_dir}/{sub}", name)
        with open(f"{out_dir}/{name}.json", "w") as f:
            json.dump(g, f, ensure_ascii=False, indent=0)
        print(name, len(g["cases"]), "cases, dim", g["dimension"], "max", g["max_seq_length"])
