//! `kiln-hub`: download model repositories from the Hugging Face hub into
//! the hub's standard cache (`models--ORG--NAME/{blobs,snapshots,refs}`),
//! laid out exactly as `huggingface_hub` lays it out, so either tool finds
//! what the other fetched.
//!
//! It speaks the hub's HTTP protocol (model info with `?blobs=true`, then
//! `resolve/{commit}/{path}` with redirects to the CDN) over `ureq` with
//! rustls, resumes partial downloads with `Range`, verifies every blob while
//! it streams (sha256 for LFS files, the git blob sha1 for the rest) and
//! checks free disk space first.
//!
//! It depends on no other Kiln crate, reads no environment variable and
//! prints nothing: the binary passes a [`HubConfig`] and renders
//! [`ProgressEvent`]s. Main entry points: [`RepoSpec::parse`], [`get`].

mod cache;
mod client;
mod disk;
mod download;
mod error;
mod filter;
mod info;
mod repo;
mod verify;

pub use cache::RepoCache;
pub use client::{HubClient, HubConfig, DEFAULT_ENDPOINT};
pub use download::{
    get, GetOptions, NoProgress, Progress, ProgressEvent, Snapshot, DEFAULT_RESERVE_BYTES,
};
pub use error::{ByteSize, HubError};
pub use filter::FileFilter;
pub use info::{Etag, RepoFile, RepoInfo};
pub use repo::{is_commit_hash, RepoSpec, DEFAULT_REVISION};
