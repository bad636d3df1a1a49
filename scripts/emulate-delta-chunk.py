#!/usr/bin/env python3
"""The delta rule's chunk-parallel CUDA form (crates/kiln-cuda/src/ops/recurrent/delta_chunk.cu),
emulated index for index on the CPU, against the token-order recurrence.

Each kernel is mirrored with its shared-memory layouts, thread mapping and work-array indexing
(the phases between its barriers run for every thread in turn); the chunk table is cut as
chunk.rs cuts it and the sequence metadata laid out as StepMeta lays it. Three sequences (150
fresh tokens with snapshots inside the first chunk, at its end and inside the second; one token
continuing a state; 70 tokens restored from another slot) at a small head shape (2 key heads of
8, 6 value heads of 12). A change to the kernels' indexing can be checked here before a GPU runs
`kiln dev cuda-check`. Needs numpy; about a minute:

    python3 scripts/emulate-delta-chunk.py      # prints max |difference| of outputs and states
"""
import numpy as np
rng = np.random.default_rng(1)
CH = 64
KH, VH, KD, VD = 2, 6, 8, 12
lens = [150, 1, 70]; computed = [0, 9, 11]
slots = [0, 1, 2]; restore = [None, None, 5]; snapsq = [[(2, 3), (64, 4), (100, 6)], [], []]
NS = 7
n = sum(lens)
cd = 2 * KH * KD + VH * VD
mixed = rng.normal(size=(n, cd)).astype(np.float32)
xw = cd + VH * VD + 2 * VH
x = rng.normal(size=(n, xw)).astype(np.float32)
z_col, b_col, a_col = cd, cd + VH * VD, cd + VH * VD + VH
a_log = rng.normal(size=VH); dt_bias = rng.normal(size=VH) * 0.5
normw = 1 + 0.3 * rng.normal(size=VD); eps = 1e-6
conv_len = 5
slot_len = conv_len + VH * KD * VD
state0 = rng.normal(size=(NS, slot_len)) * 0.5
# metadata
seqs = []; snaps = []; starts = np.cumsum([0] + lens)
for i in range(3):
    fresh = int(computed[i] == 0 and restore[i] is None)
    src = restore[i] if restore[i] is not None else slots[i]
    seqs += [starts[i], lens[i], slots[i], src, fresh, len(snaps) // 2]
    for t, sl in snapsq[i]: snaps += [t, sl]
seqs.append(len(snaps) // 2)
sp = lambda v: v if v > 20 else np.log1p(np.exp(v))
sig = lambda v: 1 / (1 + np.exp(-v)); silu = lambda v: v * sig(v)
# reference: token order
def reference():
    st = state0.copy(); out = np.zeros((n, VH * VD))
    for s in range(3):
        row0, rows, slot, src, fresh, s0 = seqs[6*s:6*s+6]
        s1 = seqs[6*(s+1)+5] if s + 1 < 3 else seqs[6*3]
        for h in range(VH):
            kh = h // (VH // KH)
            S = np.zeros((KD, VD)) if fresh else st[src, conv_len + h*KD*VD: conv_len + (h+1)*KD*VD].reshape(KD, VD).copy()
            for t in range(rows):
                r = row0 + t
                q = mixed[r, kh*KD:(kh+1)*KD].astype(np.float64); k = mixed[r, KH*KD + kh*KD: KH*KD + (kh+1)*KD].astype(np.float64)
                q = q / np.sqrt((q*q).sum() + 1e-6) / np.sqrt(KD); k = k / np.sqrt((k*k).sum() + 1e-6)
                v = mixed[r, 2*KH*KD + h*VD: 2*KH*KD + (h+1)*VD]
                beta = sig(x[r, b_col + h]); dec = np.exp(-np.exp(a_log[h]) * sp(x[r, a_col + h] + dt_bias[h]))
                S = S * dec; d = (v - S.T @ k) * beta; S = S + np.outer(k, d); o = S.T @ q
                o = normw * o / np.sqrt((o*o).mean() + eps) * silu(x[r, z_col + h*VD: z_col + (h+1)*VD])
                out[r, h*VD:(h+1)*VD] = o
                for qn in range(s0, s1):
                    if snaps[2*qn] == t + 1: st[snaps[2*qn+1], conv_len + h*KD*VD: conv_len + (h+1)*KD*VD] = S.ravel()
            st[slot, conv_len + h*KD*VD: conv_len + (h+1)*KD*VD] = S.ravel()
    return out, st
# chunk table as chunk.rs builds it
chunks = []; firsts = []
for i in range(3):
    firsts.append(len(chunks) // 4); r = 0
    while r < lens[i]:
        L = min(CH, lens[i] - r); chunks += [i, starts[i] + r, L, r]; r += L
nch = len(chunks) // 4; firsts.append(nch)
def emulate():
    st = state0.copy().ravel()
    qk = np.zeros(n * 2 * KH * KD); gb = np.zeros(n * 2 * VH)
    W = np.zeros(n * VH * KD); U = np.zeros(n * VH * VD); oi = np.zeros(n * VH * VD); out = np.zeros(n * VH * VD)
    mf = mixed.ravel(); xf = x.ravel()
    # prep
    for r in range(n):
        for vec in range(2 * KH):
            src = mf[r*cd + vec*KD: r*cd + vec*KD + KD]; ss = (src*src).sum()
            scale = 1/np.sqrt(ss + 1e-6) * (1/np.sqrt(KD) if vec < KH else 1)
            qk[r*2*KH*KD + vec*KD: r*2*KH*KD + vec*KD + KD] = src * scale
        for h in range(VH):
            gb[r*2*VH + h] = -np.exp(a_log[h]) * sp(xf[r*xw + a_col + h] + dt_bias[h])
            gb[r*2*VH + VH + h] = sig(xf[r*xw + b_col + h])
    qs_ = 2*KH*KD
    # solve
    for c in range(nch):
        row0, L = chunks[4*c+1], chunks[4*c+2]
        for h in range(VH):
            kh = h // (VH // KH); kp = KD + 1; cols = KD + VD; big = max(CH*kp, CH*cols)
            sm = np.zeros(big + CH*CH + 2*CH); A0 = big; G0 = A0 + CH*CH; B0 = G0 + CH
            kb = (KH + kh) * KD
            for e in range(L*KD):
                t, i = divmod(e, KD); sm[t*kp + i] = qk[(row0+t)*qs_ + kb + i]
            for t in range(L):
                sm[G0+t] = gb[(row0+t)*2*VH + h]; sm[B0+t] = gb[(row0+t)*2*VH + VH + h]
            acc = 0
            for t in range(L):
                acc += sm[G0+t]; sm[G0+t] = acc; gb[(row0+t)*2*VH + h] = acc
            A = np.zeros(CH*CH)
            for e in range(CH*CH):
                t, s = divmod(e, CH)
                if s < t < L:
                    d = sum(sm[t*kp+i]*sm[s*kp+i] for i in range(KD))
                    A[e] = sm[B0+t]*np.exp(sm[G0+t]-sm[G0+s])*d
            sm[A0:A0+CH*CH] = A
            X = np.zeros(big)
            for e in range(L*cols):
                t, cc = divmod(e, cols)
                X[e] = sm[B0+t]*np.exp(sm[G0+t])*qk[(row0+t)*qs_ + kb + cc] if cc < KD else sm[B0+t]*mf[(row0+t)*cd + 2*KH*KD + h*VD + cc-KD]
            for cc in range(cols):
                for t in range(L):
                    a = X[t*cols+cc]
                    for s in range(t): a -= sm[A0 + t*CH + s]*X[s*cols+cc]
                    X[t*cols+cc] = a; r = row0 + t
                    if cc < KD: W[(r*VH+h)*KD + cc] = a
                    else: U[(r*VH+h)*VD + cc-KD] = a
    # state
    RK = 16
    for s in range(3):
        m = seqs[6*s:6*s+6]; slot, src, fresh = m[2], m[3], m[4]
        s0 = m[5]; s1 = seqs[6*(s+1)+5] if s+1 < 3 else seqs[6*3]
        for h in range(VH):
            kh = h // (VH // KH)
            for z in range((VD + 31)//32):
                # threads: warp w in 0..8, lane in 0..32
                S = np.zeros((8, 32, RK))
                base = src*slot_len + conv_len + h*KD*VD
                for w in range(8):
                    for lane in range(32):
                        j = z*32 + lane
                        for rr in range(RK):
                            i = w + 8*rr
                            S[w, lane, rr] = st[base + i*VD + j] if (j < VD and i < KD and not fresh) else 0
                for c in range(firsts[s], firsts[s+1]):
                    row0, L, off = chunks[4*c+1], chunks[4*c+2], chunks[4*c+3]
                    G = np.array([gb[(row0+t)*2*VH + h] for t in range(L)])
                    wq = np.zeros(CH*KD); kc = np.zeros(CH*KD)
                    for e in range(L*KD):
                        t, i = divmod(e, KD)
                        wq[e] = W[((row0+t)*VH + h)*KD + i]; kc[e] = qk[(row0+t)*qs_ + (KH+kh)*KD + i]
                    red = np.zeros((8, CH, 32))
                    for w in range(8):
                        for lane in range(32):
                            for t in range(L):
                                red[w, t, lane] = sum(wq[t*KD + w+8*rr]*S[w, lane, rr] for rr in range(RK) if w+8*rr < KD)
                    us = np.zeros((CH, 32))
                    for t in range(L):
                        for lane in range(32):
                            j = z*32 + lane; sm_ = red[:, t, lane].sum(); u = 0
                            if j < VD:
                                idx = ((row0+t)*VH + h)*VD + j; u = U[idx] - sm_; U[idx] = u
                            us[t, lane] = u
                    for e in range(L*KD):
                        t, i = divmod(e, KD); wq[e] = qk[(row0+t)*qs_ + kh*KD + i]
                    for w in range(8):
                        for lane in range(32):
                            for t in range(L):
                                red[w, t, lane] = sum(wq[t*KD + w+8*rr]*S[w, lane, rr] for rr in range(RK) if w+8*rr < KD)
                    for t in range(L):
                        for lane in range(32):
                            j = z*32 + lane
                            if j < VD: oi[((row0+t)*VH + h)*VD + j] = np.exp(G[t]) * red[:, t, lane].sum()
                    for qn in range(s0, s1):
                        T = snaps[2*qn]
                        if T <= off or T > off + L: continue
                        tt = T - off - 1; tb = snaps[2*qn+1]*slot_len + conv_len + h*KD*VD
                        for w in range(8):
                            for lane in range(32):
                                j = z*32 + lane
                                for rr in range(RK):
                                    i = w + 8*rr
                                    if j >= VD or i >= KD: continue
                                    v = np.exp(G[tt])*S[w, lane, rr]
                                    for t in range(tt+1): v += kc[t*KD+i]*np.exp(G[tt]-G[t])*us[t, lane]
                                    st[tb + i*VD + j] = v
                    gl = G[L-1]
                    S *= np.exp(gl)
                    for t in range(L):
                        for w in range(8):
                            for lane in range(32):
                                fu = np.exp(gl - G[t])*us[t, lane]
                                for rr in range(RK):
                                    if w + 8*rr < KD: S[w, lane, rr] += kc[t*KD + w+8*rr]*fu
                ob = slot*slot_len + conv_len + h*KD*VD
                for w in range(8):
                    for lane in range(32):
                        j = z*32 + lane
                        for rr in range(RK):
                            i = w + 8*rr
                            if j < VD and i < KD: st[ob + i*VD + j] = S[w, lane, rr]
    # out
    for c in range(nch):
        seq, row0, L = chunks[4*c], chunks[4*c+1], chunks[4*c+2]
        for h in range(VH):
            kh = h // (VH // KH); kp = KD + 1
            qs = np.zeros((CH, kp)); ks = np.zeros((CH, kp))
            for t in range(L):
                qs[t, :KD] = qk[(row0+t)*qs_ + kh*KD: (row0+t)*qs_ + kh*KD + KD]
                ks[t, :KD] = qk[(row0+t)*qs_ + (KH+kh)*KD: (row0+t)*qs_ + (KH+kh)*KD + KD]
            G = [gb[(row0+t)*2*VH + h] for t in range(L)]
            P = np.zeros((CH, CH))
            for t in range(L):
                for s_ in range(t+1): P[t, s_] = np.exp(G[t]-G[s_])*(qs[t]@ks[s_])
            us = np.array([[U[((row0+t)*VH + h)*VD + jj] for jj in range(VD)] for t in range(L)])
            for t in range(L):
                o = np.array([oi[((row0+t)*VH+h)*VD + j] + sum(P[t, s_]*us[s_, j] for s_ in range(t+1)) for j in range(VD)])
                tot = (o*o).sum(); inv = 1/np.sqrt(tot/VD + eps); r = row0 + t
                zz = xf[r*xw + z_col + h*VD: r*xw + z_col + h*VD + VD]
                out[r*VH*VD + h*VD: r*VH*VD + h*VD + VD] = normw*(o*inv)*silu(zz)
    return out.reshape(n, VH*VD), st.reshape(NS, slot_len)
ro, rs = reference(); eo, es = emulate()
print("out max|d|", abs(ro - eo).max(), "state max|d|", abs(rs - es).max(), "max|out|", abs(ro).max())
assert abs(ro - eo).max() < 1e-4 and abs(rs - es).max() < 1e-4, "the emulation parts from the recurrence"
