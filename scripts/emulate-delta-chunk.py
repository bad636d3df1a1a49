#!/usr/bin/env python3
"""The delta rule's chunk-parallel CUDA form (crates/kiln-cuda/src/ops/recurrent/delta_chunk.cu),
emulated index for index on the CPU, against the token-order recurrence.

Each kernel is mirrored with its shared-memory layouts, thread mapping and work-array indexing
(the phases between its barriers run for every thread in turn; rows staged in 16-byte pieces
with the offsets and strides the kernels pass; the A and P products by 4 x 4 tiles); the chunk table is cut as
chunk.rs cuts it and the sequence metadata laid out as StepMeta lays it. Three sequences (150
fresh tokens with snapshots inside the first chunk, at its end and inside the second; one token
continuing a state; 70 tokens restored from another slot) at a small head shape (2 key heads of
8, 6 value heads of 12). Then recurrent.cu's token-parallel convolution (recurrent_conv_rows and
recurrent_conv_state) against the token-order one. A change to the kernels' indexing can be
checked here before a GPU runs `kiln dev cuda-check`. Needs numpy; about a minute:

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
def stage_rows(dst, dst_off, dst_stride, src, src_off, src_stride, L, width, threads=256, per=4):
    """delta_chunk_detail::stage_rows: rows of `width` floats in 16-byte pieces (PER in flight)."""
    assert width % 4 == 0 and src_off % 4 == 0 and src_stride % 4 == 0
    w4 = width // 4; n4 = L * w4
    for base in range(0, n4, per * threads):
        for tid in range(threads):
            for it in range(per):
                e = base + it * threads + tid
                if e < n4:
                    t, i = divmod(e, w4)
                    dst[dst_off + t*dst_stride + 4*i: dst_off + t*dst_stride + 4*i + 4] = src[src_off + t*src_stride + 4*i: src_off + t*src_stride + 4*i + 4]
def gram_tiles(a, a_off, b, b_off, stride, strict, scale, L):
    """The 4 x 4 tiles of a . b^T (gram_tile) with the callers' selection."""
    M = np.zeros(CH*CH)
    for tile in range((CH//4)**2):
        t0, s0 = (tile // (CH//4))*4, (tile % (CH//4))*4
        for r in range(4):
            for c in range(4):
                t, s = t0 + r, s0 + c
                keep = (s < t if strict else s <= t) and t < L
                if keep:
                    acc = sum(a[a_off + t*stride + i]*b[b_off + s*stride + i] for i in range(KD))
                    M[t*CH + s] = scale(t, s) * acc
    return M
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
            stage_rows(sm, 0, kp, qk, kb + row0*qs_, qs_, L, KD)
            for t in range(L):
                sm[G0+t] = gb[(row0+t)*2*VH + h]; sm[B0+t] = gb[(row0+t)*2*VH + VH + h]
            acc = 0
            for t in range(L):
                acc += sm[G0+t]; sm[G0+t] = acc; gb[(row0+t)*2*VH + h] = acc
            A = gram_tiles(sm, 0, sm, 0, kp, True, lambda t, s: sm[B0+t]*np.exp(sm[G0+t]-sm[G0+s]), L)
            sm[A0:A0+CH*CH] = A
            X = np.zeros(big)
            stage_rows(X, 0, cols, qk, kb + row0*qs_, qs_, L, KD)
            stage_rows(X, KD, cols, mf, 2*KH*KD + h*VD + row0*cd, cd, L, VD)
            for e in range(L*cols):
                t, cc = divmod(e, cols)
                X[e] *= sm[B0+t]*np.exp(sm[G0+t]) if cc < KD else sm[B0+t]
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
                    stage_rows(wq, 0, KD, W, (row0*VH + h)*KD, VH*KD, L, KD)
                    stage_rows(kc, 0, KD, qk, row0*qs_ + (KH+kh)*KD, qs_, L, KD)
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
                    stage_rows(wq, 0, KD, qk, row0*qs_ + kh*KD, qs_, L, KD)
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
            big = max(2*CH*kp, CH*VD); sm = np.zeros(big)
            stage_rows(sm, 0, kp, qk, row0*qs_ + kh*KD, qs_, L, KD, threads=(VD+31)//32*32)
            stage_rows(sm, CH*kp, kp, qk, row0*qs_ + (KH+kh)*KD, qs_, L, KD, threads=(VD+31)//32*32)
            G = [gb[(row0+t)*2*VH + h] for t in range(L)]
            P = gram_tiles(sm, 0, sm, CH*kp, kp, False, lambda t, s: np.exp(G[t]-G[s]), L).reshape(CH, CH)
            sm[:] = 0
            stage_rows(sm, 0, VD, U, (row0*VH + h)*VD, VH*VD, L, VD, threads=(VD+31)//32*32)
            us = sm[:L*VD].reshape(L, VD)
            for t in range(L):
                o = np.array([oi[((row0+t)*VH+h)*VD + j] + sum(P[t, s_]*us[s_, j] for s_ in range(t+1)) for j in range(VD)])
                tot = (o*o).sum(); inv = 1/np.sqrt(tot/VD + eps); r = row0 + t
                zz = xf[r*xw + z_col + h*VD: r*xw + z_col + h*VD + VD]
                out[r*VH*VD + h*VD: r*VH*VD + h*VD + VD] = normw*(o*inv)*silu(zz)
    return out.reshape(n, VH*VD), st.reshape(NS, slot_len)
ro, rs = reference(); eo, es = emulate()
print("out max|d|", abs(ro - eo).max(), "state max|d|", abs(rs - es).max(), "max|out|", abs(ro).max())
assert abs(ro - eo).max() < 1e-4 and abs(rs - es).max() < 1e-4, "the emulation parts from the recurrence"

# recurrent.cu: recurrent_conv_rows (every row at once) then recurrent_conv_state (the windows kept:
# snapshots, then the own slot, old inputs read first) against the token-order convolution; four
# sequences (fresh with snapshots, one token, restored with a snapshot after one token, continuing).
rng = np.random.default_rng(2)
K=4; C=5; lens=[7,1,2,9]; computed=[0,3,3,5]; slots=[0,1,2,3]; restore=[None,None,6,None]
snapsq=[[(2,4),(7,5)],[],[(1,7)],[]]; NS=8
n=sum(lens); starts=np.cumsum([0]+lens)
x=rng.normal(size=(n,C)); w=rng.normal(size=(C,K)); st0=rng.normal(size=(NS,(K-1)*C))
seqs=[];snaps=[]
for i in range(4):
    fresh=int(computed[i]==0 and restore[i] is None); src=restore[i] if restore[i] is not None else slots[i]
    seqs+=[starts[i],lens[i],slots[i],src,fresh,len(snaps)//2]
    for t,sl in snapsq[i]: snaps+=[t,sl]
seqs.append(len(snaps)//2)
row_seq=[i for i in range(4) for _ in range(lens[i])]
def seq_ref():
    st=st0.copy(); out=np.zeros((n,C))
    for s in range(4):
        row0,rows,slot,src,fresh,s0=seqs[6*s:6*s+6]; s1=seqs[6*(s+1)+5] if s<3 else seqs[24]
        win=np.zeros((K,C)); win[:K-1]=0 if fresh else st[src].reshape(K-1,C)
        for t in range(rows):
            win[K-1]=x[row0+t]; out[row0+t]=(w.T*win).sum(0); win[:K-1]=win[1:].copy()
            for q in range(s0,s1):
                if snaps[2*q]==t+1: st[snaps[2*q+1]]=win[:K-1].ravel()
        st[slot]=win[:K-1].ravel()
    return out,st
def par():
    st=st0.copy().ravel(); L=(K-1)*C; out=np.zeros((n,C))
    def inp(frm,fresh,row0,m,c):
        if m<0: return 0 if fresh else st[frm+(K-1+m)*C+c]
        return x[row0+m,c]
    for r in range(n):
        for c in range(C):
            m=seqs[6*row_seq[r]:6*row_seq[r]+6]; row0,slot,src,fresh=m[0],m[2],m[3],m[4]
            t=r-row0; out[r,c]=sum(w[c,j]*inp(src*L,fresh,row0,t-(K-1)+j,c) for j in range(K))
    for s in range(4):
        row0,rows,slot,src,fresh,s0=seqs[6*s:6*s+6]; s1=seqs[6*(s+1)+5] if s<3 else seqs[24]
        for c in range(C):
            old=[0 if fresh else st[src*L+j*C+c] for j in range(K-1)]
            def wi(to,T):
                for j in range(K-1):
                    mi=T-(K-1)+j; st[to+j*C+c]=old[K-1+mi] if mi<0 else x[row0+mi,c]
            for q in range(s0,s1):
                if 1<=snaps[2*q]<=rows: wi(snaps[2*q+1]*L,snaps[2*q])
            wi(slot*L,rows)
    return out,st.reshape(NS,L)
a, b = seq_ref(); c, d = par()
print("conv: out max|d|", abs(a - c).max(), "state max|d|", abs(b - d).max())
assert abs(a - c).max() < 1e-9 and abs(b - d).max() < 1e-9, "the token-parallel convolution parts from the token-order one"
