//! `kiln run NAME`: chat with a model by name, as Ollama users expect — a
//! path or a registered model is used as it is; an `ORG/NAME[:QUANT]` that
//! is not here yet is fetched from the hub first (`kiln get`), then
//! registered.

use anyhow::Result;
use clap::Args;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// A GGUF file, a model directory, a registered model's name, or
    /// ORG/NAME[@REVISION][:QUANT] on the Hugging Face hub.
    #[arg(value_name = "MODEL")]
    pub name: String,
    #[command(flatten)]
    pub chat: crate::chat::ChatArgs,
}

pub fn run(mut a: RunArgs) -> Result<()> {
    let path = match crate::registry::resolve_model(&a.name) {
        Ok(path) => path,
        Err(not_here) => {
            if !crate::get::is_hub_id(&a.name) {
                return Err(not_here);
            }
            eprintln!("kiln: {} is not here yet; fetching it", a.name);
            crate::get::fetch(&crate::get::GetArgs {
                model: a.name.clone(),
                include: Vec::new(),
                exclude: Vec::new(),
                jobs: 4,
            })?
        }
    };
    a.chat.model.model = Some(path.to_string_lossy().into_owned());
    crate::chat::run(a.chat)
}
