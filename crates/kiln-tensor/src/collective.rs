//! Collectives across the ranks of a tensor-parallel group: each rank is a
//! backend holding its shard of the weights, and the model's row-parallel
//! products end in [`Collectives::all_reduce_sum`], its vocabulary-parallel
//! output head in [`Collectives::all_gather_columns`].
//!
//! A backend in no group is rank 0 of 1, where both are the identity. The
//! CPU joins a [`HostGroup`]: its ranks are threads of one process that
//! exchange host buffers and sum them in rank order, so every rank gets the
//! same bits — the CPU twin of NCCL on GPUs, which CI runs.

use std::sync::{Arc, Condvar, Mutex};

use crate::backend::Memory;
use crate::error::{Result, TensorError};
use crate::tensor::Tensor;

/// A backend's collectives; the defaults are those of a group of one.
pub trait Collectives {
    /// This backend's (rank, world size); (0, 1) in no group.
    fn tp_rank(&self) -> (usize, usize) {
        (0, 1)
    }

    /// The element-wise sum of `x` over the group's ranks (every rank
    /// passes the same shape and gets the sum).
    fn all_reduce_sum(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }

    /// The ranks' `[rows, width]` tensors side by side: the first
    /// `keep[r]` columns of rank `r`'s, in rank order (every rank gets the
    /// whole).
    fn all_gather_columns(&self, x: &Tensor, keep: &[usize]) -> Result<Tensor> {
        let _ = keep;
        Ok(x.clone())
    }

    /// Makes every rank's pending and later collectives fail until
    /// [`Collectives::reset_collectives`] (a rank whose step failed calls
    /// it, so the others do not wait for it forever).
    fn abort_collectives(&self) {}

    /// Clears an abort; called between steps, when no rank is inside one.
    fn reset_collectives(&self) {}
}

/// A group of ranks in one process: each [`HostGroup::exchange`] waits for
/// every rank's buffer and hands each rank all of them.
#[derive(Debug)]
pub struct HostGroup {
    world: usize,
    state: Mutex<Exchange>,
    arrived: Condvar,
}

#[derive(Debug)]
struct Exchange {
    /// Completed exchanges so far.
    generation: u64,
    /// This exchange's buffers, by rank.
    slots: Vec<Option<Vec<f32>>>,
    /// The last completed exchange's buffers.
    last: Arc<Vec<Vec<f32>>>,
    aborted: bool,
}

impl HostGroup {
    pub fn new(world: usize) -> Arc<Self> {
        Arc::new(HostGroup {
            world: world.max(1),
            state: Mutex::new(Exchange {
                generation: 0,
                slots: vec![None; world.max(1)],
                last: Arc::new(Vec::new()),
                aborted: false,
            }),
            arrived: Condvar::new(),
        })
    }

    pub fn world(&self) -> usize {
        self.world
    }

    fn aborted() -> TensorError {
        TensorError::Device {
            backend: "collective",
            message: "another rank of the tensor-parallel group failed this step".into(),
        }
    }

    /// Deposits `data` as `rank`'s and returns every rank's, once all
    /// have arrived.
    pub fn exchange(&self, rank: usize, data: Vec<f32>) -> Result<Arc<Vec<Vec<f32>>>> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.aborted {
            return Err(Self::aborted());
        }
        if rank >= self.world || s.slots[rank].is_some() {
            return Err(TensorError::Device {
                backend: "collective",
                message: format!("rank {rank} of {} entered an exchange twice", self.world),
            });
        }
        s.slots[rank] = Some(data);
        if s.slots.iter().all(Option::is_some) {
            let all: Vec<Vec<f32>> = s
                .slots
                .iter_mut()
                .map(|d| d.take().unwrap_or_default())
                .collect();
            s.last = Arc::new(all);
            s.generation += 1;
            self.arrived.notify_all();
            return Ok(s.last.clone());
        }
        let generation = s.generation;
        while s.generation == generation && !s.aborted {
            s = self.arrived.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        if s.generation == generation {
            return Err(Self::aborted());
        }
        // No later exchange can have completed: it would need this rank.
        Ok(s.last.clone())
    }

    pub fn abort(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.aborted = true;
        self.arrived.notify_all();
    }

    pub fn reset(&self) {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.aborted = false;
        s.slots.iter_mut().for_each(|d| *d = None);
    }
}

/// A backend's place in a [`HostGroup`].
#[derive(Debug, Clone)]
pub struct HostRank {
    pub group: Arc<HostGroup>,
    pub rank: usize,
}

impl HostRank {
    /// [`Collectives::all_reduce_sum`] through host memory: summed in rank
    /// order, the same bits on every rank.
    pub fn all_reduce_sum<M: Memory + ?Sized>(&self, b: &M, x: &Tensor) -> Result<Tensor> {
        let all = self.group.exchange(self.rank, b.to_host(x)?)?;
        let n = all[0].len();
        if all.iter().any(|d| d.len() != n) {
            return Err(shape_error(
                "all_reduce_sum",
                "ranks passed different sizes",
            ));
        }
        let mut sum = all[0].clone();
        for d in &all[1..] {
            sum.iter_mut().zip(d).for_each(|(s, v)| *s += v);
        }
        b.upload(x.shape(), &sum)
    }

    /// [`Collectives::all_gather_columns`] through host memory.
    pub fn all_gather_columns<M: Memory + ?Sized>(
        &self,
        b: &M,
        x: &Tensor,
        keep: &[usize],
    ) -> Result<Tensor> {
        let (rows, width) = x.dims2("all_gather_columns")?;
        if keep.len() != self.group.world {
            return Err(shape_error("all_gather_columns", "one width a rank"));
        }
        let all = self.group.exchange(self.rank, b.to_host(x)?)?;
        let total: usize = keep.iter().sum();
        let mut out = Vec::with_capacity(rows * total);
        for r in 0..rows {
            for (d, &k) in all.iter().zip(keep) {
                let w = d.len() / rows.max(1);
                if k > w || d.len() != rows * w {
                    return Err(shape_error(
                        "all_gather_columns",
                        "a rank keeps more than it has",
                    ));
                }
                out.extend_from_slice(&d[r * w..r * w + k]);
            }
        }
        let _ = width;
        b.upload(&[rows, total], &out)
    }
}

fn shape_error(op: &'static str, detail: &str) -> TensorError {
    TensorError::Shape {
        op,
        detail: detail.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exchange_hands_every_rank_all_buffers_and_abort_releases_waiters() {
        let g = HostGroup::new(3);
        let out: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let g = &g;
                    s.spawn(move || {
                        (0..50)
                            .map(|i| g.exchange(r, vec![(r * 100 + i) as f32]).unwrap())
                            .map(|a| a.iter().map(|d| d[0]).collect::<Vec<_>>())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for rank in &out {
            for (i, got) in rank.iter().enumerate() {
                let want: Vec<f32> = (0..3).map(|r| (r * 100 + i) as f32).collect();
                assert_eq!(got, &want);
            }
        }
        // A rank left waiting is released by an abort, with an error.
        let g = HostGroup::new(2);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| g.exchange(0, vec![1.0]));
            std::thread::sleep(std::time::Duration::from_millis(20));
            g.abort();
            assert!(waiter.join().unwrap().is_err());
        });
        assert!(g.exchange(1, vec![1.0]).is_err());
        g.reset();
        std::thread::scope(|s| {
            let a = s.spawn(|| g.exchange(0, vec![1.0]).map(|a| a.len()));
            assert_eq!(g.exchange(1, vec![2.0]).unwrap().len(), 2);
            assert_eq!(a.join().unwrap().unwrap(), 2);
        });
    }
}
