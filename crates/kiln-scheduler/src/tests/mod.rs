//! The crate's scenario tests: data-driven traces through one `check` helper,
//! property tests over random sessions, and a simulated model that checks every KV
//! slot a step reads. Unit tests of single types live at the bottom of their files.

mod harness;
mod model;
mod properties;
mod rng;
mod traces;
