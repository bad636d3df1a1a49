//! `kiln-registry`: what models are on this machine.
//!
//! [`scan`] walks the Hugging Face hub cache and local folders, reads each
//! model's headers and configs only (GGUF metadata and tensor table,
//! safetensors headers, `config.json`, the chat template; never tensor
//! bytes) and records one [`Entry`] per model in a SQLite [`Registry`].
//! [`resolve`] turns a user's query into one entry by the one matching
//! rule every command shares.
//!
//! It depends on `kiln-formats` (headers) and `kiln-models` (which family
//! serves a `model_type`), never on a backend or the engine; it reads no
//! environment variable and prints nothing: the binary passes paths.
//!
//! Main types: [`Registry`], [`Entry`], [`ModelInfo`], [`RegistryError`].

mod db;
mod error;
mod find;
mod inspect;
mod resolve;
mod scan;

pub use db::{Entry, Registry, Source};
pub use error::{RegistryError, Result};
pub use find::{find_in_hub_cache, find_local, Found};
pub use inspect::{hf_config, inspect, Capabilities, ModelFormat, ModelInfo};
pub use resolve::{collapse, filter, resolve};
pub use scan::{entry_for, scan, ScanReport, ScanSources};
