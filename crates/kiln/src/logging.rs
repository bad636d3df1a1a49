//! Where the server's `tracing` events go: stderr, one line each with a
//! UTC timestamp, as text (coloured on a terminal) or as JSON objects.

use std::io::IsTerminal;

use clap::ValueEnum;
use tracing_subscriber::fmt::format::FmtSpan;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// `2026-12-01T15:46:36.123456Z  INFO kiln::access: request method=POST ...`
    Text,
    /// One JSON object a line: `timestamp`, `level`, `target`, `fields`.
    Json,
}

/// Installs the process's subscriber (info and above, to stderr). A second
/// call does nothing.
pub fn init(format: LogFormat) {
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing::Level::INFO)
        .with_span_events(FmtSpan::NONE);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder.json().with_ansi(false).try_init(),
    };
}
