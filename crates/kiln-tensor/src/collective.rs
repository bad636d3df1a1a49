//! Collectives across the ranks of a tensor-parallel group: each rank is a
//! backend holding its shard of the weights, and the model's row-parallel
//! products end in [`Collectives::all_reduce_sum`], its vocabulary-parallel
//! output head in [`Collectives::all_gather_columns`].
//!
//! A backend in no group is rank 0 of 1, where both are the identity. The
//! CPU joins a [`HostGroup`]: its ranks are threads of one process that
//! exchange host buffers and sum them in rank order, so every rank gets the
//! same bits — the CPU twin of NCCL on GPUs, which CI runs.

use std::io::{Read, Write};
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

/// A group of ranks exchanging host buffers: each [`HostGroup::exchange`]
/// waits for every rank's buffer and hands each rank all of them. The
/// ranks are threads of one process, or (`HostGroup::tcp`) spread over
/// processes, each rank connected to a hub ([`serve_hub`]) that relays
/// every exchange.
#[derive(Debug)]
pub struct HostGroup {
    world: usize,
    inner: Inner,
}

#[derive(Debug)]
enum Inner {
    Local {
        state: Mutex<Exchange>,
        arrived: Condvar,
    },
    /// This process's ranks' connections to the hub, by rank.
    Tcp(std::collections::BTreeMap<usize, Mutex<Member>>),
}

#[derive(Debug)]
struct Member {
    stream: std::net::TcpStream,
    /// This step's exchanges already ended in an abort (so the rank does
    /// not send one of its own).
    aborted: bool,
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

/// A frame's length word that means "this rank aborts the step".
const ABORT: u32 = u32::MAX;

fn write_frame(w: &mut impl Write, data: Option<&[f32]>) -> std::io::Result<()> {
    match data {
        None => w.write_all(&ABORT.to_le_bytes()),
        Some(d) => {
            let mut bytes = Vec::with_capacity(4 + d.len() * 4);
            bytes.extend_from_slice(&(d.len() as u32).to_le_bytes());
            d.iter()
                .for_each(|x| bytes.extend_from_slice(&x.to_le_bytes()));
            w.write_all(&bytes)
        }
    }
}

fn read_frame(r: &mut impl Read) -> std::io::Result<Option<Vec<f32>>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len);
    if len == ABORT {
        return Ok(None);
    }
    let mut bytes = vec![0u8; len as usize * 4];
    r.read_exact(&mut bytes)?;
    Ok(Some(
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    ))
}

/// Relays the exchanges of `world` ranks connected to `listener` (each
/// opens with its rank, a little-endian `u32`): reads one frame from every
/// rank, in rank order, and sends every rank all of them (or, if any rank
/// aborted, an abort). Returns when a rank disconnects.
pub fn serve_hub(listener: std::net::TcpListener, world: usize) -> std::io::Result<()> {
    let mut ranks: Vec<Option<std::net::TcpStream>> = (0..world).map(|_| None).collect();
    while ranks.iter().any(Option::is_none) {
        let (mut s, _) = listener.accept()?;
        let mut r = [0u8; 4];
        s.read_exact(&mut r)?;
        let r = u32::from_le_bytes(r) as usize;
        if r >= world || ranks[r].is_some() {
            continue;
        }
        s.set_nodelay(true)?;
        ranks[r] = Some(s);
    }
    let mut ranks: Vec<std::net::TcpStream> = ranks.into_iter().flatten().collect();
    loop {
        let mut frames = Vec::with_capacity(world);
        for s in ranks.iter_mut() {
            frames.push(read_frame(s)?);
        }
        let aborted = frames.iter().any(Option::is_none);
        let mut out = Vec::new();
        for f in &frames {
            match (aborted, f) {
                (false, Some(d)) => write_frame(&mut out, Some(d))?,
                _ => write_frame(&mut out, None)?,
            }
        }
        for s in ranks.iter_mut() {
            s.write_all(&out)?;
        }
    }
}

impl HostGroup {
    pub fn new(world: usize) -> Arc<Self> {
        Arc::new(HostGroup {
            world: world.max(1),
            inner: Inner::Local {
                state: Mutex::new(Exchange {
                    generation: 0,
                    slots: vec![None; world.max(1)],
                    last: Arc::new(Vec::new()),
                    aborted: false,
                }),
                arrived: Condvar::new(),
            },
        })
    }

    /// This process's `ranks` of a group of `world` spread over processes,
    /// each connected to the hub at `hub`.
    pub fn tcp(
        world: usize,
        ranks: std::ops::Range<usize>,
        hub: std::net::SocketAddr,
    ) -> std::io::Result<Arc<Self>> {
        let mut members = std::collections::BTreeMap::new();
        for r in ranks {
            let mut s = connect_retrying(hub)?;
            s.set_nodelay(true)?;
            s.write_all(&(r as u32).to_le_bytes())?;
            members.insert(
                r,
                Mutex::new(Member {
                    stream: s,
                    aborted: false,
                }),
            );
        }
        Ok(Arc::new(HostGroup {
            world,
            inner: Inner::Tcp(members),
        }))
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
        let (state, arrived) = match &self.inner {
            Inner::Local { state, arrived } => (state, arrived),
            Inner::Tcp(members) => return self.exchange_tcp(members, rank, &data),
        };
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
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
            arrived.notify_all();
            return Ok(s.last.clone());
        }
        let generation = s.generation;
        while s.generation == generation && !s.aborted {
            s = arrived.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        if s.generation == generation {
            return Err(Self::aborted());
        }
        // No later exchange can have completed: it would need this rank.
        Ok(s.last.clone())
    }

    fn exchange_tcp(
        &self,
        members: &std::collections::BTreeMap<usize, Mutex<Member>>,
        rank: usize,
        data: &[f32],
    ) -> Result<Arc<Vec<Vec<f32>>>> {
        let io = |e: std::io::Error| TensorError::Device {
            backend: "collective",
            message: format!("rank {rank}'s connection to the group: {e}"),
        };
        let m = members.get(&rank).ok_or_else(|| TensorError::Device {
            backend: "collective",
            message: format!("rank {rank} is not in this process"),
        })?;
        let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
        if m.aborted {
            return Err(Self::aborted());
        }
        write_frame(&mut m.stream, Some(data)).map_err(io)?;
        let mut all = Vec::with_capacity(self.world);
        for _ in 0..self.world {
            match read_frame(&mut m.stream).map_err(io)? {
                Some(d) => all.push(d),
                None => {
                    // The rest of the reply is aborts too.
                    for _ in all.len() + 1..self.world {
                        let _ = read_frame(&mut m.stream);
                    }
                    m.aborted = true;
                    return Err(Self::aborted());
                }
            }
        }
        Ok(Arc::new(all))
    }

    /// `rank` gives up the step: every rank's pending and later exchanges
    /// fail until [`HostGroup::reset`].
    pub fn abort(&self, rank: usize) {
        match &self.inner {
            Inner::Local { state, arrived } => {
                let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
                s.aborted = true;
                arrived.notify_all();
            }
            Inner::Tcp(members) => {
                if let Some(m) = members.get(&rank) {
                    let mut m = m.lock().unwrap_or_else(|p| p.into_inner());
                    if !m.aborted {
                        // This rank's frame of the exchange the others wait
                        // in; then the relayed aborts.
                        let _ = write_frame(&mut m.stream, None);
                        for _ in 0..self.world {
                            let _ = read_frame(&mut m.stream);
                        }
                        m.aborted = true;
                    }
                }
            }
        }
    }

    pub fn reset(&self) {
        match &self.inner {
            Inner::Local { state, .. } => {
                let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
                s.aborted = false;
                s.slots.iter_mut().for_each(|d| *d = None);
            }
            Inner::Tcp(members) => {
                for m in members.values() {
                    m.lock().unwrap_or_else(|p| p.into_inner()).aborted = false;
                }
            }
        }
    }
}

/// Connects to `addr`, retrying for up to a minute while the other side
/// starts.
pub fn connect_retrying(addr: std::net::SocketAddr) -> std::io::Result<std::net::TcpStream> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => return Ok(s),
            Err(e) if std::time::Instant::now() > deadline => return Err(e),
            Err(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
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
            g.abort(1);
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

    /// Ranks in two "processes" (groups) through a hub on loopback: the
    /// same exchanges, and an abort by one rank fails the others' step and
    /// leaves the next one whole.
    #[test]
    fn tcp_groups_relay_exchanges_and_aborts() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || serve_hub(listener, 3));
        let (a, b) = std::thread::scope(|s| {
            let a = s.spawn(|| HostGroup::tcp(3, 0..2, addr).unwrap());
            let b = s.spawn(|| HostGroup::tcp(3, 2..3, addr).unwrap());
            (a.join().unwrap(), b.join().unwrap())
        });
        let groups = [(&a, 0), (&a, 1), (&b, 2)];
        let round = |abort: Option<usize>| -> Vec<Result<Vec<f32>>> {
            std::thread::scope(|s| {
                let hs: Vec<_> = groups
                    .iter()
                    .map(|&(g, r)| {
                        s.spawn(move || {
                            if abort == Some(r) {
                                g.abort(r);
                                return Err(HostGroup::aborted());
                            }
                            g.exchange(r, vec![r as f32, 10.0 * r as f32])
                                .map(|all| all.iter().flatten().copied().collect())
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        for got in round(None) {
            assert_eq!(got.unwrap(), vec![0.0, 0.0, 1.0, 10.0, 2.0, 20.0]);
        }
        assert!(round(Some(1)).iter().all(|r| r.is_err()));
        a.reset();
        b.reset();
        for got in round(None) {
            assert_eq!(got.unwrap(), vec![0.0, 0.0, 1.0, 10.0, 2.0, 20.0]);
        }
    }
}
