//! The CPU Mixture-of-Experts layer: the reference every backend's
//! [`crate::Ops::moe`] is checked against.
//!
//! The router is one product over all rows; each row is routed on the host
//! ([`crate::moe::route`]); each expert multiplies the rows routed to it,
//! gathered, by the row-invariant products of [`crate::Ops::matmul`] (only
//! the experts some row picked are read); each row then sums its experts'
//! outputs in its routing order. A row's bits therefore depend on its own
//! input only, whatever else shares the step.

use crate::backend::Ops;
use crate::error::{Result, TensorError};
use crate::matmul::Epilogue;
use crate::moe::{route, Expert, ExpertActivation, MoeLayer};
use crate::tensor::Tensor;

use super::CpuBackend;

impl CpuBackend {
    /// One expert's gated MLP over `x`'s rows.
    fn expert(&self, x: &Tensor, e: &Expert, layer: &MoeLayer) -> Result<Vec<f32>> {
        let bias = e.gate_up_bias.as_ref();
        let h = match layer.activation {
            ExpertActivation::Gated(act) => {
                let epilogue = Epilogue {
                    bias,
                    gated: Some(act),
                    residual: None,
                };
                self.matmul(x, &e.gate_up, None, epilogue)?
            }
            ExpertActivation::ClampedSwiglu { alpha, limit } => {
                let y = self.matmul(x, &e.gate_up, None, Epilogue::bias(bias))?;
                let (n, two_i) = y.dims2("moe")?;
                let h = ExpertActivation::clamped_swiglu(
                    self.data(&y, "moe")?,
                    two_i / 2,
                    alpha,
                    limit,
                );
                Self::wrap(vec![n, two_i / 2], h)
            }
        };
        let y = self.matmul(&h, &e.down, None, Epilogue::bias(e.down_bias.as_ref()))?;
        Ok(self.data(&y, "moe")?.to_vec())
    }

    pub(super) fn moe_layer(&self, x: &Tensor, layer: &MoeLayer) -> Result<Tensor> {
        let (n, hidden) = x.dims2("moe")?;
        let num_experts = layer.num_experts();
        let (re, rh) = layer.router.dims2("moe")?;
        if re != num_experts || rh != hidden || num_experts == 0 || layer.routing.top_k == 0 {
            return Err(TensorError::Shape {
                op: "moe",
                detail: format!(
                    "router [{re}, {rh}] for {num_experts} experts (top {}) over x [{n}, {hidden}]",
                    layer.routing.top_k
                ),
            });
        }
        let logits = self.matmul(
            x,
            &layer.router,
            None,
            Epilogue::bias(layer.router_bias.as_ref()),
        )?;
        let logits = self.data(&logits, "moe")?;
        let routes: Vec<Vec<(usize, f32)>> = logits
            .chunks(num_experts)
            .map(|row| route(row, &layer.routing, layer.selection_bias.as_deref()))
            .collect();
        // Each expert's rows, and where each (row, pick) finds its output.
        let mut rows_of: Vec<Vec<u32>> = vec![Vec::new(); num_experts];
        let mut at: Vec<Vec<usize>> = Vec::with_capacity(n);
        for (row, picks) in routes.iter().enumerate() {
            at.push(
                picks
                    .iter()
                    .map(|&(e, _)| {
                        rows_of[e].push(row as u32);
                        rows_of[e].len() - 1
                    })
                    .collect(),
            );
        }
        for (e, rows) in rows_of.iter().enumerate() {
            layer.load.add(e, rows.len() as u64);
        }
        let mut outs: Vec<Vec<f32>> = vec![Vec::new(); num_experts];
        for (e, rows) in rows_of.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            // (An expert another rank holds adds nothing here.)
            let Some(expert) = layer.expert(e) else {
                continue;
            };
            let xs = self.gather_rows(x, rows)?;
            outs[e] = self.expert(&xs, expert, layer)?;
            if outs[e].len() != rows.len() * hidden {
                return Err(TensorError::Shape {
                    op: "moe",
                    detail: format!(
                        "expert {e} returned {} values for {} rows of {hidden}",
                        outs[e].len(),
                        rows.len()
                    ),
                });
            }
        }
        let mut out = vec![0f32; n * hidden];
        for (row, (picks, at)) in routes.iter().zip(&at).enumerate() {
            let dst = &mut out[row * hidden..(row + 1) * hidden];
            for (&(e, w), &i) in picks.iter().zip(at) {
                let Some(src) = outs[e].get(i * hidden..(i + 1) * hidden) else {
                    continue;
                };
                for (d, &v) in dst.iter_mut().zip(src) {
                    *d += w * v;
                }
            }
        }
        if let Some(shared) = &layer.shared {
            let ys = self.expert(x, &shared.expert, layer)?;
            let gates = match &shared.gate {
                Some(g) => {
                    let t = self.matmul(x, g, None, Epilogue::NONE)?;
                    let t = self.data(&t, "moe")?;
                    if t.len() != n {
                        return Err(TensorError::Shape {
                            op: "moe",
                            detail: format!("shared expert gate {:?}", g.shape()),
                        });
                    }
                    t.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect()
                }
                None => vec![1.0; n],
            };
            for ((dst, src), g) in out.chunks_mut(hidden).zip(ys.chunks(hidden)).zip(gates) {
                for (d, &v) in dst.iter_mut().zip(src) {
                    *d += g * v;
                }
            }
        }
        Ok(Self::wrap(vec![n, hidden], out))
    }
}
