"""Logit comparison shared by the GPU parity scripts (parity.py, quant_parity.py):
log-softmax distance, cosine and argmax agreement of two [positions, vocab] arrays."""
import numpy as np


def log_softmax(x):
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def compare(a, b):
    la, lb = log_softmax(a), log_softmax(b)
    af, bf = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return {
        "max_abs_logprob_diff": float(np.abs(la - lb).max()),
        "mean_abs_logprob_diff": float(np.abs(la - lb).mean()),
        "cosine": float(af @ bf / (np.linalg.norm(af) * np.linalg.norm(bf))),
        "argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).mean()),
    }
