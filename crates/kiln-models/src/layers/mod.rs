//! Shared layers every model family is built from. Each takes the backend
//! as `&dyn Backend` and never names a concrete one.

mod attention;
mod linear;
mod loader;
mod mlp;
mod norm;
mod rope;

pub use attention::{Attention, AttentionConfig};
pub use linear::{Fuse, Linear};
pub use loader::{LoadProgress, WeightLoader};
pub use mlp::GatedMlp;
pub use norm::RmsNorm;
pub use rope::Rope;
