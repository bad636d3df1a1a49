//! The models `kiln serve` serves: the positional model, each `--model
//! [NAME=]MODEL`, and the `[[model]]` tables of `--models FILE.toml`, in
//! that order (the first is the default, loaded at start); and, on first
//! request, any model registered here (`kiln ls`) by its exact name.
//!
//! Each model is planned as `kiln fit` plans it, once, before the server
//! starts: its context, its KV pool and the bytes it holds loaded
//! (weights, KV pool, activations, fixed costs), which the pool counts
//! against its device's budget (`--memory-budget-mib`, else what the
//! device has free at start). With several models on one device, a model
//! that sets no KV budget is planned against an equal share of that budget.
//!
//! ```toml
//! memory_budget_mib = 8192   # optional, per device
//! idle_unload_secs = 300     # optional
//!
//! [[model]]
//! name = "smol"              # what requests call it (default: the file's stem)
//! path = "models/SmolLM2-135M-Instruct.Q4_1.gguf"   # or a registered model's name
//! device = "cpu"             # default: --device
//! context = 4096             # default: --context, else the plan's
//! kv_mib = 64                # default: --kv-mib, else the plan's
//! quantize = "q8_0"          # default: --quantize
//! pinned = true              # never unloaded for room or idleness
//! ```

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use kiln_engine::memory::ContextSource;
use kiln_engine::Engine;
use kiln_server::pool::{Catalog, ModelSource, PoolConfig};
use kiln_tensor::Backend;
use serde::Deserialize;

use crate::cli::ModelArgs;
use crate::serve::ServeArgs;

/// One model as configured.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    pub name: Option<String>,
    /// A GGUF file, a model directory, or a registered model's name.
    pub path: String,
    pub device: Option<String>,
    pub context: Option<usize>,
    pub kv_mib: Option<usize>,
    pub quantize: Option<String>,
    #[serde(default)]
    pub pinned: bool,
}

/// `--models FILE.toml`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolFile {
    memory_budget_mib: Option<u64>,
    idle_unload_secs: Option<u64>,
    #[serde(default)]
    model: Vec<ModelEntry>,
}

/// `--model [NAME=]MODEL`.
pub fn parse_model(s: &str) -> Result<ModelEntry, String> {
    let (name, path) = match s.split_once('=') {
        Some((n, p)) if !n.is_empty() && !p.is_empty() => (Some(n.to_string()), p),
        Some(_) => return Err(format!("{s:?}: give NAME=MODEL or MODEL")),
        None => (None, s),
    };
    Ok(ModelEntry {
        name,
        path: path.to_string(),
        ..ModelEntry::default()
    })
}

/// The configured models in order, and the pool's limits from the file.
fn entries(a: &ServeArgs) -> Result<(Vec<ModelEntry>, PoolFile)> {
    let mut out = Vec::new();
    if let Some(m) = &a.model {
        out.push(ModelEntry {
            name: a.served_model_name.clone(),
            path: m.clone(),
            ..ModelEntry::default()
        });
    }
    out.extend(a.models.iter().cloned());
    let mut file = PoolFile::default();
    if let Some(path) = &a.models_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--models {}", path.display()))?;
        file = toml::from_str(&text).with_context(|| format!("--models {}", path.display()))?;
        out.append(&mut file.model);
    }
    if out.is_empty() {
        // The default model (ModelArgs resolves it).
        out.push(ModelEntry {
            name: a.served_model_name.clone(),
            ..ModelEntry::default()
        });
    }
    if out.len() == 1 {
        // One model: served as before, never unloaded.
        out[0].pinned = true;
    }
    Ok((out, file))
}

/// What loading takes besides the model: the flags that apply to the
/// default model alone (speculation, LoRA adapters) and shared backends.
pub struct Loader {
    pub speculative: crate::cli::SpeculativeArgs,
    pub loras: crate::serve::Loras,
    pub memory_bytes: Option<u64>,
    pub isolation: crate::serve::Isolation,
    pub watchdog: Option<Duration>,
    backends: Mutex<HashMap<String, Arc<dyn Backend>>>,
}

impl Loader {
    pub fn new(
        speculative: crate::cli::SpeculativeArgs,
        loras: crate::serve::Loras,
        memory_bytes: Option<u64>,
        isolation: crate::serve::Isolation,
        watchdog: Option<Duration>,
    ) -> Self {
        Loader {
            speculative,
            loras,
            memory_bytes,
            isolation,
            watchdog,
            backends: Mutex::default(),
        }
    }

    /// Whether the default model serves LoRA adapters (which stay in the
    /// server's process).
    fn has_loras(&self) -> bool {
        !self.loras.startup.is_empty() || self.loras.max_bytes > 0
    }

    /// A backend for `device`: one a device, shared by the models that run
    /// in this process (`keep`); otherwise (planning a model whose engine
    /// runs in its own process) a passing one, so this process holds no
    /// device context it does not use.
    fn backend(&self, device: &str, keep: bool) -> Result<Arc<dyn Backend>> {
        let mut backends = self.backends.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = backends.get(device) {
            return Ok(b.clone());
        }
        let b = crate::cli::backend_for(device)?;
        if keep {
            backends.insert(device.to_string(), b.clone());
        }
        Ok(b)
    }

    /// Whether a model's engine runs in this process.
    fn in_process(&self, default_model: bool) -> bool {
        self.isolation == crate::serve::Isolation::Thread || (default_model && self.has_loras())
    }
}

/// The device key a backend's memory counts under.
fn device_key(device: &str, backend: &Arc<dyn Backend>) -> String {
    match (backend.device_memory(), device) {
        (None, _) => "cpu".into(),
        (Some(_), "cuda" | "auto") => "cuda:0".into(),
        (Some(_), d) => d.to_string(),
    }
}

/// Everything `kiln serve` needs to serve its models: the pool spec, the
/// default model's name and what to print of it.
pub fn spec(a: &ServeArgs, loader: Arc<Loader>) -> Result<(kiln_server::PoolSpec, String)> {
    let (entries, file) = entries(a)?;
    let budget_flag = a
        .memory_budget_mib
        .or(file.memory_budget_mib)
        .map(|m| m << 20);
    // Devices first: their budgets and how many models share each.
    let mut per_device: BTreeMap<String, (u64, usize)> = BTreeMap::new();
    let mut devices = Vec::new();
    for e in &entries {
        let device = e.device.clone().unwrap_or_else(|| a.device.clone());
        let backend = loader.backend(&device, false)?;
        let key = device_key(&device, &backend);
        let (_, available) = crate::fit::target_for(&device, Some(&backend), loader.memory_bytes)?;
        let slot = per_device
            .entry(key.clone())
            .or_insert((budget_flag.unwrap_or(available), 0));
        slot.1 += 1;
        devices.push((device, key));
    }
    let mut sources = Vec::new();
    let mut first_name = String::new();
    for (i, (e, (device, key))) in entries.iter().zip(devices).enumerate() {
        let (budget, sharing) = per_device[&key];
        let plan = Plan {
            entry: e.clone(),
            device,
            key,
            defaults: Defaults::of(a),
            budget: Some(budget),
            // Alone, a model may plan with all of it (as `kiln serve` with
            // one model always has).
            share: (entries.len() > 1).then(|| budget / sharing as u64),
            default_model: i == 0,
        };
        let source = plan.source(&loader)?;
        if i == 0 {
            first_name = source.name.clone();
        }
        sources.push(source);
    }
    let config = PoolConfig {
        budgets: per_device.into_iter().map(|(k, (b, _))| (k, b)).collect(),
        idle_unload: a
            .idle_unload_secs
            .or(file.idle_unload_secs)
            .filter(|&s| s > 0)
            .map(Duration::from_secs),
        wait: Duration::from_secs(a.load_wait_secs),
        ..PoolConfig::default()
    };
    let catalog = RegistryCatalog {
        loader,
        planned: Mutex::default(),
        defaults: Defaults::of(a),
        device: a.device.clone(),
        budgets: config.budgets.clone(),
        sharing: sources.len() + 1,
    };
    Ok((
        kiln_server::PoolSpec {
            sources,
            catalog: Some(Box::new(catalog)),
            config,
        },
        first_name,
    ))
}

/// The server-wide flags a model's entry falls back on.
#[derive(Clone)]
struct Defaults {
    context: Option<usize>,
    kv_mib: Option<usize>,
    quantize: Option<kiln_quant::QuantFormat>,
    tensor_parallel: u32,
    expert_parallel: bool,
    nodes: crate::nodes::NodeArgs,
}

impl Defaults {
    fn of(a: &ServeArgs) -> Self {
        Defaults {
            context: a.context,
            kv_mib: a.kv_mib,
            quantize: a.quantize,
            tensor_parallel: a.tensor_parallel,
            expert_parallel: a.expert_parallel,
            nodes: a.nodes.clone(),
        }
    }
}

/// One model's plan, before its source exists.
struct Plan {
    entry: ModelEntry,
    device: String,
    key: String,
    defaults: Defaults,
    /// The device's budget (`None`: what it has free).
    budget: Option<u64>,
    /// Its share of the budget when several models share the device.
    share: Option<u64>,
    /// Speculation and LoRA flags apply to it.
    default_model: bool,
}

impl Plan {
    /// Resolves the model, checks that one sequence of its context fits,
    /// and makes its source.
    fn source(self, loader: &Arc<Loader>) -> Result<ModelSource<Engine>> {
        let e = &self.entry;
        let quantize = match &e.quantize {
            Some(q) => Some(crate::quantize::parse_quant_type(q).map_err(anyhow::Error::msg)?),
            None => self.defaults.quantize,
        };
        let mut model_args = ModelArgs {
            model: (!e.path.is_empty()).then(|| e.path.clone()),
            device: self.device.clone(),
            quantize,
            tensor_parallel: self.defaults.tensor_parallel,
            tp_transport: Default::default(),
            expert_parallel: self.defaults.expert_parallel,
            nodes: self.defaults.nodes.clone(),
        };
        let path = model_args.path()?;
        model_args.model = Some(path.to_string_lossy().into_owned());
        let in_process = loader.in_process(self.default_model);
        let backend = loader.backend(&self.device, in_process)?;
        let (target, measured) =
            crate::fit::target_for(&self.device, Some(&backend), loader.memory_bytes)?;
        let kv_mib = e.kv_mib.or(self.defaults.kv_mib);
        let adapter_bytes = match self.default_model {
            true => loader.loras.max_bytes,
            false => 0,
        };
        let budget = self.budget.unwrap_or(measured);
        let mut query = crate::fit::FitQuery {
            target,
            // Sharing a device, a model with no KV budget sizes its pool
            // from its share of the budget.
            available_bytes: match kv_mib {
                None => self.share.unwrap_or(budget),
                Some(_) => budget,
            },
            context: e.context.or(self.defaults.context),
            batch: 1,
            kv_pool_bytes: kv_mib.map(|m| (m as u64) << 20),
            quantize,
            adapter_bytes,
            tensor_parallel: self.defaults.tensor_parallel as usize,
        };
        let mut fit = crate::fit::check(&path, &query)?;
        if !fit.fits && query.available_bytes < budget {
            // Larger than its share: it must fit the whole budget, with a
            // pool of one sequence.
            query.available_bytes = budget;
            query.kv_pool_bytes = Some(fit.kv_bytes);
            query.context = Some(fit.context);
            fit = crate::fit::check(&path, &query)?;
        }
        if !fit.fits {
            anyhow::bail!(
                "{} does not fit one sequence of {} tokens:\n{fit}use --context, a smaller model or quantization, or another device",
                path.display(),
                fit.context
            );
        }
        let name = e.name.clone().unwrap_or_else(|| stem(&path));
        // Alone on a device with no KV budget set, the engine sizes its
        // pool from what is free once the weights are there (as before);
        // otherwise it takes the plan's.
        let kv_bytes = match (kv_mib, target.on_device, self.share) {
            (Some(m), _, _) => Some(m << 20),
            (None, true, None) => None,
            _ => Some(fit.kv_pool_bytes as usize),
        };
        let memory_bytes = fit.weights_bytes
            + fit.overheads.iter().map(|o| o.1).sum::<u64>()
            + fit.kv_pool_bytes
            + fit.activation_bytes;
        let context = fit.context;
        let context_note = match fit.context_source {
            ContextSource::Requested => "--context".to_string(),
            ContextSource::Trained => "the model's trained length".to_string(),
            ContextSource::Memory => format!(
                "the longest the KV pool holds; trained {}",
                fit.trained_context
            ),
        };
        eprintln!(
            "kiln serve: context {context} tokens ({context_note}) for `{name}` ({}); {} MiB planned on {}",
            path.display(),
            memory_bytes >> 20,
            self.key
        );
        let (loader, load_path, default_model) = (loader.clone(), path.clone(), self.default_model);
        let load_name = name.clone();
        // Only an engine in this process loads onto this process's backend.
        let backend = in_process.then_some(backend);
        Ok(ModelSource {
            name,
            device: self.key,
            memory_bytes,
            pinned: e.pinned,
            path,
            load: Arc::new(move || {
                let speculative = default_model.then_some(&loader.speculative);
                let loaded = if let Some(backend) = &backend {
                    crate::serve::load_engine(
                        &model_args,
                        &load_path,
                        backend.clone(),
                        kv_bytes,
                        context,
                        default_model.then_some(&loader.loras),
                        speculative,
                    )
                    .map(|(engine, note)| {
                        eprintln!("kiln serve: `{load_name}`: {note}");
                        engine
                    })
                } else {
                    crate::engine_worker::command(
                        &load_name,
                        &load_path,
                        &model_args,
                        context,
                        kv_bytes,
                        speculative,
                    )
                    .and_then(|mut cmd| {
                        cmd.watchdog = loader.watchdog;
                        Ok(Engine::start_process(&load_path, cmd)?)
                    })
                    .map(|engine| {
                        eprintln!("kiln serve: `{load_name}` runs in its own process");
                        engine
                    })
                };
                loaded.map_err(|e| format!("{e:#}"))
            }),
        })
    }
}

fn stem(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "kiln".into())
}

/// The models registered here (`kiln ls`), loadable by their exact name
/// with the server's flags (each planned once, when first asked for).
struct RegistryCatalog {
    loader: Arc<Loader>,
    planned: Mutex<HashMap<String, Result<ModelSource<Engine>, String>>>,
    defaults: Defaults,
    device: String,
    budgets: BTreeMap<String, u64>,
    /// Models a device's budget is planned as shared between.
    sharing: usize,
}

impl RegistryCatalog {
    fn registered() -> Vec<(String, PathBuf)> {
        let Ok(reg) = crate::registry::open() else {
            return Vec::new();
        };
        reg.entries()
            .map(|es| {
                es.into_iter()
                    .filter(|e| e.info.as_ref().is_some_and(|i| i.family.is_some()))
                    .map(|e| (e.found.name, e.found.path))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Catalog<Engine> for RegistryCatalog {
    fn find(&self, name: &str) -> Option<Result<ModelSource<Engine>, String>> {
        let mut planned = self.planned.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(found) = planned.get(name) {
            return Some(found.clone());
        }
        let found = self.plan(name)?;
        planned.insert(name.to_string(), found.clone());
        Some(found)
    }

    fn names(&self) -> Vec<String> {
        Self::registered().into_iter().map(|(n, _)| n).collect()
    }
}

impl RegistryCatalog {
    fn plan(&self, name: &str) -> Option<Result<ModelSource<Engine>, String>> {
        let (_, path) = Self::registered().into_iter().find(|(n, _)| n == name)?;
        let backend = self.loader.backend(&self.device, false);
        let key = match &backend {
            Ok(b) => device_key(&self.device, b),
            Err(e) => return Some(Err(format!("{e:#}"))),
        };
        let plan = Plan {
            entry: ModelEntry {
                name: Some(name.to_string()),
                path: path.to_string_lossy().into_owned(),
                ..ModelEntry::default()
            },
            device: self.device.clone(),
            budget: self.budgets.get(&key).copied(),
            share: self.budgets.get(&key).map(|b| b / self.sharing as u64),
            key,
            defaults: self.defaults.clone(),
            default_model: false,
        };
        Some(plan.source(&self.loader).map_err(|e| format!("{e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_flags_parse() {
        let e = parse_model("coder=models/q.gguf").unwrap();
        assert_eq!(
            (e.name.as_deref(), e.path.as_str()),
            (Some("coder"), "models/q.gguf")
        );
        let e = parse_model("models/q.gguf").unwrap();
        assert_eq!((e.name, e.path.as_str()), (None, "models/q.gguf"));
        assert!(parse_model("=x").is_err() && parse_model("x=").is_err());
    }

    #[test]
    fn the_readme_pool_file_parses() {
        let readme = include_str!("../../../README.md");
        let start = readme
            .find("```toml\n")
            .expect("a TOML example in the README")
            + 8;
        let end = start + readme[start..].find("```").unwrap();
        let file: PoolFile = toml::from_str(&readme[start..end]).unwrap();
        assert_eq!(
            (file.memory_budget_mib, file.idle_unload_secs),
            (Some(4096), Some(600))
        );
        assert_eq!(file.model.len(), 2);
        assert!(file.model[0].pinned && !file.model[1].pinned);
        assert_eq!(file.model[1].context, Some(8192));
        // A misspelt key is an error, not a silent default.
        assert!(toml::from_str::<PoolFile>("[[model]]\npath = \"x\"\npined = true\n").is_err());
    }
}
