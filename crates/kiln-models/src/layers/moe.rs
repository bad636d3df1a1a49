//! The sparse MLP of a Mixture-of-Experts block: a router and the experts'
//! gated MLPs (and, in some families, a shared expert every token runs),
//! loaded from a checkpoint's per-expert tensors and run as one
//! [`kiln_tensor::Ops::moe`] over the block's normalized hidden states.

use kiln_tensor::{Backend, Expert, ExpertActivation, MoeLayer, Routing, SharedExpert, Tensor};

use super::WeightLoader;
use crate::error::{ModelError, Result};

/// How a family names an expert's three projections under
/// `{prefix}.experts.{e}`: gate, up, down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertNames {
    /// `gate_proj`, `up_proj`, `down_proj` (Qwen-MoE and most families).
    Proj,
    /// `w1`, `w3`, `w2` (Mixtral).
    W1W3W2,
}

impl ExpertNames {
    /// The gate, up and down module names.
    pub fn modules(self) -> [&'static str; 3] {
        match self {
            ExpertNames::Proj => ["gate_proj", "up_proj", "down_proj"],
            ExpertNames::W1W3W2 => ["w1", "w3", "w2"],
        }
    }
}

/// How a family names its shared expert (and whether a gate scales it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedNames {
    /// `{prefix}.shared_expert.{gate,up,down}_proj`, scaled by
    /// `σ(x · shared_expert_gate)` (Qwen2-MoE, Qwen3.5).
    GatedQwen,
    /// `{prefix}.shared_experts.{gate,up,down}_proj`, ungated (DeepSeek-V3,
    /// GLM-4.5).
    DeepSeek,
}

/// A sparse MLP's shape, as a family's config gives it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeShape {
    pub hidden: usize,
    pub num_experts: usize,
    /// Each expert's intermediate size.
    pub intermediate: usize,
    /// The shared expert's intermediate size, if the layer has one.
    pub shared_intermediate: Option<usize>,
    pub shared_names: SharedNames,
    /// The selection bias's name under the prefix
    /// ([`kiln_tensor::MoeLayer::selection_bias`]), where the router has one.
    pub selection_bias: Option<&'static str>,
    pub routing: Routing,
    pub activation: ExpertActivation,
    pub names: ExpertNames,
    /// Expert parallelism: the routed experts this rank holds, `[start,
    /// end)` (`None`: all).
    pub held: Option<(usize, usize)>,
}

impl SharedNames {
    /// The shared expert's module under the sparse MLP's prefix.
    pub fn module(self) -> &'static str {
        match self {
            SharedNames::GatedQwen => "shared_expert",
            SharedNames::DeepSeek => "shared_experts",
        }
    }
}

impl MoeShape {
    /// Every weight of the sparse MLP at `prefix` (`model.layers.3.mlp`),
    /// router `router` (its full name): Hugging Face name and shape.
    pub fn tensor_shapes(&self, prefix: &str, router: &str) -> Vec<(String, Vec<usize>)> {
        let (h, i) = (self.hidden, self.intermediate);
        let [gate, up, down] = self.names.modules();
        let mut out = vec![(router.to_string(), vec![self.num_experts, h])];
        for e in 0..self.num_experts {
            let p = format!("{prefix}.experts.{e}");
            out.push((format!("{p}.{gate}.weight"), vec![i, h]));
            out.push((format!("{p}.{up}.weight"), vec![i, h]));
            out.push((format!("{p}.{down}.weight"), vec![h, i]));
        }
        if let Some(b) = self.selection_bias {
            out.push((format!("{prefix}.{b}"), vec![self.num_experts]));
        }
        if let Some(s) = self.shared_intermediate {
            let p = format!("{prefix}.{}", self.shared_names.module());
            out.push((format!("{p}.gate_proj.weight"), vec![s, h]));
            out.push((format!("{p}.up_proj.weight"), vec![s, h]));
            out.push((format!("{p}.down_proj.weight"), vec![h, s]));
            if self.shared_names == SharedNames::GatedQwen {
                out.push((format!("{prefix}.shared_expert_gate.weight"), vec![1, h]));
            }
        }
        out
    }
}

pub struct SparseMoe {
    pub layer: MoeLayer,
}

impl SparseMoe {
    /// Load the router `router` and the experts under `prefix`; the backend
    /// must run Mixture-of-Experts layers (checked here, at load).
    pub fn load(l: &WeightLoader, prefix: &str, router: &str, shape: &MoeShape) -> Result<Self> {
        if !l.backend.supports_moe() {
            return Err(ModelError::Tensor(kiln_tensor::TensorError::Unsupported {
                backend: l.backend.name(),
                what: "Mixture-of-Experts layers (the CPU backend runs them)".into(),
            }));
        }
        let (h, i) = (shape.hidden, shape.intermediate);
        let [gate, up, down] = shape.names.modules();
        let load_expert = |p: &str, i: usize, names: [&str; 3]| -> Result<Expert> {
            Ok(Expert::new(
                l.stacked_weight(
                    &[
                        format!("{p}.{}.weight", names[0]),
                        format!("{p}.{}.weight", names[1]),
                    ],
                    &[vec![i, h], vec![i, h]],
                )?,
                l.weight(&format!("{p}.{}.weight", names[2]), &[h, i])?,
            ))
        };
        let fused = format!("{prefix}.experts.gate_up_proj");
        let (first, end) = shape.held.unwrap_or((0, shape.num_experts));
        let experts = if l.source.contains(&fused) {
            Self::load_fused(l, prefix, shape, end - first)?
        } else {
            (first..end)
                .map(|e| load_expert(&format!("{prefix}.experts.{e}"), i, [gate, up, down]))
                .collect::<Result<Vec<_>>>()?
        };
        let shared = match shape.shared_intermediate {
            Some(s) => Some(SharedExpert {
                expert: load_expert(
                    &format!("{prefix}.{}", shape.shared_names.module()),
                    s,
                    ["gate_proj", "up_proj", "down_proj"],
                )?,
                gate: match shape.shared_names {
                    SharedNames::GatedQwen => {
                        Some(l.weight(&format!("{prefix}.shared_expert_gate.weight"), &[1, h])?)
                    }
                    SharedNames::DeepSeek => None,
                },
            }),
            None => None,
        };
        let selection_bias = shape
            .selection_bias
            .map(|b| l.host(&format!("{prefix}.{b}"), &[shape.num_experts]))
            .transpose()?;
        Ok(SparseMoe {
            layer: MoeLayer {
                router: l.weight(router, &[shape.num_experts, h])?,
                router_bias: None,
                selection_bias,
                experts,
                held: shape.held.map(|(a, b)| a..b),
                shared,
                activation: shape.activation,
                routing: shape.routing,
                load: std::sync::Arc::new(kiln_tensor::ExpertLoad::new(shape.num_experts)),
            },
        })
    }

    /// The experts as transformers holds them in memory (and some tools
    /// save them): `{prefix}.experts.gate_up_proj` `[n, 2i, h]` (each
    /// expert's gate rows, then its up rows) and `.down_proj` `[n, h, i]`.
    /// (`n` of them: all, or the run a rank holds.)
    fn load_fused(
        l: &WeightLoader,
        prefix: &str,
        shape: &MoeShape,
        n: usize,
    ) -> Result<Vec<Expert>> {
        let (h, i) = (shape.hidden, shape.intermediate);
        let gate_up = format!("{prefix}.experts.gate_up_proj");
        let down = format!("{prefix}.experts.down_proj");
        let gate_ups = l.stacked_slices(&gate_up, [n, 2 * i, h])?;
        let downs = l.stacked_slices(&down, [n, h, i])?;
        l.loaded(&gate_up);
        l.loaded(&down);
        Ok(gate_ups
            .into_iter()
            .zip(downs)
            .map(|(gate_up, down)| Expert::new(gate_up, down))
            .collect())
    }

    /// The layer over `x`, already normalized.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        Ok(b.moe(x, &self.layer)?)
    }
}
