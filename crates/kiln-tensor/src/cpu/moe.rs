//! The CPU Mixture-of-Experts layer: [`crate::moe::moe_composed`] over the
//! CPU's row-invariant products — the reference every backend's
//! [`crate::Ops::moe`] is checked against. A row's bits depend on its own
//! input only, whatever else shares the step.

use crate::error::Result;
use crate::moe::MoeLayer;
use crate::tensor::Tensor;

use super::CpuBackend;

impl CpuBackend {
    pub(super) fn moe_layer(&self, x: &Tensor, layer: &MoeLayer) -> Result<Tensor> {
        crate::moe::moe_composed(self, x, layer)
    }
}
