//! `kiln embed`: sentence embeddings of texts given as arguments (or one a
//! line on stdin), printed one JSON array a line.

use std::io::{BufRead, Write};

use anyhow::{bail, Result};
use clap::Args;
use kiln_engine::Embedder;

use crate::cli::ModelArgs;

#[derive(Args, Debug)]
pub struct EmbedArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The model's task prompt to put before each text (`query`,
    /// `document`, ... as its `config_sentence_transformers.json` names them).
    #[arg(long)]
    pub prompt_name: Option<String>,
    /// Cut texts past the model's limit instead of refusing them.
    #[arg(long)]
    pub truncate: bool,
    /// Keep the first N values of each vector and renormalize (for models
    /// trained for it: Matryoshka).
    #[arg(long)]
    pub dimensions: Option<usize>,
    /// Each input is comma-separated token ids, embedded as given (no
    /// special tokens or prompt added), as /v1/embeddings takes them.
    #[arg(long)]
    pub ids: bool,
    /// Texts to embed; none: one a line from stdin.
    pub texts: Vec<String>,
}

pub fn run(a: EmbedArgs) -> Result<()> {
    let texts = if a.texts.is_empty() {
        std::io::stdin()
            .lock()
            .lines()
            .collect::<std::io::Result<Vec<_>>>()?
    } else {
        a.texts
    };
    let model = a.model.load()?;
    let e = Embedder::new(&model)?;
    if let Some(d) = a.dimensions {
        if d == 0 || d > e.head.dimension {
            bail!(
                "--dimensions {d}: this model gives vectors of 1 to {} values",
                e.head.dimension
            );
        }
    }
    let inputs = texts
        .iter()
        .map(|t| {
            if !a.ids {
                return Ok(e.tokenize(t, a.prompt_name.as_deref(), a.truncate)?);
            }
            let ids = t
                .split(',')
                .map(|v| v.trim().parse::<u32>())
                .collect::<std::result::Result<Vec<_>, _>>()
                .map_err(|err| {
                    anyhow::anyhow!("--ids: {t:?} is not comma-separated token ids ({err})")
                })?;
            Ok(e.input_ids(&ids, a.truncate)?)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut out = std::io::stdout().lock();
    // Passes of at most 64 inputs keep the step's memory bounded.
    for chunk in inputs.chunks(64) {
        for mut v in e.embed(chunk)? {
            if let Some(d) = a.dimensions {
                v.truncate(d);
                if e.head.normalize {
                    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
                    v.iter_mut().for_each(|x| *x /= n);
                }
            }
            writeln!(out, "{}", serde_json::to_string(&v)?)?;
        }
    }
    Ok(())
}
