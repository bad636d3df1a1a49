//! Loading named weights from a [`WeightSource`] onto a backend, checking
//! each tensor's shape against what the model expects.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kiln_formats::{FormatError, WeightSource};
use kiln_tensor::{Backend, BlockWeight, Tensor, Weight, WeightKind};

use crate::error::Result;

pub struct WeightLoader<'a> {
    pub backend: &'a Arc<dyn Backend>,
    pub source: &'a dyn WeightSource,
    progress: Progress<'a>,
    stored: RefCell<BTreeMap<String, u64>>,
}

/// Bytes the model's weight matrices (projections, embedding tables,
/// experts) take on their backend, by how they are stored: a block
/// format's name (`q4_k`, `q8_0`, `bf16` blocks, …) or the backend's
/// dense element type (`dense_bf16`, `dense_f32`). Norm weights and biases
/// are left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeightBytes(pub BTreeMap<String, u64>);

impl WeightBytes {
    pub fn total(&self) -> u64 {
        self.0.values().sum()
    }
}

/// Called with (bytes loaded, total bytes) after every tensor.
pub type LoadProgress<'a> = &'a (dyn Fn(u64, u64) + Sync);

/// Stored bytes loaded so far against the total.
struct Progress<'a> {
    total: u64,
    done: Cell<u64>,
    report: Option<LoadProgress<'a>>,
    /// Stored bytes of every tensor, by name.
    sizes: HashMap<String, u64>,
}

impl Progress<'_> {
    fn add(&self, bytes: u64) {
        let done = self.done.get() + bytes;
        self.done.set(done);
        if let Some(r) = self.report {
            r(done, self.total);
        }
    }
}

impl<'a> WeightLoader<'a> {
    pub fn new(backend: &'a Arc<dyn Backend>, source: &'a dyn WeightSource) -> Self {
        Self::with_progress(backend, source, None)
    }

    pub fn with_progress(
        backend: &'a Arc<dyn Backend>,
        source: &'a dyn WeightSource,
        report: Option<LoadProgress<'a>>,
    ) -> Self {
        let sizes: HashMap<String, u64> = source
            .tensors()
            .into_iter()
            .map(|t| (t.name, t.num_bytes))
            .collect();
        WeightLoader {
            backend,
            source,
            progress: Progress {
                total: sizes.values().sum(),
                done: Cell::new(0),
                report,
                sizes,
            },
            stored: RefCell::new(BTreeMap::new()),
        }
    }

    /// Counts `w` into [`Self::weight_bytes`] (the loader's own weights are
    /// counted as they load; a family that uploads a matrix itself calls
    /// this).
    pub fn note(&self, w: &Weight) {
        let mut stored = self.stored.borrow_mut();
        match w {
            Weight::Blocks(b) => {
                for part in b.parts() {
                    let name = part.format().name().to_lowercase();
                    *stored.entry(name).or_default() += part.num_bytes() as u64;
                }
            }
            Weight::Dense(t) => {
                let d = t.dtype();
                let name = format!("dense_{}", format!("{d:?}").to_lowercase());
                *stored.entry(name).or_default() += (t.num_elements() * d.size_in_bytes()) as u64;
            }
            _ => {}
        }
    }

    /// The weight matrices loaded so far, by storage.
    pub fn weight_bytes(&self) -> WeightBytes {
        WeightBytes(self.stored.borrow().clone())
    }

    /// `name` as raw bf16 when the backend stores bf16 and the file holds it.
    fn bf16(&self, name: &str) -> Result<Option<(Vec<usize>, Vec<u16>)>> {
        if self.backend.weight_bytes_per_element() != 2 {
            return Ok(None);
        }
        Ok(self.source.load_bf16(name)?)
    }

    fn count(&self, name: &str) {
        if let Some(&bytes) = self.progress.sizes.get(name) {
            self.progress.add(bytes);
        }
    }

    /// Load `name`, which must have `shape`.
    pub fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        if !self.source.contains(name) {
            return Err(FormatError::MissingTensor {
                path: self.source.path().to_path_buf(),
                tensor: name.to_string(),
            }
            .into());
        }
        self.count(name);
        if let Some((found, bits)) = self.bf16(name)? {
            if found != shape {
                return Err(FormatError::ShapeMismatch {
                    path: self.source.path().to_path_buf(),
                    tensor: name.to_string(),
                    found,
                    expected: shape.to_vec(),
                }
                .into());
            }
            return Ok(self.backend.upload_bf16(shape, &bits)?);
        }
        let host = self.source.load_f32(name)?;
        if host.shape != shape {
            return Err(FormatError::ShapeMismatch {
                path: self.source.path().to_path_buf(),
                tensor: name.to_string(),
                found: host.shape,
                expected: shape.to_vec(),
            }
            .into());
        }
        Ok(self.backend.upload(&host.shape, &host.data)?)
    }

    /// `name` as host f32 (shape-checked), for ops that keep their
    /// parameters on the host (extension ops such as LayerNorm).
    pub fn host(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let host = self.source.load_f32(name)?;
        if host.shape != shape {
            return Err(FormatError::ShapeMismatch {
                path: self.source.path().to_path_buf(),
                tensor: name.to_string(),
                found: host.shape,
                expected: shape.to_vec(),
            }
            .into());
        }
        self.count(name);
        Ok(host.data)
    }

    /// Load the tensors `names` (shapes `[rows_i, cols...]`, same trailing
    /// dims) stacked along their first dimension into one tensor: packed
    /// q/k/v and gate/up projections are one product each.
    pub fn stacked(&self, names: &[String], shapes: &[Vec<usize>]) -> Result<Tensor> {
        let mut data = Vec::new();
        let mut bits: Vec<u16> = Vec::new();
        let mut all_bf16 = true;
        let mut rows = 0;
        for (i, (name, shape)) in names.iter().zip(shapes).enumerate() {
            if !self.source.contains(name) {
                return Err(FormatError::MissingTensor {
                    path: self.source.path().to_path_buf(),
                    tensor: name.clone(),
                }
                .into());
            }
            self.count(name);
            let raw = if all_bf16 { self.bf16(name)? } else { None };
            // A part not stored as bf16 turns the whole stack to f32.
            if raw.is_none() && all_bf16 && i > 0 {
                data = bits
                    .iter()
                    .map(|&b| f32::from_bits((b as u32) << 16))
                    .collect();
                bits = Vec::new();
            }
            all_bf16 &= raw.is_some();
            let (found, part_bits, part_f32) = match raw {
                Some((s, b)) => (s, b, Vec::new()),
                None => {
                    let h = self.source.load_f32(name)?;
                    (h.shape, Vec::new(), h.data)
                }
            };
            if found != *shape || shape[1..] != shapes[0][1..] {
                return Err(FormatError::ShapeMismatch {
                    path: self.source.path().to_path_buf(),
                    tensor: name.clone(),
                    found,
                    expected: shape.clone(),
                }
                .into());
            }
            rows += shape[0];
            if all_bf16 {
                bits.extend_from_slice(&part_bits);
            } else {
                data.extend_from_slice(&part_f32);
            }
        }
        let mut shape = shapes[0].clone();
        shape[0] = rows;
        if all_bf16 {
            return Ok(self.backend.upload_bf16(&shape, &bits)?);
        }
        Ok(self.backend.upload(&shape, &data)?)
    }

    /// Load the projection weight `name`, which must have `shape`, in the
    /// form the backend multiplies by: the file's blocks where the file
    /// stores blocks the backend multiplies by (never expanded), else a
    /// dense tensor; a form the backend cannot multiply by fails here, at
    /// load.
    pub fn weight(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        let names = [name.to_string()];
        let w = match self.blocks(&names, &[shape.to_vec()])? {
            Some(w) => w,
            None => self.supported(Weight::Dense(self.tensor(name, shape)?))?,
        };
        self.note(&w);
        Ok(w)
    }

    /// The projection weights `names` stacked by rows, as [`Self::stacked`]:
    /// the parts' blocks as they are where every part is stored in blocks
    /// the backend takes (formats may differ by part), else one dense
    /// tensor.
    pub fn stacked_weight(&self, names: &[String], shapes: &[Vec<usize>]) -> Result<Weight> {
        let w = match self.blocks(names, shapes)? {
            Some(w) => w,
            None => self.supported(Weight::Dense(self.stacked(names, shapes)?))?,
        };
        self.note(&w);
        Ok(w)
    }

    /// An embedding table (also the tied output projection): a weight, so
    /// a block table stays in blocks and its rows are dequantized on
    /// lookup.
    pub fn embedding(&self, name: &str, shape: &[usize]) -> Result<Weight> {
        self.weight(name, shape)
    }

    /// Whether the source has a tensor `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.source.contains(name)
    }

    /// [`Self::weight`] if the source has `name`.
    pub fn optional_weight(&self, name: &str, shape: &[usize]) -> Result<Option<Weight>> {
        if self.source.contains(name) {
            self.weight(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// The tensors `names` as stored blocks stacked by rows, when each is
    /// stored in a block format the backend multiplies by; `None` (load
    /// them dense) otherwise.
    fn blocks(&self, names: &[String], shapes: &[Vec<usize>]) -> Result<Option<Weight>> {
        let mut mats = Vec::with_capacity(names.len());
        for (name, shape) in names.iter().zip(shapes) {
            let Some(m) = self.source.load_blocks(name)? else {
                return Ok(None);
            };
            if !self.backend.supports_weight(WeightKind::Blocks(m.format())) {
                return Ok(None);
            }
            let found = vec![m.rows(), m.cols()];
            if found != *shape || shape[1..] != shapes[0][1..] {
                return Err(FormatError::ShapeMismatch {
                    path: self.source.path().to_path_buf(),
                    tensor: name.clone(),
                    found,
                    expected: shape.clone(),
                }
                .into());
            }
            mats.push(m);
        }
        let mut parts = Vec::with_capacity(mats.len());
        for (name, m) in names.iter().zip(mats) {
            self.count(name);
            parts.push(self.backend.upload_blocks(m)?);
        }
        Ok(Some(Weight::Blocks(BlockWeight::new(parts)?)))
    }

    /// The 3-D tensor `name` (`[n, rows, cols]`: a stack of `n` matrices,
    /// as transformers holds a sparse layer's experts) as `n` dense
    /// weights, each `[rows, cols]`.
    pub fn stacked_slices(&self, name: &str, shape: [usize; 3]) -> Result<Vec<Weight>> {
        if !self.source.contains(name) {
            return Err(FormatError::MissingTensor {
                path: self.source.path().to_path_buf(),
                tensor: name.to_string(),
            }
            .into());
        }
        let [n, r, c] = shape;
        let mismatch = |found: Vec<usize>| FormatError::ShapeMismatch {
            path: self.source.path().to_path_buf(),
            tensor: name.to_string(),
            found,
            expected: shape.to_vec(),
        };
        let range = |e: usize| e * r * c..(e + 1) * r * c;
        if let Some((found, bits)) = self.bf16(name)? {
            if found != shape {
                return Err(mismatch(found).into());
            }
            return (0..n)
                .map(|e| {
                    let w = Weight::Dense(self.backend.upload_bf16(&[r, c], &bits[range(e)])?);
                    self.note(&w);
                    Ok(w)
                })
                .collect();
        }
        let host = self.source.load_f32(name)?;
        if host.shape != shape {
            return Err(mismatch(host.shape).into());
        }
        (0..n)
            .map(|e| {
                let w = Weight::Dense(self.backend.upload(&[r, c], &host.data[range(e)])?);
                self.note(&w);
                Ok(w)
            })
            .collect()
    }

    /// Marks `name` loaded for the progress report (a tensor read in parts).
    pub fn loaded(&self, name: &str) {
        self.count(name);
    }

    /// `w` if the backend's `matmul` takes its kind.
    pub fn supported(&self, w: Weight) -> Result<Weight> {
        if !self.backend.supports_weight(w.kind()) {
            return Err(
                kiln_tensor::weight::unsupported_weight(self.backend.name(), w.kind()).into(),
            );
        }
        Ok(w)
    }

    /// Load `name` if the source has it.
    pub fn optional(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.source.contains(name) {
            self.tensor(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }
}
