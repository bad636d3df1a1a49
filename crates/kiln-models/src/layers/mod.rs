//! Shared layers every model family is built from. Each takes the backend
//! as `&dyn Backend` and never names a concrete one, and returns its value:
//! where norms and residuals go is the block's choice, passed as a [`Fuse`]
//! so that they still run inside the products. A layer that needs an
//! extension op checks the backend for it when it is built (at load).

mod attention;
mod linear;
mod loader;
mod mlp;
mod moe;
mod nextn;
mod norm;
mod rope;
mod softcap;

pub use attention::{Attention, AttentionConfig};
pub use linear::{Fuse, Linear};
pub use loader::{LoadProgress, WeightBytes, WeightLoader};
pub use mlp::GatedMlp;
pub use moe::{ExpertNames, MoeShape, SharedNames, SparseMoe};
pub use nextn::NextN;
pub use norm::RmsNorm;
pub use rope::Rope;
pub use softcap::SoftCapping;
